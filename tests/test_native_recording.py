"""The native recording backend (prismllm/comm/native) against the Python recording path.

The same programs recorded both ways (PRISM_NATIVE=1 / 0) must give graphs of equal structure
(`prism compare`: same ops in the same order, groups, sizes, peers, splits, sync/async), and
the native graph must validate. Programs: every torch.distributed API (collectives.py, with
its own value checks), DDP (waits settled at the end of backward), and gpt3d with pipeline
P2P through batch_isend_irecv (coalescing scopes) and the distributed optimizer.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from conftest import GPT3D, PRISM, ROOT

torch = pytest.importorskip("torch")

from prismllm.trace import PrismTrace, validate  # noqa: E402
from prismllm.trace.compare import compare_structure  # noqa: E402

PROGRAMS = Path(__file__).parent / "programs"
SMALL = ["--layers", "2", "--hidden", "32", "--heads", "4", "--seq", "16", "--vocab", "128",
         "--micro-batch", "1", "--global-batch", "4", "--iters", "3"]  # fmt: skip
CASES = {
    "collectives": (4, [str(PROGRAMS / "collectives.py")]),
    "ddp": (2, [str(PROGRAMS / "ddp_train.py"), "{out}/params", "3"]),
    "gpt3d_pp2_vpp2_distopt": (4, [GPT3D, "--pp", "2", "--vpp", "2", "--dist-opt", *SMALL, "--layers", "4"]),
}


def _record(out: Path, nproc: int, argv: list[str], native: bool, devices: str = "cpu") -> subprocess.CompletedProcess:
    argv = [a.replace("{out}", str(out)) for a in argv]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PRISM_NATIVE": "1" if native else "0"}
    cmd = [PRISM, "record", "--nproc", str(nproc), "--devices", devices, "--out", str(out / "graph"),
           "--timeout", "240", "--", *argv]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=360)


@pytest.mark.parametrize("case", sorted(CASES))
def test_native_graph_equals_python_paths(tmp_path, case):
    nproc, argv = CASES[case]
    graphs = {}
    for native in (False, True):
        out = tmp_path / ("native" if native else "python")
        out.mkdir()
        p = _record(out, nproc, argv, native)
        assert p.returncode == 0, f"native={native}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
        if case == "collectives":
            assert p.stdout.count("COLLECTIVES OK") == nproc, p.stdout[-3000:]
        graphs[native] = PrismTrace.load(out / "graph")
    validate(graphs[True])
    diff = compare_structure(graphs[False], graphs[True])
    assert diff is None, f"first difference: {diff}"
    assert graphs[True].manifest["world_size"] == nproc


def test_native_backend_is_what_torch_dispatches_to(tmp_path):
    """Under native recording the program's groups are plain C++ ProcessGroups whose backend is
    the recording wrapper, and ``dist.get_backend`` still answers the program's backend."""
    prog = tmp_path / "probe.py"
    prog.write_text(
        "import torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "g = dist.group.WORLD\n"
        "be = g._get_backend(torch.device('cpu'))\n"
        "print('PROBE', type(g).__name__, type(be).__name__, dist.get_backend(), be.name(),\n"
        "      list(be.global_ranks))\n"
        "t = torch.ones(4)\n"
        "dist.all_reduce(t)\n"
        "assert t.tolist() == [2.0] * 4\n"
    )
    p = _record(tmp_path, 2, [str(prog)], True)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "PROBE ProcessGroup RecordingBackend gloo gloo [0, 1]" in p.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_native_cuda_recording_resolves_every_point(tmp_path):
    """On a GPU (NCCL, world size 1): thousands of calls with an optimizer step every 50, so the
    resolver thread recycles its events many times over. The native graph equals the Python
    path's, validates, and every communication node has a device start and end; NCCL's
    durations arrive for nearly all of them."""
    argv = [str(ROOT / "benchmarks" / "programs" / "call_cost.py"), "--calls", "400", "--step-every", "50"]
    graphs = {}
    for native in (False, True):
        out = tmp_path / ("native" if native else "python")
        out.mkdir()
        p = _record(out, 1, argv, native, devices="cuda")
        assert p.returncode == 0, f"native={native}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
        graphs[native] = PrismTrace.load(out / "graph")
    g = graphs[True]
    validate(g)
    assert compare_structure(graphs[False], g) is None
    comm = g.column("kind") == "comm"
    start, dur = g.column("start_ns")[comm], g.column("duration_ns")[comm]
    assert comm.sum() > 2000 and (start >= 0).all() and (dur >= 0).all()
    assert (dur > 0).mean() > 0.9
    assert len(g.iterations) > 40
