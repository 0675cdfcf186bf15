"""`prism time --graph BARE --out DIR [--devices ...] [--slice-size K] [--parallel P] [--json]
-- SCRIPT ARGS`: slice timing (prismllm.time).

Slice timing: the ranks of GRAPH run for real a slice at a time (each slice one sandbox run: its
ranks run the program, an assistant replays every other rank as fast as dependencies allow); DP
replicas of a solo capture with --layout are timed once. Writes DIR/graph, the timed graph (input of
`prism calibrate`); an interrupted run resumes where it stopped. With --devices cuda each slice
takes --slice-size sandbox GPUs and one assistant GPU.
"""

from __future__ import annotations

import argparse

from prismllm.cli import options
from prismllm.cli.program import add_program_args, program_args
from prismllm.cli.progress import Display
from prismllm.time import TimeOptions, time_slices

SUMMARY = "time every rank of a bare graph for real, a slice of ranks at a time"
EXAMPLES = r"""
# every captured rank timed for real, an assistant playing the other ranks
prism time --graph out/bare --out out/time \
    -- gpt3d.py --tp 2 --pp 8 --layers 8 --global-batch 128 --micro-batch 1
# four GPUs: two slices at once, each one sandbox GPU and one assistant GPU
prism time --graph out/bare --out out/time --devices cuda --parallel 2 \
    -- gpt3d.py --tp 2 --pp 8 --layers 8 --global-batch 128 --micro-batch 1
"""
RUNS_PROGRAM = True  # its processes import torch: cli.main checks for it before anything starts


def add_arguments(p: argparse.ArgumentParser) -> None:
    options.add(p, "graph", "out", required=("graph", "out"))
    options.add(p, "devices")
    p.add_argument("--slice-size", type=int, default=1, metavar="K", help="sandbox ranks per slice (default 1)")
    options.add(p, "parallel", "tensors", "inputs")
    p.add_argument("--every-rank", action="store_true", help="time DP replicas too, not only their representative")
    p.add_argument(
        "--compute-under-load",
        action="store_true",
        help="CPU: take the compute spans from a second pass in which every rank runs at once (each in "
        "its own slice), so each computes under the load the real run's ranks put on the host's "
        "shared cores; communication stays the first pass's (`prism docs time`)",
    )
    options.add(p, "head_start", "timeout", "force", "no_verify", "json")
    add_program_args(p, prefix=False)


def run(args: argparse.Namespace) -> int:
    opts = TimeOptions.from_fields(args, args=program_args(args))
    display = Display("time")
    display.stage("time", unit="slices")
    try:
        res = time_slices(
            opts,
            lambda done, total, ranks, s: display.update(done, total, f"last: ranks {','.join(map(str, ranks))}"),
            say=display.say,
        )
    finally:
        display.stop()
    display.say(
        f"{len(res.timed_ranks)} of {res.world_size} rank(s) timed in {len(res.slices)} slice(s)"
        + (f" ({res.resumed} done before)" if res.resumed else "")
        + f" in {res.wall_s:.1f} s; timed graph in {res.graph}"
    )
    if any(res.left_out_ns.values()):
        total = sum(res.left_out_ns.values())
        display.say(
            f"left out of the timed ranks' clocks: {total / 1e6:.1f} ms of the emulation layer's own host "
            f"time on their calls (CPU timing; `prism docs accuracy`)"
        )
    if args.json:
        options.print_json(options.result_fields(res))
    return 0
