"""Make the program's own ``init_process_group`` / ``new_group`` use the recording backend.

``install("record")`` (called by ``prismllm.comm.bootstrap`` before the program runs; mode
"solo" hands group creation to ``prismllm.comm.solo`` (mode "switch" too, with ``prismllm.comm.switch``'s
backend), mode "emulate" to
``prismllm.comm.sandbox`` for groups with virtual members -- a group whose members all run
for real is built by the record-mode creator below):

* registers the c10d backend "prism" once (``Backend.register_backend``, extended API, for
  cpu and cuda; it does not change torch's default backend for either device);
* wraps ``distributed_c10d._new_process_group_helper``, through which every group creation
  passes (``init_process_group``, ``new_group``, ``new_subgroups``,
  ``new_subgroups_by_enumeration``, ``init_device_mesh``/DeviceMesh via ``new_group``): it
  remembers the backend the program asked for ("nccl", "gloo", None/"undefined",
  "cpu:gloo,cuda:nccl", ...), creates the group with backend "prism", and afterwards
  records the program's backend string in torch's group map, so ``dist.get_backend()``
  answers what it would without prism (programs and torch branch on it: monitored_barrier,
  object collectives, DeviceMesh). ``device_id=`` is taken out of the call and applied by
  the creator (bound device, eager NCCL connect, NCCL comm split for later groups), since a
  Python ProcessGroup cannot take it through torch's path;
* ``split_group`` (DeviceMesh with a bound device) reaches
  ``RecordingProcessGroup.split_group``, which splits the real group and wraps the result;
* wraps ``batch_isend_irecv`` (torch only coalesces when ``type(group) is ProcessGroup``, so
  without this a Python group would silently lose NCCL's grouped P2P) and
  ``_coalescing_manager`` (so all ops of one batch share a coalesced id);
* adds global optimizer step pre/post hooks: a boundary after each outermost optimizer step.

The creator builds, for each device in the program's backend config, the real backend
exactly as ``_new_process_group_helper`` would (same prefix store "<group>/<device>/",
rank, size, timeout, NCCL options incl. split_from), registers them on a plain C++
``ProcessGroup`` (``_inner``) and on the RecordingProcessGroup it returns.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from prismllm.childenv import MODES, ChildEnv, user_setting
from prismllm.comm import recorder as _recorder_mod, redops, sandbox, saving, scratch, solo, solo_objects, switch
from prismllm.comm.gpuclock import GpuClock
from prismllm.comm.leftout import LANE, LeftOutBoard
from prismllm.comm.recorder import Recorder
from prismllm.comm.recording import RecordingProcessGroup
from prismllm.comm.rows import iteration_rows, node_rows
from prismllm.trace.ranklog import GroupInfo, RankLog

BACKEND_NAME = "prism"

_C = torch._C._distributed_c10d
_ORIG: dict[str, Any] = {}
_PENDING: list[dict[str, Any]] = []  # creation context of the helper call in flight
_REC: Recorder | None = None
_MODE = ""
_NATIVE: Any = None  # prismllm.comm.native's module when it records (record mode; emulate's native lane)
_NATIVE_GROUPS: set[str] = set()  # names of the groups it records
_GPU_CLOCK: GpuClock | None = None  # a slice's or an emulation's GPU rank: the clock it ran at


def native_wanted(mode: str, child: ChildEnv) -> bool:
    """Whether this process records through the native backend: record mode when the parent
    said so (ChildEnv.native), unless tensors are saved (the Python path's hooks do that)."""
    return mode == "record" and bool(child.native) and not child.save_tensors


def reads_transfer_durations(mode: str, child: ChildEnv) -> bool:
    """Whether the recorder reads NCCL's time of each asynchronous call: a recording, a solo
    capture and prism time's slices (their timed graph's transfers), not prism emulate. Reading
    it holds the call's Work until the device completes it, and the Work holds the program's
    tensors, where a real process group lets go of them at wait(): an emulated program whose
    host runs ahead of its device, with a new output every call (DTensor's functional
    collectives), would peak higher than the real run."""
    return mode != "emulate" or bool(child.transfer_durations)


def all_points_on_device(mode: str, child: ChildEnv) -> bool:
    """Whether every point of the rank's log is a CUDA event (on a GPU), or only its iteration
    boundaries: every point where transfers are read (a recording, a slice), and in an emulation
    only when ``PRISM_DEVICE_POINTS=1`` asks for the sandbox's spans on the device (each point is a
    timing event between two of the program's kernels, ~3 µs of an H200's time the real run does
    not spend)."""
    return reads_transfer_durations(mode, child) or user_setting("PRISM_DEVICE_POINTS") == "1"


def _record_natively() -> None:
    """Every group this process makes records through the native backend."""
    global _NATIVE
    # imported here: it loads (and may first build) a C++ extension, which a run that records
    # through the Python path never needs
    from prismllm.comm import native
    from prismllm.comm.native.replay import NativeSession

    _NATIVE = native.load()
    _REC.native = NativeSession(_NATIVE)
    for name in ("send", "recv"):
        _ORIG[name] = getattr(c10d, name)
        setattr(c10d, name, _sync_p2p(_ORIG[name]))
        setattr(dist, name, getattr(c10d, name))


def installed() -> bool:
    return bool(_ORIG)


def install(mode: str | None = None, child: ChildEnv | None = None) -> Recorder | None:
    """Install the interception for ``mode`` with the settings ``child`` (default: this
    process's ChildEnv and its mode). No-op without a mode."""
    global _REC, _MODE, _GPU_CLOCK
    child = child if child is not None else ChildEnv.current()
    mode = mode if mode is not None else (child.mode or "")
    if not mode:
        return None
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: this interception supports {MODES}")
    if _ORIG:
        return _REC
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    _REC = Recorder(rank, world)
    _recorder_mod.set_current(_REC)
    _MODE = mode
    if mode == "solo":
        solo.prepare(rank, child)
    elif mode == "switch":
        solo.local_rendezvous()
        switch.prepare(rank, child)
        saving.setup(rank, child)
    elif mode == "emulate":
        sandbox.prepare(rank, child)
        if sandbox.lane() is not None:
            _record_natively()
        if child.emulate_backend == "nccl":
            _GPU_CLOCK = GpuClock()
        if child.left_out_board and child.sandbox and rank in child.sandbox:
            # a CPU emulation: what this rank leaves out of its clock, its assistant's clock too
            board, k = LeftOutBoard(child.left_out_board), child.sandbox.index(rank)
            _REC.left_out_board = (board, k)
            if _NATIVE is not None:
                _NATIVE.set_left_out_board(board.address(k, LANE))
    else:
        saving.setup(rank, child)
        if child.spool:
            solo_objects.keep_sent_messages(child.spool)
        if native_wanted(mode, child):
            _record_natively()

    if not reads_transfer_durations(mode, child):
        # an emulation's rank log is its measurement, not a timed graph: no transfer read, and
        # device time only at the iteration boundaries (Recorder.all_points_on_device)
        _REC.durations_ok = False
        points = all_points_on_device(mode, child)
        _REC.all_points_on_device = points
        if _NATIVE is not None:
            _NATIVE.set_durations(False)
            _NATIVE.set_all_points_on_device(points)

    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, _create_pg, extended_api=True, devices=["cpu", "cuda"])

    _ORIG["helper"] = c10d._new_process_group_helper
    _ORIG["helper_sig"] = inspect.signature(c10d._new_process_group_helper)
    c10d._new_process_group_helper = _helper

    _ORIG["batch_isend_irecv"] = c10d.batch_isend_irecv
    c10d.batch_isend_irecv = _batch_isend_irecv
    dist.batch_isend_irecv = _batch_isend_irecv

    _ORIG["_coalescing_manager"] = c10d._coalescing_manager
    c10d._coalescing_manager = _coalescing_manager

    rec = _REC
    _ORIG["opt_pre"] = register_optimizer_step_pre_hook(lambda *a: rec.optimizer_pre())
    _ORIG["opt_post"] = register_optimizer_step_post_hook(lambda *a: rec.optimizer_post())
    return _REC


