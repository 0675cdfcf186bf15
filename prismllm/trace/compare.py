"""Compare two graphs: structure (what each rank does, in what order, and every table that
describes it) and timing.

    result = compare_traces(a, b)           # the judge later stages use
    result.structure_equal                  # True / False (None when not checked)
    result.first_difference                 # dict (see below) or None
    result.differences                      # one entry per kind of difference found (see below)
    result.manifest                         # the manifest keys that describe the job and differ
    result.rel_error                        # (B - A) / A of the steady iteration time
    result.to_dict()                        # what `prism compare --json` prints

Structure, in this order:

- the world size, and the ranks that have nodes. When they differ nothing per rank is compared.
- ``nodes``, the communication nodes of each rank in program order ("comm #k": the k-th
  communication node of its rank): op, group (by its ranks tuple, not its id or torch name),
  in_bytes, out_bytes, dtype, reduce_op, peer, in_splits, out_splits, seq, tag, async_op,
  shape, iteration and label as they are; ``coalesced`` as batch membership (the comm # of the
  batch's first member, -1 for none: batch ids differ between graphs) and ``wait_point`` as the
  number of communication nodes the wait point comes after (-1 for none: ``wait_index`` counts
  compute spans too); and their number (field ``count``).
- ``nodes``, the kind (compute or comm) at every index of each rank: where the compute spans
  lie, and how many there are (field ``kind``). A recording, a solo capture and a timed graph of
  one program have the same compute spans, every rank's kind sequence equal: checked on the CPU
  with gpt3d TP2·PP2·DP2 (8 ranks), Megatron TP2·PP2 and torchtitan FSDP2·TP2 (record against
  solo capture), gpt3d TP2 (solo capture against its timed graph) and the native recorder's
  graphs against the Python path's; a calibrated graph keeps its source's nodes.
- ``iterations``: per rank, the iteration numbers present (rows counted: a duplicated or lost
  row is a difference) and, where both graphs have them, their labels. Times are not compared.
- ``groups``: the multiset of (ranks, desc). Group ids and torch names may differ (a solo
  capture renames its groups).
- ``edges``: each graph's edges against those its own nodes imply
  (:func:`prismllm.trace.edges.build_edges`), as a multiset of (src, dst, kind): a graph whose
  edges table is not what its nodes imply is a difference of that graph (``graph`` "A" or
  "B"); then the number of edges of each kind, A against B.
- ``manifest``: the keys that describe the job (:data:`MANIFEST_KEYS`), informational: they do
  not make the structures differ (a recording and its solo capture differ in ``mode`` and
  ``layout``), except ``world_size`` (above). The keys that always differ (created, hostname,
  argv, versions, the seal) and those saying how the graph was made (capture, timing,
  calibration, clock, recorder) are not compared.

Not compared: node ids, ``api`` (the native and Python recorders name the entry points apart),
``stream`` (it carries torch group names), times.

``differences``: one entry per kind of difference found, in the order above: {``table``,
``field``, ``count`` (the rows that differ or exist in one graph only; for ``edges``/``count``
and ``manifest``/``peak_memory_bytes`` the kinds or ranks), ``informational`` (true for
manifest entries), ``message`` (one line), ``first`` (its first example, shaped as
``first_difference``)}, with ``graph`` ("A" or "B") on an ``edges``/``implied`` entry.

``first_difference`` is the first structural difference: a world-size or rank-set one; else
the communication difference of the lowest rank, then the lowest comm index (ties in the field
order above); else the first entry of ``differences``. It always has ``table``, ``field`` and
``message``. A communication difference: {``rank``, ``comm_index``, ``a``, ``b``, ``node_a``,
``node_b`` (the two nodes: index, op, group {id, desc, ranks}, sizes, seq, tag, async_op,
shape, iteration, label, coalesced, wait_index as stored; null where a side has no such
node)}; a kind difference: {``rank``, ``index``, ``a``, ``b`` ("compute", "comm", null)}; an
iteration one: {``rank``, ``iteration``, ``a``, ``b`` (A's and B's rows, or labels)}; a group
one: {``group`` {desc, ranks}, ``a``, ``b`` (how many A and B have)}; an implied-edges one:
{``graph``, ``kind``, ``missing``, ``extra``, ``edge`` {src, dst, kind, missing}}; an edge-count
one: {``kind``, ``a``, ``b``}; world size and rank set: {``a``, ``b``}.

``manifest``: [{``key``, ``a``, ``b``, ``message``}], ``key`` one of :data:`MANIFEST_KEYS`
(``program.sha256``, ``program.args`` for the program's fingerprint); for
``peak_memory_bytes`` ``a`` and ``b`` hold the differing ranks only.

Timing: per-iteration time of each graph (max over ranks of end - start), the median over
steady iterations (all but the first when there are at least two) and the relative error
(B - A) / A overall and per rank (each rank's own median steady iteration time); the total
compute-span time per rank of each graph. Values are null where a graph has no times.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from prismllm.trace.edges import build_edges, run_starts
from prismllm.trace.graph import PrismTrace
from prismllm.trace.schema import EDGE_KINDS, KIND_COMM
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
# The communication node columns compared as they are, then the two compared as positions
# (their stored values, a batch id and a node index, differ between graphs of one program)
FIELDS = (
    "op", "group", "in_bytes", "out_bytes", "dtype", "reduce_op", "peer", "in_splits", "out_splits",
    "seq", "tag", "async_op", "shape", "iteration", "label",
)  # fmt: skip
POSITION_FIELDS = ("coalesced", "wait_point")
COMM_FIELDS = FIELDS + POSITION_FIELDS
# The manifest keys that describe the job; "program.x" is key x of the program's fingerprint.
MANIFEST_KEYS = (
    "world_size", "layout", "command", "program.sha256", "program.args", "device", "mode", "peak_memory_bytes",
)  # fmt: skip
# a rank or a batch id fits below 2**32, an index or an iteration shifted by 2**31 too: a pair
# of them packs into one int64 key
_HIGH = np.int64(1) << 32
_SHIFT = np.int64(1) << 31


@dataclasses.dataclass
class CompareResult:
    structure_equal: bool | None = None
    first_difference: dict[str, Any] | None = None
    differences: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    manifest: list[dict[str, Any]] | None = None
    iteration_time_a_ns: int | None = None
    iteration_time_b_ns: int | None = None
    rel_error: float | None = None
    per_rank: dict[int, float] = dataclasses.field(default_factory=dict)
    iterations: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    compute_ns: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)
    host_bound_differs: list[int] = dataclasses.field(default_factory=list)
    node_times: dict[str, Any] | None = None  # nodes whose own times differ (_node_times)
    timing_checked: bool = False

    def to_dict(self) -> dict[str, Any]:
        structure = None
        if self.structure_equal is not None:
            structure = {
                "equal": self.structure_equal,
                "first_difference": self.first_difference,
                "differences": self.differences,
            }
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
                "node_times": self.node_times,
            }
        return {"structure": structure, "manifest": self.manifest, "timing": timing}


def compare_traces(a: PrismTrace, b: PrismTrace, *, structure: bool = True, timing: bool = True) -> CompareResult:
    res = CompareResult()
    if structure:
        res.first_difference, res.differences = structure_differences(a, b)
        res.structure_equal = res.first_difference is None
        res.manifest = manifest_differences(a, b)
    if timing:
        _compare_timing(a, b, res)
    return res


def compare_structure(a: PrismTrace, b: PrismTrace) -> dict[str, Any] | None:
    """None if the structure is equal, else the first difference."""
    return structure_differences(a, b)[0]


def structure_differences(a: PrismTrace, b: PrismTrace) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """(the first structural difference or None, every kind of difference found: the
    structural ones, then the manifest's informational ones)."""
    entries = _world_differences(a, b)
    if not entries:
        canon: dict[tuple[int, ...], int] = {}
        ca, cb = _Comm(a, canon), _Comm(b, canon)
        entries += _comm_differences(ca, cb, a.world_size)
        entries += _kind_differences(a, b)
        entries += _iteration_differences(a, b)
    entries += _group_differences(a, b)
    entries += _implied_edge_differences(a, "A") + _implied_edge_differences(b, "B")
    entries += _edge_count_differences(a, b)
    # the lowest rank and comm index first (min keeps the first of equals: the field order)
    comm = [e["first"] for e in entries if "comm_index" in e["first"]]
    first = min(comm, key=lambda d: (d["rank"], d["comm_index"])) if comm else None
    first = first or (entries[0]["first"] if entries else None)
    # the world size is a structural entry already
    entries += [_manifest_entry(m) for m in manifest_differences(a, b) if m["key"] != "world_size"]
    return first, entries


def _entry(table: str, field: str, count: int, message: str, first: dict[str, Any], **extra: Any) -> dict[str, Any]:
    first = {"table": table, "field": field, **first}
    return {
        "table": table,
        "field": field,
        **extra,
        "count": int(count),
        "informational": False,
        "message": message,
        "first": first,
    }


# ---------------------------------------------------------------------- world and ranks
def _world_differences(a: PrismTrace, b: PrismTrace) -> list[dict[str, Any]]:
    if a.world_size != b.world_size:
        msg = f"world size differs: A has {a.world_size} ranks, B has {b.world_size}"
        return [_entry("manifest", "world_size", 1, msg, {"a": a.world_size, "b": b.world_size, "message": msg})]
    ra, rb = a.ranks(), b.ranks()
    if np.array_equal(ra, rb):
        return []
    only_a = np.setdiff1d(ra, rb)
    only_b = np.setdiff1d(rb, ra)
    r = int(min(list(only_a[:1]) + list(only_b[:1])))
    side = "A" if r in set(only_a.tolist()) else "B"
    msg = f"rank {r} has nodes only in {side}"
    first = {
        "a": ra.tolist() if len(ra) <= 64 else len(ra),
        "b": rb.tolist() if len(rb) <= 64 else len(rb),
        "message": msg,
    }
    n = len(only_a) + len(only_b)
    return [_entry("nodes", "ranks", n, f"nodes.ranks: {n} rank(s) have nodes in one graph only; first: {msg}", first)]


# ---------------------------------------------------------------------- communication nodes
def _rank_offsets(rank: np.ndarray) -> np.ndarray:
    """For rows sorted by rank: each row's position among its rank's rows."""
    return np.arange(len(rank), dtype=np.int64) - np.searchsorted(rank, rank, side="left")


def _paired(na: np.ndarray, nb: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Rows of two tables grouped by rank (``na``, ``nb`` rows a rank), paired position by
    position over each rank's common prefix: (rank, position, row in A, row in B)."""
    sa, sb = np.cumsum(na) - na, np.cumsum(nb) - nb
    m = np.minimum(na, nb)
    rank = np.repeat(np.arange(len(m)), m)
    k = np.arange(int(m.sum())) - np.repeat(np.cumsum(m) - m, m)
    return rank, k, np.repeat(sa, m) + k, np.repeat(sb, m) + k


class _Comm:
    """The comm nodes of one graph in (rank, index) order, with canonical group ids, batches
    and wait points."""

    def __init__(self, t: PrismTrace, canon: dict[tuple[int, ...], int]) -> None:
        self.t = t
        nodes = t.nodes
        is_comm = pc.equal(nodes.column("kind"), KIND_COMM).to_numpy(zero_copy_only=False)
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
        self.pos = _rank_offsets(self.rank)  # comm #
        # a batch: the comm # of its first member on the rank
        batch = self.tab.column("coalesced").to_numpy().astype(np.int64)
        self.coalesced = np.full(len(self.rows), -1, dtype=np.int64)
        member = np.flatnonzero(batch >= 0)
        if len(member):
            _, head, inv = np.unique(self.rank[member] * _HIGH + batch[member], return_index=True, return_inverse=True)
            self.coalesced[member] = self.pos[member][head][inv.reshape(-1)]
        # a wait point: how many of the rank's comm nodes come before the node at wait_index
        wait = self.tab.column("wait_index").to_numpy().astype(np.int64)
        before = np.searchsorted(self.rank * _HIGH + self.index, self.rank * _HIGH + np.maximum(wait, 0), side="left")
        self.wait_point = np.where(wait >= 0, before - (np.arange(len(self.rows)) - self.pos), -1)

    def node(self, pos: int) -> dict[str, Any]:
        row = self.tab.slice(pos, 1).to_pylist()[0]
        gid = row["group"]
        g = self.t.group_info().get(gid, {})
        # the stored values, the batch id and wait index included (what the user finds in the graph)
        keys = [f for f in FIELDS if f not in ("op", "group")] + ["coalesced", "wait_index"]
        return {
            "index": row["index"],
            "op": row["op"],
            "group": {"id": gid, "desc": g.get("desc", ""), "ranks": g.get("ranks", [])},
            **{k: row[k] for k in keys},
        }

    def value(self, pos: int, node: dict[str, Any], field: str) -> Any:
        if field in POSITION_FIELDS:
            return int(getattr(self, field)[pos])
        return node[field]


def _field_mismatch(ca: _Comm, cb: _Comm, pa_idx: np.ndarray, pb_idx: np.ndarray, field: str) -> np.ndarray:
    if field == "group" or field in POSITION_FIELDS:
        return getattr(ca, field)[pa_idx] != getattr(cb, field)[pb_idx]
    if field in ("in_bytes", "out_bytes", "peer", "seq", "tag", "async_op", "iteration"):
        return ca.tab.column(field).to_numpy()[pa_idx] != cb.tab.column(field).to_numpy()[pb_idx]
    if field in ("op", "dtype", "reduce_op", "label"):
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
    return f"group {g['id']} ('{g['desc']}', ranks {rs})" if "id" in g else f"group ('{g['desc']}', ranks {rs})"


def _shown(field: str, v: Any) -> str:
    if field == "group":
        return _group_text(v)
    if field == "coalesced":
        return "no batch" if v < 0 else f"the batch from comm #{v}"
    if field == "wait_point":
        return "no wait" if v < 0 else f"waits before comm #{v}"
    return repr(v)


def _comm_differences(ca: _Comm, cb: _Comm, ws: int) -> list[dict[str, Any]]:
    na = np.bincount(ca.rank, minlength=ws)
    nb = np.bincount(cb.rank, minlength=ws)
    pair_rank, k, ia, ib = _paired(na, nb)
    out = []
    for field in COMM_FIELDS:
        bad = np.flatnonzero(_field_mismatch(ca, cb, ia, ib, field)) if len(ia) else ia
        if not len(bad):
            continue
        p = int(bad[0])
        r, pos, pa_, pb_ = int(pair_rank[p]), int(k[p]), int(ia[p]), int(ib[p])
        node_a, node_b = ca.node(pa_), cb.node(pb_)
        va, vb = ca.value(pa_, node_a, field), cb.value(pb_, node_b, field)
        shown_a, shown_b = _shown(field, va), _shown(field, vb)
        message = (
            f"rank {r} comm #{pos} (A node {node_a['index']}, B node {node_b['index']}: "
            f"{node_a['op']} on {_group_text(node_a['group'])}): {field} differs: A {shown_a}, B {shown_b}"
        )
        first = {"rank": r, "comm_index": pos, "a": va, "b": vb, "node_a": node_a, "node_b": node_b, "message": message}
        line = (
            f"nodes.{field}: {len(bad)} communication event(s) differ; first: rank {r} comm #{pos} "
            f"({node_a['op']}): A {shown_a}, B {shown_b}"
        )
        out.append(_entry("nodes", field, len(bad), line, first))
    cnt = np.flatnonzero(na != nb)
    if len(cnt):
        r = int(cnt[0])
        pos = int(min(na[r], nb[r]))
        va, vb = int(na[r]), int(nb[r])
        side, c = ("A", ca) if va > pos else ("B", cb)
        extra = c.node(int(np.searchsorted(c.rank, r)) + pos)
        message = (
            f"rank {r}: A has {va} communication events, B has {vb}; the first extra one is "
            f"comm #{pos} in {side}: node {extra['index']} {extra['op']} on {_group_text(extra['group'])}"
        )
        first = {
            "rank": r,
            "comm_index": pos,
            "a": va,
            "b": vb,
            "node_a": extra if side == "A" else None,
            "node_b": extra if side == "B" else None,
            "message": message,
        }
        n = int(np.abs(na - nb).sum())
        line = f"nodes.count: {n} communication event(s) in one graph only, on {len(cnt)} rank(s); first: {message}"
        out.append(_entry("nodes", "count", n, line, first))
    return out


# ---------------------------------------------------------------------- compute spans
def _kind_differences(a: PrismTrace, b: PrismTrace) -> list[dict[str, Any]]:
    """Where the compute spans lie: the kind at every index of each rank."""
    ws = a.world_size
    oa, ob = a.program_order(), b.program_order()
    ka = pc.equal(a.nodes.column("kind"), KIND_COMM).to_numpy(zero_copy_only=False)[oa]
    kb = pc.equal(b.nodes.column("kind"), KIND_COMM).to_numpy(zero_copy_only=False)[ob]
    na = np.bincount(a.column("rank")[oa].astype(np.int64), minlength=ws)
    nb = np.bincount(b.column("rank")[ob].astype(np.int64), minlength=ws)
    pair_rank, k, ia, ib = _paired(na, nb)
    bad = np.flatnonzero(ka[ia] != kb[ib])
    extra = np.flatnonzero(na != nb)
    n = len(bad) + int(np.abs(na - nb).sum())
    if not n:
        return _compute_span_differences(a, b, oa[ia], ob[ib], ~ka[ia], pair_rank, k)
    # the lowest (rank, index) of a differing kind or of the first node one rank has more of
    cand = [(int(pair_rank[p]), int(k[p])) for p in bad[:1]] + [(int(r), int(min(na[r], nb[r]))) for r in extra[:1]]
    r, i = min(cand)

    def kind(k: np.ndarray, n: np.ndarray) -> str | None:
        return ("comm" if k[int(np.sum(n[:r])) + i] else "compute") if i < n[r] else None

    va, vb = kind(ka, na), kind(kb, nb)
    message = f"rank {r} node {i}: A {va or 'has no such node'}, B {vb or 'has no such node'}"
    line = f"nodes.kind: {n} node(s) differ in kind or exist in one graph only (compute spans); first: {message}"
    return [_entry("nodes", "kind", n, line, {"rank": r, "index": i, "a": va, "b": vb, "message": message})]


def _compute_span_differences(
    a: PrismTrace,
    b: PrismTrace,
    ra: np.ndarray,
    rb: np.ndarray,
    compute: np.ndarray,
    rank: np.ndarray,
    index: np.ndarray,
) -> list[dict[str, Any]]:
    """The same spans on both sides (rows ``ra``/``rb``, paired): each in the same iteration and
    with the same label (a communication event's are compared with its fields)."""
    out = []
    for field in ("iteration", "label"):
        ca, cb = a.nodes.column(field), b.nodes.column(field)
        va = ca.take(pa.array(ra)).to_numpy(zero_copy_only=False)
        vb = cb.take(pa.array(rb)).to_numpy(zero_copy_only=False)
        bad = np.flatnonzero(compute & (va != vb))
        if not len(bad):
            continue
        p0 = int(bad[0])
        x, y = ca[int(ra[p0])].as_py(), cb[int(rb[p0])].as_py()
        message = f"rank {int(rank[p0])} node {int(index[p0])} (compute): A {field} {x!r}, B {y!r}"
        line = f"nodes.{field}: {len(bad)} compute span(s) differ; first: {message}"
        out.append(_entry("nodes", field, len(bad), line, {"rank": int(rank[p0]), "index": int(index[p0]), "a": x, "b": y,
                                                             "message": message}))  # fmt: skip
    return out


# ---------------------------------------------------------------------- tables
def _multiset(keys_a: list[np.ndarray], keys_b: list[np.ndarray]) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """The distinct key tuples of A's and B's rows together, ascending, and how many rows of A
    and of B have each."""
    n_a = len(keys_a[0])
    keys = [np.r_[x.astype(np.int64), y.astype(np.int64)] for x, y in zip(keys_a, keys_b)]
    order = np.lexsort(keys[::-1])
    keys = [k[order] for k in keys]
    starts = run_starts(keys)
    run = np.cumsum(starts) - 1
    runs = int(starts.sum())
    from_a = order < n_a
    return (
        [k[starts] for k in keys],
        np.bincount(run[from_a], minlength=runs),
        np.bincount(run[~from_a], minlength=runs),
    )


def _iteration_differences(a: PrismTrace, b: PrismTrace) -> list[dict[str, Any]]:
    """Per rank, the iteration rows present and their labels (times are timing, not structure)."""
    ta, tb = a.iterations, b.iterations
    key_a = ta.column("rank").to_numpy().astype(np.int64) * _HIGH + ta.column("iteration").to_numpy() + _SHIFT
    key_b = tb.column("rank").to_numpy().astype(np.int64) * _HIGH + tb.column("iteration").to_numpy() + _SHIFT
    labels = pa.concat_arrays([ta.column("label").combine_chunks(), tb.column("label").combine_chunks()])
    codes = labels.dictionary_encode()
    lab = codes.indices.to_numpy(zero_copy_only=False).astype(np.int64)
    names = codes.dictionary.to_pylist()
    lab_a, lab_b = lab[: ta.num_rows], lab[ta.num_rows :]

    def where(key: int) -> tuple[int, int]:
        return int(key // _HIGH), int(key % _HIGH - _SHIFT)

    out = []
    (keys,), ca, cb = _multiset([key_a], [key_b])
    bad = np.flatnonzero(ca != cb)
    if len(bad):
        j = int(bad[0])
        r, i = where(keys[j])
        message = f"rank {r} iteration {i}: A has {ca[j]} row(s), B {cb[j]}"
        n = int(np.abs(ca - cb).sum())
        first = {"rank": r, "iteration": i, "a": int(ca[j]), "b": int(cb[j]), "message": message}
        line = f"iterations.iteration: {n} row(s) in one graph only; first: {message}"
        out.append(_entry("iterations", "iteration", n, line, first))
    # labels, of the iterations both graphs have as often
    (keys3, _), ca3, cb3 = _multiset([key_a, lab_a], [key_b, lab_b])
    relabelled = np.unique(keys3[(ca3 != cb3) & ~np.isin(keys3, keys[bad])])
    if len(relabelled):
        key = int(relabelled[0])
        r, i = where(key)
        la = sorted(names[x] for x in lab_a[key_a == key])
        lb = sorted(names[x] for x in lab_b[key_b == key])
        message = f"rank {r} iteration {i}: label A {_labels(la)}, B {_labels(lb)}"
        first = {"rank": r, "iteration": i, "a": la, "b": lb, "message": message}
        line = f"iterations.label: {len(relabelled)} iteration(s) labelled differently; first: {message}"
        out.append(_entry("iterations", "label", len(relabelled), line, first))
    return out


def _labels(labels: list[str]) -> str:
    return repr(labels[0]) if len(labels) == 1 else repr(labels)


def _group_differences(a: PrismTrace, b: PrismTrace) -> list[dict[str, Any]]:
    """The groups by (ranks, desc): ids and torch names are each graph's own."""
    ga = Counter((tuple(g["ranks"]), g["desc"]) for g in a.group_info().values())
    gb = Counter((tuple(g["ranks"]), g["desc"]) for g in b.group_info().values())
    differ = sorted(g for g in ga.keys() | gb.keys() if ga[g] != gb[g])
    if not differ:
        return []
    ranks, desc = differ[0]
    group = {"desc": desc, "ranks": list(ranks)}
    x, y = ga[differ[0]], gb[differ[0]]
    where = f"only in {'A' if x else 'B'}" if not (x and y) else f"{x} time(s) in A, {y} in B"
    message = f"{_group_text(group)} {where}"
    n = sum(abs(ga[g] - gb[g]) for g in differ)
    line = f"groups: {n} group(s) in one graph only; first: {message}"
    return [_entry("groups", "group", n, line, {"group": group, "a": x, "b": y, "message": message})]


def _implied_edges(t: PrismTrace) -> pa.Table:
    order = t.program_order()
    sorted_ = bool(np.array_equal(order, np.arange(len(order))))
    return build_edges(t.nodes if sorted_ else t.nodes.take(pa.array(order)), t.groups, t.world_size)


def _kind_codes(edges: pa.Table) -> np.ndarray:
    """Edge kinds as their EDGE_KINDS position; an unknown kind as len(EDGE_KINDS)."""
    codes = pc.index_in(edges.column("kind"), value_set=pa.array(EDGE_KINDS))
    return pc.fill_null(codes, len(EDGE_KINDS)).to_numpy(zero_copy_only=False).astype(np.int64)


def _implied_edge_differences(t: PrismTrace, side: str) -> list[dict[str, Any]]:
    """The graph's edges table against what its nodes imply: the replay ignores the table, so a
    stale or damaged one goes unnoticed everywhere else."""
    implied = _implied_edges(t)
    stored = t.edges
    if stored.num_rows == implied.num_rows and stored.equals(implied):  # as assemble writes it
        return []
    cols = ("src", "dst")
    (src, dst, kind), c_imp, c_sto = _multiset(
        [implied.column(c).to_numpy() for c in cols] + [_kind_codes(implied)],
        [stored.column(c).to_numpy() for c in cols] + [_kind_codes(stored)],
    )
    missing, extra = np.maximum(c_imp - c_sto, 0), np.maximum(c_sto - c_imp, 0)
    node_id = t.column("node_id")
    out = []
    for code in np.unique(kind[(missing > 0) | (extra > 0)]).tolist():
        name = EDGE_KINDS[code] if code < len(EDGE_KINDS) else "unknown-kind"
        this = kind == code
        m, x = int(missing[this].sum()), int(extra[this].sum())
        j = int(np.flatnonzero(this & (missing > 0))[0] if m else np.flatnonzero(this & (extra > 0))[0])
        ends = []
        for nid in (int(src[j]), int(dst[j])):
            row = np.flatnonzero(node_id == nid)
            ends.append(
                f"rank {t.column('rank')[row[0]]} node {t.column('index')[row[0]]}" if len(row) else f"node id {nid}"
            )
        edge = {"src": int(src[j]), "dst": int(dst[j]), "kind": name, "missing": bool(m)}
        what = f"{m} {name} edge(s) missing, {x} extra; first {'missing' if m else 'extra'}: {ends[0]} -> {ends[1]}"
        message = f"the edges table of {side} is not what its nodes imply: {what}"
        first = {"graph": side, "kind": name, "missing": m, "extra": x, "edge": edge, "message": message}
        line = f"edges.implied ({side}, against its own nodes): {what}"
        out.append(_entry("edges", "implied", m + x, line, first, graph=side))
    return out


def _edge_count_differences(a: PrismTrace, b: PrismTrace) -> list[dict[str, Any]]:
    na = np.bincount(_kind_codes(a.edges), minlength=len(EDGE_KINDS) + 1)
    nb = np.bincount(_kind_codes(b.edges), minlength=len(EDGE_KINDS) + 1)
    bad = np.flatnonzero(na != nb)
    if not len(bad):
        return []
    j = int(bad[0])
    name = EDGE_KINDS[j] if j < len(EDGE_KINDS) else "unknown-kind"
    message = f"{name} edges: A has {na[j]}, B {nb[j]}"
    line = f"edges.count: {len(bad)} edge kind(s) counted differently; first: {message}"
    return [
        _entry("edges", "count", len(bad), line, {"kind": name, "a": int(na[j]), "b": int(nb[j]), "message": message})
    ]


# ---------------------------------------------------------------------- manifest
def _manifest_value(m: dict[str, Any], key: str) -> Any:
    if key.startswith("program."):
        program = m.get("program")
        return program.get(key.split(".", 1)[1]) if isinstance(program, dict) else None
    return m.get(key)


def _brief(v: Any, width: int = 60) -> str:
    s = json.dumps(v, default=str)
    return s if len(s) <= width else s[: width - 3] + "..."


def _value_difference(va: Any, vb: Any) -> str:
    """Where two manifest values differ, in a few words: a long command line that differs in
    its last argument shows that argument."""
    if isinstance(va, list) and isinstance(vb, list):
        i = next((i for i, (x, y) in enumerate(zip(va, vb)) if x != y), min(len(va), len(vb)))
        at_a, at_b = (_brief(v[i], 40) if i < len(v) else "none" for v in (va, vb))
        return f"A {len(va)} items, B {len(vb)}; item {i}: A {at_a}, B {at_b}"
    if isinstance(va, dict) and isinstance(vb, dict):
        keys = sorted((k for k in va.keys() | vb.keys() if va.get(k) != vb.get(k)), key=str)
        return f"{len(keys)} key(s) differ; {keys[0]}: A {_brief(va.get(keys[0]), 40)}, B {_brief(vb.get(keys[0]), 40)}"
    return f"A {_brief(va)}, B {_brief(vb)}"


def manifest_differences(a: PrismTrace, b: PrismTrace) -> list[dict[str, Any]]:
    """The keys of MANIFEST_KEYS whose values differ: [{key, a, b, message}]."""
    out = []
    for key in MANIFEST_KEYS:
        va, vb = _manifest_value(a.manifest, key), _manifest_value(b.manifest, key)
        if va == vb:
            continue
        if key == "peak_memory_bytes" and isinstance(va, dict) and isinstance(vb, dict):
            ranks = sorted((r for r in va.keys() | vb.keys() if va.get(r) != vb.get(r)), key=lambda r: int(r))
            va, vb = {r: va.get(r) for r in ranks}, {r: vb.get(r) for r in ranks}
            r = ranks[0]
            message = f"peak_memory_bytes: {len(ranks)} rank(s) differ; rank {r}: A {va[r]}, B {vb[r]}"
        else:
            message = f"{key}: {_value_difference(va, vb)}"
        out.append({"key": key, "a": va, "b": vb, "message": message})
    return out


def _manifest_entry(m: dict[str, Any]) -> dict[str, Any]:
    count = len(m["a"]) if m["key"] == "peak_memory_bytes" and isinstance(m["a"], dict) else 1
    e = _entry(
        "manifest", m["key"], count, f"manifest.{m['message']}", {"a": m["a"], "b": m["b"], "message": m["message"]}
    )
    e["informational"] = True
    return e


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
    res.node_times = _node_times(a, b)


TIME_COLUMNS = ("issue_ns", "start_ns", "end_ns", "duration_ns")


def _node_times(a: PrismTrace, b: PrismTrace) -> dict[str, Any] | None:
    """Where the two graphs hold the same nodes (rank, index): how many differ in a time of their
    own (issue, start, end, duration), and the first of the largest difference; None otherwise.
    The summaries above can hide one node's change (a communication call's duration, an issue
    time), which this does not."""
    oa, ob = a.program_order(), b.program_order()
    ka = np.stack([a.column("rank")[oa], a.column("index")[oa]]) if len(oa) else np.zeros((2, 0))
    kb = np.stack([b.column("rank")[ob], b.column("index")[ob]]) if len(ob) else np.zeros((2, 0))
    if ka.shape != kb.shape or not np.array_equal(ka, kb):
        return None
    differ = np.zeros(len(oa), dtype=bool)
    worst: tuple[int, str, int] | None = None  # (|delta|, column, position)
    for col in TIME_COLUMNS:
        x, y = a.column(col)[oa].astype(np.int64), b.column(col)[ob].astype(np.int64)
        d = x != y
        differ |= d
        if d.any():
            delta = np.abs(x - y)
            pos = int(np.argmax(np.where(d, delta, -1)))
            if worst is None or int(delta[pos]) > worst[0]:
                worst = (int(delta[pos]), col, pos)
    out: dict[str, Any] = {"differ": int(differ.sum()), "of": len(oa)}
    if worst is not None:
        _, col, pos = worst
        out["largest"] = {
            "rank": int(ka[0, pos]),
            "index": int(ka[1, pos]),
            "column": col,
            "a": int(a.column(col)[oa[pos]]),
            "b": int(b.column(col)[ob[pos]]),
        }
    return out
