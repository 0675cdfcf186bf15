"""`prism capture`: the bare graph of an N-rank job, from a few ranks run alone.

    prism capture --mode solo --world N --devices G --out DIR
                  [--layout tp=..,pp=..,ep=..,cp=..,order=tp-cp-ep-dp-pp] [--device cpu|cuda]
                  [--rules FILE] [--tensors STORE] [--timeout S] [--force] [--tee] [--prefix]
                  -- SCRIPT ARGS...
"""

from __future__ import annotations

import argparse
import sys

from prismllm.capture.launcher import LaunchInterrupted
from prismllm.capture.solo import CaptureOptions, CapturePlan, CaptureResult, capture
from prismllm.cli.program import add_program_args, line_prefix, program_args


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "capture",
        help="capture the execution graph of an N-rank job from a few ranks run alone",
        description=(
            "Run SCRIPT as ranks of a world of N, each rank alone (solo mode: collectives are "
            "answered by the tensor generator or a tensor store), G ranks at a time, and write the "
            "N-rank execution graph (PrismTrace) to DIR. With --layout only one rank per class of "
            "replicas runs (one per (tp, cp, ep, pp) coordinate); the DP replicas are renamed "
            "copies. An interrupted or failed capture resumes when the same command is run again."
        ),
    )
    p.add_argument("--mode", default="solo", choices=["solo"], help="capture mode (solo)")
    p.add_argument("--world", "--world-size", dest="world", type=int, required=True, metavar="N",
                   help="logical world size")
    p.add_argument("--devices", default="1", metavar="G",
                   help="ranks run at a time (processes on cpu, one GPU each on cuda), or cuda:0,1,...")
    p.add_argument("--device", default=None, metavar="cpu|cuda",
                   help="default: cuda if G GPUs are available, else cpu")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory for the graph")
    p.add_argument("--layout", default=None, metavar="K=V,...",
                   help="parallel layout, e.g. tp=2,pp=8,ep=4 (order=tp-cp-ep-dp-pp, tp fastest); "
                        "without it every rank runs")
    p.add_argument("--rules", default=None, metavar="FILE", help="tensor-generator rules (PRISM_RULES)")
    p.add_argument("--tensors", default=None, metavar="STORE",
                   help="tensors recorded in an earlier run (PRISM_TENSOR_STORE)")
    p.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="end a batch of G ranks after S seconds, naming the ranks still running")
    p.add_argument("--force", action="store_true",
                   help="replace DIR if it holds a graph or an unfinished capture")
    p.add_argument("--tee", action="store_true",
                   help="also write each rank's stdout/stderr to DIR/logs/rank-NNNNNN.{stdout,stderr}.log")
    add_program_args(p)
    p.set_defaults(run=run)
    return p


def _argv(args: argparse.Namespace) -> list[str]:
    argv = ["prism", "capture", "--mode", args.mode, "--world", str(args.world), "--devices", str(args.devices),
            "--out", str(args.out)]
    for flag, value in (("--device", args.device), ("--layout", args.layout), ("--rules", args.rules),
                        ("--tensors", args.tensors)):
        if value is not None:
            argv += [flag, str(value)]
    if args.timeout is not None:
        argv += ["--timeout", f"{args.timeout:g}"]
    argv += [f for f, on in (("--force", args.force), ("--tee", args.tee), ("--prefix", args.prefix)) if on]
    return argv + ["--", args.script, *args.script_args]


def _fmt_s(s: float) -> str:
    if s < 60:
        return f"{s:.0f} s"
    if s < 3600:
        return f"{s // 60:.0f} min {s % 60:02.0f} s"
    return f"{s // 3600:.0f} h {s % 3600 // 60:02.0f} min"


