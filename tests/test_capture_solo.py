"""`prism capture --mode solo`: layout and replica classes, running the representatives G at
a time, resume, and assembly of the N-rank graph from renamed representatives.

Until the solo backend lands these run against a stand-in runner (``fake_solo``, written into
tmp_path): for ``python -m fake_solo SCRIPT --tp T --pp P --ep E`` it writes the RankLog that a
Megatron-style program (gpt3d's group creation order and rank order) would give for that rank,
computed from the rank's own coordinates. So a capture with every rank run (no --layout) is
the ground truth for the deduplicated one. The end-to-end test against the real backend is
skipped while ``prismllm.comm.solo`` does not exist.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import PRISM

from prismllm.capture.solo import STATE_FILE, CaptureOptions, capture
from prismllm.cli import main as climain
from prismllm.errors import PrismError
from prismllm.layout import Layout, replica_plan
from prismllm.trace import PrismTrace, compare_traces, validate

ROOT = Path(__file__).resolve().parents[1]

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


# ---------------------------------------------------------------------- real backend
GPT3D_TINY = [
    "--layers",
    "4",
    "--hidden",
    "32",
    "--heads",
    "4",
    "--seq",
    "16",
    "--vocab",
    "128",
    "--micro-batch",
    "1",
    "--global-batch",
    "8",
    "--iters",
    "2",
    "--bucket-mb",
    "0.01",
]


def test_gpt3d_solo_capture_matches_record(tmp_path, gpt3d_recording):
    """The real 8-rank TP2·PP2·DP2 recording (test_record_gpt3d's, shared) against a solo
    capture of the same command, 2 ranks at a time."""
    from test_record_gpt3d import program, recording

    prism = PRISM
    gpt3d = str(ROOT / "examples" / "gpt3d.py")
    prog = [gpt3d, *program("tp2pp2dp2")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    rec = recording(gpt3d_recording, "tp2pp2dp2").out
    cap = subprocess.run(
        [
            prism,
            "capture",
            "--mode",
            "solo",
            "--world",
            "8",
            "--devices",
            "cpu",
            "--parallel",
            "2",
            "--layout",
            "tp=2,pp=2",
            "--out",
            str(tmp_path / "cap"),
            "--",
            *prog,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert cap.returncode == 0, cap.stderr[-3000:]
    a, b = PrismTrace.load(rec), PrismTrace.load(tmp_path / "cap")
    res = compare_traces(a, b, timing=False)
    assert res.structure_equal, json.dumps(res.first_difference, indent=1, default=str)
    assert b.manifest["capture"]["ranks_run"] == 4


def test_gpt3d_switch_capture_is_the_real_run(tmp_path, gpt3d_recording):
    """The 8-rank TP2·PP2·DP2 recording (test_record_gpt3d's, shared) against a switch capture of
    the same command, two ranks running at a time: the same graph, and the same losses (the
    coordinator's sums in member order against gloo's)."""
    from test_record_gpt3d import program, recording

    rec = recording(gpt3d_recording, "tp2pp2dp2")
    log = tmp_path / "switch.json"
    p = subprocess.run(
        [PRISM, "capture", "--mode", "switch", "--world", "8", "--parallel", "2", "--devices", "cpu", "--out", str(tmp_path / "cap"),
         "--timeout", "600", "--", str(ROOT / "examples" / "gpt3d.py"), *program("tp2pp2dp2"), "--json-log", str(log)],
        capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=900,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    res = compare_traces(PrismTrace.load(rec.out), PrismTrace.load(tmp_path / "cap"), timing=False)
    assert res.structure_equal, json.dumps(res.first_difference, indent=1, default=str)
    got = json.loads(log.read_text())
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in rec.log], rel=1e-5)
    m = PrismTrace.load(tmp_path / "cap").manifest
    assert m["mode"] == "switch" and m["capture"]["ranks_run"] == 8 and m["capture"]["switches"] > 0


def test_moe_solo_capture_replays_saved_tensors(tmp_path):
    """MoE routing depends on values: generated outputs give other split sizes than the real
    run; `prism record --save-tensors all` + `prism capture --tensors` reproduce them exactly."""
    prog = [str(ROOT / "examples" / "gpt3d.py"), "--ep", "2", "--num-experts", "4", *GPT3D_TINY]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    rec = subprocess.run(
        [
            PRISM,
            "record",
            "--nproc",
            "2",
            "--devices",
            "cpu",
            "--out",
            str(tmp_path / "rec"),
            "--save-tensors",
            "all",
            "--",
            *prog,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert rec.returncode == 0, rec.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "rec" / "tensors").iterdir()) == [
        "manifest.json",  # sealed once the ranks exited
        "rank-000000.bin",
        "rank-000000.idx",
        "rank-000001.bin",
        "rank-000001.idx",
    ]
    real = PrismTrace.load(tmp_path / "rec")
    for name, extra in (("gen", []), ("store", ["--tensors", str(tmp_path / "rec" / "tensors")])):
        cap = subprocess.run(
            [
                PRISM,
                "capture",
                "--mode",
                "solo",
                "--world",
                "2",
                "--devices",
                "cpu",
                "--parallel",
                "2",
                "--out",
                str(tmp_path / name),
                *extra,
                "--",
                *prog,
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )
        assert cap.returncode == 0, cap.stderr[-3000:]
        res = compare_traces(real, PrismTrace.load(tmp_path / name), timing=False)
        if name == "gen":  # generated routing counts are not the real ones
            assert not res.structure_equal and res.first_difference["node_a"]["op"] == "all_to_all"
        else:
            assert res.structure_equal, json.dumps(res.first_difference, indent=1, default=str)


def test_record_save_tensors_bad_selector(tmp_path, capsys):
    script = tmp_path / "prog.py"
    script.write_text("print('never run')\n")
    code = climain.main(
        [
            "record",
            "--nproc",
            "1",
            "--out",
            str(tmp_path / "o"),
            "--save-tensors",
            "all_reduce,allreduce",
            "--",
            str(script),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "bad --save-tensors 'all_reduce,allreduce': unknown op(s) allreduce" in err
    assert not (tmp_path / "o").exists()


def test_tensor_store_with_expert_parallel_runs_every_rank(tmp_path):
    """Recorded values make expert-DP replicas route their own tokens: no dedup with --tensors
    (dense layouts keep it: their sizes never depend on values)."""
    from prismllm.capture.solo import plan_capture

    script = tmp_path / "prog.py"
    script.write_text("pass\n")
    (tmp_path / "store").mkdir()
    moe = CaptureOptions(
        world=16,
        out=tmp_path / "a",
        script=str(script),
        layout="tp=2,ep=4",
        parallel=2,
        devices="cpu",
        tensors=tmp_path / "store",
    )
    plan, _, _ = plan_capture(moe)
    assert plan.replicas.representatives == list(range(16))
    assert "each rank replays its own recorded routing" in plan.replicas.describe()
    plan, _, _ = plan_capture(dataclasses.replace(moe, tensors=None))
    assert len(plan.replicas.representatives) == 8 and "copy its all-to-all split sizes" in plan.replicas.describe()
    plan, _, _ = plan_capture(dataclasses.replace(moe, layout="tp=2,pp=2"))
    assert len(plan.replicas.representatives) == 4


def test_record_saves_inputs_at_issue(tmp_path):
    """`--save-tensors all,inputs`: each call's inputs are saved before the backend overwrites
    them in place, so every TP all-reduce's output is the sum (or max) of the ranks' inputs."""
    from prismllm.generate.store import TensorStore

    prog = [str(ROOT / "examples" / "gpt3d.py"), "--tp", "2", *GPT3D_TINY[:-4], "--iters", "1"]
    rec = subprocess.run(
        [
            PRISM,
            "record",
            "--nproc",
            "2",
            "--devices",
            "cpu",
            "--out",
            str(tmp_path / "rec"),
            "--save-tensors",
            "all_reduce,inputs",
            "--",
            *prog,
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=600,
    )
    assert rec.returncode == 0, rec.stderr[-3000:]
    stores = [TensorStore(tmp_path / "rec" / "tensors", r) for r in (0, 1)]
    keys = [k for k in stores[0].entries if k[5] == "in"]
    assert len(keys) > 10 and {k[2] for k in keys} == {"all_reduce"}
    ops = set()
    for g, ranks, op, index, peer, _io in keys:
        ins = [s.get(g, ranks, op, index, peer, io="in")[0].double() for s in stores]
        out = stores[0].get(g, ranks, op, index, peer)[0].double()
        if torch.allclose(out, ins[0] + ins[1], rtol=1e-5, atol=1e-6):
            ops.add("sum")
        else:
            assert torch.equal(out, torch.maximum(*ins)), (g, index)
            ops.add("max")
    assert ops == {"sum", "max"}  # vocab-parallel cross-entropy uses both


SPMD_STARTUP = str(Path(__file__).resolve().parent / "programs" / "spmd_startup.py")


@pytest.mark.parametrize("parallel", [2, 1])
def test_solo_ranks_share_object_collectives_and_take_numpy_splits(tmp_path, parallel):
    """Rank 1 receives the config rank 0 broadcast (published in the spool: root first); run
    together, each rank sees the other's gathered rank id; numpy split sizes reach the rank log
    as ints; a receive into a leaf that requires grad is filled. One rank at a time, rank 0
    cannot see rank 1's id (it has not run yet): the program's own check of the gathered ids
    fails, the documented limit of the fallback."""
    run = [PRISM, "capture", "--mode", "solo", "--world", "2", "--parallel", str(parallel), "--devices", "cpu"]
    r = subprocess.run(
        [*run, "--out", str(tmp_path / "solo"), "--", SPMD_STARTUP], capture_output=True, text=True, timeout=300
    )
    if parallel == 1:
        assert r.returncode != 0 and "gathered ranks [0, 0]" in r.stdout + r.stderr, r.stdout + r.stderr
        return
    assert r.returncode == 0, r.stdout + r.stderr
    assert "rank 0: ok" in r.stdout and "rank 1: ok" in r.stdout
    assert_equals_the_real_runs_structure(tmp_path / "solo", 2, ["--recorder", "python", "--", SPMD_STARTUP])


def assert_equals_the_real_runs_structure(solo: Path, nproc: int, record_args: list[str]) -> None:
    """The solo graph at ``solo`` has the structure of the real run (``prism record`` of ``nproc``
    ranks with ``record_args``, beside it)."""
    real = solo.parent / f"{solo.name}-real"
    rec = subprocess.run(
        [PRISM, "record", "--nproc", str(nproc), "--devices", "cpu", "--out", str(real), *record_args],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert rec.returncode == 0, rec.stdout + rec.stderr
    cmp = subprocess.run([PRISM, "compare", str(real), str(solo)], capture_output=True, text=True, timeout=120)
    assert "structure: equal" in cmp.stdout, cmp.stdout


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


def test_the_rank_that_runs_out_of_memory_first_in_the_program_is_named(tmp_path):
    """Two solo ranks run out of memory: rank 0 in its second iteration, at once, rank 1 in its
    first, two seconds later. Rank 1 is named, with the calls each had made (a real run, whose
    ranks keep step at the all_reduces, runs out on rank 1)."""
    hungry = str(Path(__file__).parent / "programs" / "memory_hungry.py")
    argv = ["capture", "--world", "2", "--parallel", "2", "--devices", "cpu", "--out", str(tmp_path / "g")]
    p = subprocess.run([PRISM, *argv, "--", hungry, "--hungry-rank", "1", "--delay", "2", "--hungry-late", "0"],
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert p.returncode != 0
    assert "rank 1 ran out of memory in its solo run after 2 communication call(s)" in p.stderr, p.stderr[-2000:]
    assert "also out of memory: rank 0 after 4 call(s)" in p.stderr, p.stderr[-2000:]


ZERO3_CHECK = str(Path(__file__).resolve().parent / "programs" / "zero3_check.py")


def test_a_start_up_agreement_check_passes_solo_capture_with_default_rules(tmp_path):
    """A partitioning library's start-up check of the ZeRO stage-3 kind (tests/programs/zero3_check.py:
    each rank's parameter counts gathered as a tensor, its shard sizes as an object, a float
    checksum; a disagreement refused) passes solo capture with no rule: a rank run alone is
    answered with what it holds itself, as an SPMD program's peers hold the same. The graph equals
    the real run's."""
    out = tmp_path / "solo"
    p = subprocess.run(
        [PRISM, "capture", "--mode", "solo", "--world", "2", "--devices", "cpu", "--out", str(out), "--", ZERO3_CHECK],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert_equals_the_real_runs_structure(out, 2, ["--", ZERO3_CHECK])


PIPELINE_TRAIN = str(Path(__file__).resolve().parent / "programs" / "pipeline_train.py")


def test_torch_pipelining_runs_with_no_recording(tmp_path):
    """``torch.distributed.pipelining``'s stages send each other their shapes at the first step
    (``send_object_list``/``recv_object_list``), which no rule can invent. Solo capture: a rank
    receives what its sender, a solo rank of the same capture, sent; the messages go with the
    graph, and in the slices and the emulation a virtual sender sends them again (a replica, its
    representative's). Interleaved 1F1B with two pipelines side by side (N = 4, pp innermost),
    ``prism run`` end to end: the captured graph equals the real run's, the emulated last rank
    trains; the real run's recording keeps its messages as well and is emulated without its
    tensors. One rank at a time, the first stage waits on metadata from the second, which has not
    run: one line naming the call, the sender and the fixes."""
    program = ["--", PIPELINE_TRAIN, "--stages-per-rank", "2", "--dp", "2"]
    layout = ["--world", "4", "--layout", "pp=2,order=tp-pp-dp", "--devices", "cpu"]
    one = subprocess.run(
        [PRISM, "capture", "--mode", "solo", *layout, "--out", str(tmp_path / "one"), *program],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert one.returncode != 0
    assert "recv_object_list" in one.stderr and "its sender, rank 1, has not run" in one.stderr, one.stderr
    run = subprocess.run(
        [PRISM, "run", *layout, "--parallel", "2", "--sandbox", "3", "--out", str(tmp_path / "run"), *program],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    emulated = (tmp_path / "run" / "logs" / "emulate.log").read_text()
    assert "rank 3: iteration 3/3 | loss" in emulated, emulated[-2000:]
    assert_equals_the_real_runs_structure(tmp_path / "run" / "bare", 4, program)
    # the real run's recording keeps its messages too: emulated without its tensors, and with the
    # issue thread serving the CPU's calls (a receive that takes a message is planned inline)
    emu = subprocess.run(
        [PRISM, "emulate", "--graph", str(tmp_path / "run" / "bare-real"), "--sandbox", "3", "--devices", "cpu",
         "--out", str(tmp_path / "emu"), *program],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PRISM_ISSUE_THREAD": "all"},
    )  # fmt: skip
    assert emu.returncode == 0 and "rank 3: iteration 3/3 | loss" in emu.stdout, emu.stdout[-3000:] + emu.stderr[-3000:]
