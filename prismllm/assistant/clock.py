"""The real-time schedule of the virtual ranks' calls with the sandbox (``prism emulate --timing
real``): when the proxy enters each call, and how the sandbox's real completions move that.

Logical time 0 of the replay is pinned to the clock by the first call that completes for real
(its planned end meets the moment it ended). Each call is due at its planned ready time (the
moment its last virtual member arrives in the solve of the calibrated graph), moved by how late
(or early) its *gates* completed against their planned ends: the sandbox's calls its virtual
members last waited on before arriving (``prismllm.replay.gates``), each less the plan's waits
after it, and it is not entered before they completed. A sandbox slower than the calibrated
graph so delays the virtual ranks that wait on it, as a slow rank delays its real peers; a call
that a virtual rank issued and went on from
(DDP's bucket, FSDP's prefetch) delays only what waits on it. (One global shift, the earlier
rule, moved every later call by the latest completion: a virtual replica then arrived ever later
than the sandbox at its asynchronous buckets, the sandbox's NCCL kernels waited on its GPU's
SMs, and the emulated DDP iteration ran 11-19 % over the calibrated one on four H100s.) Until a
first call completed, each group's first call without gates is entered at once.

Two clocks keep that schedule, with one interface and one report:

* :class:`DeviceClock` (NCCL, the proxy on a GPU): the schedule lives in the assistant GPU's
  memory. Before each call the proxy's worker enqueues a one-thread kernel on the call's stream
  that waits for the call's gates to complete and then on the GPU's global timer until the call
  is due; after it, a kernel that stamps the completion. The host only enqueues, ahead of time:
  no host round trip lies between a completion and the entry it lets go (measured on four H100s
  with the host clock: a 1 MB pruned all-reduce 276 µs against 93 µs real).
* :class:`HostClock` (gloo, processes for devices): the same rules on the host's clock; the
  worker waits for the gates' completions and sleeps until the time; the completer notices each
  completion.

Both log, per call, the time it was due, the time it was entered and the time it completed:
:meth:`arrivals` reports how late the virtual ranks' arrivals came against their schedule
(emulate.json's ``replay.arrivals``).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from prismllm.comm.spin import compile_kernel

UNSET = -1  # a log entry not written (a call never entered, or entered before the origin was pinned)

_KERNELS = r"""
#define UNSET (-1LL)
__device__ __forceinline__ long long prism_now() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return (long long)t;
}

// state[0]: device time at logical 0 (0 until a first completion pinned it).
// rows[4 * j ...]: call j's [due, entered, completed, lateness of its completion].
// Call j waits for its gates gate[gate_ptr[j] .. gate_ptr[j + 1]) to complete, then until it is due:
// origin + ready + the most any of them completed late, less its offset (what the virtual rank
// waited, by the plan, after it: the slack that absorbs its lateness).
extern "C" __global__ void prism_enter_at(long long* state, long long* rows, const long long* gate_ptr,
                                          const long long* gate, const long long* gate_offset,
                                          const long long* planned_end, int j, double ready_ns) {
    volatile long long* s = state;
    volatile long long* r = rows;
    long long late = 0;
    bool gated = false;
    for (long long k = gate_ptr[j]; k < gate_ptr[j + 1]; ++k) {
        long long i = gate[k];
        while (r[4 * i + 2] == UNSET) {
        }
        __threadfence();  // the lateness, written before the completion, read after it
        long long l = r[4 * i + 3] - gate_offset[k];
        if (!gated || l > late) late = l;
        gated = true;
    }
    long long origin = s[0];
    long long now = prism_now();
    if (origin == 0) {  // nothing completed yet: the group's first call goes at once
        r[4 * j + 1] = now;
        return;
    }
    long long due = origin + (long long)ready_ns + late;
    while (now < due) now = prism_now();
    r[4 * j] = due;
    r[4 * j + 1] = now;
}

