"""Emulate mode, sandbox side: a few real ranks run the program inside a virtual world.

Mode ``emulate`` (with torchrun's RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, and the rank's
``ChildEnv``: ``sandbox``, the logical ranks that run for real, this one among them; ``graph``,
the graph the assistants replay). docs/internals/assistant.md has the design.

The virtual world is solo mode's (``prismllm/comm/solo.py``): groups this rank is not in are
never instantiated, every member group is a ``RecordingProcessGroup`` (so the sandbox rank
records its graph as in ``prism record``), with solo's metadata backends registered on it
(``solo._attach``). What differs is the group's inner backend, chosen by who is real:

* every member a sandbox rank: the real backend over the program's own store, exactly as in
  record mode (``install._create_pg`` builds it; :func:`create_pg` returns None for these);
* some members virtual: a :class:`PrunedBackend`. It owns a *small* ``ProcessGroupGloo`` of
  the real members (logical group order) plus the assistant's proxy (``pruning.Pruned``), made over the
  launcher's TCPStore under ``prism/pruned/<group name>/``; the assistant makes its side
  under the same prefix. Every call is rewritten by the pruning plan of
  ``prismllm/pruning``: ``plan`` -> ``sandbox_call`` -> issue on the small group
  -> a :class:`PrunedWork` whose wait runs ``SmallCall.finish`` (copy back, re-order, divide
  for AVG), so the program's tensors end up equal to the logical group's result.

Check (``ChildEnv.check_tensors``: a recorded-tensor store, ``check_out``: a directory): every
pruned call's output is compared, once the call finished, with what this rank received in the
recorded run (``prism record --save-tensors all``); at exit ``<dir>/check-rank-<r>.json`` holds
the number of calls compared, missing from the store, never finished (never waited on) and not
comparable, the largest absolute and relative differences with the call that had them, and the
calls that differ by more than rounding (:func:`rounding_tolerance`), the first named. It is how
a sandbox rank that prints nothing (e.g. TP rank 0 of gpt3d) is shown to see exactly what the
real run saw.

Issue thread (GPU; ``PRISM_ISSUE_THREAD=0`` turns it off): an asynchronous pruned call is recorded and checked
against the graph on the program's thread, which then only marks where its stream stands (a CUDA
event) and returns, as NCCL's own enqueue does; :class:`IssueThread` plans it and issues its small
calls after that mark. DDP issues its gradient buckets from autograd's thread between backward
kernels: the emulation's host work there (~100 µs a call beside NCCL's ~35 µs, H100 host) left
the device without work in every bucket. Calls stay in the program's order on every small group:
a call issued on the program's thread first waits until the issue thread is done.

Rendezvous: the program's ``env://`` store is the launcher's real TCPStore (its clients do
not wait for absent ranks); the store-based barriers torch adds with
``TORCH_DIST_INIT_BARRIER=1`` would wait for absent ranks and are skipped (as in solo mode).
Not done yet (docs/commands/emulate.md, "Not supported"): answering store keys that a program's
own store protocol expects from absent ranks.
"""

from __future__ import annotations

import atexit
import collections
import json
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from prismllm import pruning as C
from prismllm.childenv import ChildEnv, user_setting, variable
from prismllm.comm import scratch, solo, solo_objects
from prismllm.comm.graphcheck import GraphExpectation
from prismllm.comm.native.replay import red_name
from prismllm.comm.recording import RecordingProcessGroup
from prismllm.errors import PrismError
from prismllm.generate.generator import Call
from prismllm.generate.store import TensorStore
from prismllm.pruning import PRUNED_PREFIX, small_group
from prismllm.specs import format_ranks
from prismllm.trace.schema import split_reduce_op

_C = torch._C._distributed_c10d

_ORIG: dict[str, Any] = {}
_SANDBOX: tuple[int, ...] = ()
_STORE: Any = None  # the launcher's TCPStore, as a client
_CHECK: OutputCheck | None = None
_BACKENDS: list[PrunedBackend] = []  # every pruned group's backend, closed at exit
_EXPECT: Any = None  # this rank's calls in the graph (GraphExpectation): a deviation is one error
# the virtual ranks' inputs are generated: every virtual member is taken to hold what this rank
# holds (pruning.sandbox_call's like_me: all_gather slots, sums scaled to the group's)
_LIKE_ME = False
# generated inputs: what the capture kept of what ranks sent (object lists, roots' small
# broadcasts), answering a sandbox rank whose sender or root is virtual
_MESSAGES: solo_objects.CapturedMessages | None = None
_ISSUE: IssueThread | None = None  # asynchronous pruned calls issued off the program's thread (PRISM_ISSUE_THREAD)
# the issue thread serves CUDA calls; PRISM_ISSUE_THREAD=all gloo's too (the CPU tests of its order)
_ISSUE_ON_CPU = False
_LANE: Any = None  # the native module, when the pruned groups run through its lane (ChildEnv.native_lane_on)


def _close_small_groups() -> None:
    """atexit: the small groups go while the interpreter is whole. The program's
    destroy_process_group does not reach them (torch shuts down NCCL backends only, and a
    RecordingProcessGroup and its inner backend reference each other, so they are freed at
    teardown at the earliest)."""
    if _ISSUE is not None:
        try:
            _ISSUE.drain()
        except BaseException:  # noqa: BLE001 - reported where the program waited; the groups still go
            pass
    while _BACKENDS:
        _BACKENDS.pop().shutdown()


class EmulateError(PrismError):
    """The sandbox cannot run a call of the program in emulation (unsupported op or layout)."""


def sandbox() -> tuple[int, ...]:
    return _SANDBOX


