"""RecordingWork: the Work a RecordingProcessGroup returns. It forwards everything to the real
Work and tells the recorder when the program waits on it (see ``recording.py`` on how Python
and C++ callers reach it)."""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from prismllm.comm.recorder import ST_PENDING

if TYPE_CHECKING:
    from prismllm.comm.recording import RecordingProcessGroup


def hold_to_the_end(groups: Iterable[Any]) -> None:
    """Keep the gloo groups' last Works alive through the interpreter's finalization (never
    freed: the process is ending). A gloo worker thread drops its own reference to a Work after
    completing it; when that drop came last, after the interpreter began to finalize, freeing the
    Work's tensors needed the GIL, which a finalizing interpreter denies by ending the thread: the
    process aborted ("terminate called without an active exception"). With a reference held,
    the worker's drop is never the last. CPU (gloo) only, so no device memory is held."""
    for g in groups:
        last = getattr(g, "_last_works", None)
        if last:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(list(last)))


class RecordingWork(dist.Work):
    """Forwards to the real Work; reports the program's wait to the recorder."""

    # Defaults at class level: an instance sets them only where they differ (one Work a call).
    _state = ST_PENDING
    _anysource = False
    _on_wait = None

    def __init__(self, inner: Any, pg: RecordingProcessGroup, rows: tuple):
        super().__init__()
        self._inner = inner
        self._pg = pg
        self._rows = rows
        if pg._last_works is not None:
            pg._last_works.append(inner)
        if pg._on_wait_hook is not None:
            self._on_wait = pg._on_wait_hook(inner)

    # -- waits (points of program order) --
    def wait(self, timeout=None):
        inner = self._inner
        if timeout is None:
            return self._pg._rec.wait(self, inner.wait, ())
        return self._pg._rec.wait(self, inner.wait, (timeout,))

    def synchronize(self):
        return self._pg._rec.wait(self, self._inner.synchronize, ())

    def block_current_stream(self):
        return self._pg._rec.wait(self, self._inner.block_current_stream, ())

    def __getattr__(self, name):  # attributes of newer torch versions
        return getattr(self.__dict__["_inner"], name)

    def __repr__(self):
        return f"RecordingWork({self._inner!r})"


def _forward(name: str) -> Callable[..., Any]:
    def method(self: RecordingWork, *args: Any) -> Any:
        return getattr(self._inner, name)(*args)

    method.__name__ = method.__qualname__ = name
    return method


# Everything else is the real Work's. Defined on the class (not left to ``__getattr__``): these
# are methods of ``dist.Work`` itself, which would answer for the Work wrapper, not the real one.
for _name in (
    "get_future",
    "get_future_result",
    "is_completed",
    "is_success",
    "exception",
    "source_rank",
    "_source_rank",
    "result",
    "_get_duration",
    "_get_op_type",
    "boxed",
):
    setattr(RecordingWork, _name, _forward(_name))
del _name

__all__ = ["RecordingWork"]
