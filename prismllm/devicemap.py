"""CUDA on the CPU: run a program that hard-codes CUDA on CPU processes (``--cuda-on-cpu``).

Training programs name the GPU everywhere: ``torch.cuda.set_device``, ``device="cuda"``,
``.cuda()``, ``init_process_group("nccl")``, ``init_device_mesh("cuda", ...)``, CUDA streams,
events, RNG state and memory statistics; some pick ``"cuda"`` even when no accelerator is found
(torchtitan). On a CPU-only torch they stop at the first such call. With ``install()`` (run by
``prismllm.comm.bootstrap`` in every rank when ``ChildEnv.cuda_on_cpu`` is set, after prism's
interception and before the program) each process's CPU stands for its one CUDA device and gloo
carries what NCCL would, so the program runs unmodified. This is for a run's values and
structure (record, solo capture, emulation), not its GPU timing or memory. Nothing here knows a
framework; where Megatron-core and torchtitan needed different answers, the one that serves
both is taken and the reason is given where it is made.

What is mapped:

* device arguments: a TorchFunctionMode rewrites every ``device=`` naming CUDA (``"cuda"``,
  ``"cuda:N"``, ``torch.device("cuda", N)``, an int index) to ``cpu`` in every torch function
  and Tensor method, the positional device of ``Tensor.to`` too, and ``pin_memory=True`` to
  False. The mode is the program thread's, and it is entered again around the autograd
  engine's run (torch pops a mode while it handles a call, so ``loss.backward()`` would run
  custom Functions' backward and gradient hooks without it).
* tensors: ``Tensor.cuda()`` returns the tensor (it is on "the device"), ``pin_memory()`` too,
  ``is_pinned()`` is False, ``record_stream`` of a mapped stream does nothing; ``is_cuda`` is
  True and ``type()`` names ``torch.cuda.XTensor`` for a CPU tensor (Megatron-core converts
  MoE split sizes to numpy only ``if tensor.is_cuda``, and checks ``type()``); ``t.device`` stays
  ``cpu`` (prism's own code tests ``device.type``, never ``is_cuda``).
* ``torch.cuda``: ``is_available()`` True, ``device_count()`` the node's local world size (one
  device per process, torchrun's layout), ``set_device``/``current_device``/``device(...)`` keep
  an index; ``synchronize``/``empty_cache``/``ipc_collect``/peak resets/``nvtx`` do nothing;
  ``_lazy_call(fn)`` runs fn now; ``Stream``/``ExternalStream``/``current_stream``/``stream(...)``
  are no-op streams, ``Event`` reads the host clock; memory statistics are 0 (``memory_stats()``
  answers 0 for any key), ``mem_get_info`` and ``get_device_properties`` describe the host with
  compute capability 8.0; the RNG functions and ``default_generators[i]`` are the CPU default
  generator (random ops on "CUDA" tensors draw from it, so a program's CUDA-RNG forking, e.g.
  Megatron's tracker, keeps its meaning).
* ``torch.autocast("cuda")`` is CPU autocast; ``torch.set_default_device("cuda")`` sets the CPU.
* ``DeviceMesh("cuda")`` / ``init_device_mesh("cuda", ...)`` make a CPU mesh, so torch's own
  DTensor and FSDP2 code takes its CPU paths (no device streams, no CUDA RNG tracker).
* c10d: a backend string is translated device by device (``nccl`` -> ``gloo``,
  ``cuda:nccl,cpu:gloo`` -> ``cpu:gloo``, ``default_device_backend_map["cuda"]`` gloo) and a CUDA
  ``device_id=`` is dropped, before prism's interception sees the call: a recording holds the
  CPU program that ran. NCCL's AVG and PREMUL_SUM, which gloo lacks, run on prism's recorded
  groups (``prismllm.comm.redops``).

Not mapped: CUDA graphs, ``MemPool``, ``torch.Generator(device="cuda")``, threads the program
starts itself (no mode there), ``tensor.device.type == "cuda"`` tests, and custom CUDA kernels
(Transformer Engine, Apex, Triton launches).
"""

from __future__ import annotations

import functools
import inspect
import os
import time
import types
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import device_mesh as dm, distributed_c10d as c10d
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")
# An A100's capability: bf16 paths on, Hopper-only kernels (FlashAttention 3, fp8, symmetric
# memory) off, which a CPU cannot run. Megatron-core takes its Ampere paths with it; torchtitan
# asks for 9.0 or more only for those kernels.
CAPABILITY = (8, 0)
_INSTALLED: list[bool] = []


