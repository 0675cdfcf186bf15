"""The real-time schedule of the virtual ranks' calls with the sandbox (``prism emulate --timing
real``): when the proxy enters each call, and how the sandbox's real completions move that.

Logical time 0 of the replay is pinned to the clock by the first call that completes for real
(its planned end meets the moment it ended). Every later call is entered at its planned ready
time (the moment its last virtual member arrives in the solve of the calibrated graph) moved by
the *drift*: how late (or early) the latest real completion came against its planned end. A
sandbox slower than the calibrated graph so delays its virtual peers, as a slow rank delays its
real ones (one shift for every virtual rank: a model choice, exact for one virtual peer).
Until a first call completed, each group's first call is entered at once (the sandbox's first
call is one of them, whatever its order).

Two clocks keep that schedule, with one interface and one report:

* :class:`DeviceClock` (NCCL, the proxy on a GPU): the schedule lives in the assistant GPU's
  memory. Before each call the proxy's worker enqueues a one-thread kernel on the call's stream
  that waits on the GPU's global timer until the call's time; after it, a kernel that stamps
  the completion and sets the drift. The host only enqueues, ahead of time: no host round trip
  (thread wake-up, a device synchronisation, a Python loop) lies between one call's completion
  and the next call's entry, which the host clock put on every call (measured on four H100s: a
  1 MB pruned all-reduce 276 µs against 93 µs real, and an emulated iteration that fell 17 %
  behind its calibrated schedule, each real completion noticed late moving every later call).
* :class:`HostClock` (gloo, processes for devices): the same rules on the host's clock; the
  worker sleeps until the time and the completer notices the completion.

Both log, per call, the time it was due (the schedule as the sandbox moved it), the time it was
entered and the time it completed: :meth:`arrivals` reports how late the virtual ranks' arrivals
came against their schedule (emulate.json's ``replay.arrivals``).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import torch

UNSET = -1  # a log entry not written (a call never entered, or entered before the origin was pinned)

_KERNELS = r"""
__device__ __forceinline__ long long prism_now() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return (long long)t;
}

// state[0]: device time at logical 0 (0 until a first completion pinned it); state[1]: drift.
// log: [due, entered, completed, drift after] of this call.
extern "C" __global__ void prism_enter_at(long long* state, long long* log, double ready_ns) {
    volatile long long* s = state;
    long long now = prism_now();
    long long origin = s[0];
    if (origin == 0) {  // nothing completed yet: the group's first call goes at once
        log[1] = now;
        return;
    }
    long long due = origin + (long long)ready_ns + s[1];
    while (now < due) {
        now = prism_now();
        due = origin + (long long)ready_ns + s[1];  // a completion on another group may move it
    }
    log[0] = due;
    log[1] = now;
}

extern "C" __global__ void prism_completed(long long* state, long long* log, double end_ns) {
    long long now = prism_now();
    unsigned long long* s = (unsigned long long*)state;
    unsigned long long pin = (unsigned long long)(now - (long long)end_ns);
    if (atomicCAS(&s[0], 0ULL, pin) != 0ULL) {
        long long drift = now - (long long)((volatile unsigned long long*)s)[0] - (long long)end_ns;
        atomicExch(&s[1], (unsigned long long)drift);
    }
    __threadfence_system();
    log[2] = now;
    log[3] = (long long)((volatile unsigned long long*)s)[1];
}
"""


class _Log:
    """Per call: [due, entered, completed, drift after], and the call's planned ready time."""

    def __init__(self, calls: int, ready_ns: np.ndarray):
        self.ready_ns = np.asarray(ready_ns, dtype=np.int64)
        self.rows = np.full((calls, 4), UNSET, dtype=np.int64)


def arrival_report(rows: np.ndarray, ready_ns: np.ndarray, origin: int | None) -> dict[str, Any]:
    """How late the proxy entered each call against the schedule, in ns: ``late`` against the time it
    was due (the calibrated ready time moved by the sandbox's completions: what the emulation
    itself adds), ``moved`` by how much the sandbox had moved the schedule when it was due (the
    drift: how much slower or faster than the calibrated graph the sandbox ran), ``behind`` the
    calibrated time itself (the two together). Calls entered before the origin was pinned are
    counted apart (``at_once``)."""
    due, entered = rows[:, 0], rows[:, 1]
    timed = (due != UNSET) & (entered != UNSET)
    out: dict[str, Any] = {
        "calls": int(len(rows)),
        "entered": int((entered != UNSET).sum()),
        "at_once": int(((due == UNSET) & (entered != UNSET)).sum()),
        "timed": int(timed.sum()),
    }
    if not timed.any() or origin is None:
        return out
    late = entered[timed] - due[timed]
    moved = due[timed] - origin - ready_ns[timed]
    behind = entered[timed] - origin - ready_ns[timed]

    def stats(x: np.ndarray) -> dict[str, int]:
        return {
            "median_ns": int(np.median(x)),
            "p90_ns": int(np.percentile(x, 90)),
            "max_ns": int(x.max()),
            "min_ns": int(x.min()),
        }

    out["late"] = stats(late)
    out["late_over_10us"] = int((late > 10_000).sum())
    out["late_over_100us"] = int((late > 100_000).sum())
    out["moved"] = stats(moved)
    out["behind"] = stats(behind)
    return out


