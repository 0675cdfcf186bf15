"""`prism export DIR (--perfetto OUT.json | --perfetto-proto OUT.pftrace | --hta OUT_DIR | --chakra OUT_DIR)
[--ranks RANKS] [--json]`: write a graph for the tools people use.

--perfetto: Chrome trace-event JSON for https://ui.perfetto.dev or chrome://tracing: a
process per rank, a track per stream (compute, comm:<group>), iteration spans, flow arrows
between the participants of each collective and send/recv pair, and a peak memory counter per
rank where the graph has one. A graph without times
is laid out by program order (1 µs per node) and the file's metadata says so.
--perfetto-proto: the same in Perfetto's own protobuf trace format, about a third the size
(ui.perfetto.dev and trace_processor read it).
--hta: Kineto-style traces, one rank-<r>.json per rank with distributedInfo, that Holistic
Trace Analysis loads (`TraceAnalysis(trace_dir=OUT_DIR)`); a directory of their own (HTA reads
every .json in it). Needs a graph with times.
--chakra: Chakra execution traces (prism.<r>.et, what ASTRA-sim reads) and comm_group.json.
Needs a graph with times.
--ranks keeps some ranks only. The graph is validated first (--no-validate skips the check).
"""

from __future__ import annotations

import argparse

from prismllm.cli import options
from prismllm.errors import PrismError
from prismllm.outdir import writing
from prismllm.trace.chakra import export_chakra
from prismllm.trace.graph import PrismTrace
from prismllm.trace.kineto import export_kineto
from prismllm.trace.perfetto import export_perfetto, parse_ranks
from prismllm.trace.perfetto_proto import export_perfetto_proto

SUMMARY = "export a graph for Perfetto, Holistic Trace Analysis or Chakra"
EXAMPLES = r"""
# for https://ui.perfetto.dev: a process per rank, a track per stream; the first 16 ranks
prism export out/cal/graph --perfetto out/cal.json --ranks 0-15
# the same, a third the size: Perfetto's protobuf trace
prism export out/cal/graph --perfetto-proto out/cal.pftrace
# for Holistic Trace Analysis, and for Chakra / ASTRA-sim
prism export out/cal/graph --hta out/hta
prism export out/cal/graph --chakra out/chakra
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("graph", metavar="DIR", help="graph directory")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--perfetto", metavar="OUT.json", help="write Chrome trace-event JSON for Perfetto")
    fmt.add_argument(
        "--perfetto-proto", metavar="OUT.pftrace", help="write a Perfetto protobuf trace (smaller than the JSON)"
    )
    fmt.add_argument("--hta", metavar="OUT_DIR", help="write Kineto traces for Holistic Trace Analysis")
    fmt.add_argument("--chakra", metavar="OUT_DIR", help="write Chakra execution traces (ASTRA-sim)")
    options.add(p, "ranks", "no_validate", "no_verify", "json")


def run(args: argparse.Namespace) -> int:
    if not (args.perfetto or args.perfetto_proto or args.hta or args.chakra):
        raise PrismError(
            "choose an export format: --perfetto OUT.json, --perfetto-proto OUT.pftrace, --hta OUT_DIR or --chakra OUT_DIR"
        )
    trace = options.load_graph(args.graph, check=not args.no_validate, verify=args.verify)
    ranks = parse_ranks(args.ranks, trace.world_size) if args.ranks else None
    shown = f"{len(set(ranks))} of {trace.world_size}" if ranks else f"{trace.world_size}"
    # a directory of files (--perfetto, --perfetto-proto: one file, written atomically)
    with writing(args.hta or args.chakra):
        return _export(args, trace, ranks, shown)


def _export(args: argparse.Namespace, trace: PrismTrace, ranks: list[int] | None, shown: str) -> int:
    if args.hta:
        fmt, out = "hta", args.hta
        stats = export_kineto(trace, out, ranks=ranks)
        line = f"{stats['kernels']} kernels in {len(stats['files'])} Kineto trace(s) for Holistic Trace Analysis"
    elif args.chakra:
        fmt, out = "chakra", args.chakra
        stats = export_chakra(trace, out, ranks=ranks)
        line = f"{stats['nodes']} nodes in {len(stats['files'])} Chakra execution trace(s)"
    else:
        fmt, out = ("perfetto", args.perfetto) if args.perfetto else ("perfetto-proto", args.perfetto_proto)
        stats = (export_perfetto if args.perfetto else export_perfetto_proto)(trace, out, ranks=ranks)
        note = " (no times in the graph: laid out by program order)" if stats["synthetic"] else ""
        skipped = (
            f", {stats['nodes_without_times']} nodes without times left out" if stats["nodes_without_times"] else ""
        )
        line = f"{stats['nodes']} nodes, {stats['flows']} sync flows{skipped}{note}"
    if args.json:
        options.print_json({"format": fmt, "out": out, "graph": args.graph, "world_size": trace.world_size} | stats)
    else:
        print(f"wrote {out}: {shown} ranks, {line}")
    return 0
