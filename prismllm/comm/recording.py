"""RecordingProcessGroup: a Python ``ProcessGroup`` that records every call and forwards it
to a real one.

Each group the program creates becomes a ``RecordingProcessGroup`` (``install.py`` makes
torch's group creation build it). It holds ``_inner``: a plain C++ ``ProcessGroup`` built the
way ``_new_process_group_helper`` would build the real group (same prefix store, rank, size,
timeout, options), with the real backends registered (``ProcessGroupGloo`` on CPU,
``ProcessGroupNCCL`` on CUDA, both for "cpu:gloo,cuda:nccl"). Every collective method
records a node row and then calls the same method of ``_inner``, so the call goes through
torch's dispatcher to the real backend exactly as it would without prism: values and
behaviour are the real backend's. The same backend objects are also registered on this
group, so ``_get_backend(device)``, ``_device_types`` (which object collectives and
``barrier`` use to pick a device), ``bound_device_id``, ``shutdown`` and sequence numbers
behave as on the real group.

Which methods torch reaches. The public APIs call these Python methods directly; on 2.13
e.g. ``all_gather_into_tensor`` -> ``all_gather_single``, ``reduce_scatter_tensor`` ->
``reduce_scatter_single``, ``all_to_all_single`` -> ``all_to_all_single``, on 2.11
``_allgather_base`` / ``_reduce_scatter_base`` / ``alltoall_base`` (both sets are here, each
forwarding to whichever name the inner group has). C++ callers (DDP's reducer, functional
collectives, DTensor) reach them through the trampoline ``PyProcessGroup``, which overrides
(2.13) allreduce, allreduce_coalesced, allgather, all_gather_single_coalesced (falling back
to allgather_into_tensor_coalesced), reduce_scatter, reduce_scatter_single_coalesced (falling
back to reduce_scatter_tensor_coalesced), all_to_all_single (falling back to alltoall_base),
broadcast, barrier, send, recv; (2.11, read from its header) allreduce, allreduce_coalesced,
allgather, allgather_into_tensor_coalesced, alltoall_base, reduce_scatter,
reduce_scatter_tensor_coalesced, broadcast, barrier, send, recv. Other C++ entry points (e.g.
``_allgather_base`` called from C++) are not trampolined and go straight to the registered
backend, unrecorded.

Works. A call returns a ``RecordingWork`` (a Python ``dist.Work`` subclass) that forwards
everything to the real Work and tells the recorder when the program waits on it. Python
callers get the object itself; C++ callers get it through the trampoline's
``PyWorkHolder`` (present in 2.11 and 2.13), which keeps it alive and forwards ``wait`` and
``get_future`` to it (a C++ caller's other Work calls reach the holder's base class, exactly
as they would for any Python process group). The recorder also holds a reference until the
Work is waited on or settled. A backend call that raises leaves no row (``_cancel``).
"""

from __future__ import annotations

import collections
import inspect
import operator
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from prismllm.comm.recorder import Recorder, dtype_name
from prismllm.comm.recording_work import RecordingWork

_C = torch._C._distributed_c10d
_getframe = sys._getframe
_HAS_ASYNC_OP = hasattr(_C.AllreduceOptions(), "asyncOp")
# A group's hook on the program's waits: real Work -> callback to run when the program waits on
# it, or None (record mode with --save-tensors: prismllm.comm.saving.on_wait).
OnWait = Callable[[Any], Callable[[], None] | None]
# How a group splits (``dist.split_group``): (parent, ranks, timeout, opts, group_name,
# group_desc, device_types) -> the new group, or None where this rank is not in it.
Split = Callable[..., Any]

# Code objects used to tell the synchronous send/recv (isend + wait) from isend/irecv.
_ISEND = c10d.isend.__code__
_IRECV = c10d.irecv.__code__
_SEND = inspect.unwrap(c10d.send).__code__
_RECV = inspect.unwrap(c10d.recv).__code__


def _called_sync(api_code, sync_code) -> bool:
    """True when the caller chain is ``send -> isend -> here`` (resp. recv -> irecv)."""
    try:
        f = _getframe(2)
    except ValueError:
        return False
    if f.f_code is not api_code:
        return False
    f = f.f_back
    return f is not None and f.f_code is sync_code


def _nbytes(ts) -> int:
    n = 0
    for t in ts:
        n += t.nbytes
    return n


