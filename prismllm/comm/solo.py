"""Solo mode: one process that believes it is rank r of a world of N runs the program alone.

``PRISM_MODE=solo`` (with torchrun's RANK/WORLD_SIZE/...): ``install("solo")`` makes the
virtual world bootstrap without peers --

* rendezvous: ``env://`` and ``tcp://`` build their store through
  ``torch.distributed.rendezvous._create_c10d_store``, replaced by a local ``HashStore``
  (nothing listens, nothing waits for absent ranks); ``dist.TCPStore`` is replaced by
  :class:`SoloTCPStore` (a ``HashStore`` taking TCPStore's arguments) so programs that build
  their own store and pass ``store=`` do not wait either; ``_store_based_barrier`` (used
  when TORCH_DIST_INIT_BARRIER=1) is a no-op;
* groups: every group this rank is a member of is a ``RecordingProcessGroup`` (exactly as in
  record mode, so every call is recorded the same way) whose ``_inner`` is a
  :class:`GeneratedBackend` instead of a real ProcessGroup. Groups this rank is not a member
  of are never instantiated (torch returns NON_GROUP_MEMBER before the creator): creating
  thousands of them costs only torch's own bookkeeping. ``split_group`` builds the split
  directly (no communicator to split);
* on the group itself (what torch's ``_get_backend(device)``/``_device_types`` see) a C++
  backend is registered per device, since a C++ ``Backend`` cannot be implemented in Python:
  for an nccl device a ``FakeProcessGroup`` of the group's rank and size; for a gloo device
  a real ``ProcessGroupGloo``, because C++ code casts a group's GLOO backend to that class
  (DDP's Logger reads its thread count; a FakeProcessGroup there is a SIGSEGV). That one is
  a single 1-rank ProcessGroupGloo shared by every group (made once: 1 worker thread, a
  loopback device, a private HashStore; nothing per group, so 2000 groups take as long as
  with FakeProcessGroups, ~0.3 s). Being shared and of 1 rank, it reports rank 0 of 1 and
  names every group, to C++ ``ProcessGroup::getGroupName``, after the last one created;
  neither torch 2.13's Python nor DDP reads these (they read the group's own rank, size
  and ``group_name``, which RecordingProcessGroup answers). These backends are only
  consulted for metadata; every collective reaches the Python methods (directly, or
  through the trampoline for C++ callers). ``supports_coalescing`` is answered from the
  program's real backend (NCCL: yes, gloo: no) so ``batch_isend_irecv`` takes the same
  path as in a real run;
* object collectives (``broadcast_object_list``, ``all_gather_object``, ``gather_object``,
  ``scatter_object_list``, ``recv_object_list``) are wrapped to let rules answer with
  objects; by default the objects the capture's other solo ranks contributed to the call,
  else the local object(s) replicated (``prismllm.comm.solo_objects``).

The GeneratedBackend fills the program's own output tensors in place from the tensor
generator and returns already-completed Works (``_create_work_from_future``, as torch's
``multi_threaded_pg``). Sends complete at once; receives are filled by the generator.

Memory (GPU). What the caching allocator sees must be what ProcessGroupNCCL causes (torch
>= 2.8, the GPU machines' 2.11; checked against its source and by benchmarks/solo_memory.py):

* a collective with ``asyncOp`` False runs on the *current* stream: no side stream, no
  ``recordStream``, no reference kept, no Work returned (``None``);
* an async collective runs on the group's own stream, which first waits on the current
  stream; its inputs and outputs are *stashed* in the Work until ``wait()`` (inside a
  coalescing scope: in the scope's shelf, handed to the batch's Work), and the Work's Future
  holds the outputs for the Work's life;
* send/recv run on the group's stream and ``recordStream`` the tensor on it (no stash); an
  unbatched one returns a Work whose Future holds that tensor; inside a coalescing scope
  (``batch_isend_irecv``) no per-op reference is kept;
* the batch's Work (``end_coalescing``) holds nothing but the shelf, released at ``wait()``;
  its Future's value is empty.

NCCL allocates nothing through the caching allocator (its buffers are its own). The
GeneratedBackend follows these rules on CUDA tensors, and fills in place
(``copy_``/``mul_``/``zero_`` on the program's tensors and views). It allocates nothing on
the device: a broadcast's check for uninitialised memory reads a host copy, and a rule's or
the store's returned tensor is copied from wherever it lives (the store's: the host).
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from prismllm.childenv import ChildEnv
from prismllm.comm import solo_objects
from prismllm.comm.recorder import redop_name
from prismllm.comm.recording import RecordingProcessGroup
from prismllm.generate.generator import Call, TensorGenerator

_C = torch._C._distributed_c10d
_ORIG: dict[str, Any] = {}
_GEN: TensorGenerator | None = None


class SoloTCPStore(dist.HashStore):
    """``dist.TCPStore`` in solo mode: same arguments, a local store, no waiting."""

    def __init__(self, host_name="127.0.0.1", port=0, world_size=None, is_master=False,
                 timeout=None, wait_for_workers=True, multi_tenant=False,
                 master_listen_fd=None, use_libuv=True):  # fmt: skip
        super().__init__()
        self._host, self._port = host_name, port

    @property
    def host(self):
        return self._host

    @property
    def port(self):
        return self._port

    @property
    def libuvBackend(self):
        return True


def generator() -> TensorGenerator | None:
    return _GEN


def prepare(rank: int, child: ChildEnv) -> TensorGenerator:
    """Patch torch for a world without peers; build the tensor generator."""
    global _GEN

    _GEN = TensorGenerator.for_rank(rank, child.rules, child.tensor_store)
    if _ORIG:
        return _GEN
    local_rendezvous()
    solo_objects.install(_GEN, child)
    return _GEN


def local_rendezvous() -> None:
    """Every store this process makes is a local one and nothing waits for a peer at start-up
    (the module docstring's first point; switch mode's too)."""
    if "create_store" in _ORIG:
        return
    rdzv = importlib.import_module("torch.distributed.rendezvous")
    _ORIG["create_store"] = rdzv._create_c10d_store
    rdzv._create_c10d_store = lambda *a, **k: dist.HashStore()
    _ORIG["TCPStore"] = dist.TCPStore
    dist.TCPStore = SoloTCPStore
    c10d.TCPStore = SoloTCPStore
    _ORIG["barrier"] = c10d._store_based_barrier
    c10d._store_based_barrier = lambda *a, **k: None


# ---- group creation -------------------------------------------------------------------------
def create_pg(dist_opts, ctx: dict, rec, btypes: dict, backend_class: type[GeneratedBackend] | None = None):
    """The "prism" creator's solo branch: a RecordingProcessGroup over a GeneratedBackend (or
    ``backend_class``, a subclass: switch mode's)."""
    devmap: dict[str, str] = ctx["devmap"]
    prefix_store = dist_opts.store.underlying_store
    rank, size = dist_opts.group_rank, dist_opts.group_size
    group_name = dist_opts.group_id
    granks = list(dist_opts.global_ranks_in_group)
    global_ranks = granks if granks else list(range(size))
    inner = (backend_class or GeneratedBackend)(rank, size, global_ranks, devmap, group_name)
    backend = ctx["backend"]
    pg = RecordingProcessGroup(prefix_store, rank, size, inner, group_name, global_ranks, backend, rec, split=split_pg)
    _attach(pg, inner, devmap, btypes, ctx["device_id"])
    rec.add_group(pg)
    return pg


