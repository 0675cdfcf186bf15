"""`prism calibrate GRAPH --out CAL [--durations OTHER] [--force] [--json]`: solve a timed graph.

A discrete-event pass over the graph (program order per rank and stream, issue -> wait of
asynchronous ops, collectives and send/recv pairs starting when their last member arrives)
turns the measured durations into globally consistent start/end times for every node:
CAL/calibrated.parquet (node_id, rank, index, iteration, start_ns, end_ns, op_start_ns,
op_end_ns) and CAL/summary.json (predicted iteration times, the critical path of the median
steady iteration, busy/idle time per rank, the pipeline bubble); `prism docs calibrate`
defines them.

--durations OTHER: solve GRAPH's structure with OTHER's measured durations (a graph of the same
program and layout, e.g. re-recorded after a kernel change): same ranks, node count per rank
and op at every position, else an error naming the rank and first differing node.
"""

from __future__ import annotations

import argparse

from rich.console import Console

from prismllm.calibrate import TRANSFER_RULES, CalibrationError, calibrate, render
from prismllm.cli import options

SUMMARY = "solve a timed graph: consistent node times, iteration time, critical path, bubble"
EXAMPLES = r"""
# the pipeline's stage: solve a timed graph, and write the graph that prism emulate replays
prism calibrate out/time/graph --out out/cal --write-graph
# a real recording's own timeline: its critical path, bubble, busy and idle time per rank
prism calibrate out/real8 --out out/real8-cal
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "graph",
        metavar="GRAPH",
        help="a graph with measured durations: a timed graph (`prism time`: TIME/graph) or a recording (`prism record`)",
    )
    options.add(p, "out", required=("out",))
    p.add_argument(
        "--durations",
        metavar="OTHER",
        default=None,
        help="take the node durations from OTHER, a graph of the same structure",
    )
    p.add_argument(
        "--transfer",
        choices=TRANSFER_RULES,
        default="auto",
        help="transfer time of an instance: min (the smallest of its members' measured durations), "
        "slice (per slice the smallest, then the mean over the slices: timed graphs), last (the "
        "member that arrived last; needs one clock); auto (default): slice for a timed graph, "
        "else min",
    )
    p.add_argument(
        "--write-graph",
        action="store_true",
        help="also write CAL/graph: GRAPH with the solved times (a PrismTrace, mode calibrated)",
    )
    options.add(p, "warmup", "force", "no_validate", "no_verify", "json")


def run(args: argparse.Namespace) -> int:
    try:
        summary = calibrate(
            args.graph,
            args.out,
            durations=args.durations,
            rule=args.transfer,
            validate_graph=not args.no_validate,
            write_graph=args.write_graph,
            force=args.force,
            verify=args.verify,
            warmup=args.warmup,
        )
    except ValueError as e:  # a duration array the engine refuses: report it as one line
        raise CalibrationError(str(e)) from None
    if args.json:
        options.print_json(summary)
    else:
        render(summary, Console(), args.out)
    return 0
