"""Export a PrismTrace as Kineto-style traces (one per rank), the input of Holistic Trace Analysis.

    export_kineto(trace, "out/kineto") -> dict of counts
    # then: from hta.trace_analysis import TraceAnalysis; TraceAnalysis(trace_dir="out/kineto")

Kineto is the trace PyTorch's profiler writes (Chrome trace-event JSON with a few conventions);
Holistic Trace Analysis (HTA, PyPI ``holistictraceanalysis``) reads a directory of them, one file
per rank. What HTA relies on, and how the graph maps onto it:

- Files: ``rank-<r>.json``. HTA takes every ``*.json`` of the directory and finds the rank by
  the first line that matches ``"rank": <n>`` (with a space after the colon), so the top-level
  ``distributedInfo`` ({"backend", "rank", "world_size", "pg_count", "pg_config"}, as PyTorch
  writes it) is the first key, on its own line. ``baseTimeNanoseconds`` is the graph's clock
  (``time.time_ns``) at ts 0: HTA turns an event time back into Unix time as
  ``ts * 1000 + baseTimeNanoseconds``. All files share one base, so ranks stay aligned.
- GPU kernels: every timed node is a complete event (``ph: X``, ``ts``/``dur`` in µs with ns
  decimals) with ``cat: "kernel"`` and ``args`` {"device", "stream", "correlation", ...}. HTA
  takes an event with a ``stream`` arg as a GPU kernel and classifies it by name only:
  ``^nccl.*Kernel`` is communication, names with ``Memcpy``/``Memset``/``Sync`` are not
  compute, anything else is compute. So communication nodes are named like NCCL's kernels,
  ``ncclKernel_<Op>`` (AllReduce, AllGather, ReduceScatter, AllToAll, Broadcast, Reduce,
  Gather, Scatter, Barrier, Send, Recv): NCCL's names before 2.19 (later ones are
  ``ncclDevKernel_...``), because HTA's straggler analysis still looks for ``ncclKernel`` only.
  They carry PyTorch's collective args ("Collective name",
  "In msg nelems", "Group size", "Process Group Name", ...); compute spans are named
  ``compute`` or ``compute: <label>`` (a label's "Sync"/"Memcpy"/"Memset" lower-cased so that
  it stays compute).
- Streams: compute on stream 7 (the id CUPTI reports for the default stream), each
  communication stream of the graph (one per group, ``comm:<group>``) on its own stream from 20
  on; the same numbering in every file. Device index 0 (pid 0): a rank's local device index is
  not in the graph.
- Host side: the host thread (pid ``HOST_PID_BASE + rank``) has a ``cudaLaunchKernel`` runtime
  event per kernel at the node's issue time (``issue_ns``, else its start), linked to the kernel
  by ``correlation`` (and an ``ac2g`` flow, as Kineto draws it), and one ``ProfilerStep#<i>``
  annotation per iteration (from the iterations table, else the span of the iteration's nodes).
  HTA assigns kernels to iterations through these links, and by default (as for a real
  profile, whose last step is cut short) it drops the kernels launched in the last profiler
  step: ``TraceAnalysis(trace_dir=..., include_last_profiler_step=True)`` keeps them.

Times: a node's span is start_ns..end_ns (falling back to issue_ns / duration_ns, as the
Perfetto export does); nodes without a time are left out and counted. A graph with no times at
all (a bare graph) cannot be exported: TraceError.

The events describe a GPU run whatever device the graph was recorded on (``distributedInfo``
says backend "nccl"); the graph's own mode and device are under the top-level key
``prismtrace``. Written as a stream, rank by rank and batch by batch.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import pyarrow as pa

from prismllm.trace.graph import PrismTrace, group_desc, ranks_text
from prismllm.trace.schema import CALL_COLUMNS, KIND_COMM
from prismllm.trace.spans import measured_spans, rank_rows, write_atomically

DEVICE = 0
STREAM_COMPUTE = 7
STREAM_COMM_FIRST = 20
HOST_PID_BASE = 100_000  # no OS pid is known; keeps host pids apart from the device pid 0
BATCH = 65536

NCCL_KERNEL = {
    "all_reduce": "ncclKernel_AllReduce",
    "all_gather": "ncclKernel_AllGather",
    "reduce_scatter": "ncclKernel_ReduceScatter",
    "all_to_all": "ncclKernel_AllToAll",
    "broadcast": "ncclKernel_Broadcast",
    "reduce": "ncclKernel_Reduce",
    "gather": "ncclKernel_Gather",
    "scatter": "ncclKernel_Scatter",
    "barrier": "ncclKernel_Barrier",
    "send": "ncclKernel_Send",
    "recv": "ncclKernel_Recv",
}

DTYPE_BYTES = {
    "float64": 8,
    "double": 8,
    "float32": 4,
    "float": 4,
    "float16": 2,
    "half": 2,
    "bfloat16": 2,
    "int64": 8,
    "long": 8,
    "int32": 4,
    "int": 4,
    "int16": 2,
    "short": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "complex64": 8,
    "complex128": 16,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
}


# ---------------------------------------------------------------------- export
def export_kineto(trace: PrismTrace, out_dir: str | os.PathLike, ranks: list[int] | None = None) -> dict[str, Any]:
    """Write ``out_dir/rank-<r>.json`` for every rank of the graph (or of ``ranks``).

    Returns {"files", "ranks", "kernels", "nodes_without_times", "profiler_steps",
    "base_time_ns", "streams"}. Write into a directory of its own: HTA reads every .json in it.
    """
    trace, present, rows_of = rank_rows(trace, ranks)
    start, end, known = measured_spans(trace, "a Kineto trace")
    # the host launches a kernel when the program issued the node (never after it started)
    issue = trace.column("issue_ns").astype(np.int64)
    launch = np.where((issue >= 0) & (issue <= start), issue, start)

    # one clock origin for all files: the earliest launch, span or iteration start
    cand = [int(start[known].min()), int(launch[known].min())]
    it = trace.iterations
    it_start = it.column("start_ns").to_numpy().astype(np.int64) if it.num_rows else np.zeros(0, np.int64)
    if (it_start >= 0).any():
        cand.append(int(it_start[it_start >= 0].min()))
    t0 = min(cand)

    streams = stream_ids(trace)
    info = trace.group_info()
    steps_of = _iteration_spans(trace)
    out_dir = Path(out_dir)
    files, kernels, steps = [], 0, 0
    for r, rows in zip(present, rows_of):
        path = out_dir / f"rank-{r}.json"
        k, s = write_atomically(
            path,
            lambda f, r=r, rows=rows: _write_rank(
                f, trace, r, rows, start, end, known, launch, t0, streams, info, steps_of.get(r, [])
            ),
        )
        files.append(str(path))
        kernels += k
        steps += s
    return {
        "files": files,
        "ranks": len(present),
        "kernels": kernels,
        "nodes_without_times": int(sum(int((~known[rows]).sum()) for rows in rows_of)),
        "profiler_steps": steps,
        "base_time_ns": t0,
        "streams": streams,
    }


def stream_ids(trace: PrismTrace) -> dict[str, int]:
    """Stream name -> CUDA-like stream id, the same for every rank."""
    names = sorted(set(trace.column("stream").tolist()) - {"compute"}, key=_stream_key)
    ids = {"compute": STREAM_COMPUTE}
    ids.update({s: STREAM_COMM_FIRST + k for k, s in enumerate(names)})
    return ids


def _stream_key(s: str) -> tuple[int, str]:
    if s.startswith("comm:") and s[5:].isdigit():
        return (int(s[5:]), "")
    return (1 << 30, s)


def _stream_label(s: str, info: dict[int, dict[str, Any]]) -> str:
    """ "comm:<group id>" -> "comm:<desc> (ranks 0-3)"; other stream names as they are."""
    if s.startswith("comm:") and s[5:].isdigit() and int(s[5:]) in info:
        g = info[int(s[5:])]
        return f"comm:{group_desc(g) or g['name']} ({ranks_text(g['ranks'])})"
    return s


def _compute_name(label: str) -> str:
    if not label:
        return "compute"
    # HTA takes a kernel whose name holds "Sync" or "Memcpy"/"Memset" for non-compute
    for word in ("Sync", "Memcpy", "Memset"):
        label = label.replace(word, word.lower())
    return f"compute: {label}"


def _distributed_info(trace: PrismTrace, rank: int, info: dict[int, dict[str, Any]]) -> dict[str, Any]:
    mine = [g for _, g in sorted(info.items()) if rank in g["ranks"]]
    return {
        "backend": "nccl",
        "rank": rank,
        "world_size": trace.world_size,
        "pg_count": len(mine),
        "pg_config": [
            {
                "pg_name": g["name"],
                "pg_desc": g["desc"],
                "backend_config": "cuda:nccl",
                "pg_size": len(g["ranks"]),
                "ranks": g["ranks"],
            }
            for g in mine
        ],
    }


def _iteration_spans(trace: PrismTrace) -> dict[int, list[tuple[int, int, int]]]:
    """rank -> [(iteration, start_ns, end_ns)] of the iterations table rows that have times."""
    it = trace.iterations.to_pydict()
    spans: dict[int, list[tuple[int, int, int]]] = {}
    for r, i, s, e in zip(it["rank"], it["iteration"], it["start_ns"], it["end_ns"]):
        if i >= 0 and 0 <= s <= e:
            spans.setdefault(r, []).append((i, s, e))
    return spans


def _write_rank(
    f: TextIO,
    trace: PrismTrace,
    rank: int,
    rows: np.ndarray,
    start: np.ndarray,
    end: np.ndarray,
    known: np.ndarray,
    launch: np.ndarray,
    t0: int,
    streams: dict[str, int],
    info: dict[int, dict[str, Any]],
    spans: list[tuple[int, int, int]],
) -> tuple[int, int]:
    esc: dict[str, str] = {}

    def q(s: str) -> str:
        v = esc.get(s)
        if v is None:
            v = esc[s] = json.dumps(s)
        return v

    def us(ns: int) -> str:
        return f"{(ns - t0) / 1000:.3f}"

    first = True

    def emit(s: str) -> None:
        nonlocal first
        f.write(s if first else ",\n" + s)
        first = False

    host = HOST_PID_BASE + rank
    # distributedInfo first and on one line: HTA finds the rank by a line-wise regex
    f.write('{\n"distributedInfo": ' + json.dumps(_distributed_info(trace, rank, info)) + ",\n")
    f.write(f'"schemaVersion": 1,\n"baseTimeNanoseconds": {t0},\n"displayTimeUnit": "ms",\n')
    f.write('"traceEvents": [\n')
    emit(f'{{"ph":"M","name":"process_name","pid":{host},"tid":0,"args":{{"name":"rank {rank} host"}}}}')
    emit(f'{{"ph":"M","name":"thread_name","pid":{host},"tid":{host},"args":{{"name":"rank {rank} main thread"}}}}')
    emit(f'{{"ph":"M","name":"process_name","pid":{DEVICE},"tid":0,"args":{{"name":"rank {rank} GPU {DEVICE}"}}}}')
    for s in sorted(set(trace.column("stream")[rows].tolist()), key=streams.__getitem__):
        sid = streams[s]
        name = q(f"stream {sid} {_stream_label(s, info)}")
        emit(f'{{"ph":"M","name":"thread_name","pid":{DEVICE},"tid":{sid},"args":{{"name":{name}}}}}')

    # profiler steps: the iterations table where it has times, else the span of each iteration's
    # nodes from the first launch on (HTA puts a kernel in the step its launch falls in)
    steps = 0
    spans = list(spans)
    if not spans:
        iteration = trace.column("iteration")[rows].astype(np.int64)
        ok = known[rows] & (iteration >= 0)
        for i in np.unique(iteration[ok]).tolist():
            sel = rows[ok & (iteration == i)]
            spans.append((i, int(launch[sel].min()), int(end[sel].max())))
    for i, s, e in sorted(spans, key=lambda x: x[1]):
        emit(
            f'{{"ph":"X","cat":"user_annotation","name":"ProfilerStep#{i}","pid":{host},"tid":{host},'
            f'"ts":{us(s)},"dur":{(e - s) / 1000:.3f},"args":{{"External id":{i + 1}}}}}'
        )
        steps += 1

    cols = [
        *CALL_COLUMNS,
        "dtype",
        "in_bytes",
        "out_bytes",
        "in_splits",
        "out_splits",
        "async_op",
        "label",
        "reduce_op",
        "stream",
    ]
    kernels = 0
    for b0 in range(0, len(rows), BATCH):
        sel = rows[b0 : b0 + BATCH]
        d = trace.nodes.take(pa.array(sel)).select(cols).to_pydict()
        kn = known[sel].tolist()
        ts, te, tl = start[sel].tolist(), end[sel].tolist(), launch[sel].tolist()
        for j in range(len(sel)):
            if not kn[j]:
                continue
            index = d["index"][j]
            corr = index + 1  # > 0: HTA reads correlation -1 as "none"
            sid = streams[d["stream"][j]]
            op = d["op"][j]
            args = [
                f'"device":{DEVICE}',
                f'"stream":{sid}',
                f'"correlation":{corr}',
                '"context":1',
                f'"op":{q(op)}',
                f'"index":{index}',
                f'"iteration":{d["iteration"][j]}',
            ]
            if d["kind"][j] == KIND_COMM:
                name = NCCL_KERNEL.get(op, "ncclKernel_" + op)
                args.append(_comm_args(d, j, info, q))
            else:
                name = _compute_name(d["label"][j])
            if d["label"][j]:
                args.append(f'"label":{q(d["label"][j])}')
            emit(
                f'{{"ph":"X","cat":"kernel","name":{q(name)},"pid":{DEVICE},"tid":{sid},'
                f'"ts":{us(ts[j])},"dur":{(te[j] - ts[j]) / 1000:.3f},"args":{{{",".join(args)}}}}}'
            )
            emit(
                f'{{"ph":"X","cat":"cuda_runtime","name":"cudaLaunchKernel","pid":{host},"tid":{host},'
                f'"ts":{us(tl[j])},"dur":0,"args":{{"cbid":211,"correlation":{corr}}}}}'
            )
            emit(f'{{"ph":"s","cat":"ac2g","name":"ac2g","id":{corr},"pid":{host},"tid":{host},"ts":{us(tl[j])}}}')
            emit(
                f'{{"ph":"f","bp":"e","cat":"ac2g","name":"ac2g","id":{corr},"pid":{DEVICE},"tid":{sid},'
                f'"ts":{us(ts[j])}}}'
            )
            kernels += 1

    m = trace.manifest
    meta = {
        "world_size": trace.world_size,
        "mode": m.get("mode"),
        "device": m.get("device"),
        "command": m.get("command"),
        "clock": m.get("clock"),
    }
    f.write('\n],\n"prismtrace": ' + json.dumps(meta, default=str) + "\n}\n")
    return kernels, steps


def _comm_args(d: dict[str, list], j: int, info: dict[int, dict[str, Any]], q: Any) -> str:
    """PyTorch's record_param_comms args (what HTA's communication columns read), plus bytes."""
    g = info.get(d["group"][j], {"name": str(d["group"][j]), "desc": "", "ranks": []})
    itemsize = DTYPE_BYTES.get(d["dtype"][j], 0)
    in_b, out_b = d["in_bytes"][j], d["out_bytes"][j]
    args = [
        f'"Collective name":{q(d["op"][j])}',
        f'"Group size":{len(g["ranks"])}',
        f'"dtype":{q(d["dtype"][j])}',
        f'"In msg size":{in_b}',
        f'"Out msg size":{out_b}',
        f'"In split size":{q(json.dumps(d["in_splits"][j]))}',
        f'"Out split size":{q(json.dumps(d["out_splits"][j]))}',
        f'"Process Group Name":{q(g["name"])}',
        f'"Process Group Description":{q(group_desc(g))}',
        f'"Process Group Ranks":{q(json.dumps(g["ranks"]))}',
        f'"seq":{d["seq"][j]}',
    ]
    if itemsize:
        args.append(f'"In msg nelems":{in_b // itemsize},"Out msg nelems":{out_b // itemsize}')
    if d["peer"][j] >= 0:
        args.append(f'"peer":{d["peer"][j]}')
    if d["reduce_op"][j]:
        args.append(f'"reduce_op":{q(d["reduce_op"][j])}')
    if d["async_op"][j]:
        args.append('"async":true')
    return ",".join(args)
