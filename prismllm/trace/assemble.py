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

from prismllm.trace.edges import build_edges, ordinal
from prismllm.trace.graph import PrismTrace, TraceError
from prismllm.trace.ranklog import GroupInfo, RankLog, read_ranklog
from prismllm.trace.schema import (
    COLLECTIVE_OPS,
    FORMAT_NAME,
    FORMAT_VERSION,
    GROUP_SCHEMA,
    ITERATION_SCHEMA,
    KIND_COMM,
    KIND_COMPUTE,
    NODE_DEFAULTS,
    NODE_SCHEMA,
)

LOG_FIELDS = [f for f in NODE_SCHEMA if f.name not in ("node_id", "group")] + [pa.field("group_name", pa.string())]
_LOG_STRUCT = pa.struct(LOG_FIELDS)
_ITER_STRUCT = pa.struct([f for f in ITERATION_SCHEMA])
_RANKLOG_RE = re.compile(r"^rank-(\d+)\.msgpack$")


# ---------------------------------------------------------------------- per-rank parts
@dataclasses.dataclass
class Part:
    """One rank's log with its rows converted to Arrow (the dicts can be dropped early)."""

    rank: int
    world_size: int
    device: str
    clock: str
    groups: list[GroupInfo]
    nodes: pa.StructArray
    iterations: pa.StructArray
    peak_memory_bytes: int


def part_of(log: RankLog) -> Part:
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
        raise TraceError(
            f"the log of rank {log.rank} holds an iteration record of the wrong shape ({str(e)[:120]})"
        ) from None
    return Part(
        int(log.rank),
        int(log.world_size),
        str(log.device),
        str(log.clock),
        list(log.groups),
        nodes,
        iterations,
        int(log.peak_memory_bytes),
    )


def read_parts(paths: list[tuple[int, str]]) -> list[Part]:
    """Read and convert rank logs one by one (each log's dicts are freed once converted)."""
    out = []
    with gc_paused():
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
            out.append(part_of(log))
    return out


@contextlib.contextmanager
def gc_paused():
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
        world_size = read_parts(items[:1])[0].world_size
    missing = sorted(set(range(int(world_size))) - set(found))
    if missing:
        raise TraceError(
            f"spool directory {spool} lacks the log of {rank_list(missing)} "
            f"(expected rank-{missing[0]:06d}.msgpack for world size {world_size}): "
            f"that rank did not finish; see its output and re-record"
        )
    return assemble_parts(read_parts(items), manifest)


def assemble(logs: list[RankLog], manifest: dict[str, Any]) -> PrismTrace:
    """Build a PrismTrace from one RankLog per rank (any order)."""
    if not logs:
        raise TraceError("no rank logs to assemble")
    with gc_paused():
        parts = [part_of(log) for log in logs]
    return assemble_parts(parts, manifest)


def assemble_parts(parts: list[Part], manifest: dict[str, Any]) -> PrismTrace:
    if not parts:
        raise TraceError("no rank logs to assemble")
    parts = sorted(parts, key=lambda p: p.rank)
    sizes = sorted({p.world_size for p in parts})
    if len(sizes) != 1:
        raise TraceError(
            f"rank logs disagree on the world size ({', '.join(map(str, sizes))}); they come from different runs"
        )
    world_size = sizes[0]
    ranks = [p.rank for p in parts]
    if len(set(ranks)) != len(ranks):
        dup = next(r for i, r in enumerate(ranks) if i and ranks[i - 1] == r)
        raise TraceError(f"two rank logs for rank {dup}; they come from different runs")
    missing = sorted(set(range(world_size)) - set(ranks))
    if missing:
        raise TraceError(
            f"no rank log for {rank_list(missing)} of world size {world_size}; that rank did not finish, re-record"
        )
    extra = [r for r in ranks if r < 0 or r >= world_size]
    if extra:
        raise TraceError(f"rank log for rank {extra[0]}, outside world size {world_size}")

    with gc_paused():
        groups, name_to_gid = assemble_groups(parts)
        nodes = assemble_nodes(parts, groups, name_to_gid, world_size)
        edges = build_edges(nodes, groups, world_size)
        iterations = assemble_iterations(parts)

    out = graph_manifest(manifest, parts, world_size, {str(p.rank): p.peak_memory_bytes for p in parts})
    return PrismTrace(manifest=out, nodes=nodes, edges=edges, groups=groups, iterations=iterations)


def graph_manifest(manifest: dict, parts: list, world_size: int, peak: dict[str, int]) -> dict:
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
def assemble_groups(logs: list[Part]) -> tuple[pa.Table, dict[str, int]]:
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
    table = groups_table(names, descs, granks)
    return table, name_to_gid


def groups_table(names: list[str], descs: list[str], granks: list) -> pa.Table:
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
def assemble_nodes(parts: list[Part], groups: pa.Table, name_to_gid: dict[str, int], world_size: int) -> pa.Table:
    counts = np.array([len(p.nodes) for p in parts], dtype=np.int64)
    log_ranks = np.array([p.rank for p in parts], dtype=np.int64)
    n = int(counts.sum())
    sa = pa.concat_arrays([p.nodes for p in parts]) if parts else pa.array([], type=_LOG_STRUCT)
    cols: dict[str, pa.Array] = {f.name: sa.field(f.name) for f in LOG_FIELDS}

    expected_rank = np.repeat(log_ranks, counts).astype(np.int32)
    starts = np.cumsum(counts) - counts
    position = np.arange(n, dtype=np.int64) - np.repeat(starts, counts)

    # rank: fill from the log, refuse a log whose rows name another rank
    rank_col = cols["rank"]
    if rank_col.null_count < n:
        given = pc.fill_null(rank_col, -1).to_numpy(zero_copy_only=False)
        bad = np.flatnonzero((given != -1) & (given != expected_rank))
        if len(bad):
            i = int(bad[0])
            raise TraceError(
                f"the log of rank {expected_rank[i]} holds a node of rank {given[i]}: logs were mixed up, re-record"
            )
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
        ordp = ordinal([rank, group, peer, op_code], pos, is_p2p)
        seq = np.where(is_p2p, ordp, seq)
    if np.any(is_coll & (seq < 0)):
        ordc = ordinal([rank, group], pos, is_coll)
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


# ---------------------------------------------------------------------- iterations
def assemble_iterations(parts: list[Part]) -> pa.Table:
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
def rank_list(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    shown = ", ".join(map(str, ranks[:8]))
    return f"ranks {shown}" + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")


def _short_list(xs: list[int]) -> str:
    return str(xs) if len(xs) <= 10 else "[" + ", ".join(map(str, xs[:8])) + f", ... ({len(xs)} ranks)]"
