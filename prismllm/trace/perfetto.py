"""Export a PrismTrace as Chrome trace-event JSON (opens in Perfetto / chrome://tracing).

    export_perfetto(trace, "trace.json") -> dict of counts

Layout: one process per rank ("rank N", sorted by rank); per rank one track per stream —
"iterations" (the iteration boundaries, as spans), "compute", and "comm:<group desc>" per
communication stream; every node is a complete event (``X``, ts/dur in µs) with args (op,
group, bytes, dtype, shape, splits, label, iteration, ...); every sync edge is a flow arrow
(``s`` at the source node, ``f`` with ``bp: "e"`` at the destination, one id per edge).

Times: a node's span is start_ns..end_ns (falling back to issue_ns / duration_ns); nodes with
no time at all are left out and counted. A graph with no times at all (a bare graph) is laid
out by program order instead: node ``index`` at ``index`` µs, 1 µs long (an async node spans
to its wait point); the metadata says so (``metadata.prismtrace.timeline``).

Written as a stream (batch by batch), so large graphs never hold the whole JSON in memory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from prismllm import specs
from prismllm.errors import PrismError, RequirementError
from prismllm.trace.graph import PrismTrace, group_desc, ranks_text
from prismllm.trace.schema import CALL_COLUMNS, EDGE_SYNC
from prismllm.trace.spans import node_spans, select_ranks

TID_ITERATIONS = 0
TID_COMPUTE = 1
BATCH = 65536


def _span(trace: PrismTrace) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
    """(start_ns, end_ns, known mask, synthetic). Synthetic spans are in ns of the layout."""
    start, end, known = node_spans(trace)
    if known.any():
        return start, end, known, False
    index = trace.column("index").astype(np.int64)
    wait = trace.column("wait_index").astype(np.int64)
    start = index * 1000
    end = np.where(wait > index, wait, index + 1) * 1000
    return start, end, np.ones(len(start), dtype=bool), True


class _Esc(dict):
    """Cache of JSON-escaped strings."""

    def __missing__(self, key: str) -> str:
        v = json.dumps(key)
        self[key] = v
        return v


def _us(ns: int) -> str:
    return f"{ns / 1000:.3f}"


def parse_ranks(spec: str, world_size: int) -> list[int]:
    """ "0-7,12,16-31" -> ranks; PrismError (a usage error) on a bad spec or a rank outside the world."""
    try:
        return list(specs.parse_ranks(spec, world_size))
    except ValueError as e:
        raise PrismError(str(e)) from None


def export_perfetto(trace: PrismTrace, out: str | os.PathLike, ranks: list[int] | None = None) -> dict[str, Any]:
    """Write the Chrome trace JSON of the graph (or of some ``ranks`` only)."""
    if ranks is not None:
        trace = select_ranks(trace, ranks)
    out = Path(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
        with open(tmp, "w") as f:
            stats = _write(trace, f)
        os.replace(tmp, out)
    except OSError as e:
        raise RequirementError(f"cannot write {out}: {e.strerror or e}") from None
    return stats


def _write(trace: PrismTrace, f: TextIO) -> dict[str, Any]:
    esc = _Esc()
    nodes = trace.nodes
    n = nodes.num_rows
    start, end, known, synthetic = _span(trace)
    rank = trace.column("rank").astype(np.int64)
    it_tab = trace.iterations
    it_start = it_tab.column("start_ns").to_numpy().astype(np.int64) if it_tab.num_rows else np.zeros(0, np.int64)
    t0_cand = [start[known].min()] if known.any() else []
    if not synthetic and len(it_start) and (it_start >= 0).any():
        t0_cand.append(it_start[it_start >= 0].min())
    t0 = int(min(t0_cand)) if t0_cand else 0

    # tracks: one tid per distinct stream, shared by all ranks
    info = trace.group_info()
    stream_codes_enc = pc.dictionary_encode(nodes.column("stream")).combine_chunks()
    if isinstance(stream_codes_enc, pa.ChunkedArray):
        stream_codes_enc = stream_codes_enc.combine_chunks()
    streams = [str(s) for s in stream_codes_enc.dictionary.to_pylist()]
    scode = stream_codes_enc.indices.to_numpy(zero_copy_only=False).astype(np.int64) if n else np.zeros(0, np.int64)
    order = sorted(range(len(streams)), key=lambda k: (streams[k] != "compute", _stream_key(streams[k])))
    tid_of_code = np.zeros(max(len(streams), 1), dtype=np.int64)
    names = {}
    next_tid = TID_COMPUTE + 1
    for k in order:
        if streams[k] == "compute":
            tid_of_code[k] = TID_COMPUTE
        else:
            tid_of_code[k] = next_tid
            next_tid += 1
        names[int(tid_of_code[k])] = _stream_name(streams[k], info)
    tid = tid_of_code[scode] if n else np.zeros(0, np.int64)

    events = 0
    first = True

    def emit(s: str) -> None:
        nonlocal first, events
        f.write(s if first else ",\n" + s)
        first = False
        events += 1

    f.write('{"traceEvents":[\n')
    ranks = np.unique(rank) if n else np.zeros(0, np.int64)
    if it_tab.num_rows:
        ranks = np.union1d(ranks, it_tab.column("rank").to_numpy().astype(np.int64))
    pairs = np.unique(rank * (next_tid + 1) + tid) if n else np.zeros(0, np.int64)
    for r in ranks.tolist():
        emit(f'{{"ph":"M","name":"process_name","pid":{r},"tid":0,"args":{{"name":"rank {r}"}}}}')
        emit(f'{{"ph":"M","name":"process_sort_index","pid":{r},"tid":0,"args":{{"sort_index":{r}}}}}')
        emit(f'{{"ph":"M","name":"thread_name","pid":{r},"tid":{TID_ITERATIONS},"args":{{"name":"iterations"}}}}')
        emit(f'{{"ph":"M","name":"thread_sort_index","pid":{r},"tid":{TID_ITERATIONS},"args":{{"sort_index":0}}}}')
    for p in pairs.tolist():
        r, t = divmod(p, next_tid + 1)
        emit(f'{{"ph":"M","name":"thread_name","pid":{r},"tid":{t},"args":{{"name":{esc[names[t]]}}}}}')
        emit(f'{{"ph":"M","name":"thread_sort_index","pid":{r},"tid":{t},"args":{{"sort_index":{t}}}}}')

    # iterations
    n_iter_events = 0
    if synthetic or not len(it_start) or not (it_start >= 0).any():
        # spans of the nodes of each (rank, iteration)
        iteration = trace.column("iteration").astype(np.int64)
        sel = iteration >= 0
        if sel.any():
            key_r, key_i = rank[sel], iteration[sel]
            o = np.lexsort((key_i, key_r))
            kr, ki, s_, e_ = key_r[o], key_i[o], start[sel][o], end[sel][o]
            brk = np.flatnonzero(np.r_[True, (kr[1:] != kr[:-1]) | (ki[1:] != ki[:-1])])
            smin = np.minimum.reduceat(s_, brk)
            emax = np.maximum.reduceat(e_, brk)
            for r, i, s, e in zip(kr[brk].tolist(), ki[brk].tolist(), smin.tolist(), emax.tolist()):
                emit(
                    f'{{"ph":"X","name":"iteration {i}","cat":"iteration","pid":{r},"tid":{TID_ITERATIONS},'
                    f'"ts":{_us(s - t0)},"dur":{_us(e - s)},"args":{{"iteration":{i}}}}}'
                )
                n_iter_events += 1
    else:
        it = it_tab.to_pydict()
        for r, i, s, e, lab in zip(it["rank"], it["iteration"], it["start_ns"], it["end_ns"], it["label"]):
            if s < 0 or e < s:
                continue
            name = f"iteration {i}" + (f" ({lab})" if lab else "")
            emit(
                f'{{"ph":"X","name":{esc[name]},"cat":"iteration","pid":{r},"tid":{TID_ITERATIONS},'
                f'"ts":{_us(s - t0)},"dur":{_us(e - s)},"args":{{"iteration":{i}}}}}'
            )
            n_iter_events += 1

    # nodes
    glabel = {gid: f"{gid} ({group_desc(g) or ranks_text(g['ranks'])})" for gid, g in info.items()}
    cols = [
        "node_id",
        *CALL_COLUMNS,
        "dtype",
        "shape",
        "in_bytes",
        "out_bytes",
        "in_splits",
        "out_splits",
        "async_op",
        "wait_index",
        "label",
        "reduce_op",
    ]
    n_nodes = 0
    for b0 in range(0, n, BATCH):
        b1 = min(n, b0 + BATCH)
        d = nodes.slice(b0, b1 - b0).select(cols).to_pydict()
        ts_b = (start[b0:b1] - t0).tolist()
        du_b = (end[b0:b1] - start[b0:b1]).tolist()
        kn = known[b0:b1].tolist()
        rk = rank[b0:b1].tolist()
        td = tid[b0:b1].tolist()
        for j in range(b1 - b0):
            if not kn[j]:
                continue
            op = d["op"][j]
            label = d["label"][j]
            is_comm = d["kind"][j] == "comm"
            name = op if is_comm else (label or "compute")
            args = [
                f'"op":{esc[op]}',
                f'"node_id":{d["node_id"][j]}',
                f'"index":{d["index"][j]}',
                f'"iteration":{d["iteration"][j]}',
            ]
            if is_comm:
                g = d["group"][j]
                args.append(f'"group":{esc[glabel.get(g, str(g))]}')
                args.append(f'"seq":{d["seq"][j]}')
                if d["peer"][j] >= 0:
                    args.append(f'"peer":{d["peer"][j]}')
                args.append(f'"in_bytes":{d["in_bytes"][j]},"out_bytes":{d["out_bytes"][j]}')
                if d["reduce_op"][j]:
                    args.append(f'"reduce_op":{esc[d["reduce_op"][j]]}')
                if d["in_splits"][j]:
                    args.append(f'"in_splits":{json.dumps(d["in_splits"][j])}')
                if d["out_splits"][j]:
                    args.append(f'"out_splits":{json.dumps(d["out_splits"][j])}')
                if d["async_op"][j]:
                    args.append(f'"async":true,"wait_index":{d["wait_index"][j]}')
            if d["dtype"][j]:
                args.append(f'"dtype":{esc[d["dtype"][j]]}')
            if d["shape"][j]:
                args.append(f'"shape":{json.dumps(d["shape"][j])}')
            if label:
                args.append(f'"label":{esc[label]}')
            emit(
                f'{{"ph":"X","name":{esc[name]},"cat":{esc[d["kind"][j]]},"pid":{rk[j]},"tid":{td[j]},'
                f'"ts":{_us(ts_b[j])},"dur":{_us(du_b[j])},"args":{{{",".join(args)}}}}}'
            )
            n_nodes += 1

    # flows: one per sync edge
    n_flows = 0
    e = trace.edges
    if e.num_rows and n:
        sync = pc.equal(e.column("kind"), EDGE_SYNC).to_numpy(zero_copy_only=False)
        src = e.column("src").to_numpy()[sync]
        dst = e.column("dst").to_numpy()[sync]
        ids = trace.column("node_id")
        o = np.argsort(ids, kind="stable")
        sid = ids[o]

        def rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            p = np.minimum(np.searchsorted(sid, x), len(sid) - 1)
            return o[p], sid[p] == x

        rs, oks = rows(src)
        rd, okd = rows(dst)
        ok = oks & okd
        rs, rd = rs[ok], rd[ok]
        ok = known[rs] & known[rd]
        rs, rd = rs[ok], rd[ok]
        s_pid, s_tid, s_ts = rank[rs].tolist(), tid[rs].tolist(), (start[rs] - t0).tolist()
        d_pid, d_tid, d_ts = rank[rd].tolist(), tid[rd].tolist(), (start[rd] - t0).tolist()
        for k in range(len(rs)):
            emit(
                f'{{"ph":"s","name":"sync","cat":"sync","id":{k},"pid":{s_pid[k]},"tid":{s_tid[k]},"ts":{_us(s_ts[k])}}}'
            )
            emit(
                f'{{"ph":"f","bp":"e","name":"sync","cat":"sync","id":{k},"pid":{d_pid[k]},"tid":{d_tid[k]},"ts":{_us(d_ts[k])}}}'
            )
            n_flows += 1

    m = trace.manifest
    skipped = int(n - int(known.sum()))
    meta = {
        "prismtrace": {
            "world_size": trace.world_size,
            "mode": m.get("mode"),
            "device": m.get("device"),
            "command": m.get("command"),
            "timeline": (
                "synthetic: laid out by program order, 1 µs per node (the graph has no times)"
                if synthetic
                else "recorded times (start_ns..end_ns)"
            ),
            "nodes_exported": n_nodes,
            "nodes_without_times": skipped,
            "flows": n_flows,
        }
    }
    f.write('\n],\n"displayTimeUnit":"ns",\n"metadata":')
    f.write(json.dumps(meta, default=str))
    f.write("}\n")
    return {
        "events": events,
        "nodes": n_nodes,
        "nodes_without_times": skipped,
        "flows": n_flows,
        "iterations": n_iter_events,
        "synthetic": synthetic,
    }


def _stream_key(s: str) -> tuple[int, str]:
    if s.startswith("comm:") and s[5:].isdigit():
        return (int(s[5:]), "")
    return (1 << 30, s)


def _stream_name(s: str, info: dict[int, dict[str, Any]]) -> str:
    """ "comm:<gid>" -> "comm:<desc>" (with "#<gid>" when several groups share the desc)."""
    if s.startswith("comm:") and s[5:].lstrip("-").isdigit():
        gid = int(s[5:])
        g = info.get(gid)
        if g is not None:
            desc = group_desc(g)
            if not desc:
                return f"comm:{gid} ({ranks_text(g['ranks'])})"
            shared = sum(1 for x in info.values() if group_desc(x) == desc) > 1
            return f"comm:{desc}#{gid}" if shared else f"comm:{desc}"
    return s