_SUM, _AVG = dist.ReduceOp.SUM, dist.ReduceOp.AVG


def _red(opts) -> Any:
    """The reduce op of ``opts`` as the recorder keeps it (``redop_name`` reads both): "sum" or
    "avg", else the ReduceOp. pybind hands ``opts.reduceOp`` out tied to ``opts`` (keep-alive),
    so a ReduceOp kept in a row holds that call's options object alive: ~1 µs a call more
    (measured on CPU), and two objects a row that a long run accumulates."""
    op = opts.reduceOp
    if op == _SUM:
        return "sum"
    if op == _AVG:
        return "avg"
    return op


def _rows_of(ts) -> list[int]:
    return [t.shape[0] if t.dim() else 1 for t in ts]


def _inner_method(name: str, *alternatives: str):
    """The inner ProcessGroup's method ``name``, or the first alternative this torch has."""
    for n in (name, *alternatives):
        if hasattr(_C.ProcessGroup, n):
            return n
    return name


# Method names differ by torch version (2.11 vs 2.13): forward to the one that exists.
_AG_BASE = _inner_method("all_gather_single", "_allgather_base")
RS_BASE = _inner_method("reduce_scatter_single", "_reduce_scatter_base")
_A2A_BASE = _inner_method("all_to_all_single", "alltoall_base")
_AG_COAL = _inner_method("all_gather_single_coalesced", "allgather_into_tensor_coalesced")
RS_COAL = _inner_method("reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced")


LAST_WORKS_HELD = 8  # per gloo group: see RecordingProcessGroup._last_works


