"""The host's head start (``prism time`` on GPUs, ``ChildEnv.head_start``): a slice measures what
its device does, not how fast the sandbox's host feeds it.

A slice's compute span is the device time between two of the rank's points (CUDA events). When
the host falls behind its device, the device waits for the next kernel inside the span, and the
span holds that wait. The sandbox's host is not the real run's: the emulation layer's host work
on every pruned call, and a host that runs slower from one run (or one machine) to the next,
made the same DDP slice on four H100s measure 37.5 or 47.2 ms where the real job runs 36.2 ms.

So after each point where the program's host waited for its device (``torch.cuda.synchronize``,
``Tensor.item``/``tolist``/``__float__``/``__int__``/``__bool__``, a copy between the GPU and the
host, an Event's or a Stream's ``synchronize``), the device sleeps (``torch.cuda._sleep``)
before the program's next kernel, between two events of the recorder's own, and the sleep is
left out of the rank's device timeline (:class:`DeviceHoles`): every later device time moves
earlier by the sleeps before it. The host runs that far ahead of its device. How far
(``ChildEnv.head_start``): the emulation layer's host time from this wait to the host's next, as
the last iteration spent it from its wait of the same place ("overhead": the real run's host is
that much farther ahead, and the program's own host pace stays in the spans), or about the last iteration's device time ("iteration": the spans hold the device's own
work), at most :data:`MAX_NS` either way. A rank whose host falls behind its device even so
shows its host's pace, and the recorder counts the points where its device had caught up with
its host (``host_behind``), which ``prism time`` reports.

Nothing of this runs before the program's second iteration ended (the first is its warm-up, the
second sizes the head start).
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable
from typing import Any

import torch

MIN_NS = 1_000_000
MAX_NS = 500_000_000  # a host that falls behind its device by more within one iteration is host-bound
# a point whose event ran less than this after the host recorded it: the device had caught up
# (the anchor maps device times onto the host clock to ~0.2 ms)
BEHIND_NS = 300_000


class DeviceHoles:
    """The sleeps of one device, as [start, end) on its timeline (ns from its anchor), in order:
    how much of the time before ``t`` they took (:meth:`left_out`)."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.before: list[int] = [0]  # before[i]: total length of holes 0 .. i-1

    def add(self, start: int, end: int) -> None:
        """A sleep from ``start`` to ``end``; where it overlaps the last one (two streams), only the
        part after it counts."""
        if self.ends:
            start = max(start, self.ends[-1])
            end = max(end, start)
        self.starts.append(start)
        self.ends.append(end)
        self.before.append(self.before[-1] + max(0, end - start))

    def left_out(self, t: int) -> int:
        """Time the sleeps took before ``t``; a time inside a sleep counts up to itself."""
        i = bisect.bisect_right(self.starts, t)  # holes starting at or before t
        if i == 0:
            return 0
        return self.before[i - 1] + min(max(0, t - self.starts[i - 1]), self.ends[i - 1] - self.starts[i - 1])


def sleep_cycles_per_ns(device: int) -> float:
    """The GPU's clock, measured: ``torch.cuda._sleep`` counts cycles, a head start is sized in ns
    (its exact length does not matter: it is left out of the timeline)."""
    with torch.cuda.device(device):
        torch.cuda._sleep(1000)  # the kernel's first launch loads it (CUDA's lazy loading): not timed
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        cycles = 2_000_000
        a.record()
        torch.cuda._sleep(cycles)
        b.record()
        b.synchronize()
        return cycles / max(1.0, a.elapsed_time(b) * 1e6)


def _after(orig: Callable, hook: Callable[[], None], waits: Callable[..., bool]) -> Callable:
    @functools.wraps(orig)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        out = orig(*args, **kwargs)
        if waits(out, *args, **kwargs):
            hook()
        return out

    return wrapper


def _cuda_self(out: Any, self: Any, *a: Any, **k: Any) -> bool:
    return self.is_cuda


def _always(*a: Any, **k: Any) -> bool:
    return True


def _crossed(out: Any, self: Any, *a: Any, **k: Any) -> bool:
    """A copy between the GPU and the host, not asked to be asynchronous."""
    return getattr(out, "is_cuda", self.is_cuda) != self.is_cuda and not k.get("non_blocking", False)


def _copied(out: Any, self: Any, src: Any, *a: Any, **k: Any) -> bool:
    non_blocking = k.get("non_blocking", a[0] if a else False)
    return getattr(src, "is_cuda", self.is_cuda) != self.is_cuda and not non_blocking


# where a program's host waits for its device: (owner, name, when the call waited)
SYNC_POINTS: tuple[tuple[Any, str, Callable[..., bool]], ...] = (
    (torch.cuda, "synchronize", _always),
    (torch.cuda.Event, "synchronize", _always),
    (torch.cuda.Stream, "synchronize", _always),
    (torch.Tensor, "item", _cuda_self),
    (torch.Tensor, "tolist", _cuda_self),
    (torch.Tensor, "__float__", _cuda_self),
    (torch.Tensor, "__int__", _cuda_self),
    (torch.Tensor, "__bool__", _cuda_self),
    (torch.Tensor, "cpu", _cuda_self),
    (torch.Tensor, "to", _crossed),
    (torch.Tensor, "cuda", _crossed),
    (torch.Tensor, "copy_", _copied),
)


def install(hook: Callable[[], None]) -> Callable[[], None]:
    """Call ``hook`` after each of :data:`SYNC_POINTS` in which the host waited; returns the undo."""
    # (owner, name, its own attribute or None where it inherits the method, e.g. Tensor's from TensorBase)
    saved = [(owner, name, owner.__dict__.get(name)) for owner, name, _ in SYNC_POINTS]
    for owner, name, waits in SYNC_POINTS:
        setattr(owner, name, _after(getattr(owner, name), hook, waits))

    def undo() -> None:
        for owner, name, own in saved:
            if own is None:
                delattr(owner, name)
            else:
                setattr(owner, name, own)

    return undo


__all__ = ["BEHIND_NS", "DeviceHoles", "MAX_NS", "MIN_NS", "SYNC_POINTS", "install", "sleep_cycles_per_ns"]
