"""Assemble the per-rank logs (RankLog) into one PrismTrace.

    trace = assemble_spool("out/spool", {"mode": "record", "command": [...]})
    trace = assemble(logs, manifest)

What assembly does, all of it columnar (numpy / pyarrow, no per-node Python work beyond
decoding the logs):

- groups: ids in order of first appearance, scanning ranks in order and each rank's groups in
  its order; a group name must have identical ranks on every rank that knows it.
- nodes: ranks in order, each rank's nodes in ``index`` order (indices must be 0..n-1);
  ``node_id`` is the position in that order. Missing columns take ``NODE_DEFAULTS``;
  ``group_name`` becomes the group id; a comm node without a stream gets ``comm:<group id>``;
  a collective without ``seq`` gets its ordinal per (rank, group); a send/recv always gets
  its ordinal per (rank, group, peer, op) (equal to a correct producer's, and right for a
  recv from any source, whose producer counter could not count it).
- edges: ``order`` (i -> i+1 on each rank); ``wait`` (async comm node -> node at its
  ``wait_index``, when that index is in range); ``sync``: a collective instance is the nodes
  with one (group, seq), chained in group-rank order; the k-th send a->b on group g is matched
  with the k-th recv on b from a on g (send -> recv). Unmatched or inconsistent communication
  is left for :func:`prismllm.trace.validate.validate` to report.
- manifest: the caller's, plus ``format``, ``format_version``, ``world_size``,
  ``peak_memory_bytes`` ({rank: bytes}, -1 where unknown) and ``device`` / ``clock`` when the
  caller gave none.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from prismllm.trace.graph import PrismTrace, TraceError
from prismllm.trace.ranklog import GroupInfo, RankLog, read_ranklog
from prismllm.trace.schema import (
    COLLECTIVE_OPS,
    EDGE_KINDS,
    EDGE_ORDER,
    EDGE_SCHEMA,
    EDGE_SYNC,
    EDGE_WAIT,
    FORMAT_NAME,
    FORMAT_VERSION,
    GROUP_SCHEMA,
    ITERATION_SCHEMA,
    KIND_COMM,
    KIND_COMPUTE,
    NODE_DEFAULTS,
    NODE_SCHEMA,
)

_LOG_FIELDS = [f for f in NODE_SCHEMA if f.name not in ("node_id", "group")] + [pa.field("group_name", pa.string())]
_LOG_STRUCT = pa.struct(_LOG_FIELDS)
_ITER_STRUCT = pa.struct([f for f in ITERATION_SCHEMA])
_RANKLOG_RE = re.compile(r"^rank-(\d+)\.msgpack$")


# ---------------------------------------------------------------------- per-rank parts
@dataclasses.dataclass
class _Part:
    """One rank's log with its rows converted to Arrow (the dicts can be dropped early)."""

    rank: int
    world_size: int
    device: str
    clock: str
    groups: list[GroupInfo]
    nodes: pa.StructArray
    iterations: pa.StructArray
    peak_memory_bytes: int


def _part_of(log: RankLog) -> _Part:
    try:
        nodes = pa.array(log.nodes, type=_LOG_STRUCT)
    except (pa.ArrowException, TypeError, ValueError):
        nodes = None
    if nodes is None or nodes.null_count:
        for i, row in enumerate(log.nodes):
            if not isinstance(row, dict):
                raise TraceError(f"rank {log.rank} node {i} is not a row of columns: {str(row)[:100]}")
            try:
                pa.array([row], type=_LOG_STRUCT)
            except (pa.ArrowException, TypeError, ValueError) as e:
                bad = {k: v for k, v in row.items() if k in _LOG_STRUCT.names}
                raise TraceError(
                    f"rank {log.rank} node {row.get('index', i)} has a value of the wrong type "
                    f"({str(e)[:120]}): {str(bad)[:200]}"
                ) from None
        raise TraceError(f"the log of rank {log.rank} holds a node row of the wrong shape")
    try:
        iterations = pa.array(log.iterations, type=_ITER_STRUCT)
        if iterations.null_count:
            raise ValueError("a null iteration record")
    except (pa.ArrowException, TypeError, ValueError) as e:
        raise TraceError(f"the log of rank {log.rank} holds an iteration record of the wrong shape ({str(e)[:120]})") from None
    return _Part(int(log.rank), int(log.world_size), str(log.device), str(log.clock), list(log.groups),
                 nodes, iterations, int(log.peak_memory_bytes))


def _read_parts(paths: list[tuple[int, str]]) -> list[_Part]:
    """Read and convert rank logs one by one (each log's dicts are freed once converted)."""
    out = []
    with _gc_paused():
        for rank, path in paths:
            try:
                log = read_ranklog(path)
            except Exception as e:  # msgpack / version / shape errors: one message naming the file
                raise TraceError(
                    f"rank log {path} is unreadable ({type(e).__name__}: {str(e)[:120]}); "
                    f"rank {rank} may have crashed while writing it: re-record"
                ) from None
            if int(log.rank) != rank:
                raise TraceError(f"rank log {path} holds rank {log.rank}; the spool was mixed up, re-record")
            out.append(_part_of(log))
    return out