# ---- group creation -------------------------------------------------------------------------
def _real_device_map(backend: str) -> dict[str, str]:
    return {d: str(b) for d, b in c10d.BackendConfig(backend).get_device_backend_map().items()}


def _helper(*args, **kwargs):
    orig = _ORIG["helper"]
    ranks = args[2] if len(args) > 2 else kwargs.get("global_ranks_in_group")
    if ranks and c10d.is_initialized() and c10d._get_default_group().rank() not in ranks:
        # Not a member: torch returns NON_GROUP_MEMBER before it looks at the backend. The fast
        # path matters at scale: a Megatron rank of an 8192-rank job makes ~78k groups it is
        # mostly not in, and binding the signature of each cost seconds.
        return orig(*args, **kwargs)
    bound = _ORIG["helper_sig"].bind(*args, **kwargs)
    a = bound.arguments
    backend = str(a.get("backend"))
    if backend.lower() == BACKEND_NAME:
        return orig(*args, **kwargs)
    try:
        devmap = _real_device_map(backend)
    except Exception:
        return orig(*args, **kwargs)
    if not devmap or not set(devmap.values()) <= {"gloo", "nccl"}:
        warnings.warn(f"prism: backend {backend!r} is not recorded (only gloo and nccl are)", stacklevel=3)
        return orig(*args, **kwargs)
    device_id = a.get("device_id")
    _PENDING.append(
        {
            "backend": backend,
            "devmap": devmap,
            "device_id": device_id,
            "backend_options": a.get("backend_options"),
        }
    )
    a["backend"] = dist.Backend(BACKEND_NAME)
    if "device_id" in a:
        a["device_id"] = None
    try:
        pg, store = orig(*bound.args, **bound.kwargs)
    finally:
        _PENDING.pop()
    if _recorded(pg):
        # What the program's backend string would have registered.
        c10d._world.pg_map[pg] = (dist.Backend(backend), store)
        c10d._world.pg_backend_config[pg] = str(c10d.BackendConfig(dist.Backend(backend)))
        if not a.get("global_ranks_in_group"):
            rec = _REC
            rec.rank, rec.world_size = pg.rank(), pg.size()
            rec.start()
    return pg, store