# ---- devices and backends -----------------------------------------------------------------------
def _names_cuda(d: Any) -> bool:
    if isinstance(d, torch.device):
        return d.type == "cuda"
    if isinstance(d, str):
        return d.split(":", 1)[0].strip().lower() == "cuda"
    return isinstance(d, int) and not isinstance(d, bool)  # an accelerator index


def map_device(d: Any) -> Any:
    """A device naming CUDA (or an accelerator index) -> the CPU; any other as it is."""
    return _CPU if _names_cuda(d) else d


def map_device_type(t: Any) -> Any:
    return "cpu" if t == "cuda" else t


def map_backend(backend: Any) -> Any:
    """'nccl' -> 'gloo'; 'cuda:nccl,cpu:gloo' -> 'cpu:gloo' (one backend per device); others as
    they are."""
    if backend is None:
        return None
    text = str(backend).lower()
    if ":" not in text:
        return "gloo" if text == "nccl" else str(backend)
    out: dict[str, str] = {}
    for part in text.split(","):
        dev, _, name = part.partition(":")
        dev, name = map_device_type(dev.strip()), name.strip()
        out.setdefault(dev, "gloo" if name == "nccl" else name)
    return ",".join(f"{d}:{n}" for d, n in out.items())


# ---- the torch-function mode ------------------------------------------------------------------------
_T = torch.Tensor


def _cuda_type_name(name: str) -> str:
    return "torch.cuda." + name[len("torch.") :] if name.startswith("torch.") and ".cuda." not in name else name


def _cpu_type(t: Any) -> Any:
    if isinstance(t, str) and t.startswith("torch.cuda."):
        return "torch." + t[len("torch.cuda.") :]
    if isinstance(t, type) and t.__module__ == "torch.cuda":
        return getattr(torch, t.__name__, t)
    return t


def _tensor_cuda(args, kwargs):
    t = args[0]
    fmt = kwargs.get("memory_format")
    return t if fmt is None or fmt is torch.preserve_format else t.contiguous(memory_format=fmt)


def _tensor_type(args, kwargs):
    t, rest = args[0], list(args[1:])
    dtype = rest[0] if rest else kwargs.get("dtype")
    if dtype is None:
        name = _T.type(t)
        return _cuda_type_name(name) if t.device.type == "cpu" else name
    if rest:
        rest[0] = _cpu_type(rest[0])
    else:
        kwargs["dtype"] = _cpu_type(dtype)
    return _T.type(t, *rest, **kwargs)


def _tensor_to(args, kwargs):
    args = (args[0], *(a if isinstance(a, (torch.dtype, torch.Tensor)) else map_device(a) for a in args[1:]))
    if "device" in kwargs:
        kwargs["device"] = map_device(kwargs["device"])
    return _T.to(*args, **kwargs)


_SPECIAL = {
    _T.cuda: _tensor_cuda,
    _T.type: _tensor_type,
    _T.to: _tensor_to,
    _T.pin_memory: lambda a, k: a[0],
    _T.is_pinned: lambda a, k: False,
    _T.is_cuda.__get__: lambda a, k: a[0].device.type in ("cpu", "cuda"),
}


class CudaOnCpu(TorchFunctionMode):
    """Rewrites the CUDA device arguments of every torch call to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs) if kwargs else {}
        special = _SPECIAL.get(func)
        if special is not None:
            return special(args, kwargs)
        if "device" in kwargs:
            kwargs["device"] = map_device(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        return func(*args, **kwargs)


# ---- torch.cuda stand-ins ---------------------------------------------------------------------------
class Stream:
    """A CUDA stream on the CPU: work is synchronous, so every wait is already satisfied."""

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any):
        self.device = _CPU
        self.priority = priority
        self.cuda_stream = 0
        self.stream_id = 0
        self.device_index = 0
        self.device_type = _CPU.type

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Event | None = None) -> Event:
        event = event or Event()
        event.record(self)
        return event

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: Any) -> bool:
        return False

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Stream)

    def __hash__(self) -> int:
        return 0


class Event:
    """A CUDA event on the CPU: ``record`` reads the host clock; ``elapsed_time`` in ms."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False, **kw: Any):
        self.t: float | None = None

    def record(self, stream: Any = None) -> None:
        self.t = time.perf_counter()

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: Event) -> float:
        if self.t is None or end.t is None:
            raise RuntimeError("Event.elapsed_time: both events must be recorded first")
        return (end.t - self.t) * 1e3


