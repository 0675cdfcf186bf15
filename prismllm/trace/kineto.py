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
- Process groups: ``pg_config`` lists the rank's groups from the graph's groups table (name,
  ranks) and every communication kernel carries "Process Group Name" / "Description" / "Ranks".
  The description is the group's own (``group_desc``: "default_pg", a user's ``group_desc``),
  else its ranks ("ranks 0-3"), never torch's placeholder "undefined".
- Steps: like a PyTorch profile with a warm-up step (``torch.profiler.schedule(warmup=1)``),
  the traces hold the steady iterations only: the graph's first iteration (the warm-up) and the
  set-up before it (iteration -1) are left out, and counted, when the graph has at least two
  iterations (``keep_warmup=True`` keeps them). HTA's own step choices (the first
  ``ProfilerStep`` for the critical path, every step but the last for the other analyses) then
  fall on steady iterations.
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
- Host side (pid ``HOST_PID_BASE + rank``, one thread), what HTA's critical path walks: each
  node is a CPU op (``cat: "cpu_op"``, the compute span's name or ``nccl:<op>``) at its issue
  time, holding a 1 µs ``cudaLaunchKernel`` linked to its kernel by ``correlation`` (and an
  ``ac2g`` flow, as Kineto draws it); one ``ProfilerStep#<i>`` annotation per iteration (from
  the iterations table, else the span of the iteration's nodes), 1 ns short of its end because
  HTA's critical path takes a step's end into the step. HTA assigns kernels to steps through
  the launches, and by default (as for a real profile, whose last step is cut short) it drops
  the kernels launched in the last profiler step:
  ``TraceAnalysis(trace_dir=..., include_last_profiler_step=True)`` keeps them.
  The graph has no host cost of a node, and HTA's critical path counts a CPU op's time but not
  the time between ops; so an op lasts ``HOST_OP_US`` (its launch, and an event record), a
  nominal time. HTA keeps only host events of at least 1 µs (it rounds starts up and ends down
  to whole µs), so host times are whole µs; a launch is at its node's issue, or ``HOST_OP_US``
  after the previous launch where the graph issued faster than that (a communication call and
  the compute after it are issued at one instant): a launch may then follow its kernel's start.
- Dependencies between streams, as PyTorch's NCCL process group makes them with CUDA events: a
  node that the graph makes wait for a node on another stream (the nearest earlier node the
  program waited for, i.e. any but an async call; an async call's wait point) gets a
  ``cudaStreamWaitEvent`` on the host 1 µs before its launch and a ``Stream Wait Event``
  (``cat: "cuda_sync"``, args ``wait_on_stream``, ``wait_on_cuda_event_record_corr_id``) on
  its stream, in the whole µs before the earlier of the awaited kernel's end and its own start
  (HTA orders a sync event by its end, before the kernel); the awaited node gets a
  ``cudaEventRecord`` right after its launch. HTA's critical path turns each into a
  synchronisation edge, so ``critical_path_analysis(rank, "ProfilerStep", k)`` runs through
  the communication that the compute waited for, and not through an async call it overlapped.

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
from prismllm.trace.spans import measured_spans, prev_waited, rank_rows, write_atomically

DEVICE = 0
STREAM_COMPUTE = 7
STREAM_COMM_FIRST = 20
HOST_PID_BASE = 100_000  # no OS pid is known; keeps host pids apart from the device pid 0
BATCH = 65536
HOST_OP_US = 2  # a node's host op: its launch (1 µs), then its event record

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
def export_kineto(
    trace: PrismTrace, out_dir: str | os.PathLike, ranks: list[int] | None = None, keep_warmup: bool = False
) -> dict[str, Any]:
    """Write ``out_dir/rank-<r>.json`` for every rank of the graph (or of ``ranks``).

    Returns {"files", "ranks", "kernels", "nodes_without_times", "warmup_nodes",
    "profiler_steps", "stream_waits", "base_time_ns", "streams"}. ``keep_warmup`` keeps the
    set-up and the first iteration, which are left out by default (see the module's doc).
    Write into a directory of its own: HTA reads every .json in it.
    """
    trace, present, rows_of = rank_rows(trace, ranks)
    start, end, known = measured_spans(trace, "a Kineto trace")
    iteration = trace.column("iteration").astype(np.int64)
    first = _first_steady(iteration[known]) if not keep_warmup else None
    profiled = iteration >= first if first is not None else np.ones(len(iteration), bool)
    exported = known & profiled
    # the host launches a kernel when the program issued the node (never after it started)
    issue = trace.column("issue_ns").astype(np.int64)
    launch = np.where((issue >= 0) & (issue <= start), issue, start)

    # one clock origin for all files: the earliest launch, span or iteration start
    steps_of = _iteration_spans(trace, first)
    cand = [int(start[exported].min()), int(launch[exported].min())]
    cand += [s for spans in steps_of.values() for _, s, _ in spans]
    t0 = min(cand)

    streams = stream_ids(trace)
    info = trace.group_info()
    cols = {
        "async": (trace.column("kind") == KIND_COMM) & trace.column("async_op").astype(bool),
        "index": trace.column("index").astype(np.int64),
        "wait_index": trace.column("wait_index").astype(np.int64),
        "stream": trace.column("stream"),
    }
    out_dir = Path(out_dir)
    files, kernels, steps, waits = [], 0, 0, 0
    for r, rows in zip(present, rows_of):
        path = out_dir / f"rank-{r}.json"
        deps = _stream_waits(rows, exported, cols)
        k, s, w = write_atomically(
            path,
            lambda f, r=r, rows=rows, deps=deps: _write_rank(
                f, trace, r, rows[exported[rows]], deps, (start, end, launch, t0), streams, info, steps_of.get(r, [])
            ),
        )
        files.append(str(path))
        kernels += k
        steps += s
        waits += w
    return {
        "files": files,
        "ranks": len(present),
        "kernels": kernels,
        "nodes_without_times": int(sum(int((~known[rows] & profiled[rows]).sum()) for rows in rows_of)),
        "warmup_nodes": int(sum(int((~profiled[rows]).sum()) for rows in rows_of)),
        "profiler_steps": steps,
        "stream_waits": waits,
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


def _first_steady(iteration: np.ndarray) -> int | None:
    """The first iteration after the warm-up (the graph's first iteration), or None when the
    graph has fewer than two iterations (then there is nothing steady to keep apart)."""
    its = np.unique(iteration[iteration >= 0])
    return int(its[1]) if len(its) >= 2 else None


def _pg_desc(g: dict[str, Any]) -> str:
    """A group's description for HTA: its own, else its ranks (torch's default is "undefined")."""
    return group_desc(g) or ranks_text(g["ranks"])


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
                "pg_desc": _pg_desc(g),
                "backend_config": "cuda:nccl",
                "pg_size": len(g["ranks"]),
                "ranks": g["ranks"],
            }
            for g in mine
        ],
    }