_BTYPE = {
    "gloo": _C.ProcessGroup.BackendType.GLOO,
    "nccl": _C.ProcessGroup.BackendType.NCCL,
}


def _make_backend(name, store, rank, size, timeout, group_name, granks, options, device_id):
    if name == "gloo":
        be = _C.ProcessGroupGloo(store, rank, size, timeout=timeout)
        be.options.global_ranks_in_group = granks
        be.options.group_name = group_name
        be._set_sequence_number_for_group()
        return be
    nccl = getattr(c10d, "ProcessGroupNCCL", None)
    if nccl is None or not dist.is_nccl_available():
        raise RuntimeError("Distributed package doesn't have NCCL built in")
    if options is None:
        options = nccl.Options()
        options.is_high_priority_stream = False
    options._timeout = timeout
    if c10d.is_initialized() and c10d._get_default_group().bound_device_id:
        split_source = getattr(c10d, "_get_split_source", None)
        split_from = split_source(c10d._get_default_group()) if split_source else None
        if split_from:
            options.split_from = split_from
            options.split_color = c10d._process_group_color(granks)
    options.global_ranks_in_group = granks
    options.group_name = group_name
    be = nccl(store, rank, size, options)
    be._set_sequence_number_for_group()
    return be


def _recorded(pg: Any) -> bool:
    """A group this process records (Python RecordingProcessGroup, or a native one)."""
    return isinstance(pg, RecordingProcessGroup) or (
        bool(_NATIVE_GROUPS) and getattr(pg, "group_name", None) in _NATIVE_GROUPS
    )


def _sync_p2p(fn):
    """``dist.send``/``dist.recv`` (isend/irecv and a wait at once): tell the native backend
    that its next P2P call is waited on at once (the Python path reads the call stack)."""

    def wrapper(*args, **kwargs):
        _NATIVE.sync_p2p(True)
        try:
            return fn(*args, **kwargs)
        finally:
            _NATIVE.sync_p2p(False)

    wrapper.__wrapped__ = fn
    return wrapper


