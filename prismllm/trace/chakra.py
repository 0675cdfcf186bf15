"""Export a PrismTrace as Chakra execution traces, the workload input of ASTRA-sim.

    export_chakra(trace, "out/chakra") -> dict of counts
    # then: AstraSim_... --workload-configuration=out/chakra/prism
    #                    --comm-group-configuration=out/chakra/comm_group.json ...

Format (MLCommons Chakra, ``schema/protobuf/et_def.proto``, package ``ChakraProtoMsg``): per
rank one file ``<prefix>.<rank>.et``, a stream of protobuf messages each preceded by its length
as a varint: one ``GlobalMetadata``, then one ``Node`` per node of the rank. Chakra is not on
PyPI, so the few fields used here are encoded by hand below (field numbers from et_def.proto):

    GlobalMetadata: version = 1 (string), attr = 2 (AttributeProto)
    Node: id = 1, name = 2, type = 3 (NodeType), ctrl_deps = 4, data_deps = 5 (packed uint64),
          start_time_micros = 6, duration_micros = 7, attr = 10 (AttributeProto)
    AttributeProto: name = 1, one value of: int32_val = 7, int64_val = 9, bool_val = 27,
          string_val = 29
    NodeType: COMP_NODE 4, COMM_SEND_NODE 5, COMM_RECV_NODE 6, COMM_COLL_NODE 7
    CollectiveCommType: ALL_REDUCE 0, REDUCE 1, ALL_GATHER 2, GATHER 3, SCATTER 4,
          BROADCAST 5, ALL_TO_ALL 6, REDUCE_SCATTER 7, BARRIER 9

Mapping, per rank in program order (node id = the node's ``index``, so ids run 0..n-1):

- compute span -> COMP_NODE, ``duration_micros`` its duration (rounded to whole µs; ASTRA-sim
  replays a 0 as 1 ns), attr ``is_cpu_op`` false (a device kernel).
- collective -> COMM_COLL_NODE with attrs ``comm_type`` (int64), ``comm_size`` (int64: the
  buffer of the collective, the larger of the node's in/out bytes, so an all_gather or
  reduce_scatter carries the full gathered size) and ``pg_name`` (string).
- send / recv -> COMM_SEND_NODE / COMM_RECV_NODE with ``comm_src`` / ``comm_dst`` (int32,
  global ranks), ``comm_tag`` (int32) and ``comm_size``. The graph matches the k-th send a->b on a
  group with the k-th recv on b from a; the tag carries that pairing ((seq * groups + group) mod
  2^31, taken from the send for both ends), so a simulator matching on (src, dst, tag) pairs the
  same transfers.
- process groups: ``pg_name`` is ``str(group_id + 1)``, because ASTRA-sim takes "" and "0" for
  "all ranks" and numeric names only; the groups are written to ``comm_group.json``
  ({"<pg_name>": [global ranks]}), ASTRA-sim's ``--comm-group-configuration`` file.
- dependencies (``data_deps``): a node depends on the nearest earlier node of its rank that the
  program waited for (every node but an asynchronous communication call); the node at an async
  call's wait point also depends on that call (the graph's ``wait`` edges); and a communication
  node depends on the previous async call on its stream (one NCCL stream per group runs its
  calls in order). So compute overlaps an outstanding async collective exactly as recorded.
  ``ctrl_deps`` is left empty: Chakra uses it for the host-op hierarchy, and ASTRA-sim's current
  feeder (FeederV3) honours it as hard dependencies as well while the older ETFeeder reads
  data_deps only; every execution dependency is therefore in data_deps, which both honour.

Nodes without a time in a timed graph keep their place (the collectives must match across
ranks) with a duration of 0, and are counted. A graph with no times at all: TraceError.
ASTRA-sim itself simulates all_reduce, all_gather, reduce_scatter, all_to_all (and replays
broadcast); the other collective types are written as Chakra defines them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import pyarrow as pa

from prismllm.trace.graph import PrismTrace, TraceError
from prismllm.trace.protowire import len_field, packed, varint, varint_field
from prismllm.trace.schema import EDGE_WAIT, KIND_COMM
from prismllm.trace.spans import measured_spans, prev_waited, rank_rows, write_atomically

CHAKRA_VERSION = "1.0.0"  # the schema version Chakra's own generator writes
COMM_GROUP_FILE = "comm_group.json"
BATCH = 65536

# NodeType
COMP_NODE = 4
COMM_SEND_NODE = 5
COMM_RECV_NODE = 6
COMM_COLL_NODE = 7
NODE_TYPE_NAMES = {
    COMP_NODE: "COMP_NODE",
    COMM_SEND_NODE: "COMM_SEND_NODE",
    COMM_RECV_NODE: "COMM_RECV_NODE",
    COMM_COLL_NODE: "COMM_COLL_NODE",
}

# CollectiveCommType
COMM_TYPE = {
    "all_reduce": 0,
    "reduce": 1,
    "all_gather": 2,
    "gather": 3,
    "scatter": 4,
    "broadcast": 5,
    "all_to_all": 6,
    "reduce_scatter": 7,
    "barrier": 9,
}

# field numbers of et_def.proto
_META_VERSION, _META_ATTR = 1, 2
_NODE_ID, _NODE_NAME, _NODE_TYPE, _NODE_CTRL_DEPS, _NODE_DATA_DEPS = 1, 2, 3, 4, 5
_NODE_START, _NODE_DURATION, _NODE_ATTR = 6, 7, 10
_ATTR_NAME, _ATTR_INT32, _ATTR_INT64, _ATTR_BOOL, _ATTR_STRING = 1, 7, 9, 27, 29


def _attr(
    name: str,
    *,
    int32: int | None = None,
    int64: int | None = None,
    boolean: bool | None = None,
    string: str | None = None,
) -> bytes:
    """An AttributeProto as a Node/GlobalMetadata field body. The value is in a oneof, so it is
    written even when zero (its presence is what a reader checks)."""
    body = len_field(_ATTR_NAME, name.encode())
    if int32 is not None:
        body += varint_field(_ATTR_INT32, int32)
    elif int64 is not None:
        body += varint_field(_ATTR_INT64, int64)
    elif boolean is not None:
        body += varint_field(_ATTR_BOOL, int(boolean))
    elif string is not None:
        body += len_field(_ATTR_STRING, string.encode())
    return body


def _delimited(message: bytes) -> bytes:
    return varint(len(message)) + message


# ---------------------------------------------------------------------- export
def export_chakra(
    trace: PrismTrace, out_dir: str | os.PathLike, ranks: list[int] | None = None, prefix: str = "prism"
) -> dict[str, Any]:
    """Write ``out_dir/<prefix>.<rank>.et`` for every rank of the graph (or of ``ranks``) and
    ``out_dir/comm_group.json``.

    Returns {"files", "workload" (the prefix path ASTRA-sim's --workload-configuration takes),
    "comm_groups", "ranks", "nodes", "nodes_by_type", "nodes_without_times"}.
    """
    trace, present, rows_of = rank_rows(trace, ranks)
    start, end, known = measured_spans(trace, "Chakra execution traces")
    n = trace.num_nodes
    t0 = int(start[known].min())

    is_comm = trace.column("kind") == KIND_COMM
    is_async = is_comm & trace.column("async_op").astype(bool)
    group = trace.column("group").astype(np.int64)
    seq = trace.column("seq").astype(np.int64)
    rank = trace.column("rank").astype(np.int64)
    peer = trace.column("peer").astype(np.int64)
    index = trace.column("index").astype(np.int64)
    op = trace.column("op")
    stream_code = np.unique(trace.column("stream"), return_inverse=True)[1].astype(np.int64).reshape(-1)
    info = trace.group_info()

    # p2p: tag and source from the send a recv is matched with (its sync edge)
    n_groups = max(len(info), 1)
    tag = (np.maximum(seq, 0) * n_groups + np.maximum(group, 0)) % (1 << 31)
    src = np.where(op == "send", rank, peer)
    row_of = _row_lookup(trace)
    e = trace.edges
    if e.num_rows and n:
        s_row, d_row = row_of(e.column("src").to_numpy()), row_of(e.column("dst").to_numpy())
        ok = (s_row >= 0) & (d_row >= 0)
        s_row, d_row = s_row[ok], d_row[ok]
        p2p = (op[s_row] == "send") & (op[d_row] == "recv")
        tag[d_row[p2p]] = tag[s_row[p2p]]
        src[d_row[p2p]] = rank[s_row[p2p]]
        kind = e.column("kind").to_numpy(zero_copy_only=False)[ok]
        wait = kind == EDGE_WAIT
        wait_src, wait_dst = s_row[wait], d_row[wait]
    else:
        wait_src = wait_dst = np.zeros(0, np.int64)
    waits_at: dict[int, list[int]] = {}  # row of a wait point -> rows of the async calls it waits for
    for s_, d_ in zip(wait_src.tolist(), wait_dst.tolist()):
        waits_at.setdefault(d_, []).append(s_)

    out_dir = Path(out_dir)
    files, by_type = [], {name: 0 for name in NODE_TYPE_NAMES.values()}
    dur_us = np.where(known, (end - start + 500) // 1000, 0)
    start_us = np.where(known, (start - t0 + 500) // 1000, 0)
    comm_size = np.maximum(trace.column("in_bytes"), trace.column("out_bytes")).astype(np.int64)
    cols = dict(
        is_comm=is_comm,
        is_async=is_async,
        group=group,
        rank=rank,
        peer=peer,
        src=src,
        tag=tag,
        index=index,
        op=op,
        stream=stream_code,
        dur_us=dur_us,
        start_us=start_us,
        comm_size=comm_size,
    )
    for r, rows in zip(present, rows_of):
        path = out_dir / f"{prefix}.{r}.et"
        counts = write_atomically(
            path, lambda f, r=r, rows=rows: _write_rank(f, trace, r, rows, cols, waits_at, info), binary=True
        )
        for k, v in counts.items():
            by_type[k] += v
        files.append(str(path))

    groups = {str(gid + 1): g["ranks"] for gid, g in sorted(info.items())}
    comm_path = out_dir / COMM_GROUP_FILE
    write_atomically(comm_path, lambda f: f.write(json.dumps(groups) + "\n"))
    without = int(sum(int((~known[rows]).sum()) for rows in rows_of))
    return {
        "files": files,
        "workload": str(out_dir / prefix),
        "comm_groups": str(comm_path),
        "ranks": len(present),
        "nodes": int(sum(len(rows) for rows in rows_of)),
        "nodes_by_type": {k: v for k, v in by_type.items() if v},
        "nodes_without_times": without,
    }


def _row_lookup(trace: PrismTrace) -> Any:
    """node ids -> row numbers (-1 for an id the graph does not hold)."""
    ids = trace.column("node_id").astype(np.int64)
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]

    def rows(x: np.ndarray) -> np.ndarray:
        if not len(sorted_ids):
            return np.full(len(x), -1, np.int64)
        p = np.minimum(np.searchsorted(sorted_ids, x), len(sorted_ids) - 1)
        return np.where(sorted_ids[p] == x, order[p], -1)

    return rows


def _execution_deps(rows: np.ndarray, cols: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Per node of one rank (program order): the position of the nearest earlier node the
    program waited for, and of the previous async call on the same stream if the node is a
    communication call (-1 where none)."""
    n = len(rows)
    prev_blocking = prev_waited(cols["is_async"][rows])
    prev_async_same_stream = np.full(n, -1, np.int64)
    comm = np.flatnonzero(cols["is_comm"][rows])
    if len(comm):
        stream = cols["stream"][rows][comm]
        o = np.lexsort((comm, stream))  # by stream, then program order
        c, s = comm[o], stream[o]
        same = np.r_[False, s[1:] == s[:-1]]
        prev = np.r_[-1, c[:-1]]
        hit = same & cols["is_async"][rows][np.maximum(prev, 0)]
        prev_async_same_stream[c[hit]] = prev[hit]
    return prev_blocking, prev_async_same_stream


def _write_rank(
    f: BinaryIO,
    trace: PrismTrace,
    rank: int,
    rows: np.ndarray,
    cols: dict[str, np.ndarray],
    waits_at: dict[int, list[int]],
    info: dict[int, dict[str, Any]],
) -> dict[str, int]:
    meta = (
        len_field(_META_VERSION, CHAKRA_VERSION.encode())
        + len_field(_META_ATTR, _attr("source", string="prismllm"))
        + len_field(_META_ATTR, _attr("rank", int64=rank))
        + len_field(_META_ATTR, _attr("world_size", int64=trace.world_size))
    )
    f.write(_delimited(meta))

    prev_blocking, prev_async = _execution_deps(rows, cols)
    is_gpu_op = len_field(_NODE_ATTR, _attr("is_cpu_op", boolean=False))
    pg_attr = {gid: len_field(_NODE_ATTR, _attr("pg_name", string=str(gid + 1))) for gid in info}
    labels = trace.nodes.column("label")
    counts = dict.fromkeys(NODE_TYPE_NAMES.values(), 0)
    index_of_row = cols["index"]
    for b0 in range(0, len(rows), BATCH):
        sel = rows[b0 : b0 + BATCH]
        # plain lists per batch: per-element numpy indexing is several times slower
        b = {k: v[sel].tolist() for k, v in cols.items()}
        label = labels.take(pa.array(sel)).to_pylist()
        after_blocking = index_of_row[rows[np.maximum(prev_blocking[b0 : b0 + BATCH], 0)]].tolist()
        after_async = index_of_row[rows[np.maximum(prev_async[b0 : b0 + BATCH], 0)]].tolist()
        has_blocking = (prev_blocking[b0 : b0 + BATCH] >= 0).tolist()
        has_async = (prev_async[b0 : b0 + BATCH] >= 0).tolist()
        for j, row in enumerate(sel.tolist()):
            deps = {int(index_of_row[w]) for w in waits_at.get(row, ())}
            if has_blocking[j]:
                deps.add(after_blocking[j])
            if has_async[j]:
                deps.add(after_async[j])
            op = b["op"][j]
            if b["is_comm"][j]:
                if op == "send" or op == "recv":
                    ntype = COMM_SEND_NODE if op == "send" else COMM_RECV_NODE
                    src = b["src"][j] if op == "recv" else rank
                    dst = b["peer"][j] if op == "send" else rank
                    attrs = (
                        len_field(_NODE_ATTR, _attr("comm_src", int32=src))
                        + len_field(_NODE_ATTR, _attr("comm_dst", int32=dst))
                        + len_field(_NODE_ATTR, _attr("comm_tag", int32=b["tag"][j]))
                    )
                else:
                    ntype = COMM_COLL_NODE
                    if op not in COMM_TYPE:
                        raise TraceError(f"rank {rank} node {b['index'][j]}: Chakra has no collective type for {op!r}")
                    attrs = len_field(_NODE_ATTR, _attr("comm_type", int64=COMM_TYPE[op]))
                attrs += len_field(_NODE_ATTR, _attr("comm_size", int64=b["comm_size"][j]))
                attrs += pg_attr.get(b["group"][j], b"")
                name = op
            else:
                ntype = COMP_NODE
                attrs = b""
                name = label[j] or "compute"
            body = (
                varint_field(_NODE_ID, b["index"][j])
                + len_field(_NODE_NAME, name.encode())
                + varint_field(_NODE_TYPE, ntype)
                + packed(_NODE_DATA_DEPS, sorted(deps))
            )
            # proto3 leaves zero scalars out
            if b["start_us"][j]:
                body += varint_field(_NODE_START, b["start_us"][j])
            if b["dur_us"][j]:
                body += varint_field(_NODE_DURATION, b["dur_us"][j])
            f.write(_delimited(body + is_gpu_op + attrs))
            counts[NODE_TYPE_NAMES[ntype]] += 1
    return counts