def _iteration_spans(trace: PrismTrace, first: int | None) -> dict[int, list[tuple[int, int, int]]]:
    """rank -> [(iteration, start_ns, end_ns)] of the iterations table rows that have times
    (from iteration ``first`` on, where given)."""
    it = trace.iterations.to_pydict()
    lowest = 0 if first is None else first
    spans: dict[int, list[tuple[int, int, int]]] = {}
    for r, i, s, e in zip(it["rank"], it["iteration"], it["start_ns"], it["end_ns"]):
        if i >= lowest and 0 <= s <= e:
            spans.setdefault(r, []).append((i, s, e))
    return spans


def _stream_waits(rows: np.ndarray, exported: np.ndarray, cols: dict[str, np.ndarray]) -> np.ndarray:
    """The dependencies of one rank (rows in program order) that cross streams, as rows
    [(waiting node's position, awaited node's position)] among the exported rows, sorted.

    A node waits for the nearest earlier node the program waited for (any node but an async
    call), and the node at an async call's wait point for that call (the graph's ``wait``
    edge), as the Chakra export reads the graph; on one stream, the stream's order holds these."""
    n = len(rows)
    pos = np.arange(n)
    prev = prev_waited(cols["async"][rows])
    dst, src = [pos[prev >= 0]], [prev[prev >= 0]]
    index, wait_index = cols["index"][rows], cols["wait_index"][rows]
    calls = np.flatnonzero(cols["async"][rows] & (wait_index >= 0))
    at = np.minimum(np.searchsorted(index, wait_index[calls]), n - 1)  # index ascends in program order
    hit = index[at] == wait_index[calls]
    dst.append(at[hit])
    src.append(calls[hit])
    d, s = np.concatenate(dst), np.concatenate(src)
    ok = exported[rows[d]] & exported[rows[s]] & (cols["stream"][rows[d]] != cols["stream"][rows[s]])
    # positions among the exported rows
    ex_pos = np.cumsum(exported[rows]) - 1
    pairs = np.stack([ex_pos[d[ok]], ex_pos[s[ok]]], axis=1)
    return np.unique(pairs, axis=0) if len(pairs) else pairs.reshape(0, 2)