def _native_pg(prefix_store, rank, size, created, default_type, group_name, granks):
    """A plain C++ ProcessGroup whose backends are the native recording wrappers of the real
    ones: torch dispatches every call to C++ with no Python on the way."""
    pg = _C.ProcessGroup(prefix_store, rank, size)
    pg._set_default_backend(default_type)
    wrapped: dict[int, Any] = {}
    for dev, name, be in created:
        nb = wrapped.get(id(be))
        if nb is None:
            nb = wrapped[id(be)] = _NATIVE.RecordingBackend(be, list(granks))
        pg._register_backend(torch.device(dev), _BTYPE[name], nb)
    pg._set_group_name(group_name)
    _NATIVE_GROUPS.add(group_name)
    return pg


def _debug_wrap(be, group_name, store, rank, size, timeout):
    if c10d.get_debug_level() == c10d.DebugLevel.DETAIL and c10d._GLOO_AVAILABLE:
        return c10d._create_process_group_wrapper(
            wrapped_pg=be, store_prefix=group_name, store=store, rank=rank,
            world_size=size, timeout=timeout,
        )  # fmt: skip
    return be


def _create_pg(dist_opts, backend_options):
    """The "prism" backend's creator (extended API)."""
    rec = _REC
    if _PENDING:
        ctx = _PENDING[-1]
    else:  # the program named backend "prism" itself
        ctx = {"backend": "undefined", "devmap": _real_device_map("undefined"),
               "device_id": None, "backend_options": backend_options}  # fmt: skip
    if _MODE == "solo":
        return solo.create_pg(dist_opts, ctx, rec, _BTYPE)
    if _MODE == "switch":
        pg = solo.create_pg(dist_opts, ctx, rec, _BTYPE, switch.SwitchBackend)
        if saving.saving_enabled():  # the real values of the selected calls, as record mode saves them
            pg._inner = saving.SavingInner(pg._inner, pg)
            pg._on_wait_hook = saving.on_wait
        return pg
    lane = None  # the native lane's backend of a group with virtual members
    if _MODE == "emulate":  # a group with virtual members; all real: the real backend below
        pg = sandbox.create_pg(dist_opts, ctx, rec, _BTYPE)
        if pg is not None and _NATIVE is None:
            return pg
        lane = pg
    devmap: dict[str, str] = ctx["devmap"]
    prefix_store = dist_opts.store.underlying_store  # creator gets "<group>/cpu/"
    rank, size = dist_opts.group_rank, dist_opts.group_size
    timeout = dist_opts.timeout
    group_name = dist_opts.group_id
    granks = list(dist_opts.global_ranks_in_group)
    options = ctx["backend_options"]

    created: list[tuple[str, str, Any]] = []  # (device, backend name, backend object)
    names = list(devmap.values())
    if lane is not None:
        created = [(d, name, lane) for d, name in devmap.items()]
        group_name = lane.backend.group_name  # the graph's name of the group (sandbox.create_pg)
    elif len(set(names)) == 1:
        dev0 = next(iter(devmap))
        st = _C.PrefixStore(f"{dev0}/", prefix_store)
        be = _make_backend(names[0], st, rank, size, timeout, group_name, granks, options, None)
        be = _debug_wrap(be, group_name, st, rank, size, timeout)
        created = [(d, names[0], be) for d in devmap]
    else:
        for dev, name in devmap.items():
            st = _C.PrefixStore(f"{dev}/", prefix_store)
            be = _make_backend(
                name, st, rank, size, timeout, group_name, granks,
                options if name == "nccl" else None, None,
            )  # fmt: skip
            be = _debug_wrap(be, group_name, st, rank, size, timeout)
            created.append((dev, name, be))

    backend = ctx["backend"]
    if "," not in backend and ":" not in backend and backend != "undefined":
        default_type = c10d.Backend.backend_type_map[dist.Backend(backend)]
    else:
        default_type = _BTYPE["nccl"] if "nccl" in names else _BTYPE["gloo"]

    global_ranks = granks if granks else list(range(size))
    if "nccl" in names and torch.cuda.is_available():
        rec.cuda = True
    if _NATIVE is not None:
        _NATIVE.set_cuda(rec.cuda)
        pg = _native_pg(prefix_store, rank, size, created, default_type, group_name, global_ranks)
        _bind_device(pg, pg, ctx["device_id"], created)
        rec.add_group(pg)
        return pg
    inner = _C.ProcessGroup(prefix_store, rank, size)
    pg = _recording_group(prefix_store, rank, size, inner, group_name, global_ranks, backend, rec, names)
    for g in (inner, pg):
        g._set_default_backend(default_type)
        for dev, name, be in created:
            g._register_backend(torch.device(dev), _BTYPE[name], be)
    inner._set_group_name(group_name)
    _bind_device(pg, inner, ctx["device_id"], created)
    rec.add_group(pg)
    return pg


