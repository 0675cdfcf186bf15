"""Compare two graphs: structure (what each rank communicates, in what order) and timing.

    result = compare_traces(a, b)           # the judge later stages use
    result.structure_equal                  # True / False (None when not checked)
    result.first_difference                 # dict (see below) or None
    result.rel_error                        # (B - A) / A of the steady iteration time
    result.to_dict()                        # what `prism compare --json` prints

Structure: same world size and ranks; per rank, the communication nodes in program order
with equal op, group (compared by its ranks tuple, not its id), in_bytes, out_bytes, dtype,
reduce_op, peer, in_splits and out_splits. Compute spans are not compared. The first
difference is the lowest rank, then the lowest comm index (the position among that rank's
communication nodes); ``first_difference`` = {``rank``, ``comm_index``, ``field``, ``a``, ``b``,
``node_a``, ``node_b`` (the two nodes: index, op, group {id, desc, ranks}, sizes; null where a
side has no such node), ``message``}; for a world-size or rank-set difference only ``field``,
``a``, ``b``, ``message``.

Timing: per-iteration time of each graph (max over ranks of end - start), the median over
steady iterations (all but the first when there are at least two) and the relative error
(B - A) / A overall and per rank (each rank's own median steady iteration time); the total
compute-span time per rank of each graph. Values are null where a graph has no times.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from prismllm.trace.graph import PrismTrace
from prismllm.trace.summary import (
    compute_time_by_rank,
    host_lead_by_rank,
    iteration_times,
    rank_iteration_times,
    steady,
)

# Below this lead the host issued each call about when the device reached it: the device waited
# for the host (a launch takes ~0.1 ms on the GPU machines; a host that runs ahead leads by ms).
HOST_BOUND_NS = 1_000_000
FIELDS = ("op", "group", "in_bytes", "out_bytes", "dtype", "reduce_op", "peer", "in_splits", "out_splits")


@dataclasses.dataclass
class CompareResult:
    structure_equal: bool | None = None
    first_difference: dict[str, Any] | None = None
    iteration_time_a_ns: int | None = None
    iteration_time_b_ns: int | None = None
    rel_error: float | None = None
    per_rank: dict[int, float] = dataclasses.field(default_factory=dict)
    iterations: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    compute_ns: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)
    host_bound_differs: list[int] = dataclasses.field(default_factory=list)
    timing_checked: bool = False

    def to_dict(self) -> dict[str, Any]:
        structure = None
        if self.structure_equal is not None:
            structure = {"equal": self.structure_equal, "first_difference": self.first_difference}
        timing = None
        if self.timing_checked:
            timing = {
                "iteration_time_a_ns": self.iteration_time_a_ns,
                "iteration_time_b_ns": self.iteration_time_b_ns,
                "rel_error": self.rel_error,
                "per_rank": {str(r): e for r, e in sorted(self.per_rank.items())},
                "iterations": self.iterations,
                "compute_ns": {str(r): v for r, v in sorted(self.compute_ns.items())},
                "host_bound_differs": self.host_bound_differs,
            }
        return {"structure": structure, "timing": timing}


def compare_traces(a: PrismTrace, b: PrismTrace, *, structure: bool = True, timing: bool = True) -> CompareResult:
    res = CompareResult()
    if structure:
        res.first_difference = compare_structure(a, b)
        res.structure_equal = res.first_difference is None
    if timing:
        _compare_timing(a, b, res)
    return res


# ---------------------------------------------------------------------- structure
class _Comm:
    """The comm nodes of one graph in (rank, index) order, with canonical group ids."""

    def __init__(self, t: PrismTrace, canon: dict[tuple[int, ...], int]) -> None:
        self.t = t
        nodes = t.nodes
        is_comm = pc.equal(nodes.column("kind"), "comm").to_numpy(zero_copy_only=False)
        order = t.program_order()
        self.rows = order[is_comm[order]]
        self.rank = t.column("rank")[self.rows].astype(np.int64)
        self.index = t.column("index")[self.rows].astype(np.int64)
        self.tab = nodes.take(pa.array(self.rows)).combine_chunks() if len(self.rows) else nodes.slice(0, 0)
        info = t.group_info()
        gmax = max(info) + 1 if info else 0
        cmap = np.full(gmax + 1, -1, dtype=np.int64)
        for gid, g in info.items():
            cmap[gid] = canon.setdefault(tuple(g["ranks"]), len(canon))
        g = self.tab.column("group").to_numpy().astype(np.int64)
        self.group = np.where((g >= 0) & (g < gmax), cmap[np.clip(g, 0, gmax)], -1)

    def node(self, pos: int) -> dict[str, Any]:
        row = self.tab.slice(pos, 1).to_pylist()[0]
        gid = row["group"]
        g = self.t.group_info().get(gid, {})
        return {
            "index": row["index"],
            "op": row["op"],
            "group": {"id": gid, "desc": g.get("desc", ""), "ranks": g.get("ranks", [])},
            "in_bytes": row["in_bytes"],
            "out_bytes": row["out_bytes"],
            "dtype": row["dtype"],
            "reduce_op": row["reduce_op"],
            "peer": row["peer"],
            "in_splits": row["in_splits"],
            "out_splits": row["out_splits"],
        }


def _field_mismatch(ca: _Comm, cb: _Comm, pa_idx: np.ndarray, pb_idx: np.ndarray, field: str) -> np.ndarray:
    if field == "group":
        return ca.group[pa_idx] != cb.group[pb_idx]
    if field in ("in_bytes", "out_bytes", "peer"):
        return ca.tab.column(field).to_numpy()[pa_idx] != cb.tab.column(field).to_numpy()[pb_idx]
    if field in ("op", "dtype", "reduce_op"):
        x = ca.tab.column(field).take(pa.array(pa_idx))
        y = cb.tab.column(field).take(pa.array(pb_idx))
        return ~pc.equal(x, y).to_numpy(zero_copy_only=False).astype(bool)
    # list columns
    x = ca.tab.column(field).take(pa.array(pa_idx)).combine_chunks()
    y = cb.tab.column(field).take(pa.array(pb_idx)).combine_chunks()
    lx = pc.list_value_length(x).to_numpy(zero_copy_only=False).astype(np.int64)
    ly = pc.list_value_length(y).to_numpy(zero_copy_only=False).astype(np.int64)
    bad = lx != ly
    same = np.flatnonzero(~bad & (lx > 0))
    if len(same):
        fx = pc.list_flatten(x.take(pa.array(same))).to_numpy(zero_copy_only=False)
        fy = pc.list_flatten(y.take(pa.array(same))).to_numpy(zero_copy_only=False)
        owner = np.repeat(same, lx[same])
        diff = owner[fx != fy]
        bad[diff] = True
    return bad


def _group_text(g: dict[str, Any]) -> str:
    r = g["ranks"]
    rs = str(r) if len(r) <= 8 else f"[{r[0]}, ..., {r[-1]}] ({len(r)} ranks)"
    return f"group {g['id']} ('{g['desc']}', ranks {rs})"


def compare_structure(a: PrismTrace, b: PrismTrace) -> dict[str, Any] | None:
    """None if the structure is equal, else the first difference."""
    if a.world_size != b.world_size:
        return {
            "field": "world_size",
            "a": a.world_size,
            "b": b.world_size,
            "message": f"world size differs: A has {a.world_size} ranks, B has {b.world_size}",
        }
    ra, rb = a.ranks(), b.ranks()
    if not np.array_equal(ra, rb):
        only_a = np.setdiff1d(ra, rb)
        only_b = np.setdiff1d(rb, ra)
        r = int(min(list(only_a[:1]) + list(only_b[:1])))
        side = "A" if r in set(only_a.tolist()) else "B"
        return {
            "field": "ranks",
            "a": ra.tolist() if len(ra) <= 64 else len(ra),
            "b": rb.tolist() if len(rb) <= 64 else len(rb),
            "message": f"rank {r} has nodes only in {side}",
        }
    canon: dict[tuple[int, ...], int] = {}
    ca, cb = _Comm(a, canon), _Comm(b, canon)
    ws = a.world_size
    na = np.bincount(ca.rank, minlength=ws)
    nb = np.bincount(cb.rank, minlength=ws)
    sa = np.cumsum(na) - na
    sb = np.cumsum(nb) - nb
    m = np.minimum(na, nb)
    pair_rank = np.repeat(np.arange(ws), m)
    k = np.arange(int(m.sum())) - np.repeat((np.cumsum(m) - m), m)
    ia = np.repeat(sa, m) + k
    ib = np.repeat(sb, m) + k

    cand: list[tuple[int, int, str, int | None, int | None]] = []  # (rank, comm index, field, pos a, pos b)
    if len(ia):
        any_bad = np.zeros(len(ia), dtype=bool)
        masks = {}
        for f in FIELDS:
            masks[f] = _field_mismatch(ca, cb, ia, ib, f)
            any_bad |= masks[f]
        p = np.flatnonzero(any_bad)
        if len(p):
            p0 = int(p[0])
            field = next(f for f in FIELDS if masks[f][p0])
            cand.append((int(pair_rank[p0]), int(k[p0]), field, int(ia[p0]), int(ib[p0])))
    cnt = np.flatnonzero(na != nb)
    if len(cnt):
        r = int(cnt[0])
        pos = int(m[r])
        cand.append(
            (r, pos, "count", int(sa[r] + pos) if na[r] > pos else None, int(sb[r] + pos) if nb[r] > pos else None)
        )
    if not cand:
        return None
    r, pos, field, pa_, pb_ = min(cand, key=lambda c: (c[0], c[1]))
    node_a = ca.node(pa_) if pa_ is not None else None
    node_b = cb.node(pb_) if pb_ is not None else None
    if field == "count":
        va, vb = int(na[r]), int(nb[r])
        extra = node_a or node_b
        side = "A" if node_a else "B"
        message = (
            f"rank {r}: A has {va} communication events, B has {vb}; the first extra one is "
            f"comm #{pos} in {side}: node {extra['index']} {extra['op']} on {_group_text(extra['group'])}"
        )
    else:
        if field == "group":
            va, vb = node_a["group"], node_b["group"]
            shown_a, shown_b = _group_text(va), _group_text(vb)
        else:
            va, vb = node_a[field], node_b[field]
            shown_a, shown_b = repr(va), repr(vb)
        message = (
            f"rank {r} comm #{pos} (A node {node_a['index']}, B node {node_b['index']}: "
            f"{node_a['op']} on {_group_text(node_a['group'])}): {field} differs: "
            f"A {shown_a}, B {shown_b}"
        )
    return {
        "rank": r,
        "comm_index": pos,
        "field": field,
        "a": va,
        "b": vb,
        "node_a": node_a,
        "node_b": node_b,
        "message": message,
    }


# ---------------------------------------------------------------------- timing
def _rel(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or a <= 0:
        return None
    return (b - a) / a


def _compare_timing(a: PrismTrace, b: PrismTrace, res: CompareResult) -> None:
    res.timing_checked = True
    ia, ib = iteration_times(a), iteration_times(b)
    sa, sb = steady(ia), steady(ib)
    res.iteration_time_a_ns = int(np.median([x["max_ns"] for x in sa])) if sa else None
    res.iteration_time_b_ns = int(np.median([x["max_ns"] for x in sb])) if sb else None
    res.rel_error = _rel(res.iteration_time_a_ns, res.iteration_time_b_ns)
    by_a = {x["iteration"]: x["max_ns"] for x in ia}
    by_b = {x["iteration"]: x["max_ns"] for x in ib}
    res.iterations = [
        {"iteration": i, "a_ns": by_a.get(i), "b_ns": by_b.get(i), "rel_error": _rel(by_a.get(i), by_b.get(i))}
        for i in sorted(set(by_a) | set(by_b))
    ]
    pa_, pb_ = rank_iteration_times(a), rank_iteration_times(b)
    res.per_rank = {r: _rel(pa_[r], pb_[r]) for r in sorted(set(pa_) & set(pb_))}
    ca, cb = compute_time_by_rank(a), compute_time_by_rank(b)
    la, lb = host_lead_by_rank(a), host_lead_by_rank(b)
    res.compute_ns = {
        r: {
            "a_ns": ca.get(r),
            "b_ns": cb.get(r),
            "rel_error": _rel(ca.get(r), cb.get(r)),
            "host_lead_a_ns": la.get(r),
            "host_lead_b_ns": lb.get(r),
        }
        for r in sorted(set(ca) | set(cb))
    }
    # ranks whose device waited for its host in one graph and not in the other: their compute
    # spans measure different things (host pace against kernel time), so their compute differs
    # by the host's launch time, whatever the kernels did
    res.host_bound_differs = sorted(r for r in set(la) & set(lb) if (la[r] < HOST_BOUND_NS) != (lb[r] < HOST_BOUND_NS))
