"""`prism record`: run a training program like torchrun and record its execution graph.

    prism record --nproc 8 --out out/tp2pp2 [--devices cpu|cuda] [--layout tp=2,pp=2]
                 [--save-tensors SELECTOR [--tensor-store DIR]] [--recorder auto|native|python] [--timeout S] [--force] [--tee] [--prefix] -- SCRIPT ARGS...
"""

from __future__ import annotations

import argparse
import os
import sys

from prismllm.capture.launcher import LaunchInterrupted
from prismllm.capture.record import RECORDERS, RecordOptions, RecordResult, record
from prismllm.cli.program import add_program_args, line_prefix, program_args


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "record",
        help="run a program like torchrun and record its execution graph",
        description=(
            "Run SCRIPT on N rank processes, as torchrun would (RANK, LOCAL_RANK, WORLD_SIZE, "
            "MASTER_ADDR/PORT, ...), with its process groups recorded, and write the execution "
            "graph (PrismTrace) to DIR. If any rank fails, the others are ended and the first "
            "failure is reported."
        ),
    )
    p.add_argument("--nproc", "--nproc-per-node", "--nproc_per_node", dest="nproc", type=int,
                   required=True, metavar="N", help="number of rank processes")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory for the trace")
    p.add_argument("--devices", default=None, metavar="cpu|cuda",
                   help="cpu (one process per rank) or cuda / cuda:0,1,... (one GPU per rank; a GPU "
                        "listed twice is shared, its ranks each NCCL's own host: right values and memory, "
                        "not NVLink timing); default: cuda if there are at least N GPUs, else cpu")
    p.add_argument("--layout", default=None, metavar="K=V,...",
                   help="parallel layout recorded in the manifest, e.g. tp=2,pp=2,dp=2")
    p.add_argument("--save-tensors", default=None, metavar="SELECTOR",
                   help="save the outputs of the selected collectives for solo capture to replay "
                        "(`prism capture --tensors`): all, op names (all_to_all,recv,...) and/or "
                        "label:<label>")
    p.add_argument("--tensor-store", default=None, metavar="DIR",
                   help="where --save-tensors writes (default: DIR/tensors)")
    p.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="end the run after S seconds, naming the ranks still running")
    p.add_argument("--force", action="store_true",
                   help="replace DIR if it already holds a trace")
    p.add_argument("--recorder", choices=RECORDERS,
                   default={"0": "python", "1": "native"}.get(os.environ.get("PRISM_NATIVE", ""), "auto"),
                   help="native: the C++ recording backend (built once per torch version; the least "
                        "host time a call); python: the Python path; auto (default; PRISM_NATIVE=1/0 "
                        "picks native/python): native, or the Python path with a warning if it cannot "
                        "be built. --save-tensors always records through the Python path")
    p.add_argument("--tee", action="store_true",
                   help="also write each rank's stdout/stderr to DIR/logs/rank-NNNNNN.{stdout,stderr}.log")
    add_program_args(p)
    p.set_defaults(run=run)
    return p


def _argv(args: argparse.Namespace) -> list[str]:
    """prism's own command line, canonical form, for the manifest."""
    argv = ["prism", "record", "--nproc", str(args.nproc), "--out", str(args.out)]
    for flag, value in (("--devices", args.devices), ("--layout", args.layout),
                        ("--save-tensors", args.save_tensors), ("--tensor-store", args.tensor_store)):
        if value is not None:
            argv += [flag, str(value)]
    if args.timeout is not None:
        argv += ["--timeout", f"{args.timeout:g}"]
    if args.recorder != "auto":
        argv += ["--recorder", args.recorder]
    argv += [f for f, on in (("--force", args.force), ("--tee", args.tee), ("--prefix", args.prefix)) if on]
    return argv + ["--", args.script, *args.script_args]


def _live_output():
    """On a terminal: a rich console with a spinner, and a sink printing the program's lines
    above it. Elsewhere (pipes, files, CI): plain pass-through and no spinner."""
    if not (sys.stdout.isatty() and sys.stderr.isatty()):
        return None, None
    from rich.console import Console
    from rich.text import Text

    console = Console(stderr=True)

    def sink(rank: int, stream: str, line: str) -> None:
        console.print(Text.from_ansi(line.rstrip("\n")), soft_wrap=True, highlight=False)

    return console, sink


def _summary(res: RecordResult) -> None:
    from rich.console import Console
    from rich.table import Table

    def fmt(v):
        return "?" if v is None else f"{v:,}"

    table = Table(show_header=False, box=None, padding=(0, 1))
    table.add_column(style="bold")
    table.add_column()
    table.add_row("ranks", f"{res.world_size} ({res.device})")
    table.add_row("iterations", fmt(res.iterations))
    table.add_row("nodes", fmt(res.nodes))
    table.add_row("recorder", res.manifest.get("recorder", "?"))
    table.add_row("output", str(res.out))
    table.add_row("wall time", f"{res.wall_s:.1f} s")
    console = Console()
    console.print("[green]recorded[/green]")
    console.print(table)


def run(args: argparse.Namespace) -> int:
    script_args = program_args(args)
    console, sink = _live_output()
    status = None

    def on_start(device: str, nproc: int) -> None:
        nonlocal status
        text = f"recording {nproc} rank{'s' if nproc != 1 else ''} on {device}…"
        if console is not None:
            status = console.status(text)
            status.start()
        else:
            print(f"prism record: {text}", file=sys.stderr, flush=True)

    opts = RecordOptions(
        nproc=args.nproc,
        out=args.out,
        script=args.script,
        args=script_args,
        devices=args.devices,
        layout=args.layout,
        timeout=args.timeout,
        force=args.force,
        tee=args.tee,
        line_prefix=line_prefix(args),
        argv=_argv(args),
        save_tensors=args.save_tensors,
        tensor_store=args.tensor_store,
        recorder=args.recorder,
        sink=sink,
    )
    try:
        res = record(opts, on_start=on_start)
    except LaunchInterrupted as e:
        if status is not None:
            status.stop()
        print(f"prism record: {e}", file=sys.stderr)
        return 128 + e.signum
    finally:
        if status is not None:
            status.stop()
    _summary(res)
    return 0