def _bind_device(pg: Any, inner: Any, device_id: Any, created: list) -> None:
    """``init_process_group(device_id=...)``: bind the group and connect NCCL eagerly."""
    if device_id is None:
        return
    pg.bound_device_id = device_id
    inner.bound_device_id = device_id
    for dev, _name, be in created:
        if torch.device(dev).type == device_id.type and be.supports_splitting:
            be.eager_connect_single_device(device_id)
            break


def _recording_group(
    store,
    rank: int,
    size: int,
    inner,
    group_name: str,
    granks: list[int],
    backend: str,
    rec: Recorder,
    backends: list[str],
) -> RecordingProcessGroup:
    """A RecordingProcessGroup over a real group (whose backends are named ``backends``): it
    splits the real group, runs NCCL's AVG and PREMUL_SUM where a backend is gloo
    (prismllm.comm.redops), and with --save-tensors it saves the selected outputs
    (prismllm.comm.saving) of the program's call, around both."""
    saves = saving.saving_enabled()
    pg = RecordingProcessGroup(
        store,
        rank,
        size,
        inner,
        group_name,
        granks,
        backend,
        rec,
        split=_split_real,
        on_wait=saving.on_wait if saves else None,
    )
    pg._inner = redops.wrap(pg._inner, backends)
    if saves:
        pg._inner = saving.SavingInner(pg._inner, pg)
    return pg


def _split_real(
    parent: RecordingProcessGroup, ranks, timeout=None, opts=None, group_name=None, group_desc=None, device_types=None
):
    """``split_group`` of a real group: split ``parent._inner``, then wrap the split."""
    kwargs: dict[str, Any] = {"timeout": timeout, "opts": opts, "group_name": group_name,
                              "group_desc": group_desc}  # fmt: skip
    if device_types is not None:
        kwargs["device_types"] = device_types
    inner = parent._inner.split_group(list(ranks), **kwargs)
    if inner is None:
        return None
    granks = [parent._global_ranks[r] for r in sorted(ranks)]
    name = group_name or inner.group_name
    backends = [inner._get_backend(dev).name().lower() for dev in inner._device_types]
    pg = _recording_group(
        inner.get_group_store(),
        inner.rank(),
        inner.size(),
        inner,
        name,
        granks,
        parent._real_backend,
        parent._rec,
        backends,
    )
    default = None
    for dev in inner._device_types:
        be = inner._get_backend(dev)
        btype = _BTYPE.get(be.name().lower(), _C.ProcessGroup.BackendType.CUSTOM)
        pg._register_backend(dev, btype, be)
        if default is None or dev.type != "cpu":
            default = btype
    if default is not None:
        pg._set_default_backend(default)
    pg._set_group_name(name)
    if group_desc:
        pg._set_group_desc(group_desc)
    if parent.bound_device_id is not None:
        pg.bound_device_id = parent.bound_device_id
    parent._rec.add_group(pg)
    return pg


