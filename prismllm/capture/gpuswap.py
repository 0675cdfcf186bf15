"""A GPU rank's device state moved out to the host and back: the CUDA driver's checkpoint API
(``cuCheckpointProcessLock/Checkpoint/Restore/Unlock``, driver 550 and newer), called through
ctypes with the rank's pid from switch mode's coordinator, which never creates a CUDA context of
its own (``cuInit`` only).

Out: lock the process (its CUDA calls then block; the driver waits for its work in flight),
checkpoint it (the driver copies its device memory into the process's host memory and releases
the GPU), then stop it (SIGSTOP). Back: continue it, restore its memory onto the same GPU,
unlock it. The driver does the work on a thread of the target process, so the process runs
while it is locked, checkpointed or restored, and is stopped only in between. A process that has
no CUDA state yet (it has not touched the GPU) is only stopped.

The bytes a swap moves are the process's device memory as the driver reports it to NVML
(``nvmlDeviceGetComputeRunningProcesses``) just before the checkpoint; None where NVML cannot say.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time

from prismllm.errors import PrismError

RUNNING, LOCKED, CHECKPOINTED, FAILED = 0, 1, 2, 3  # CUprocessState
_STATE_NAMES = {RUNNING: "running", LOCKED: "locked", CHECKPOINTED: "checkpointed", FAILED: "failed"}
LOCK_TIMEOUT_MS = 60_000  # a rank's in-flight device work that outlasts this is not a waiting rank


class SwapError(PrismError):
    """The driver refused to move a rank's device state (or has no checkpoint API)."""


class _Args(ctypes.Structure):
    """Every CUcheckpoint*Args struct is 64 bytes; the lock's starts with its timeout, the others
    are all reserved (zero) unless a GPU is remapped, which switch mode never does."""

    _fields_ = [("timeout_ms", ctypes.c_uint), ("reserved0", ctypes.c_uint), ("reserved", ctypes.c_uint64 * 7)]


class _NvmlProcess(ctypes.Structure):  # nvmlProcessInfo_v2/v3: pid, usedGpuMemory, two instance ids
    _fields_ = [("pid", ctypes.c_uint), ("used", ctypes.c_ulonglong), ("gi", ctypes.c_uint), ("ci", ctypes.c_uint)]


