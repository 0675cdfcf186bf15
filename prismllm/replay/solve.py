"""Solve a graph: one replay of every rank with the durations of ``durations.py``, giving
globally consistent start/end times and the predicted iteration time (``prism calibrate``'s
core; the assistant's planned ends in real-time emulation)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import numpy as np

from prismllm.replay.durations import (
    CalibrationError,
    Durations,
    check_has_durations,
    check_same_structure,
    durations_for,
    measured,
    resolve_rule,
    slice_of_rank,
)
from prismllm.replay.engine import Replay, ReplayResult
from prismllm.replay.graph import ReplayGraph
from prismllm.trace.graph import PrismTrace
from prismllm.trace.schema import REPLICAS_KEY
from prismllm.trace.summary import WARMUP
from prismllm.trace.validate import validate


# ---------------------------------------------------------------------- solve
@dataclasses.dataclass
class Solution:
    """A solved graph: the replay's result (per node position: start, end, return; per
    instance: start, end; iteration times) and the durations it was fed."""

    trace: PrismTrace
    graph: ReplayGraph
    result: ReplayResult
    durations: Durations
    rule: str
    rounds: int
    timings_s: dict[str, float]
    durations_from: str | None = None
    replicas_copied: bool = False  # the replicas' solved times are their representatives' (a copy's)
    mirror: np.ndarray | None = None  # per rank: the replayed rank it is a copy of, or -1 (left out: none)


def solve(
    trace: PrismTrace,
    *,
    durations: PrismTrace | None = None,
    rule: str = "auto",
    names: tuple[str, str] = ("GRAPH", "OTHER"),
    validate_graph: bool = True,
    adjust: Callable[[ReplayGraph, Durations], None] | None = None,
    mirror: np.ndarray | None = None,
    warmup: int = WARMUP,
) -> Solution:
    """Solve ``trace`` with its own measured durations, or with those of ``durations`` (a graph
    of the same structure). ``rule``: see :func:`instance_transfer`; ``auto`` picks it from the
    graph the durations come from (:func:`resolve_rule`). ``adjust(graph, durations)`` may change
    the durations in place before the replay (``prism whatif``). ``mirror``: the ranks left out
    as copies (:func:`prismllm.replay.mirror.mirror_plan`); the solution then holds the others.
    ``warmup``: the iterations left out of the steady median (:func:`prismllm.trace.summary.steady`)."""
    source = durations if durations is not None else trace
    if mirror is not None and durations is not None:
        raise ValueError("a solve with another graph's durations replays every rank (mirror=None)")
    rule = resolve_rule(rule, source)
    t = {}
    t0 = time.perf_counter()
    if validate_graph:
        validate(trace)
        t["validate"] = time.perf_counter() - t0
        t0 = time.perf_counter()
    if not trace.num_nodes:
        raise CalibrationError(f"graph {names[0]} has no nodes")
    graph = ReplayGraph(trace, mirror=mirror)
    t["build"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    if durations is None:
        m = measured(trace, graph.row)
        check_has_durations(trace, m, graph.is_comm, names[0])
    else:
        rows = durations.program_order()  # what ReplayGraph.row holds for a replay of every rank
        check_same_structure(graph, durations, rows, names)
        m = measured(durations, rows)
        check_has_durations(durations, m, graph.is_comm, names[1])
    d = durations_for(graph, m, rule, slice_of_rank(source))
    if adjust is not None:
        adjust(graph, d)
    t["durations"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    rep = Replay(graph, compute=d.compute_ns, transfer=d.transfer_ns, issue=d.issue_ns, warmup=warmup)
    res = rep.run_to_end()
    t["replay"] = time.perf_counter() - t0
    copied = adjust is None and REPLICAS_KEY in trace.manifest and REPLICAS_KEY in source.manifest
    return Solution(
        trace=trace,
        graph=graph,
        result=res,
        durations=d,
        rule=rule,
        rounds=rep.rounds,
        timings_s=t,
        replicas_copied=copied,
        mirror=mirror,
    )


__all__ = ["Solution", "solve"]