# ---- batching -------------------------------------------------------------------------------
def _batch_isend_irecv(p2p_op_list):
    """``dist.batch_isend_irecv`` with torch's own logic, except that a RecordingProcessGroup
    takes the coalescing path whenever its real backend supports coalescing (NCCL)."""
    c10d._check_p2p_op_list(p2p_op_list)
    group = p2p_op_list[0].group
    if group is None:
        group = c10d._get_default_group()
    if not isinstance(group, RecordingProcessGroup):
        if not _recorded(group):
            return _ORIG["batch_isend_irecv"](p2p_op_list)
        # native: torch coalesces on a plain ProcessGroup itself; one scope for the batch
        _NATIVE.coalesce_begin(-1)
        try:
            return _ORIG["batch_isend_irecv"](p2p_op_list)
        finally:
            _NATIVE.coalesce_end()
    device = p2p_op_list[0].tensor.device
    rec = group._rec
    rec.begin_coalesce()
    try:
        if _supports_coalescing(group, device):
            with _coalescing_manager(group, device, async_ops=True) as cm:
                for op in p2p_op_list:
                    op.op(op.tensor, op.peer, op.group, op.tag)
            return cm.works
        reqs = []
        for op in p2p_op_list:
            work = op.op(op.tensor, op.peer, op.group, op.tag)
            if work:
                reqs.append(work)
        return reqs
    finally:
        rec.end_coalesce()


def _supports_coalescing(group: RecordingProcessGroup, device) -> bool:
    if _MODE in ("solo", "switch") or getattr(group._inner, "pruned", False):  # a stand-in is registered
        return group._inner.supports_coalescing(device)
    return group._get_backend(device).supports_coalescing


@contextlib.contextmanager
def _coalescing_manager(group=None, device=None, async_ops: bool = False):
    """torch's ``_coalescing_manager``; on a RecordingProcessGroup all ops issued inside share
    one coalesced id, and the batch Work is sync or async as ``async_ops`` says."""
    orig = _ORIG["_coalescing_manager"]
    g = group or c10d._get_default_group()
    if not isinstance(g, RecordingProcessGroup):
        if not _recorded(g):
            with orig(group, device, async_ops) as cm:
                yield cm
            return
        _NATIVE.coalesce_begin(1 if async_ops else 0)
        try:
            with orig(group, device, async_ops) as cm:
                yield cm
        finally:
            _NATIVE.coalesce_end()
        return
    rec = g._rec
    rec.begin_coalesce()
    prev = rec.coal_async
    rec.coal_async = async_ops
    try:
        with orig(group, device, async_ops) as cm:
            yield cm
    finally:
        rec.coal_async = prev
        rec.end_coalesce()


# ---- exit -----------------------------------------------------------------------------------
def collect(rec: Recorder) -> RankLog:
    """The RankLog of this process (after ``rec.finish()``)."""
    groups = []
    seen = set()
    for pg in rec.groups:
        name = pg.group_name
        if name in seen:
            continue
        seen.add(name)
        try:
            desc = pg.group_desc
        except Exception:
            desc = ""
        groups.append(GroupInfo(name=name, desc=desc or "", ranks=_global_ranks(pg)))
    device = "cpu"
    peak = -1
    if rec.cuda and torch.cuda.is_initialized():
        try:
            device = torch.cuda.get_device_name()
            peak = int(torch.cuda.max_memory_allocated())
        except Exception:
            pass
    return RankLog(
        rank=rec.rank,
        world_size=rec.world_size,
        device=device,
        clock=rec.clock,
        nodes=node_rows(rec),
        groups=groups,
        iterations=iteration_rows(rec),
        peak_memory_bytes=peak,
        excluded_ns=int(rec.excluded_ns) + (sandbox.lane().excluded_ns() if sandbox.lane() is not None else 0),
        emulation_host_ns=int(rec.emulation_host_ns),
        scratch_bytes=scratch.reserved_bytes(),
        calls_off_thread=rec.calls_off_thread,
        emulation_host_parts=rec.emulation_host_parts,
        transfer_durations=rec.transfer_durations() if rec.cuda else {},
        head_start=rec.head_start_counts() if rec.head_start else {},
        native_lane=dict(sandbox.lane().lane_stats()) if sandbox.lane() is not None else {},
        gpu=_GPU_CLOCK.summary() if _GPU_CLOCK is not None else {},
    )


def _global_ranks(pg: Any) -> list[int]:
    ranks = getattr(pg, "_global_ranks", None)
    if ranks is None:  # a native group: its wrapper knows them
        ranks = pg._get_backend(pg._device_types[0]).global_ranks
    return list(ranks)


def current() -> Recorder | None:
    return _REC


__all__ = ["install", "installed", "collect", "current", "BACKEND_NAME"]