def _fake(rank: int, size: int, group_name: str, granks: list[int]):
    o = _C.FakeProcessGroup.Options()
    try:
        o.group_name = group_name
        o.global_ranks_in_group = granks
    except Exception:  # pragma: no cover - older torch
        pass
    return _C.FakeProcessGroup._create_internal(rank, size, o)


_GLOO: Any = None


def _gloo() -> Any:
    """The ``ProcessGroupGloo`` registered for gloo devices on every group (see the module
    docstring), made once: one per group would cost a worker thread per group. One worker
    thread, not none: a stray C++ call reaching it then fails or completes, never hangs."""
    global _GLOO
    if _GLOO is None:
        gloo = dist.ProcessGroupGloo
        opts = gloo._Options()
        opts._devices = [gloo.create_device(hostname="127.0.0.1")]
        opts._threads = 1
        _GLOO = gloo(dist.HashStore(), 0, 1, opts)
    return _GLOO


def _attach(pg, inner: GeneratedBackend, devmap, btypes, device_id) -> None:
    inner.owner = pg
    names = list(devmap.values())
    if "," in pg._real_backend or ":" in pg._real_backend or pg._real_backend == "undefined":
        default_type = btypes["nccl"] if "nccl" in names else btypes["gloo"]
    else:
        default_type = btypes[names[0]]
    pg._set_default_backend(default_type)
    for dev, name in devmap.items():
        be = _gloo() if name == "gloo" else _fake(pg.rank(), pg.size(), inner.group_name,
                                                  list(inner.global_ranks))  # fmt: skip
        pg._register_backend(torch.device(dev), btypes[name], be)
    pg._set_group_name(inner.group_name)
    if device_id is not None and getattr(device_id, "index", None) is not None:
        pg.bound_device_id = device_id
    if "nccl" in names and torch.cuda.is_available():
        pg._rec.cuda = True


