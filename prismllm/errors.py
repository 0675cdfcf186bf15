"""The errors a user sees as one clear line, and the exit codes of every `prism` command.

Every exception that reaches the command line ends as one line and one of :class:`ExitCode`
(``prismllm.cli.main``); an error of prism's own says which code by its class."""

from __future__ import annotations

import enum
import os


class ExitCode(enum.IntEnum):
    """What a `prism` command's exit status means, the same for every command.

    1 is what torchrun returns for a failed worker and what diff(1) returns for a difference:
    the run went through and its answer is "no". 2 stays argparse's own code for a command line
    it refuses, so a script sees one code for every mistake of its command line. Bad input
    files (3) and a machine that lacks something (4) are apart because they are fixed apart: the
    one by recording again, the other by installing or choosing another device. 5 is a bug of
    prismllm. Signals follow the shell's 128 + N."""

    OK = 0
    FAILED = 1  # the program failed: a rank crashed or ran out of memory; --check or compare found a difference
    USAGE = 2  # the command line: a flag, a value, or an output directory that cannot be used
    BAD_INPUT = 3  # an input file: a graph, tensor store, calibration or rules file missing, unreadable or invalid
    ENVIRONMENT = 4  # what the machine lacks: PyTorch, a GPU, a compiler; a file it cannot read or write
    INTERNAL = 5  # an unexpected error: a bug of prismllm (--debug shows the traceback)
    INTERRUPTED = 130  # Ctrl-C (SIGINT); another signal N ends a run with 128 + N


# The exit codes as every command's --help ends (and docs/exit-codes.md lists them).
EXIT_CODES_HELP = """\
exit status:
  0    done
  1    the program failed: a rank crashed or ran out of memory, or
       --check / compare found a difference
  2    usage: a flag, a value or an output directory that cannot be used
  3    bad input: a graph, tensor store, calibration or rules file that is
       missing, unreadable or invalid
  4    environment: PyTorch, a GPU or a compiler missing; a file that
       cannot be read or written
  5    internal error: a bug of prismllm (prism --debug shows the traceback)
  130  interrupted (Ctrl-C); 128 + N for another signal N
  Errors are one line on stderr; `prism --debug COMMAND` or PRISM_DEBUG=1 adds
  the traceback."""


class PrismError(Exception):
    """A problem with the user's input or program, reported as one clear message by the CLI;
    ``exit_code`` says which (a usage error unless a subclass says otherwise)."""

    exit_code: int = ExitCode.USAGE


class InputError(PrismError):
    """An input file (a graph, a tensor store, a calibration, a rules file) that is missing,
    unreadable or invalid; the message names the file and what is wrong in it."""

    exit_code = ExitCode.BAD_INPUT


class RequirementError(PrismError):
    """What this machine lacks or refuses the command: PyTorch, a GPU, a compiler; the space or
    the permission to write a file."""

    exit_code = ExitCode.ENVIRONMENT


class OutputBusy(PrismError):
    """Another live run writes the output directory (``prismllm.outdir``): a usage error (choose
    another --out, or wait)."""


class StorageError(RequirementError):
    """A write failed on a full disk or a failing file system. ``problem``: the path, what
    failed and the free space there; ``kept``: the output directory left incomplete, once the
    command writing it knows (``prismllm.outdir.writing``)."""

    def __init__(self, problem: str, kept: str | os.PathLike | None = None):
        self.problem = problem
        self.kept = kept
        super().__init__(
            problem
            if kept is None
            else f"{problem}; {kept} is left incomplete, earlier outputs are kept: make room (or repair the "
            f"file system) and run the command again"
        )
