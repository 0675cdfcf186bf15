"""Megatron-core through prism on CPU processes (``--cuda-on-cpu``; docs/stacks/megatron.md):
examples/megatron_gpt.py at TP2·PP2 on 4 ranks, recorded for real, captured solo (the same
structure), and emulated with the last rank real: its printed losses and gradient norms are the
real run's, digit for digit."""

from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path

import pytest
from conftest import PRISM

ROOT = Path(__file__).resolve().parents[1]
PROGRAM = [str(ROOT / "examples" / "megatron_gpt.py"), "--tp", "2", "--pp", "2", "--iters", "3"]

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None,
    reason="megatron-core is not installed (pip install 'prismllm[megatron]'; make test-env installs it)",
)


def prism(*args: str) -> str:
    """The command's output: the program's lines (stdout), then prism's own (stderr)."""
    p = subprocess.run([PRISM, *args], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert p.returncode == 0, f"prism {args[0]}:\n{p.stdout[-3000:]}{p.stderr[-3000:]}"
    return p.stdout + p.stderr


def losses(output: str) -> list[str]:
    """``lm loss: ... | grad norm: ...`` of every iteration the last rank printed."""
    return re.findall(r"lm loss: (\S+) \| grad norm: (\S+)", output)


def test_tp2_pp2_record_solo_emulate(tmp_path):
    real, solo = tmp_path / "real", tmp_path / "solo"
    recorded = prism("record", "--nproc", "4", "--devices", "cpu", "--cuda-on-cpu", "--out", str(real),
                     "--save-tensors", "all,inputs", "--timeout", "500", "--", *PROGRAM)  # fmt: skip
    assert len(losses(recorded)) == 3, recorded[-2000:]
    prism("capture", "--mode", "solo", "--world", "4", "--parallel", "2", "--devices", "cpu", "--cuda-on-cpu",
          "--out", str(solo), "--timeout", "500", "--", *PROGRAM)  # fmt: skip
    assert "structure: equal" in prism("compare", str(real), str(solo))
    # switch mode, two ranks at a time: the real values, so the real run's losses too
    switch = tmp_path / "switch"
    prism("capture", "--mode", "switch", "--world", "4", "--parallel", "2", "--devices", "cpu", "--cuda-on-cpu",
          "--out", str(switch), "--tee", "--timeout", "500", "--", *PROGRAM)  # fmt: skip
    assert "structure: equal" in prism("compare", str(real), str(switch))
    logged = "".join(f.read_text() for f in sorted((switch / "logs").glob("*.log")))
    assert losses(logged) == losses(recorded)
    emulated = prism("emulate", "--graph", str(real), "--sandbox", "3", "--out", str(tmp_path / "emu"), "--check",
                     "--timeout", "500", "--", *PROGRAM)  # fmt: skip
    assert losses(emulated) == losses(recorded)
    assert "max abs diff 0," in emulated
