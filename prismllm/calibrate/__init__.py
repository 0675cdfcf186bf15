"""Calibrate: solve a timed graph into globally consistent start/end times (docs/commands/calibrate.md).

    from prismllm.calibrate import calibrate
    summary = calibrate("out/graph", out="out/cal")              # own durations
    summary = calibrate("out/graph", out="out/cal2", durations="out/other")  # re-time

``solve`` returns the in-memory :class:`Solution` (the replay result and what it was fed);
``summarize`` / ``calibrated_table`` turn it into the summary dict and the per-node table.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from prismllm.calibrate.analyze import Timeline
from prismllm.calibrate.report import (
    CALIBRATED_FILE,
    calibrated_table,
    calibrated_trace,
    render,
    summarize,
    write,
)
from prismllm.outdir import must_replace, writing
from prismllm.outputs import SUMMARY_FILE
from prismllm.replay import TRANSFER_RULES, CalibrationError, Solution, solve
from prismllm.replay.graph import MirrorError
from prismllm.replay.mirror import mirror_plan
from prismllm.trace.graph import PrismTrace
from prismllm.trace.summary import WARMUP, steady_iteration_time


def calibrate(
    graph: str | os.PathLike,
    out: str | os.PathLike | None = None,
    *,
    durations: str | os.PathLike | None = None,
    rule: str = "auto",
    validate_graph: bool = True,
    write_graph: bool = False,
    force: bool = False,
    verify: bool = True,
    warmup: int = WARMUP,
) -> dict[str, Any]:
    """Load GRAPH (and OTHER; their files' checksums verified unless ``verify`` is False), solve,
    write CAL when ``out`` is given (with ``write_graph`` also CAL/graph, the calibrated
    PrismTrace), as its one writer from the start (``prismllm.outdir``); return the summary. A
    non-empty CAL is replaced only with ``force``, and only when it holds a calibration. ``warmup``:
    the iterations left out of the prediction's steady median (``prism calibrate --warmup``)."""
    with writing(out):
        if out is not None:  # before the solve: a refused CAL costs nothing
            must_replace(Path(out), force, (SUMMARY_FILE,), "calibration")
        t0 = time.perf_counter()
        trace = PrismTrace.load(graph, verify)
        other = PrismTrace.load(durations, verify) if durations is not None else None
        load_s = time.perf_counter() - t0
        # a graph of DP replicas that copy their representatives is solved one world (edp
        # coordinate) for all: the copies' times are their images' (prismllm.replay.mirror)
        names = (str(graph), str(durations))
        try:
            sol = solve(
                trace,
                durations=other,
                rule=rule,
                validate_graph=validate_graph,
                names=names,
                mirror=mirror_plan(trace) if other is None else None,
                warmup=warmup,
            )
        except MirrorError:  # a pair of calls across DP replicas: every rank solved (validated above)
            sol = solve(trace, durations=other, rule=rule, validate_graph=False, names=names, warmup=warmup)
        check_warmup(len(sol.graph.iterations), warmup, str(graph))
        t0 = time.perf_counter()
        summary = summarize(
            sol, str(graph), str(durations) if durations is not None else None, {"load": load_s, **sol.timings_s}
        )
        if other is not None:
            ref = steady_iteration_time(other, warmup=warmup)
            pred = summary["predicted_iteration_ns"]
            summary["durations_recorded_iteration_ns"] = ref
            summary["durations_rel_error"] = (pred - ref) / ref if (ref and pred is not None) else None
        summary["solve"]["analyze_s"] = round(time.perf_counter() - t0, 4)
        if out is not None:
            t0 = time.perf_counter()
            table = calibrated_table(sol)
            write(out, table, summary, calibrated_trace(sol) if write_graph else None)
            summary["solve"]["write_s"] = round(time.perf_counter() - t0, 4)
        return summary


def check_warmup(n: int, warmup: int, name: str) -> None:
    """Refuse a warm-up that leaves none of a graph's ``n`` iterations steady (or is negative); the
    default's one, of a graph of one iteration, leaves that one (the first is all there is)."""
    if warmup < 0 or (warmup > WARMUP and warmup >= n > 0):
        raise CalibrationError(
            f"--warmup {warmup}: graph {name} has {n} iteration(s), of which at most {max(n - 1, 0)} can be left "
            f"out (or run the program for more iterations)"
        )


__all__ = [
    "CALIBRATED_FILE",
    "calibrated_trace",
    "TRANSFER_RULES",
    "CalibrationError",
    "Solution",
    "Timeline",
    "calibrate",
    "calibrated_table",
    "render",
    "solve",
    "summarize",
    "write",
]
