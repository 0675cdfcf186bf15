"""The emulation on GPUs (NCCL), N = 2: the real 2-rank run of examples/gpt3d.py recorded with
its tensors, then one sandbox rank run for real with the other rank played by an assistant.
Run on the device machine: ``pytest -m gpu tests/test_emulate_gpu.py``.

With two GPUs the sandbox rank and the assistant each have one, as in use. With one GPU both
real ranks, and then the sandbox rank and the assistant, share it, each NCCL's own host
(``--devices cuda:0,0``): NCCL connects them through sockets, which changes the timing but not
the values, so the correctness checks are the same: the sandbox's losses and every pruned
collective's output equal the real run's (k = 1 real member of n = 2: a sum of two terms is
bit-exact in either order). Then the whole pipeline (solo capture, slice timing, calibration,
real-time emulation) runs on the GPU(s) and must finish with the recorded numbers.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from conftest import PRISM
from test_emulate import GPT3D, LAYOUTS, SIZES, assert_all_ended, assert_check, assert_same_losses  # noqa: E402

from prismllm.emulate import EmulateOptions, emulate  # noqa: E402
from prismllm.outputs import RANKLOGS_DIR  # noqa: E402
from prismllm.trace.ranklog import ranklog_path, read_ranklog  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "1",
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def two_gpus() -> bool:
    return torch.cuda.device_count() >= 2


# the real run's GPUs and the emulation's (sandbox rank, then assistant)
REAL_DEVICES = "cuda:0,1" if two_gpus() else "cuda:0,0"
EMU_DEVICES = "cuda" if two_gpus() else "cuda:0,0"


def prism(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run([PRISM, *args], capture_output=True, text=True, env=ENV, timeout=timeout)
    assert proc.returncode == 0, f"prism {args[0]} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def record(out: Path, layout: str) -> tuple[Path, list[dict]]:
    log = out.with_suffix(".json")
    prism(
        "record",
        "--nproc",
        "2",
        "--devices",
        REAL_DEVICES,
        "--out",
        str(out),
        "--save-tensors",
        "all,inputs",
        "--timeout",
        "200",
        "--",
        GPT3D,
        *LAYOUTS[layout],
        *SIZES,
        "--json-log",
        str(log),
    )
    return out, json.loads(log.read_text())


def run_emulation(graph: Path, out: Path, layout: str, sandbox: str, check: bool = True):
    log = out.with_suffix(".json")
    res = emulate(
        EmulateOptions(
            graph=graph,
            sandbox=sandbox,
            out=out,
            script=GPT3D,
            devices=EMU_DEVICES,
            args=[*LAYOUTS[layout], *SIZES, "--json-log", str(log)],
            timeout=200,
            check=check,
            sink=lambda *a: None,
        )
    )
    assert_all_ended(res.launch.pids.values())
    assert res.shared_gpu == (not two_gpus())
    return res, (json.loads(log.read_text()) if log.exists() else None)


@pytest.mark.parametrize("layout", ["tp2", "pp2", "dp2_distopt"])
def test_losses_and_pruned_outputs_equal_the_real_run(layout, tmp_path):
    graph, real = record(tmp_path / "real", layout)
    manifest = json.loads((graph / "manifest.json").read_text())
    assert manifest["device"] == "cuda", manifest["device"]
    res, emu = run_emulation(graph, tmp_path / "emu1", layout, "1")
    assert emu is not None, "the sandbox (last rank) writes the loss log"
    assert_same_losses(real, emu)
    assert_check(res, 1, graph)
    assert_same_peak(res, 1, manifest)
    if layout == "dp2_distopt":  # one virtual member: reduce-scatter and all-gather on the program's tensors
        assert res.sandbox_results[1]["emulation_scratch_bytes"] == 0, res.sandbox_results
    res, _ = run_emulation(graph, tmp_path / "emu0", layout, "0")
    assert_check(res, 0, graph)
    assert_same_peak(res, 0, manifest)


@pytest.mark.parametrize("layout", ["tp2", "pp2", "dp2_distopt"])
def test_the_native_lane_keeps_losses_and_peak_memory(layout, tmp_path, monkeypatch):
    """PRISM_NATIVE_LANE=1 on NCCL: the pruned calls after the first of each signature go through
    the lane's templates (NCCL's pre-multiplied sum, the padding in the same batch), the pipeline's
    sends and receives through the Python backend in one NCCL group a batch; the losses and the
    peak memory are the real run's (no output check: it runs the Python path)."""
    graph, real = record(tmp_path / "real", layout)
    manifest = json.loads((graph / "manifest.json").read_text())
    monkeypatch.setenv("PRISM_NATIVE_LANE", "1")
    res, emu = run_emulation(graph, tmp_path / "emu1", layout, "1", check=False)
    assert_same_losses(real, emu)
    assert_same_peak(res, 1, manifest)
    lane = res.sandbox_results[1]["emulation_native_lane"]
    assert lane["fast"] > 0, lane
    # device time at the iteration boundaries only: no timing event on the program's stream a call
    assert res.sandbox_results[1]["compute_ns"] is None and res.sandbox_results[1]["iteration_ns"]