def prepare(rank: int, child: ChildEnv) -> None:
    """Read the sandbox set; skip store-based barriers (they wait for absent ranks); set up
    the output check when asked."""
    global _SANDBOX, _CHECK, _EXPECT, _LIKE_ME, _MESSAGES, _ISSUE, _ISSUE_ON_CPU
    if not child.sandbox:
        raise PrismError(f"{variable('mode')}=emulate needs {variable('sandbox')} (the ranks that run for real)")
    _SANDBOX = child.sandbox
    # as solo capture's generator fills them, so that values deciding shapes (MoE routing counts)
    # and objects equal on every rank (all_gather_object) agree with the graph
    _LIKE_ME = child.inputs == "generated"
    if rank not in _SANDBOX:
        raise PrismError(f"rank {rank} runs the program but is not in {variable('sandbox')}={format_ranks(_SANDBOX)}")
    if not _ORIG:
        _ORIG["barrier"] = c10d._store_based_barrier
        c10d._store_based_barrier = lambda *a, **k: None
        atexit.register(_close_small_groups)
    if child.graph:
        _EXPECT = GraphExpectation(child.graph, rank)
    if child.check_tensors:
        _CHECK = OutputCheck(child.check_tensors, rank, child.check_out)
        atexit.register(_CHECK.write)
    if child.graph and _LIKE_ME:  # (recorded inputs: the store holds what the senders sent)
        messages = solo_objects.CapturedMessages.of_graph(child.graph)
        if messages is not None:
            _receive_captured_objects(messages)
            _MESSAGES = messages
    # the native lane (prismllm/comm/native/pruned_lane.h), as the launcher decided (launch_sandbox):
    # a call whose small call has a template goes from the program to the small communicator with no
    # Python on the way
    if child.native_lane_on:
        from prismllm.comm import native  # the launcher built it

        global _LANE
        _LANE = native.load(without="PRISM_NATIVE_LANE=0 emulates through the Python path")
        return  # calls issue on the program's thread, with no Python on the way: no issue thread
    issue = user_setting("PRISM_ISSUE_THREAD", "1")
    if issue not in ("0", "1", "all"):
        raise PrismError(
            f"PRISM_ISSUE_THREAD={issue!r}: 1 (the default), 0 (calls issued on the program's thread) or all"
        )
    _ISSUE, _ISSUE_ON_CPU = (IssueThread(), issue == "all") if issue != "0" else (None, False)


def lane() -> Any:
    """The native module when the native lane runs (ChildEnv.native_lane_on), else None."""
    return _LANE


def _receive_captured_objects(messages: solo_objects.CapturedMessages) -> None:
    """``recv_object_list`` from a virtual rank receives what the capture's sender sent
    (``CapturedMessages``; generated bytes would not unpickle, and their size would not be the
    graph's): the receives it makes take that payload in place of what the small call brings."""
    orig = c10d.recv_object_list

    def recv_object_list(object_list, src=None, group=None, device=None, group_src=None, **kwargs):
        pg = group or c10d._get_default_group()
        inner = getattr(pg, "_inner", None)
        peer = solo_objects.global_peer(group, src, group_src)
        objects = solo_objects.DEFAULT
        if isinstance(inner, PrunedBackend) and peer not in _SANDBOX:
            objects = messages.next(pg._global_ranks, peer, pg._rec.rank)
        if not isinstance(objects, list) or len(objects) != len(object_list):
            return orig(object_list, src=src, group=group, device=device, group_src=group_src, **kwargs)
        inner.expect(peer, solo_objects.object_payload(objects, pg))
        try:
            return orig(object_list, src=src, group=group, device=device, group_src=group_src, **kwargs)
        finally:
            inner.expect(peer, None)

    c10d.recv_object_list = dist.recv_object_list = recv_object_list


# A pruned sum adds its members in another order than the real ring, so a float output may differ
# from the recording by rounding, which grows with the terms summed (docs/accuracy.md#values): up to
# this many units of the dtype's precision per group member, relative to the recorded output's
# largest magnitude. Anything more, and any difference of an exact type, is a difference.
ROUNDING_ULPS = 32


def rounding_tolerance(dtype: torch.dtype, members: int) -> float:
    """The relative difference a pruned call's output of ``dtype`` on a group of ``members`` may
    show from the recording by rounding alone (0 for an exact type)."""
    if not dtype.is_floating_point:
        return 0.0
    return ROUNDING_ULPS * members * torch.finfo(dtype).eps


