"""`prism`: the command-line entry point. Each subcommand lives in its own module exposing
``SUMMARY`` (its line in ``prism --help``), ``add_arguments(parser)`` and ``run(args) -> int``; its
docstring is its ``--help`` description, kept as written unless the module sets
``RAW_DESCRIPTION = False``."""

from __future__ import annotations

import argparse
import importlib
import sys

from prismllm import __version__
from prismllm.cli import options
from prismllm.errors import PrismError

SUBCOMMANDS = (
    "run",
    "record",
    "capture",
    "time",
    "calibrate",
    "emulate",
    "report",
    "show",
    "export",
    "compare",
    "whatif",
    "sweep",
    "moe_stats",
)


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
        p = options.command(
            sub, name.replace("_", "-"), module.SUMMARY, module.__doc__, raw=getattr(module, "RAW_DESCRIPTION", True)
        )
        module.add_arguments(p)
        # ``parser``: what a command's manifest rebuilds its command line from (options.canonical_argv)
        p.set_defaults(run=module.run, parser=p)
    return parser


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parse ARGV; for a command whose module sets ``PROGRAM_AFTER_DASHES`` (a positional of its
    own, then an optional ``-- SCRIPT ARGS``), what follows ``--`` is ``args.program``: argparse
    cannot give a later positional what follows ``--`` once an earlier one has matched."""
    name = argv[0].replace("-", "_") if argv else ""
    if name in SUBCOMMANDS and "--" in argv:
        module = importlib.import_module(f"prismllm.cli.{name}")
        if getattr(module, "PROGRAM_AFTER_DASHES", False):
            i = argv.index("--")
            args = parser.parse_args(argv[:i])
            args.program = argv[i + 1 :]
            return args
    args = parser.parse_args(argv)
    return args


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = _parse(parser, list(sys.argv[1:] if argv is None else argv))
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