class _NoContext:
    """``torch.cuda.stream(s)``, ``StreamContext``, ``nvtx.range``: a context (and decorator)
    that does nothing."""

    def __init__(self, *args: Any, **kwargs: Any):
        pass

    def __enter__(self) -> _NoContext:
        return self

    def __exit__(self, *exc: Any) -> bool:
        return False

    def __call__(self, fn: Any) -> Any:
        return fn


class _Generators:
    """``torch.cuda.default_generators``: every index (an int or a device) is the CPU generator."""

    def __getitem__(self, i: Any) -> torch.Generator:
        return torch.default_generator

    def __len__(self) -> int:
        return _device_count()

    def __iter__(self):
        return iter([torch.default_generator] * _device_count())


def _host_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _properties(device: Any = None) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        name="cpu (--cuda-on-cpu)", major=CAPABILITY[0], minor=CAPABILITY[1], total_memory=_host_memory(),
        multi_processor_count=os.cpu_count() or 1, is_integrated=False, is_multi_gpu_board=False,
        gcnArchName="", uuid="cpu", L2_cache_size=0, warp_size=32,
    )  # fmt: skip


def _device_count() -> int:
    # torchrun's layout, one device per local process: set_device(LOCAL_RANK) and
    # rank % device_count() name this process's "GPU"
    env = os.environ
    return max(int(env.get("LOCAL_WORLD_SIZE") or 1), int(env.get("LOCAL_RANK") or 0) + 1)


class _CurrentDevice:
    """The index ``set_device`` keeps. An int, as torch's: programs build
    ``torch.device("cuda", current_device())`` and pass ``barrier(device_ids=[current_device()])``
    (torchtitan); ``device=current_device()`` is mapped by the mode like any index, in backward too."""

    index = 0

    @classmethod
    def of(cls, device: Any) -> int:
        if device is None:
            return cls.index
        if isinstance(device, str):
            device = torch.device(device)
        if isinstance(device, torch.device):
            return device.index if device.index is not None else cls.index
        return int(device)

    @classmethod
    def set(cls, device: Any) -> None:
        i = cls.of(device)
        if i >= 0:
            cls.index = i


class _DeviceContext:
    def __init__(self, device: Any):
        self.new = _CurrentDevice.of(device) if device is not None else -1
        self.prev = _CurrentDevice.index

    def __enter__(self) -> _DeviceContext:
        self.prev = _CurrentDevice.index
        if self.new >= 0:
            _CurrentDevice.index = self.new
        return self

    def __exit__(self, *exc: Any) -> bool:
        _CurrentDevice.index = self.prev
        return False


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


def _zero(*args: Any, **kwargs: Any) -> int:
    return 0


def _manual_seed(seed: Any) -> None:
    # the CPU generator itself: torch.manual_seed calls torch.cuda.manual_seed_all
    torch.default_generator.manual_seed(int(seed))


_STREAM = Stream()

