"""The recording backend on CPU (gloo): programs run unmodified under
``python -m prismllm.comm.bootstrap``; their RankLogs are read straight from the spool.

All launches start together in one module fixture (the cost is mostly importing torch in
each process), then the tests inspect the results.
"""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from prismllm.trace.ranklog import RankLog, ranklog_path, read_ranklog  # noqa: E402
from prismllm.trace.schema import COMM_OPS  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_gloo_available(), reason="needs gloo")

PROGRAMS = Path(__file__).parent / "programs"
N = 4
DDP_STEPS = 3
FSDP_STEPS = 2
# the recorded DDP and FSDP2 runs (N ranks, these steps) are started by conftest.torch_program_runs
# and shared with test_solo_backend


# ---- launcher (stand-in for `prism record` until the launcher exists) -------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Launch:
    def __init__(self, script, nproc, spool, args=(), record=True, env=None):
        self.nproc = nproc
        self.spool = Path(spool)
        port = _free_port()
        extra_env = dict(env or {})
        self.procs = []
        for r in range(nproc):
            env = dict(os.environ)
            for k in ("PRISM_MODE", "PRISM_SPOOL"):
                env.pop(k, None)
            env.update(
                RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(nproc),
                LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
            )  # fmt: skip
            if record:  # the Python recording path (test_native_recording compares the native one)
                env.update(PRISM_MODE="record", PRISM_SPOOL=str(spool), PRISM_NATIVE="0")
            env.update(extra_env)
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "prismllm.comm.bootstrap", str(script), *args],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )  # fmt: skip
            )
        self.results: list[tuple[int, str]] | None = None

    def wait(self, timeout=240):
        if self.results is None:
            deadline = time.monotonic() + timeout
            res = []
            for p in self.procs:
                try:
                    out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    for q in self.procs:
                        q.kill()
                    out, _ = p.communicate()
                    res.append((-9, out))
                    continue
                res.append((p.returncode, out))
            self.results = res
        return self.results

    def ok(self):
        res = self.wait()
        bad = [(r, rc, out[-3000:]) for r, (rc, out) in enumerate(res) if rc != 0]
        assert not bad, "ranks failed:\n" + "\n".join(f"rank {r} rc={rc}\n{o}" for r, rc, o in bad)
        return res

    def logs(self) -> list[RankLog]:
        self.ok()
        return [read_ranklog(ranklog_path(self.spool, r)) for r in range(self.nproc)]


EXIT3 = """
import sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(2)
dist.all_reduce(t)
sys.exit(3)
"""

