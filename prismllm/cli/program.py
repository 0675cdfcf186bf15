"""The trailing `[--prefix] SCRIPT ARGS...` that every launching command (record, capture,
emulate) takes, declared and read in one place."""

from __future__ import annotations

import argparse

LINE_PREFIX = "[rank{rank}]: "


def add_program_args(p: argparse.ArgumentParser,
                     prefix_help: str = "prefix each line of the program's output with [rankN]") -> None:
    p.add_argument("--prefix", action="store_true", help=prefix_help)
    p.add_argument("script", metavar="SCRIPT", help="the training program")
    p.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS",
                   help="arguments for SCRIPT (after --)")


def program_args(args: argparse.Namespace) -> list[str]:
    """SCRIPT's arguments without the separating ``--`` (also stored back on ``args``, which
    the manifest's command line is built from)."""
    script_args = list(args.script_args)
    if script_args[:1] == ["--"]:
        script_args = script_args[1:]
    args.script_args = script_args
    return script_args


def devices_arg(value: str) -> str:
    """--devices of the commands that run sandbox ranks and assistants: cpu, cuda, or
    cuda:G,G,... (their GPUs in order; one listed twice is shared)."""
    v = value.strip().lower()
    if v in ("cpu", "cuda"):
        return v
    if v.startswith("cuda:"):
        items = v[5:].split(",")
        if items and all(x.strip().isdigit() for x in items):
            return "cuda:" + ",".join(x.strip() for x in items)
    raise argparse.ArgumentTypeError(f"{value!r}: expected cpu, cuda or cuda:G,G,... (GPU indices)")


def line_prefix(args: argparse.Namespace) -> str | None:
    return LINE_PREFIX if args.prefix else None
