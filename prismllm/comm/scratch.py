"""Device scratch of the pruned calls, kept out of the program's memory figures.

A pruned collective may need buffers the real collective does not: a zero-padded copy
(all-reduce with ``match_bytes``), the re-arranged slots of a reduce-scatter, an all-gather's
small-group output (docs/internals/pruning.md, "Scratch memory"). Taken from PyTorch's caching allocator
they would show in the sandbox rank's ``torch.cuda.max_memory_allocated``, the figure compared
with the real run's (peak memory must be exact on GPU), and the program's own allocations
would fragment around them.

:class:`DeviceArena` takes that memory from the CUDA driver instead (``cuMemAlloc``), as NCCL
takes its own buffers: the device memory is used, but not by the program's allocator, so its
statistics, its peak and its block layout are the program's alone. The arena keeps what it
took (segments rounded to 2 MiB) and reports it (``reserved_bytes``), so the emulation shows
the memory beside the program's peak instead of hiding it.

Reuse: a segment given back after a call's post step is handed out again only after the
stream that ran the post step reached that point (a CUDA event), the ordering PyTorch's
allocator gets from ``record_stream``.
"""

from __future__ import annotations

import ctypes
import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import torch

from prismllm.errors import PrismError

SEGMENT_ALIGN = 2 << 20


class ScratchError(PrismError):
    """The driver refused device memory for a pruned call's scratch."""


class _Driver:
    """cuMemAlloc from libcuda (the driver every CUDA process has loaded). Segments are never
    freed: the arena keeps them for reuse, and the driver reclaims them with the process."""

    _lib: Any = None

    @classmethod
    def lib(cls) -> Any:
        if cls._lib is None:
            try:
                lib = ctypes.CDLL("libcuda.so.1")
            except OSError as e:
                raise ScratchError(f"cannot load the CUDA driver (libcuda.so.1) for pruned-call scratch: {e}") from None
            lib.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
            cls._lib = lib
        return cls._lib

    @classmethod
    def alloc(cls, device: torch.device, nbytes: int) -> int:
        ptr = ctypes.c_uint64(0)
        with torch.cuda.device(device):  # cudaSetDevice: the device's primary context is current
            rc = cls.lib().cuMemAlloc_v2(ctypes.byref(ptr), nbytes)
        if rc != 0:
            what = "out of memory" if rc == 2 else f"CUresult {rc}"
            raise ScratchError(f"device scratch of {nbytes / 2**20:.1f} MiB for a pruned call on {device}: {what}")
        return int(ptr.value)


class _DeviceBytes:
    """A raw device pointer as an array (``__cuda_array_interface__``): ``torch.as_tensor``
    wraps it without copying and without the caching allocator."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 2}


@dataclasses.dataclass(eq=False)  # found and removed by identity (a tensor has no truth value)
class _Segment:
    data: torch.Tensor  # uint8 over the whole segment
    ready: Any = None  # CUDA event: where the last user's stream was when it gave the segment back


class DeviceArena:
    """Scratch buffers on one GPU from segments outside PyTorch's caching allocator.
    ``segment(nbytes)``: where a new segment comes from (default: the CUDA driver; a test may
    hand out CPU tensors to check the bookkeeping without a GPU)."""

    def __init__(self, device: torch.device, segment: Callable[[int], torch.Tensor] | None = None):
        self.device = torch.device(device)
        self._segment = segment or self._driver_segment
        self._free: list[_Segment] = []
        self._busy: dict[int, _Segment] = {}  # data_ptr of a handed-out buffer -> its segment
        self._lock = threading.Lock()
        self.reserved_bytes = 0
        self._unread: torch.Tensor | None = None  # the segment of unread() buffers
        self._unread_views: dict[tuple, torch.Tensor] = {}

    def take(self, numel: int, dtype: torch.dtype, zero: bool = False) -> torch.Tensor:
        """A flat ``numel``-element buffer (zero-filled with ``zero``), on the current stream."""
        nbytes = numel * dtype.itemsize
        if nbytes == 0:
            return torch.empty(0, dtype=dtype, device=self.device)
        with self._lock:
            fit = [s for s in self._free if s.data.numel() >= nbytes]
            seg = min(fit, key=lambda s: s.data.numel()) if fit else None
            if seg is not None:
                self._free.remove(seg)
        if seg is None:
            size = -(-nbytes // SEGMENT_ALIGN) * SEGMENT_ALIGN
            seg = _Segment(self._segment(size))
            self.reserved_bytes += size
        elif seg.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(seg.ready)
        buf = seg.data[:nbytes].view(dtype)
        with self._lock:
            self._busy[buf.data_ptr()] = seg
        if zero:
            buf.zero_()
        return buf

    def unread(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A ``numel``-element buffer whose contents no call reads back (a padded all_reduce's
        padding): one segment per arena shared by every such call, in flight or not, with no
        hand-back and no event (what it holds reaches no result, so calls may overwrite each
        other's). Grown by powers of two; views are kept per size, so a call costs a lookup."""
        key = (int(numel), dtype)
        view = self._unread_views.get(key)
        if view is not None:
            return view
        nbytes = key[0] * dtype.itemsize
        with self._lock:
            if self._unread is None or self._unread.numel() < nbytes:
                size = max(SEGMENT_ALIGN, 1 << max(nbytes - 1, 1).bit_length())
                # a smaller segment stays with the views of calls that may be in flight
                self._unread = self._segment(size)
                self.reserved_bytes += size
                self._unread_views = {}
            view = self._unread_views[key] = self._unread[:nbytes].view(dtype)
        return view

    def _driver_segment(self, nbytes: int) -> torch.Tensor:
        return torch.as_tensor(_DeviceBytes(_Driver.alloc(self.device, nbytes), nbytes), device=self.device)

    def give_back(self, buffers: list[torch.Tensor]) -> None:
        """The buffers' call is finished (its post step issued on the current stream)."""
        ready = None
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        with self._lock:
            for b in buffers:
                seg = self._busy.pop(b.data_ptr(), None)
                if seg is not None:
                    seg.ready = ready
                    self._free.append(seg)


_ARENAS: dict[torch.device, DeviceArena] = {}


def arena(device: torch.device) -> DeviceArena | None:
    """This process's arena on ``device`` (made on first use); None for a CPU device."""
    if device.type != "cuda":
        return None
    a = _ARENAS.get(device)
    if a is None:
        a = _ARENAS[device] = DeviceArena(device)
    return a


def reserved_bytes() -> int:
    """Device memory this process's arenas took, all devices together (0 when none was used)."""
    return sum(a.reserved_bytes for a in _ARENAS.values())
