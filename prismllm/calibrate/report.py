"""The calibration's outputs: ``CAL/calibrated.parquet``, ``CAL/summary.json`` (keys documented in
docs/commands/calibrate.md) and the short table ``prism calibrate`` prints."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from prismllm.calibrate.analyze import Timeline
from prismllm.errors import PrismError
from prismllm.fsutil import write_dir_atomically
from prismllm.outputs import GRAPH_DIR, SUMMARY_FILE
from prismllm.replay import INST_COLLECTIVE, INST_P2P, Solution
from prismllm.terminal import Table
from prismllm.trace.graph import PrismTrace
from prismllm.trace.schema import REPLICAS_KEY
from prismllm.trace.summary import fmt_ns

CALIBRATED_FILE = "calibrated.parquet"
FORMAT = "prism-calibration"
FORMAT_VERSION = 1

_I64 = np.int64


# ---------------------------------------------------------------------- every rank
def solved_ranks(sol: Solution) -> tuple[np.ndarray, np.ndarray]:
    """(the ranks the solution gives times for, each one's position in ``sol.graph.ranks``): the
    replayed ranks, and where the solve left copies out (``sol.mirror``) those too, at their
    images' positions."""
    g = sol.graph
    if sol.mirror is None:
        return g.ranks, np.arange(len(g.ranks), dtype=_I64)
    ranks = np.union1d(g.ranks, np.flatnonzero(sol.mirror >= 0))
    return ranks, np.searchsorted(g.ranks, np.where(sol.mirror[ranks] >= 0, sol.mirror[ranks], ranks))


def solved_rows(sol: Solution) -> tuple[np.ndarray, np.ndarray]:
    """(the rows of ``sol.trace.nodes`` the solution gives times for, in program order, each one's
    node position in ``sol.graph``: its own, or for a copy left out its image's)."""
    g = sol.graph
    if sol.mirror is None:
        return g.row, np.arange(g.num_nodes, dtype=_I64)
    rows = sol.trace.program_order()
    rank = sol.trace.column("rank")[rows].astype(_I64)
    image = np.where(sol.mirror[rank] >= 0, sol.mirror[rank], rank)
    pos = g.position(image, sol.trace.column("index")[rows])
    if len(pos) and pos.min() < 0:
        r = int(rank[int(np.argmin(pos))])
        raise PrismError(f"rank {r} has a node its image, rank {int(sol.mirror[r])}, lacks: the copy is none")
    return rows, pos


# ---------------------------------------------------------------------- per-node times
def calibrated_table(sol: Solution) -> pa.Table:
    """One row per node, in (rank, index) order: logical times in ns from the solve's time 0
    (every rank starts at 0). ``start_ns``: the node begins (comm: the rank arrives at the op);
    ``end_ns``: compute ends / the op completes for this rank (a coalesced batch's completion
    for batched ops); ``op_start_ns`` / ``op_end_ns``: the op's instance starts (last member
    arrives) and ends, -1 for compute."""
    g, res, trace = sol.graph, sol.result, sol.trace
    rows, pos = solved_rows(sol)
    inst = g.inst_of[pos]
    comm = inst >= 0
    op_start = (
        np.where(comm, res.instance_start_ns[np.maximum(inst, 0)], -1)
        if g.num_instances
        else np.full(len(pos), -1, _I64)
    )
    op_end = (
        np.where(comm, res.instance_end_ns[np.maximum(inst, 0)], -1) if g.num_instances else np.full(len(pos), -1, _I64)
    )
    return pa.table(
        {
            "node_id": pa.array(trace.column("node_id").astype(_I64)[rows], pa.int64()),
            "rank": pa.array(trace.column("rank")[rows].astype(np.int32), pa.int32()),
            "index": pa.array(trace.column("index")[rows].astype(np.int32), pa.int32()),
            "iteration": pa.array(g.iteration[pos].astype(np.int32), pa.int32()),
            "start_ns": pa.array(res.start_ns[pos], pa.int64()),
            "end_ns": pa.array(res.end_ns[pos], pa.int64()),
            "op_start_ns": pa.array(op_start.astype(_I64), pa.int64()),
            "op_end_ns": pa.array(op_end.astype(_I64), pa.int64()),
        }
    )


def rank_iteration_bounds(sol: Solution) -> tuple[np.ndarray, np.ndarray]:
    """(begin, finish) per replayed rank position x iteration (``graph.iterations``), -1 where the
    rank has no node of that iteration: the same bounds the engine measures iteration times with."""
    g, res = sol.graph, sol.result
    its = g.iterations
    nr, nk = len(g.ranks), len(its)
    begin = np.full((nr, nk), -1, dtype=_I64)
    finish = np.full((nr, nk), -1, dtype=_I64)
    if not (nk and g.num_nodes):
        return begin, finish
    prev, last, has, lo = g.iteration_bounds()
    b = np.where(prev >= lo, res.return_ns[np.maximum(prev, 0)], res.start_ns[np.minimum(lo, g.num_nodes - 1)])
    f = res.return_ns[np.maximum(last, 0)]
    begin.reshape(-1)[has] = b[has]
    finish.reshape(-1)[has] = f[has]
    return begin, finish


def calibrated_trace(sol: Solution) -> PrismTrace:
    """The solved graph as a PrismTrace (manifest mode ``calibrated``): GRAPH's structure with
    the solved logical times. A compute node lasts its duration; a communication node's
    ``duration_ns`` is from the rank's arrival to the op's end (so the member that arrived last
    measures the transfer alone, as in a real recording); its ``end_ns`` is the completion the
    rank sees (a coalesced batch's). The iterations table holds the solved per-rank bounds.
    Calibrating this graph again gives the same times: the solve is a fixed point on its own
    output (tests/test_calibrate.py)."""
    g, res, trace = sol.graph, sol.result, sol.trace
    inst = np.maximum(g.inst_of, 0)
    op_end = res.instance_end_ns[inst] if g.num_instances else np.zeros(g.num_nodes, _I64)
    dur = np.where(g.is_comm, op_end - res.start_ns, sol.durations.compute_ns).astype(_I64)
    rows, pos = solved_rows(sol)
    n = trace.num_nodes
    start = np.empty(n, dtype=_I64)
    end = np.empty(n, dtype=_I64)
    duration = np.empty(n, dtype=_I64)
    start[rows], end[rows], duration[rows] = res.start_ns[pos], res.end_ns[pos], dur[pos]
    nodes = trace.nodes
    for name, arr in (("issue_ns", start), ("start_ns", start), ("end_ns", end), ("duration_ns", duration)):
        nodes = nodes.set_column(nodes.schema.get_field_index(name), name, pa.array(arr, pa.int64()))
    ranks, rpos = solved_ranks(sol)
    begin, finish = (x[rpos] for x in rank_iteration_bounds(sol))
    ok = begin >= 0
    rr, kk = np.nonzero(ok)
    iterations = pa.table(
        {
            "rank": pa.array(ranks[rr].astype(np.int32), pa.int32()),
            "iteration": pa.array(g.iterations[kk].astype(np.int32), pa.int32()),
            "start_ns": pa.array(begin[ok], pa.int64()),
            "end_ns": pa.array(finish[ok], pa.int64()),
            "label": pa.array([""] * int(ok.sum()), pa.string()),
        }
    )
    manifest = {
        **{k: v for k, v in trace.manifest.items() if k != REPLICAS_KEY or sol.replicas_copied},
        "mode": "calibrated",
        "clock": "logical",
        # an emulation of the calibrated graph leaves the same iterations out (trace.summary.warmup_of)
        "calibration": {
            "transfer_rule": sol.rule,
            "from_mode": trace.manifest.get("mode"),
            "warmup": sol.result.warmup,
        },
    }
    return PrismTrace(manifest=manifest, nodes=nodes, edges=trace.edges, groups=trace.groups, iterations=iterations)


# ---------------------------------------------------------------------- summary
def _median_iteration(its: np.ndarray, times: np.ndarray, steady: np.ndarray) -> int | None:
    """The steady iteration whose time is the median (the lower median for an even count)."""
    cand = [(int(times[np.searchsorted(its, k)]), int(k)) for k in steady if times[np.searchsorted(its, k)] >= 0]
    if not cand:
        return None
    cand.sort()
    return cand[(len(cand) - 1) // 2][1]


def _stats(x: np.ndarray) -> dict[str, float] | None:
    if not len(x):
        return None
    return {"mean": float(np.mean(x)), "min": float(np.min(x)), "max": float(np.max(x))}


def _instances(sol: Solution) -> int:
    """The graph's collective and point-to-point instances. Where the solve replayed one world of
    DP replicas for all (``prism calibrate``: every replayed rank in it), an instance within the
    world stands for one in each world, and one on a group across the worlds (DP, the world
    group) for itself."""
    g = sol.graph
    if sol.mirror is None:
        return int(g.num_instances)
    worlds = (len(g.ranks) + int((sol.mirror >= 0).sum())) // max(len(g.ranks), 1)
    across = (g.inst_kind == INST_COLLECTIVE) & (g.group_mirrored[np.maximum(g.inst_group, 0)] > 0)
    return int((~across).sum()) * worlds + int(across.sum())


def summarize(
    sol: Solution,
    graph_path: str | None = None,
    durations_path: str | None = None,
    timings_s: dict[str, float] | None = None,
) -> dict[str, Any]:
    g, res = sol.graph, sol.result
    tl = Timeline(sol)
    ranks, rpos = solved_ranks(sol)  # every rank: a copy left out has its image's figures
    rank_iteration_ns = res.rank_iteration_ns[rpos]
    its = g.iterations
    rec = g.recorded_iteration_ns
    recorded = np.where((rec >= 0).any(axis=0), rec.max(axis=0, initial=-1), -1) if len(its) else np.zeros(0, _I64)
    # An error compares a prediction with a real run: a recording's iterations are one (a timed
    # graph's are the slices' own measurements, the input of this very prediction; a solo
    # capture's ran each rank alone).
    real = sol.trace.manifest.get("mode") == "record"
    iterations = []
    for c, k in enumerate(its.tolist()):
        pred = int(res.iteration_ns[c])
        r = int(recorded[c]) if recorded[c] >= 0 else None
        slow = int(ranks[int(np.argmax(rank_iteration_ns[:, c]))]) if pred >= 0 else None
        iterations.append(
            {
                "iteration": k,
                "predicted_ns": pred if pred >= 0 else None,
                "recorded_ns": r,
                "rel_error": (pred - r) / r if (real and r and pred >= 0) else None,
                "slowest_rank": slow,
            }
        )
    steady = [int(x) for x in res.steady_iterations]
    rec_steady = [int(recorded[np.searchsorted(its, k)]) for k in steady if recorded[np.searchsorted(its, k)] >= 0]
    recorded_median = int(np.median(rec_steady)) if rec_steady else None
    pred = res.predicted_iteration_ns
    med = _median_iteration(its, res.iteration_ns, np.asarray(steady))
    out: dict[str, Any] = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "graph": graph_path,
        "durations_from": durations_path,
        "transfer_rule": sol.rule,
        "graph_mode": sol.trace.manifest.get("mode"),
        "world_size": int(g.world_size),
        "ranks": int(len(ranks)),
        "nodes": int(sol.trace.num_nodes if sol.mirror is not None else g.num_nodes),
        "instances": _instances(sol),
        "unknown_durations": {
            "compute_nodes": sol.durations.unknown_compute,
            "instances": sol.durations.unknown_transfer,
        },
        "time_origin": "logical: every rank starts at 0 ns",
        "iterations": iterations,
        "warmup": res.warmup,
        "steady_iterations": steady,
        "predicted_iteration_ns": pred,
        "recorded_iteration_ns": recorded_median,
        "recorded_is_real_run": real,
        "rel_error": (
            (pred - recorded_median) / recorded_median if (real and pred is not None and recorded_median) else None
        ),
        "median_iteration": med,
        "critical_path": None,
        "critical_paths": [],
        "per_rank": None,
        "busy_fraction": None,
        "pipeline_bubble": None,
        "solve": {
            "rounds": int(sol.rounds),
            **{f"{k}_s": round(v, 4) for k, v in (timings_s or sol.timings_s).items()},
        },
    }
    if sol.mirror is not None:  # what the solve replayed: one world of DP replicas stands for all
        out["replayed"] = {"ranks": int(len(g.ranks)), "nodes": int(g.num_nodes), "instances": int(g.num_instances)}
    if durations_path is not None:  # filled by the caller, who has OTHER
        out["durations_recorded_iteration_ns"] = None
        out["durations_rel_error"] = None
    # every iteration's path, so that the report can show any of them; the median's is the one the
    # figures below describe
    out["critical_paths"] = [tl.critical_path(int(k)) for c, k in enumerate(its) if res.iteration_ns[c] >= 0]
    if med is None:
        return out
    out["critical_path"] = next(cp for cp in out["critical_paths"] if cp["iteration"] == med)
    acc = {k: v[rpos] for k, v in tl.accounting().items()}
    c = int(np.searchsorted(its, med))
    span = acc["span"][:, c]
    has = span > 0
    busy = acc["compute"][:, c] + acc["comm_exposed"][:, c]
    idle = acc["idle"][:, c]
    p2p = acc["p2p_wait"][:, c]
    frac = np.where(has, busy / np.maximum(span, 1), 0.0)
    bubble = np.where(has, p2p / np.maximum(span, 1), 0.0)
    out["per_rank"] = {
        "iteration": int(med),
        "rank": [int(r) for r in ranks],
        "span_ns": span.tolist(),
        "busy_ns": busy.tolist(),
        "compute_ns": acc["compute"][:, c].tolist(),
        "comm_exposed_ns": acc["comm_exposed"][:, c].tolist(),
        "idle_ns": idle.tolist(),
        "p2p_wait_ns": p2p.tolist(),
        "bubble_fraction": [round(float(x), 6) for x in bubble],
    }
    out["busy_fraction"] = _stats(frac[has])
    if (g.inst_kind == INST_P2P).any():
        b = bubble[has]
        worst = int(ranks[has][int(np.argmax(b))]) if len(b) else None
        out["pipeline_bubble"] = {
            "iteration": int(med),
            "fraction": float(p2p[has].sum() / max(int(span[has].sum()), 1)),
            "mean": float(b.mean()) if len(b) else None,
            "max": float(b.max()) if len(b) else None,
            "max_rank": worst,
        }
    return out


# ---------------------------------------------------------------------- writing
def write(
    out_dir: str | os.PathLike, table: pa.Table, summary: dict[str, Any], graph: PrismTrace | None = None
) -> Path:
    """Write CAL atomically (a temp directory beside it, then a rename). An existing CAL is
    replaced; any other non-empty directory, or a file, is refused."""

    def fill(tmp: Path) -> None:
        pq.write_table(table, tmp / CALIBRATED_FILE, compression="zstd", row_group_size=1 << 20)
        with open(tmp / SUMMARY_FILE, "w") as f:
            json.dump(summary, f, indent=1)
            f.write("\n")
        if graph is not None:
            graph.save(tmp / GRAPH_DIR)

    # an --out that holds something else: a usage error, not one of the input graph
    return write_dir_atomically(out_dir, SUMMARY_FILE, fill, PrismError, "calibration")


# ---------------------------------------------------------------------- the table
def _recorded_row(s: dict[str, Any], pct) -> tuple[str, str]:
    """The graph's own iteration time: an error only against a real run (a recording)."""
    if s.get("recorded_is_real_run"):
        return (
            "recorded iteration (real run)",
            f"{fmt_ns(s['recorded_iteration_ns'])}  error {pct(s['rel_error'])}"
            + ("  (GRAPH's own run)" if s["durations_from"] else ""),
        )
    what = {
        "timed": "measured in the slices (this prediction's input, not a reference)",
        "solo": "solo capture: each rank ran alone (not a reference)",
        "switch": "switch-mode capture: every rank ran with real values, times distorted (not a reference)",
    }.get(s.get("graph_mode") or "", "")
    return ("graph's own iteration", f"{fmt_ns(s['recorded_iteration_ns'])}  {what}".rstrip())


def render(s: dict[str, Any], console, out_dir: str | None = None) -> None:

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:+.1f}%"

    head = Table(title=f"calibration of {s['graph']}", show_header=False, title_justify="left")
    head.add_column(style="bold")
    head.add_column()
    rows = [
        (
            "ranks / nodes / instances",
            f"{s['ranks']} / {s['nodes']:,} / {s['instances']:,}"
            + (
                f" ({s['replayed']['ranks']} ranks replayed: their DP replicas are copies)" if s.get("replayed") else ""
            ),
        ),
        ("durations", s["durations_from"] or "the graph's own"),
        (
            "transfer per instance",
            {
                "min": "the minimum over its members' measurements",
                "slice": "per slice the minimum, then the mean over the slices",
                "last": "the last member to arrive's",
            }.get(s["transfer_rule"], s["transfer_rule"]),
        ),
        (
            "predicted iteration",
            f"{fmt_ns(s['predicted_iteration_ns'])} (median of steady iterations "
            f"{', '.join(map(str, s['steady_iterations']))})",
        ),
        _recorded_row(s, pct),
    ]
    if s.get("durations_recorded_iteration_ns") is not None:
        rows.append(
            (
                "recorded (durations' graph)",
                f"{fmt_ns(s['durations_recorded_iteration_ns'])}  error {pct(s.get('durations_rel_error'))}",
            )
        )
    unk = s["unknown_durations"]
    if unk["compute_nodes"] or unk["instances"]:
        rows.append(
            ("without a measurement (as 0)", f"{unk['compute_nodes']} compute nodes, {unk['instances']} instances")
        )
    if out_dir:
        rows.append(("written", out_dir))
    for k, v in rows:
        head.add_row(k, str(v))
    console.print(head)

    real = s.get("recorded_is_real_run")
    it = Table(title="iterations (slowest rank)", title_justify="left")
    cols = (
        ("iteration", "predicted", "recorded", "error", "slowest rank")
        if real
        else ("iteration", "predicted", "slowest rank")
    )
    for col in cols:
        it.add_column(col, justify="right")
    for x in s["iterations"][:20]:
        mark = " (median)" if x["iteration"] == s["median_iteration"] else ""
        cells = (
            [fmt_ns(x["predicted_ns"]), fmt_ns(x["recorded_ns"]), pct(x["rel_error"])]
            if real
            else [fmt_ns(x["predicted_ns"])]
        )
        it.add_row(f"{x['iteration']}{mark}", *cells, str(x["slowest_rank"]))
    console.print(it)

    cp = s["critical_path"]
    if cp:
        t = Table(
            title=f"critical path of iteration {cp['iteration']}: {fmt_ns(cp['total_ns'])}, "
            f"{len(cp['segments'])} segments over {len(cp['ranks_visited'])} rank(s), ends on rank "
            f"{cp['end_rank']}",
            title_justify="left",
        )
        t.add_column("what")
        t.add_column("time", justify="right")
        t.add_column("share", justify="right")
        for k, v in list(cp["by_kind"].items())[:8]:
            t.add_row(k, fmt_ns(v), f"{100 * v / max(cp['total_ns'], 1):.1f}%")
        console.print(t)
    pr = s["per_rank"]
    if pr:
        span = np.asarray(pr["span_ns"])
        ok = span > 0
        busy = np.asarray(pr["busy_ns"])[ok]
        t = Table(
            title=f"per rank, iteration {pr['iteration']} (busy = compute + exposed communication)",
            title_justify="left",
        )
        for col in ("", "mean", "min", "max"):
            t.add_column(col, justify="right" if col else "left")
        for name, key in (
            ("busy", "busy_ns"),
            ("compute", "compute_ns"),
            ("exposed comm", "comm_exposed_ns"),
            ("idle", "idle_ns"),
            ("P2P wait", "p2p_wait_ns"),
        ):
            v = np.asarray(pr[key])[ok]
            if len(v):
                t.add_row(name, fmt_ns(v.mean()), fmt_ns(v.min()), fmt_ns(v.max()))
        if len(busy):
            f = busy / span[ok]
            t.add_row("busy fraction", f"{100 * f.mean():.1f}%", f"{100 * f.min():.1f}%", f"{100 * f.max():.1f}%")
        pb = s["pipeline_bubble"]
        if pb:
            t.caption = (
                f"pipeline bubble (P2P wait / iteration, over ranks): {100 * pb['fraction']:.1f}%; "
                f"worst rank {pb['max_rank']}: {100 * pb['max']:.1f}%"
            )
        else:
            t.caption = "no send/recv: no pipeline bubble"
        console.print(t)
