"""`prism capture --mode solo`: layout and replica classes, running the representatives G at
a time, resume, and assembly of the N-rank graph from renamed representatives.

Until the solo backend lands these run against a stand-in runner (``fake_solo``, written into
tmp_path): for ``python -m fake_solo SCRIPT --tp T --pp P --ep E`` it writes the RankLog that a
Megatron-style program (gpt3d's group creation order and rank order) would give for that rank,
computed from the rank's own coordinates. So a capture with every rank run (no --layout) is
the ground truth for the deduplicated one. The captures of real programs through the solo
backend are in test_capture_solo_programs.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import numpy as np
import pytest

from prismllm.capture.solo import STATE_FILE, CaptureOptions, capture
from prismllm.cli import main as climain
from prismllm.errors import PrismError
from prismllm.layout import Layout, replica_plan
from prismllm.trace import PrismTrace, compare_traces, validate

FAKE_RUNNER = r'''
"""Stand-in for the solo backend: writes the RankLog of a fake Megatron-style program."""
import os, sys, time
from prismllm.trace.ranklog import GroupInfo, RankLog, write_ranklog

def arg(name, default):
    a = sys.argv[2:]
    return int(a[a.index(name) + 1]) if name in a else default

def main():
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    tp, pp, ep, iters = arg("--tp", 1), arg("--pp", 1), arg("--ep", 1), arg("--iters", 2)
    dp = world // (tp * pp); edp = dp // ep
    t, d, p = rank % tp, (rank // tp) % dp, rank // (tp * dp)
    e = d % ep
    if os.environ.get("FAKE_RUN_LOG"):
        with open(os.environ["FAKE_RUN_LOG"], "a") as f:
            f.write(f"{rank}\n")
    def g(p_, d_, t_):
        return (p_ * dp + d_) * tp + t_
    # gpt3d's new_group order; every rank counts every group, lists only its own
    groups, mine, counter = [GroupInfo("0", "default_pg", list(range(world)))], {}, [0]
    def make(ranks, attr):
        counter[0] += 1
        if rank in ranks:
            groups.append(GroupInfo(str(counter[0]), "undefined", ranks)); mine[attr] = (str(counter[0]), ranks)
    for p_ in range(pp):
        for t_ in range(tp): make([g(p_, d_, t_) for d_ in range(dp)], "dp")
    for p_ in range(pp):
        for d_ in range(dp): make([g(p_, d_, t_) for t_ in range(tp)], "tp")
    for d_ in range(dp):
        for t_ in range(tp): make([g(p_, d_, t_) for p_ in range(pp)], "pp")
    for p_ in range(pp):
        for t_ in range(tp):
            for j in range(edp): make([g(p_, j * ep + x, t_) for x in range(ep)], "ep")
            for x in range(ep): make([g(p_, j * ep + x, t_) for j in range(edp)], "edp")
    nodes, iters_out = [], []
    def node(op, group="", **kw):
        n = {"index": len(nodes), "op": op, "group_name": group, "dtype": "float32" if op != "compute" else ""}
        n.update(kw); nodes.append(n); return n
    tpn, tpr = mine["tp"]; dpn, dpr = mine["dp"]; epn, epr = mine["ep"]; edpn, edpr = mine["edp"]
    for it in range(iters):
        t0 = time.time_ns()
        node("compute", iteration=it, duration_ns=1000)
        if tp > 1:
            node("broadcast", tpn, iteration=it, peer=tpr[0], in_bytes=64 if rank == tpr[0] else 0, out_bytes=0 if rank == tpr[0] else 64)
            node("all_reduce", tpn, iteration=it, in_bytes=256, out_bytes=256, reduce_op="sum")
        if p > 0:
            node("recv", "0", iteration=it, peer=g(p - 1, d, t), out_bytes=128)
        node("compute", iteration=it)
        if p < pp - 1:
            node("send", "0", iteration=it, peer=g(p + 1, d, t), in_bytes=128)
        if ep > 1:
            ins = [1 + e + 2 * x for x in range(ep)]; outs = [1 + x + 2 * e for x in range(ep)]
            if os.environ.get("FAKE_BAD_SPLITS"):  # peers' counts generated, not the truth
                outs = [5] * ep
            node("all_to_all", epn, iteration=it, in_splits=ins, out_splits=outs, in_bytes=16 * sum(ins), out_bytes=16 * sum(outs))
        if dp > 1:
            a = node("all_reduce", dpn, iteration=it, in_bytes=512, out_bytes=512, reduce_op="avg", async_op=True)
            node("compute", iteration=it)
            a["wait_index"] = len(nodes)
            node("broadcast", dpn, iteration=it, peer=dpr[0], in_bytes=32 if rank == dpr[0] else 0, out_bytes=0 if rank == dpr[0] else 32)
        if edp > 1 and ep > 1:
            node("all_reduce", edpn, iteration=it, in_bytes=48, out_bytes=48, reduce_op="sum")
        node("all_reduce", "0", iteration=it, in_bytes=4, out_bytes=4, reduce_op="sum")
        node("compute", iteration=it)
        iters_out.append({"iteration": it, "start_ns": t0, "end_ns": time.time_ns(), "label": ""})
    log = RankLog(rank=rank, world_size=world, device="cpu", clock="host", nodes=nodes, groups=groups,
                  iterations=iters_out, peak_memory_bytes=1000 + 100 * p + 10 * t + e)
    write_ranklog(os.environ["PRISM_SPOOL"], log)
    if os.environ.get("FAKE_FAIL_RANK") == str(rank):
        print(f"fake program: rank {rank} fails on purpose", file=sys.stderr)
        sys.exit(3)
    print(f"fake rank {rank} done")

main()
'''


@pytest.fixture
def fake(tmp_path):
    """(options factory, script, run log): captures through the stand-in runner."""
    mod = tmp_path / "fakemods"
    mod.mkdir()
    (mod / "fake_solo.py").write_text(FAKE_RUNNER)
    script = tmp_path / "fake_prog.py"
    script.write_text("# the stand-in runner does not execute this file\n")
    runlog = tmp_path / "ran.txt"
    pythonpath = os.pathsep.join([str(mod), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)

    def opts(out, world, args=(), *, env=None, **kw):
        e = {"PYTHONPATH": pythonpath, "FAKE_RUN_LOG": str(runlog), **(env or {})}
        return CaptureOptions(
            world=world,
            out=out,
            script=str(script),
            args=[str(a) for a in args],
            runner="fake_solo",
            env=e,
            devices="cpu",
            sink=lambda *a: None,
            **kw,
        )

    def ran() -> list[int]:
        return [int(x) for x in runlog.read_text().split()] if runlog.exists() else []

    return opts, script, ran


# ---------------------------------------------------------------------- layout
def test_layout_coordinates_follow_gpt3d_rank_order():
    lay = Layout.parse("tp=2,pp=2,ep=2", 16)
    assert (lay.dp, lay.edp) == (4, 2)
    for r in range(16):
        tp, dp, pp = r % 2, (r // 2) % 4, r // 8  # gpt3d: rank = (pp*dp + dp_rank)*tp + tp_rank
        c = lay.coords(r)
        assert (c["tp"], c["dp"], c["pp"], c["ep"], c["edp"]) == (tp, dp, pp, dp % 2, dp // 2)


def test_replica_classes_cover_every_tp_cp_ep_pp_coordinate():
    lay = Layout.parse("tp=2,pp=2,ep=2", 16)
    plan = replica_plan(lay)
    c = lay.coords_array()
    rep_coords = {(c["tp"][r], c["cp"][r], c["ep"][r], c["pp"][r]) for r in plan.representatives}
    assert len(rep_coords) == len(plan.representatives) == 8
    all_coords = {(c["tp"][r], c["cp"][r], c["ep"][r], c["pp"][r]) for r in range(16)}
    assert rep_coords == all_coords
    for r in range(16):
        rep = plan.replica_of[r]
        assert (c["tp"][r], c["ep"][r], c["pp"][r]) == (c["tp"][rep], c["ep"][rep], c["pp"][rep])
        assert plan.rename(plan.map_of[r], rep) == r
    # a rename is a permutation of the world
    for j in range(1, lay.edp):
        assert sorted(lay.shift(j, np.arange(16)).tolist()) == list(range(16))
    # dense: 1024 ranks, tp=2 pp=8 -> 16 representatives, dp=64 replicas each
    plan = replica_plan(Layout.parse("tp=2,pp=8", 1024))
    assert len(plan.representatives) == 16 and len(plan.classes()[0]) == 64


def test_layout_errors_are_one_clear_message():
    with pytest.raises(PrismError, match="does not divide --world 10"):
        Layout.parse("tp=2,pp=2", 10)
    with pytest.raises(PrismError, match="ep=3 does not divide dp"):
        Layout.parse("tp=2,ep=3", 8)
    with pytest.raises(PrismError, match="unknown key 'tpp'"):
        Layout.parse("tpp=2", 8)
    with pytest.raises(PrismError, match="lacks pp"):
        Layout.parse("pp=2,order=tp-dp", 8)
    with pytest.raises(PrismError, match="dp=3"):
        Layout.parse("tp=2,dp=3", 8)


def test_layout_order_changes_coordinates():
    lay = Layout.parse("tp=2,pp=2,order=tp-pp-dp", 8)  # pp before dp
    assert lay.coords(2) == {"tp": 0, "cp": 0, "ep": 0, "edp": 0, "pp": 1, "dp": 0}
    assert replica_plan(lay).representatives == [0, 1, 2, 3]


# ---------------------------------------------------------------------- dedup equals ground truth
LAYOUTS = [
    ("tp=2,pp=2", 8, ["--tp", 2, "--pp", 2]),
    ("tp=2,pp=2,ep=2", 16, ["--tp", 2, "--pp", 2, "--ep", 2]),
    ("pp=2", 8, ["--pp", 2]),
]


@pytest.mark.parametrize("layout,world,args", LAYOUTS, ids=[x[0] for x in LAYOUTS])
def test_dedup_graph_equals_all_ranks_graph(fake, tmp_path, layout, world, args):
    opts, _, ran = fake
    full = capture(opts(tmp_path / "full", world, args, parallel=4))
    assert sorted(ran()) == list(range(world)) and not full.dedup
    n_full = len(ran())
    dedup = capture(opts(tmp_path / "dedup", world, args, parallel=4, layout=layout))
    reps = replica_plan(Layout.parse(layout, world)).representatives
    assert sorted(ran()[n_full:]) == reps and dedup.dedup and dedup.ranks_run == len(reps) < world
    a, b = PrismTrace.load(tmp_path / "full"), PrismTrace.load(tmp_path / "dedup")
    validate(b)
    res = compare_traces(a, b, timing=False)
    assert res.structure_equal, res.first_difference
    # the same groups (by members), the same sync structure
    ga = sorted(tuple(r) for r in a.groups.column("ranks").to_pylist())
    gb = sorted(tuple(r) for r in b.groups.column("ranks").to_pylist())
    assert ga == gb
    assert a.edges.num_rows == b.edges.num_rows
    kinds = lambda t: sorted(t.edges.column("kind").to_pylist())  # noqa: E731
    assert kinds(a) == kinds(b)
    assert a.iterations.num_rows == b.iterations.num_rows
    # peak memory: every rank has one; replicas inherit their representative's (= the truth here)
    assert a.manifest["peak_memory_bytes"] == b.manifest["peak_memory_bytes"]
    cap = b.manifest["capture"]
    assert cap["representatives"] == reps and cap["ranks_run"] == len(reps) and cap["dedup"]
    assert len(cap["replica_of"]) == world and b.manifest["mode"] == "solo"
    assert b.manifest["layout"]["dp"] == world // (2 * 2 if "tp=2" in layout else 2)
    assert not (tmp_path / "dedup" / ".spool").exists()


def test_all_to_all_splits_reconciled_senders_win(fake, tmp_path):
    opts, _, _ = fake
    args = ["--tp", 2, "--pp", 2, "--ep", 2]
    truth = capture(opts(tmp_path / "truth", 16, args, parallel=4, layout="tp=2,pp=2,ep=2"))
    assert truth.manifest["capture"]["all_to_all_reconciled"] == 0
    bad = capture(opts(tmp_path / "bad", 16, args, parallel=4, layout="tp=2,pp=2,ep=2", env={"FAKE_BAD_SPLITS": "1"}))
    assert bad.manifest["capture"]["all_to_all_reconciled"] > 0
    a, b = PrismTrace.load(tmp_path / "truth"), PrismTrace.load(tmp_path / "bad")
    validate(b)
    res = compare_traces(a, b, timing=False)
    assert res.structure_equal, res.first_difference


def test_replica_renaming_of_groups_peers_roots_and_streams(fake, tmp_path):
    opts, _, _ = fake
    capture(opts(tmp_path / "g", 8, ["--tp", 2, "--pp", 2], parallel=2, layout="tp=2,pp=2"))
    t = PrismTrace.load(tmp_path / "g")
    info = t.group_info()
    rows = t.nodes.to_pylist()
    by_rank = {r: [n for n in rows if n["rank"] == r and n["kind"] == "comm"] for r in range(8)}
    # rank 2 is rank 0's DP replica (dp 1): its TP group is {2, 3}, its TP broadcast's root is 2
    tp_bcast = by_rank[2][0]
    assert tp_bcast["op"] == "broadcast" and info[tp_bcast["group"]]["ranks"] == [2, 3] and tp_bcast["peer"] == 2
    assert tp_bcast["stream"] == f"comm:{tp_bcast['group']}"
    # its send goes to its own next stage, rank 6
    send = next(n for n in by_rank[2] if n["op"] == "send")
    assert send["peer"] == 6
    # the DP group is shared with the representative; the DP broadcast keeps root 0
    dp_bcast = [n for n in by_rank[2] if n["op"] == "broadcast"][1]
    assert info[dp_bcast["group"]]["ranks"] == [0, 2] and dp_bcast["peer"] == 0
    # the replicas' groups nobody ran are new groups named after the representative's
    names = {g["name"] for g in info.values()}
    assert any("@" in n for n in names)


# ---------------------------------------------------------------------- resume
def test_failure_names_rank_keeps_spool_and_resume_skips_done(fake, tmp_path):
    opts, _, ran = fake
    out = tmp_path / "cap"
    args = ["--tp", 2, "--pp", 2]
    with pytest.raises(PrismError) as ei:
        capture(opts(out, 8, args, parallel=2, layout="tp=2,pp=2", env={"FAKE_FAIL_RANK": "4"}))
    msg = str(ei.value)
    assert "rank 4" in msg and "re-run the same command to resume" in msg
    state = json.loads((out / ".spool" / STATE_FILE).read_text())
    # batch [0, 1] finished; in batch [4, 5] rank 4 failed (5 may have finished first)
    assert state["done"][:2] == [0, 1] and 4 not in state["done"]
    assert (out / ".spool" / "rank-000004.msgpack").exists()  # kept for diagnosis
    first = ran()
    # the same command resumes: only the unfinished representatives run
    res = capture(opts(out, 8, args, parallel=2, layout="tp=2,pp=2"))
    todo = sorted(set([0, 1, 4, 5]) - set(state["done"]))
    assert sorted(ran()[len(first) :]) == todo
    assert res.ranks_run == len(todo) and res.ranks_resumed == 4 - len(todo)
    assert res.manifest["capture"]["runs"] == 2
    validate(PrismTrace.load(out))


def test_resume_refuses_another_command_and_force_starts_over(fake, tmp_path):
    opts, _, ran = fake
    out = tmp_path / "cap"
    with pytest.raises(PrismError):
        capture(opts(out, 8, ["--tp", 2, "--pp", 2], parallel=2, layout="tp=2,pp=2", env={"FAKE_FAIL_RANK": "1"}))
    with pytest.raises(PrismError, match=r"another command.*layout.*--force"):
        capture(opts(out, 8, ["--tp", 2, "--pp", 2], parallel=2, layout="tp=2,pp=2,order=tp-pp-dp"))
    with pytest.raises(PrismError, match=r"world 8 -> 16"):
        capture(opts(out, 16, ["--tp", 2, "--pp", 2], parallel=2, layout="tp=2,pp=2"))
    n = len(ran())
    res = capture(opts(out, 8, ["--tp", 2, "--pp", 2], parallel=4, layout="tp=2,pp=4", force=True))
    assert res.ranks_run == 8 and res.ranks_resumed == 0 and sorted(ran()[n:]) == list(range(8))
    # a finished graph is not overwritten without --force
    with pytest.raises(PrismError, match="already holds a graph"):
        capture(opts(out, 8, ["--tp", 2, "--pp", 2], parallel=4, layout="tp=2,pp=4"))


def test_bad_inputs(fake, tmp_path):
    opts, _, _ = fake
    with pytest.raises(PrismError, match="does not divide"):
        capture(opts(tmp_path / "a", 12, parallel=2, layout="tp=8"))
    with pytest.raises(PrismError, match="--parallel must be at least 1"):
        capture(opts(tmp_path / "a", 8, parallel=0))
    with pytest.raises(PrismError, match="--rules"):
        capture(opts(tmp_path / "a", 8, rules=tmp_path / "nope.yaml"))
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "x").write_text("x")
    with pytest.raises(PrismError, match="refusing"):
        capture(opts(tmp_path / "junk", 8, force=True))
    assert not (tmp_path / "a").exists()


def test_a_layout_the_program_does_not_follow_is_one_line(fake, tmp_path):
    """--layout tp=2 for a program run as --tp 4: rank 2, a DP replica of rank 0 for the layout, is in
    the program's tensor-parallel group 0-3, which no renaming of rank 0's groups gives it."""
    opts, _, _ = fake
    with pytest.raises(PrismError) as e:
        capture(opts(tmp_path / "c", 8, ["--tp", 4], parallel=2, layout="tp=2"))
    assert str(e.value) == (
        "--layout and the program disagree: the layout makes tp=2, dp=4 of 8 ranks, but the program made a group "
        "of 4 ranks (0-3) across tp and dp of the layout, which has no such group; give --layout the program's "
        "own parallel sizes"
    )
    assert type(e.value) is PrismError  # a usage error (exit 2), not a damaged input


# ---------------------------------------------------------------------- CLI
def test_cli_capture(fake, tmp_path, monkeypatch, capsys):
    opts, script, _ = fake
    base = opts(tmp_path / "unused", 1)
    monkeypatch.setattr(
        "prismllm.cli.capture.capture",
        lambda o, **kw: capture(dataclasses.replace(o, runner=base.runner, env=base.env), **kw),
    )
    out = tmp_path / "cli"
    rc = climain.main(
        [
            "capture",
            "--mode",
            "solo",
            "--world",
            "8",
            "--devices",
            "cpu",
            "--parallel",
            "2",
            "--out",
            str(out),
            "--layout",
            "tp=2,pp=2",
            "--",
            str(script),
            "--tp",
            "2",
            "--pp",
            "2",
        ]
    )
    o, e = capsys.readouterr()
    assert rc == 0, e
    assert "4 of 8 ranks run" in e and "4/4 ranks done" in e
    assert "captured" in o and "representatives" in o
    m = json.loads((out / "manifest.json").read_text())
    assert m["argv"][:2] == ["prism", "capture"] and m["capture"]["representatives"] == [0, 1, 4, 5]
    # --json: stdout is the result alone; the program's lines and the progress go to stderr
    rc = climain.main(["capture", "--world", "8", "--devices", "cpu", "--parallel", "2", "--out", str(tmp_path / "j"),
                       "--layout", "tp=2,pp=2", "--json", "--", str(script), "--tp", "2", "--pp", "2"])  # fmt: skip
    o, e = capsys.readouterr()
    res = json.loads(o)
    assert rc == 0 and res["out"] == str(tmp_path / "j") and res["representatives"] == [0, 1, 4, 5]
    assert res["world_size"] == 8 and res["ranks_run"] == 4 and res["dedup"] and "run_s" in res["timings"]
    assert "fake rank 0 done" in e and "4/4 ranks done" in e
    # no layout: said so
    rc = climain.main(
        [
            "capture",
            "--world",
            "4",
            "--devices",
            "cpu",
            "--parallel",
            "4",
            "--out",
            str(tmp_path / "nl"),
            "--",
            str(script),
            "--tp",
            "2",
        ]
    )
    o, e = capsys.readouterr()
    assert rc == 0 and "all 4 ranks run (no --layout: no replica deduplication)" in e
    # errors: one line
    rc = climain.main(
        [
            "capture",
            "--world",
            "10",
            "--devices",
            "cpu",
            "--out",
            str(tmp_path / "x"),
            "--layout",
            "tp=4",
            "--",
            str(script),
        ]
    )
    o, e = capsys.readouterr()
    assert rc == 2 and e.strip().count("\n") == 0 and "does not divide --world 10" in e


# ---------------------------------------------------------------------- scale (columnar expansion)
def test_expansion_to_1024_ranks_is_fast(fake, tmp_path):
    """16 representatives -> 1024 ranks: assemble, validate, save and load in seconds."""
    import time

    opts, _, _ = fake
    res = capture(opts(tmp_path / "big", 1024, ["--tp", 2, "--pp", 8], parallel=2, layout="tp=2,pp=8"))
    assert res.ranks_run == 16
    t = res.timings
    assert t["assemble_s"] + t["validate_s"] + t["save_s"] < 60, t
    t0 = time.monotonic()
    g = PrismTrace.load(tmp_path / "big")
    assert time.monotonic() - t0 < 10
    assert g.world_size == 1024 and len(g.ranks()) == 1024


# ---------------------------------------------------------------------- devices
def test_a_gpu_list_is_a_pool(monkeypatch):
    """--parallel G takes the first G of a longer --devices list (prism run hands capture, time and
    emulate the same list); a shorter list is refused."""
    import prismllm.capture.common as common
    from prismllm.capture.solo import _parallel_and_devices

    monkeypatch.setattr(common, "cuda_info", lambda: (True, 1))
    opts = CaptureOptions(world=8, out="o", script="s", devices="cuda:0,0,0,0", parallel=2)
    assert _parallel_and_devices(opts) == (2, "cuda", [0, 0])
    with pytest.raises(PrismError, match=r"lists 1 GPU\(s\) for --parallel 2"):
        _parallel_and_devices(CaptureOptions(world=8, out="o", script="s", devices="cuda:0", parallel=2))
    # auto with more ranks at a time than GPUs shares them, as the slices of `prism run` will: a
    # capture on the CPU gave a graph (fp32) that its GPU slices (bf16) deviated from
    assert _parallel_and_devices(CaptureOptions(world=8, out="o", script="s", parallel=3)) == (3, "cuda", [0, 0, 0])


def test_every_visible_gpu_runs_a_rank_or_a_slice_by_default(monkeypatch):
    """Without --parallel, `cuda` and `auto` use every GPU the machine has: capture a rank on
    each, time a slice (sandbox GPUs and the assistant's) on each slice's worth. One at a time, a
    32-rank demo took 2 min 50 s on four H100s against 49 s on a 2-core VM (a rank's CUDA and
    NCCL start-up is seconds). No GPU, a graph captured with --cuda-on-cpu, or --devices cpu:
    one at a time."""
    import prismllm.capture.common as common
    import prismllm.capture.solo as solo
    import prismllm.launch.sandbox as sandbox
    import prismllm.time.slices as slices

    for gpus in (4, 0):
        monkeypatch.setattr(common, "cuda_info", lambda n=gpus: (n > 0, n))
        monkeypatch.setattr(sandbox, "cuda_count", lambda n=gpus: n)
        for devices in ("auto", "cuda"):
            opts = CaptureOptions(world=32, out="o", script="s", devices=devices)
            if gpus:
                assert solo._parallel_and_devices(opts) == (4, "cuda", [0, 1, 2, 3])
            elif devices == "auto":
                assert solo._parallel_and_devices(opts) == (1, "cpu", "cpu")
            t = slices.TimeOptions(graph="g", out="o", script="s", devices=devices)
            assert slices._parallel(t) == (2 if gpus else 1)
            assert slices._parallel(dataclasses.replace(t, slice_size=3)) == 1  # 3 sandbox GPUs + 1 a slice
            assert slices._parallel(t, cuda_on_cpu=True) == 1
        cpu = CaptureOptions(world=32, out="o", script="s", devices="cpu")
        assert solo._parallel_and_devices(cpu) == (1, "cpu", "cpu")
        assert solo._parallel_and_devices(dataclasses.replace(cpu, devices="auto", cuda_on_cpu=True))[0] == 1
        assert slices._parallel(slices.TimeOptions(graph="g", out="o", script="s", devices="cpu")) == 1


def test_a_roots_small_broadcast_is_kept_for_its_members_and_the_replicas(tmp_path):
    """The root of a small broadcast keeps it in the capture's spool; a member reads it (the root
    ran before it), and after the capture, the graph's copy answers a replica's group through the
    representatives' (``capture.replica_of``). A tensor over the bound is not kept, and a member
    of that size does not wait for one."""
    import torch

    from prismllm.comm.solo_objects import KEPT_BROADCAST_BYTES, CapturedMessages, SharedObjects
    from prismllm.generate.generator import Call

    def call(rank: int, index: int, t: torch.Tensor) -> Call:
        return Call(rank=rank, op="broadcast", api="broadcast", group_ranks=(2, 3), group_desc="",
                    group_name="tp", group_rank=rank - 2, index=index, label="", root=2, is_root=rank == 2,
                    input=t if rank == 2 else None, output=None if rank == 2 else t)  # fmt: skip

    ids = torch.arange(6, dtype=torch.int64).reshape(2, 3) * 11
    big = torch.ones(KEPT_BROADCAST_BYTES // 4 + 1)
    root = SharedObjects(str(tmp_path), (2,), wait_s=30.0)
    root.keep_broadcast(call(2, 4, ids))
    root.keep_broadcast(call(2, 5, big))
    member = SharedObjects(str(tmp_path), (3,), wait_s=30.0)  # its root ran in an earlier batch
    assert torch.equal(member.broadcast(call(3, 4, torch.empty(2, 3, dtype=torch.int64))), ids)
    beside = SharedObjects(str(tmp_path), (2, 3), wait_s=30.0)  # its root runs beside it: would wait
    t0 = time.monotonic()
    assert beside.broadcast(call(3, 5, torch.empty_like(big))) is None and time.monotonic() - t0 < 5  # none so big
    assert member.broadcast(call(3, 6, torch.empty(2, 3, dtype=torch.int64))) is None  # kept none: no wait
    graph = CapturedMessages(tmp_path / "objects", replica_of=[0, 1, 2, 3, 0, 1, 2, 3])
    assert torch.equal(graph.broadcast((6, 7), 4, 6), ids)  # replicas 6, 7 of 2, 3
    assert graph.broadcast((3, 7), 4, 3) is None  # a group across replicas: no capture ran it