class RecordingProcessGroup(dist.ProcessGroup):
    def __init__(
        self,
        store: Any,
        rank: int,
        size: int,
        inner: Any,
        group_name: str,
        global_ranks: list[int],
        real_backend: str,
        rec: Recorder,
        *,
        split: Split | None = None,
        on_wait: OnWait | None = None,
    ):
        """``split``: how ``split_group`` makes a subgroup (None: not supported here);
        ``on_wait``: the hook on the program's waits (None: none). The creator of the group
        passes both: the backends differ by mode, and the group does not know them."""
        super().__init__(rank, size)  # (store, rank, size) cannot build a Python subclass
        self._store = store
        self._inner = inner
        self._prism_group_name = group_name
        self._global_ranks = global_ranks
        self._real_backend = real_backend
        self._rec = rec
        self._split = split
        self._on_wait_hook = on_wait
        self._seq = 0
        self._p2p: dict[tuple[int, str], int] = {}
        # gloo's last Works, held (comm.recording_work.hold_to_the_end): gloo's worker threads
        # drop their own reference after completing a Work, at most one each (two by default),
        # but they complete Works out of the order they were issued in: the two a worker still
        # holds need not be the last two (an 8-rank test aborted about 1 run in 4 with two held)
        self._last_works: collections.deque | None = (
            collections.deque(maxlen=LAST_WORKS_HELD) if "nccl" not in real_backend else None
        )

    # ---- identity ----------------------------------------------------------------------
    @property
    def group_name(self) -> str:
        return self._prism_group_name

    def getBackendName(self) -> str:
        return self._inner.name()

    def name(self) -> str:
        return self._inner.name()

    def get_group_store(self):
        return self._store

    def __repr__(self) -> str:
        return (
            f"RecordingProcessGroup(name={self._prism_group_name!r}, rank={self.rank()}, "
            f"size={self.size()}, backend={self._real_backend!r})"
        )

    # ---- helpers -----------------------------------------------------------------------
    def _next_seq(self) -> int:
        s = self._seq
        self._seq = s + 1
        return s

    def _p2p_seq(self, peer: int, op: str) -> int:
        key = (peer, op)
        s = self._p2p.get(key, 0)
        self._p2p[key] = s + 1
        return s

    def _global(self, group_rank: int) -> int:
        gr = self._global_ranks
        return gr[group_rank] if 0 <= group_rank < len(gr) else -1

    def _row(self, op, api, t, inb, outb, red="", peer=-1, tag=0, insp=(), outsp=(), seq=None,
             same=-1):  # fmt: skip
        return self._rec.issue(
            op, api, self._prism_group_name, self._next_seq() if seq is None else seq, peer,
            tag, red, dtype_name(t.dtype), t.shape, inb, outb, insp, outsp, t.device.type == "cuda", same,
        )  # fmt: skip

    def _cancel(self, rows) -> None:
        """The real backend raised: the call did not happen; undo its rows and numbering."""
        rec = self._rec
        for j in rows:
            op = rec.m_op[j]
            if op in ("send", "recv"):
                key = (rec.m_peer[j], op)
                if rec.m_seq[j] >= 0 and self._p2p.get(key, 0) > 0:
                    self._p2p[key] -= 1
            else:
                self._seq -= 1
        rec.cancel(tuple(rows))

    def _done(self, work, rows: tuple, is_async: bool):
        w = RecordingWork(work, self, rows) if work is not None else None
        self._rec.issued(w, rows, not is_async)
        return w

    def _coalesced(self, op, api, red, outs, ins, out_bytes_each, call):
        """One row per tensor pair of a *_coalesced call, sharing a coalesced id."""
        rec = self._rec
        rec.begin_coalesce()
        try:
            rows = []
            first = -1
            for o, i in zip(outs, ins):
                row = self._row(op, api, i, i.nbytes, out_bytes_each(o), red, same=first)
                if first < 0:
                    first = row
                rows.append(row)
            rows = tuple(rows)
        finally:
            rec.end_coalesce()
        try:
            return rows, call()
        except BaseException:
            self._cancel(rows)
            raise

    # ---- all-reduce ----------------------------------------------------------------------
    def allreduce(self, tensors, opts=None, *args):
        if isinstance(tensors, torch.Tensor):  # allreduce(tensor, op=SUM, timeout=None)
            tensors = [tensors]
            o = _C.AllreduceOptions()
            if opts is not None:
                o.reduceOp = opts
            if args and args[0] is not None:
                o.timeout = args[0]
            opts = o
        elif opts is None:
            opts = _C.AllreduceOptions()
        t = tensors[0]
        nb = t.nbytes if len(tensors) == 1 else _nbytes(tensors)
        rec = self._rec
        seq = self._seq
        self._seq = seq + 1
        row = rec.issue(
            "all_reduce", "allreduce", self._prism_group_name, seq, -1, 0, _red(opts),
            dtype_name(t.dtype), t.shape, nb, nb, (), (), t.device.type == "cuda",
        )  # fmt: skip
        try:
            work = self._inner.allreduce(tensors, opts)
        except BaseException:
            self._cancel((row,))
            raise
        w = RecordingWork(work, self, (row,)) if work is not None else None
        rec.issued(w, (row,), not opts.asyncOp if _HAS_ASYNC_OP else False)
        return w

    def allreduce_coalesced(self, tensors, opts=None):
        if opts is None:
            opts = _C.AllreduceCoalescedOptions()
        red = _red(opts)
        rows, work = self._coalesced(
            "all_reduce", "allreduce_coalesced", red, tensors, tensors, lambda o: o.nbytes,
            lambda: self._inner.allreduce_coalesced(tensors, opts),
        )  # fmt: skip
        return self._done(work, rows, (opts.asyncOp if _HAS_ASYNC_OP else True))

    # ---- all-gather ----------------------------------------------------------------------
    def allgather(self, output_tensors, input_tensors, opts=None):
        if opts is None:
            opts = _C.AllgatherOptions()
        if isinstance(input_tensors, torch.Tensor):  # allgather(list, tensor, timeout)
            output_tensors, input_tensors = [output_tensors], [input_tensors]
        t = input_tensors[0]
        outb = sum(_nbytes(ol) for ol in output_tensors)
        row = self._row("all_gather", "allgather", t, _nbytes(input_tensors), outb)
        try:
            work = self._inner.allgather(output_tensors, input_tensors, opts)
        except BaseException:
            self._cancel((row,))
            raise
        return self._done(work, (row,), (opts.asyncOp if _HAS_ASYNC_OP else True))

    def _ag_base(self, api, output, input, opts):
        if opts is None:
            opts = _C.AllgatherOptions()
        row = self._row("all_gather", api, input, input.nbytes, output.nbytes)
        try:
            work = getattr(self._inner, _AG_BASE)(output, input, opts)
        except BaseException:
            self._cancel((row,))
            raise
        return self._done(work, (row,), (opts.asyncOp if _HAS_ASYNC_OP else True))

    def _allgather_base(self, output, input, opts=None):
        return self._ag_base("_allgather_base", output, input, opts)

    def all_gather_single(self, output, input, opts=None):
        return self._ag_base("all_gather_single", output, input, opts)

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        if opts is None:
            opts = _C.AllgatherOptions()
        rows, work = self._coalesced(
            "all_gather", "allgather_coalesced", "", output_lists, input_list, _nbytes,
            lambda: self._inner.allgather_coalesced(output_lists, input_list, opts),
        )  # fmt: skip
        return self._done(work, rows, (opts.asyncOp if _HAS_ASYNC_OP else True))

    def _ag_coal(self, api, outputs, inputs, opts):
        if opts is None:
            opts = _C.AllgatherOptions()
        rows, work = self._coalesced(
            "all_gather", api, "", outputs, inputs, lambda o: o.nbytes,
            lambda: getattr(self._inner, _AG_COAL)(outputs, inputs, opts),
        )  # fmt: skip
        return self._done(work, rows, (opts.asyncOp if _HAS_ASYNC_OP else True))

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        return self._ag_coal("all_gather_single_coalesced", outputs, inputs, opts)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        return self._ag_coal("allgather_into_tensor_coalesced", outputs, inputs, opts)

    # ---- reduce-scatter ------------------------------------------------------------------
    def reduce_scatter(self, output_tensors, input_tensors, opts=None, *args):
        if isinstance(output_tensors, torch.Tensor):  # reduce_scatter(out, list, op, timeout)
            output_tensors, input_tensors = [output_tensors], [input_tensors]
            o = _C.ReduceScatterOptions()
            if opts is not None:
                o.reduceOp = opts
            if args and args[0] is not None:
                o.timeout = args[0]
            opts = o
        elif opts is None:
            opts = _C.ReduceScatterOptions()
        t = input_tensors[0][0]
        inb = sum(_nbytes(il) for il in input_tensors)
        row = self._row(
            "reduce_scatter", "reduce_scatter", t, inb, _nbytes(output_tensors),
            _red(opts),
        )  # fmt: skip
        try:
            work = self._inner.reduce_scatter(output_tensors, input_tensors, opts)
        except BaseException:
            self._cancel((row,))
            raise
        return self._done(work, (row,), (opts.asyncOp if _HAS_ASYNC_OP else True))

    def _rs_base(self, api, output, input, opts):
        if opts is None:
            opts = _C.ReduceScatterOptions()
        row = self._row("reduce_scatter", api, input, input.nbytes, output.nbytes, _red(opts))
        try:
            work = getattr(self._inner, RS_BASE)(output, input, opts)
        except BaseException:
            self._cancel((row,))
            raise
        return self._done(work, (row,), (opts.asyncOp if _HAS_ASYNC_OP else True))

    def _reduce_scatter_base(self, output, input, opts=None):
        return self._rs_base("_reduce_scatter_base", output, input, opts)

    def reduce_scatter_single(self, output, input, opts=None):
        return self._rs_base("reduce_scatter_single", output, input, opts)

    def _rs_coal(self, api, outputs, inputs, opts):
        if opts is None:
            opts = _C.ReduceScatterOptions()
        rows, work = self._coalesced(
            "reduce_scatter", api, _red(opts), outputs, inputs,
            lambda o: o.nbytes, lambda: getattr(self._inner, RS_COAL)(outputs, inputs, opts),
        )  # fmt: skip
        return self._done(work, rows, (opts.asyncOp if _HAS_ASYNC_OP else True))

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        return self._rs_coal("reduce_scatter_single_coalesced", outputs, inputs, opts)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        return self._rs_coal("reduce_scatter_tensor_coalesced", outputs, inputs, opts)

    # ---- all-to-all ----------------------------------------------------------------------
    def alltoall(self, output_tensors, input_tensors, opts=None):
        if opts is None:
            opts = _C.AllToAllOptions()
        t = input_tensors[0]
        row = self._row(
            "all_to_all", "alltoall", t, _nbytes(input_tensors), _nbytes(output_tensors),
            insp=_rows_of(input_tensors), outsp=_rows_of(output_tensors),
        )  # fmt: skip
        try:
            work = self._inner.alltoall(output_tensors, input_tensors, opts)
        except BaseException:
            self._cancel((row,))
            raise
        return self._done(work, (row,), (opts.asyncOp if _HAS_ASYNC_OP else True))

    def _a2a_base(self, api, output, input, output_split_sizes, input_split_sizes, opts):
        if opts is None:
            opts = _C.AllToAllOptions()
        # what torch's C++ binding makes of the sizes (any __index__ type: numpy integers, a
        # numpy array, 0-d tensors); a Python group receives them as the program passed them
        # (Megatron-core's MoE dispatcher: a numpy array), and a rank log holds plain ints
        output_split_sizes = [operator.index(x) for x in output_split_sizes]
        input_split_sizes = [operator.index(x) for x in input_split_sizes]
        row = self._row(
            "all_to_all", api, input, input.nbytes, output.nbytes,
            insp=list(input_split_sizes), outsp=list(output_split_sizes),
        )  # fmt: skip
        try:
            work = getattr(self._inner, _A2A_BASE)(output, input, output_split_sizes, input_split_sizes, opts)
        except BaseException:
            self._cancel((row,))
            raise
        return self._done(work, (row,), (opts.asyncOp if _HAS_ASYNC_OP else True))

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        return self._a2a_base("all_to_all_single", output, input, output_split_sizes, input_split_sizes, opts)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        return self._a2a_base("alltoall_base", output, input, output_split_sizes, input_split_sizes, opts)

    # ---- rooted collectives ----------------------------------------------------------------
    def broadcast(self, tensors, opts=None, *args):
        if isinstance(tensors, torch.Tensor):  # broadcast(tensor, root, timeout=None)
            tensors = [tensors]
            o = _C.BroadcastOptions()
            o.rootRank = int(opts)
            o.rootTensor = 0
            if args and args[0] is not None:
                o.timeout = args[0]
            opts = o
        elif opts is None:
            opts = _C.BroadcastOptions()
        root = opts.rootRank
        t = tensors[0]
        nb = _nbytes(tensors)
        is_root = root == self.rank()
        row = self._row(
            "broadcast", "broadcast", t, nb if is_root else 0, 0 if is_root else nb,
            peer=self._global(root),
        )  # fmt: skip
        try:
            work = self._inner.broadcast(tensors, opts)
        except BaseException:
            self._cancel((row,))
            raise
        return self._done(work, (row,), (opts.asyncOp if _HAS_ASYNC_OP else True))

    def reduce(self, tensors, opts=None, *args):
        if isinstance(tensors, torch.Tensor):  # reduce(tensor, root, op=SUM, timeout=None)
            tensors = [tensors]
            o = _C.ReduceOptions()
            o.rootRank = int(opts)
            o.rootTensor = 0
            if args:
                o.reduceOp = args[0]
            if len(args) > 1 and args[1] is not None:
                o.timeout = args[1]
            opts = o
        elif opts is None:
            opts = _C.ReduceOptions()
        root = opts.rootRank
        t = tensors[0]
        nb = _nbytes(tensors)
        row = self._row(
            "reduce", "reduce", t, nb, nb if root == self.rank() else 0,
            _red(opts), peer=self._global(root),
        )  # fmt: skip
        try:
            work = self._inner.reduce(tensors, opts)
        except BaseException:
            self._cancel((row,))
            raise
        return self._done(work, (row,), (opts.asyncOp if _HAS_ASYNC_OP else True))

    def gather(self, output_tensors, input_tensors, opts=None):
        if opts is None:
            opts = _C.GatherOptions()
        root = opts.rootRank
        t = input_tensors[0]
        outb = sum(_nbytes(ol) for ol in output_tensors)
        row = self._row("gather", "gather", t, _nbytes(input_tensors), outb, peer=self._global(root))
        try:
            work = self._inner.gather(output_tensors, input_tensors, opts)
        except BaseException:
            self._cancel((row,))
            raise
        return self._done(work, (row,), (opts.asyncOp if _HAS_ASYNC_OP else True))

    def scatter(self, output_tensors, input_tensors, opts=None):
        if opts is None:
            opts = _C.ScatterOptions()
        root = opts.rootRank
        inb = sum(_nbytes(il) for il in input_tensors)
        t = input_tensors[0][0] if input_tensors and input_tensors[0] else output_tensors[0]
        row = self._row("scatter", "scatter", t, inb, _nbytes(output_tensors), peer=self._global(root))
        try:
            work = self._inner.scatter(output_tensors, input_tensors, opts)
        except BaseException:
            self._cancel((row,))
            raise
        return self._done(work, (row,), (opts.asyncOp if _HAS_ASYNC_OP else True))

    # ---- barriers --------------------------------------------------------------------------
    def barrier(self, opts=None):
        if opts is None or not isinstance(opts, _C.BarrierOptions):  # barrier(timeout)
            o = _C.BarrierOptions()
            if opts is not None:
                o.timeout = opts
            opts = o
        rec = self._rec
        row = rec.issue(
            "barrier", "barrier", self._prism_group_name, self._next_seq(), -1, 0, "", "", (),
            0, 0, (), (), _barrier_on_cuda(self, opts),
        )  # fmt: skip
        try:
            work = self._inner.barrier(opts)
        except BaseException:
            self._cancel((row,))
            raise
        return self._done(work, (row,), (opts.asyncOp if _HAS_ASYNC_OP else True))

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        rec = self._rec
        row = rec.issue(
            "barrier", "monitored_barrier", self._prism_group_name, self._next_seq(), -1, 0,
            "", "", (), 0, 0, (), (), False,
        )  # fmt: skip
        try:
            if timeout is None:
                r = self._inner.monitored_barrier(wait_all_ranks=wait_all_ranks)
            else:
                r = self._inner.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)
        finally:
            rec.issued(None, (row,), True)
        return r

    # ---- point-to-point ----------------------------------------------------------------------
    def send(self, tensors, dstRank, tag=0):
        t = tensors[0]
        peer = self._global(dstRank)
        row = self._row(
            "send", "send", t, _nbytes(tensors), 0, peer=peer, tag=tag,
            seq=self._p2p_seq(peer, "send"),
        )  # fmt: skip
        try:
            work = self._inner.send(tensors, dstRank, tag)
        except BaseException:
            self._cancel((row,))
            raise
        return self._done(work, (row,), not _called_sync(_ISEND, _SEND))

    def recv(self, tensors, srcRank, tag=0):
        t = tensors[0]
        peer = self._global(srcRank)
        row = self._row(
            "recv", "recv", t, 0, _nbytes(tensors), peer=peer, tag=tag,
            seq=self._p2p_seq(peer, "recv"),
        )  # fmt: skip
        try:
            work = self._inner.recv(tensors, srcRank, tag)
        except BaseException:
            self._cancel((row,))
            raise
        return self._done(work, (row,), not _called_sync(_IRECV, _RECV))

    def recv_anysource(self, tensors, tag=0):
        t = tensors[0]
        row = self._row("recv", "recv_anysource", t, 0, _nbytes(tensors), peer=-1, tag=tag, seq=-1)
        try:
            work = self._inner.recv_anysource(tensors, tag)
        except BaseException:
            self._cancel((row,))
            raise
        w = self._done(work, (row,), not _called_sync(_IRECV, _RECV))
        if w is not None:
            w._anysource = True
        return w

    # ---- coalescing ------------------------------------------------------------------------
    def _start_coalescing(self, device):
        self._rec.begin_coalesce()
        self._inner._start_coalescing(device)

    def _end_coalescing(self, device):
        rec = self._rec
        try:
            work = self._inner._end_coalescing(device)
        finally:
            rows = rec.end_coalesce()
        if work is None:  # nothing to wait on: the batch's rows completed here
            rec.complete_rows(rows)
            return None
        w = RecordingWork(work, self, tuple(rows))
        rec.bind_batch(w, rows)
        return w

    # Names the newer trampoline (torch > 2.13) calls for C++-side coalescing.
    def start_coalescing(self, device):
        return self._start_coalescing(device)

    def end_coalescing(self, device):
        return self._end_coalescing(device)

    # ---- group creation ------------------------------------------------------------------
    def split_group(
        self,
        ranks,
        timeout=None,
        opts=None,
        group_name=None,
        group_desc=None,
        device_types=None,
    ):
        """``dist.split_group`` (used by DeviceMesh when the default group has a bound device):
        a subgroup of this group's ranks, made the way this group's creator says."""
        if self._split is None:
            raise RuntimeError(f"split_group is not supported on group {self._prism_group_name!r} in this mode")
        return self._split(self, ranks, timeout, opts, group_name, group_desc, device_types)


def _barrier_on_cuda(pg: RecordingProcessGroup, opts) -> bool:
    dev = getattr(opts, "device", None)
    return dev is not None and getattr(dev, "type", "cpu") == "cuda"


__all__ = ["RecordingProcessGroup", "RecordingWork"]