def difference(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(largest absolute difference, it relative to ``b``'s largest finite magnitude) of two flat
    tensors: inf when they cannot be compared (size, dtype), when an exact type differs at all,
    or when a NaN or an infinity of one is not in the other at the same place."""
    if a.numel() != b.numel() or a.dtype != b.dtype:
        return math.inf, math.inf
    if not a.is_floating_point():
        return (0.0, 0.0) if torch.equal(a, b) else (math.inf, math.inf)
    a, b = a.double(), b.double()
    same = (a == b) | (a.isnan() & b.isnan())
    if bool(same.all()):
        return 0.0, 0.0
    d = float(torch.nan_to_num((a - b).abs()[~same], nan=math.inf).max())
    finite = b[b.isfinite()]
    scale = float(finite.abs().max()) if finite.numel() else 0.0
    return d, d / max(scale, 1e-30)


class OutputCheck:
    """Compares pruned calls' outputs with the recorded run's (``ChildEnv.check_tensors``)."""

    def __init__(self, root: str, rank: int, out_dir: str | None):

        self.store = TensorStore(root, rank)
        self.rank = rank
        self.out_dir = out_dir
        self.compared = 0
        self.missing = 0
        self.max_abs = 0.0
        self.max_rel = 0.0
        self.worst = ""
        self.differing = 0  # calls whose outputs differ by more than rounding
        self.first_difference = ""  # the first of them, with its difference
        self._lock = threading.Lock()
        self._open: dict[int, str] = {}  # calls issued, not finished yet: id -> description
        self.errors: list[str] = []  # calls the check itself failed on

    def issued(self, c: Call) -> None:
        with self._lock:
            self._open[id(c)] = f"{c.op} #{c.index} on group {c.group_name} {list(c.group_ranks)}"

    def compare(self, c: Call, outs: list[torch.Tensor]) -> None:
        """Called once per finished call, from the program's thread or gloo's (a Future
        callback): everything under the lock (the store reads through one file handle), and
        never raising into the program."""
        peer = c.peer if c.op in ("send", "recv") else -1
        with self._lock:
            self._open.pop(id(c), None)
            try:
                rec = self.store.get(c.group_name, c.group_ranks, c.op, c.index, peer)
                if rec is None or len(rec) != len(outs):
                    self.missing += 1
                    return
                self._compare(c, outs, rec)
                self.compared += 1
            except Exception as e:  # noqa: BLE001 - a check must not break the program
                self.errors.append(f"{c.op} #{c.index} on group {c.group_name}: {e}")

    def _compare(self, c: Call, outs: list[torch.Tensor], rec: list[torch.Tensor]) -> None:
        what = f"{c.op} #{c.index} on group {c.group_name} {list(c.group_ranks)}"
        differs = ""
        for a, b in zip(outs, rec):
            d, r = difference(a.detach().cpu().reshape(-1), b.reshape(-1))
            if r > self.max_rel or (r == self.max_rel and d > self.max_abs):
                self.worst = what
            self.max_abs, self.max_rel = max(self.max_abs, d), max(self.max_rel, r)
            allowed = rounding_tolerance(b.dtype, len(c.group_ranks))
            if r > allowed and not differs:
                differs = (
                    f"{what} differs from the recording: max abs diff {d:.3g}, relative {r:.3g} "
                    f"(rounding allows {allowed:.3g})"
                )
        if differs:
            self.differing += 1
            self.first_difference = self.first_difference or differs

    def summary(self) -> dict:
        with self._lock:
            unfinished = list(self._open.values())
        return {
            "rank": self.rank,
            "compared": self.compared,
            "missing": self.missing,
            "max_abs_diff": self.max_abs,
            "max_rel_diff": self.max_rel,
            "worst": self.worst,
            "differing": self.differing,
            "first_difference": self.first_difference,
            # issued but never finished by exit (the program never waited on the Work)
            "unfinished": len(unfinished),
            "unfinished_calls": unfinished[:8],
            "errors": len(self.errors),
            "error_calls": self.errors[:8],
        }

    def write(self) -> None:
        if self.out_dir:
            os.makedirs(self.out_dir, exist_ok=True)
            path = os.path.join(self.out_dir, f"check-rank-{self.rank}.json")
            with open(path, "w") as f:
                json.dump(self.summary(), f, indent=1, default=str)


def _store() -> Any:
    """A client of the launcher's TCPStore (MASTER_ADDR/MASTER_PORT): where the small groups
    meet the assistant, whatever store the program itself rendezvoused with."""
    global _STORE
    if _STORE is None:
        addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = os.environ.get("MASTER_PORT")
        if not port:
            raise PrismError("PRISM_MODE=emulate needs MASTER_ADDR/MASTER_PORT (the launcher's store)")
        _STORE = dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(minutes=30))
    return _STORE


# ---- group creation -------------------------------------------------------------------------
def create_pg(dist_opts, ctx: dict, rec, btypes: dict):
    """The "prism" creator's emulate branch. None: every member is real (the caller builds the
    real backend as in record mode); else a RecordingProcessGroup over a PrunedBackend, or with
    the native lane the PrunedLane over it (the caller makes the native group around it)."""
    devmap: dict[str, str] = ctx["devmap"]
    kinds = set(devmap.values())
    if not kinds <= {"gloo", "nccl"}:
        raise EmulateError(f"emulation runs on gloo and nccl; the program asked for {ctx['backend']!r}")
    # one small group per pruned group: NCCL when the program's CUDA tensors go to NCCL
    backend = "nccl" if devmap.get("cuda") == "nccl" else "gloo"
    rank, size = dist_opts.group_rank, dist_opts.group_size
    group_name = dist_opts.group_id
    granks = list(dist_opts.global_ranks_in_group) or list(range(size))
    real = tuple(g for g, r in enumerate(granks) if r in _SANDBOX)
    if len(real) == size:
        return None
    pruned = C.Pruned(size, real)
    # the graph's name of this group (the assistant makes its side under that name)
    group_name = (_EXPECT.name_of(granks, group_name) if _EXPECT is not None else None) or group_name
    store, small_rank, timeout = _store(), pruned.small(rank), dist_opts.timeout

    def make_small() -> Any:
        # Made at the group's first call, not here: a program makes groups it never calls on
        # (Megatron-core's gloo groups on a GPU run), and the assistant makes its side only for
        # groups with calls ahead. The backend is said first, so that an assistant running
        # another one stops with a message instead of waiting for a peer that never comes.
        store.set(f"{PRUNED_PREFIX}{group_name}/backend", backend)
        return small_group(store, group_name, small_rank, pruned.size, timeout, backend)

    inner = PrunedBackend(rank, size, granks, devmap, group_name, pruned, make_small, backend)
    _BACKENDS.append(inner)
    if _LANE is not None:  # the caller registers it under a native recording backend
        table = _EXPECT.collectives(group_name, list(_LANE.OPS)) if _EXPECT is not None else []
        return _LANE.PrunedLane(rank, size, inner, backend, backend == "nccl", _EXPECT is not None, table)
    pg = RecordingProcessGroup(
        dist_opts.store.underlying_store, rank, size, inner, group_name, granks, ctx["backend"], rec, split=_no_split
    )
    solo._attach(pg, inner, devmap, btypes, ctx["device_id"])
    rec.add_group(pg)
    return pg


Stamp = tuple[int, int]  # (perf_counter_ns, thread_time_ns)


def stamp() -> Stamp:
    """Now, on the wall clock and on this thread's CPU clock: a part of the layer's host time
    whose CPU time is well under its wall time waited (for the GIL, in a blocking call)."""
    return time.perf_counter_ns(), time.thread_time_ns()


# ---- works ----------------------------------------------------------------------------------
class PrunedWork(dist.Work):
    """The Work of one pruned call: the small group's Works, then the sandbox's post step
    (``SmallCall.finish``), run once -- by ``wait``, by ``is_completed`` once the small Works
    are done, or by the Future's callback (which the recorder uses for async timing)."""

    def __init__(
        self,
        works: Sequence[Any],
        calls: Sequence[C.SmallCall],
        outputs: list,
        checks: Sequence[tuple[Call, list]] = (),
        leave_out: Callable[[Stamp, str], None] | None = None,
        issued: bool = True,
    ):
        super().__init__()
        self._leave_out = leave_out  # the backend's _leave_out on CPU: the post step is ours
        self._works = list(works)
        self._calls = list(calls)
        self._outputs = outputs
        self._checks = list(checks)  # (call, its outputs) to compare with the recording
        self._lock = threading.Lock()
        self._finished = False
        self._fut: Any = None
        # issued later by the IssueThread (``issued=False``): set by ``_bind`` or ``_fail``; None:
        # issued already (no Event made on the hot path of every other call)
        self._issued = None if issued else threading.Event()
        self._failure: BaseException | None = None
        self._fut_lock = threading.Lock()  # not _lock: a chained callback may run _finish inside
        self._complete_at_finish = False  # the Future of a late Work whose small Works have none

    def _bind(self, works: Sequence[Any], calls: Sequence[C.SmallCall], checks: Sequence) -> None:
        """The small calls the issue thread made for this Work."""
        self._works, self._calls, self._checks = list(works), list(calls), list(checks)
        with self._fut_lock:
            self._issued.set()
            fut = self._fut  # made before the bind (get_future came first): completed from here
            if fut is not None:

                def complete(f: Any) -> None:
                    try:
                        fut.set_result(f.value())
                    except Exception as e:  # noqa: BLE001 - the program sees it where it waits
                        fut.set_exception(e)

                try:
                    chained = self._chain()
                except RuntimeError:  # gloo's point-to-point Works have no Future: completed at the wait
                    self._complete_at_finish = True
                else:
                    chained.add_done_callback(complete)

    def _fail(self, e: BaseException) -> None:
        with self._fut_lock:
            self._failure = e
            self._issued.set()
            if self._fut is not None:  # made before the failure: it is the program's to see
                self._fut.set_exception(e)

    def _ready(self) -> None:
        """Wait until the small calls are issued; raise what stopped them."""
        if self._issued is not None:
            self._issued.wait()
        if self._failure is not None:
            raise self._failure

    def _finish(self) -> None:
        with self._lock:
            if not self._finished:
                for c in self._calls:
                    c.finish()
                self._finished = True
                if _CHECK is not None:
                    for call, outs in self._checks:
                        _CHECK.compare(call, outs)
                if self._complete_at_finish:
                    self._fut.set_result(self._outputs)

    def wait(self, timeout=None) -> bool:
        self._ready()
        for w in self._works:
            if timeout is None:
                w.wait()
            else:
                w.wait(timeout)
        t0 = stamp()
        self._finish()
        if self._leave_out is not None:
            self._leave_out(t0, "finish")
        return True

    def is_completed(self) -> bool:
        """The small calls ran on the device (as NCCL's Work says of its kernel), not only the
        post step: the program's wait returns before the device ran the call, and the recorder
        reads NCCL's device time once this says so."""
        if self._device_completed():
            self._ready()
            self._finish()
            return True
        return False

    def _device_completed(self) -> bool:
        """Whether the small calls ran on the device (or failed), the post step left to whoever
        waits or asks ``is_completed``: what the native recorder's resolver, a thread of its own,
        asks of a Work of the lane's Python path (``HeldWork`` in pruned_lane.h)."""
        if self._issued is not None and not self._issued.is_set():
            return False
        return self._failure is not None or all(w.is_completed() for w in self._works)

    def is_success(self) -> bool:
        return self.is_completed()

    def exception(self):
        return None

    def get_future(self):
        with self._fut_lock:
            if self._fut is None:
                if self._failure is not None:
                    raise self._failure
                if self._issued is None or self._issued.is_set():
                    self._fut = self._chain()
                else:  # completed once the issue thread bound the small calls (``_bind``)
                    devices = sorted({str(t.device) for t in self._outputs if t.device.type == "cuda"})
                    self._fut = torch.futures.Future(devices=devices or None)
            return self._fut

    def _chain(self):
        """The small calls' Future, then the post step: completes with the program's outputs."""
        futs = [w.get_future() for w in self._works]  # raises where gloo has none (p2p)
        outs = self._outputs

        def done(_f):
            self._finish()
            return outs

        if len(futs) == 1:  # the common case: no collect_all (a Future more, a callback more)
            return futs[0].then(done)
        if futs:
            return torch.futures.collect_all(futs).then(done)
        f = torch.futures.Future()
        f.set_result(None)
        return f.then(done)

    def _get_duration(self) -> float:
        """NCCL's device time of the small calls, in ms (TORCH_NCCL_ENABLE_TIMING=1, as the
        sandbox runs): what the recorder reads as an async call's duration, so that a GPU slice
        measures a pruned transfer as a recording measures a real one. The small calls run one
        after the other on the communicator's stream: their sum."""
        return sum(w._get_duration() for w in self._works)

    def synchronize(self) -> None:
        self.wait()

    def block_current_stream(self) -> None:
        self.wait()

    def source_rank(self) -> int:
        return -1

    def _source_rank(self) -> int:
        return -1

    def result(self):
        return self._outputs

    def __repr__(self) -> str:
        return f"PrunedWork({', '.join(c.op for c in self._calls)}, {len(self._works)} small works)"


class IssueThread:
    """Plans and issues the sandbox's asynchronous pruned calls on a thread of its own (module
    docstring, "Issue thread"), one after the other in the order the program made them. A call
    issued on the program's thread first waits until this one is done (:meth:`drain`), so every
    small communicator sees the program's order. A call that fails here fails its Work, where the
    program waits, and every later one (the order the small groups expect is lost)."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._jobs: collections.deque[tuple[PrunedWork, Callable[[], tuple]]] = collections.deque()
        self._busy = 0
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._stream: Any = None  # the thread's current CUDA stream, as use_stream last set it

    def use_stream(self, stream: Any) -> None:
        """Make ``stream`` (and its device) current on the issue thread, which runs nothing but
        the jobs: it stays current for the next call, so a run of calls on one group sets it once
        (a device and a stream context entered and left around every call took ~60 us of an
        H100 host's time a call)."""
        if stream is not self._stream:
            torch.cuda.set_stream(stream)
            self._stream = stream

    def submit(self, work: PrunedWork, job: Callable[[], tuple]) -> None:
        """``job()`` -> (works, calls, checks) is bound to ``work`` once it ran."""
        with self._cv:
            if self._error is not None:
                raise self._error
            self._jobs.append((work, job))
            self._busy += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="prism-issue", daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def drain(self) -> None:
        """Wait until every call submitted is issued; raise what stopped one."""
        with self._cv:
            while self._busy:
                self._cv.wait()
            if self._error is not None:
                raise self._error

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._jobs:
                    self._cv.wait()
                item = self._jobs.popleft()
            self._issue(*item)
            # nothing of the call stays here once it is issued: its closure holds the program's
            # tensors, which would otherwise live until the next call came (a gradient shard the
            # program had dropped, still held, put a GPU run's peak 64,000 B above the real one)
            del item

    def _issue(self, work: PrunedWork, job: Callable[[], tuple]) -> None:
        try:
            if self._error is not None:
                raise self._error
            work._bind(*job())
        except BaseException as e:  # noqa: BLE001 - handed to the program where it waits
            if self._error is None:
                self._error = e if isinstance(e, PrismError) else EmulateError(f"issuing a pruned call: {e}")
            work._fail(self._error)
        finally:
            with self._cv:
                self._busy -= 1
                self._cv.notify_all()


# ---- the backend ----------------------------------------------------------------------------
def _one(x: Any, what: str) -> torch.Tensor:
    """The single tensor of a call (pruned calls take one tensor per member)."""
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (list, tuple)) and len(x) == 1 and isinstance(x[0], torch.Tensor):
        return x[0]
    raise EmulateError(
        f"{what}: a list of {len(x) if x is not None else 0} tensors per member "
        f"is not supported in emulation (one tensor)"
    )


class PrunedBackend(solo.GeneratedBackend):
    """A pruned group's inner backend: the argument handling and ``Call`` building of solo's
    GeneratedBackend (same methods, same checks), with ``_run`` issuing each call on the small
    group through the pruning plan instead of filling outputs from a generator."""

    pruned = True

    def __init__(self, rank: int, size: int, global_ranks: list[int], devmap: dict[str, str],
                 group_name: str, group: C.Pruned, make_small: Callable[[], Any], backend: str = "gloo"):  # fmt: skip
        super().__init__(rank, size, global_ranks, devmap, group_name)
        self.group = group
        self._make_small = make_small
        self._small: Any = None  # the small group, made at the first call (create_pg)
        self.backend = backend
        self._batch: list[PrunedWork] | None = None  # gloo: the open batch's Works
        # nccl: the open batch's calls, issued together by _end_coalescing
        self._nccl_batch: list[tuple[list, list, list]] | None = None
        self._expected: dict[int, collections.deque] = {}  # peer -> payloads its next receives take
        # the native lane's call in progress (native_call): its rows, and the small calls planned
        self._native_rows: list[tuple] | None = None
        self._planned: list[C.SmallCall] | None = None

    def supports_coalescing(self, device) -> bool:
        # as the real backend: NCCL batches (one NCCL group), gloo posts ops one by one
        return self.backend == "nccl" and device is not None and torch.device(device).type == "cuda"

    def _call(self, op_rows: int, k: int, **kw) -> Call:
        """The call, checked against this rank's graph before anything is issued: the
        assistant serves what the graph says, so a program that deviates from it must stop
        here with one message, not hang in a mismatched small call."""
        t0 = stamp()
        if self._native_rows is not None:  # the native lane's call: its rows come from the native log
            op, api, seq, red, factor, in_bytes, out_bytes = self._native_rows[k]
            c = Call(
                rank=self.global_ranks[self._rank], op=op, api=api, group_ranks=tuple(self.global_ranks),
                group_desc="", group_name=self.group_name, group_rank=self._rank, index=seq,
                reduce_op=red_name(red, factor), **kw,
            )  # fmt: skip
        else:
            c = super()._call(op_rows, k, **kw)
            rec = self.owner._rec
            j = len(rec.m_op) - op_rows + k
            in_bytes, out_bytes = rec.m_in[j], rec.m_out[j]
        if _EXPECT is not None:
            _EXPECT.check(
                c.group_name, c.op, c.index, in_bytes, out_bytes, c.peer if c.op in ("send", "recv") else c.root
            )
        self._leave_out(t0, "check")
        return c

    def _leave_out(self, t0: Stamp, part: str) -> None:
        """On CPU, where the rank's host clock is its device clock, the time since ``t0``
        (:func:`stamp`) was this layer's own work on a call (the call, its check against
        the graph, the plan, buffers, post steps), which the program's real backend does not
        do: the recorder leaves it out of the rank's clock, so slice timing measures the
        program and the link, not the emulation (docs/commands/time.md, "Emulation overhead on the CPU"). On GPU
        the device clock does not see host work while the host runs ahead, so nothing is left out;
        the time is still counted (``Recorder.emulation_host_ns``): a host-bound rank's device
        waits for it."""
        ns = time.perf_counter_ns() - t0[0]
        if self.owner is None:  # the native lane: the native recorder's clock (it counts the lane's time)
            if self.backend == "gloo":
                _LANE.exclude(ns)
            return
        rec = self.owner._rec
        rec.count_layer_time(part, ns, time.thread_time_ns() - t0[1])
        if self.backend == "gloo":
            rec.exclude(ns)

    def small(self) -> Any:
        """The small group, made now if this is the group's first call."""
        if self._small is None:
            self._small = self._make_small()
        return self._small

    # -- planning --
    def _sandbox_call(self, p: C.Plan, **tensors: Any) -> C.SmallCall:
        """This member's small call; on a GPU its scratch comes from outside the program's
        allocator (``prismllm.comm.scratch.arena``; CPU tensors: PyTorch's), so the sandbox's
        peak memory is the program's."""
        nccl = self.backend == "nccl"  # batches and pre-multiplied sums: no pass over the program's tensors
        return C.sandbox_call(
            p, self._rank, scratch=scratch.arena, like_me=_LIKE_ME, coalesce=nccl, premul=nccl, **tensors
        )

    def _plan(self, c: Call, tag: int = 0) -> tuple[C.Plan, C.SmallCall]:
        """The plan of one call and this member's small call, from the program's tensors."""
        G, g, op = self.group, self._rank, c.op
        n = G.n
        red, factor = split_reduce_op(c.reduce_op)  # premul_sum carries its factor
        if op == "all_reduce":
            t = _one(c.output, "all_reduce")
            p = C.plan_once(C.plan_all_reduce, n, G, t.shape, red, dtype=t.dtype, factor=factor)
            return p, self._sandbox_call(p, tensor=t)
        if op == "broadcast":
            t = _one(c.input if c.is_root else c.output, "broadcast")
            p = C.plan_once(C.plan_broadcast, n, G, t.shape, self.global_ranks.index(c.root), dtype=t.dtype)
            sc = self._sandbox_call(p, tensor=t)
            if _MESSAGES is not None and not c.is_root and c.root not in _SANDBOX and solo_objects.kept_size(t):
                # a virtual root's broadcast the capture kept (a micro-batch's token ids from a virtual
                # tensor-parallel rank 0), in place of this rank's own copy (zeros where ``t`` was
                # uninitialised: a model then learns label 0)
                _take_kept(sc, t, _MESSAGES.broadcast(c.group_ranks, c.index, c.root))
            return p, sc
        if op == "reduce":
            t = _one(c.input, "reduce")
            root = self.global_ranks.index(c.root)
            p = C.plan_once(C.plan_reduce, n, G, t.shape, root, red, dtype=t.dtype, factor=factor)
            return p, self._sandbox_call(p, tensor=t)
        if op == "all_gather":
            x = _one(c.input, "all_gather")
            p = C.plan_once(C.plan_all_gather, n, G, x.shape, dtype=x.dtype)
            return p, self._sandbox_call(p, output=c.output, input=x)
        if op == "reduce_scatter":
            out = _one(c.output, "reduce_scatter")
            p = C.plan_once(C.plan_reduce_scatter, n, G, out.shape, red, dtype=out.dtype, factor=factor)
            return p, self._sandbox_call(p, output=out, input=c.input)
        if op == "all_to_all":
            x = c.input if isinstance(c.input, torch.Tensor) else None
            if x is None:  # alltoall(outputs, inputs): one tensor per member, as the recording's
                # rows (first dimension) and row size (the first input's trailing dimensions)
                ins, outs = list(c.input), list(c.output)
                row_numel = math.prod(ins[0].shape[1:]) if ins and ins[0].dim() else 1
                rows = [t.shape[0] if t.dim() else 1 for t in ins]
                cols = [t.shape[0] if t.dim() else 1 for t in outs]
                if any(t.numel() != r * row_numel for t, r in zip([*ins, *outs], [*rows, *cols])):
                    raise EmulateError(
                        f"{c.where()}: all_to_all tensors whose trailing dimensions differ "
                        f"are not supported in emulation"
                    )
                sp = C.splits_matrix(n, rows={g: rows}, cols={g: cols})
                p = C.plan_once(C.plan_all_to_all, n, G, sp, row_numel=row_numel, dtype=ins[0].dtype)
                return p, self._sandbox_call(p, output=outs, input=ins)
            if not (c.in_splits or c.out_splits):
                p = C.plan_once(C.plan_all_to_all, n, G, None, numel=x.numel(), dtype=x.dtype)
                return p, self._sandbox_call(p, output=c.output, input=x)
            # uneven: this member knows its own row (what it sends) and column (what it
            # receives), which is all its small call reads
            out = c.output
            isp = list(c.in_splits) or [(x.shape[0] if x.dim() else 0) // n] * n
            osp = list(c.out_splits) or [(out.shape[0] if out.dim() else 0) // n] * n
            sp = C.splits_matrix(n, rows={g: isp}, cols={g: osp})
            p = C.plan_once(C.plan_all_to_all, n, G, sp, row_numel=math.prod(x.shape[1:]), dtype=x.dtype)
            return p, self._sandbox_call(p, output=out, input=x)
        if op in ("send", "recv"):
            peer = self.global_ranks.index(c.peer)
            src, dst = (g, peer) if op == "send" else (peer, g)
            t = _one(c.input if op == "send" else c.output, op)
            p = C.plan_once(C.plan_send, n, G, src, dst, t.shape, tag=tag, dtype=t.dtype)
            sc = self._sandbox_call(p, tensor=t)
            if op == "recv" and _MESSAGES is not None and c.peer not in _SANDBOX:
                # a virtual sender's small send the capture kept (a count, a flag, a small model's
                # activations), in place of what the assistant sends (zeros). Every receive from a
                # virtual sender takes its number here, in the program's order (point-to-point
                # calls never take the native lane's templates)
                _take_kept(sc, t, _MESSAGES.sent(c.group_ranks, c.peer, c.rank))
            return p, sc
        if op == "gather":
            x = _one(c.input, "gather")
            p = C.plan_once(C.plan_gather, n, G, x.shape, self.global_ranks.index(c.root), dtype=x.dtype)
            return p, self._sandbox_call(p, input=x, output=c.output)
        if op == "scatter":
            out = _one(c.output, "scatter")
            p = C.plan_once(C.plan_scatter, n, G, out.shape, self.global_ranks.index(c.root), dtype=out.dtype)
            return p, self._sandbox_call(p, input=c.input, output=out)
        if op == "barrier":
            p = C.plan_once(C.plan_barrier, n, G)
            return p, self._sandbox_call(p)
        raise EmulateError(f"{c.where()}: {op} is not supported in emulation")

    def _plans(self, calls: list[Call], tag: int) -> tuple[list[C.SmallCall], list]:
        """Each call's small call, and the (call, outputs) pairs to compare with the recording."""
        smalls, checks = [], []
        for c in calls:
            try:
                _, sc = self._plan(c, tag)
            except C.PruningError as e:
                raise EmulateError(f"{c.where()}: {e}") from None
            smalls.append(sc)
            if _CHECK is not None:
                got = c.targets or ([_one(c.input, c.op)] if c.op == "broadcast" else [])
                if got:
                    checks.append((c, got))
                    _CHECK.issued(c)
        return smalls, checks

    def _run(self, calls: list[Call], ins, outs, opts: Any = None, tag: int = 0, inline: bool = False):
        """Issue every call on the small group; one PrunedWork for all of them (inside an
        NCCL batch: nothing yet, as NCCL returns no Work there; the batch's Work comes from
        ``_end_coalescing``). With the issue thread, an asynchronous call on the GPU is issued
        there (:meth:`_run_later`), unless ``inline``."""
        t0 = stamp()
        tensors = solo._flat(ins) + solo._flat(outs)
        cuda = any(t.device.type == "cuda" for t in tensors)  # not is_cuda: --cuda-on-cpu maps it
        if cuda != (self.backend == "nccl") and tensors:
            raise EmulateError(
                f"{calls[0].where()}: {'CUDA' if cuda else 'CPU'} tensors on a group whose "
                f"small group is {self.backend} (one device type per pruned group)"
            )
        if _ISSUE is not None:
            later = not inline and self._nccl_batch is None and self._batch is None and solo._is_async(opts)
            if later and (cuda or _ISSUE_ON_CPU):
                return self._run_later(calls, outs, tag, t0)
            _ISSUE.drain()
        smalls, checks = self._plans(calls, tag)
        if self._native_rows is not None:  # native_call reads them (and lets them go: they hold tensors)
            self._planned = smalls
        if self._nccl_batch is not None:
            self._nccl_batch.append((smalls, solo._flat(outs), checks))
            return None
        self._leave_out(t0, "plan")
        works = self._issue(smalls)  # the real backend's part
        t0 = stamp()
        w = PrunedWork(works, smalls, solo._flat(outs), checks, self._leave_out)
        if self._batch is not None:
            self._batch.append(w)
        self._leave_out(t0, "work")
        return w

    def _issue(self, smalls: list[C.SmallCall]) -> list:
        """Issue the small calls on the small group: their Works."""
        small = self.small()
        return [w for sc in smalls for w in C.issue(small, sc)]

    def _run_later(self, calls: list[Call], outs, tag: int, t0: Stamp) -> PrunedWork:
        """The call's Work now; its plan and small calls on the issue thread, after the point the
        program's stream has reached (a CUDA event: what the collective must see of its tensors)."""
        mark = dev = None
        if self.backend == "nccl":
            dev = torch.device("cuda", torch.cuda.current_device())
            mark = torch.cuda.Event()
            mark.record(torch.cuda.current_stream(dev))  # (a device given: no device-count lookup)
        w = PrunedWork((), (), solo._flat(outs), (), issued=False)
        self.small()  # made on the program's thread, at the group's first call, as without the thread

        def job() -> tuple:
            rec = self.owner._rec
            t1 = stamp()
            if mark is not None:  # after the mark, on the group's own stream
                side = self._side_stream(dev)
                _ISSUE.use_stream(side)
                side.wait_event(mark)
            t2 = stamp()
            smalls, checks = self._plans(calls, tag)
            t3 = stamp()
            works = self._issue(smalls)
            t4 = stamp()
            for part, a, b in (("thread: stream", t1, t2), ("thread: plan", t2, t3), ("thread: call", t3, t4)):
                rec.count_layer_time(part, b[0] - a[0], b[1] - a[1])  # counted, never left out
            rec.calls_off_thread += 1
            return works, smalls, checks

        _ISSUE.submit(w, job)
        self._leave_out(t0, "hand-off")
        return w

    def native_call(self, method: str, rows: list[tuple], program: list[torch.Tensor] | None, *args: Any) -> tuple:
        """A call the native lane hands over (``prismllm/comm/native/pruned_lane.h``): ``method``
        of this backend with the program's arguments, ``rows`` the call's rows in the native log
        (op, api, seq, reduce op code, factor, bytes in, bytes out), ``program`` the program's
        tensors in the lane's order where the call can take the lane (else None). Returns the
        Work, and where the call's one small call can be issued again from those tensors alone,
        its template (``pruning.lane_template``) and the small group (a backend) that issues it."""
        self._native_rows, self._planned = rows, None
        try:
            work = getattr(self, method)(*args)
        finally:
            self._native_rows = None
        smalls, self._planned = self._planned, None
        if program is None or not smalls or len(smalls) != 1 or self._nccl_batch is not None:
            return work, None, None
        template = C.lane_template(smalls[0], program)
        if template is None:
            return work, None, None
        return work, template, self.small()

    # -- calls GeneratedBackend answers without a Call, or without the tag --
    def barrier(self, opts=None):
        self._hold_barrier_tensor(opts)
        return self._run([self._call(1, 0)], [], [])

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        self._run([self._call(1, 0)], [], []).wait()

    def send(self, tensors, dstRank, tag=0):
        g = self._peer(dstRank)
        return self._run([self._call(1, 0, input=tensors[0], output=None, peer=g)], tensors, [], tag=tag)

    def recv(self, tensors, srcRank, tag=0):
        g = self._peer(srcRank)
        t = _one(tensors, "recv")
        expected = self._expected.get(g)
        # a receive that takes a payload is planned here, not on the issue thread: its small call
        # is at hand once _run returns (in the Work, or in the open batch)
        w = self._run([self._call(1, 0, output=t, peer=g)], [], tensors, tag=tag, inline=bool(expected))
        if expected:
            small = w._calls[-1] if w is not None else self._nccl_batch[-1][0][-1]
            _overwrite_after(small, t, expected.popleft())
        return w

    def expect(self, peer: int, payload: list[torch.Tensor] | None) -> None:
        """The next receives from ``peer`` take ``payload``'s tensors, one each in order, in place
        of what their small calls bring (a captured object message); None: no more."""
        if payload is None:
            self._expected.pop(peer, None)
        else:
            self._expected[peer] = collections.deque(payload)

    def recv_anysource(self, tensors, tag=0):
        raise _unsupported(
            self, "recv from any source (src=None)", "the sender of each receive must be known to replay it; "
            "name the source rank (dist.recv(tensor, src=...))"
        )  # fmt: skip

    # -- coalescing: gloo posts ops one by one and the batch's Work waits for all of them;
    # -- NCCL issues the batch's calls together (one NCCL group) --
    def _start_coalescing(self, device):
        if self.supports_coalescing(device):
            self._nccl_batch = []
        else:
            self._batch = []

    def _end_coalescing(self, device):
        if _ISSUE is not None:
            _ISSUE.drain()
        if self._nccl_batch is not None:
            batch, self._nccl_batch = self._nccl_batch, None
            if not batch:
                return None
            smalls = [sc for scs, _, _ in batch for sc in scs]
            outs = [t for _, o, _ in batch for t in o]
            checks = [ck for _, _, cks in batch for ck in cks]
            return PrunedWork(C.issue_batch(self.small(), smalls), smalls, outs, checks)
        batch, self._batch = self._batch or [], None
        # waits on each op's own PrunedWork, so every post step still runs exactly once
        return PrunedWork(batch, [], [t for b in batch for t in b._outputs])

    start_coalescing = _start_coalescing
    end_coalescing = _end_coalescing

    def shutdown(self):
        """Shut the small group down and drop it now (at exit, see :func:`_close_small_groups`),
        not during interpreter teardown, where destroying its threads aborted the process
        ("terminate called without an active exception", ~1 run in 20)."""
        small, self._small = self._small, None
        if small is not None:
            try:
                small.shutdown()
            except Exception:
                pass

    def split_group(self, *a, **k):  # the RecordingProcessGroup splits (_no_split), never its inner
        raise _unsupported(self, "split_group", _SPLIT_FIX)


def _take_kept(small: C.SmallCall, tensor: torch.Tensor, kept: torch.Tensor | None) -> None:
    """Once ``small`` completed (its post step), ``tensor`` holds ``kept``, what the capture kept of
    a virtual rank's broadcast or send, where there is one of its shape and dtype. Written outside
    autograd, as a backend writes: a receive buffer may be a leaf that requires grad
    (``torch.distributed.pipelining``'s are), which an in-place write under grad mode refuses."""
    if kept is None or kept.shape != tensor.shape or kept.dtype != tensor.dtype:
        return

    def write() -> None:
        with torch.no_grad():
            tensor.copy_(kept)

    small.post = write


def _overwrite_after(small: C.SmallCall, tensor: torch.Tensor, payload: torch.Tensor) -> None:
    """Once ``small`` finished (its post step), ``tensor`` holds ``payload``."""
    post = small.post
    if payload.numel() != tensor.numel() or payload.dtype != tensor.dtype:
        raise EmulateError(
            f"a captured object message does not fit the receive: {payload.numel()} {payload.dtype} "
            f"for {tensor.numel()} {tensor.dtype} (capture the graph again with this program)"
        )

    def overwrite() -> None:
        if post is not None:
            post()
        tensor.copy_(payload.reshape(tensor.shape))

    small.post = overwrite


_SPLIT_FIX = "create the subgroup with dist.new_group(ranks) (DeviceMesh: without a bound device_id)"


def _no_split(parent, *a, **k):
    """``split_group`` of a group with virtual members."""
    raise _unsupported(parent._inner, "split_group", _SPLIT_FIX)


def _unsupported(backend: PrunedBackend, what: str, fix: str) -> EmulateError:
    """One line naming the sandbox rank, the call and the group that emulation cannot run."""
    ranks = backend.global_ranks
    where = f"rank {ranks[backend._rank]}: {what} on group {backend.group_name} (ranks {format_ranks(ranks)})"
    return EmulateError(f"{where} is not supported in emulation: {fix}")


__all__ = ["OutputCheck", "PrunedBackend", "PrunedWork", "EmulateError", "create_pg", "prepare"]
