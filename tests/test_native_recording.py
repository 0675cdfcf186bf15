"""The native recording backend (prismllm/comm/native) against the Python recording path.

The same programs recorded both ways (PRISM_NATIVE=1 / 0) must give graphs of equal structure
(`prism compare`: same ops in the same order, groups, sizes, peers, splits, sync/async), and
the native graph must validate. Programs: every torch.distributed API (collectives.py, with
its own value checks), DDP (waits settled at the end of backward), and gpt3d with pipeline
P2P through batch_isend_irecv (coalescing scopes) and the distributed optimizer.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import COLLECTIVES, GPT3D, PRISM, ROOT

torch = pytest.importorskip("torch")

from prismllm.errors import ExitCode  # noqa: E402
from prismllm.trace import PrismTrace, validate  # noqa: E402
from prismllm.trace.compare import compare_structure  # noqa: E402

PROGRAMS = Path(__file__).parent / "programs"
SMALL = ["--layers", "2", "--hidden", "32", "--heads", "4", "--seq", "16", "--vocab", "128",
         "--micro-batch", "1", "--global-batch", "4", "--iters", "3"]  # fmt: skip
CASES = {
    "collectives": (4, [COLLECTIVES]),  # conftest.collectives_native: this command, recorded natively
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
def test_native_graph_equals_python_paths(tmp_path, case, request):
    nproc, argv = CASES[case]
    graphs = {}
    for native in (False, True):
        if native and case == "collectives":  # the same command, recorded once (test_graphcheck's too)
            graph, stdout = request.getfixturevalue("collectives_native")
        else:
            out = tmp_path / ("native" if native else "python")
            out.mkdir()
            p = _record(out, nproc, argv, native)
            assert p.returncode == 0, f"native={native}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
            graph, stdout = out / "graph", p.stdout
        if case == "collectives":
            assert stdout.count("COLLECTIVES OK") == nproc, stdout[-3000:]
        graphs[native] = PrismTrace.load(graph)
    validate(graphs[True])
    diff = compare_structure(graphs[False], graphs[True])
    assert diff is None, f"first difference: {diff}"
    assert graphs[True].manifest["world_size"] == nproc


MISMATCH = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(4)
for _ in range(3):
    dist.all_reduce(t)
if dist.get_rank() == 1:
    dist.broadcast(t, src=0)  # rank 0 never joins it
else:
    dist.irecv(t, src=1).wait()  # and rank 1 never sends
"""