RAISE = """
import torch, torch.distributed as dist
import prismllm
from prismllm import api
dist.init_process_group("gloo")
api.mark("first")
t = torch.ones(2)
dist.all_reduce(t)
api.step()
def broken():
    raise RuntimeError("the program's own error")
broken()
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory, torch_program_runs):
    tmp = tmp_path_factory.mktemp("rec")
    (tmp / "exit3.py").write_text(textwrap.dedent(EXIT3))
    (tmp / "raise.py").write_text(textwrap.dedent(RAISE))
    launches = {
        "collectives": Launch(PROGRAMS / "collectives.py", N, tmp / "spool_coll"),
        "ddp": torch_program_runs["ddp"],  # ddp_train.py OUT DDP_STEPS, recorded
        "ddp_plain": Launch(PROGRAMS / "ddp_train.py", N, tmp / "spool_plain",
                            [str(tmp / "ddp_plain"), str(DDP_STEPS)], record=False),
        "fsdp2": torch_program_runs["fsdp2"],  # fsdp2_train.py FSDP_STEPS, recorded
        "exit3": Launch(tmp / "exit3.py", 1, tmp / "spool_exit3"),
        "raise": Launch(tmp / "raise.py", 1, tmp / "spool_raise"),
    }  # fmt: skip
    for launch in launches.values():
        launch.wait()
    launches["tmp"] = tmp
    launches["ddp_out"] = torch_program_runs["ddp_out"]
    return launches


# ---- generic checks on any RankLog --------------------------------------------------------------
def check_structure(log: RankLog, cuda: bool = False) -> None:
    nodes = log.nodes
    assert [n["index"] for n in nodes] == list(range(len(nodes)))
    assert all(n["rank"] == log.rank for n in nodes)
    prev_iter, prev_issue = -1, -1
    for n in nodes:
        assert n["iteration"] >= prev_iter
        prev_iter = n["iteration"]
        assert n["issue_ns"] >= prev_issue, n
        prev_issue = n["issue_ns"]
        assert 0 <= n["start_ns"] <= n["end_ns"], n
        assert n["duration_ns"] == n["end_ns"] - n["start_ns"]
        if n["kind"] == "compute":
            assert n["op"] == "compute" and n["stream"] == "compute" and n["group_name"] == ""
            assert n["wait_index"] == -1
        else:
            assert n["kind"] == "comm" and n["op"] in COMM_OPS
            assert n["stream"] == "comm:" + n["group_name"]
            if n["async_op"]:
                w = n["wait_index"]
                assert w > n["index"] and nodes[w]["kind"] == "compute", n
            else:
                assert n["wait_index"] == -1
    its = log.iterations
    assert [it["iteration"] for it in its] == list(range(len(its)))
    for a, b in zip(its, its[1:]):
        assert a["end_ns"] == b["start_ns"]
    for it in its:
        assert it["start_ns"] < it["end_ns"]
    if cuda:
        assert log.device != "cpu" and log.clock == "cuda" and log.peak_memory_bytes > 0
    else:
        assert log.device == "cpu" and log.clock == "host" and log.peak_memory_bytes == -1


def comm(log: RankLog) -> list[dict]:
    return [n for n in log.nodes if n["kind"] == "comm"]


# ---- collectives.py: every API, exact rows ------------------------------------------------------
def _row(it, op, group, api, seq, shape, inb, outb, *, dtype="float32", red="", peer=-1,
         tag=0, insp=(), outsp=(), coal=-1, wait=None, label=""):  # fmt: skip
    return {
        "iteration": it, "op": op, "group_name": group, "api": api, "seq": seq,
        "shape": list(shape), "in_bytes": inb, "out_bytes": outb,
        "dtype": dtype if op != "barrier" else "", "reduce_op": red, "peer": peer, "tag": tag,
        "in_splits": list(insp), "out_splits": list(outsp), "coalesced": coal,
        "async_op": wait is not None, "wait_rel": wait, "label": label,
    }  # fmt: skip


# Method names torch reaches for the same public call differ by version (2.11 | 2.13).
CANONICAL_API = {
    "_allgather_base": "all_gather_single",
    "_reduce_scatter_base": "reduce_scatter_single",
    "alltoall_base": "all_to_all_single",
    "allgather_into_tensor_coalesced": "all_gather_single_coalesced",
    "reduce_scatter_tensor_coalesced": "reduce_scatter_single_coalesced",
}


def expected_collectives(r: int, alltoall: bool = True) -> list[dict]:
    """The comm rows of collectives.py on rank ``r``; ``alltoall=False`` where gloo has no
    alltoall (torch < 2.13): that call raised and must have left no row."""
    E = _expected_collectives(r)
    if not alltoall:
        k = next(i for i, e in enumerate(E) if e["api"] == "alltoall")
        del E[k]
        for e in E[k:]:
            if e["group_name"] == "0" and e["op"] not in ("send", "recv"):
                e["seq"] -= 1
    return E


def _expected_collectives(r: int) -> list[dict]:
    n = N
    nxt, prv = (r + 1) % n, (r - 1) % n
    E = []
    a = E.append
    # phase A, iteration 0, default group "0"
    a(_row(0, "all_reduce", "0", "allreduce", 0, [4], 16, 16, red="sum"))
    a(_row(0, "all_reduce", "0", "allreduce", 1, [4], 16, 16, red="max", wait=2))
    a(_row(0, "all_reduce", "0", "allreduce", 2, [2], 8, 8, red="min"))
    a(_row(0, "all_reduce", "0", "allreduce", 3, [2], 16, 16, red="product", dtype="float64"))
    a(_row(0, "all_gather", "0", "allgather", 4, [3], 12, 48))
    a(_row(0, "all_gather", "0", "all_gather_single", 5, [3], 12, 48))
    a(_row(0, "reduce_scatter", "0", "reduce_scatter_single", 6, [8], 32, 8, red="sum"))
    a(_row(0, "reduce_scatter", "0", "reduce_scatter", 7, [2], 32, 8, red="sum"))
    insp = [r + j + 1 for j in range(n)]
    outsp = [j + r + 1 for j in range(n)]
    a(_row(0, "all_to_all", "0", "all_to_all_single", 8, [sum(insp), 2], 8 * sum(insp),
           8 * sum(outsp), insp=insp, outsp=outsp))  # fmt: skip
    a(_row(0, "all_to_all", "0", "all_to_all_single", 9, [4], 16, 16))
    a(_row(0, "all_to_all", "0", "alltoall", 10, [1], 16, 16, insp=[1] * n, outsp=[1] * n))
    a(_row(0, "broadcast", "0", "broadcast", 11, [5], 20 if r == 2 else 0,
           0 if r == 2 else 20, peer=2))  # fmt: skip
    a(_row(0, "reduce", "0", "reduce", 12, [5], 20, 20 if r == 1 else 0, red="sum", peer=1))
    a(_row(0, "gather", "0", "gather", 13, [2], 8, 32 if r == 3 else 0, peer=3))
    a(_row(0, "scatter", "0", "scatter", 14, [2], 32 if r == 0 else 0, 8, peer=0))
    send = _row(0, "send", "0", "send", 0, [3], 12, 0, peer=nxt)
    recv = _row(0, "recv", "0", "recv", 0, [3], 0, 12, peer=prv)
    E += [send, recv] if r % 2 == 0 else [recv, send]
    a(_row(0, "send", "0", "send", 1, [3], 12, 0, peer=nxt, tag=7, wait=4))
    a(_row(0, "recv", "0", "recv", 1, [3], 0, 12, peer=prv, tag=7, wait=3))
    a(_row(0, "send", "0", "send", 2, [4], 16, 0, peer=nxt, coal=0, wait=4))
    a(_row(0, "recv", "0", "recv", 2, [4], 0, 16, peer=prv, coal=0, wait=3))
    p = max(len(pickle.dumps({"rank": j})) for j in range(n))
    a(_row(0, "all_gather", "0", "allgather", 15, [1], 8, 32, dtype="int64"))
    a(_row(0, "all_gather", "0", "allgather", 16, [p], p, n * p, dtype="uint8"))
    q = len(pickle.dumps("hello")) + len(pickle.dumps(42))
    a(_row(0, "broadcast", "0", "broadcast", 17, [2], 16 if r == 1 else 0, 0 if r == 1 else 16,
           dtype="int64", peer=1))  # fmt: skip
    a(_row(0, "broadcast", "0", "broadcast", 18, [q], q if r == 1 else 0, 0 if r == 1 else q,
           dtype="uint8", peer=1))  # fmt: skip
    a(_row(0, "barrier", "0", "barrier", 19, [], 0, 0))
    a(_row(0, "barrier", "0", "monitored_barrier", 20, [], 0, 0))
    a(_row(0, "all_reduce", "0", "allreduce", 21, [4], 16, 16, red="sum", wait=2))  # funcol
    a(_row(0, "all_reduce", "0", "allreduce_coalesced", 22, [2], 8, 8, red="sum", coal=1))
    a(_row(0, "all_reduce", "0", "allreduce_coalesced", 23, [3], 12, 12, red="sum", coal=1))
    a(_row(0, "all_reduce", "0", "allreduce_coalesced", 24, [2], 8, 8, red="sum", coal=2,
           wait=3))  # fmt: skip
    a(_row(0, "all_reduce", "0", "allreduce_coalesced", 25, [3], 12, 12, red="sum", coal=2,
           wait=2))  # fmt: skip
    # phase B, iteration 1, sub-groups
    members = [0, 2] if r % 2 == 0 else [1, 3]
    mine = "1" if r % 2 == 0 else "2"
    pair = [0, 1] if r < 2 else [2, 3]
    pg = "3" if r < 2 else "4"
    a(_row(1, "all_reduce", mine, "allreduce", 0, [4], 16, 16, red="sum"))
    a(_row(1, "all_gather", pg, "all_gather_single", 0, [3], 12, 24))
    root = members[1]
    a(_row(1, "broadcast", mine, "broadcast", 1, [2], 8 if r == root else 0,
           0 if r == root else 8, peer=root))  # fmt: skip
    other = members[1] if r == members[0] else members[0]
    send = _row(1, "send", mine, "send", 0, [2], 8, 0, peer=other)
    recv = _row(1, "recv", mine, "recv", 0, [2], 0, 8, peer=other)
    E += [send, recv] if r == members[0] else [recv, send]
    pother = pair[1] if r == pair[0] else pair[0]
    a(_row(1, "recv", pg, "recv", 0, [5], 0, 20, peer=pother, coal=3, wait=4))
    a(_row(1, "send", pg, "send", 0, [5], 20, 0, peer=pother, coal=3, wait=3))
    gr = pair.index(r)
    insp, outsp = [gr + 1, 2], [[1, 2][gr], [2, 2][gr]]
    a(_row(1, "all_to_all", pg, "all_to_all_single", 1, [sum(insp)], 4 * sum(insp),
           4 * sum(outsp), insp=insp, outsp=outsp, wait=2))  # fmt: skip
    a(_row(1, "barrier", pg, "barrier", 2, [], 0, 0))
    # phase C
    a(_row(2, "all_reduce", "0", "allreduce", 26, [2], 8, 8, red="sum", label="tail-allreduce"))
    a(_row(3, "all_reduce", "0", "allreduce", 27, [1], 4, 4, red="sum"))
    return E


def test_collectives_program_ran_and_checked_its_values(runs):
    res = runs["collectives"].ok()
    for r, (_, out) in enumerate(res):
        assert f"COLLECTIVES OK {r}" in out


@pytest.mark.parametrize("r", range(N))
def test_collectives_rows_exact(runs, r):
    log = runs["collectives"].logs()[r]
    check_structure(log)
    assert log.rank == r and log.world_size == N
    got = []
    for c in comm(log):
        g = {k: c[k] for k in _row(0, "", "", "", 0, [], 0, 0) if k != "wait_rel"}
        g["api"] = CANONICAL_API.get(g["api"], g["api"])
        g["wait_rel"] = c["wait_index"] - c["index"] if c["async_op"] else None
        got.append(g)
    alltoall = "ALLTOALL UNSUPPORTED" not in runs["collectives"].ok()[r][1]
    exp = expected_collectives(r, alltoall)
    for i, (g, e) in enumerate(zip(got, exp)):
        assert g == e, f"comm row {i}:\n got {g}\nwant {e}"
    assert len(got) == len(exp)


@pytest.mark.parametrize("r", range(N))
def test_collectives_groups_and_iterations(runs, r):
    log = runs["collectives"].logs()[r]
    groups = {g.name: (g.desc, g.ranks) for g in log.groups}
    members = [0, 2] if r % 2 == 0 else [1, 3]
    pair = [0, 1] if r < 2 else [2, 3]
    assert groups == {
        "0": ("default_pg", [0, 1, 2, 3]),
        "1" if r % 2 == 0 else "2": ("undefined", members),
        "3" if r < 2 else "4": (groups["3" if r < 2 else "4"][0], pair),
    }
    # iterations 0 and 1 end at optimizer steps, 2 at prismllm.step(); the optimizer step
    # after that was ignored, so the last all_reduce is in the unclosed iteration 3.
    assert [it["iteration"] for it in log.iterations] == [0, 1, 2]
    # Compute spans alternate with communication: every comm node is preceded by a compute
    # node (the rows of one *_coalesced call share one issue point).
    nodes = log.nodes
    assert nodes[0]["kind"] == "compute" and nodes[-1]["kind"] == "compute"
    for a, b in zip(nodes, nodes[1:]):
        if a["kind"] == "comm" and b["kind"] == "comm":
            assert a["coalesced"] == b["coalesced"] >= 0 and a["issue_ns"] == b["issue_ns"]


def test_collectives_cross_rank_consistency(runs):
    """Matching: a collective's (group, seq) has the same op and sizes on every member; every
    send (group, src, dst, seq) has exactly one recv with the same size."""
    logs = runs["collectives"].logs()
    coll: dict[tuple, list] = {}
    sends, recvs = {}, {}
    for log in logs:
        for c in comm(log):
            if c["op"] == "send":
                sends[(c["group_name"], log.rank, c["peer"], c["seq"])] = c["in_bytes"]
            elif c["op"] == "recv":
                recvs[(c["group_name"], c["peer"], log.rank, c["seq"])] = c["out_bytes"]
            else:
                coll.setdefault((c["group_name"], c["seq"]), []).append(
                    (log.rank, c["op"], c["reduce_op"], c["peer"], c["coalesced"])
                )
    assert sends == recvs
    groups = {g.name: g.ranks for log in logs for g in log.groups}
    for (g, seq), parts in coll.items():
        assert sorted(p[0] for p in parts) == groups[g], (g, seq)
        assert len({p[1:] for p in parts}) == 1, (g, seq, parts)


def test_compute_spans_cover_the_program(runs):
    """Compute spans and waits tile the rank's time: each compute span starts where the
    previous point ended (issue return / wait return) and stalls are not compute."""
    log = runs["collectives"].logs()[0]
    nodes = log.nodes
    total = sum(n["duration_ns"] for n in nodes if n["kind"] == "compute")
    span = nodes[-1]["end_ns"] - nodes[0]["start_ns"]
    assert 0 < total <= span
    # The async max all_reduce was waited after a matmul: its wait point splits compute.
    ar = comm(log)[1]
    before, after = nodes[ar["index"] + 1], nodes[ar["wait_index"]]
    assert before["end_ns"] <= after["start_ns"]
    assert ar["start_ns"] == ar["issue_ns"] and ar["end_ns"] <= after["start_ns"]


def test_mark_starts_a_labelled_compute_span(runs):
    """``prismllm.mark("tail-allreduce")`` ends the span under way and starts a compute span of
    that name, which the labelled all_reduce ends; the span before it is unlabelled and ends
    where the labelled one starts."""
    for log in runs["collectives"].logs():
        nodes = log.nodes
        (c1,) = [n for n in comm(log) if n["label"] == "tail-allreduce"]
        labelled, before = nodes[c1["index"] - 1], nodes[c1["index"] - 2]
        assert labelled["kind"] == "compute" and labelled["label"] == "tail-allreduce"
        assert before["kind"] == "compute" and before["label"] == ""
        assert before["end_ns"] == labelled["start_ns"] <= labelled["end_ns"] <= c1["issue_ns"]
        assert sum(n["label"] == "tail-allreduce" for n in nodes) == 2


# ---- DDP -------------------------------------------------------------------------------------
def test_ddp_rows(runs):
    logs = runs["ddp"].logs()
    param_bytes = 4 * (32 * 64 + 64 + 64 * 64 + 64 + 64 * 8 + 8)
    seqs = []
    for log in logs:
        check_structure(log)
        assert len(log.iterations) == DDP_STEPS
        for it in range(DDP_STEPS):
            ars = [c for c in comm(log) if c["iteration"] == it and c["op"] == "all_reduce"]
            assert ars, f"no gradient all_reduce in iteration {it}"
            assert sum(c["in_bytes"] for c in ars) == param_bytes
            assert len(ars) >= (1 if it == 0 else 2)  # buckets are rebuilt after step 0
            for c in ars:
                # DDP's reducer waits through the Future inside backward: the wait is placed
                # at the end of the backward pass, before the optimizer step's boundary.
                assert c["async_op"] and c["api"] == "allreduce" and c["reduce_op"] == "sum"
                w = log.nodes[c["wait_index"]]
                assert w["iteration"] == it
        # DDP's start: shape check (all_gather) and parameter broadcast from rank 0
        first = comm(log)[:3]
        assert [c["op"] for c in first] == ["all_gather", "broadcast", "broadcast"]
        assert all(c["peer"] == 0 for c in first[1:])
        seqs.append([(c["op"], c["seq"], c["shape"], c["iteration"]) for c in comm(log)])
    assert all(s == seqs[0] for s in seqs)


def test_ddp_values_unchanged_by_recording(runs):
    runs["ddp_plain"].ok()
    tmp = runs["tmp"]
    rec = torch.load(runs["ddp_out"] / "ddp_params.pt")
    plain = torch.load(tmp / "ddp_plain" / "ddp_params.pt")
    assert rec.keys() == plain.keys()
    for k in rec:
        assert torch.equal(rec[k], plain[k]), k
    # without PRISM_MODE the bootstrap installs nothing and writes no rank log
    assert not ranklog_path(runs["ddp_plain"].spool, 0).exists()


# ---- FSDP2 -------------------------------------------------------------------------------------
def test_fsdp2_rows(runs):
    logs = runs["fsdp2"].logs()
    for log in logs:
        check_structure(log)
        assert len(log.iterations) == FSDP_STEPS
        for it in range(FSDP_STEPS):
            cs = [c for c in comm(log) if c["iteration"] == it]
            ag = [c for c in cs if c["op"] == "all_gather"]
            rs = [c for c in cs if c["op"] == "reduce_scatter"]
            # two FSDP units (the root owns no parameters): gathered for forward and again
            # for backward, gradients reduce-scattered once each
            assert len(ag) == 4 and len(rs) == 2, [(c["op"], c["api"]) for c in cs]
            for c in ag:
                assert c["api"] in ("all_gather_single", "_allgather_base")
                assert c["out_bytes"] == N * c["in_bytes"]
            for c in rs:
                assert c["api"] in ("reduce_scatter_single", "_reduce_scatter_base")
                assert c["in_bytes"] == N * c["out_bytes"]
            assert sum(c["out_bytes"] for c in rs) == sum(c["in_bytes"] for c in ag) // 2


# ---- bootstrap: exit status, exceptions, mark/step ----------------------------------------------
def test_exit_code_is_the_programs(runs):
    ((rc, out),) = runs["exit3"].wait()
    assert rc == 3, out
    log = read_ranklog(ranklog_path(runs["exit3"].spool, 0))
    assert [c["op"] for c in comm(log)] == ["all_reduce"]


def test_exception_keeps_traceback_and_writes_log(runs):
    ((rc, out),) = runs["raise"].wait()
    assert rc == 1
    assert "RuntimeError: the program's own error" in out
    tb = out[out.index("Traceback") :]
    assert "bootstrap.py" not in tb and "runpy" not in tb, tb
    log = read_ranklog(ranklog_path(runs["raise"].spool, 0))
    (c,) = comm(log)
    assert c["label"] == "first" and c["iteration"] == 0
    assert len(log.iterations) == 1


def test_api_is_noop_outside_prism():
    import prismllm.api as api

    api.mark("x")
    api.step()  # nothing installed in this process: no error, no effect


def test_reduce_op_kept_as_its_name():
    """The recording wrappers keep "sum"/"avg" as strings (a ReduceOp read from the options
    would keep each call's options object alive), others as the ReduceOp: same names."""
    from prismllm.comm.recorder import redop_name
    from prismllm.comm.recording import _red

    ops = [dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX, dist.ReduceOp.PRODUCT]
    premul = getattr(dist.distributed_c10d, "_make_nccl_premul_sum", None)
    if premul is not None:
        ops.append(premul(2.0))
    for op in ops:
        o = torch._C._distributed_c10d.AllreduceOptions()
        o.reduceOp = op
        assert redop_name(_red(o)) == redop_name(o.reduceOp)
    o = torch._C._distributed_c10d.AllreduceOptions()
    o.reduceOp = dist.ReduceOp.SUM
    assert _red(o) == "sum"


def _device_clock_recorder(times: list[int]):
    """A Recorder whose every point takes the next of ``times`` as its device time (as resolved
    CUDA events would give): the node model of a GPU recording without a GPU."""
    from prismllm.comm.recorder import Recorder

    rec = Recorder(0, 2)
    rec.cuda = rec.cuda_live = True
    clock = iter(times)

    def cuda_point(_t: int) -> int:
        pid = rec._host_point(next(clock))
        rec.p_dev[pid] = 0  # device 0's
        return pid

    rec._cuda_point = cuda_point
    rec.start()
    return rec


@pytest.mark.parametrize("coalesced", [False, True])
def test_a_call_without_a_work_ends_the_compute_span_where_it_completed(coalesced):
    """A synchronous call whose backend returns no Work (NCCL in torch 2.11 runs a synchronous
    collective on the program's stream and returns none; a coalesced batch may end without one)
    completed where it returned, on the device clock the point after the return: the next compute
    span starts there. Opened at the issue point instead, that span counted the collective's
    time a second time (a TP2 recording on two H200s calibrated 36 % above its own iteration)."""
    from prismllm.comm.rows import node_rows

    # points: start 0, issue 100, completed 900, next issue 1000
    rec = _device_clock_recorder([0, 100, 900, 1000])
    args = ("all_reduce", "allreduce", "g", 0, -1, 0, "sum", "float32", [4], 16, 16, [], [], True)
    if coalesced:
        rec.begin_coalesce()
        j = rec.issue(*args)
        rec.issued(None, (j,), True)
        rec.complete_rows(rec.end_coalesce())
    else:
        j = rec.issue(*args)
        rec.issued(None, (j,), True)
    rec.issue("all_reduce", "allreduce", "g", 1, -1, 0, "sum", "float32", [4], 16, 16, [], [], True)
    rows = node_rows(rec)
    kinds = [(r["kind"], r["start_ns"], r["end_ns"]) for r in rows]
    assert kinds[:3] == [("compute", 0, 100), ("comm", 100, 900), ("compute", 900, 1000)], kinds


def test_one_work_without_a_device_time_leaves_the_others_timed():
    """An asynchronous call's transfer time is NCCL's own (``Work._get_duration``). A Work that
    has none (an error, or 0 ms) leaves that call's transfer ending at the wait, counted and
    named in the rank log's ``transfer_durations``, and every other call is still timed: one
    such Work at a DDP job's start (its setup calls) once turned timing off for the whole run."""

    class Inner:
        def __init__(self, ms):
            self.ms = ms

        def is_completed(self):
            return True

        def _get_duration(self):
            if isinstance(self.ms, Exception):
                raise self.ms
            return self.ms

    class Work:
        def __init__(self, ms):
            self._inner = Inner(ms)

    rec = _device_clock_recorder(list(range(0, 10_000, 100)))
    args = ["all_reduce", "allreduce", "g", 0, -1, 0, "sum", "float32", [4], 16, 16, [], [], True]
    rows = []
    for seq, ms in enumerate([RuntimeError("no events for this Work"), 0.0, 0.25, 0.5]):
        args[3] = seq
        j = rec.issue(*args)
        rec.issued(Work(ms), (j,), False)
        rows.append(j)
    rec._poll_durations(10)
    assert [rec.m_dur[j] for j in rows] == [-1, -1, 250_000, 500_000]
    got = rec.transfer_durations()
    assert got["read"] == 2 and got["missing"] == 2, got
    assert got["first_missing"].startswith("all_reduce #0 (Inner): RuntimeError: no events"), got


def test_an_emulation_holds_no_work_for_its_device_time():
    """Reading NCCL's time of an async call holds its Work until the device completes it, and
    the Work holds the program's tensors; a real process group lets go of them at wait(). So
    ``prism emulate`` reads none (the DTensor jobs' emulated sandbox peaked 0.6-2 GB over the
    real run on four H100s, in 128 MiB activations): a Work the program dropped is freed at
    once, its transfer ending where the program waited. Slices still read them (their timed
    graph's transfers)."""
    import gc
    import weakref

    from prismllm.childenv import ChildEnv
    from prismllm.comm.install import reads_transfer_durations
    from prismllm.comm.native.replay import ReplayRecorder

    class Inner:
        def is_completed(self):
            return False  # the device has not reached the call yet (the host is ahead)

    class Work:
        def __init__(self):
            self._inner = Inner()

    args = ["all_reduce", "allreduce", "g", 0, -1, 0, "sum", "float32", [4], 16, 16, [], [], True]
    for reads in (True, False):
        rec = _device_clock_recorder(list(range(0, 10_000, 100)))
        rec.durations_ok = reads
        w = Work()
        gone = weakref.ref(w._inner)
        j = rec.issue(*args)
        rec.issued(w, (j,), False)
        rec.outstanding.clear()  # the program waited on it and dropped it
        del w
        gc.collect()
        assert (gone() is None) is not reads, f"reads={reads}"
        # the native recorder's log replays through a Recorder that reads what the live one read
        assert ReplayRecorder(rec, {"p_host": [], "p_ns": [], "p_dev": []}).durations_ok is reads
    # what install() decides from what the launcher hands a slice's ranks, an emulation's, a recording's
    for child, reads in ((ChildEnv(mode="emulate", transfer_durations=True), True), (ChildEnv(mode="emulate"), False)):
        assert reads_transfer_durations("emulate", ChildEnv.from_env(child.to_env())) is reads
    assert reads_transfer_durations("record", ChildEnv(mode="record"))


def test_an_emulation_records_device_points_only_at_iteration_boundaries():
    """Each CUDA point is a timing event on the program's stream, device time between two
    kernels that the real run does not spend (a pruned 64 KB call 6 µs slower on an H200 with
    them). ``prism emulate`` (no transfer read) keeps the device's time of its iteration
    boundaries only; a slice or a recording keeps every point on the device."""
    from prismllm.childenv import ChildEnv
    from prismllm.comm.install import reads_transfer_durations

    args = ["all_reduce", "allreduce", "g", 0, -1, 0, "sum", "float32", [4], 16, 16, [], [], True]
    for every in (True, False):
        rec = _device_clock_recorder(list(range(0, 10**6, 100)))
        rec.all_points_on_device = every  # install(): reads_transfer_durations(mode, child)
        for it in range(2):
            for k in range(3):
                args[3] = 3 * it + k
                j = rec.issue(*args)
                rec.issued(None, (j,), True)
            rec.boundary(explicit=True)
        rec.finish()
        on_device = [p for p, d in enumerate(rec.p_dev) if d >= 0]
        if every:
            assert rec.clock == "cuda" and len(on_device) == len(rec.p_dev)
        else:  # start, the two boundaries, the finish
            boundaries = [0, *(it[2] for it in rec.iterations), len(rec.p_dev) - 1]
            assert rec.clock == "cuda-iterations" and on_device == boundaries, (on_device, boundaries)
    assert not reads_transfer_durations("emulate", ChildEnv(mode="emulate"))
    assert reads_transfer_durations("emulate", ChildEnv(mode="emulate", transfer_durations=True))


def test_device_points_asks_an_emulation_for_every_span_on_the_device(monkeypatch):
    """PRISM_DEVICE_POINTS=1: an emulated sandbox's spans timed on the device, as its slice's, to set
    them side by side; a slice and a recording keep every point there regardless."""
    from prismllm.childenv import ChildEnv
    from prismllm.comm.install import all_points_on_device

    monkeypatch.delenv("PRISM_DEVICE_POINTS", raising=False)
    assert not all_points_on_device("emulate", ChildEnv(mode="emulate"))
    assert all_points_on_device("record", ChildEnv(mode="record"))
    assert all_points_on_device("emulate", ChildEnv(mode="emulate", transfer_durations=True))
    monkeypatch.setenv("PRISM_DEVICE_POINTS", "1")
    assert all_points_on_device("emulate", ChildEnv(mode="emulate"))


def test_sandbox_ranks_record_nccl_timing_events_only_where_they_are_read():
    """NCCL's timing events cost the device time between two kernels, which the real job does
    not spend: a sandbox rank records them only where its transfers are read (prism time's GPU
    slices), never in prism emulate."""
    from prismllm.launch.sandbox import nccl_timing_env

    assert nccl_timing_env(cuda=True, transfer_durations=True) == {"TORCH_NCCL_ENABLE_TIMING": "1"}
    assert nccl_timing_env(cuda=True, transfer_durations=False) == {}
    assert nccl_timing_env(cuda=False, transfer_durations=True) == {}


def test_a_backward_pass_settles_its_waits_after_every_final_callback_queued_in_it():
    """The waits a program makes inside the autograd engine (DDP's reducer) are settled by a
    final callback the recorder queues at the pass's first call; DDP queues the callback that
    waits for its buckets later, at its last bucket. The settling must run after it, where the
    program's stream stands after those waits."""
    torch = pytest.importorskip("torch")
    rec = _device_clock_recorder(list(range(0, 100_000, 100)))
    order = []
    rec._settle = lambda works, p=-1: order.append("settled")
    engine = torch.autograd.Variable._execution_engine

    def first_call(g):  # the recorder sees the pass's first call here
        rec._check_backward()
        return g

    def last_bucket(g):  # and DDP queues its wait on every bucket here, later in the pass
        engine.queue_callback(lambda: order.append("program's final callback"))
        return g

    x = torch.ones(3, requires_grad=True)
    a = x * 2
    a.register_hook(last_bucket)
    b = a * 3
    b.register_hook(first_call)
    b.sum().backward()
    assert order == ["program's final callback", "settled"], order
