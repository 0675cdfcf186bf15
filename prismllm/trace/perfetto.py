"""Export a PrismTrace for Perfetto: Chrome trace-event JSON here (opens in Perfetto and
chrome://tracing), Perfetto's own protobuf trace in :mod:`prismllm.trace.perfetto_proto`. Both
show what :func:`layout` lays out.

    export_perfetto(trace, "trace.json") -> dict of counts

Layout: one process per rank ("rank N", sorted by rank); per rank one track per stream —
"iterations" (the iteration boundaries, as spans), "compute", and "comm:<group desc>" per
communication stream; every node is a complete event (``X``, ts/dur in µs) with args (op,
group, bytes, dtype, shape, splits, label, iteration, ...); every sync edge is a flow arrow
(``s`` at the source node, ``f`` with ``bp: "e"`` at the destination, one id per edge); a rank
whose peak memory the manifest has (``peak_memory_bytes``) gets a "peak memory" counter (``C``,
arg ``bytes``) set at the start of the trace and again at its end, so that it spans the trace.

Times: a node's span is start_ns..end_ns (falling back to issue_ns / duration_ns); nodes with
no time at all are left out and counted. A graph with no times at all (a bare graph) is laid
out by program order instead: node ``index`` at ``index`` µs, 1 µs long (an async node spans
to its wait point); the metadata says so (``metadata.prismtrace.timeline``).

Written as a stream (batch by batch), so large graphs never hold the whole JSON in memory.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from prismllm import specs
from prismllm.errors import PrismError
from prismllm.trace.graph import PrismTrace, group_desc, ranks_text
from prismllm.trace.schema import EDGE_SYNC
from prismllm.trace.spans import node_spans, select_ranks, write_atomically

TID_ITERATIONS = 0
TID_COMPUTE = 1
BATCH = 65536
MEMORY_COUNTER = "peak memory"

# the node columns a node's event is made of, in the order :func:`node_event` unpacks a row
NODE_COLUMNS = (
    "node_id",
    "index",
    "iteration",
    "kind",
    "op",
    "group",
    "seq",
    "peer",
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
)


@dataclass
class Layout:
    """What both Perfetto exports show. Times are ns on the graph's clock (a synthetic layout's
    own ns for a graph without times); the exports write them relative to ``t0``."""

    start: np.ndarray  # per node row
    end: np.ndarray
    known: np.ndarray  # the rows with a span: the others are left out
    synthetic: bool
    t0: int
    t_end: int  # the end of the last span shown
    rank: np.ndarray  # per node row
    tid: np.ndarray  # per node row: its track, TID_COMPUTE or one per communication stream
    track_names: dict[int, str]  # tid -> name
    ranks: list[int]  # every rank shown, ascending
    tracks: list[tuple[int, int]]  # the (rank, tid) pairs that have nodes, ascending
    iterations: list[tuple[int, int, int, int, str]]  # (rank, iteration, start, end, name)
    flow_src: np.ndarray  # node rows of each sync edge whose both ends are shown
    flow_dst: np.ndarray
    peak_memory: dict[int, int]  # rank -> bytes, for the ranks shown whose peak the manifest has
    group_label: dict[int, str]  # group id -> "<gid> (<desc or ranks>)"


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


def layout(trace: PrismTrace) -> Layout:
    """The tracks, spans, iterations, flows and memory counters of the graph (see the module
    docstring)."""
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

    ranks = np.unique(rank) if n else np.zeros(0, np.int64)
    if it_tab.num_rows:
        ranks = np.union1d(ranks, it_tab.column("rank").to_numpy().astype(np.int64))
    pairs = np.unique(rank * (next_tid + 1) + tid) if n else np.zeros(0, np.int64)
    tracks = [divmod(p, next_tid + 1) for p in pairs.tolist()]

    iterations = []
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
                iterations.append((r, i, s, e, f"iteration {i}"))
    else:
        it = it_tab.to_pydict()
        for r, i, s, e, lab in zip(it["rank"], it["iteration"], it["start_ns"], it["end_ns"], it["label"]):
            if s < 0 or e < s:
                continue
            iterations.append((r, i, s, e, f"iteration {i}" + (f" ({lab})" if lab else "")))

    # flows: one per sync edge whose both ends are shown
    rs = rd = np.zeros(0, np.int64)
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

    ends = [int(end[known].max())] if known.any() else []
    ends += [e for _, _, _, e, _ in iterations]
    shown = set(ranks.tolist())
    peak = {
        int(r): int(b) for r, b in (trace.manifest.get("peak_memory_bytes") or {}).items() if int(r) in shown and b >= 0
    }
    return Layout(
        start=start,
        end=end,
        known=known,
        synthetic=synthetic,
        t0=t0,
        t_end=max(ends, default=t0),
        rank=rank,
        tid=tid,
        track_names=names,
        ranks=ranks.tolist(),
        tracks=tracks,
        iterations=iterations,
        flow_src=rs,
        flow_dst=rd,
        peak_memory=dict(sorted(peak.items())),
        group_label={gid: f"{gid} ({group_desc(g) or ranks_text(g['ranks'])})" for gid, g in info.items()},
    )


def node_event(row: tuple[Any, ...], group_label: dict[int, str]) -> tuple[str, str, list[tuple[str, Any]]]:
    """A node's row of :data:`NODE_COLUMNS` (see :func:`node_rows`) as an event: (name,
    category, args); an arg's value is an int, a bool, a str or a list of ints."""
    (node_id, index, iteration, kind, op, group, seq, peer, dtype, shape) = row[:10]
    (in_bytes, out_bytes, in_splits, out_splits, async_op, wait_index, label, reduce_op) = row[10:]
    args: list[tuple[str, Any]] = [("op", op), ("node_id", node_id), ("index", index), ("iteration", iteration)]
    if kind == "comm":
        args += [("group", group_label.get(group, str(group))), ("seq", seq)]
        if peer >= 0:
            args.append(("peer", peer))
        args += [("in_bytes", in_bytes), ("out_bytes", out_bytes)]
        if reduce_op:
            args.append(("reduce_op", reduce_op))
        if in_splits:
            args.append(("in_splits", in_splits))
        if out_splits:
            args.append(("out_splits", out_splits))
        if async_op:
            args += [("async", True), ("wait_index", wait_index)]
    if dtype:
        args.append(("dtype", dtype))
    if shape:
        args.append(("shape", shape))
    if label:
        args.append(("label", label))
    return (op if kind == "comm" else (label or "compute")), kind, args