@contextlib.contextmanager
def _gc_paused():
    """Millions of small dicts and arrays: the cyclic GC would rescan them again and again."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


# ---------------------------------------------------------------------- entry points
def assemble_spool(spool_dir: str | os.PathLike, manifest: dict[str, Any]) -> PrismTrace:
    """Read every ``rank-*.msgpack`` of a spool directory and assemble them.

    Decoding the msgpack rows into Python dicts and converting them to Arrow is the expensive
    part (a few µs per node); everything after is columnar."""
    spool = Path(spool_dir)
    if not spool.is_dir():
        raise TraceError(f"spool directory {spool} does not exist")
    found: dict[int, str] = {}
    for entry in os.scandir(spool):
        m = _RANKLOG_RE.match(entry.name)
        if m:
            found[int(m.group(1))] = entry.path
    if not found:
        raise TraceError(f"spool directory {spool} holds no rank logs (rank-*.msgpack): no rank finished recording")
    items = sorted(found.items())
    world_size = manifest.get("world_size")
    if world_size is None:
        world_size = _read_parts(items[:1])[0].world_size
    missing = sorted(set(range(int(world_size))) - set(found))
    if missing:
        raise TraceError(
            f"spool directory {spool} lacks the log of {_rank_list(missing)} "
            f"(expected rank-{missing[0]:06d}.msgpack for world size {world_size}): "
            f"that rank did not finish; see its output and re-record"
        )
    return _assemble_parts(_read_parts(items), manifest)


def assemble(logs: list[RankLog], manifest: dict[str, Any]) -> PrismTrace:
    """Build a PrismTrace from one RankLog per rank (any order)."""
    if not logs:
        raise TraceError("no rank logs to assemble")
    with _gc_paused():
        parts = [_part_of(log) for log in logs]
    return _assemble_parts(parts, manifest)


def _assemble_parts(parts: list[_Part], manifest: dict[str, Any]) -> PrismTrace:
    if not parts:
        raise TraceError("no rank logs to assemble")
    parts = sorted(parts, key=lambda p: p.rank)
    sizes = sorted({p.world_size for p in parts})
    if len(sizes) != 1:
        raise TraceError(f"rank logs disagree on the world size ({', '.join(map(str, sizes))}); they come from different runs")
    world_size = sizes[0]
    ranks = [p.rank for p in parts]
    if len(set(ranks)) != len(ranks):
        dup = next(r for i, r in enumerate(ranks) if i and ranks[i - 1] == r)
        raise TraceError(f"two rank logs for rank {dup}; they come from different runs")
    missing = sorted(set(range(world_size)) - set(ranks))
    if missing:
        raise TraceError(f"no rank log for {_rank_list(missing)} of world size {world_size}; that rank did not finish, re-record")
    extra = [r for r in ranks if r < 0 or r >= world_size]
    if extra:
        raise TraceError(f"rank log for rank {extra[0]}, outside world size {world_size}")

    with _gc_paused():
        groups, name_to_gid = _assemble_groups(parts)
        nodes = _assemble_nodes(parts, groups, name_to_gid, world_size)
        edges = build_edges(nodes, groups, world_size)
        iterations = _assemble_iterations(parts)

    out = _graph_manifest(manifest, parts, world_size,
                          {str(p.rank): p.peak_memory_bytes for p in parts})
    return PrismTrace(manifest=out, nodes=nodes, edges=edges, groups=groups, iterations=iterations)


def _graph_manifest(manifest: dict, parts: list, world_size: int, peak: dict[str, int]) -> dict:
    """The user's manifest completed with what the graph itself knows."""
    out = dict(manifest)
    out["format"] = FORMAT_NAME
    out["format_version"] = FORMAT_VERSION
    out["world_size"] = world_size
    out["peak_memory_bytes"] = peak
    if "device" not in out:
        devices = sorted({p.device for p in parts})
        out["device"] = devices[0] if len(devices) == 1 else devices
    if "clock" not in out:
        clocks = sorted({p.clock for p in parts})
        out["clock"] = clocks[0] if len(clocks) == 1 else clocks
    return out


# ---------------------------------------------------------------------- groups
def _assemble_groups(logs: list[_Part]) -> tuple[pa.Table, dict[str, int]]:
    name_to_gid: dict[str, int] = {}
    names: list[str] = []
    descs: list[str] = []
    granks: list[list[int]] = []
    first_seen: list[int] = []
    for log in logs:
        for g in log.groups:
            gid = name_to_gid.get(g.name)
            if gid is None:
                ranks = [int(r) for r in g.ranks]
                name_to_gid[g.name] = len(names)
                names.append(g.name)
                descs.append(g.desc)
                granks.append(ranks)
                first_seen.append(log.rank)
            elif granks[gid] != g.ranks and granks[gid] != [int(r) for r in g.ranks]:
                ranks = [int(r) for r in g.ranks]
                raise TraceError(
                    f"group {g.name!r} ({g.desc}) has ranks {_short_list(granks[gid])} on rank "
                    f"{first_seen[gid]} but {_short_list(ranks)} on rank {log.rank}: every member "
                    f"must create its groups with the same ranks in the same order"
                )
    table = _groups_table(names, descs, granks)
    return table, name_to_gid


def _groups_table(names: list[str], descs: list[str], granks: list) -> pa.Table:
    """The groups table, group ids numbering the lists' positions."""
    return pa.Table.from_arrays(
        [
            pa.array(np.arange(len(names), dtype=np.int32)),
            pa.array(names, type=pa.string()),
            pa.array(descs, type=pa.string()),
            pa.array(granks, type=pa.list_(pa.int32())),
        ],
        schema=GROUP_SCHEMA,
    )


