"""Spinning inside labelled spans: ``prism whatif --spin LABEL=MS`` times the program with
every compute span named LABEL longer by MS ms of device work, so that the slices measure what
a longer span does to the iteration (its overlap with communication, the device's other
streams), which a re-solve of the calibration cannot see.

The spin starts where the program marks the span (``prismllm.mark(LABEL)`` or entering
``prismllm.span(LABEL)``): on a GPU a spin kernel on the current stream (``torch.cuda._sleep``,
its cycles per ms measured once per device), on the CPU a busy loop (the CPU is the device).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import torch

_PROBE_CYCLES = 50_000_000  # ~25 ms on a 2 GHz GPU: long enough to measure the clock to < 0.1 %


def parse_spins(text: str) -> dict[str, float]:
    """``{label: ms}`` from the JSON a child gets (``ChildEnv.spin``)."""
    spins = json.loads(text)
    return {str(k): float(v) for k, v in spins.items()}


def _cycles_per_ms(device: int) -> float:
    with torch.cuda.device(device):
        torch.cuda._sleep(1_000_000)  # the kernel's first launch loads it
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(_PROBE_CYCLES)
        end.record()
        end.synchronize()
        return _PROBE_CYCLES / start.elapsed_time(end)


class Spinner:
    """Keeps the rank's device busy for a given time, where the program stands."""

    def __init__(self) -> None:
        self._rates: dict[int, float] = {}

    def __call__(self, ms: float) -> None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            dev = torch.cuda.current_device()
            if dev not in self._rates:
                self._rates[dev] = _cycles_per_ms(dev)
            torch.cuda._sleep(round(ms * self._rates[dev]))
            return
        end = time.perf_counter_ns() + round(ms * 1e6)
        while time.perf_counter_ns() < end:
            pass


def install(rec: Any, spins: dict[str, float]) -> None:
    """Make ``rec.mark(label)`` spin ``spins[label]`` ms after marking (the spin is the new span's)."""
    mark: Callable[[str], None] = rec.mark
    spin = Spinner()

    def mark_and_spin(label: str) -> None:
        mark(label)
        ms = spins.get(label)
        if ms:
            spin(ms)

    rec.mark = mark_and_spin


__all__ = ["Spinner", "install", "parse_spins"]
