"""`prism`: the command-line entry point. Each subcommand lives in its own module exposing
``SUMMARY`` (its line in ``prism --help``), ``EXAMPLES`` (command lines that end its ``--help``),
``add_arguments(parser)`` and ``run(args) -> int``; its docstring is its ``--help`` description,
kept as written unless the module sets ``RAW_DESCRIPTION = False``. A module that sets
``RUNS_PROGRAM = True`` runs the user's program, so PyTorch must be there before it starts.

Whatever a command raises ends here as one line on stderr and an exit code of
:class:`prismllm.errors.ExitCode`; ``prism --debug COMMAND`` (or PRISM_DEBUG=1) prints the
traceback too."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
import traceback

import prismllm
from prismllm import __version__
from prismllm.childenv import user_setting
from prismllm.cli import options
from prismllm.errors import ExitCode, PrismError

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
    "example",
    "docs",
)

# Where `prism --help` sends someone who has just installed prismllm.
GETTING_STARTED = """\
# write gpt3d.py, a small Megatron-style GPT, and print the command that runs it at 32 ranks
prism example
# the documentation's pages, then the first one to read
prism docs
prism docs getting-started
# a command's flags and examples
prism run --help
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prism",
        allow_abbrev=False,
        description="Emulate large-scale LLM training faithfully on a few devices.",
        epilog=options.epilog(GETTING_STARTED),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"prismllm {__version__}")
    parser.add_argument(
        "--debug", action="store_true", help="on an error, print its traceback after the one line (also PRISM_DEBUG=1)"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in SUBCOMMANDS:
        module = importlib.import_module(f"prismllm.cli.{name}")
        p = options.command(
            sub,
            name.replace("_", "-"),
            module.SUMMARY,
            module.__doc__,
            raw=getattr(module, "RAW_DESCRIPTION", True),
            examples=getattr(module, "EXAMPLES", ""),
        )
        module.add_arguments(p)
        # ``parser``: what a command's manifest rebuilds its command line from (options.canonical_argv)
        p.set_defaults(run=module.run, parser=p, runs_program=getattr(module, "RUNS_PROGRAM", False))
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
    """Run one `prism` command and return its exit code (:class:`ExitCode`); every exception
    becomes one line on stderr, with its traceback under --debug."""
    argv = list(sys.argv[1:] if argv is None else argv)
    who, debug = "prism", user_setting("PRISM_DEBUG") == "1"
    try:
        parser = build_parser()
        args = _parse(parser, argv)
        who, debug = f"prism {args.command}", debug or args.debug
        if args.runs_program and not _has_torch():
            raise ModuleNotFoundError("No module named 'torch'", name="torch")  # one line, before any output
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        if debug:
            traceback.print_exc()
        print(f"{who}: interrupted", file=sys.stderr)
        return int(ExitCode.INTERRUPTED)
    except Exception as e:  # noqa: BLE001 - the one place every error becomes one line
        if debug:
            traceback.print_exc()
        message, code = describe(e)
        print(f"{who}: error: {message}", file=sys.stderr)
        return int(code)


def describe(e: Exception) -> tuple[str, int]:
    """The line that reports ``e`` and the exit code it ends the command with: prism's own
    errors as they say; a missing module, an operating-system error and anything else (a bug)
    in one line naming what failed."""
    if isinstance(e, PrismError):
        return str(e), e.exit_code
    if isinstance(e, ModuleNotFoundError):
        return _missing_module(e), ExitCode.ENVIRONMENT
    if isinstance(e, OSError) and e.filename is not None:
        return f"{e.filename}: {e.strerror or _first_line(e)}", ExitCode.ENVIRONMENT
    if isinstance(e, OSError | MemoryError):
        return f"{type(e).__name__}: {_first_line(e)}", ExitCode.ENVIRONMENT
    return (
        f"internal error: {type(e).__name__}: {_first_line(e)} (at {_where(e)}); a bug of prismllm: "
        "`prism --debug ...` shows the traceback",
        ExitCode.INTERNAL,
    )


def _has_torch() -> bool:
    """Whether torch can be imported, without importing it (an import takes seconds)."""
    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):  # hidden (sys.modules["torch"] = None), or a broken install
        return False


def _missing_module(e: ModuleNotFoundError) -> str:
    """torch is the user's own build, not a dependency of prismllm; any other module is."""
    if (e.name or "").split(".")[0] == "torch":
        return (
            f"prism needs PyTorch, which this Python ({sys.executable}) does not have: pip install torch "
            "(the build for your CUDA version, or the CPU one: https://pytorch.org/get-started/locally/)"
        )
    return f"the Python module {e.name!r} is missing: reinstall prismllm with its dependencies"


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    line = lines[0] if lines else "(no message)"
    return line if len(line) <= 300 else line[:297] + "..."


def _where(e: BaseException) -> str:
    """The innermost frame of prismllm's own code the exception went through: ``prismllm/trace/graph.py:68
    in world_size`` (the innermost frame of all when none is prismllm's)."""
    package = os.path.dirname(prismllm.__file__)
    frames = traceback.extract_tb(e.__traceback__)
    ours = [f for f in frames if f.filename.startswith(package + os.sep)]
    f = (ours or frames or [None])[-1]
    if f is None:
        return "an unknown place"
    name = os.path.relpath(f.filename, os.path.dirname(package)) if ours else f.filename
    return f"{name}:{f.lineno} in {f.name}"


if __name__ == "__main__":
    sys.exit(main())
