"""The host's head start of GPU slices (prismllm.comm.headstart), on the GPU(s). A program whose
host stalls at the start of each iteration, right after it waited for its device
(tests/programs/host_stalls.py), is host-bound there in its real run too: the default head start
("overhead": the emulation layer's own host time, a fraction of a millisecond here) keeps the
stall in the slice, as the host's own pace ("off") does; "iteration" gives the host about one
iteration (more than the stall), and the slice times the device's work alone, as the program
without the stall does. Run on the device machine: ``pytest -m gpu tests/test_headstart_gpu.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from conftest import PRISM  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROGRAM = str(Path(__file__).parent / "programs" / "host_stalls.py")
ARGS = ["--n", "4096", "--matmuls", "48", "--iters", "8"]  # ~10 ms of matmuls an iteration on an H100
# a slice's sandbox rank and its assistant: a GPU each, or one shared
DEVICES = "cuda:0,1" if torch.cuda.is_available() and torch.cuda.device_count() >= 2 else "cuda:0,0"
STALL_MS = 6  # shorter than an iteration's device work: a head start of one iteration covers it


def prism(*args: str, stall_ms: float = 0) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
           "NVSHMEM_DISABLE_NVLS": "1", "HOST_STALL_MS": str(stall_ms)}  # fmt: skip
    proc = subprocess.run([PRISM, *args], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, f"prism {args[0]} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def slice_ms(tmp: Path, bare: Path, head_start: str, stall_ms: float) -> tuple[float, dict]:
    """The slice's median steady iteration (its timed graph solved) and its head starts."""
    out = tmp / f"{head_start}-{stall_ms}"
    prism("time", "--graph", str(bare), "--out", str(out), "--devices", DEVICES, "--head-start", head_start,
          "--", PROGRAM, *ARGS, stall_ms=stall_ms)  # fmt: skip
    prism("calibrate", str(out / "graph"), "--out", str(out / "cal"))
    summary = json.loads((out / "cal" / "summary.json").read_text())
    manifest = json.loads((out / "graph" / "manifest.json").read_text())
    return summary["predicted_iteration_ns"] / 1e6, manifest["timing"]["head_start"]


def test_the_head_start_keeps_the_programs_own_host_pace_or_times_the_device_alone(tmp_path):
    bare = tmp_path / "bare"
    prism("capture", "--mode", "solo", "--world", "2", "--devices", "cuda:0", "--parallel", "1", "--out", str(bare),
          "--", PROGRAM, *ARGS)  # fmt: skip
    device_ms, _ = slice_ms(tmp_path, bare, "iteration", 0)
    alone_ms, alone = slice_ms(tmp_path, bare, "iteration", STALL_MS)
    own_ms, own = slice_ms(tmp_path, bare, "overhead", STALL_MS)
    off_ms, off = slice_ms(tmp_path, bare, "off", STALL_MS)
    figures = {"device": device_ms, "iteration": alone_ms, "overhead": own_ms, "off": off_ms}
    assert off == {} and all(h["sleeps"] >= 5 for h in [*alone.values(), *own.values()]), (alone, own)
    assert abs(alone_ms - device_ms) < 0.05 * device_ms, figures
    assert off_ms > device_ms + 0.6 * STALL_MS, figures
    assert own_ms > device_ms + 0.6 * STALL_MS, figures