def node_rows(nodes: pa.Table) -> Iterator[tuple[Any, ...]]:
    """The rows of a batch of nodes for :func:`node_event`, one at a time (tuples: faster to
    read than ``to_pydict``'s columns by name; one at a time, so that zip reuses its tuple)."""
    d = nodes.select(list(NODE_COLUMNS)).to_pydict()
    return zip(*(d[c] for c in NODE_COLUMNS))


def metadata(trace: PrismTrace, lay: Layout) -> dict[str, Any]:
    """The graph's facts both exports carry: world size, mode, device, command, and how the
    timeline was made."""
    m = trace.manifest
    return {
        "world_size": trace.world_size,
        "mode": m.get("mode"),
        "device": m.get("device"),
        "command": m.get("command"),
        "timeline": (
            "synthetic: laid out by program order, 1 µs per node (the graph has no times)"
            if lay.synthetic
            else "recorded times (start_ns..end_ns)"
        ),
    }


def export_perfetto(trace: PrismTrace, out: str | os.PathLike, ranks: list[int] | None = None) -> dict[str, Any]:
    """Write the Chrome trace JSON of the graph (or of some ``ranks`` only)."""
    if ranks is not None:
        trace = select_ranks(trace, ranks)
    return write_atomically(Path(out), lambda f: _write(trace, f))