def split_pg(parent, ranks, timeout=None, opts=None, group_name=None, group_desc=None, device_types=None):
    """``RecordingProcessGroup.split_group`` in solo mode (group ranks of the parent; no
    backend to split, so timeout, options and device types do not matter)."""
    my = parent.rank()
    ranks = sorted(int(r) for r in ranks)
    if my not in ranks:
        return None
    granks = [parent._global_ranks[r] for r in ranks]
    pinner: GeneratedBackend = parent._inner
    name = group_name or c10d._process_group_name(ranks, use_hashed_name=True)
    inner = pinner.split_backend(ranks.index(my), len(ranks), granks, name)
    pg = RecordingProcessGroup(
        parent._store,
        ranks.index(my),
        len(ranks),
        inner,
        name,
        granks,
        parent._real_backend,
        parent._rec,
        split=split_pg,
    )
    btypes = {"gloo": _C.ProcessGroup.BackendType.GLOO, "nccl": _C.ProcessGroup.BackendType.NCCL}
    _attach(pg, inner, pinner.devmap, btypes, parent.bound_device_id)
    if group_desc:
        pg._set_group_desc(group_desc)
    parent._rec.add_group(pg)
    return pg


# ---- the backend ------------------------------------------------------------------------------
def on_stream(device: torch.device | None, stream: Any) -> Any:
    """``stream`` made current on a GPU; nothing on the CPU."""
    return torch.cuda.stream(stream) if device is not None else contextlib.nullcontext()


def _done_future(value: list, device: torch.device | None = None, stream=None) -> torch.futures.Future:
    """A completed Future holding ``value``; on a GPU its events recorded on ``stream``."""
    if device is not None and device.type == "cuda":
        fut = torch.futures.Future(devices=[device])
        with torch.cuda.stream(stream):
            fut.set_result(value)
    else:
        fut = torch.futures.Future()
        fut.set_result(value)
    return fut


def _done_work(outs: list, device: torch.device | None = None, stream=None):
    return _C._create_work_from_future(_done_future(outs, device, stream))


class StashingWork(dist.Work):
    """An async CUDA Work as ProcessGroupNCCL returns it: ``wait()`` makes the current stream
    wait on the group's stream (the events of the Futures of its calls, recorded there when their
    outputs were written) and releases the stashed tensors; its Future holds the outputs."""

    def __init__(self, futs: list[torch.futures.Future], stash: list):
        super().__init__()
        self._futs = futs
        self._stash = stash

    def wait(self, timeout=None) -> bool:
        self.synchronize()
        return True

    def synchronize(self) -> None:
        for f in self._futs:
            f.wait()  # the host until written (switch mode's answers), then the current stream
        self._stash = None

    block_current_stream = synchronize

    def is_completed(self) -> bool:
        return all(f.done() for f in self._futs)

    def is_success(self) -> bool:
        return True

    def exception(self):
        return None

    def get_future(self):
        return self._futs[-1]

    def result(self):
        return self._futs[-1].value()


def _is_async(opts) -> bool:
    return True if opts is None else bool(getattr(opts, "asyncOp", True))


def _flat(ts) -> list[torch.Tensor]:
    out = []
    for t in ts:
        if isinstance(t, torch.Tensor):
            out.append(t)
        elif t is not None:
            out.extend(_flat(t))
    return out


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