def test_device_points_time_the_sandbox_spans_on_the_device(tmp_path, monkeypatch):
    """PRISM_DEVICE_POINTS=1: the emulated sandbox's rank log has every span on the device (clock
    ``cuda``), so its compute per iteration is reported, below its iteration time."""
    graph, real = record(tmp_path / "real", "pp2")
    monkeypatch.setenv("PRISM_DEVICE_POINTS", "1")
    res, emu = run_emulation(graph, tmp_path / "emu1", "pp2", "1", check=False)
    assert_same_losses(real, emu)
    m = res.sandbox_results[1]
    assert m["compute_ns"] and all(0 < c <= t for c, t in zip(m["compute_ns"], m["iteration_ns"])), m
    assert read_ranklog(ranklog_path(tmp_path / "emu1" / RANKLOGS_DIR, 1)).clock == "cuda"


def assert_same_peak(res, rank: int, manifest: dict) -> None:
    """The sandbox rank's peak memory (torch.cuda.max_memory_allocated) is the real rank's to
    the byte: the pruned calls' scratch is taken outside the program's allocator and reported
    apart (docs/internals/pruning.md, "Scratch memory")."""
    m = res.sandbox_results[rank]
    real = int(manifest["peak_memory_bytes"][str(rank)])
    assert real > 0 and m["peak_memory_bytes"] == real, (
        f"rank {rank}: emulated peak {m['peak_memory_bytes']:,} B, real {real:,} B "
        f"({m['peak_memory_bytes'] - real:+,} B); scratch outside it {m.get('emulation_scratch_bytes'):,} B"
    )


def test_device_arena_is_outside_the_allocator():
    """Scratch from the arena: usable device memory that PyTorch's allocator statistics do not
    see, reused once given back, zero-filled on request."""
    from prismllm.comm.scratch import DeviceArena

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    before = torch.cuda.memory_allocated(dev), torch.cuda.max_memory_allocated(dev)
    arena = DeviceArena(dev)
    a = arena.take(16 << 20, torch.float32)  # 64 MiB
    a.fill_(3.0)
    b = arena.take(1 << 20, torch.float32, zero=True)
    # (checked before any reduction below, which takes its own small buffer from the allocator)
    assert (torch.cuda.memory_allocated(dev), torch.cuda.max_memory_allocated(dev)) == before
    assert arena.reserved_bytes == (64 << 20) + (4 << 20)
    assert a.device == dev and float(a.sum()) == 3.0 * (16 << 20)
    assert int(torch.count_nonzero(b)) == 0
    ptr = a.data_ptr()
    arena.give_back([a])
    c = arena.take(1 << 20, torch.bfloat16, zero=True)  # fits the freed 64 MiB segment: reused
    assert c.data_ptr() == ptr and arena.reserved_bytes == (64 << 20) + (4 << 20)
    assert int(torch.count_nonzero(c)) == 0
    d = arena.take(1 << 20, torch.float32)  # both segments busy: a third
    assert d.data_ptr() not in (ptr, b.data_ptr()) and arena.reserved_bytes == (64 << 20) + (8 << 20)


