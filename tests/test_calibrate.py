"""`prism calibrate` (prismllm.calibrate): solving timed graphs into consistent node times.

- Exact checks: a hand-made PP graph with a bubble (every time worked out in the docstring); a
  synthetic lockstep graph whose recorded steady iteration is reproduced to the nanosecond;
  calibrating a calibrated graph (CAL/graph) gives the same times again (a fixed point).
- Real runs: gpt3d PP2 and TP2 recorded on the CPU with `prism record` (2 processes each); the
  predicted iteration time (median of steady iterations) against the recorded one, within a
  bound measured on this 2-core VM (docs/commands/calibrate.md, "Fidelity": -9.9 % .. +0.5 % over ten
  recordings on a quiet machine, -22 % at worst under load average 7 from other jobs: the
  recording counts the time a descheduled process takes to notice a completion, the solve
  does not). Critical path total = that iteration's predicted time; busy + idle = span.
- --durations: a copy of the graph with every time doubled predicts exactly twice the time;
  compute alone doubled lands in between.
- Bad inputs: one line `prism calibrate: error: ...`, exit 2, no traceback.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import GPT3D, PRISM, gpt3d_sizes

from prismllm.calibrate import calibrate, solve, summarize
from prismllm.errors import ExitCode
from prismllm.trace import PrismTrace, assemble
from prismllm.trace.ranklog import GroupInfo, RankLog
from prismllm.trace.synth import synthetic_logs

ROOT = Path(__file__).resolve().parents[1]
SIZES = gpt3d_sizes(global_batch=8, iters=5)
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
# predicted vs recorded steady iteration time of a real CPU recording (see the docstring): on the
# 2-core VM alone -13 % (PP2) and -7 % (TP2); the recording made while the suite's other worker
# runs its own processes was slowed further, to -32 % (PP2, a fresh clone's `make test`)
LOW, HIGH = -0.40, 0.10


def prism(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([PRISM, *args], capture_output=True, text=True, env=ENV, timeout=timeout)


# ---------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> dict[str, Path]:
    """gpt3d PP2 and TP2, 2 CPU processes each, 5 iterations (recorded one after the other): four
    steady ones, so that one iteration slowed by the host (seen: 30.6 ms among ~14 ms ones on the
    2-core VM) moves the recorded median only a little, where with two it moved it halfway."""
    base = tmp_path_factory.mktemp("calibrate")
    out = {}
    for layout in ("pp", "tp"):
        g = base / f"{layout}2"
        p = prism(
            "record",
            "--nproc",
            "2",
            "--devices",
            "cpu",
            "--out",
            str(g),
            "--timeout",
            "120",
            "--",
            GPT3D,
            f"--{layout}",
            "2",
            *SIZES,
            timeout=300,
        )
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
        out[layout] = g
    return out


@pytest.fixture(scope="module")
def calibrated(recorded, tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    base = tmp_path_factory.mktemp("cal")
    out = {}
    for layout, g in recorded.items():
        cal = base / f"{layout}2"
        p = prism("calibrate", str(g), "--out", str(cal), "--write-graph", "--json")
        assert p.returncode == 0, p.stderr[-3000:]
        s = json.loads(p.stdout)
        on_disk = json.loads((cal / "summary.json").read_text())
        assert {k: v for k, v in s.items() if k != "solve"} == {k: v for k, v in on_disk.items() if k != "solve"}
        out[layout] = (cal, s)
    return out


# ---------------------------------------------------------------------- hand-made graph
def C(start: int, dur: int, **kw) -> dict:
    return {"op": "compute", "kind": "compute", "start_ns": start, "duration_ns": dur, **kw}


def M(op: str, start: int, dur: int, group: str = "0", **kw) -> dict:
    return {
        "op": op,
        "kind": "comm",
        "group_name": group,
        "start_ns": start,
        "duration_ns": dur,
        "in_bytes": 64,
        "out_bytes": 64,
        "dtype": "float32",
        **kw,
    }


def make_trace(programs: list[list[dict]], iterations: int) -> PrismTrace:
    world = len(programs)
    groups = [GroupInfo("0", "default_pg", list(range(world)))]
    logs = []
    for rank, nodes in enumerate(programs):
        rows = []
        for i, n in enumerate(nodes):
            n = {**n, "rank": rank, "index": i}
            n.update(issue_ns=n["start_ns"], end_ns=n["start_ns"] + n["duration_ns"])
            rows.append(n)
        its = []
        for k in range(iterations):
            mine = [r for r in rows if r["iteration"] == k]
            its.append({"iteration": k, "start_ns": mine[0]["start_ns"], "end_ns": mine[-1]["end_ns"], "label": ""})
        logs.append(
            RankLog(rank=rank, world_size=world, device="cpu", clock="host", nodes=rows, groups=groups, iterations=its)
        )
    return assemble(logs, {"mode": "record", "command": ["test"]})


def hand_made_pipeline(iterations: int = 2, **rank0_compute) -> tuple[list[dict], list[dict]]:
    """The two-stage programs of test_hand_made_pipeline_bubble_and_critical_path, ``iterations``
    of them (rank 0's compute nodes take ``rank0_compute`` too, e.g. a label)."""
    prog0, prog1 = [], []
    for k in range(iterations):
        t = 215 * k
        prog0 += [
            C(t, 100, iteration=k, **rank0_compute),
            M("send", t + 100, 10, peer=1, iteration=k),
            M("all_reduce", t + 110, 105, reduce_op="sum", iteration=k),
        ]
        prog1 += [
            M("recv", t, 110, peer=0, iteration=k),
            C(t + 110, 100, iteration=k),
            M("all_reduce", t + 210, 5, reduce_op="sum", iteration=k),
        ]
    return prog0, prog1


def test_hand_made_pipeline_bubble_and_critical_path():
    """Two stages, one micro-batch, an all-reduce closing each iteration. Per iteration k,
    rank 0: compute 100, send to 1 (measured 10: it arrived last), all_reduce (measured 105,
    it waited); rank 1: recv (measured 110: waited for the send), compute 100, all_reduce
    (measured 5). Transfers: send/recv min(10, 110) = 10, all_reduce min(105, 5) = 5.

    Iteration 1 starts at 215 on both ranks (iteration 0: rank 0 computes [0, 100], the pair
    runs [100, 110], rank 1 computes [110, 210], the all-reduce [210, 215]). Rank 0: compute
    [215, 315], send [315, 325], waits in the all-reduce from 325 until rank 1 arrives at 425,
    transfer to 430. Rank 1: waits in the recv from 215 to 315 (P2P wait: the bubble), transfer
    to 325, compute [325, 425], all-reduce [425, 430]. Spans 215; busy 115 each; idle 100 each,
    P2P on rank 1 only: bubble fraction 100 / 430 over both ranks. Critical path from rank 0's
    end: all_reduce transfer 5 (rank 1 arrived last), rank 1's compute 100, the pair's transfer
    10 (the send arrived last), rank 0's compute 100: 215."""
    s = summarize(solve(make_trace(list(hand_made_pipeline()), 2)))
    assert [x["predicted_ns"] for x in s["iterations"]] == [215, 215]
    assert [x["recorded_ns"] for x in s["iterations"]] == [215, 215]
    assert s["predicted_iteration_ns"] == 215 and s["median_iteration"] == 1 and s["rel_error"] == 0
    pr = s["per_rank"]
    assert pr["span_ns"] == [215, 215] and pr["busy_ns"] == [115, 115] and pr["idle_ns"] == [100, 100]
    assert pr["compute_ns"] == [100, 100] and pr["comm_exposed_ns"] == [15, 15] and pr["p2p_wait_ns"] == [0, 100]
    assert s["pipeline_bubble"]["fraction"] == pytest.approx(100 / 430)
    assert s["pipeline_bubble"]["max_rank"] == 1 and s["pipeline_bubble"]["max"] == pytest.approx(100 / 215)
    cp = s["critical_path"]
    assert cp["total_ns"] == 215 == cp["iteration_ns"]
    assert [(x["rank"], x["index"], x["kind"], x["op"], x["duration_ns"]) for x in cp["segments"]] == [
        (1, 5, "transfer", "all_reduce", 5),
        (1, 4, "compute", "compute", 100),
        (0, 4, "transfer", "send", 10),
        (0, 3, "compute", "compute", 100),
    ]
    # every iteration's path (the report offers each): iteration 0 runs the same chain from time 0
    assert [x["iteration"] for x in s["critical_paths"]] == [0, 1] and s["critical_paths"][1] == cp
    first = s["critical_paths"][0]
    assert first["total_ns"] == 215 and [x["duration_ns"] for x in first["segments"]] == [5, 100, 10, 100]


def test_synthetic_lockstep_graph_is_reproduced_exactly():
    """A synthetic TP·PP·DP graph (prismllm.trace.synth) whose recorded times are globally
    consistent: every steady iteration is predicted to the nanosecond."""
    trace = assemble(synthetic_logs(64, 100, tp=2, pp=4, iterations=3), {"mode": "record"})
    s = summarize(solve(trace))
    for it in s["iterations"][1:]:
        assert it["predicted_ns"] == it["recorded_ns"], it
    assert s["rel_error"] == 0
    assert s["critical_path"]["total_ns"] == s["iterations"][s["median_iteration"]]["predicted_ns"]
    assert s["pipeline_bubble"] is not None


# ---------------------------------------------------------------------- recorded runs
@pytest.mark.parametrize("layout", ["pp", "tp"])
def test_predicted_iteration_time_matches_the_recording(calibrated, layout):
    cal, s = calibrated[layout]
    assert s["steady_iterations"] == [1, 2, 3, 4] and s["median_iteration"] in (1, 2, 3, 4)
    assert s["recorded_iteration_ns"] > 0 and s["predicted_iteration_ns"] > 0
    err = s["rel_error"]
    print(
        f"{layout}2: predicted {s['predicted_iteration_ns']} recorded {s['recorded_iteration_ns']} "
        f"error {100 * err:+.1f}% per iteration {[round(100 * x['rel_error'], 1) for x in s['iterations']]}"
    )
    assert LOW <= err <= HIGH, s["iterations"]
    # iteration 0 (set-up included, seconds) is dominated by the measured first compute span
    assert abs(s["iterations"][0]["rel_error"]) < 0.05
    assert s["unknown_durations"] == {"compute_nodes": 0, "instances": 0}
    if layout == "pp":
        b = s["pipeline_bubble"]
        assert b is not None and 0 < b["fraction"] < 1 and 0 < b["max"] < 1
    else:
        assert s["pipeline_bubble"] is None


@pytest.mark.parametrize("layout", ["pp", "tp"])
def test_critical_path_adds_up_to_the_iteration_time(calibrated, layout):
    cal, s = calibrated[layout]
    cp = s["critical_path"]
    k = s["median_iteration"]
    assert cp["iteration"] == k
    assert cp["total_ns"] == s["iterations"][k]["predicted_ns"] == cp["iteration_ns"]
    assert cp["total_ns"] == sum(x["duration_ns"] for x in cp["segments"]) == cp["end_ns"] - cp["begin_ns"]
    # contiguous, from the end back to the start
    for a, b in zip(cp["segments"], cp["segments"][1:]):
        assert b["start_ns"] + b["duration_ns"] == a["start_ns"]
    assert cp["segments"][0]["start_ns"] + cp["segments"][0]["duration_ns"] == cp["end_ns"]
    assert cp["segments"][-1]["start_ns"] == cp["begin_ns"]
    assert {x["kind"] for x in cp["segments"]} <= {"compute", "transfer", "issue"}
    pr = s["per_rank"]
    for span, busy, idle, c, e in zip(
        pr["span_ns"], pr["busy_ns"], pr["idle_ns"], pr["compute_ns"], pr["comm_exposed_ns"]
    ):
        assert busy + idle == span and c + e == busy and idle >= 0
    assert max(pr["span_ns"]) == cp["total_ns"]


@pytest.mark.parametrize("layout", ["pp", "tp"])
def test_calibrated_times_are_consistent_and_a_fixed_point(recorded, calibrated, layout):
    cal, s = calibrated[layout]
    t = pq.read_table(cal / "calibrated.parquet")
    g = PrismTrace.load(recorded[layout])
    assert t.num_rows == g.num_nodes
    assert sorted(t.column("node_id").to_pylist()) == sorted(g.column("node_id").tolist())
    start, end = t.column("start_ns").to_numpy(), t.column("end_ns").to_numpy()
    assert (start >= 0).all() and (end >= start).all()
    rank = t.column("rank").to_numpy()
    same = rank[1:] == rank[:-1]
    assert (start[1:][same] >= start[:-1][same]).all()  # program order
    comm = t.column("op_start_ns").to_numpy() >= 0
    assert (t.column("op_start_ns").to_numpy()[comm] >= start[comm]).all()
    # the calibrated graph, calibrated again, gives the same times and iteration times
    p = prism("calibrate", str(cal / "graph"), "--out", str(cal.parent / f"again-{layout}"), "--json")
    assert p.returncode == 0, p.stderr
    s2 = json.loads(p.stdout)
    assert pq.read_table(cal.parent / f"again-{layout}" / "calibrated.parquet").equals(t)
    assert [x["predicted_ns"] for x in s2["iterations"]] == [x["predicted_ns"] for x in s["iterations"]]
    # the calibrated graph's iterations table is the solved one; not a real run, so no "error"
    assert s2["recorded_iteration_ns"] == s["predicted_iteration_ns"] and s2["rel_error"] is None
    assert s2["critical_path"] == s["critical_path"]


def test_transfer_rules_min_never_exceeds_last(recorded):
    trace = PrismTrace.load(recorded["tp"])
    a, b = solve(trace, rule="min"), solve(trace, rule="last")
    assert (a.durations.transfer_ns <= b.durations.transfer_ns).all()
    assert a.result.predicted_iteration_ns <= b.result.predicted_iteration_ns * 1.001


def test_slice_rule_averages_the_slices_of_a_timed_graph():
    """A timed graph of four ranks measured in two slices, {0, 1} and {2, 3}: each slice's
    members measured one all-reduce of the four (the virtual members were there first). Within
    a slice the member that waited least saw the transfer (slice 0: min(30, 10) = 10; slice 1:
    min(50, 70) = 50); across slices the measurements are independent, so the transfer is their
    mean, 30, where the minimum over all members (10) keeps only the low tail. ``auto`` picks
    ``slice`` for a timed graph that names its slices and ``min`` for a recording."""
    durs = [30, 10, 50, 70]
    progs = [[C(0, 100, iteration=0), M("all_reduce", 100, d, reduce_op="sum", iteration=0)] for d in durs]
    rec = make_trace(progs, 1)
    timed = PrismTrace(
        manifest={**rec.manifest, "mode": "timed", "timing": {"slice_of_rank": [0, 0, 1, 1]}},
        nodes=rec.nodes,
        edges=rec.edges,
        groups=rec.groups,
        iterations=rec.iterations,
    )
    assert solve(timed).rule == "slice" and solve(rec).rule == "min"
    assert solve(timed).durations.transfer_ns.tolist() == [30]
    assert solve(timed, rule="min").durations.transfer_ns.tolist() == [10]
    assert solve(timed).result.predicted_iteration_ns == 130
    # replicas measured in one slice count once: ranks 0-2 all copies of slice 0
    one = PrismTrace(
        manifest={**timed.manifest, "timing": {"slice_of_rank": [0, 0, 0, 1]}},
        nodes=rec.nodes,
        edges=rec.edges,
        groups=rec.groups,
        iterations=rec.iterations,
    )
    assert solve(one).durations.transfer_ns.tolist() == [(10 + 70) // 2]
    from prismllm.calibrate import CalibrationError

    with pytest.raises(CalibrationError, match="needs a timed graph"):
        solve(rec, rule="slice")


# ---------------------------------------------------------------------- --durations
def scaled_copy(src: Path, dst: Path, compute: float, comm: float) -> Path:
    """GRAPH with compute durations x ``compute`` and communication durations x ``comm``; with
    equal factors every time is scaled about the first start (gaps included)."""
    t = PrismTrace.load(src)
    nodes = t.nodes
    is_comm = np.asarray(nodes.column("kind").to_pylist()) == "comm"
    f = np.where(is_comm, comm, compute)
    t0 = int(t.column("start_ns").min())

    def sc(x: np.ndarray, factor) -> np.ndarray:
        return np.where(x >= 0, t0 + np.rint((x - t0) * factor).astype(np.int64), x)

    dur = t.column("duration_ns")
    cols = {"duration_ns": np.where(dur >= 0, np.rint(dur * f), dur).astype(np.int64)}
    if compute == comm:
        for c in ("start_ns", "end_ns", "issue_ns"):
            cols[c] = sc(t.column(c), compute)
    for c, v in cols.items():
        nodes = nodes.set_column(nodes.schema.get_field_index(c), c, pa.array(v, pa.int64()))
    its = t.iterations
    if compute == comm:
        for c in ("start_ns", "end_ns"):
            its = its.set_column(
                its.schema.get_field_index(c), c, pa.array(sc(its.column(c).to_numpy(), compute), pa.int64())
            )
    PrismTrace(manifest=t.manifest, nodes=nodes, edges=t.edges, groups=t.groups, iterations=its).save(dst)
    return dst


def test_durations_from_a_scaled_graph(recorded, calibrated, tmp_path):
    for layout in ("pp", "tp"):
        _, base = calibrated[layout]
        x2 = scaled_copy(recorded[layout], tmp_path / f"{layout}-x2", 2, 2)
        p = prism(
            "calibrate", str(recorded[layout]), "--durations", str(x2), "--out", str(tmp_path / f"c-{layout}"), "--json"
        )
        assert p.returncode == 0, p.stderr
        s = json.loads(p.stdout)
        assert s["durations_from"] == str(x2)
        for a, b in zip(base["iterations"], s["iterations"]):
            assert b["predicted_ns"] == pytest.approx(2 * a["predicted_ns"], rel=1e-6), (a, b)
        assert s["predicted_iteration_ns"] == pytest.approx(2 * base["predicted_iteration_ns"], rel=1e-6)
        assert s["durations_recorded_iteration_ns"] == pytest.approx(2 * base["recorded_iteration_ns"], rel=1e-6)
        assert s["durations_rel_error"] == pytest.approx(base["rel_error"], abs=1e-6)
        assert s["critical_path"]["total_ns"] == pytest.approx(2 * base["critical_path"]["total_ns"], rel=1e-6)
    # compute alone twice as slow: longer, but less than twice (communication did not change)
    c2 = scaled_copy(recorded["tp"], tmp_path / "tp-c2", 2, 1)
    s = calibrate(recorded["tp"], None, durations=c2)
    base = calibrated["tp"][1]["predicted_iteration_ns"]
    assert base < s["predicted_iteration_ns"] < 2 * base


def test_warmup_leaves_the_first_iterations_out_of_the_prediction(recorded, calibrated, tmp_path):
    """``--warmup 3``: the prediction, the recording's figure beside it and the calibrated graph
    (which an emulation of it reads) leave out iterations 0-2, where the default leaves out 0."""
    _, base = calibrated["pp"]
    assert base["warmup"] == 1 and base["steady_iterations"] == [1, 2, 3, 4]
    cal = tmp_path / "cal-w3"
    p = prism("calibrate", str(recorded["pp"]), "--out", str(cal), "--warmup", "3", "--write-graph", "--json")
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads(p.stdout)
    assert s["warmup"] == 3 and s["steady_iterations"] == [3, 4]
    per = {x["iteration"]: x for x in s["iterations"]}
    assert [per[k]["predicted_ns"] for k in (0, 1, 2, 3, 4)] == [x["predicted_ns"] for x in base["iterations"]]
    assert s["predicted_iteration_ns"] == int(np.median([per[3]["predicted_ns"], per[4]["predicted_ns"]]))
    assert s["recorded_iteration_ns"] == int(np.median([per[3]["recorded_ns"], per[4]["recorded_ns"]]))
    assert PrismTrace.load(cal / "graph").manifest["calibration"]["warmup"] == 3
    shown = json.loads(prism("show", str(cal / "graph"), "--json").stdout)  # the prediction's iterations
    assert shown["steady_iterations"] == [3, 4] and shown["iteration_time_ns"] == s["predicted_iteration_ns"]
    # none left: refused, naming the option and how many the graph has
    assert_error(
        prism("calibrate", str(recorded["pp"]), "--out", str(tmp_path / "cal-w5"), "--warmup", "5"),
        "--warmup 5",
        "5 iteration(s), of which at most 4 can be left out",
    )
    assert not (tmp_path / "cal-w5" / "summary.json").exists()


# ---------------------------------------------------------------------- bad input
def assert_error(p: subprocess.CompletedProcess, *needles: str, code: int = ExitCode.BAD_INPUT) -> str:
    assert p.returncode == code, (p.returncode, p.stdout[-500:], p.stderr[-2000:])
    err = p.stderr.strip()
    assert err.startswith("prism calibrate: error: ") and "\n" not in err and "Traceback" not in err, err
    for n in needles:
        assert n in err, err
    return err


def test_bad_inputs(recorded, tmp_path):
    pp, tp = recorded["pp"], recorded["tp"]
    out = str(tmp_path / "cal")
    assert_error(prism("calibrate", str(tmp_path / "missing"), "--out", out), "does not exist")
    (tmp_path / "notagraph").mkdir()
    assert_error(prism("calibrate", str(tmp_path / "notagraph"), "--out", out), "manifest.json")
    assert_error(prism("calibrate", str(pp), "--durations", str(tmp_path / "missing"), "--out", out), "does not exist")
    # a graph without durations (every time unknown, as in a bare graph)
    t = PrismTrace.load(pp)
    nodes = t.nodes
    for c in ("issue_ns", "start_ns", "end_ns", "duration_ns"):
        nodes = nodes.set_column(nodes.schema.get_field_index(c), c, pa.array(np.full(t.num_nodes, -1), pa.int64()))
    bare = tmp_path / "bare"
    PrismTrace(manifest=t.manifest, nodes=nodes, edges=t.edges, groups=t.groups, iterations=t.iterations).save(bare)
    assert_error(prism("calibrate", str(bare), "--out", out), "no measured durations", str(bare))
    assert_error(
        prism("calibrate", str(pp), "--durations", str(bare), "--out", out), "no measured durations", str(bare)
    )
    # --durations of another structure: the rank and the first differing node are named
    err = assert_error(prism("calibrate", str(pp), "--durations", str(tp), "--out", out), "another structure", "rank ")
    assert " node " in err
    ops = t.nodes.column("op").to_pylist()
    rank = t.column("rank")
    i = int(np.flatnonzero((rank == 1) & (np.asarray(ops) == "compute"))[3])
    ops[i] = "all_reduce"
    odd = tmp_path / "odd"
    PrismTrace(
        manifest=t.manifest,
        nodes=t.nodes.set_column(t.nodes.schema.get_field_index("op"), "op", pa.array(ops)),
        edges=t.edges,
        groups=t.groups,
        iterations=t.iterations,
    ).save(odd)
    idx = int(t.column("index")[i])
    assert_error(
        prism("calibrate", str(pp), "--durations", str(odd), "--out", out),
        f"rank 1 node {idx} is compute in graph {pp} but all_reduce in graph {odd}",
    )
    # an --out that holds something else
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "file.txt").write_text("x")
    assert_error(prism("calibrate", str(pp), "--out", str(tmp_path / "busy")), "not empty", code=ExitCode.USAGE)
    assert not (tmp_path / "cal").exists()