# ---------------------------------------------------------------------- nodes
def _assemble_nodes(parts: list[_Part], groups: pa.Table, name_to_gid: dict[str, int], world_size: int) -> pa.Table:
    counts = np.array([len(p.nodes) for p in parts], dtype=np.int64)
    log_ranks = np.array([p.rank for p in parts], dtype=np.int64)
    n = int(counts.sum())
    sa = pa.concat_arrays([p.nodes for p in parts]) if parts else pa.array([], type=_LOG_STRUCT)
    cols: dict[str, pa.Array] = {f.name: sa.field(f.name) for f in _LOG_FIELDS}

    expected_rank = np.repeat(log_ranks, counts).astype(np.int32)
    starts = (np.cumsum(counts) - counts)
    position = np.arange(n, dtype=np.int64) - np.repeat(starts, counts)

    # rank: fill from the log, refuse a log whose rows name another rank
    rank_col = cols["rank"]
    if rank_col.null_count < n:
        given = pc.fill_null(rank_col, -1).to_numpy(zero_copy_only=False)
        bad = np.flatnonzero((given != -1) & (given != expected_rank))
        if len(bad):
            i = int(bad[0])
            raise TraceError(f"the log of rank {expected_rank[i]} holds a node of rank {given[i]}: logs were mixed up, re-record")
    rank = expected_rank

    # index: fill by position; must be 0..n-1 on each rank
    index = pc.fill_null(cols["index"], -1).to_numpy(zero_copy_only=False).astype(np.int64)
    index = np.where(index < 0, position, index)
    order = None
    if not np.array_equal(index, position):
        order = np.lexsort((index, rank))
        if not np.array_equal(index[order], position):
            bad = int(np.flatnonzero(index[order] != position)[0])
            r = int(rank[order][bad])
            raise TraceError(
                f"rank {r}: node indices are not 0..{counts[np.searchsorted(log_ranks, r)] - 1} "
                f"(index {int(index[order][bad])} where {int(position[bad])} was expected: "
                f"duplicate or missing node); re-record"
            )

    # op / kind
    op = cols["op"]
    if op.null_count:
        i = int(np.flatnonzero(op.is_null().to_numpy(zero_copy_only=False))[0])
        raise TraceError(f"rank {rank[i]} node {index[i]} has no op")
    is_compute_op = pc.equal(op, KIND_COMPUTE)
    kind = pc.if_else(cols["kind"].is_null(), pc.if_else(is_compute_op, KIND_COMPUTE, KIND_COMM), cols["kind"])
    is_comm = pc.equal(kind, KIND_COMM).to_numpy(zero_copy_only=False)

    # group_name -> group id
    gname = pc.fill_null(cols["group_name"], "")
    names = pa.array(list(name_to_gid), type=pa.string())
    gidx = pc.index_in(gname, value_set=names)
    unknown = pc.and_(gidx.is_null(), pc.not_equal(gname, "")).to_numpy(zero_copy_only=False)
    if unknown.any():
        i = int(np.flatnonzero(unknown)[0])
        raise TraceError(
            f"rank {rank[i]} node {index[i]} ({op[i].as_py()}) names group {gname[i].as_py()!r}, "
            f"which no rank log lists among its groups; the recorder missed a new_group, re-record"
        )
    group = pc.fill_null(gidx, -1).to_numpy(zero_copy_only=False).astype(np.int32)

    filled: dict[str, Any] = {}
    for f in NODE_SCHEMA:
        name = f.name
        if name in ("node_id", "rank", "index", "group", "kind", "op"):
            continue
        col = cols[name]
        if col.null_count:
            if pa.types.is_list(f.type) and NODE_DEFAULTS[name] == []:
                col = _fill_empty_lists(col, f.type)
            else:
                col = pc.fill_null(col, pa.scalar(NODE_DEFAULTS[name], type=f.type))
        filled[name] = col

    # comm stream: "comm:<group id>" unless the producer named another stream
    stream = filled["stream"]
    stream_raw = cols["stream"]
    gid_str = pc.cast(pa.array(group), pa.string())
    comm_by_name = pc.binary_join_element_wise("comm:", gname, "")
    use_default = pc.and_(
        pa.array(is_comm),
        pc.or_(
            pc.or_(stream_raw.is_null(), pc.equal(pc.fill_null(stream_raw, ""), "")),
            pc.equal(pc.fill_null(stream_raw, ""), comm_by_name),
        ),
    )
    filled["stream"] = pc.if_else(use_default, pc.binary_join_element_wise("comm:", gid_str, ""), stream)

    # seq: fill the ordinal where the producer gave none
    seq = filled["seq"].to_numpy(zero_copy_only=False).astype(np.int64)
    peer = filled["peer"].to_numpy(zero_copy_only=False).astype(np.int64)
    is_coll = pc.is_in(op, value_set=pa.array(COLLECTIVE_OPS)).to_numpy(zero_copy_only=False) & is_comm
    is_p2p = is_comm & ~is_coll
    pos = position if order is None else index  # program order within the rank
    if is_p2p.any():
        # send/recv: always the ordinal, which is what matching uses (the producer's counter
        # cannot count a recv from any source, whose peer is known only once it completed)
        op_code = pc.dictionary_encode(op).indices.to_numpy(zero_copy_only=False).astype(np.int64)
        ordp = _ordinal([rank, group, peer, op_code], pos, is_p2p)
        seq = np.where(is_p2p, ordp, seq)
    if np.any(is_coll & (seq < 0)):
        ordc = _ordinal([rank, group], pos, is_coll)
        seq = np.where(is_coll & (seq < 0), ordc, seq)
    filled["seq"] = pa.array(seq, type=pa.int64())

    arrays = []
    for f in NODE_SCHEMA:
        name = f.name
        if name == "node_id":
            arr = pa.array(np.arange(n, dtype=np.int64))  # set after sorting below
        elif name == "rank":
            arr = pa.array(rank.astype(np.int32))
        elif name == "index":
            arr = pa.array(index.astype(np.int32))
        elif name == "group":
            arr = pa.array(group)
        elif name == "kind":
            arr = kind
        elif name == "op":
            arr = op
        else:
            arr = filled[name]
        if not arr.type.equals(f.type):
            arr = arr.cast(f.type)
        arrays.append(arr)
    table = pa.Table.from_arrays(arrays, schema=NODE_SCHEMA)
    if order is not None:
        table = table.take(pa.array(order))
        table = table.set_column(0, NODE_SCHEMA.field("node_id"), pa.array(np.arange(n, dtype=np.int64)))
    return table.combine_chunks()