def _write_rank(
    f: TextIO,
    trace: PrismTrace,
    rank: int,
    rows: np.ndarray,
    deps: np.ndarray,
    times: tuple[np.ndarray, np.ndarray, np.ndarray, int],
    streams: dict[str, int],
    info: dict[int, dict[str, Any]],
    spans: list[tuple[int, int, int]],
) -> tuple[int, int, int]:
    """One rank's file; ``rows`` are its exported rows in program order, ``deps`` its
    cross-stream waits among them (:func:`_stream_waits`)."""
    start, end, launch, t0 = times
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
    n = len(rows)
    iteration = trace.column("iteration")[rows].astype(np.int64)
    spans = list(spans)
    if not spans:
        for i in np.unique(iteration[iteration >= 0]).tolist():
            sel = rows[iteration == i]
            spans.append((i, int(launch[sel].min()), int(end[sel].max())))
    spans.sort(key=lambda x: x[1])
    for i, s, e in spans:
        # HTA's critical path takes the events from a step's start to its end, both included:
        # the annotation stops 1 ns short of the iteration's end, which keeps the next step's
        # first event (HTA rounds times to whole µs) out of it
        emit(
            f'{{"ph":"X","cat":"user_annotation","name":"ProfilerStep#{i}","pid":{host},"tid":{host},'
            f'"ts":{us(s)},"dur":{max(e - s - 1, 0) / 1000:.3f},"args":{{"External id":{i + 1}}}}}'
        )

    # host layout in whole µs from t0: node k launches at host_at[k], its issue (never before its
    # step's start, which HTA rounds up to a whole µs), or HOST_OP_US after the previous launch
    # if that is later. Its op is the launch and the event record after it: the graph has no
    # host cost of a node, and HTA's critical path counts an op's time but not the time between
    k = np.arange(n)
    issued = (launch[rows] - t0) // 1000
    for i, s, _ in spans:
        issued[iteration == i] = np.maximum(issued[iteration == i], -((t0 - s) // 1000))
    host_at = np.maximum.accumulate(issued - HOST_OP_US * k) + HOST_OP_US * k
    waits_of: dict[int, list[int]] = {}
    for d, s in deps.tolist():
        waits_of.setdefault(d, []).append(s)
    recorded = np.zeros(n, bool)
    recorded[deps[:, 1]] = True
    index = trace.column("index")[rows].astype(np.int64)
    stream_of = trace.column("stream")[rows]
    # correlation ids, unique in the file: kernels index + 1 (> 0: HTA reads -1 as "none"), then
    # the event records, then the stream waits
    base = int(index.max()) + 1 if n else 0

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
    kernels = n_waits = 0
    for b0 in range(0, n, BATCH):
        sel = rows[b0 : b0 + BATCH]
        d = trace.nodes.take(pa.array(sel)).select(cols).to_pydict()
        ts, te = start[sel].tolist(), end[sel].tolist()
        hl = host_at[b0 : b0 + BATCH].tolist()
        rec = recorded[b0 : b0 + BATCH].tolist()
        for j in range(len(sel)):
            idx = d["index"][j]
            corr = idx + 1
            sid = streams[d["stream"][j]]
            op = d["op"][j]
            args = [
                f'"device":{DEVICE}',
                f'"stream":{sid}',
                f'"correlation":{corr}',
                '"context":1',
                f'"op":{q(op)}',
                f'"index":{idx}',
                f'"iteration":{d["iteration"][j]}',
            ]
            if d["kind"][j] == KIND_COMM:
                name = NCCL_KERNEL.get(op, "ncclKernel_" + op)
                host_name = "nccl:" + op
                args.append(_comm_args(d, j, info, q))
            else:
                name = host_name = _compute_name(d["label"][j])
            if d["label"][j]:
                args.append(f'"label":{q(d["label"][j])}')
            emit(
                f'{{"ph":"X","cat":"cpu_op","name":{q(host_name)},"pid":{host},"tid":{host},'
                f'"ts":{hl[j]},"dur":{HOST_OP_US},"args":{{"index":{idx}}}}}'
            )
            for p in waits_of.get(b0 + j, ()):
                # the host's wait (1 µs before this launch) and the stream's, in the whole µs
                # before the earlier of the awaited kernel's end and this kernel's start: HTA
                # orders a sync event by its end and must meet it before this kernel
                wcorr = 2 * base + n_waits + 1
                rcorr = base + int(index[p]) + 1
                w_end = (min(int(end[rows[p]]), ts[j]) - t0 - 1) // 1000
                emit(
                    f'{{"ph":"X","cat":"cuda_runtime","name":"cudaStreamWaitEvent","pid":{host},"tid":{host},'
                    f'"ts":{hl[j] - 1},"dur":0,"args":{{"cbid":147,"correlation":{wcorr}}}}}'
                )
                emit(
                    f'{{"ph":"X","cat":"cuda_sync","name":"Stream Wait Event","pid":{DEVICE},"tid":{sid},'
                    f'"ts":{w_end},"dur":0,"args":{{"device":{DEVICE},"stream":{sid},"correlation":{wcorr},'
                    f'"context":1,"wait_on_stream":{streams[stream_of[p]]},'
                    f'"wait_on_cuda_event_record_corr_id":{rcorr}}}}}'
                )
                n_waits += 1
            emit(
                f'{{"ph":"X","cat":"cuda_runtime","name":"cudaLaunchKernel","pid":{host},"tid":{host},'
                f'"ts":{hl[j]},"dur":1,"args":{{"cbid":211,"correlation":{corr}}}}}'
            )
            emit(f'{{"ph":"s","cat":"ac2g","name":"ac2g","id":{corr},"pid":{host},"tid":{host},"ts":{hl[j]}}}')
            emit(
                f'{{"ph":"f","bp":"e","cat":"ac2g","name":"ac2g","id":{corr},"pid":{DEVICE},"tid":{sid},'
                f'"ts":{us(ts[j])}}}'
            )
            emit(
                f'{{"ph":"X","cat":"kernel","name":{q(name)},"pid":{DEVICE},"tid":{sid},'
                f'"ts":{us(ts[j])},"dur":{(te[j] - ts[j]) / 1000:.3f},"args":{{{",".join(args)}}}}}'
            )
            if rec[j]:
                emit(
                    f'{{"ph":"X","cat":"cuda_runtime","name":"cudaEventRecord","pid":{host},"tid":{host},'
                    f'"ts":{hl[j] + 1},"dur":0,"args":{{"cbid":135,"correlation":{base + idx + 1}}}}}'
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
    return kernels, len(spans), n_waits


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
        f'"Process Group Description":{q(_pg_desc(g))}',
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
