"""torchtitan 0.3.0 through prism on CPU processes (``--cuda-on-cpu``; docs/stacks/torchtitan.md):
its own trainer (examples/torchtitan/train.py, Llama 3 debugmodel) at FSDP2·TP2 on 4 ranks,
recorded for real, captured solo (the same structure), and emulated with the last rank real:
its losses and gradient norms (TensorBoard, full precision) are the real run's, bit for bit."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import PRISM

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "torchtitan"

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torchtitan") is None,
    reason="torchtitan is not installed (make test-env installs it; docs/stacks/torchtitan.md)",
)


def run(*cmd: str) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    p = subprocess.run(list(cmd), capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert p.returncode == 0, f"{' '.join(cmd[:2])}:\n{p.stdout[-3000:]}{p.stderr[-3000:]}"
    return p.stdout + p.stderr  # the program's lines, then prism's own


def test_fsdp2_tp2_record_solo_emulate(tmp_path):
    assets = tmp_path / "assets"
    run(sys.executable, str(EXAMPLE / "make_assets.py"), str(assets))
    args = ["--module", "prism_configs", "--config", "llama3_debugmodel_cpu",
            "--parallelism.data-parallel-shard-degree", "2", "--parallelism.tensor-parallel-degree", "2",
            "--hf-assets-path", str(assets / "tokenizer"), "--dataloader.dataset-path", str(assets / "c4_test")]  # fmt: skip
    train = str(EXAMPLE / "train.py")
    real, solo, emu = tmp_path / "real", tmp_path / "solo", tmp_path / "emu"
    run(PRISM, "record", "--nproc", "4", "--devices", "cpu", "--cuda-on-cpu", "--out", str(real),
        "--save-tensors", "all,inputs", "--timeout", "500", "--", train, *args, "--dump-folder", f"{real}-dump")  # fmt: skip
    run(PRISM, "capture", "--mode", "solo", "--world", "4", "--parallel", "2", "--devices", "cpu", "--cuda-on-cpu",
        "--out", str(solo), "--timeout", "500", "--", train, *args, "--dump-folder", f"{solo}-dump")  # fmt: skip
    assert "structure: equal" in run(PRISM, "compare", str(real), str(solo))
    emulated = run(PRISM, "emulate", "--graph", str(real), "--sandbox", "3", "--out", str(emu), "--check",
                   "--timeout", "500", "--", train, *args, "--dump-folder", f"{emu}-dump")  # fmt: skip
    assert "max abs diff 0," in emulated
    losses = [
        [line for line in run(sys.executable, str(EXAMPLE / "losses.py"), f"{d}-dump", "3").splitlines()
         if line.startswith("rank 3: loss ['")]
        for d in (real, emu)
    ]  # fmt: skip
    assert len(losses[0]) == 1 and losses[0] == losses[1]