class GpuSwap:
    """The driver's checkpoint API through one ``libcuda``; thread-safe (the driver serializes)."""

    def __init__(self) -> None:
        try:
            self._cuda = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise SwapError(f"switch mode on GPUs needs the CUDA driver (libcuda.so.1): {e}") from None
        missing = [
            f
            for f in ("cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint", "cuCheckpointProcessRestore")
            if not hasattr(self._cuda, f)
        ]
        if missing:
            raise SwapError(
                f"switch mode on GPUs needs the CUDA driver's checkpoint API (driver 550 or newer); this driver "
                f"lacks {', '.join(missing)}: use --mode solo, or switch mode on the CPU (--devices cpu)"
            )
        self._check(self._cuda.cuInit(0), "cuInit", None)
        self._nvml = _Nvml()
        self.moved_bytes = 0  # device memory checkpointed, over every swap out NVML could measure
        self.out_s = self.back_s = 0.0
        self.outs = self.backs = 0
        self._lock = threading.Lock()

    def _check(self, rc: int, call: str, rank: int | None) -> None:
        if rc == 0:
            return
        name = ctypes.c_char_p()
        self._cuda.cuGetErrorName(rc, ctypes.byref(name))
        who = f" of rank {rank}" if rank is not None else ""
        raise SwapError(
            f"the CUDA driver refused {call}{who}: {(name.value or b'?').decode()} ({rc}); switch mode cannot "
            "swap this rank's device state out (run fewer ranks per GPU with --parallel, or --mode solo)"
        )

    def state(self, pid: int) -> int | None:
        """The process's CUprocessState; None when it has no CUDA state (it has not used the GPU)."""
        s = ctypes.c_int()
        return s.value if self._cuda.cuCheckpointProcessGetState(pid, ctypes.byref(s)) == 0 else None

    def out(self, pid: int, rank: int, gpu: int) -> None:
        """Move the process's device state to the host and stop it."""
        t0 = time.monotonic()
        state = self.state(pid)
        moved = None
        if state == RUNNING:
            moved = self._nvml.used(gpu, pid)
            self._check(self._cuda.cuCheckpointProcessLock(pid, ctypes.byref(_Args(LOCK_TIMEOUT_MS))), "lock", rank)
            self._check(self._cuda.cuCheckpointProcessCheckpoint(pid, ctypes.byref(_Args())), "checkpoint", rank)
        elif state == FAILED:
            raise SwapError(f"rank {rank}'s CUDA state is failed (an earlier checkpoint or restore went wrong)")
        send_signal(pid, signal.SIGSTOP)
        with self._lock:
            self.outs += 1
            self.out_s += time.monotonic() - t0
            self.moved_bytes += moved or 0

    def back(self, pid: int, rank: int) -> None:
        """Continue the process and move its device state back onto its GPU."""
        t0 = time.monotonic()
        send_signal(pid, signal.SIGCONT)
        state = self.state(pid)
        if state == CHECKPOINTED:
            self._check(self._cuda.cuCheckpointProcessRestore(pid, ctypes.byref(_Args())), "restore", rank)
            state = LOCKED
        if state == LOCKED:
            self._check(self._cuda.cuCheckpointProcessUnlock(pid, ctypes.byref(_Args())), "unlock", rank)
        elif state == FAILED:
            raise SwapError(f"rank {rank}'s CUDA state is failed (an earlier checkpoint or restore went wrong)")
        with self._lock:
            self.backs += 1
            self.back_s += time.monotonic() - t0

    def summary(self) -> dict[str, float | int | None]:
        """What the swaps cost, for the capture's manifest."""
        with self._lock:
            return {
                "out": self.outs,
                "out_s": round(self.out_s, 3),
                "back": self.backs,
                "back_s": round(self.back_s, 3),
                "bytes_out": self.moved_bytes if self._nvml.ok else None,
            }


class _Nvml:
    """A process's device memory on one GPU (NVML, through ctypes); ``ok`` False where NVML is absent."""

    def __init__(self) -> None:
        try:
            self._lib = ctypes.CDLL("libnvidia-ml.so.1")
            self.ok = self._lib.nvmlInit_v2() == 0
        except OSError:
            self.ok = False

    def used(self, gpu: int, pid: int) -> int | None:
        if not self.ok:
            return None
        handle = ctypes.c_void_p()
        if self._lib.nvmlDeviceGetHandleByIndex_v2(_nvml_index(gpu), ctypes.byref(handle)) != 0:
            return None
        count = ctypes.c_uint(64)
        procs = (_NvmlProcess * 64)()
        if self._lib.nvmlDeviceGetComputeRunningProcesses_v3(handle, ctypes.byref(count), procs) != 0:
            return None
        return next((int(p.used) for p in procs[: count.value] if p.pid == pid), None)


def _nvml_index(gpu: int) -> int:
    """NVML counts every GPU of the machine; a GPU index here counts the visible ones."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not visible:
        return gpu
    ids = [v.strip() for v in visible.split(",")]
    return int(ids[gpu]) if gpu < len(ids) and ids[gpu].isdigit() else gpu


def send_signal(pid: int, sig: int) -> None:
    """Signal a rank's process; one that is gone is left to the launcher, which reports its end."""
    if pid <= 0:  # os.kill would signal a process group, or every process this user may signal
        raise ValueError(f"not a rank's process id: {pid}")
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # gone: the launcher reports its end


__all__ = ["GpuSwap", "SwapError", "send_signal"]
