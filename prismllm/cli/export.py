"""`prism export DIR --perfetto OUT.json`: write a graph in another format.

--perfetto: Chrome trace-event JSON for https://ui.perfetto.dev or chrome://tracing — a
process per rank, a track per stream (compute, comm:<group>), iteration spans, and flow
arrows between the participants of each collective and send/recv pair. A graph without times
is laid out by program order (1 µs per node) and the file's metadata says so. --ranks keeps
some ranks only (flows between kept ranks).
The graph is loaded and validated first (--no-validate skips the check).
"""

from __future__ import annotations

import argparse

from prismllm.errors import PrismError
from prismllm.trace.graph import PrismTrace
from prismllm.trace.perfetto import export_perfetto, parse_ranks
from prismllm.trace.validate import validate


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("export", help="export a graph (Perfetto / Chrome trace JSON)", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("graph", metavar="DIR", help="graph directory")
    p.add_argument("--perfetto", metavar="OUT.json", help="write Chrome trace-event JSON for Perfetto")
    p.add_argument("--ranks", metavar="LIST", help="only these ranks, e.g. 0-7,12 (large graphs make large files)")
    p.add_argument("--no-validate", action="store_true", help="export without validating the graph first")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if not args.perfetto:
        raise PrismError("choose an export format: --perfetto OUT.json")
    trace = PrismTrace.load(args.graph)
    if not args.no_validate:
        validate(trace)
    ranks = parse_ranks(args.ranks, trace.world_size) if args.ranks else None
    stats = export_perfetto(trace, args.perfetto, ranks=ranks)
    note = " (no times in the graph: laid out by program order)" if stats["synthetic"] else ""
    skipped = f", {stats['nodes_without_times']} nodes without times left out" if stats["nodes_without_times"] else ""
    shown = f"{len(set(ranks))} of {trace.world_size}" if ranks else f"{trace.world_size}"
    print(f"wrote {args.perfetto}: {shown} ranks, {stats['nodes']} nodes, "
          f"{stats['flows']} sync flows{skipped}{note}")
    return 0