def test_whole_pipeline_on_gpu(tmp_path):
    """capture (solo) -> time -> calibrate -> emulate --timing real, TP2: every stage on the
    GPU(s); the emulated sandbox measures iterations beside the calibrated prediction."""
    args = [*LAYOUTS["tp2"], *SIZES]
    prism(
        "capture",
        "--mode",
        "solo",
        "--world",
        "2",
        "--devices",
        "cuda",
        "--parallel",
        "1",
        "--layout",
        "tp=2",
        "--out",
        str(tmp_path / "bare"),
        "--",
        GPT3D,
        *args,
    )
    prism(
        "time",
        "--graph",
        str(tmp_path / "bare"),
        "--out",
        str(tmp_path / "time"),
        "--devices",
        EMU_DEVICES,
        "--inputs",
        "generated",
        "--timeout",
        "200",
        "--",
        GPT3D,
        *args,
    )
    prism("calibrate", str(tmp_path / "time" / "graph"), "--out", str(tmp_path / "cal"), "--write-graph")
    out = tmp_path / "emu"
    prism(
        "emulate",
        "--graph",
        str(tmp_path / "cal" / "graph"),
        "--sandbox",
        "1",
        "--devices",
        EMU_DEVICES,
        "--inputs",
        "generated",
        "--timeout",
        "200",
        "--out",
        str(out),
        "--",
        GPT3D,
        *args,
    )
    rec = json.loads((out / "emulate.json").read_text())
    assert rec["ok"] and rec["timing"] == "real", rec["message"]
    its = rec["sandbox_results"]["1"]["iteration_ns"]
    assert len(its) >= 2 and all(t > 0 for t in its), rec["sandbox_results"]
    assert rec["sandbox_results"]["1"]["compute_ns"] is None  # iterations timed on the device, not spans
    assert rec["prediction"]["predicted_iteration_ns"] > 0
    if importlib.util.find_spec("pynvml"):  # NVML read the GPU's clock in the slice and in the emulation
        res = rec["sandbox_results"]["1"]
        assert res["gpu"].get("samples", 0) > 0 and res["slice_gpu"].get("samples", 0) > 0, res


def test_a_virtual_roots_small_broadcast_on_nccl(tmp_path, capsys, monkeypatch):
    """Kept broadcasts on NCCL: the solo capture writes the root's token ids from the GPU, and
    the slice's and the emulation's rank 1 (rank 0 virtual) receive them into its GPU buffer."""
    from test_run import kept_broadcasts_reach_the_sandbox

    for name in ("OMP_NUM_THREADS", "NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        monkeypatch.setenv(name, ENV[name])
    kept_broadcasts_reach_the_sandbox(tmp_path, capsys, EMU_DEVICES)


def test_a_virtual_peers_bf16_gradient_share_on_nccl(tmp_path, capsys, monkeypatch):
    """DDP in bfloat16 on NCCL, its peer virtual: the sandbox's averaged gradient is its own
    batch's (the pruned all-reduce's pre-multiplied sum; all zeros before the bf16 factor was
    handed to ProcessGroupNCCL in the form it reads)."""
    from test_run import own_gradient_reaches_the_optimizer

    for name in ("OMP_NUM_THREADS", "NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        monkeypatch.setenv(name, ENV[name])
    own_gradient_reaches_the_optimizer(tmp_path, capsys, EMU_DEVICES, "bfloat16")


def test_a_virtual_senders_small_send_on_nccl(tmp_path, capsys, monkeypatch):
    """Kept sends on NCCL: the solo capture writes rank 0's sends from the GPU, and the slice's
    and the emulation's rank 1 (rank 0 virtual) receive them into its GPU buffers."""
    from test_run import kept_sends_reach_the_sandbox

    for name in ("OMP_NUM_THREADS", "NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        monkeypatch.setenv(name, ENV[name])
    kept_sends_reach_the_sandbox(tmp_path, capsys, EMU_DEVICES)
