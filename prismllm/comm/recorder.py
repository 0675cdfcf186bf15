"""Per-process recorder: turns the program's communication calls into RankLog node rows.

Node model (see ``prismllm.trace.schema``): the rank's program order is a sequence of
*points* -- the issue of a communication call, the wait on an asynchronous one, an
iteration boundary -- and between two consecutive points the device runs compute. So every
point closes the current compute span (one "compute" node) and opens the next.

* A call the program waits on before anything else happens (the public synchronous APIs:
  ``dist.all_reduce(t)`` issues, then waits at once) is a *sync* call: one issue point, and
  the next compute span starts when the wait returns. ``async_op`` False, ``wait_index`` -1.
* Any other call is *async*: its wait is a separate point with a "before wait" and an
  "after wait" time, so the stall between them is not counted as compute; ``wait_index`` is
  the index of the compute node that starts after the wait.
* Waits the Python layer cannot see (a Work consumed only through its Future, e.g. DDP's
  reducer, which waits inside the autograd engine) are *settled*: at the end of the backward
  pass that issued them (an autograd final callback queued after the ones DDP/FSDP queue),
  else at the next iteration boundary. A later explicit wait overrides a settled one.

Timing. CPU ("host" clock): every point is ``time.time_ns()``. A sync call ends when its wait
returns (the host blocks in gloo). An async call ends when its Future completes: a done
callback stamps the time on gloo's worker thread as soon as the algorithm finishes, which
is exact to thread wake-up, whereas the wait's return would add the time the program spent
elsewhere before waiting; where a Work has no Future the wait's return is used (an upper
bound). GPU ("cuda" clock): every point also records a CUDA event on the current stream
(pooled); events are mapped onto the host clock through one anchor per device (host time
taken right after synchronising, then ``anchor.elapsed_time(ev)``) and resolved lazily: at
iteration boundary k the points of iteration k-1, and everything at exit, so nothing
synchronises the device in the hot path. An async communication's duration is NCCL's own
(``work._get_duration()``, needs TORCH_NCCL_ENABLE_TIMING=1), read once the Work reports
completion (polled at points, never blocking, so the Work -- and its tensors -- is held
only until the next point after it completes); its start is the device time of its issue
point, or the end of the previous operation on the same group's stream if later. A sync
communication (and any op without an NCCL duration: torch 2.11 reports 0 for sync ops,
which NCCL runs on the caller's stream) ends where the program's stream resumed after the
wait (the "after wait" event). In prism time's GPU slices the device sleeps after each of the
host's waits for it, and the sleeps are taken out of its timeline (``prismllm.comm.headstart``:
every later device time moves earlier by the sleeps before it).
Storage. Everything is kept in columns (``array`` of ints, lists of shared strings and of
tuples of ints), never as one Python object per row: a long run records millions of rows,
and per-row objects would survive into the oldest GC generation and make every full
collection walk them (measured: +20-50 µs a call after a few 10^4 calls). A point, a compute
span and a communication row are integer ids into their columns.
"""

from __future__ import annotations

import os
import time
from array import array
from collections import deque
from typing import Any

import torch

from prismllm.childenv import user_setting
from prismllm.comm import headstart
from prismllm.comm.leftout import PYTHON, LeftOutBoard

_now = time.time_ns

ST_PENDING, ST_WAITED, ST_SETTLED = 0, 1, 2
DUR_PENDING = -2  # m_dur while NCCL's duration is awaited
# CUDA events made per device with its anchor: the points of about two iterations of a TP2
# step (~330 calls, two points each; events come back to the pool one iteration late).
EVENT_PREFILL = 1024
# Works whose NCCL duration fails before one is read: then timing is off on the rank (no
# TORCH_NCCL_ENABLE_TIMING, an older torch) and no later Work is asked
DURATION_TRIES = 8

_DTYPE_NAMES: dict[torch.dtype, str] = {}


def dtype_name(dt: torch.dtype) -> str:
    n = _DTYPE_NAMES.get(dt)
    if n is None:
        n = _DTYPE_NAMES[dt] = str(dt).replace("torch.", "")
    return n


_REDOP_NAMES: dict[Any, str] = {}


def premul_factor(op: Any) -> Any:
    """A PREMUL_SUM ``ReduceOp``'s factor (a float or a tensor). torch 2.13 has ``op.factor``;
    earlier releases keep it only in the pickled state, ``(RedOpType, factor)``, as 2.13 also does."""
    factor = getattr(op, "factor", None)
    return op.__getstate__()[1] if factor is None else factor


def redop_name(op: Any) -> str:
    """``ReduceOp`` (or its ``RedOpType``) -> "sum", "avg", ...; a PREMUL_SUM ReduceOp ->
    ``"premul_sum:<factor>"`` (``trace.schema.split_reduce_op``; a tensor factor by its value),
    which the emulation needs to replay the call."""
    if isinstance(op, str):
        return op
    key = getattr(op, "op", op)  # ReduceOp wraps a RedOpType in .op
    n = _REDOP_NAMES.get(key)
    if n is None:
        name = getattr(key, "name", None) or str(key).rsplit(".", 1)[-1]
        n = _REDOP_NAMES[key] = name.lower()
    factor = premul_factor(op) if n == "premul_sum" and key is not op else None
    if factor is None:
        return n
    return f"premul_sum:{float(factor.item() if isinstance(factor, torch.Tensor) else factor)!r}"