class _Progress:
    """Ranks done / total, rate and ETA: a rich bar on a terminal, one line per batch elsewhere."""

    def __init__(self) -> None:
        self.tty = sys.stdout.isatty() and sys.stderr.isatty()
        self.console = None
        self.bar = None
        self.task = None
        self.sink = None
        if self.tty:
            from rich.console import Console
            from rich.text import Text

            self.console = Console(stderr=True)

            def sink(rank: int, stream: str, line: str) -> None:
                self.console.print(Text.from_ansi(line.rstrip("\n")), soft_wrap=True, highlight=False)

            self.sink = sink

    def plan(self, plan: CapturePlan) -> None:
        rp = plan.replicas
        lines = [
            f"world {plan.world}, {plan.parallel} at a time on {plan.device}",
            rp.describe(),
        ]
        if plan.resuming:
            lines.append(f"resuming: {len(plan.resumed)} rank(s) already captured, {len(plan.pending)} to run")
        for line in lines:
            if self.console is not None:
                self.console.print(f"prism capture: {line}", highlight=False)
            else:
                print(f"prism capture: {line}", file=sys.stderr, flush=True)
        total = len(rp.representatives)
        if self.console is not None:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                       TimeElapsedColumn, TimeRemainingColumn)

            self.bar = Progress(TextColumn("[bold]ranks"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TextColumn("ETA"),
                                TimeRemainingColumn(), console=self.console, transient=True)
            self.bar.start()
            self.task = self.bar.add_task("capture", total=total, completed=len(plan.resumed), rate="")

    def update(self, done: int, total: int, ran: int, elapsed: float) -> None:
        rate = ran / elapsed if elapsed > 0 and ran else 0.0
        eta = (total - done) / rate if rate else None
        rate_s = f"{rate:.2f} ranks/s" if rate else ""
        if self.bar is not None:
            self.bar.update(self.task, completed=done, rate=rate_s)
        elif ran or done == total:
            eta_s = f", ETA {_fmt_s(eta)}" if eta is not None and done < total else ""
            print(f"prism capture: {done}/{total} ranks done ({rate_s or 'n/a'}{eta_s})", file=sys.stderr, flush=True)

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


def _summary(res: CaptureResult) -> None:
    from rich.console import Console
    from rich.table import Table

    def fmt(v):
        return "?" if v is None else f"{v:,}"

    table = Table(show_header=False, box=None, padding=(0, 1))
    table.add_column(style="bold")
    table.add_column()
    table.add_row("ranks", f"{res.world_size} ({res.device})")
    reps = len(res.representatives)
    run = f"{res.ranks_run} run now" + (f", {res.ranks_resumed} from an earlier run" if res.ranks_resumed else "")
    table.add_row("representatives", f"{reps} ({run})" if res.dedup else f"all {reps}, no dedup ({run})")
    table.add_row("iterations", fmt(res.iterations))
    table.add_row("nodes", fmt(res.nodes))
    table.add_row("output", str(res.out))
    t = res.timings
    table.add_row("wall time", f"{res.wall_s:.1f} s (run {t['run_s']:.1f} s, assemble {t['assemble_s']:.1f} s, "
                               f"validate {t['validate_s']:.1f} s, save {t['save_s']:.1f} s)")
    console = Console()
    console.print("[green]captured[/green]")
    console.print(table)


def run(args: argparse.Namespace) -> int:
    script_args = program_args(args)
    progress = _Progress()
    opts = CaptureOptions(
        world=args.world,
        out=args.out,
        script=args.script,
        args=script_args,
        devices=args.devices,
        device=args.device,
        layout=args.layout,
        rules=args.rules,
        tensors=args.tensors,
        force=args.force,
        timeout=args.timeout,
        tee=args.tee,
        line_prefix=line_prefix(args),
        argv=_argv(args),
        sink=progress.sink,
        mode=args.mode,
    )
    try:
        res = capture(opts, on_plan=progress.plan, on_progress=progress.update)
    except LaunchInterrupted as e:
        progress.stop()
        print(f"prism capture: {e}; re-run the same command to resume", file=sys.stderr)
        return 128 + e.signum
    finally:
        progress.stop()
    _summary(res)
    return 0