_BUILT: dict[int, tuple[Any, Any]] = {}


def _kernels(device: int) -> tuple[Any, Any]:
    """The two kernels, built once per device and launched once before use: with CUDA's lazy
    loading a kernel's first launch loads it, which waited for the device to go idle (seen on an
    H100: the host blocked 50 ms behind a waiting ``prism_enter_at``)."""
    if device not in _BUILT:
        from prismllm.comm.spin import compile_kernel

        what = "real-time emulation on a GPU"
        enter = compile_kernel(_KERNELS, "prism_enter_at", device, what)
        done = compile_kernel(_KERNELS, "prism_completed", device, what)
        state = torch.zeros(2, dtype=torch.int64, device=torch.device("cuda", device))
        log = torch.zeros(4, dtype=torch.int64, device=state.device)
        enter(args=[state, log, 0.0])
        done(args=[state, log, 0.0])
        torch.cuda.synchronize(state.device)
        _BUILT[device] = (enter, done)
    return _BUILT[device]


class DeviceClock:
    """The schedule on the assistant's GPU (module docstring). ``calls``: how many calls with the
    sandbox this assistant enters; ``ready_ns``: each one's planned ready time (by slot)."""

    def __init__(self, device: torch.device, calls: int, ready_ns: np.ndarray):
        self.device = device
        idx = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.set_device(idx)  # the module loads into the device's context, current on this thread
        self.state = torch.zeros(2, dtype=torch.int64, device=device)
        self._log = _Log(calls, ready_ns)
        self.rows = torch.full((max(calls, 1), 4), UNSET, dtype=torch.int64, device=device)
        self._enter, self._done = _kernels(idx)

    def enter(self, slot: int) -> None:
        """Enqueue, on the current stream, the wait until call ``slot`` is due."""
        self._enter(args=[self.state, self.rows[slot], float(self._log.ready_ns[slot])])

    def completed(self, slot: int, end_ns: int) -> None:
        """Enqueue, on the current stream (after the call's Works were waited on), the stamp of its
        completion; ``end_ns``: where the replay planned it to end."""
        self._done(args=[self.state, self.rows[slot], float(end_ns)])

    def arrivals(self) -> dict[str, Any]:
        torch.cuda.synchronize(self.device)
        rows = self.rows.cpu().numpy()[: len(self._log.ready_ns)]
        origin = int(self.state[0].item())
        return {"clock": "device", **arrival_report(rows, self._log.ready_ns, origin or None)}


class HostClock:
    """The schedule on the host's clock (``perf_counter_ns``): the worker sleeps until a call is
    due (less what entering costs, a running mean), the completer notices each completion."""

    def __init__(self, calls: int, ready_ns: np.ndarray):
        self._log = _Log(calls, ready_ns)
        self._origin: int | None = None
        self._pinned = threading.Event()
        self._lock = threading.Lock()
        self._drift = 0
        self.issue_ns = 0  # what entering a call costs (running mean, set by the worker)

    def enter(self, slot: int, first_of_group: bool) -> None:
        """Return when call ``slot`` is due; a group's first call before the origin is pinned goes at once."""
        if first_of_group and not self._pinned.is_set():
            self._log.rows[slot, 1] = time.perf_counter_ns()
            return
        self._pinned.wait()
        due = self._origin + int(self._log.ready_ns[slot]) + self._drift
        delay = due - self.issue_ns - time.perf_counter_ns()
        if delay > 0:
            time.sleep(delay / 1e9)
        self._log.rows[slot, 0] = due
        self._log.rows[slot, 1] = time.perf_counter_ns()

    def completed(self, slot: int, end_ns: int) -> None:
        """The call ``slot`` was seen complete now; it was planned to end at ``end_ns``."""
        now = time.perf_counter_ns()
        with self._lock:
            if not self._pinned.is_set():  # the first real completion: logical time meets the clock
                self._origin = now - end_ns
                self._pinned.set()
            else:
                self._drift = now - self._origin - end_ns
            self._log.rows[slot, 2] = now
            self._log.rows[slot, 3] = self._drift

    def arrivals(self) -> dict[str, Any]:
        return {"clock": "host", **arrival_report(self._log.rows, self._log.ready_ns, self._origin)}


__all__ = ["DeviceClock", "HostClock", "arrival_report"]
