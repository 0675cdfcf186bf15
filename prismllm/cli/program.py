"""The trailing `[--prefix] SCRIPT ARGS...` that every launching command (record, capture,
emulate) takes, declared and read in one place."""

from __future__ import annotations

import argparse
from typing import Any

from prismllm.cli.options import canonical_argv
from prismllm.launch import LineSink

LINE_PREFIX = "[rank{rank}]: "


def add_program_args(p: argparse.ArgumentParser, prefix: bool = True) -> None:
    """SCRIPT ARGS, and with ``prefix`` (commands that pass the program's output through) --prefix."""
    if prefix:
        p.add_argument(
            "--prefix",
            action="store_true",
            help="prefix each line of the processes' output with [rankN] (an assistant's: [assistant])",
        )
    p.add_argument("script", metavar="SCRIPT", help="the training program")
    p.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="arguments for SCRIPT (after --)")


def program_args(args: argparse.Namespace) -> list[str]:
    """SCRIPT's arguments without the separating ``--`` (also stored back on ``args``, which
    the manifest's command line is built from)."""
    script_args = list(args.script_args)
    if script_args[:1] == ["--"]:
        script_args = script_args[1:]
    args.script_args = script_args
    return script_args


def line_prefix(args: argparse.Namespace) -> str | None:
    return LINE_PREFIX if args.prefix else None


def graph_program_fields(args: argparse.Namespace, command: str, sink: LineSink) -> dict[str, Any]:
    """The options of a command that writes a graph (record, capture) that say how its program runs:
    SCRIPT's arguments, the line prefix and ``sink`` of its output, and ``prism COMMAND``'s own
    command line for the graph's manifest."""
    return {
        "args": program_args(args),  # first: the manifest's command line is read back from args
        "line_prefix": line_prefix(args),
        "argv": canonical_argv(args.parser, args, command),
        "sink": sink,
    }
