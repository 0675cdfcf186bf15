"""`prism`: the command-line entry point. Each subcommand lives in its own module exposing
``add_parser(subparsers)`` and ``run(args) -> int``."""

from __future__ import annotations

import argparse
import importlib
import sys

from prismllm import __version__
from prismllm.errors import PrismError

SUBCOMMANDS = ("run", "record", "capture", "time", "calibrate", "emulate", "report", "show", "export", "compare")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prism",
        allow_abbrev=False,
        description="Emulate large-scale LLM training faithfully on a few devices.",
    )
    parser.add_argument("--version", action="version", version=f"prismllm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in SUBCOMMANDS:
        module = importlib.import_module(f"prismllm.cli.{name}")
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except PrismError as e:
        print(f"prism {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"prism {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
