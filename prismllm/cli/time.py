"""`prism time --graph BARE --out DIR [--devices cpu|cuda] [--slice-size K] [--parallel P]
-- SCRIPT ARGS`: slice timing (prismllm.time)."""

from __future__ import annotations

import argparse
import sys

from prismllm.cli.program import add_program_args, devices_arg, program_args
from prismllm.time import TimeOptions, time_slices


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "time",
        help="time every rank of a bare graph for real, a slice of ranks at a time",
        description=(
            "Slice timing: the ranks of BARE run for real a slice at a time (each slice one "
            "`prism emulate`: its ranks are the sandbox, an assistant replays every other rank as "
            "fast as dependencies allow); DP replicas of a solo capture with --layout are timed "
            "once. Writes DIR/graph, the timed graph (input of `prism calibrate`); an interrupted "
            "run resumes where it stopped."
        ),
    )
    p.add_argument("--graph", required=True, metavar="BARE", help="the bare graph")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory")
    p.add_argument("--devices", type=devices_arg, default="cpu", metavar="cpu|cuda|cuda:G,...",
                   help="cpu, or cuda: each slice takes --slice-size sandbox GPUs and one assistant GPU; "
                        "or cuda:G,G,... the GPUs of one slice (sandbox ranks, then the assistant), a GPU "
                        "listed twice being shared (right values, not the timing of linked GPUs)")
    p.add_argument("--slice-size", type=int, default=1, metavar="K", help="sandbox ranks per slice (default 1)")
    p.add_argument("--parallel", type=int, default=1, metavar="P", help="slices at a time (default 1)")
    p.add_argument("--tensors", default=None, metavar="STORE", help="the virtual ranks' recorded inputs "
                   "(default BARE/tensors)")
    p.add_argument("--inputs", choices=["recorded", "generated"], default="recorded",
                   help="the virtual ranks' inputs: recorded, or generated (zeros; not for MoE routing)")
    p.add_argument("--every-rank", action="store_true", help="time DP replicas too, not only their representative")
    p.add_argument("--compute-under-load", action="store_true",
                   help="CPU: take the compute spans from a second pass in which every rank runs at once (each in "
                        "its own slice), so each computes under the load the real run's ranks put on the host's "
                        "shared cores; communication stays the first pass's (docs/time.md)")
    p.add_argument("--timeout", type=float, default=None, metavar="S", help="limit per slice, in seconds")
    p.add_argument("--force", action="store_true", help="start over in DIR")
    add_program_args(p)
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    opts = TimeOptions(
        graph=args.graph, out=args.out, script=args.script, args=program_args(args), devices=args.devices,
        slice_size=args.slice_size, parallel=args.parallel, tensors=args.tensors, inputs=args.inputs,
        every_rank=args.every_rank, timeout=args.timeout, force=args.force,
        compute_under_load=args.compute_under_load,
    )
    with Progress(TextColumn("[bold]prism time[/]"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.description}"), TimeElapsedColumn(), transient=True) as bar:
        task = bar.add_task("slices", total=None)

        def progress(done: int, total: int, ranks: list[int], seconds: float) -> None:
            bar.update(task, completed=done, total=total,
                       description=f"last: ranks {','.join(map(str, ranks))} in {seconds:.1f} s")
        res = time_slices(opts, progress, say=lambda line: bar.console.print(f"prism time: {line}", highlight=False,
                                                                           markup=False, soft_wrap=True))
    print(f"prism time: {len(res.timed_ranks)} of {res.world_size} rank(s) timed in {len(res.slices)} slice(s)"
          + (f" ({res.resumed} done before)" if res.resumed else "")
          + f" in {res.wall_s:.1f} s; timed graph in {res.graph}", file=sys.stderr)
    if any(res.left_out_ns.values()):
        total = sum(res.left_out_ns.values())
        print(f"prism time: left out of the timed ranks' clocks: {total / 1e6:.1f} ms of the emulation layer's own "
              f"host time on their calls (CPU timing; docs/time.md, \"Emulation overhead\")", file=sys.stderr)
    return 0
