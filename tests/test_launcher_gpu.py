"""The launcher and `prism record` on GPUs (NCCL). Run on the device machine: `pytest -m gpu`."""

from __future__ import annotations

import json
import signal
import textwrap
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from prismllm.launch import LaunchSpec, launch  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA GPUs"),
]


def ngpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def write(path: Path, src: str) -> Path:
    path.write_text(textwrap.dedent(src))
    return path


NCCL_PROGRAM = """
import json, os, sys, torch, torch.distributed as dist
local_rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local_rank)
dist.init_process_group("nccl")
rank, world = dist.get_rank(), dist.get_world_size()
x = torch.full((1 << 20,), float(rank + 1), device="cuda")
for step in range(3):
    dist.all_reduce(x)
    torch.cuda.synchronize()
expected = float(world * (world + 1) // 2) * world ** 2
out = os.environ.get("DUMP_DIR")
if out:
    keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "CUDA_VISIBLE_DEVICES", "NCCL_NVLS_ENABLE",
            "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS", "TORCH_NCCL_ENABLE_TIMING",
            "PRISM_MODE"]
    with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
        json.dump({"env": {k: os.environ.get(k) for k in keys},
                   "device": torch.cuda.current_device(),
                   "uuid": str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid),
                   "value": x[0].item(), "expected": expected}, f)
dist.destroy_process_group()
"""


def test_local_rank_selects_gpu_and_nccl_works(tmp_path):
    n = ngpus()
    script = write(tmp_path / "prog.py", NCCL_PROGRAM)
    dump = tmp_path / "dump"
    dump.mkdir()
    res = launch(
        LaunchSpec(
            nproc=n, script=str(script), runner=None, devices=list(range(n)), env={"DUMP_DIR": str(dump)}, timeout=300
        )
    )
    assert res.ok, res.message
    for r in range(n):
        d = json.loads((dump / f"rank-{r}.json").read_text())
        assert d["device"] == r and d["env"]["LOCAL_RANK"] == str(r)
        assert d["value"] == d["expected"]
        assert d["env"]["NCCL_NVLS_ENABLE"] == "0"
        assert d["env"]["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
        assert d["env"]["NVSHMEM_DISABLE_NVLS"] == "1"


@pytest.mark.skipif(ngpus() < 2, reason="needs 2 GPUs")
def test_listed_gpu_is_the_one_used(tmp_path):
    """devices=[1]: LOCAL_RANK 0 must land on physical GPU 1."""
    script = write(tmp_path / "prog.py", NCCL_PROGRAM)
    dump = tmp_path / "dump"
    dump.mkdir()
    res = launch(
        LaunchSpec(nproc=1, script=str(script), runner=None, devices=[1], env={"DUMP_DIR": str(dump)}, timeout=300)
    )
    assert res.ok, res.message
    d = json.loads((dump / "rank-0.json").read_text())
    assert d["uuid"] == str(torch.cuda.get_device_properties(1).uuid)


@pytest.mark.skipif(ngpus() < 2, reason="needs 2 GPUs")
def test_rank_failure_while_peer_waits_in_nccl(tmp_path):
    """Rank 1 dies while rank 0 is blocked in an NCCL all-reduce: rank 0 is ended."""
    script = write(
        tmp_path / "prog.py",
        """
        import os, torch, torch.distributed as dist
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
        x = torch.ones(1, device="cuda")
        dist.all_reduce(x); torch.cuda.synchronize()
        if dist.get_rank() == 1:
            raise RuntimeError("rank 1 broke after init")
        dist.all_reduce(x); torch.cuda.synchronize()  # waits for rank 1 forever
    """,
    )
    t0 = time.monotonic()
    res = launch(LaunchSpec(nproc=2, script=str(script), runner=None, devices=[0, 1], grace_period=5.0, timeout=300))
    assert time.monotonic() - t0 < 120
    assert not res.ok and res.failure.rank == 1
    assert res.message.startswith("rank 1 exited with code 1: RuntimeError: rank 1 broke after init")
    assert res.returncodes[0] in (-signal.SIGTERM, -signal.SIGKILL) or res.returncodes[0] != 0


def _importable(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:
        return False


@pytest.mark.skipif(
    not (_importable("prismllm.comm.bootstrap") and _importable("prismllm.trace.assemble")),
    reason="recording bootstrap / assembler not there yet",
)
def test_prism_record_on_gpus(tmp_path, monkeypatch, capsys):
    from prismllm.cli import main as cli_main

    monkeypatch.setattr(cli_main, "SUBCOMMANDS", ("record",))
    n = ngpus()
    script = write(tmp_path / "prog.py", NCCL_PROGRAM)
    dump = tmp_path / "dump"
    dump.mkdir()
    monkeypatch.setenv("DUMP_DIR", str(dump))
    out = tmp_path / "trace"
    rc = cli_main.main(["record", "--nproc", str(n), "--out", str(out), "--timeout", "300", "--", str(script)])
    assert rc == 0, capsys.readouterr().err
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["device"] == "cuda" and manifest["world_size"] == n
    assert "cuda" in manifest["versions"] and "nccl" in manifest["versions"]
    for r in range(n):
        d = json.loads((dump / f"rank-{r}.json").read_text())
        assert d["env"]["TORCH_NCCL_ENABLE_TIMING"] == "1" and d["env"]["PRISM_MODE"] == "record"
        assert d["device"] == r and d["value"] == d["expected"]
    assert not (out / ".spool").exists()