_CUDA: dict[str, Any] = {
    "is_available": lambda: True,
    "is_initialized": lambda: True,
    "init": _nothing,
    "_lazy_init": _nothing,
    "_lazy_call": lambda fn, **kw: fn(),
    "device_count": _device_count,
    "current_device": lambda: _CurrentDevice.index,
    "set_device": _CurrentDevice.set,
    "device": _DeviceContext,
    "device_of": lambda obj: _DeviceContext(None),
    "synchronize": _nothing,
    # torch 2.11's optimizers ask it whenever CUDA is available (2.13 asks torch.accelerator)
    "is_current_stream_capturing": lambda: False,
    "ipc_collect": _nothing,
    "empty_cache": _nothing,
    "get_device_name": lambda device=None: _properties().name,
    "get_device_properties": _properties,
    "get_device_capability": lambda device=None: CAPABILITY,
    "get_arch_list": lambda: [],
    "is_bf16_supported": lambda including_emulation=True: True,
    "is_tf32_supported": lambda: False,
    "Stream": Stream,
    "ExternalStream": Stream,
    "StreamContext": _NoContext,
    "stream": _NoContext,
    "set_stream": _nothing,
    "current_stream": lambda device=None: _STREAM,
    "default_stream": lambda device=None: _STREAM,
    "Event": Event,
    "memory_stats": lambda device=None: defaultdict(int),
    "memory_stats_as_nested_dict": lambda device=None: {},
    "memory_summary": lambda device=None, abbreviated=False: "(--cuda-on-cpu: no device memory statistics)",
    "memory_snapshot": lambda *a, **k: [],
    "memory_allocated": _zero,
    "max_memory_allocated": _zero,
    "memory_reserved": _zero,
    "max_memory_reserved": _zero,
    "memory_cached": _zero,
    "max_memory_cached": _zero,
    "mem_get_info": lambda device=None: (_host_memory(), _host_memory()),
    "reset_peak_memory_stats": _nothing,
    "reset_max_memory_allocated": _nothing,
    "reset_max_memory_cached": _nothing,
    "reset_accumulated_memory_stats": _nothing,
    "set_per_process_memory_fraction": _nothing,
    "manual_seed": _manual_seed,
    "manual_seed_all": _manual_seed,
    "seed": lambda: torch.default_generator.seed(),
    "seed_all": lambda: torch.default_generator.seed(),
    "initial_seed": lambda: torch.default_generator.initial_seed(),
    "get_rng_state": lambda device="cuda": torch.get_rng_state(),
    "set_rng_state": lambda new_state, device="cuda": torch.set_rng_state(new_state),
    "get_rng_state_all": lambda: [torch.get_rng_state()] * _device_count(),
    "set_rng_state_all": lambda states: torch.set_rng_state(states[0]),
    "default_generators": _Generators(),
}
# submodules that hold their own references to the same functions
_SUBMODULES = {
    "random": ("manual_seed", "manual_seed_all", "seed", "seed_all", "initial_seed", "get_rng_state",
               "set_rng_state", "get_rng_state_all", "set_rng_state_all", "default_generators"),
    "memory": ("empty_cache", "memory_stats", "memory_stats_as_nested_dict", "memory_summary", "memory_snapshot",
               "memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved",
               "reset_peak_memory_stats", "reset_accumulated_memory_stats", "mem_get_info",
               "set_per_process_memory_fraction"),
}  # fmt: skip


def _patch(obj: Any, name: str, value: Any) -> None:
    if isinstance(value, types.FunctionType):
        # one function object per name: torch.compile's trace rules key torch's objects by
        # identity and refuse one object under two names with different rules ("Duplicate
        # torch object", at Megatron-core's import)
        fn = value

        @functools.wraps(fn)
        def value(*args, **kwargs):
            return fn(*args, **kwargs)

        value.__name__ = value.__qualname__ = name
        value.__module__ = __name__
    setattr(obj, name, value)


def _patch_cuda() -> None:
    cuda = torch.cuda
    for name, value in _CUDA.items():
        _patch(cuda, name, value)
    for sub, names in _SUBMODULES.items():
        mod = getattr(cuda, sub, None)
        for name in names if mod is not None else ():
            _patch(mod, name, _CUDA[name])
    memory = getattr(cuda, "memory", None)
    if memory is not None:
        _patch(memory, "_record_memory_history", _nothing)
        _patch(memory, "_snapshot", lambda *a, **k: {"segments": [], "device_traces": []})
        _patch(memory, "_dump_snapshot", _nothing)
    nvtx = getattr(cuda, "nvtx", None)
    if nvtx is not None:
        for name in ("range_push", "range_pop", "mark", "range_start", "range_end"):
            _patch(nvtx, name, _zero)
        _patch(nvtx, "range", _NoContext)


def _patch_tensor() -> None:
    record_stream = _T.record_stream

    def mapped_record_stream(self, stream):  # torch parses the stream before any mode sees the call
        return None if isinstance(stream, Stream) else record_stream(self, stream)

    _T.record_stream = mapped_record_stream
    set_default_device = torch.set_default_device
    torch.set_default_device = lambda device: set_default_device(map_device(device))


def _patch_autocast() -> None:
    autocast = torch.amp.autocast_mode.autocast
    init = autocast.__init__

    @functools.wraps(init)
    def mapped_init(self, device_type, *args, **kwargs):
        init(self, map_device_type(device_type), *args, **kwargs)

    autocast.__init__ = mapped_init
    available = torch.amp.autocast_mode.is_autocast_available

    def is_autocast_available(device_type: str) -> bool:
        return available(map_device_type(device_type))

    torch.amp.autocast_mode.is_autocast_available = is_autocast_available
    torch.amp.is_autocast_available = is_autocast_available
    for name in ("is_autocast_enabled", "get_autocast_dtype", "set_autocast_enabled", "set_autocast_dtype"):
        fn = getattr(torch, name, None)
        if fn is not None:
            setattr(torch, name, _first_arg_mapped(fn))