def _fill_empty_lists(col: pa.ListArray, type: pa.DataType) -> pa.Array:
    """fill_null(col, []) without pyarrow's slow generic path: null slots of a converted list
    array already have zero length, so dropping the validity bitmap is enough."""
    offsets = col.offsets.to_numpy(zero_copy_only=False)
    nulls = col.is_null().to_numpy(zero_copy_only=False)
    if np.any(np.diff(offsets)[nulls] != 0):
        return pc.fill_null(col, pa.scalar([], type=type))
    return pa.ListArray.from_arrays(col.offsets, col.values, type=type)


def _ordinal(keys: list[np.ndarray], pos: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """For rows in ``mask``: their rank (0, 1, ...) among rows with equal keys, by ``pos``."""
    out = np.full(len(pos), -1, dtype=np.int64)
    idx = np.flatnonzero(mask)
    if not len(idx):
        return out
    sub = [k[idx] for k in keys]
    order = np.lexsort([pos[idx]] + sub[::-1])
    starts = _run_starts([k[order] for k in sub])
    run_id = np.cumsum(starts) - 1
    first = np.flatnonzero(starts)
    ordinal = np.arange(len(idx)) - first[run_id]
    out[idx[order]] = ordinal
    return out


def _run_starts(sorted_keys: list[np.ndarray]) -> np.ndarray:
    """Boolean: True where a run of equal key tuples starts (keys already sorted)."""
    n = len(sorted_keys[0])
    starts = np.zeros(n, dtype=bool)
    if n:
        starts[0] = True
        for k in sorted_keys:
            starts[1:] |= k[1:] != k[:-1]
    return starts


# ---------------------------------------------------------------------- edges
def group_rank_lookup(groups: pa.Table, world_size: int):
    """Return ``f(gid, rank) -> group rank`` (vectorised; -1 where rank is no member)."""
    ranks_col = groups.column("ranks").combine_chunks()
    gids = groups.column("group_id").to_numpy().astype(np.int64)
    lengths = pc.list_value_length(ranks_col).to_numpy(zero_copy_only=False).astype(np.int64)
    flat = pc.list_flatten(ranks_col).to_numpy(zero_copy_only=False).astype(np.int64)
    pair_gid = np.repeat(gids, lengths)
    pair_grank = np.arange(len(flat)) - np.repeat((np.cumsum(lengths) - lengths), lengths)
    ws = max(int(world_size), int(flat.max()) + 1 if len(flat) else 1)
    keys = pair_gid * ws + flat
    order = np.argsort(keys, kind="stable")
    keys = keys[order]
    pair_grank = pair_grank[order]

    def lookup(gid: np.ndarray, rank: np.ndarray) -> np.ndarray:
        q = gid.astype(np.int64) * ws + rank.astype(np.int64)
        i = np.searchsorted(keys, q)
        i = np.minimum(i, max(len(keys) - 1, 0))
        if not len(keys):
            return np.full(len(q), -1, dtype=np.int64)
        hit = (keys[i] == q) & (gid >= 0) & (rank >= 0) & (rank < ws)
        return np.where(hit, pair_grank[i], -1)

    return lookup


def build_edges(nodes: pa.Table, groups: pa.Table, world_size: int) -> pa.Table:
    """Derive the order, wait and sync edges of a node table sorted by (rank, index)."""
    node_id = nodes.column("node_id").to_numpy()
    rank = nodes.column("rank").to_numpy().astype(np.int64)
    index = nodes.column("index").to_numpy().astype(np.int64)
    n = len(node_id)
    srcs, dsts, kinds = [], [], []

    # order
    same = rank[1:] == rank[:-1]
    srcs.append(node_id[:-1][same])
    dsts.append(node_id[1:][same])
    kinds.append(EDGE_KINDS.index(EDGE_ORDER))

    # wait
    wait_index = nodes.column("wait_index").to_numpy().astype(np.int64)
    starts = np.flatnonzero(np.r_[True, rank[1:] != rank[:-1]]) if n else np.zeros(0, np.int64)
    run_len = np.diff(np.r_[starts, n])
    run_id = np.cumsum(np.r_[True, rank[1:] != rank[:-1]]) - 1 if n else np.zeros(0, np.int64)
    rank_start = starts[run_id] if n else starts
    rank_n = run_len[run_id] if n else run_len
    ok = (wait_index > index) & (wait_index < rank_n)
    srcs.append(node_id[ok])
    dsts.append(node_id[rank_start[ok] + wait_index[ok]])
    kinds.append(EDGE_KINDS.index(EDGE_WAIT))

    # sync: collectives by (group, seq), chained in group-rank order
    op = nodes.column("op")
    group = nodes.column("group").to_numpy().astype(np.int64)
    seq = nodes.column("seq").to_numpy().astype(np.int64)
    is_comm = pc.equal(nodes.column("kind"), KIND_COMM).to_numpy(zero_copy_only=False)
    is_coll = pc.is_in(op, value_set=pa.array(COLLECTIVE_OPS)).to_numpy(zero_copy_only=False) & is_comm & (group >= 0)
    lookup = group_rank_lookup(groups, world_size)
    ci = np.flatnonzero(is_coll)
    if len(ci):
        g, s, r = group[ci], seq[ci], rank[ci]
        gr = lookup(g, r)
        o = np.lexsort((r, gr, s, g))
        g, s, ids = g[o], s[o], node_id[ci][o]
        link = (g[1:] == g[:-1]) & (s[1:] == s[:-1])
        srcs.append(ids[:-1][link])
        dsts.append(ids[1:][link])
        kinds.append(EDGE_KINDS.index(EDGE_SYNC))

    # sync: the k-th send a->b on g with the k-th recv on b from a on g
    src_pair, dst_pair = match_p2p(nodes)
    srcs.append(src_pair)
    dsts.append(dst_pair)
    kinds.append(EDGE_KINDS.index(EDGE_SYNC))

    lens = np.array([len(s) for s in srcs], dtype=np.int64)
    kind_codes = np.repeat(np.array(kinds, dtype=np.int8), lens)
    kind_arr = pa.DictionaryArray.from_arrays(pa.array(kind_codes), pa.array(list(EDGE_KINDS))).cast(pa.string())
    return pa.Table.from_arrays(
        [pa.array(np.concatenate(srcs).astype(np.int64)), pa.array(np.concatenate(dsts).astype(np.int64)), kind_arr],
        schema=EDGE_SCHEMA,
    )


def match_p2p(nodes: pa.Table, *, unmatched: bool = False):
    """Pair sends with recvs by order. Returns (send node ids, recv node ids) of the pairs, and
    with ``unmatched=True`` also (unmatched send rows, unmatched recv rows) as row positions."""
    op = nodes.column("op")
    is_comm = pc.equal(nodes.column("kind"), KIND_COMM).to_numpy(zero_copy_only=False)
    is_send = pc.equal(op, "send").to_numpy(zero_copy_only=False) & is_comm
    is_recv = pc.equal(op, "recv").to_numpy(zero_copy_only=False) & is_comm
    node_id = nodes.column("node_id").to_numpy()
    rank = nodes.column("rank").to_numpy().astype(np.int64)
    index = nodes.column("index").to_numpy().astype(np.int64)
    group = nodes.column("group").to_numpy().astype(np.int64)
    peer = nodes.column("peer").to_numpy().astype(np.int64)
    si, ri = np.flatnonzero(is_send), np.flatnonzero(is_recv)
    empty = np.zeros(0, dtype=np.int64)
    if not len(si) and not len(ri):
        return (empty, empty, empty, empty) if unmatched else (empty, empty)
    p2p = is_send | is_recv
    # ordinal per (rank, group, peer, direction), in program order
    ordinal = _ordinal([rank, group, peer, is_recv.astype(np.int64)], index, p2p)
    rows = np.r_[si, ri]
    flag = np.r_[np.zeros(len(si), np.int64), np.ones(len(ri), np.int64)]
    a = np.r_[rank[si], peer[ri]]  # sender
    b = np.r_[peer[si], rank[ri]]  # receiver
    g = group[rows]
    k = ordinal[rows]
    o = np.lexsort((flag, k, b, a, g))
    a, b, g, k, flag, rows = a[o], b[o], g[o], k[o], flag[o], rows[o]
    pair = (a[1:] == a[:-1]) & (b[1:] == b[:-1]) & (g[1:] == g[:-1]) & (k[1:] == k[:-1]) & (flag[:-1] == 0) & (flag[1:] == 1)
    send_rows, recv_rows = rows[:-1][pair], rows[1:][pair]
    if not unmatched:
        return node_id[send_rows], node_id[recv_rows]
    matched = np.zeros(len(node_id), dtype=bool)
    matched[send_rows] = True
    matched[recv_rows] = True
    return send_rows, recv_rows, si[~matched[si]], ri[~matched[ri]]


# ---------------------------------------------------------------------- iterations
def _assemble_iterations(parts: list[_Part]) -> pa.Table:
    counts = np.array([len(p.iterations) for p in parts], dtype=np.int64)
    if not counts.sum():
        return ITERATION_SCHEMA.empty_table()
    sa = pa.concat_arrays([p.iterations for p in parts])
    defaults = {"iteration": -1, "start_ns": -1, "end_ns": -1, "label": ""}
    arrays = []
    for f in ITERATION_SCHEMA:
        if f.name == "rank":
            col = pa.array(np.repeat(np.array([p.rank for p in parts], dtype=np.int32), counts))
        else:
            col = sa.field(f.name)
            if col.null_count:
                col = pc.fill_null(col, pa.scalar(defaults[f.name], type=f.type))
        arrays.append(col)
    table = pa.Table.from_arrays(arrays, schema=ITERATION_SCHEMA)
    o = np.lexsort((table.column("iteration").to_numpy(), table.column("rank").to_numpy()))
    return table.take(pa.array(o))


# ---------------------------------------------------------------------- text
def _rank_list(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    shown = ", ".join(map(str, ranks[:8]))
    return f"ranks {shown}" + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")


def _short_list(xs: list[int]) -> str:
    return str(xs) if len(xs) <= 10 else "[" + ", ".join(map(str, xs[:8])) + f", ... ({len(xs)} ranks)]"


# ---------------------------------------------------------------------- replicated ranks
_ROOTED_OPS = ("broadcast", "reduce", "gather", "scatter")


def assemble_replicated(
    spool_dir: str | os.PathLike,
    manifest: dict[str, Any],
    *,
    replica_of: np.ndarray,
    map_of: np.ndarray,
    rename,
) -> PrismTrace:
    """Assemble a graph of all ranks from the logs of a few *representatives* (solo capture).

    ``replica_of[r]`` is the representative whose graph rank r takes (r itself for a
    representative, whose log must be in the spool; no other log is read). ``map_of[r]`` is
    the renaming that turns that representative into r (-1 for a representative) and
    ``rename(map_ids, ranks)`` applies renamings elementwise: a permutation of the world per
    map, with ``rename(map_of[r], replica_of[r]) == r`` (e.g. a shift of the DP coordinate).

    Groups are identified by their members, not their torch names (a representative knows only
    the groups it is a member of, and names need not agree across runs): key = (desc, sorted
    member set, ordinal among the rank's groups with that same desc and set, in creation
    order). Groups with one key are one group, whatever their names. A replica's group for a
    representative's group G under map m is the group whose key is (desc, rename(m, G), same
    ordinal): an existing one (e.g. the DP group, mapped onto itself) or a new one named
    ``<G's name>@<m>`` with members ``rename(m, G)`` in G's order.

    A replica's nodes are its representative's, with: ``group`` -> the replica's group;
    ``peer`` of send/recv -> ``rename(m, peer)``; the root of a rooted collective -> the member
    at the root's group-rank position in the replica's group (a root given as a group rank,
    the usual case, stays put in a group mapped onto itself); ``stream`` "comm:<gid>" follows
    the group; everything else (sizes, splits, times, iterations) unchanged. Edges are then
    derived over all ranks as :func:`assemble` does. Each rank's peak memory is its
    representative's. Fully columnar: an 8192-rank graph expands in seconds.
    """
    replica_of = np.asarray(replica_of, dtype=np.int64)
    map_of = np.asarray(map_of, dtype=np.int64)
    world_size = len(replica_of)
    if world_size < 1 or len(map_of) != world_size:
        raise TraceError("replica_of and map_of must give one entry per rank")
    reps = np.unique(replica_of)
    if np.any(replica_of[reps] != reps) or np.any(map_of[reps] != -1):
        raise TraceError("every representative must stand for itself (replica_of[r] == r, map_of[r] == -1)")
    spool = Path(spool_dir)
    if not spool.is_dir():
        raise TraceError(f"spool directory {spool} does not exist")
    paths = [(int(r), str(spool / f"rank-{int(r):06d}.msgpack")) for r in reps]
    missing = [r for r, p in paths if not os.path.exists(p)]
    if missing:
        raise TraceError(
            f"spool directory {spool} lacks the log of {_rank_list(missing)} "
            f"(expected rank-{missing[0]:06d}.msgpack): that rank did not finish; see its output and re-run"
        )
    parts = _read_parts(paths)
    sizes = sorted({p.world_size for p in parts})
    if sizes != [world_size]:
        raise TraceError(
            f"rank logs give world size {', '.join(map(str, sizes))}, expected {world_size}; "
            f"they come from another run"
        )
    with _gc_paused():
        parts = _canonical_group_names(parts)
        groups, name_to_gid = _assemble_groups(parts)
        rep_nodes = _assemble_nodes(parts, groups, name_to_gid, world_size)
        keys = _group_keys(parts, name_to_gid)
        all_groups, gmap = _replica_groups(groups, keys, np.unique(map_of[map_of >= 0]), rename)
        nodes = _expand_nodes(rep_nodes, groups, all_groups, gmap, replica_of, map_of, rename, world_size)
        edges = build_edges(nodes, all_groups, world_size)
        iterations = _expand_iterations(_assemble_iterations(parts), replica_of)

    peak = {p.rank: p.peak_memory_bytes for p in parts}
    out = _graph_manifest(manifest, parts, world_size,
                          {str(r): peak[int(rep)] for r, rep in enumerate(replica_of.tolist())})
    return PrismTrace(manifest=out, nodes=nodes, edges=edges, groups=all_groups, iterations=iterations)


def _set_key(desc: str, ranks) -> tuple[str, bytes]:
    return (str(desc), np.sort(np.asarray(ranks, dtype=np.int64)).tobytes())


def _rank_group_keys(groups: list[GroupInfo]) -> list[tuple[str, bytes, int]]:
    """Each group's key on one rank: (desc, member set, ordinal among equal (desc, set))."""
    seen: dict[tuple[str, bytes], int] = {}
    keys = []
    for g in groups:
        k = _set_key(g.desc, g.ranks)
        n = seen.get(k, 0)
        seen[k] = n + 1
        keys.append((k[0], k[1], n))
    return keys


def _canonical_group_names(parts: list[_Part]) -> list[_Part]:
    """Give every group one name on every rank: the name under which its key was first seen
    (ranks in order). A no-op when the producers' names already agree (torch's names do)."""
    key_name: dict[tuple, str] = {}
    name_key: dict[str, tuple] = {}
    out = []
    for p in parts:
        renames: dict[str, str] = {}
        new_groups = []
        for g, key in zip(p.groups, _rank_group_keys(p.groups)):
            name = key_name.get(key)
            if name is None:
                name = g.name
                n = 1
                while name in name_key:  # the name is already another group's: make it unique
                    name = f"{g.name}#{n}"
                    n += 1
                key_name[key] = name
                name_key[name] = key
            if name != g.name:
                renames[g.name] = name
            new_groups.append(GroupInfo(name=name, desc=g.desc, ranks=list(g.ranks)))
        if renames:
            gname = p.nodes.field("group_name")
            old = pa.array(list(renames), type=pa.string())
            new = pa.array(list(renames.values()), type=pa.string())
            idx = pc.index_in(gname, value_set=old)
            gname = pc.if_else(idx.is_null(), gname, pc.take(new, idx))
            fields = [p.nodes.field(f.name) if f.name != "group_name" else gname for f in _LOG_FIELDS]
            nodes = pa.StructArray.from_arrays(fields, fields=_LOG_FIELDS)
            p = dataclasses.replace(p, groups=new_groups, nodes=nodes)
        else:
            p = dataclasses.replace(p, groups=new_groups)
        out.append(p)
    return out


def _group_keys(parts: list[_Part], name_to_gid: dict[str, int]) -> dict[int, tuple]:
    keys: dict[int, tuple] = {}
    for p in parts:
        for g, key in zip(p.groups, _rank_group_keys(p.groups)):
            keys.setdefault(name_to_gid[g.name], key)
    return keys


def _replica_groups(groups: pa.Table, keys: dict[int, tuple], maps: np.ndarray, rename):
    """The representatives' groups plus the images of each under each map. Returns the group
    table and ``gmap`` [max map + 1, representatives' groups] -> group id."""
    names = groups.column("name").to_pylist()
    descs = groups.column("desc").to_pylist()
    granks = [list(r) for r in groups.column("ranks").to_pylist()]
    n_rep = len(names)
    key_gid = {keys[g]: g for g in range(n_rep)}
    maps = np.asarray(maps, dtype=np.int64)
    gmap = np.tile(np.arange(n_rep, dtype=np.int64), (int(maps.max()) + 1 if len(maps) else 1, 1))
    for g in range(n_rep):
        if not len(maps):
            break
        members = np.asarray(granks[g], dtype=np.int64)
        desc, _, ordinal = keys[g]
        images = rename(np.repeat(maps, len(members)), np.tile(members, len(maps))).reshape(len(maps), len(members))
        sorted_images = np.sort(images, axis=1)
        for i, m in enumerate(maps.tolist()):
            key = (desc, sorted_images[i].tobytes(), ordinal)
            gid = key_gid.get(key)
            if gid is None:
                gid = len(names)
                key_gid[key] = gid
                names.append(f"{names[g]}@{m}")
                descs.append(descs[g])
                granks.append(images[i].tolist())
            gmap[m, g] = gid
    table = _groups_table(names, descs, granks)
    return table, gmap


def _expand_nodes(rep_nodes: pa.Table, rep_groups: pa.Table, groups: pa.Table, gmap: np.ndarray,
                  replica_of: np.ndarray, map_of: np.ndarray, rename, world_size: int) -> pa.Table:
    world = len(replica_of)
    rrank = rep_nodes.column("rank").to_numpy().astype(np.int64)
    n_rep_rows = len(rrank)
    if n_rep_rows:
        starts = np.flatnonzero(np.r_[True, rrank[1:] != rrank[:-1]])
        ranks_present = rrank[starts]
        counts_present = np.diff(np.r_[starts, n_rep_rows])
    else:
        starts = ranks_present = counts_present = np.zeros(0, dtype=np.int64)
    start_of = np.zeros(world, dtype=np.int64)
    count_of = np.zeros(world, dtype=np.int64)
    start_of[ranks_present] = starts
    count_of[ranks_present] = counts_present
    counts = count_of[replica_of]
    n = int(counts.sum())
    out_start = np.cumsum(counts) - counts
    src = np.arange(n, dtype=np.int64) + np.repeat(start_of[replica_of] - out_start, counts)
    if np.array_equal(replica_of, np.arange(world)) and n == n_rep_rows:
        return rep_nodes  # nothing to expand
    table = rep_nodes.take(pa.array(src))
    m_row = np.repeat(map_of, counts)
    is_rep_row = m_row < 0

    old_g = rep_nodes.column("group").to_numpy().astype(np.int64)[src]
    new_g = old_g.copy()
    sel = ~is_rep_row & (old_g >= 0)
    new_g[sel] = gmap[m_row[sel], old_g[sel]]

    op = table.column("op")
    is_comm = pc.equal(table.column("kind"), KIND_COMM).to_numpy(zero_copy_only=False)
    peer = table.column("peer").to_numpy().astype(np.int64)
    new_peer = peer.copy()
    is_p2p = pc.is_in(op, value_set=pa.array(["send", "recv"])).to_numpy(zero_copy_only=False) & is_comm
    sel_p = ~is_rep_row & is_p2p & (peer >= 0)
    if sel_p.any():
        new_peer[sel_p] = rename(m_row[sel_p], peer[sel_p])
    is_rooted = pc.is_in(op, value_set=pa.array(list(_ROOTED_OPS))).to_numpy(zero_copy_only=False) & is_comm
    sel_r = ~is_rep_row & is_rooted & (peer >= 0) & (old_g >= 0)
    if sel_r.any():
        pos = group_rank_lookup(rep_groups, world_size)(old_g[sel_r], peer[sel_r])
        ranks_col = groups.column("ranks").combine_chunks()
        flat = pc.list_flatten(ranks_col).to_numpy(zero_copy_only=False).astype(np.int64)
        lens = pc.list_value_length(ranks_col).to_numpy(zero_copy_only=False).astype(np.int64)
        offs = np.cumsum(lens) - lens
        g2 = new_g[sel_r]
        ok = (pos >= 0) & (pos < lens[g2])
        mapped = np.where(ok, flat[offs[g2] + np.where(ok, pos, 0)], rename(m_row[sel_r], peer[sel_r]))
        new_peer[sel_r] = mapped
        # the root's bytes differ from the others': where the role changes, so do they
        out_rank = np.repeat(np.arange(world, dtype=np.int64), counts)[sel_r]
        was_root = peer[sel_r] == rrank[src[sel_r]]
        is_root = mapped == out_rank
        change = was_root != is_root
        if change.any():
            in_b = table.column("in_bytes").to_numpy().astype(np.int64).copy()
            out_b = table.column("out_bytes").to_numpy().astype(np.int64).copy()
            rows = np.flatnonzero(sel_r)[change]
            ops = np.asarray(op.take(pa.array(rows)).to_pylist(), dtype=object)
            root = is_root[change]
            size = lens[g2[change]]
            i0, o0 = in_b[rows], out_b[rows]
            x = np.maximum(i0, o0)
            ni, no = i0.copy(), o0.copy()
            b = ops == "broadcast"  # root sends the tensor, the others receive it
            ni[b], no[b] = np.where(root[b], x[b], 0), np.where(root[b], 0, x[b])
            r = ops == "reduce"  # only the root receives the result
            no[r] = np.where(root[r], i0[r], 0)
            g_ = ops == "gather"  # only the root receives size x input
            no[g_] = np.where(root[g_], i0[g_] * size[g_], 0)
            s_ = ops == "scatter"  # only the root sends size x output
            ni[s_] = np.where(root[s_], o0[s_] * size[s_], 0)
            in_b[rows], out_b[rows] = ni, no
            extra_cols = {"in_bytes": pa.array(in_b), "out_bytes": pa.array(out_b)}
        else:
            extra_cols = {}
    else:
        extra_cols = {}

    stream = table.column("stream")
    old_stream = pc.binary_join_element_wise("comm:", pc.cast(pa.array(old_g), pa.string()), "")
    follow = pc.and_(pa.array(new_g != old_g), pc.equal(stream, old_stream))
    new_stream = pc.if_else(follow, pc.binary_join_element_wise("comm:", pc.cast(pa.array(new_g), pa.string()), ""), stream)

    replace = {
        "node_id": pa.array(np.arange(n, dtype=np.int64)),
        "rank": pa.array(np.repeat(np.arange(world, dtype=np.int32), counts)),
        "group": pa.array(new_g.astype(np.int32)),
        "peer": pa.array(new_peer.astype(np.int32)),
        "stream": new_stream,
        **extra_cols,
    }
    for name, arr in replace.items():
        i = table.schema.get_field_index(name)
        table = table.set_column(i, NODE_SCHEMA.field(name), arr)
    return table.combine_chunks()


def _expand_iterations(rep_iters: pa.Table, replica_of: np.ndarray) -> pa.Table:
    world = len(replica_of)
    if not rep_iters.num_rows:
        return rep_iters
    rrank = rep_iters.column("rank").to_numpy().astype(np.int64)
    start_of = np.zeros(world, dtype=np.int64)
    count_of = np.zeros(world, dtype=np.int64)
    starts = np.flatnonzero(np.r_[True, rrank[1:] != rrank[:-1]])
    start_of[rrank[starts]] = starts
    count_of[rrank[starts]] = np.diff(np.r_[starts, len(rrank)])
    counts = count_of[replica_of]
    n = int(counts.sum())
    src = np.arange(n, dtype=np.int64) + np.repeat(start_of[replica_of] - (np.cumsum(counts) - counts), counts)
    t = rep_iters.take(pa.array(src))
    return t.set_column(0, ITERATION_SCHEMA.field("rank"), pa.array(np.repeat(np.arange(world, dtype=np.int32), counts)))