extern "C" __global__ void prism_completed(long long* state, long long* rows, const long long* planned_end, int j) {
    long long now = prism_now();
    unsigned long long* s = (unsigned long long*)state;
    atomicCAS(&s[0], 0ULL, (unsigned long long)(now - planned_end[j]));  // the first completion pins
    __threadfence_system();
    long long origin = (long long)((volatile unsigned long long*)s)[0];
    volatile long long* r = rows;
    r[4 * j + 3] = now - origin - planned_end[j];
    __threadfence_system();
    r[4 * j + 2] = now;
}
"""


@dataclasses.dataclass
class Schedule:
    """The calls with the sandbox as the clock keeps them, by slot (the order the proxy's workers are
    handed them): each call's planned ready time and planned end (logical ns), and its gates (CSR
    of slots: ``gate[gate_ptr[j]:gate_ptr[j + 1]]``, earlier slots) with each gate's offset (ns the
    virtual rank waited by the plan after that gate: its lateness less that moves the call;
    ``prismllm.replay.gates``; none given: 0)."""

    ready_ns: np.ndarray
    planned_end_ns: np.ndarray
    gate_ptr: np.ndarray
    gate: np.ndarray
    gate_offset_ns: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.gate_offset_ns is None:
            self.gate_offset_ns = np.zeros(len(self.gate), dtype=np.int64)
        for f in dataclasses.fields(self):
            setattr(self, f.name, np.ascontiguousarray(getattr(self, f.name), dtype=np.int64))

    @property
    def calls(self) -> int:
        return len(self.ready_ns)

    def gates(self, j: int) -> np.ndarray:
        return self.gate[self.gate_ptr[j] : self.gate_ptr[j + 1]]

    def offsets(self, j: int) -> np.ndarray:
        return self.gate_offset_ns[self.gate_ptr[j] : self.gate_ptr[j + 1]]


def arrival_report(rows: np.ndarray, ready_ns: np.ndarray, origin: int | None) -> dict[str, Any]:
    """How late the proxy entered each call against the schedule, in ns: ``late`` against the time it
    was due (the calibrated ready time moved by its gates' completions: what the emulation itself
    adds), ``moved`` by how much the sandbox's completions had moved it (how much slower or faster
    than the calibrated graph the sandbox ran before it), ``behind`` the calibrated time itself
    (the two together). Calls entered before the origin was pinned are counted apart
    (``at_once``)."""
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


def schedule_table(schedule: Schedule, rows: np.ndarray, origin: int | None, calls: dict[str, list]) -> pa.Table:
    """The schedule as the clock kept it, one row a call (slot): ``calls``' columns (what each call
    is), its planned ``ready_ns`` and ``planned_end_ns``, its ``gates`` (slots) and their
    ``gate_offsets_ns``, and when it was ``due``, ``entered`` and ``completed`` in the replay's
    logical ns (the clock's time less its origin; null where not written or before the origin was
    pinned). What moved the virtual ranks against the calibrated graph can be read from it call
    by call: a gap between a gate's completion and the entry it let go that differs from the
    planned one, or a call that took longer in the emulation than planned (its ``completed -
    entered`` against ``planned_end_ns - ready_ns``)."""
    n = schedule.calls

    def logical(col: np.ndarray) -> pa.Array:
        ok = (col != UNSET) & (origin is not None)
        return pa.array(np.where(ok, col - (origin or 0), 0), mask=~ok, type=pa.int64())

    def per_call(values: np.ndarray) -> pa.Array:  # a gate column, one list a call (the schedule's CSR)
        return pa.ListArray.from_arrays(pa.array(schedule.gate_ptr, type=pa.int32()), pa.array(values, pa.int64()))

    cols = {
        "slot": pa.array(np.arange(n), type=pa.int64()),
        **{k: pa.array(v) for k, v in calls.items()},
        "ready_ns": pa.array(schedule.ready_ns, type=pa.int64()),
        "planned_end_ns": pa.array(schedule.planned_end_ns, type=pa.int64()),
        "gates": per_call(schedule.gate),
        "gate_offsets_ns": per_call(schedule.gate_offset_ns),
        "due_ns": logical(rows[:n, 0]),
        "entered_ns": logical(rows[:n, 1]),
        "completed_ns": logical(rows[:n, 2]),
    }
    return pa.table(cols)


_BUILT: dict[int, tuple[Any, Any]] = {}


def _kernels(device: int) -> tuple[Any, Any]:
    """The two kernels, built once per device and launched once before use: with CUDA's lazy
    loading a kernel's first launch loads it, which waited for the device to go idle (seen on an
    H100: the host blocked 50 ms behind a waiting ``prism_enter_at``)."""
    if device not in _BUILT:
        what = "real-time emulation on a GPU"
        enter = compile_kernel(_KERNELS, "prism_enter_at", device, what)
        done = compile_kernel(_KERNELS, "prism_completed", device, what)
        dev = torch.device("cuda", device)
        state = torch.zeros(2, dtype=torch.int64, device=dev)
        rows = torch.full((4,), UNSET, dtype=torch.int64, device=dev)
        zeros = torch.zeros(2, dtype=torch.int64, device=dev)
        enter(args=[state, rows, zeros, zeros, zeros, zeros, 0, 0.0])
        done(args=[state, rows, zeros, 0])
        torch.cuda.synchronize(dev)
        _BUILT[device] = (enter, done)
    return _BUILT[device]


class DeviceClock:
    """The schedule on the assistant's GPU (module docstring)."""

    def __init__(self, device: torch.device, schedule: Schedule):
        self.device = device
        idx = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.set_device(idx)  # the module loads into the device's context, current on this thread
        self.schedule = schedule
        on = dict(dtype=torch.int64, device=device)
        self.state = torch.zeros(2, **on)
        self.rows = torch.full((max(schedule.calls, 1), 4), UNSET, **on)
        self._gate_ptr = torch.as_tensor(schedule.gate_ptr, **on)
        self._gate = torch.as_tensor(schedule.gate if len(schedule.gate) else np.zeros(1, np.int64), **on)
        offsets = schedule.gate_offset_ns
        self._offset = torch.as_tensor(offsets if len(offsets) else np.zeros(1, np.int64), **on)
        self._end = torch.as_tensor(schedule.planned_end_ns if schedule.calls else np.zeros(1, np.int64), **on)
        self._enter, self._done = _kernels(idx)

    def enter(self, slot: int) -> None:
        """Enqueue, on the current stream, the wait until call ``slot`` is due."""
        ready = float(self.schedule.ready_ns[slot])
        self._enter(args=[self.state, self.rows, self._gate_ptr, self._gate, self._offset, self._end, slot, ready])

    def completed(self, slot: int) -> None:
        """Enqueue, on the current stream (after the call's Works were waited on), its completion stamp."""
        self._done(args=[self.state, self.rows, self._end, slot])

    def log(self) -> tuple[np.ndarray, int | None]:
        """Each call's [due, entered, completed, lateness of its completion] (the clock's ns, UNSET
        where not written), and the clock's time at logical 0 (None until a completion pinned it)."""
        torch.cuda.synchronize(self.device)
        origin = int(self.state[0].item())
        return self.rows.cpu().numpy()[: self.schedule.calls], origin or None

    def arrivals(self) -> dict[str, Any]:
        rows, origin = self.log()
        return {"clock": "device", **arrival_report(rows, self.schedule.ready_ns, origin)}