def _write(trace: PrismTrace, f: TextIO) -> dict[str, Any]:
    esc = _Esc()
    enc = {bool: lambda v: "true" if v else "false", str: esc.__getitem__, list: json.dumps}
    lay = layout(trace)
    nodes = trace.nodes
    n = nodes.num_rows
    t0, start, end, known, rank, tid = lay.t0, lay.start, lay.end, lay.known, lay.rank, lay.tid

    events = 0
    first = True

    def emit(s: str) -> None:
        nonlocal first, events
        f.write(s if first else ",\n" + s)
        first = False
        events += 1

    f.write('{"traceEvents":[\n')
    for r in lay.ranks:
        emit(f'{{"ph":"M","name":"process_name","pid":{r},"tid":0,"args":{{"name":"rank {r}"}}}}')
        emit(f'{{"ph":"M","name":"process_sort_index","pid":{r},"tid":0,"args":{{"sort_index":{r}}}}}')
        emit(f'{{"ph":"M","name":"thread_name","pid":{r},"tid":{TID_ITERATIONS},"args":{{"name":"iterations"}}}}')
        emit(f'{{"ph":"M","name":"thread_sort_index","pid":{r},"tid":{TID_ITERATIONS},"args":{{"sort_index":0}}}}')
    for r, t in lay.tracks:
        emit(f'{{"ph":"M","name":"thread_name","pid":{r},"tid":{t},"args":{{"name":{esc[lay.track_names[t]]}}}}}')
        emit(f'{{"ph":"M","name":"thread_sort_index","pid":{r},"tid":{t},"args":{{"sort_index":{t}}}}}')

    for r, i, s, e, name in lay.iterations:
        emit(
            f'{{"ph":"X","name":{esc[name]},"cat":"iteration","pid":{r},"tid":{TID_ITERATIONS},'
            f'"ts":{_us(s - t0)},"dur":{_us(e - s)},"args":{{"iteration":{i}}}}}'
        )

    for r, b in lay.peak_memory.items():
        for ts in (0, lay.t_end - t0):
            emit(f'{{"ph":"C","name":"{MEMORY_COUNTER}","pid":{r},"tid":0,"ts":{_us(ts)},"args":{{"bytes":{b}}}}}')

    # nodes
    n_nodes = 0
    for b0 in range(0, n, BATCH):
        b1 = min(n, b0 + BATCH)
        rows = node_rows(nodes.slice(b0, b1 - b0))
        ts_b = (start[b0:b1] - t0).tolist()
        du_b = (end[b0:b1] - start[b0:b1]).tolist()
        kn = known[b0:b1].tolist()
        rk = rank[b0:b1].tolist()
        td = tid[b0:b1].tolist()
        for j, row in enumerate(rows):
            if not kn[j]:
                continue
            name, cat, args = node_event(row, lay.group_label)
            # ints (most args) as they are; a list comprehension: faster than a generator here
            a = ",".join([f'"{k}":{v}' if type(v) is int else f'"{k}":{enc[type(v)](v)}' for k, v in args])
            emit(
                f'{{"ph":"X","name":{esc[name]},"cat":{esc[cat]},"pid":{rk[j]},"tid":{td[j]},'
                f'"ts":{_us(ts_b[j])},"dur":{_us(du_b[j])},"args":{{{a}}}}}'
            )
            n_nodes += 1

    # flows: one per sync edge
    rs, rd = lay.flow_src, lay.flow_dst
    s_pid, s_tid, s_ts = rank[rs].tolist(), tid[rs].tolist(), (start[rs] - t0).tolist()
    d_pid, d_tid, d_ts = rank[rd].tolist(), tid[rd].tolist(), (start[rd] - t0).tolist()
    for k in range(len(rs)):
        emit(f'{{"ph":"s","name":"sync","cat":"sync","id":{k},"pid":{s_pid[k]},"tid":{s_tid[k]},"ts":{_us(s_ts[k])}}}')
        emit(
            f'{{"ph":"f","bp":"e","name":"sync","cat":"sync","id":{k},"pid":{d_pid[k]},"tid":{d_tid[k]},"ts":{_us(d_ts[k])}}}'
        )

    skipped = int(n - int(known.sum()))
    counts = {"nodes_exported": n_nodes, "nodes_without_times": skipped, "flows": len(rs)}
    f.write('\n],\n"displayTimeUnit":"ns",\n"metadata":')
    f.write(json.dumps({"prismtrace": metadata(trace, lay) | counts}, default=str))
    f.write("}\n")
    return {
        "events": events,
        "nodes": n_nodes,
        "nodes_without_times": skipped,
        "flows": len(rs),
        "iterations": len(lay.iterations),
        "memory_counters": len(lay.peak_memory),
        "synthetic": lay.synthetic,
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