class _Cuda:
    """CUDA entry points bound on first use (a CPU-only torch has none of them)."""

    get_device = None
    get_stream = None
    record = None

    @classmethod
    def bind(cls) -> None:
        cls.get_device = staticmethod(torch._C._cuda_getDevice)
        cls.get_stream = staticmethod(torch._C._cuda_getCurrentStream)
        cls.record = staticmethod(torch._C._CudaEventBase.record)


_cuda = _Cuda


class Recorder:
    """Records one rank. All methods run on the program's thread (autograd's, during
    backward) except the Future done-callbacks, which only store a timestamp."""

    def __init__(self, rank: int, world_size: int):
        self.rank = rank
        self.world_size = world_size
        self.cuda = False  # device-side timing (set when a group uses NCCL on CUDA)
        self.cuda_live = False  # ... and CUDA is initialised: points record events
        # every point on the device (a recording, a slice's timed graph), or only the iteration
        # boundaries (prism emulate: each point is a timing event on the program's stream, ~3 µs
        # of the device's time between two kernels on an H200, which the real run does not spend)
        self.all_points_on_device = True
        self.started = False
        self.finished = False
        self.groups: list[Any] = []  # the recorded groups, in creation order
        # the native recording backend (prismllm.comm.native.replay.NativeSession) when it records this
        # rank: the live methods below then only log, and ``finish`` replays the log
        self.native: Any = None
        self.replayed: Recorder | None = None
        # points: host time, resolved time on the host clock, device (-1: host point), event
        self.p_host = array("q")
        self.p_ns = array("q")
        self.p_dev = array("i")
        self.p_ev: list[Any] = []
        # nodes in program order: kind (0 compute, 1 comm) and the id in that kind's columns
        self.n_kind = array("b")
        self.n_sub = array("q")
        # compute spans
        self.c_iter = array("i")
        self.c_p0 = array("q")
        self.c_p1 = array("q")
        self.c_label: list[str] = []
        # communication rows, a column each (m_*, listed in comm_columns)
        self.m_index = array("q")  # the row's node index in the rank's program order
        self.m_iter = array("q")  # its iteration
        self.m_seq = array("q")  # the call's sequence number on its group
        self.m_peer = array("q")  # send/recv: the peer's global rank; a rooted call: the root; else -1
        self.m_tag = array("q")
        self.m_in = array("q")  # bytes in
        self.m_out = array("q")  # bytes out
        self.m_coal = array("q")  # the coalescing scope's id, -1 outside one
        self.m_async = array("q")  # 1: waited apart from its issue (an async call), 0: sync
        self.m_wait = array("q")  # async: the index of the compute node after its wait, else -1
        self.m_p0 = array("q")  # the issue point
        self.m_p1 = array("q")  # the point after its wait, -1 until waited or settled
        self.m_done = array("q")  # CPU: when its Future completed (host clock), -1 unknown
        self.m_dur = array("q")  # GPU: NCCL's own duration (ns), -1 none, DUR_PENDING awaited
        self.m_cuda = array("q")  # 1: issued on CUDA tensors
        self.m_state = array("q")  # ST_PENDING, ST_WAITED or ST_SETTLED
        self.m_op: list[str] = []  # the schema's op name
        self.m_group: list[str] = []  # the group's name
        self.m_red: list[str] = []  # the reduce op ("" if none; "premul_sum:<factor>")
        self.m_dtype: list[str] = []
        self.m_shape: list[tuple] = []
        self.m_insp: list[tuple] = []  # all_to_all input splits
        self.m_outsp: list[tuple] = []  # and output splits
        self.m_api: list[str] = []  # the c10d method the program called
        self.m_label: list[str] = []  # the span label pending at the call (prismllm.mark)
        # the columns above, named once: a cancelled call pops one entry from every one of them
        self.comm_columns = tuple(name for name in vars(self) if name.startswith("m_"))
        self.iterations: list[list] = []  # [iteration, start point, end point, label]
        self.iteration = 0
        self.iter_start = -1
        self.span_start = -1
        self.span_label = ""
        self.label_pending = ""
        self.comm_points = 0  # issue/wait/mark points since the last boundary
        self.explicit_steps = False
        self.optim_depth = 0
        self.coal_depth = 0
        self.coal_id = -1
        self.next_coal = 0
        self.coal_rows: list[int] = []
        self.coal_starts: list[int] = []
        self.coal_async = True  # the open _coalescing_manager's async_ops
        self.pending_sync: Any = None  # RecordingWork issued sync, not yet waited
        self.outstanding: dict[int, Any] = {}  # id -> RecordingWork not yet waited/settled
        self.waiting: Any = None  # the RecordingWork whose wait the program is in
        self.bwd_cb_queued = False
        self.bwd_works: list[Any] = []
        self.in_bwd = getattr(torch._C, "_current_graph_task_id", None)
        # CPU async completion: "callback" (exact, ~5-40 µs a call for the GIL hand-off from
        # gloo's thread) or "wait" (the wait's return: an upper bound, no extra cost)
        self.host_callbacks = user_setting("PRISM_HOST_COMPLETION", "callback") != "wait"
        # GPU state
        self.anchors: dict[int, tuple[Any, int]] = {}  # device -> (anchor event, host ns)
        self.ev_pool: dict[int, list[Any]] = {}
        self.streams: dict[tuple, Any] = {}
        self.unresolved: deque[int] = deque()  # point ids with a pending event
        self.dur_works: deque[tuple[int, Any]] = deque()  # (comm row, real Work)
        self.durations_ok = True
        self.durations_read = 0  # async calls whose transfer time NCCL's events gave
        self.durations_missing = 0  # and those without (their transfers end at the wait)
        self.duration_error = ""  # the first missing one and why
        self.boundary_points: list[int] = []
        self.pid = os.getpid()
        # host time the emulation's own layer spent on this rank's calls (prism emulate's
        # pruned groups on CPU: planning, buffers, checks), left out of the host clock
        self.excluded_ns = 0
        # (board, this rank's place) where a CPU emulation shares excluded_ns with its assistant
        self.left_out_board: tuple[LeftOutBoard, int] | None = None
        # the same layer's host time on every backend (on GPU counted, not left out)
        self.emulation_host_ns = 0
        self.calls_off_thread = 0  # emulation: pruned calls the issue thread issued (comm.sandbox)
        # that host time by part (comm.sandbox: "check", "hand-off", "thread: plan", ...) over the
        # steady iterations (the second on): part -> [calls, wall ns, the thread's CPU ns]
        self.emulation_host_parts: dict[str, list[int]] = {}
        # the host's head start (prismllm.comm.headstart; prism time on GPUs): the device sleeps after
        # each of the program's waits for it, and the sleeps are left out of its timeline
        self.head_start = ""  # "overhead" | "iteration"; "": none (ChildEnv.head_start)
        self.layer_ns_at_boundary: list[int] = []  # emulation_host_ns at each iteration boundary
        # ... at each wait of the host for its device (a head start's point), this iteration's and the last's
        self.layer_ns_at_waits: list[int] = []
        self.layer_ns_at_waits_last: list[int] = []
        self.holes: dict[int, headstart.DeviceHoles] = {}  # device -> its sleeps, resolved
        self.holes_pending: deque[tuple[int, Any, Any]] = deque()  # (device, event before, event after)
        self.cycles_per_ns: dict[int, float] = {}
        self.head_starts = 0
        self.head_start_from = -1  # the first point recorded after a head start
        self.points_timed = 0  # points from then on, resolved
        self.host_behind = 0  # ... at which the device had caught up with the host
        self.giving = False  # in give_head_start: the waits it makes itself give none

    # ---- points -------------------------------------------------------------------------
    def _host_point(self, t: int) -> int:
        pid = len(self.p_host)
        self.p_host.append(t)
        self.p_ns.append(t)
        self.p_dev.append(-1)
        self.p_ev.append(None)
        return pid

    def host_now(self) -> int:
        """The rank's host clock: wall time less what :meth:`exclude` took out."""
        return _now() - self.excluded_ns

    def exclude(self, ns: int) -> None:
        """Leave ``ns`` of host time out of this rank's clock from now on: time the emulation
        layer spent on a call that the program's real backend would not spend (CPU timing,
        where the host clock is the device clock; docs/commands/time.md, "Emulation overhead on the CPU")."""
        self.excluded_ns += ns
        if self.left_out_board is not None:  # the CPU emulation's assistant keeps this clock too
            board, k = self.left_out_board
            board.set(k, PYTHON, self.excluded_ns)

    def _ret_point(self) -> int:
        """The host point where a backend call returned."""
        return self._host_point(self.host_now())

    def point(self, boundary: bool = False) -> int:
        """A point now: on the device where the rank's clock is CUDA's (with
        ``all_points_on_device`` off, only an iteration ``boundary``), else on the host."""
        t = self.host_now()
        if not self.cuda_live:
            if not self.cuda or not torch.cuda.is_initialized():
                return self._host_point(t)
            _cuda.bind()
            self.cuda_live = True
        if not (boundary or self.all_points_on_device):
            return self._host_point(t)
        return self._cuda_point(t)

    @property
    def clock(self) -> str:
        """The rank log's clock: ``cuda`` (every point a CUDA event mapped onto the host clock),
        ``cuda-iterations`` (the iteration boundaries so, every other point on the host) or
        ``host``."""
        if not self.cuda:
            return "host"
        return "cuda" if self.all_points_on_device else "cuda-iterations"

    def _cuda_point(self, t: int) -> int:
        dev = _cuda.get_device()
        pool = self.ev_pool.get(dev)
        if pool is None:  # this device's first point
            self._make_anchor(dev)
            pool = self.ev_pool[dev]
        # dry only before the second boundary recycles the first iteration's events, and then
        # only past the pre-filled pool
        ev = pool.pop() if pool else torch.cuda.Event(enable_timing=True)
        _cuda.record(ev, self._current_stream(dev))
        pid = len(self.p_host)
        self.p_host.append(t)
        self.p_ns.append(-1)
        self.p_dev.append(dev)
        self.p_ev.append(ev)
        self.unresolved.append(pid)
        if self.dur_works:
            self._poll_durations(1)
        return pid

    def _current_stream(self, dev: int) -> Any:
        """The device's current stream, as a torch Stream made once per stream."""
        sd = _cuda.get_stream(dev)
        st = self.streams.get(sd)
        if st is None:
            st = self.streams[sd] = torch.cuda.Stream(stream_id=sd[0], device_index=sd[1], device_type=sd[2])
        return st

    def _make_anchor(self, dev: int) -> None:
        if _cuda.record is None:
            _cuda.bind()
        with torch.cuda.device(dev):
            # The first iterations' events, made now rather than one per point in the hot path
            # (the pool refills only from the second boundary on). Each is recorded once here:
            # torch creates the CUDA event itself lazily, at its first record.
            pool = [torch.cuda.Event(enable_timing=True) for _ in range(EVENT_PREFILL)]
            # on the stream looked up once: Event.record() looks up the current device's each
            # time, through a device count that took ~1 ms a call on an H100 host (1 s here)
            stream = torch.cuda.current_stream(dev)
            for ev in pool:
                ev.record(stream)
            torch.cuda.synchronize()
            if self.head_start:  # measured here, before the anchor: in no span of the program's
                self.cycles_per_ns[dev] = headstart.sleep_cycles_per_ns(dev)
            anchor = torch.cuda.Event(enable_timing=True)
            anchor.record()
            anchor.synchronize()
            self.anchors[dev] = (anchor, _now())
        self.ev_pool[dev] = pool

    def _resolve(self, upto: int, block: bool = False) -> None:
        """Resolve the pending points with id < ``upto`` (oldest first); stop at the first
        event not yet complete unless ``block``."""
        q = self.unresolved
        while q and q[0] < upto:
            pid = q[0]
            ev = self.p_ev[pid]
            if not ev.query():
                if not block:
                    return
                ev.synchronize()
            dev = self.p_dev[pid]
            anchor, host0 = self.anchors[dev]
            t = int(round(anchor.elapsed_time(ev) * 1e6))
            if self.head_start_from >= 0:  # holes given
                self._resolve_holes(block)
                if self.head_start_from <= pid:
                    self.points_timed += 1
                    self.host_behind += host0 + t - self.p_host[pid] < headstart.BEHIND_NS
                holes = self.holes.get(dev)
                if holes is not None:
                    t -= holes.left_out(t)
            self.p_ns[pid] = host0 + t
            self.p_ev[pid] = None
            self.ev_pool[dev].append(ev)
            q.popleft()

    def _resolve_holes(self, block: bool) -> None:
        """The head starts whose sleeps ran, in order, onto their devices' timelines."""
        q = self.holes_pending
        while q:
            dev, before, after = q[0]
            if not after.query():
                if not block:
                    return
                after.synchronize()
            anchor = self.anchors[dev][0]
            holes = self.holes.get(dev)
            if holes is None:
                holes = self.holes[dev] = headstart.DeviceHoles()
            holes.add(int(round(anchor.elapsed_time(before) * 1e6)), int(round(anchor.elapsed_time(after) * 1e6)))
            self.ev_pool[dev] += (before, after)
            q.popleft()

    def give_head_start(self) -> None:
        """The program's host has just waited for its device: the device sleeps before the
        program's next kernel, so that the host runs that far ahead of it (prismllm.comm.headstart):
        for the emulation layer's host time until the host's next wait ("overhead") or about the
        last iteration's device time ("iteration")."""
        if not self.head_start or not self.cuda_live or self.finished or self.giving:
            return
        self.layer_ns_at_waits.append(self.emulation_host_ns)
        # from the end of the second iteration: the first is the warm-up, the second measures the head start
        if len(self.iterations) < 2:
            return
        dev = _cuda.get_device()
        pool = self.ev_pool.get(dev)
        if pool is None or dev not in self.cycles_per_ns:  # (no point on this device yet)
            return
        self.giving = True  # the waits below are the recorder's own
        try:
            self._give_head_start(dev, pool)
        finally:
            self.giving = False

    def _give_head_start(self, dev: int, pool: list) -> None:
        before = pool.pop() if pool else torch.cuda.Event(enable_timing=True)
        after = pool.pop() if pool else torch.cuda.Event(enable_timing=True)
        st = self._current_stream(dev)
        # first: the device, idle since the wait, reaches it now, so that what the recorder does
        # here (resolving every point since the last wait) is in the hole too, not in a span
        _cuda.record(before, st)
        self._resolve(len(self.p_host))  # the host waited: the last iteration's points have run
        ns = self._last_iteration_ns() if self.head_start == "iteration" else self._layer_ns_to_next_wait()
        if ns > 0:  # else no pruned call until the next wait: the host is where the real run's is
            torch.cuda._sleep(int(ns * self.cycles_per_ns[dev]))
        _cuda.record(after, st)
        self.holes_pending.append((dev, before, after))
        if self.head_start_from < 0:
            self.head_start_from = len(self.p_host)
        self.head_starts += int(ns > 0)

    def _last_iteration_ns(self) -> int:
        """The device time of the last iteration whose points are resolved (sleeps left out),
        within the head start's bounds; the longest bound before one is."""
        for _, start, end, _ in reversed(self.iterations):
            if start >= 0 and self.p_ns[start] >= 0 and self.p_ns[end] >= 0:
                return min(headstart.MAX_NS, max(headstart.MIN_NS, self.p_ns[end] - self.p_ns[start]))
        return headstart.MAX_NS

    def _layer_ns_to_next_wait(self) -> int:
        """The emulation layer's host time (its calls, on the program's thread and the issue thread)
        from this wait of the host to its next one, as the last iteration spent it from its wait of
        the same place: how much farther ahead of its device the real run's host is until it waits
        again. A program whose waits do not repeat from one iteration to the next: the last
        iteration's whole layer time. (Each wait given the whole iteration's: a Megatron TP2 slice,
        85-136 waits an iteration, slept 2.4-9 s an iteration on four H100s.)"""
        last, now = self.layer_ns_at_waits_last, self.layer_ns_at_waits
        k = len(now) - 1  # this wait's place in the iteration
        if last and k < len(last) - 1:
            ns = last[k + 1] - last[k]
        elif last and k == len(last) - 1:  # the last wait: up to the next iteration's first
            ns = now[0] - last[k]
        else:
            at = self.layer_ns_at_boundary
            ns = at[-1] - at[-2]
        return min(headstart.MAX_NS, ns)

    def count_layer_time(self, part: str, wall_ns: int, cpu_ns: int) -> None:
        """Host time the emulation layer spent in one part of one call: in ``emulation_host_ns``,
        and by part from the second iteration on (the first builds plans, buffers and
        communicators once)."""
        self.emulation_host_ns += wall_ns
        if self.iterations:
            acc = self.emulation_host_parts.setdefault(part, [0, 0, 0])
            acc[0] += 1
            acc[1] += wall_ns
            acc[2] += cpu_ns

    def head_start_counts(self) -> dict[str, int]:
        """For the rank log: head starts given, and the points after the first at which the
        device had caught up with the host anyway (a host-bound stretch)."""
        return {"sleeps": self.head_starts, "points": self.points_timed, "host_behind": self.host_behind}

    def _poll_durations(self, limit: int) -> None:
        q = self.dur_works
        n = 0
        while q and n < limit:
            j, work = q[0]
            try:
                if not work.is_completed():
                    return
            except Exception as e:  # noqa: BLE001 - the program sees a failed Work where it waits
                q.popleft()
                self._no_duration(j, work, e)
            else:
                q.popleft()
                self._read_duration(j, work)
            n += 1

    def _read_duration(self, j: int, work: Any) -> None:
        """Row ``j``'s transfer time from NCCL's own events of its completed ``work``."""
        try:
            d = work._get_duration()
        except Exception as e:  # timing not enabled, no _get_duration in this torch, a Work without events
            self._no_duration(j, work, e)
            return
        if d > 0:
            self.m_dur[j] = int(round(d * 1e6))
            self.durations_read += 1
        else:
            self._no_duration(j, work, None)

    def _no_duration(self, j: int, work: Any, e: BaseException | None) -> None:
        """Row ``j`` has no device duration: its transfer ends where the program waited. Counted
        and the first reason kept (``transfer_durations`` in the rank log), so that a graph whose
        transfers are not NCCL's measurements says so; after DURATION_TRIES failures with none
        read, timing is off on this rank and no other Work is asked."""
        self.m_dur[j] = -1
        self.durations_missing += 1
        if not self.duration_error:
            why = f"{type(e).__name__}: {e}".splitlines()[0][:300] if e is not None else "no device time (0 ms)"
            self.duration_error = f"{self.m_op[j]} #{self.m_seq[j]} ({type(work).__name__}): {why}"
        if e is not None and not self.durations_read and self.durations_missing >= DURATION_TRIES:
            self.durations_ok = False
            for jj, _w in self.dur_works:
                if self.m_dur[jj] == DUR_PENDING:
                    self.m_dur[jj] = -1
                    self.durations_missing += 1
            self.dur_works.clear()

    def transfer_durations(self) -> dict[str, Any]:
        """How many asynchronous calls' transfer times came from NCCL's events (GPU), how many
        did not, and the first reason why not."""
        return {"read": self.durations_read, "missing": self.durations_missing, "first_missing": self.duration_error}

    # ---- spans --------------------------------------------------------------------------
    def _close_span(self, p: int) -> None:
        """Emit the compute node from the current span start to point ``p``."""
        c = len(self.c_p0)
        self.c_iter.append(self.iteration)
        self.c_p0.append(self.span_start)
        self.c_p1.append(p)
        self.c_label.append(self.span_label)
        self.span_label = ""
        self.n_kind.append(0)
        self.n_sub.append(c)

    def _open_span(self, p: int) -> None:
        self.span_start = p
        if self.label_pending:
            self.span_label = self.label_pending
            self.label_pending = ""

    @property
    def next_index(self) -> int:
        return len(self.n_kind)

    # ---- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        """Iteration 0 starts now (the default group's creation returned)."""
        if self.started:
            return
        self.started = True
        if self.native is not None:
            self.native.start()
            return
        p = self.point(boundary=True)
        self.span_start = p
        self.iter_start = p

    def add_group(self, pg: Any) -> None:
        self.groups.append(pg)

    # ---- issue --------------------------------------------------------------------------
    def issue(self, op, api, group, seq, peer, tag, red, dt, shape, inb, outb, insp, outsp,
              cuda, same=-1) -> int:  # fmt: skip
        """A communication call is being issued; returns its row id (not yet waited).

        ``same``: a row issued by the same call (the tensors of one *_coalesced call): the
        new row shares its issue point and no compute span is closed between them."""
        if same < 0:
            if self.pending_sync is not None:
                self._demote_sync()
            p = self.point()
            self._close_span(p)
            self.comm_points += 1
            self._check_backward()
        else:
            p = self.m_p0[same]
        label = self.label_pending
        if label:
            self.label_pending = ""
        coal = self.coal_id if self.coal_depth else -1
        j = len(self.m_op)
        self.m_index.append(len(self.n_kind))
        self.n_kind.append(1)
        self.n_sub.append(j)
        self.m_iter.append(self.iteration)
        self.m_seq.append(seq)
        self.m_peer.append(peer)
        self.m_tag.append(tag)
        self.m_in.append(inb)
        self.m_out.append(outb)
        self.m_coal.append(coal)
        self.m_async.append(0)
        self.m_wait.append(-1)
        self.m_p0.append(p)
        self.m_p1.append(-1)
        self.m_done.append(-1)
        self.m_dur.append(-1)
        self.m_cuda.append(1 if cuda else 0)
        self.m_state.append(ST_PENDING)
        self.m_op.append(op)
        self.m_group.append(group)
        self.m_red.append(red)
        self.m_dtype.append(dt)
        self.m_shape.append(tuple(shape))
        self.m_insp.append(tuple(insp))
        self.m_outsp.append(tuple(outsp))
        self.m_api.append(api)
        self.m_label.append(label)
        if coal >= 0:
            self.coal_rows.append(j)
        return j

    def issued(self, work: Any, rows: tuple, sync: bool) -> None:
        """The backend call returned ``work`` (a RecordingWork, or None)."""
        if self.cuda_live:
            # The device does not wait for the issue: the next compute span starts, on the
            # device, where the previous one ended (the issue point's event).
            p = self.m_p0[rows[0]]
        else:
            p = self._ret_point()
        if work is None and not self.coal_depth:  # in a batch, rows complete with its Work
            # No Work: the call returned when it completed (monitored_barrier; NCCL in torch
            # 2.11 runs a synchronous collective on the program's stream and returns none). The
            # next compute span starts there too -- on the device, the event after the return,
            # which the stream reaches once the collective ran -- else the span would count
            # the collective a second time.
            end = self.point() if self.cuda else p
            for j in rows:
                self.m_async[j] = 0
                self.m_p1[j] = end
                self.m_state[j] = ST_WAITED
            self._open_span(end)
            return
        self._open_span(p)
        if work is None:
            return
        if sync:
            self.pending_sync = work
        else:
            for j in rows:
                self.m_async[j] = 1
        self.outstanding[id(work)] = work
        if self.bwd_cb_queued:
            self.bwd_works.append(work)
        inner = work._inner
        if self.cuda:
            if self.durations_ok and self.m_cuda[rows[0]] and not self.coal_depth and not sync:
                for j in rows:
                    self.m_dur[j] = DUR_PENDING
                    self.dur_works.append((j, inner))
        elif not sync and self.host_callbacks:
            self._watch_completion(inner, rows)

    def _watch_completion(self, inner: Any, rows: tuple) -> None:
        """Stamp the rows' end when the real Work's Future completes (host clock)."""
        try:
            fut = inner.get_future()
        except Exception:
            return
        m_done = self.m_done

        # the transfer runs in wall time: host time left out (Recorder.exclude) while it is
        # in flight -- the rank planning its next calls -- does not make it shorter
        left_out = self.excluded_ns

        def _done(_f, rows=rows):  # runs on gloo's worker thread: store a time only
            t = _now() - left_out
            for j in rows:
                if m_done[j] < 0:
                    m_done[j] = t

        try:
            fut.add_done_callback(_done)
        except Exception:
            pass

    def bind_batch(self, work: Any, rows: list[int]) -> None:
        """``work`` (from _end_coalescing) completes the rows of its coalescing scope."""
        if not rows:
            return
        if self.coal_async:
            for j in rows:
                self.m_async[j] = 1
        else:  # _coalescing_manager(async_ops=False) waits on it at once
            if self.pending_sync is not None:
                self._demote_sync()
            self.pending_sync = work
        self.outstanding[id(work)] = work
        if self.cuda and self.durations_ok and self.m_cuda[rows[0]]:
            for j in rows:
                self.m_dur[j] = DUR_PENDING
                self.dur_works.append((j, work._inner))

    def complete_rows(self, rows) -> None:
        """Rows whose batch ended without a Work (nothing to wait on): done now, sync; the next
        compute span starts where they completed (as ``issued`` does for a call without a Work)."""
        p = -1
        for j in rows:
            if self.m_state[j] == ST_PENDING:
                if p < 0:
                    p = self.point()
                self.m_async[j] = 0
                self.m_p1[j] = p
                self.m_state[j] = ST_WAITED
        if p >= 0:
            self._open_span(p)

    def cancel(self, rows: tuple) -> None:
        """The backend refused the call just issued (it raised): forget its rows, and the
        compute span closed at its issue point continues as if no call had happened."""
        n = len(rows)
        p0 = self.m_p0[rows[0]]
        label = self.m_label[rows[0]]
        for _ in range(n):
            for c in self.comm_columns:
                getattr(self, c).pop()
            self.n_kind.pop()
            self.n_sub.pop()
        if self.coal_rows:
            gone = set(rows)
            self.coal_rows = [j for j in self.coal_rows if j not in gone]
        if self.n_kind and self.n_kind[-1] == 0 and self.c_p1[-1] == p0:
            self.span_start = self.c_p0.pop()
            self.c_p1.pop()
            self.c_iter.pop()
            self.span_label = self.c_label.pop()
            self.n_kind.pop()
            self.n_sub.pop()
            self.comm_points = max(0, self.comm_points - 1)
        if label:
            self.label_pending = label

    def _demote_sync(self) -> None:
        """The last sync-issued call was not waited on at once: it is async after all."""
        w = self.pending_sync
        self.pending_sync = None
        for j in w._rows:
            self.m_async[j] = 1

    # ---- status (prismllm.launch.status: read from the reporter's thread, under the GIL) -------
    def calls(self) -> int:
        """The communication calls made so far."""
        if self.native is not None:
            return int(self.native.self_time()["calls"])
        return len(self.m_op)

    def progress(self) -> int:
        """A count that moves with every call, wait and boundary."""
        if self.native is not None:
            t = self.native.self_time()
            return t["calls"] + t["waits"] + t["boundaries"]
        return len(self.n_kind)

    # ---- waits --------------------------------------------------------------------------
    def wait(self, work: Any, fn, args) -> Any:
        """The program waits on ``work``; ``fn(*args)`` performs the backend's wait."""
        if work._state == ST_WAITED:
            return fn(*args)
        immediate = self.pending_sync is work
        if not immediate:
            if self.pending_sync is not None:
                self._demote_sync()
            self._close_span(self.point())
        self.waiting = work  # for a status report (prismllm.launch.status) while the wait blocks
        try:
            return fn(*args)
        finally:
            self.waiting = None
            pa = self.point()
            work._state = ST_WAITED
            self.outstanding.pop(id(work), None)
            m_state = self.m_state
            if immediate:
                self.pending_sync = None
                for j in work._rows:
                    self.m_async[j] = 0
                    self.m_wait[j] = -1
                    self.m_p1[j] = pa
                    m_state[j] = ST_WAITED
            else:
                idx = len(self.n_kind)
                for j in work._rows:
                    if m_state[j] != ST_WAITED:
                        self.m_async[j] = 1
                        self.m_wait[j] = idx
                        self.m_p1[j] = pa
                        m_state[j] = ST_WAITED
                self.comm_points += 1
            self._open_span(pa)
            if work._anysource:
                self._fix_anysource(work)
            cb = work._on_wait
            if cb is not None:
                work._on_wait = None
                cb()

    def _fix_anysource(self, work: Any) -> None:
        try:
            src = work._inner._source_rank()
        except Exception:
            return
        pg = work._pg
        g = pg._global_ranks[src] if 0 <= src < len(pg._global_ranks) else -1
        for j in work._rows:
            self.m_peer[j] = g
            self.m_seq[j] = pg._p2p_seq(g, "recv")

    def _settle(self, works, p: int = -1) -> None:
        """Place the unobserved wait of ``works`` at a point (provisional): a new point, or
        ``p`` when the caller has just closed the span there (an iteration boundary)."""
        m_state = self.m_state
        rows = []
        for w in works:
            if w._state == ST_PENDING:
                w._state = ST_SETTLED
                self.outstanding.pop(id(w), None)
                rows.extend(j for j in w._rows if m_state[j] == ST_PENDING)
        if not rows:
            return
        if p < 0:
            if self.pending_sync is not None:
                self._demote_sync()
            p = self.point()
            self._close_span(p)
            self._open_span(p)
        idx = len(self.n_kind)
        for j in rows:
            if m_state[j] == ST_PENDING:
                self.m_async[j] = 1
                self.m_wait[j] = idx
                self.m_p1[j] = p
                m_state[j] = ST_SETTLED

    def _check_backward(self) -> None:
        """At a call's issue: the first call of a backward pass queues the settling callback."""
        if self.in_bwd is not None and not self.bwd_cb_queued and self.in_bwd() != -1:
            self._queue_bwd_callback()

    def _queue_bwd_callback(self) -> None:
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)
        except Exception:
            return
        self.bwd_cb_queued = True

    def _on_backward_end(self) -> None:
        """The pass's first final callback (queued at its first call). DDP queues its own, which
        makes the program's stream wait for every bucket, only when its last bucket is ready, so
        after this one: queued again from here, the settling runs after every callback queued
        during the pass, and its point is where the stream stands after those waits (else the
        next compute span counted the last buckets' transfer a second time: a DDP recording's
        own solve was 2 % above it)."""
        torch.autograd.Variable._execution_engine.queue_callback(self._settle_backward)

    def _settle_backward(self) -> None:
        self.bwd_cb_queued = False
        works, self.bwd_works = self.bwd_works, []
        self._settle(works)

    # ---- coalescing ---------------------------------------------------------------------
    def begin_coalesce(self) -> None:
        """Enter a coalescing scope. Nested scopes (batch_isend_irecv > _coalescing_manager >
        _start_coalescing) share the outermost scope's id."""
        if self.coal_depth == 0:
            self.coal_id = self.next_coal
            self.next_coal += 1
            self.coal_rows = []
        self.coal_starts.append(len(self.coal_rows))
        self.coal_depth += 1

    def end_coalesce(self) -> list[int]:
        """Leave a scope; returns the rows issued since the matching begin_coalesce."""
        self.coal_depth -= 1
        rows = self.coal_rows[self.coal_starts.pop() :]
        if self.coal_depth == 0:
            if not self.coal_rows:  # nothing was issued: give the id back
                self.next_coal -= 1
            self.coal_rows = []
            self.coal_id = -1
        return rows

    # ---- user API -----------------------------------------------------------------------
    def mark(self, label: str) -> None:
        """End the compute span under way here and start one named ``label``; the call that
        ends it carries the label too (what generator rules match on)."""
        if self.native is not None:
            self.native.mark(str(label))
            return
        self.label_pending = str(label)
        if not self.started or self.finished:  # the first span takes it when it opens
            return
        if self.pending_sync is not None:
            self._demote_sync()
        p = self.point()
        self._close_span(p)
        self.comm_points += 1  # a point of the program's own: the next boundary opens an iteration
        self.span_start = p  # not _open_span: the pending label stays for the call that ends it
        self.span_label = self.label_pending

    def boundary(self, explicit: bool) -> None:
        """End of an iteration: an optimizer step finished, or the program called step()."""
        if not self.started or self.finished:
            return
        if explicit:
            self.explicit_steps = True
        elif self.explicit_steps:
            return
        if self.native is not None:
            self.native.boundary(explicit)
            return
        if self.pending_sync is not None:
            self._demote_sync()
        p = self.point(boundary=True)
        if self.comm_points == 0 and self.iterations:
            # Nothing communicated since the last boundary (a second optimizer, or step()
            # right after an optimizer step): extend the previous iteration instead.
            self.iteration -= 1
            self._close_span(p)
            self.iterations[-1][2] = p
            self.iteration += 1
            self.layer_ns_at_boundary[-1] = self.emulation_host_ns
            self.layer_ns_at_waits = self.layer_ns_at_waits_last + self.layer_ns_at_waits
        else:
            self._close_span(p)
            self.iterations.append([self.iteration, self.iter_start, p, ""])
            self.iteration += 1
            self.layer_ns_at_boundary.append(self.emulation_host_ns)
        self.layer_ns_at_waits_last, self.layer_ns_at_waits = self.layer_ns_at_waits, []
        self.iter_start = p
        self.comm_points = 0
        self._open_span(p)
        if self.outstanding:
            self._settle(list(self.outstanding.values()), p)
        if self.cuda:
            # Resolve the previous iteration's points (done on the device long ago).
            self.boundary_points.append(p)
            if len(self.boundary_points) >= 2:
                self._resolve(self.boundary_points[-2])
            self._poll_durations(1 << 30)

    def optimizer_pre(self) -> None:
        self.optim_depth += 1

    def optimizer_post(self) -> None:
        self.optim_depth = max(0, self.optim_depth - 1)
        if self.optim_depth == 0:
            self.boundary(explicit=False)

    # ---- exit ---------------------------------------------------------------------------
    def finish(self) -> None:
        """Close the last span; resolve every time (synchronising the device once)."""
        if self.finished:
            return
        self.finished = True
        if not self.started:
            return
        if self.native is not None:
            self.replayed = self.native.replay_into(self)
            return
        if self.pending_sync is not None:
            self._demote_sync()
        self._close_span(self.point(boundary=True))
        if self.cuda:
            try:
                torch.cuda.synchronize()
            except Exception:
                pass
            self._resolve(len(self.p_host), block=True)
            q = self.dur_works
            while q:
                j, work = q.popleft()
                self._read_duration(j, work)


_RECORDER: Recorder | None = None


def current() -> Recorder | None:
    return _RECORDER


def set_current(rec: Recorder | None) -> None:
    global _RECORDER
    _RECORDER = rec