class HostClock:
    """The schedule on the host's clock (``perf_counter_ns``): the worker waits for the call's gates
    and sleeps until it is due (less what entering costs, a running mean), the completer notices
    each completion. ``left_out``: the host time the sandbox ranks have left out of their clocks so
    far (a CPU emulation: prismllm.comm.leftout), left out of this one too, so that the virtual
    ranks keep the sandbox's clock, not the wall clock."""

    def __init__(self, schedule: Schedule, left_out: Callable[[], int] | None = None):
        self.schedule = schedule
        self._left_out = left_out
        self.rows = np.full((schedule.calls, 4), UNSET, dtype=np.int64)
        self._done = [threading.Event() for _ in range(schedule.calls)]
        self._origin: int | None = None
        self._pinned = threading.Event()
        self._lock = threading.Lock()
        self.issue_ns = 0  # what entering a call costs (running mean, set by the worker)

    def enter(self, slot: int, first_of_group: bool) -> None:
        """Return when call ``slot`` is due; a group's first call without gates, before the origin is
        pinned, goes at once."""
        sch = self.schedule
        gates = sch.gates(slot)
        for i in gates:
            self._done[i].wait()
        if not len(gates) and first_of_group and not self._pinned.is_set():
            self.rows[slot, 1] = self.now()
            return
        self._pinned.wait()
        late = int(max(self.rows[i, 3] - o for i, o in zip(gates, sch.offsets(slot)))) if len(gates) else 0
        due = self._origin + int(sch.ready_ns[slot]) + late
        # the sandbox may leave more out while this sleeps: its clock is then behind the wall's
        while (delay := due - self.issue_ns - self.now()) > 0:
            time.sleep(delay / 1e9)
        self.rows[slot, 0] = due
        self.rows[slot, 1] = self.now()

    def now(self) -> int:
        """The clock's time: the host's, less what the sandbox ranks have left out of theirs."""
        return time.perf_counter_ns() - (self._left_out() if self._left_out is not None else 0)

    def completed(self, slot: int) -> None:
        """The call ``slot`` was seen complete now."""
        now = self.now()
        end = int(self.schedule.planned_end_ns[slot])
        with self._lock:
            if not self._pinned.is_set():  # the first real completion: logical time meets the clock
                self._origin = now - end
                self._pinned.set()
            self.rows[slot, 2] = now
            self.rows[slot, 3] = now - self._origin - end
        self._done[slot].set()

    def log(self) -> tuple[np.ndarray, int | None]:
        """As :meth:`DeviceClock.log`, on the host's clock."""
        return self.rows, self._origin

    def arrivals(self) -> dict[str, Any]:
        rows, origin = self.log()
        return {"clock": "host", **arrival_report(rows, self.schedule.ready_ns, origin)}


__all__ = ["DeviceClock", "HostClock", "Schedule", "arrival_report", "schedule_table"]
