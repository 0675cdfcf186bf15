"""The host time each sandbox rank leaves out of its clock, shared with the assistant: a CPU
emulation's virtual ranks keep the sandbox's clock, not the wall clock.

On the CPU the host clock is the device clock, and a sandbox rank leaves out of it what the
emulation layer spends on each call (``Recorder.exclude``; docs/commands/time.md, "Emulation
overhead on the CPU"), as the slices its prediction came from did. The real-time schedule of the
virtual ranks (``prismllm.assistant.clock.HostClock``) ran on the wall clock: each call's left-out
time came back as lateness of the sandbox's completions, and the virtual ranks, following them,
fell behind by as much every call (`make demo`'s schedule moved +5.2 ms an iteration, the emulated
sandbox 9.7 % over its prediction on the 2-core dev VM). The board is a small file the launcher
makes for a CPU emulation with real timing, run by one invocation: two int64 per sandbox rank (in
``ChildEnv.sandbox`` order), the time the Python layer and the native lane have left out so far,
each written only by that rank (an aligned 8-byte store, read whole); the assistant's host clock
takes their mean out of its own.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np

PARTS = 2  # per rank: the Python layer's (Recorder.exclude), the native lane's (its log's exclude)
PYTHON, LANE = 0, 1


class LeftOutBoard:
    """One file of ``PARTS`` int64 per sandbox rank, mapped into this process."""

    def __init__(self, path: str | os.PathLike):
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), 0)
        self.ns = np.frombuffer(self._map, dtype=np.int64).reshape(-1, PARTS)

    @staticmethod
    def create(path: str | os.PathLike, ranks: int) -> Path:
        """A board of zeros for ``ranks`` sandbox ranks."""
        path = Path(path)
        path.write_bytes(bytes(8 * PARTS * max(ranks, 1)))
        return path

    def set(self, k: int, part: int, ns: int) -> None:
        """Sandbox rank ``k`` (its place in ChildEnv.sandbox) has left ``ns`` out in all, by ``part``."""
        self.ns[k, part] = ns

    def address(self, k: int, part: int) -> int:
        """Where that value lies in this process's memory (the native lane stores it from C++)."""
        return int(self.ns.ctypes.data) + 8 * (k * PARTS + part)

    def mean_ns(self) -> int:
        """The time the sandbox ranks have left out of their clocks so far, their mean."""
        return int(self.ns.sum(axis=1).mean())


__all__ = ["LANE", "PYTHON", "LeftOutBoard"]
