"""Shared, session-scoped recordings of real runs: each costs seconds per rank on a small machine
(every rank is a Python process importing torch), and several modules check different
properties of the same run, so each distinct run is made once per test session.

``gpt3d_recording``: CPU recordings of examples/gpt3d.py with ``prism record``, shared by every
test that asks for the same command: test_record_gpt3d, test_replay_engine and
test_capture_solo_programs share the 8-rank TP2·PP2·DP2 recording; test_record_gpt3d,
test_emulate_n8 and test_solo_backend the 8-rank MoE one; test_emulate_n8 and test_solo_backend the 8-rank
TP2·PP2·DP2 one without gradient clipping; test_emulate and test_emulate_faults the 2-rank TP2
one; test_emulate and test_emulate_realtime the 2-rank PP2 one; test_emulate and
test_emulate_assistants the 4-rank TP2·DP2 one. The cache key is the whole
recording command: rank count, the program's arguments (order included), ``--save-tensors``
and whether the program saves its final parameters. Output paths (the graph, ``--json-log``,
``--save-params``) are chosen by the fixture, so two tests share a recording exactly when they
would have run the same command.

``torch_program_runs``: the recorded 4-rank runs of tests/programs/ddp_train.py and
fsdp2_train.py (rank logs in their spools), shared by test_recording and test_solo_backend.

``collectives_native``: ``prism record`` of tests/programs/collectives.py on 4 ranks through the
native recorder, shared by test_native_recording and test_graphcheck.

``recorded_graph``: ``prism record`` of any other program, once per distinct command: the real
4-rank run of tests/programs/pipeline_train.py that test_capture_solo_programs and
test_capture_switch both compare their captures with.

Under pytest-xdist (``make test``: ``-n 2 --dist loadfile``) a session fixture is per worker, and
the files that share a recording often run on different workers: ``gpt3d_recording``,
``collectives_native`` and ``recorded_graph`` therefore keep each distinct run in a directory that every worker of the
test run sees (beside the workers' base temporaries), made by whichever worker asks first while the
others wait on its lock (``shared_run``), so each is made once per ``make test``.

Recordings are read-only for their users: write emulations, calibrations and copies elsewhere.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from listeners import ListenerWatch

ROOT = Path(__file__).resolve().parents[1]
PRISM = str(Path(sys.executable).with_name("prism"))
GPT3D = str(ROOT / "examples" / "gpt3d.py")
COLLECTIVES = str(ROOT / "tests" / "programs" / "collectives.py")


def gpt3d_sizes(
    *, layers: int = 2, seq: int = 16, vocab: int = 128, global_batch: int | None = None, iters: int = 3,
    bucket_mb: str | None = None,
) -> list[str]:  # fmt: skip
    """A tiny gpt3d model's arguments (hidden 32, 4 heads, micro-batch 1: a rank runs in seconds on
    two cores). The list is part of a shared recording's key (``gpt3d_recording``): the same
    sizes give the same list."""
    args = ["--layers", str(layers), "--hidden", "32", "--heads", "4", "--seq", str(seq), "--vocab", str(vocab),
            "--micro-batch", "1"]  # fmt: skip
    if global_batch is not None:
        args += ["--global-batch", str(global_batch)]
    args += ["--iters", str(iters)]
    if bucket_mb is not None:
        args += ["--bucket-mb", bucket_mb]
    return args


@contextlib.contextmanager
def shared_run(tmp_path_factory, name: str, key):
    """``with shared_run(f, name, key) as (base, result):``: a directory for the run named by
    ``key`` and what an earlier maker stored in ``base/result.json`` (None: make it now, and store
    a JSON-able result there before leaving). Under xdist the directory is one for the whole test
    run (its workers' base temporaries share a parent), held under an exclusive lock while made,
    so a run another worker made, or is making, is not made again; without xdist it is this
    session's own."""
    digest = hashlib.sha1(repr(key).encode()).hexdigest()[:16]
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        base = tmp_path_factory.mktemp(name)
        yield base, None
        return
    import fcntl

    shared = tmp_path_factory.getbasetemp().parent / "shared-runs"
    shared.mkdir(exist_ok=True)
    base = shared / f"{name}-{digest}"
    with open(shared / f"{name}-{digest}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        result = base / "result.json"
        if result.exists():
            yield base, json.loads(result.read_text())
            return
        base.mkdir(exist_ok=True)
        yield base, None


@dataclass(frozen=True)
class Recording:
    """One real run of gpt3d under ``prism record``."""

    out: Path  # the graph (``prism record --out``); with --save-tensors, its tensors/ too
    log_path: Path  # gpt3d --json-log of the run (written by the last rank)
    params: Path | None  # gpt3d --save-params of the run, when asked for
    listeners: frozenset = frozenset()  # what the run's processes listened on (tests/listeners.py)

    @property
    def log(self) -> list[dict]:
        """[{iteration, loss, iter_time_ms, max_mem_bytes, grad_norm}] per iteration (a fresh copy)."""
        return json.loads(self.log_path.read_text())


def _recording(base: Path, made, nproc, args, save_tensors, save_params, timeout) -> Recording | str:
    """gpt3d_recording's run in ``base`` (a Recording, or the failure's message), or what
    shared_run found there (``made``); stores it for the other workers."""
    rec = Recording(out=base / "rec", log_path=base / "rec.json", params=base / "params" if save_params else None)
    if made is not None:
        if "error" in made:
            return made["error"]
        return dataclasses.replace(rec, listeners=frozenset(tuple(x) for x in made["listeners"]))
    cmd = [PRISM, "record", "--nproc", str(nproc), "--devices", "cpu", "--out", str(rec.out)]
    if save_tensors:
        cmd += ["--save-tensors", save_tensors]
    cmd += ["--timeout", str(timeout), "--", GPT3D, *args, "--json-log", str(rec.log_path)]
    if rec.params is not None:
        cmd += ["--save-params", str(rec.params)]
    p = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    with ListenerWatch(p.pid) as watch:
        try:
            out, err = p.communicate(timeout=timeout + 120)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
    # a failed recording fails every test that needs it, without running it again
    if p.returncode != 0:
        error = f"{' '.join(cmd)} exited with {p.returncode}:\n{out[-3000:]}{err[-3000:]}"
        (base / "result.json").write_text(json.dumps({"error": error}))
        return error
    (base / "result.json").write_text(json.dumps({"listeners": sorted(watch.seen)}))
    return dataclasses.replace(rec, listeners=frozenset(watch.seen))


@pytest.fixture(scope="session")
def gpt3d_recording(tmp_path_factory):
    """``record(nproc, args, save_tensors=None, save_params=False, timeout=300) -> Recording``:
    ``prism record --nproc NPROC --devices cpu [--save-tensors SEL] -- gpt3d.py ARGS --json-log LOG
    [--save-params DIR]``, run once per test run for each distinct command (shared_run)."""
    done: dict[tuple, Recording | str] = {}

    def record(
        nproc: int, args: list[str], *, save_tensors: str | None = None, save_params: bool = False, timeout: float = 300
    ) -> Recording:
        key = (int(nproc), tuple(args), save_tensors, bool(save_params))
        if key not in done:
            with shared_run(tmp_path_factory, "gpt3d-recording", key) as (base, made):
                done[key] = _recording(base, made, nproc, args, save_tensors, save_params, timeout)
        rec = done[key]
        if isinstance(rec, str):
            pytest.fail(rec)
        return rec

    return record


# ---- PyTorch DDP and FSDP2 programs (tests/programs), recorded ------------------------------------
@pytest.fixture(scope="session")
def torch_program_runs(tmp_path_factory):
    """Recorded runs (PRISM_MODE=record, rank logs kept in their spools) of ddp_train.py OUT
    DDP_STEPS and fsdp2_train.py FSDP_STEPS on N ranks (test_recording's constants and
    launcher), started once per session and shared by test_recording (which checks their rows)
    and test_solo_backend (which compares a solo rank with them). Returned started, not waited
    for: {"ddp": Launch, "fsdp2": Launch, "ddp_out": OUT, where rank 0 saved the final
    parameters}."""
    from test_recording import DDP_STEPS, FSDP_STEPS, PROGRAMS, Launch, N

    tmp = tmp_path_factory.mktemp("torch-programs")
    return {
        "ddp": Launch(PROGRAMS / "ddp_train.py", N, tmp / "spool_ddp", [str(tmp / "ddp_rec"), str(DDP_STEPS)]),
        "fsdp2": Launch(PROGRAMS / "fsdp2_train.py", N, tmp / "spool_fsdp", [str(FSDP_STEPS)]),
        "ddp_out": tmp / "ddp_rec",
    }


# ---- tests/programs/collectives.py, recorded natively --------------------------------------------
@pytest.fixture(scope="session")
def collectives_native(tmp_path_factory) -> tuple[Path, str]:
    """(graph, the run's stdout) of ``prism record --nproc 4 --devices cpu -- collectives.py``
    through the native recorder (PRISM_NATIVE=1): test_native_recording compares it with the
    Python path's graph, test_graphcheck checks every recorded call against it."""
    cmd = [PRISM, "record", "--nproc", "4", "--devices", "cpu", "--out", "GRAPH", "--timeout", "240", "--",
           COLLECTIVES]  # fmt: skip
    with shared_run(tmp_path_factory, "collectives-native", cmd) as (base, made):
        out = base / "graph"
        if made is None:
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PRISM_NATIVE": "1"}
            p = subprocess.run([str(out) if a == "GRAPH" else a for a in cmd], capture_output=True, text=True,
                               env=env, timeout=360)  # fmt: skip
            made = {"returncode": p.returncode, "stdout": p.stdout, "stderr": p.stderr}
            (base / "result.json").write_text(json.dumps(made))
    assert made["returncode"] == 0, made["stdout"][-3000:] + made["stderr"][-3000:]
    return out, made["stdout"]


# ---- other programs, recorded ---------------------------------------------------------------------
@pytest.fixture(scope="session")
def recorded_graph(tmp_path_factory):
    """``record(nproc, args) -> Path``: the graph of ``prism record --nproc NPROC --devices cpu
    ARGS`` (ARGS: record options, ``--``, the program and its arguments), made once per test run for
    each distinct command (shared_run); a failed recording fails every test that asks for it."""
    done: dict[tuple, tuple[Path, dict]] = {}

    def record(nproc: int, args: list[str]) -> Path:
        key = (int(nproc), tuple(args))
        if key not in done:
            with shared_run(tmp_path_factory, "recorded-graph", key) as (base, made):
                if made is None:
                    cmd = [PRISM, "record", "--nproc", str(nproc), "--devices", "cpu", "--out", str(base / "graph"),
                           *args]  # fmt: skip
                    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
                    made = {"returncode": p.returncode, "output": p.stdout[-3000:] + p.stderr[-3000:]}
                    (base / "result.json").write_text(json.dumps(made))
            done[key] = (base / "graph", made)
        graph, made = done[key]
        assert made["returncode"] == 0, made["output"]
        return graph

    return record
