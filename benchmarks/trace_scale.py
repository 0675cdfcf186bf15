"""PrismTrace at scale: synthesise an N-rank graph and time each stage.

    .venv/bin/python benchmarks/trace_scale.py [--world-size 8192] [--nodes-per-rank 500]
        [--out DIR] [--perfetto] [--keep]

Stages timed: synthesising the rank logs (not part of the pipeline), writing them to a spool
(msgpack, as recorders do), assemble_spool, save, load, validate, summary, compare (a graph
with itself) and, with --perfetto, the Perfetto export. Prints one JSON object: sizes, seconds
per stage (wall and CPU: on a shared machine the CPU time is the steadier figure), peak RSS,
on-disk bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path


def _write_fast(spool: Path, log) -> None:
    import msgpack

    from prismllm.trace.ranklog import RANKLOG_VERSION, ranklog_path

    d = {
        "rank": log.rank,
        "world_size": log.world_size,
        "device": log.device,
        "clock": log.clock,
        "nodes": log.nodes,
        "groups": [{"name": g.name, "desc": g.desc, "ranks": g.ranks} for g in log.groups],
        "iterations": log.iterations,
        "peak_memory_bytes": log.peak_memory_bytes,
        "version": RANKLOG_VERSION,
    }
    with open(ranklog_path(spool, log.rank), "wb") as f:
        f.write(msgpack.packb(d, use_bin_type=True))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", type=int, default=8192)
    ap.add_argument("--nodes-per-rank", type=int, default=500)
    ap.add_argument("--out", default=None, help="work directory (default: a temp dir, removed)")
    ap.add_argument("--perfetto", action="store_true", help="also time the Perfetto export")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    args = ap.parse_args(argv)

    from prismllm.trace import PrismTrace, assemble_spool, compare_traces, validate
    from prismllm.trace.ranklog import write_ranklog
    from prismllm.trace.summary import summarize
    from prismllm.trace.synth import synthetic_logs

    work = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="trace_scale-"))
    work.mkdir(parents=True, exist_ok=True)
    spool, graph = work / "spool", work / "graph"
    spool.mkdir(exist_ok=True)
    t: dict[str, float] = {}
    cpu: dict[str, float] = {}

    def stage(name, fn, *fargs):
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn(*fargs)
        t[name] = round(time.perf_counter() - t0, 3)
        cpu[name] = round(time.process_time() - c0, 3)
        print(f"{name}: {t[name]} s wall, {cpu[name]} s cpu", file=sys.stderr, flush=True)
        return out

    def write_spool() -> int:
        logs = stage("synthesise_logs", synthetic_logs, args.world_size, args.nodes_per_rank)
        # The recorders' own writer (RankLog.to_dict = dataclasses.asdict, a deep copy) is slow
        # for 8192 logs in one process; time it on a sample and write the rest with the same
        # msgpack layout directly.
        sample, rest = logs[: min(64, len(logs))], logs[min(64, len(logs)) :]
        stage("write_ranklog_sample", lambda: [write_ranklog(spool, log) for log in sample])
        t["write_ranklog_per_rank_ms"] = round(1000 * t["write_ranklog_sample"] / len(sample), 2)
        stage("write_spool_fast", lambda: [_write_fast(spool, log) for log in rest])
        return sum(len(log.nodes) for log in logs)

    n_nodes = write_spool()
    manifest = {"mode": "record", "command": ["synthetic"]}
    stage("save", stage("assemble_spool", assemble_spool, spool, manifest).save, graph)
    loaded = stage("load", PrismTrace.load, graph)
    stage("validate", validate, loaded)
    stage("summary", summarize, loaded)
    stage("compare_self", compare_traces, loaded, loaded)
    if args.perfetto:
        from prismllm.trace.perfetto import export_perfetto

        stage("export_perfetto", export_perfetto, loaded, work / "trace.json")
    disk = {p.name: p.stat().st_size for p in graph.iterdir()}
    result = {
        "world_size": args.world_size,
        "nodes_per_rank_requested": args.nodes_per_rank,
        "nodes": n_nodes,
        "edges": loaded.edges.num_rows,
        "groups": loaded.groups.num_rows,
        "seconds": t,
        "cpu_seconds": cpu,
        "load_average_1min_at_end": round(os.getloadavg()[0], 1),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "graph_bytes": disk,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }
    print(json.dumps(result, indent=2))
    if not args.keep and not args.out:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