def test_a_hung_recording_says_where_each_rank_waits(tmp_path):
    """Two ranks wait on calls that never match: the timeout's message names, per rank, the
    program's line, the call it waits on (op, group, peer or root) and its counts, from the
    native recorder (prismllm.launch.status; the Python recorder's report: test_emulate_faults)."""
    script = tmp_path / "mismatch.py"
    script.write_text(MISMATCH)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PRISM_NATIVE": "1"}
    p = subprocess.run(
        [
            PRISM,
            "record",
            "--nproc",
            "2",
            "--devices",
            "cpu",
            "--out",
            str(tmp_path / "g"),
            "--timeout",
            "10",
            "--",
            str(script),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert p.returncode != 0
    err = p.stderr
    assert "prism record: error: timed out after 10 s; ranks still running: 0-1" in err, err
    rank0, rank1 = err.split("  rank 0: ")[1].split("  rank 1: ")
    assert rank0.startswith("at mismatch.py:10 in <module>"), err
    assert rank1.startswith("at mismatch.py:8 in <module>, in broadcast (distributed_c10d.py)"), err
    assert "waiting on call 3 recv" in rank0 and "on group '0' from rank 1" in rank0, err
    assert "waiting on call 3 broadcast" in rank1 and "on group '0' root rank 0" in rank1, err
    assert "4 call(s), 3 wait(s)" in rank0, err


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


def test_a_python_work_of_the_native_lane_says_when_it_completed():
    """A Work of the native lane's Python path (a pruned call that took no template), asked from
    C++: it completes once its small calls ran, and reports their device time. c10d's trampoline
    for a Work written in Python forwards neither, so the native recorder, which holds an async
    Work until it completes, held every such Work and its tensors to the end of the run (on four
    H100s: a pipeline stage's peak grew 268 MB an iteration)."""
    p = subprocess.run(
        [sys.executable, str(PROGRAMS / "lane_python_work.py")], capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert p.stdout.splitlines()[-2:] == ["LANE WORK completed=True", "LANE WORK completed=True duration=1.5"]


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


def test_build_locks_left_behind_are_removed_and_a_live_one_is_named(tmp_path, monkeypatch, capsys):
    """A build killed half-way leaves torch's empty ``lock`` (and our ``build.lock``) behind;
    before the fix every later start waited on it forever. Both are removed with a message; a
    lock whose holder is alive ends the wait after PRISM_NATIVE_BUILD_TIMEOUT, naming it. (The
    lock around ``load()``'s build, on a directory of its own: no compiler run needed.)"""
    from prismllm.comm.native import BuildLockTimeout, _build_lock

    monkeypatch.setenv("PRISM_NATIVE_BUILD_TIMEOUT", "5")  # a lock not removed fails, not hangs
    host = socket.gethostname()
    exited = subprocess.Popen(["true"])
    exited.wait()
    (tmp_path / "lock").touch()
    (tmp_path / "build.lock").write_text(f"{host} {exited.pid}\n")
    with _build_lock(tmp_path):
        assert (tmp_path / "build.lock").read_text().split() == [host, str(os.getpid())]
        assert not (tmp_path / "lock").exists()
    assert not (tmp_path / "build.lock").exists()
    err = capsys.readouterr().err
    assert f"removing {tmp_path / 'build.lock'}" in err and f"removing {tmp_path / 'lock'}" in err

    holder = subprocess.Popen(["sleep", "60"])
    monkeypatch.setenv("PRISM_NATIVE_BUILD_TIMEOUT", "1")
    try:
        (tmp_path / "build.lock").write_text(f"{host} {holder.pid}\n")
        with pytest.raises(BuildLockTimeout) as e, _build_lock(tmp_path):
            pass
    finally:
        holder.kill()
        holder.wait()
    msg = str(e.value)
    assert "waited 1 s for the native backend's build, held by" in msg
    assert str(holder.pid) in msg and str(tmp_path / "build.lock") in msg


SHARED_BUILD = """
import os, shutil, sys
import torch.utils.cpp_extension as ext
from prismllm.comm import native
native.load()  # found in the user's cache, or built there first
tag = native._tag()
theirs = native.build_directory(tag)
os.environ["PRISM_NATIVE_CACHE"] = sys.argv[1]
mine = native.build_directory(tag)
mine.mkdir(parents=True)
for name in (tag + ".so", tag + ".built"):
    shutil.copy(theirs / name, mine / name)
def refuse(**kw):
    raise RuntimeError("the builder was asked")
ext.load = refuse
native._MOD = None
print("IMPORTED", native.load().__name__ == tag)
(mine / (tag + ".built")).unlink()  # not marked finished: the builder is asked
native._MOD = None
try:
    native.load()
except native.NativeBuildError as e:
    print("BUILDER", "the builder was asked" in str(e))
"""


def test_a_finished_build_is_imported_without_asking_the_builder_again(tmp_path):
    """A finished build (marked ``TAG.built`` beside its library) is imported as it is: torch's
    builder, asked from another environment, finds other include paths in its build file and
    compiles again (two checkouts used side by side rebuilt each other's, ~40 s each time). A
    library not marked finished goes through the builder."""
    p = subprocess.run([sys.executable, "-c", SHARED_BUILD, str(tmp_path / "cache")], capture_output=True, text=True,
                       timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert p.stdout.splitlines()[-2:] == ["IMPORTED True", "BUILDER True"], p.stdout + p.stderr[-2000:]


def _prism_record(tmp_path: Path, name: str, *flags: str, env: dict | None = None) -> subprocess.CompletedProcess:
    prog = tmp_path / "one_all_reduce.py"
    prog.write_text(
        "import torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "t = torch.ones(4)\n"
        "dist.all_reduce(t)\n"
    )
    run_env = {k: v for k, v in os.environ.items() if k != "PRISM_NATIVE"}
    run_env.update(env or {}, OMP_NUM_THREADS="1")
    cmd = [PRISM, "record", "--nproc", "2", "--devices", "cpu", "--out", str(tmp_path / name),
           "--timeout", "120", *flags, "--", str(prog)]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, env=run_env, timeout=300)


def test_record_takes_the_native_path_unless_it_cannot_be_built(tmp_path):
    """`prism record` records natively by default and names the path in the manifest; a build
    that fails is said on stderr and the Python path records instead (auto), or ends the run
    with the reason (--recorder native). --save-tensors needs the Python path."""
    p = _prism_record(tmp_path, "default")
    assert p.returncode == 0, p.stderr[-2000:]
    assert PrismTrace.load(tmp_path / "default").manifest["recorder"] == "native"

    p = _prism_record(tmp_path, "python", "--recorder", "python")
    assert p.returncode == 0, p.stderr[-2000:]
    assert PrismTrace.load(tmp_path / "python").manifest["recorder"] == "python"

    broken = {"PRISM_NATIVE_CACHE": str(tmp_path / "empty-cache"), "CXX": "/bin/false"}
    p = _prism_record(tmp_path, "fallback", env=broken)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "WARNING: the native recording backend could not be built" in p.stderr
    assert "recording through the Python path instead" in p.stderr
    assert PrismTrace.load(tmp_path / "fallback").manifest["recorder"] == "python"

    p = _prism_record(tmp_path, "required", "--recorder", "native", env=broken)
    assert p.returncode == ExitCode.ENVIRONMENT and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert "prism record: error: the native recording backend could not be built" in p.stderr

    p = _prism_record(tmp_path, "saving", "--recorder", "native", "--save-tensors", "all")
    assert p.returncode == ExitCode.USAGE
    assert "--save-tensors records through the Python path" in p.stderr