class GeneratedBackend:
    """Stands where the real ProcessGroup would be: same methods, outputs generated."""

    def __init__(self, rank: int, size: int, global_ranks: list[int], devmap: dict[str, str],
                 group_name: str):  # fmt: skip
        self._rank = rank
        self._size = size
        self.global_ranks = list(global_ranks)
        self.devmap = dict(devmap)
        self.group_name = group_name
        self.owner = None  # the RecordingProcessGroup (set by _attach)
        self._call_ctx: tuple[tuple[int, ...], str] | None = None  # (members, desc), by the first _call
        self._streams: dict[int, Any] = {}
        self._shelf: list[torch.Tensor] | None = None  # open coalescing scope's tensors
        self._shelf_futs: list[torch.futures.Future] = []  # the scope's calls' Futures (switch mode waits on them)
        self._shelf_async = True
        self._barrier_tensor: torch.Tensor | None = None  # NCCL's, see _hold_barrier_tensor

    # -- identity --
    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def name(self) -> str:
        names = set(self.devmap.values())
        return "nccl" if "nccl" in names and len(names) == 1 else next(iter(names), "gloo")

    def supports_coalescing(self, device) -> bool:
        dev = torch.device(device).type if device is not None else "cpu"
        return self.devmap.get(dev, "") == "nccl"

    def _side_stream(self, dev: torch.device) -> Any:
        """This group's own stream on ``dev`` (made at its first use): the backend's work there
        waits for the program's stream only where it says so, as a communicator's stream does."""
        side = self._streams.get(dev.index)
        if side is None:
            side = self._streams[dev.index] = torch.cuda.Stream(device=dev)
        return side

    # -- the call's context --
    def _call(self, op_rows: int, k: int, **kw) -> Call:
        """A Call for row ``k`` of the ``op_rows`` rows the owner just issued."""
        pg = self.owner
        rec = pg._rec
        j = len(rec.m_op) - op_rows + k
        ctx = self._call_ctx
        if ctx is None:  # the group's members and description, once (torch sets both at creation)
            try:
                desc = pg.group_desc
            except Exception:
                desc = ""
            ctx = self._call_ctx = (tuple(self.global_ranks), desc or "")
        return Call(
            rank=rec.rank, op=rec.m_op[j], api=rec.m_api[j], group_ranks=ctx[0],
            group_desc=ctx[1], group_name=self.group_name, group_rank=self._rank,
            index=rec.m_seq[j], label=rec.m_label[j], reduce_op=redop_name(rec.m_red[j]),
            **kw,
        )  # fmt: skip

    def _write(self, calls: list[Call], device: torch.device | None, stream, value: list) -> torch.futures.Future:
        """Write the calls' outputs (on ``stream`` on a GPU) and return the Future their Work
        holds, with ``value``, its events on ``stream``: here the generator's outputs, written at
        once (switch mode's backend: the coordinator's, the Future completed once they are written)."""
        with on_stream(device, stream):
            for c in calls:
                if c.output is not None:
                    _GEN.fill(c)
                else:
                    _GEN.sent(c)
        return _done_future(value, device, stream)

    def _run(self, calls: list[Call], ins, outs, opts=None, *, p2p: bool = False):
        """Fill every call's outputs and return the Work (or None) that ProcessGroupNCCL
        would return, holding what it would hold (module docstring); on CPU a completed
        Work, as gloo's."""
        ins_f, outs_f = _flat(ins), _flat(outs)
        # device.type, not is_cuda (--cuda-on-cpu answers True for CPU tensors), here and in
        # prism's every device test
        dev = next((t.device for t in outs_f + ins_f if t.device.type == "cuda"), None)
        if dev is None:
            return _C._create_work_from_future(self._write(calls, None, None, outs_f))
        coalescing = self._shelf is not None
        if not p2p and not _is_async(opts):  # on the current stream, nothing kept
            self._write(calls, dev, torch.cuda.current_stream(dev), []).wait()
            if coalescing:
                self._shelf_async = False
            return None
        side = self._side_stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        if p2p:
            for t in ins_f + outs_f:
                t.record_stream(side)
        held = [] if coalescing else ins_f + outs_f if p2p else outs_f
        fut = self._write(calls, dev, side, held)
        if coalescing:
            if not p2p:
                self._shelf.extend(ins_f + outs_f)
            self._shelf_futs.append(fut)
            self._shelf_async = True
            return _done_work([])
        if p2p:
            return _C._create_work_from_future(fut)
        return StashingWork([fut], ins_f + outs_f)

    # -- all-reduce --
    def allreduce(self, tensors, opts=None):
        calls = [self._call(1, 0, input=tensors[0], output=list(tensors) if len(tensors) > 1
                            else tensors[0])]  # fmt: skip
        return self._run(calls, tensors, tensors, opts)

    def allreduce_coalesced(self, tensors, opts=None):
        n = len(tensors)
        calls = [self._call(n, i, input=t, output=t) for i, t in enumerate(tensors)]
        return self._run(calls, tensors, tensors, opts)

    # -- all-gather --
    def allgather(self, output_tensors, input_tensors, opts=None):
        out, inp = output_tensors[0], input_tensors[0]
        _check(len(out) == self._size, f"allgather: {len(out)} outputs for a group of {self._size}")
        for t in out:
            _check(
                t.numel() == inp.numel() and t.dtype == inp.dtype,
                "allgather: output tensors must match the input's size and dtype",
            )
        calls = [self._call(1, 0, input=inp, output=list(out))]
        return self._run(calls, input_tensors, output_tensors, opts)

    def _ag_one(self, n, i, out, inp):
        _check(
            out.numel() == inp.numel() * self._size,
            f"output tensor size must be equal to world_size times input tensor size "
            f"({out.numel()} != {self._size} x {inp.numel()})",
        )
        _check(out.dtype == inp.dtype, "output tensor must have the same type as input tensor")
        return self._call(n, i, input=inp, output=out)

    def all_gather_single(self, output, input, opts=None):
        return self._run([self._ag_one(1, 0, output, input)], [input], [output], opts)

    _allgather_base = all_gather_single

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        n = len(input_list)
        calls = [self._call(n, i, input=inp, output=list(out))
                 for i, (out, inp) in enumerate(zip(output_lists, input_list))]  # fmt: skip
        return self._run(calls, input_list, output_lists, opts)

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        n = len(inputs)
        calls = [self._ag_one(n, i, o, x) for i, (o, x) in enumerate(zip(outputs, inputs))]
        return self._run(calls, inputs, outputs, opts)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    # -- reduce-scatter --
    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        out, inp = output_tensors[0], input_tensors[0]
        _check(len(inp) == self._size, f"reduce_scatter: {len(inp)} inputs for a group of {self._size}")
        calls = [self._call(1, 0, input=list(inp), output=out)]
        return self._run(calls, input_tensors, output_tensors, opts)

    def _rs_one(self, n, i, out, inp):
        _check(
            inp.numel() == out.numel() * self._size,
            f"input tensor must be the same size as output size times world size "
            f"({inp.numel()} != {self._size} x {out.numel()})",
        )
        _check(out.dtype == inp.dtype, "input tensor must be the same type as the output tensor")
        return self._call(n, i, input=inp, output=out)

    def reduce_scatter_single(self, output, input, opts=None):
        return self._run([self._rs_one(1, 0, output, input)], [input], [output], opts)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        n = len(inputs)
        calls = [self._rs_one(n, i, o, x) for i, (o, x) in enumerate(zip(outputs, inputs))]
        return self._run(calls, inputs, outputs, opts)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # -- all-to-all --
    def alltoall(self, output_tensors, input_tensors, opts=None):
        _check(
            len(output_tensors) == self._size == len(input_tensors),
            "alltoall: one input and one output tensor per group member",
        )
        calls = [self._call(1, 0, input=list(input_tensors), output=list(output_tensors))]
        return self._run(calls, input_tensors, output_tensors, opts)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        n = self._size
        osp, isp = list(output_split_sizes), list(input_split_sizes)
        _check(output.dtype == input.dtype, "all_to_all: input and output dtypes differ")
        for sp, t, what in ((osp, output, "output"), (isp, input, "input")):
            if sp:
                _check(
                    len(sp) == n and all(s >= 0 for s in sp),
                    f"all_to_all: {what} split sizes must be {n} non-negative numbers",
                )
                _check(
                    t.dim() > 0 and sum(sp) == t.shape[0],
                    f"all_to_all: {what} split sizes sum to {sum(sp)}, tensor has {t.shape[0] if t.dim() else 0} rows",
                )
            else:
                _check(t.numel() % n == 0, f"all_to_all: {what} size is not divisible by {n}")
        calls = [self._call(1, 0, input=input, output=output, in_splits=tuple(isp),
                            out_splits=tuple(osp))]  # fmt: skip
        return self._run(calls, [input], [output], opts)

    alltoall_base = all_to_all_single

    # -- rooted --
    def _root(self, r: int) -> int:
        _check(0 <= r < self._size, f"invalid root rank {r} for a group of {self._size}")
        return self.global_ranks[r]

    def broadcast(self, tensors, opts=None):
        root = opts.rootRank
        g = self._root(root)
        is_root = root == self._rank
        calls = [self._call(1, 0, input=tensors[0] if is_root else None,
                            output=None if is_root else (tensors[0] if len(tensors) == 1
                                                        else list(tensors)),
                            root=g, is_root=is_root)]  # fmt: skip
        return self._run(calls, tensors if is_root else [], [] if is_root else tensors, opts)

    def reduce(self, tensors, opts=None):
        root = opts.rootRank
        g = self._root(root)
        is_root = root == self._rank
        calls = [self._call(1, 0, input=tensors[0], output=tensors[0] if is_root else None,
                            root=g, is_root=is_root)]  # fmt: skip
        return self._run(calls, tensors, tensors, opts)

    def gather(self, output_tensors, input_tensors, opts=None):
        root = opts.rootRank
        g = self._root(root)
        is_root = root == self._rank
        out = list(output_tensors[0]) if is_root and output_tensors else None
        if is_root:
            _check(out is not None and len(out) == self._size, "gather: one output per member")
        calls = [self._call(1, 0, input=input_tensors[0], output=out, root=g, is_root=is_root)]
        return self._run(calls, input_tensors, output_tensors, opts)

    def scatter(self, output_tensors, input_tensors, opts=None):
        root = opts.rootRank
        g = self._root(root)
        is_root = root == self._rank
        inp = list(input_tensors[0]) if is_root and input_tensors else None
        if is_root:
            _check(inp is not None and len(inp) == self._size, "scatter: one input per member")
        calls = [self._call(1, 0, input=inp, output=output_tensors[0], root=g, is_root=is_root)]
        return self._run(calls, input_tensors, output_tensors, opts)

    # -- barriers --
    def barrier(self, opts=None):
        self._hold_barrier_tensor(opts)
        return _done_work([])

    def _hold_barrier_tensor(self, opts) -> None:
        """NCCL's barrier all-reduces a one-element float tensor that its process group allocates
        at the group's first barrier and keeps (one 512-byte block for the group's life, measured
        with torch 2.11 on an H100): a device group here holds the same, so that the rank's memory
        is the real run's to the byte."""
        if self._barrier_tensor is not None or self.devmap.get("cuda") != "nccl" or not torch.cuda.is_available():
            return
        ids = list(getattr(opts, "device_ids", None) or [])
        device = torch.device("cuda", ids[0] if ids else torch.cuda.current_device())
        self._barrier_tensor = torch.zeros(1, dtype=torch.float32, device=device)

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        return None

    # -- point-to-point --
    def _peer(self, r: int) -> int:
        _check(
            0 <= r < self._size and r != self._rank,
            f"invalid peer rank {r} (group of {self._size}, this rank {self._rank})",
        )
        return self.global_ranks[r]

    def send(self, tensors, dstRank, tag=0):
        g = self._peer(dstRank)
        calls = [self._call(1, 0, input=tensors[0], output=None, peer=g)]
        return self._run(calls, tensors, [], p2p=True)

    def recv(self, tensors, srcRank, tag=0):
        g = self._peer(srcRank)
        calls = [self._call(1, 0, output=tensors[0] if len(tensors) == 1 else list(tensors),
                            peer=g)]  # fmt: skip
        return self._run(calls, [], tensors, p2p=True)

    def recv_anysource(self, tensors, tag=0):
        calls = [self._call(1, 0, output=tensors[0] if len(tensors) == 1 else list(tensors))]
        return self._run(calls, [], tensors, p2p=True)

    # -- coalescing --
    def _start_coalescing(self, device):
        self._shelf, self._shelf_futs, self._shelf_async = [], [], True

    def _end_coalescing(self, device):
        shelf, futs, self._shelf, self._shelf_futs = self._shelf or [], self._shelf_futs, None, []
        dev = torch.device(device) if device is not None else None
        if dev is None or dev.type != "cuda":
            return _done_work([])
        if not self._shelf_async:
            return None
        return StashingWork([*futs, _done_future([], dev, self._side_stream(dev))], shelf)

    start_coalescing = _start_coalescing
    end_coalescing = _end_coalescing

    # -- lifecycle --
    def shutdown(self):
        return None

    def abort(self):
        return None

    def split_backend(self, rank: int, size: int, global_ranks: list[int], group_name: str) -> GeneratedBackend:
        """The backend of a group split from this one: of this one's class (switch mode's stays switch
        mode's, whatever wraps it) and devices."""
        return type(self)(rank, size, global_ranks, self.devmap, group_name)

    def split_group(self, *a, **k):  # the RecordingProcessGroup splits (split_pg), never its inner
        raise RuntimeError("split_group: use RecordingProcessGroup.split_group")


__all__ = ["GeneratedBackend", "SoloTCPStore", "prepare", "create_pg", "split_pg", "generator"]
