"""Spinning inside labelled spans: ``prism whatif --spin LABEL=MS`` times the program with
every compute span named LABEL longer by MS ms of device work, so that the slices measure what
a longer span does to the iteration (its overlap with communication, the device's other
streams), which a re-solve of the calibration cannot see. ``examples/gpt3d.py --spin`` uses the
same :class:`Spinner` for the real run that such a what-if is checked against.

The spin starts where the program marks the span (``prismllm.mark(LABEL)`` or entering
``prismllm.span(LABEL)``):

* on a GPU, a one-thread kernel on the current stream that runs until the GPU's global timer
  (``%globaltimer``, nanoseconds) has advanced by MS ms. A count of SM clock cycles
  (``torch.cuda._sleep``) is not a duration: the clock it was measured at is not the clock of
  a busy GPU (an H100 ran such spins 7 % short of plan). The kernel is compiled once per device
  with NVRTC (``torch.cuda._compile_kernel``); where that cannot be done the spin fails with
  the reason, rather than spinning for some other time;
* on the CPU (processes stand in for devices), the span's process spins MS ms on the clock,
  yielding its core at every turn (``sched_yield``) to any other runnable thread. A plain busy
  loop would take a core from the other ranks' threads on a machine with fewer cores than
  threads (on 2 cores it slowed gloo's threads so that 400 ms spun cost 430-460 ms); a sleep
  lets the core go idle, and the work after it ran ~1 ms slower a wake-up on the 2-core VM.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from prismllm.errors import PrismError

_KERNEL = r"""
extern "C" __global__ void prism_spin(double ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while ((double)(now - start) < ns);
}
"""


def parse_spins(text: str) -> dict[str, float]:
    """``{label: ms}`` from the JSON a child gets (``ChildEnv.spin``)."""
    spins = json.loads(text)
    return {str(k): float(v) for k, v in spins.items()}


def compile_kernel(source: str, name: str, device: int, what: str) -> Callable[..., None]:
    """A CUDA kernel built with NVRTC for ``device`` (``torch.cuda._compile_kernel``); called as
    ``kernel(grid=, block=, args=[tensors as pointers, ints as C int, floats as C double])`` on
    the current stream. ``what`` names the feature that needs it in the error."""
    try:
        with torch.cuda.device(device):
            return torch.cuda._compile_kernel(source, name)
    except Exception as e:  # NVRTC missing, or a torch without _compile_kernel
        raise PrismError(
            f"cannot build the GPU kernel {name} on cuda:{device} ({type(e).__name__}: {e}); "
            f"{what} needs torch.cuda._compile_kernel and NVRTC (torch >= 2.8 with CUDA)"
        ) from None


def _compile(device: int) -> Callable[..., None]:
    return compile_kernel(_KERNEL, "prism_spin", device, "--spin")


def wait_cpu(ns: int) -> None:
    """Return ``ns`` nanoseconds from now, yielding the core to other runnable threads meanwhile."""
    end = time.perf_counter_ns() + ns
    while time.perf_counter_ns() < end:
        os.sched_yield()


class Spinner:
    """Keeps the rank's device busy for a given time, where the program stands."""

    def __init__(self) -> None:
        self._kernels: dict[int, Callable[..., None]] = {}

    def __call__(self, ms: float) -> None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            dev = torch.cuda.current_device()
            if dev not in self._kernels:
                self._kernels[dev] = _compile(dev)
            self._kernels[dev](grid=(1, 1, 1), block=(1, 1, 1), args=[float(ms) * 1e6])
            return
        wait_cpu(round(ms * 1e6))


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


__all__ = ["Spinner", "compile_kernel", "install", "parse_spins", "wait_cpu"]
