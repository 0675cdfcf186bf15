"""Where an emulated sandbox rank's iteration went against its prediction: the rank's device spans
three ways, and the real-time schedule call by call.

    python benchmarks/sandbox_spans.py RUN [--record GRAPH] [--rank R] [--warmup N] [--json OUT] [--top K]

``RUN`` is a `prism run` directory whose emulation ran with ``PRISM_DEVICE_POINTS=1`` (its sandbox's
spans timed on the device; without it only its iterations are compared). ``--record``: a graph of
the real job (``prism record``, as `fidelity_gpu.py --record` makes), the rank's real spans.

Per source (the real recording, the rank's slice in ``time/graph``, the emulation's rank log) the
median over the steady iterations (from ``--warmup``, default the calibration's) of the rank's
iteration and of its compute per iteration, and the compute spans whose medians differ most from
the slice's. From ``emulate/schedule.parquet``: how far the sandbox's completions moved the
virtual ranks' calls from the calibrated graph, per iteration (the drift: a sandbox faster or
slower than its slice moves it each iteration by as much), and the time the proxy's calls waited
for the sandbox against the plan's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import pyarrow.parquet as pq

from prismllm.outputs import CAL_DIR, EMULATE_DIR, GRAPH_DIR, RANKLOGS_DIR, SCHEDULE_FILE, SUMMARY_FILE, TIME_DIR
from prismllm.trace.graph import read_rows_of_ranks
from prismllm.trace.ranklog import ranklog_path, read_ranklog
from prismllm.trace.summary import WARMUP, steady

MS = 1e6


def graph_rank(graph: Path, rank: int) -> tuple[list[dict], dict[int, int]]:
    """A graph's nodes of ``rank`` (kind, iteration, index, duration_ns) and its iterations' lengths."""
    cols = ["kind", "iteration", "index", "duration_ns"]
    nodes = read_rows_of_ranks(graph / "nodes.parquet", [rank]).select(cols).to_pylist()
    its = read_rows_of_ranks(graph / "iterations.parquet", [rank]).to_pylist()
    return nodes, {i["iteration"]: i["end_ns"] - i["start_ns"] for i in its}


def log_rank(run: Path, rank: int) -> tuple[list[dict], dict[int, int], str]:
    """The emulation's rank log: nodes, iterations' lengths, its clock."""
    log = read_ranklog(ranklog_path(run / EMULATE_DIR / RANKLOGS_DIR, rank))
    its = {i["iteration"]: i["end_ns"] - i["start_ns"] for i in log.iterations if i["end_ns"] >= i["start_ns"] >= 0}
    return log.nodes, its, log.clock


def spans(nodes: list[dict], its: dict[int, int], warmup: int) -> dict:
    """Medians over the steady iterations (all but the first ``warmup``, as prism's own medians):
    iteration, compute per iteration, and each compute span by its place in the iteration (its
    index less the iteration's first)."""
    first: dict[int, int] = {}
    for n in nodes:
        first[n["iteration"]] = min(first.get(n["iteration"], n["index"]), n["index"])
    kept = steady(sorted(its), warmup)
    compute: dict[int, int] = defaultdict(int)
    by_place: dict[int, list[int]] = defaultdict(list)
    for n in nodes:
        if n["kind"] == "compute" and n["iteration"] in kept and n["duration_ns"] >= 0:
            compute[n["iteration"]] += n["duration_ns"]
            by_place[n["index"] - first[n["iteration"]]].append(n["duration_ns"])
    return {
        "iterations": len(kept),
        "iteration_ms": statistics.median(its[k] for k in kept) / MS if kept else None,
        "compute_ms": statistics.median(compute[k] for k in kept) / MS if kept else None,
        "span_ms": {p: statistics.median(v) / MS for p, v in by_place.items()},
    }


def schedule(path: Path, warmup: int) -> dict | None:
    """The proxy's calls as the clock kept them: per steady iteration the median of how far they were
    moved (due less planned ready: the sandbox's lead or lag), its change per iteration (the
    drift), and their time in the call against the plan's."""
    if not path.is_file():
        return None
    rows = [r for r in pq.read_table(path).to_pylist() if r["due_ns"] is not None and r["iteration"] >= warmup]
    if not rows:
        return {"calls": 0}
    moved: dict[int, list[int]] = defaultdict(list)
    in_call: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    for r in rows:
        moved[r["iteration"]].append(r["due_ns"] - r["ready_ns"])
        if r["completed_ns"] is not None:
            in_call[r["iteration"]][0] += r["completed_ns"] - r["entered_ns"]
            in_call[r["iteration"]][1] += r["planned_end_ns"] - r["ready_ns"]
    its = sorted(moved)
    med = [statistics.median(moved[k]) for k in its]
    drift = [b - a for a, b in zip(med, med[1:])]
    return {
        "calls": len(rows),
        "moved_ms": {k: m / MS for k, m in zip(its, med)},
        "drift_ms_per_iteration": statistics.median(drift) / MS if drift else None,
        "in_call_ms": statistics.median(in_call[k][0] for k in its) / MS,
        "in_call_planned_ms": statistics.median(in_call[k][1] for k in its) / MS,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="a prism run directory")
    ap.add_argument("--record", type=Path, help="a recorded graph of the real job")
    ap.add_argument("--rank", type=int, help="the sandbox rank (default: the emulation's first)")
    ap.add_argument("--warmup", type=int, help="iterations left out (default: the calibration's)")
    ap.add_argument("--top", type=int, default=8, help="spans listed, by their difference from the slice's")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    emu = json.loads((a.run / EMULATE_DIR / "emulate.json").read_text())
    rank = a.rank if a.rank is not None else int(sorted(emu["sandbox_results"], key=int)[0])
    summary = json.loads((a.run / CAL_DIR / SUMMARY_FILE).read_text())
    warmup = a.warmup if a.warmup is not None else int(summary.get("warmup", WARMUP))
    sources = {"slice": spans(*graph_rank(a.run / TIME_DIR / GRAPH_DIR, rank), warmup)}
    if a.record is not None:
        sources["real"] = spans(*graph_rank(a.record, rank), warmup)
    nodes, its, clock = log_rank(a.run, rank)
    sources["emulated"] = spans(nodes, its, warmup)
    if clock == "cuda-iterations":  # its spans are the host's pace: only its iterations compare
        sources["emulated"].update(compute_ms=None, span_ms={})
    out = {
        "run": str(a.run),
        "rank": rank,
        "warmup": warmup,
        "predicted_ms": summary["predicted_iteration_ns"] / MS,
        "emulated_clock": clock,
        "sources": sources,
        "schedule": schedule(a.run / EMULATE_DIR / SCHEDULE_FILE, warmup),
    }
    print(f"{a.run}  rank {rank}, iterations {warmup} on; predicted {out['predicted_ms']:.2f} ms")
    for name, s in sources.items():
        comp = f"{s['compute_ms']:.2f}" if s["compute_ms"] is not None else "-"
        it = f"{s['iteration_ms']:.2f}" if s["iteration_ms"] is not None else "-"
        print(f"  {name:9} iteration {it:>9} ms  compute {comp:>9} ms  ({s['iterations']} iterations)")
    ref = sources["slice"]["span_ms"]
    for name, s in sources.items():
        if name == "slice" or not s["span_ms"]:
            continue
        diffs = sorted(((s["span_ms"][p] - ref[p], p) for p in ref if p in s["span_ms"]), key=lambda d: -abs(d[0]))
        print(
            f"  {name} against the slice, the compute spans that differ most (place in the iteration: slice -> {name}):"
        )
        for d, p in diffs[: a.top]:
            print(f"    {p:5d}: {ref[p]:8.3f} -> {s['span_ms'][p]:8.3f} ms ({d:+.3f})")
    sch = out["schedule"]
    if sch and sch["calls"]:
        drift = sch["drift_ms_per_iteration"]
        print(
            f"  schedule: {sch['calls']} calls; the sandbox moved them {drift:+.3f} ms an iteration"
            f" (negative: ran ahead of the calibrated graph); in the call {sch['in_call_ms']:.2f} ms an iteration"
            f" against {sch['in_call_planned_ms']:.2f} planned"
        )
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
