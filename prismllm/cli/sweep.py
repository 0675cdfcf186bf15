"""`prism sweep`: which configuration is fastest without running out of memory.

    prism sweep --world N [--layout 'tp={tp},pp=2'] --grid KEY=V1,V2 [--grid ...] [--memory-only]
                --out DIR [run flags] -- SCRIPT ARGS...

Runs `prism run` (capture, time, calibrate; with --sandbox also emulate) for every point of the
grid, one after the other, and prints one table: per point its predicted iteration time and its
peak memory per rank (the largest, on which rank and where in the layout, and the least), a
point that runs out of memory marked at the rank that did. DIR/sweep.html holds the same table,
each point linking its report; DIR/sweep.json the figures; DIR/points/ one run per point.

A key K whose {K} appears in ARGS, --layout or --sandbox is filled in there; any other key is
the program flag --K V (V = on: the bare flag; off: nothing); the key `world` sets --world.
Values are separated by commas, or by | when a value holds a comma. --memory-only stops each
point after the capture (peak memory per rank, no iteration time). Run the same command again
to go on where a sweep stopped. `prism docs sweep` has the long form.
"""

from __future__ import annotations

import argparse
import sys

from rich.console import Console

from prismllm.cli import options
from prismllm.cli.program import add_program_args, program_args
from prismllm.cli.progress import Display, fmt_seconds
from prismllm.cli.run import PIPELINE_FLAGS, UI
from prismllm.errors import ExitCode
from prismllm.launch import LaunchInterrupted
from prismllm.pipeline.sweep import Point, SweepOptions, parse_grid, run_sweep
from prismllm.report.html import fmt_bytes, fmt_ns
from prismllm.report.sweep import best_point
from prismllm.terminal import Table

SUMMARY = "run the pipeline for every point of a grid of configurations: time and memory per point"
EXAMPLES = r"""
# micro-batch size and recompute: which point is fastest without running out of memory
prism sweep --world 64 --layout tp=2,pp=4 --grid micro-batch=1,2,4 --grid recompute=off,on \
    --out out/sweep -- gpt3d.py --tp 2 --pp 4 --global-batch 64
# {pp} filled in the layout and the program's flags; peak memory only (capture, no timing)
prism sweep --world 64 --layout 'tp=2,pp={pp}' --grid pp=2,4 --memory-only --out out/mem \
    -- gpt3d.py --tp 2 --pp {pp} --global-batch 64
"""
RUNS_PROGRAM = True  # its processes import torch: cli.main checks for it before anything starts


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--grid",
        action="append",
        default=[],
        type=parse_grid,
        metavar="KEY=V1,V2",
        required=True,
        help="a dimension of the grid (repeatable; the first varies slowest)",
    )
    p.add_argument(
        "--memory-only",
        action="store_true",
        help="capture only: peak memory per rank, no time or calibrate (no iteration time)",
    )
    options.add(p, "world", "out", required=("out",))
    options.add(p, *PIPELINE_FLAGS)
    add_program_args(p, prefix=False)


def render(state: dict, console: Console) -> None:
    keys = [k for k, _ in state["grid"]]
    best = best_point(state["points"])
    t = Table(title=f"sweep of {state['script']}: {len(state['points'])} point(s)", title_justify="left")
    for k in keys:
        t.add_column(k)
    t.add_column("status")
    emulated = any(p.get("emulated_iteration_ns") is not None for p in state["points"])
    if not state.get("memory_only"):
        t.add_column("iteration", justify="right")
    if emulated:
        t.add_column("emulated (rank)", justify="right")
    t.add_column("peak memory", justify="right")
    t.add_column("on rank")
    for p in state["points"]:
        status = p["status"]
        if status == "out_of_memory":
            status = "[red]OOM" + (f" rank {p['oom_rank']}" if p.get("oom_rank") is not None else "") + "[/]"
        elif status == "failed":
            status = "[red]failed[/]"
        cells = [str(p["values"][k]) for k in keys] + [status]
        if not state.get("memory_only"):
            star = " *" if p["point"] == best else ""
            cells.append(fmt_ns(p.get("predicted_iteration_ns")) + star)
        if emulated:
            r = p.get("emulated_rank")
            cells.append(fmt_ns(p.get("emulated_iteration_ns")) + (f" ({r})" if r is not None else ""))
        peak = p.get("peak_memory_bytes")
        cells += [fmt_bytes(peak), p.get("peak_memory_at") or "–"]
        t.add_row(*cells)
    if best is not None:
        t.caption = "* the fastest point that ran"
    console.print(t)
    for p in state["points"]:
        if p["status"] != "ok":
            console.print(f"point {p['point']} ({', '.join(f'{k}={v}' for k, v in p['values'].items())}): {p['error']}")
    console.print(f"wall time {fmt_seconds(state.get('wall_s') or 0)}; table: {state['report']}", highlight=False)


def run(args: argparse.Namespace) -> int:
    display = Display("sweep")
    opts = SweepOptions.from_fields(args, args=program_args(args))

    def on_point(p: Point, total: int) -> None:
        display.say(f"point {p.number + 1}/{total}: {p.name}")

    try:
        state = run_sweep(opts, UI(display), on_point)
    except LaunchInterrupted as e:
        display.stop()
        display.say(f"{e}; run the same command again to go on where it stopped")
        return e.exit_code
    finally:
        display.stop()
    if args.json:
        options.print_json(state)
    else:
        render(state, Console(file=sys.stdout))
    return 0 if all(p["status"] != "failed" for p in state["points"]) else ExitCode.FAILED