def _first_arg_mapped(fn: Any) -> Any:
    @functools.wraps(fn)
    def mapped(*args, **kwargs):
        if args and isinstance(args[0], str):
            args = (map_device_type(args[0]), *args[1:])
        return fn(*args, **kwargs)

    return mapped


def _patch_device_mesh() -> None:
    mesh_init = dm.DeviceMesh.__init__

    @functools.wraps(mesh_init)
    def mapped_mesh_init(self, device_type, *args, **kwargs):
        mesh_init(self, map_device_type(device_type), *args, **kwargs)

    dm.DeviceMesh.__init__ = mapped_mesh_init
    init_device_mesh = dm.init_device_mesh

    @functools.wraps(init_device_mesh)
    def mapped_init_device_mesh(device_type, *args, **kwargs):
        return init_device_mesh(map_device_type(device_type), *args, **kwargs)

    dm.init_device_mesh = mapped_init_device_mesh
    if getattr(dist, "init_device_mesh", None) is init_device_mesh:
        dist.init_device_mesh = mapped_init_device_mesh
    handle = getattr(dm, "_get_device_handle", None)
    if handle is not None:
        dm._get_device_handle = lambda device_type="cuda": handle(map_device_type(device_type))


def _patch_c10d() -> None:
    """Backend strings and bound devices, translated before prism's interception sees them
    (these wrappers are installed after it, so they are the outer ones)."""
    backends = c10d.Backend.default_device_backend_map
    if backends.get("cuda") == "nccl":
        backends["cuda"] = "gloo"

    def drop_cuda_device(kwargs: dict) -> None:
        if _names_cuda(kwargs.get("device_id")):
            kwargs["device_id"] = None

    init_process_group = c10d.init_process_group

    @functools.wraps(init_process_group)
    def mapped_init_process_group(backend=None, *args, **kwargs):
        drop_cuda_device(kwargs)
        return init_process_group(map_backend(backend), *args, **kwargs)

    new_group = c10d.new_group
    new_group_backend = list(inspect.signature(new_group).parameters).index("backend")

    @functools.wraps(new_group)
    def mapped_new_group(*args, **kwargs):
        drop_cuda_device(kwargs)
        if "backend" in kwargs:
            kwargs["backend"] = map_backend(kwargs["backend"])
        elif len(args) > new_group_backend:
            args = (*args[:new_group_backend], map_backend(args[new_group_backend]), *args[new_group_backend + 1 :])
        return new_group(*args, **kwargs)

    helper = c10d._new_process_group_helper
    helper_signature = inspect.signature(helper)

    def mapped_helper(*args, **kwargs):
        bound = helper_signature.bind(*args, **kwargs)
        a = bound.arguments
        if "backend" in a:
            a["backend"] = c10d.Backend(map_backend(a["backend"]))
        if _names_cuda(a.get("device_id")):
            a["device_id"] = None
        return helper(*bound.args, **bound.kwargs)

    for module in (c10d, dist):
        module.init_process_group = mapped_init_process_group
        module.new_group = mapped_new_group
    c10d._new_process_group_helper = mapped_helper


def _patch_backward() -> None:
    """The autograd engine's run inside the mode: torch pops a mode while that mode handles a
    call (``loss.backward()`` is one), so custom Functions' backward and gradient hooks, which
    run in the engine, would otherwise see ``device="cuda"`` unmapped."""
    run_backward = torch.autograd._engine_run_backward

    def mapped_run_backward(*args, **kwargs):
        with CudaOnCpu():  # a second one where the first is still active maps nothing twice
            return run_backward(*args, **kwargs)

    torch.autograd._engine_run_backward = mapped_run_backward


def install() -> None:
    """Map CUDA to the CPU in this process, for the calling thread (once). Call it before the
    program imports anything that binds ``torch.cuda`` names (``from torch.cuda import
    _lazy_call``), and after prism's interception (``_patch_c10d``)."""
    if _INSTALLED:
        return
    _INSTALLED.append(True)
    _patch_cuda()
    _patch_tensor()
    _patch_autocast()
    _patch_device_mesh()
    _patch_c10d()
    _patch_backward()
    CudaOnCpu().__enter__()  # for the program's life: never left


__all__ = ["CAPABILITY", "CudaOnCpu", "Event", "Stream", "install", "map_backend", "map_device"]
