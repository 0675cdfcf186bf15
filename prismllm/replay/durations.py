"""The durations a replay is fed from a graph's measurements (what calibration solves with, and
what an assistant replays virtual ranks with in real time).

The discrete-event pass is the replay engine's (:class:`prismllm.replay.Replay`): it walks the
directional edges (program order per rank, issue -> wait of asynchronous ops) and the
synchronisation edges (a collective instance or a matched send/recv starts when its last
member arrives) in logical time. This module only decides what durations it is fed, and reads
the times it records back:

- compute span: its measured ``duration_ns`` (else ``end_ns - start_ns`` where both are known);
- communication instance (collective, or a send/recv pair), rule ``min``: the *minimum* over
  its members of the measured duration (``duration_ns``, else ``end_ns - start_ns``). Every
  member's measurement is "from my arrival to the end", so everyone but the last to arrive also
  counts the wait for late peers; the minimum is the one that waited least. Unlike the engine's
  default ("the duration of the member whose ``start_ns`` is latest") it compares no clock
  readings across ranks, so it holds for ranks on different hosts (docs/commands/calibrate.md).
  Rule ``slice``, for a timed graph: the members measured in one slice give one measurement
  (their minimum, as above: the virtual members were there first), and the instance's transfer
  is the *mean* over the slices that measured it: each slice measured the transfer alone, and
  the minimum of several independent measurements would keep only their low tail. ``auto``
  (the default) is ``slice`` for a timed graph that says which slice measured each rank, else
  ``min``;
- issue of an asynchronous call (host time it holds the rank): the gap from the call to the
  next node in the recording, as the engine measures it (0 before a wait point).

``durations=OTHER`` takes all three from another graph of the same structure (same ranks,
same node count per rank, same op at every position): "re-time without re-capture".
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from prismllm.errors import InputError
from prismllm.replay.graph import ReplayGraph, ranges
from prismllm.trace.graph import PrismTrace

_I64 = np.int64

TRANSFER_RULES = ("auto", "min", "slice", "last")


class CalibrationError(InputError):
    """A graph that cannot be calibrated (no durations, structures that differ, ...)."""


# ---------------------------------------------------------------------- measured durations
@dataclasses.dataclass
class Measured:
    """Per node position of a ReplayGraph (rank by rank, program order): the measured duration
    (-1 unknown) and the recorded start (-1 unknown)."""

    duration_ns: np.ndarray
    start_ns: np.ndarray

    @property
    def known(self) -> np.ndarray:
        return self.duration_ns >= 0


def measured(trace: PrismTrace, rows: np.ndarray) -> Measured:
    """``duration_ns`` where known (>= 0), else ``end_ns - start_ns`` where both are known."""
    dur = trace.column("duration_ns").astype(_I64)[rows]
    start = trace.column("start_ns").astype(_I64)[rows]
    end = trace.column("end_ns").astype(_I64)[rows]
    fallback = np.where((start >= 0) & (end >= start), end - start, -1)
    return Measured(duration_ns=np.where(dur >= 0, dur, fallback), start_ns=start)


def check_has_durations(trace: PrismTrace, m: Measured, is_comm: np.ndarray, name: str) -> None:
    if not len(m.duration_ns):
        raise CalibrationError(f"graph {name} has no nodes")
    if not m.known[~is_comm].any() and not m.known[is_comm].any():
        mode = trace.manifest.get("mode") or "?"
        raise CalibrationError(
            f"graph {name} carries no measured durations (mode {mode!r}: every duration_ns, start_ns "
            f"and end_ns is unknown); calibrate a graph recorded with `prism record` or a timed one, "
            f"or give the durations with --durations OTHER"
        )


def check_same_structure(
    graph: ReplayGraph, other: PrismTrace, rows: np.ndarray, names: tuple[str, str] = ("GRAPH", "OTHER")
) -> None:
    """OTHER has the same ranks, node count per rank and op at every position as the graph;
    else a CalibrationError naming the rank and its first differing node."""
    a_name, b_name = (f"graph {x}" for x in names)
    ranks_a = graph.ranks
    rank_b = other.column("rank").astype(_I64)[rows]
    ranks_b, counts_b = np.unique(rank_b, return_counts=True)
    only_a = np.setdiff1d(ranks_a, ranks_b)
    only_b = np.setdiff1d(ranks_b, ranks_a)
    if len(only_a) or len(only_b):
        if len(only_a):
            r, where, missing = int(only_a[0]), a_name, b_name
        else:
            r, where, missing = int(only_b[0]), b_name, a_name
        raise CalibrationError(
            f"--durations: {b_name} has another structure than {a_name}: rank {r} has nodes in {where} but none "
            f"in {missing} ({len(ranks_a)} ranks in one, {len(ranks_b)} in the other); --durations needs a graph of "
            f"the same program and layout"
        )
    counts_a = np.diff(graph.off)
    ops_a = graph.trace.nodes.column("op").take(pa.array(graph.row))
    ops_b = other.nodes.column("op").take(pa.array(rows))
    # first differing op per rank, over the common prefix of each rank
    off_b = np.r_[0, np.cumsum(counts_b)]
    common = np.minimum(counts_a, counts_b)
    pos_a = ranges(graph.off[:-1], common)
    pos_b = ranges(off_b[:-1], common)
    diff = np.zeros(len(pos_a), dtype=bool)
    if len(pos_a):
        eq = pc.equal(ops_a.take(pa.array(pos_a)), ops_b.take(pa.array(pos_b)))
        diff = ~pc.fill_null(eq, False).to_numpy(zero_copy_only=False)
    bad_rank = np.zeros(len(ranks_a), dtype=bool)
    first_bad = np.full(len(ranks_a), -1, dtype=_I64)
    if diff.any():
        seg = np.repeat(np.arange(len(ranks_a)), common)
        d = np.flatnonzero(diff)
        r_of = seg[d]
        u, first = np.unique(r_of, return_index=True)
        bad_rank[u] = True
        first_bad[u] = pos_a[d[first]] - graph.off[u]
    bad_rank |= counts_a != counts_b
    if not bad_rank.any():
        return
    r = int(np.flatnonzero(bad_rank)[0])
    rank = int(ranks_a[r])
    if first_bad[r] >= 0:
        i = int(first_bad[r])
        oa = ops_a[int(graph.off[r] + i)].as_py()
        ob = ops_b[int(off_b[r] + i)].as_py()
        raise CalibrationError(
            f"--durations: {b_name} has another structure than {a_name}: rank {rank} node {i} is {oa} in "
            f"{a_name} but {ob} in {b_name}; --durations needs a graph of the same program and layout"
        )
    i = int(common[r])
    raise CalibrationError(
        f"--durations: {b_name} has another structure than {a_name}: rank {rank} has {int(counts_a[r])} nodes "
        f"in {a_name} but {int(counts_b[r])} in {b_name} (first differing node {i}: the shorter one ends there); "
        f"--durations needs a graph of the same program and layout"
    )


# ---------------------------------------------------------------------- durations fed to the replay
@dataclasses.dataclass
class Durations:
    compute_ns: np.ndarray  # per node position (compute nodes read)
    transfer_ns: np.ndarray  # per instance
    issue_ns: np.ndarray  # per node position (non-blocking comm nodes read)
    unknown_compute: int  # compute nodes without a measurement (counted as 0)
    unknown_transfer: int  # instances with no member measured (counted as 0)


def slice_of_rank(trace: PrismTrace) -> list[int] | None:
    """Which slice measured each rank of a timed graph (``prism time``'s manifest), else None."""
    timing = trace.manifest.get("timing") or {}
    s = timing.get("slice_of_rank")
    if trace.manifest.get("mode") != "timed" or not isinstance(s, list) or len(s) != trace.world_size:
        return None
    return [int(x) for x in s]


def resolve_rule(rule: str, measured_in: PrismTrace) -> str:
    """``auto`` -> ``slice`` for a timed graph that names its slices, else ``min``."""
    if rule not in TRANSFER_RULES:
        raise CalibrationError(f"transfer rule {rule!r}: expected one of {', '.join(TRANSFER_RULES)}")
    if rule == "auto":
        return "slice" if slice_of_rank(measured_in) is not None else "min"
    if rule == "slice" and slice_of_rank(measured_in) is None:
        raise CalibrationError(
            "transfer rule 'slice' needs a timed graph (`prism time`) that names the slice of "
            "each rank; use --transfer min for a recording"
        )
    return rule


def instance_transfer(
    graph: ReplayGraph, m: Measured, rule: str = "min", slice_of: list[int] | None = None
) -> tuple[np.ndarray, int]:
    """Transfer time of every instance from its members' measurements: ``min`` (the member that
    waited least), ``slice`` (the mean over the slices that measured the instance of each
    slice's minimum; ``slice_of``: the slice of every rank) or ``last`` (the member whose
    recorded start is latest, the engine's rule). Members without a measurement are ignored;
    an instance with none gets 0."""
    ni = graph.num_instances
    if not ni:
        return np.zeros(0, dtype=_I64), 0
    d = m.duration_ns[graph.inst_nodes]
    cnt = np.diff(graph.inst_ptr)
    if rule == "slice":
        if slice_of is None:
            raise ValueError("transfer rule 'slice' needs the slice of every rank")
        seg = np.repeat(np.arange(ni), cnt)
        key = np.asarray(slice_of, dtype=_I64)[graph.ranks[graph.rank_pos[graph.inst_nodes]]]
        ok = d >= 0
        seg, key, dv = seg[ok], key[ok], d[ok]
        o = np.lexsort((dv, key, seg))  # by instance, then slice, smallest first
        seg, key, dv = seg[o], key[o], dv[o]
        first = np.r_[True, (seg[1:] != seg[:-1]) | (key[1:] != key[:-1])] if len(seg) else np.zeros(0, bool)
        total = np.bincount(seg[first], weights=dv[first].astype(np.float64), minlength=ni)
        count = np.bincount(seg[first], minlength=ni)
        out = np.where(count > 0, np.rint(total / np.maximum(count, 1)), -1).astype(_I64)
    elif rule == "min":
        big = np.iinfo(_I64).max
        out = np.minimum.reduceat(np.where(d >= 0, d, big), graph.inst_ptr[:-1])
        out[cnt == 0] = big
    elif rule == "last":
        seg = np.repeat(np.arange(ni), cnt)
        s = np.where(d >= 0, m.start_ns[graph.inst_nodes], np.iinfo(_I64).min)
        o = np.lexsort((s, seg))
        out = d[o][graph.inst_ptr[1:] - 1]
    else:
        raise ValueError(f"transfer rule {rule!r}: expected one of {', '.join(TRANSFER_RULES)}")
    unknown = (out < 0) | (out == np.iinfo(_I64).max)
    return np.where(unknown, 0, out).astype(_I64), int(unknown.sum())


def issue_gaps(graph: ReplayGraph, start: np.ndarray) -> np.ndarray:
    """The host time each non-blocking call held its rank: the gap from its start to the next
    node's start, 0 before a wait point (whose start also holds the wait) or where unknown.
    The same rule as ReplayGraph's recorded issue, applied to any start times."""
    nxt = np.r_[start[1:], -1]
    same_rank = np.r_[graph.rank_pos[1:] == graph.rank_pos[:-1], False]
    before_wait = np.r_[np.diff(graph.wait_ptr)[1:] > 0, False]
    ok = graph.is_comm & ~graph.blocking & same_rank & ~before_wait & (start >= 0) & (nxt >= 0)
    return np.where(ok, np.maximum(nxt - start, 0), 0).astype(_I64)


def durations_for(graph: ReplayGraph, m: Measured, rule: str = "min", slice_of: list[int] | None = None) -> Durations:
    compute = np.where(graph.is_comm, 0, np.maximum(m.duration_ns, 0)).astype(_I64)
    transfer, unknown_t = instance_transfer(graph, m, rule, slice_of)
    return Durations(
        compute_ns=compute,
        transfer_ns=transfer,
        issue_ns=issue_gaps(graph, m.start_ns),
        unknown_compute=int((~graph.is_comm & ~m.known).sum()),
        unknown_transfer=unknown_t,
    )


__all__ = [
    "CalibrationError",
    "Durations",
    "Measured",
    "TRANSFER_RULES",
    "check_has_durations",
    "check_same_structure",
    "durations_for",
    "instance_transfer",
    "issue_gaps",
    "measured",
    "resolve_rule",
    "slice_of_rank",
]
