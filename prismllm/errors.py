"""The exceptions a user sees: a clear message, no traceback."""

from __future__ import annotations

import os


class PrismError(Exception):
    """A problem with the user's input or program, reported as one clear message by the CLI."""


class OutputBusy(PrismError):
    """Another live run writes the output directory (``prismllm.outdir``)."""


class StorageError(PrismError):
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
