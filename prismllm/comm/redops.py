"""NCCL's reduce ops that gloo lacks, on a recorded gloo group: ``ReduceOp.AVG`` and
``PREMUL_SUM``.

Gloo refuses both ("Cannot use ReduceOp.AVG with Gloo", "... PREMUL_SUM ..."), while torch's
own code issues them on any group it takes for NCCL: FSDP2's gradient reduce-scatter (AVG, or
``PREMUL_SUM(1/factor)`` after ``set_gradient_divide_factor``), DTensor's ``Partial("avg")``.
A CUDA program run on CPU processes (``--cuda-on-cpu``, ``prismllm.devicemap``), or a CPU
program that uses them, would stop at its first gradient reduction.

:class:`GlooReduceOps` stands in for a recorded group's real ``_inner`` (below the saving layer,
so saved inputs and outputs are the program's, before and after the whole op) and runs them as
NCCL defines them, a SUM on gloo plus a local step: PREMUL_SUM(f) multiplies each member's input
by ``f`` first (in place where the input is the output, else into a copy), AVG divides the output
by the group size once the SUM completed (integers truncated, as NCCL), at ``wait`` or through
the Work's Future, whichever comes first. The same local steps as a pruned call's
(``prismllm.pruning``). Every other call goes to the real group as it is. The native recorder
has no such step: ``prism record --cuda-on-cpu`` takes the Python path.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from prismllm.comm.recorder import premul_factor
from prismllm.comm.recording import RS_BASE, RS_COAL

_C = torch._C._distributed_c10d
_AVG = _C.ReduceOp.RedOpType.AVG
_PREMUL = _C.ReduceOp.RedOpType.PREMUL_SUM
_OPTION_FIELDS = ("timeout", "asyncOp", "rootRank", "rootTensor")

# the inner group's reducing methods: in place (the input is the output) or a scatter
_IN_PLACE = ("allreduce", "allreduce_coalesced", "reduce")
_SCATTER = ("reduce_scatter", RS_BASE, RS_COAL)


def _with_sum(opts: Any) -> Any:
    """A copy of ``opts`` with ReduceOp.SUM (the program's options object stays as it is)."""
    new = type(opts)()
    for f in _OPTION_FIELDS:
        if hasattr(opts, f):
            setattr(new, f, getattr(opts, f))
    new.reduceOp = dist.ReduceOp.SUM
    return new


def _first(x: Any) -> torch.Tensor:
    while not isinstance(x, torch.Tensor):  # a list, or a list of lists
        x = x[0]
    return x


def _scaled(x: Any, factor: Any) -> Any:
    return x * factor if isinstance(x, torch.Tensor) else [_scaled(t, factor) for t in x]


def _tensors(x: Any) -> list[torch.Tensor]:
    return [x] if isinstance(x, torch.Tensor) else list(x)


@torch.no_grad()  # a backend writes outside autograd (an output may be a leaf that requires grad)
def _divide(ts: list[torch.Tensor], n: int) -> None:
    for t in ts:
        if t.is_floating_point() or t.is_complex():
            t.div_(n)
        else:
            t.div_(n, rounding_mode="trunc")


class PostWork(dist.Work):
    """The real Work, with ``post`` run once after it completed: before ``wait`` returns and
    before its Future's value is seen."""

    def __init__(self, inner: Any, post: Callable[[], None]):
        super().__init__()
        self._inner = inner
        self._post = post
        self._lock = threading.Lock()
        self._posted = False

    def _run_post(self) -> None:
        with self._lock:
            if not self._posted:
                self._posted = True
                self._post()

    def wait(self, timeout=None):
        done = self._inner.wait() if timeout is None else self._inner.wait(timeout)
        self._run_post()
        return done

    def get_future(self):
        def posted(fut):
            self._run_post()
            return fut.value()

        return self._inner.get_future().then(posted)

    def synchronize(self):
        self._inner.synchronize()
        self._run_post()

    def is_completed(self):
        return self._inner.is_completed()

    def is_success(self):
        return self._inner.is_success()

    def exception(self):
        return self._inner.exception()

    def result(self):
        return self._inner.result()

    def source_rank(self):
        return self._inner.source_rank()


class GlooReduceOps:
    """A group's real ``_inner``, whose AVG and PREMUL_SUM run as SUM plus the local step where
    the backend of the tensors' device is gloo; everything else is the real group's."""

    def __init__(self, inner: Any):
        self.__dict__["_real"] = inner
        self.__dict__["_gloo"] = {}  # device type -> its backend is gloo

    def _is_gloo(self, t: torch.Tensor) -> bool:
        known = self.__dict__["_gloo"]
        kind = t.device.type
        if kind not in known:
            known[kind] = self._real._get_backend(t.device).name().lower() == "gloo"
        return known[kind]

    def __getattr__(self, name: str) -> Any:
        real = self.__dict__["_real"]
        method = getattr(real, name)
        if name not in _IN_PLACE and name not in _SCATTER:
            return method

        def call(outputs, *rest):
            *inputs, opts = rest
            red = opts.reduceOp
            kind = getattr(red, "op", red)
            if kind not in (_AVG, _PREMUL) or not self._is_gloo(_first(outputs)):
                return method(outputs, *rest)
            results = _tensors(outputs)
            if name == "reduce" and opts.rootRank != real.rank():
                results = []  # only the root's buffer holds the result
            if kind == _PREMUL:
                factor = premul_factor(red)
                with torch.no_grad():
                    if name in _SCATTER:  # into copies: the program's inputs stay as they are
                        inputs = [_scaled(inputs[0], factor)]
                    elif results:  # in place: the input is the output
                        for t in results:
                            t.mul_(factor)
                    else:  # a reduce's non-root: its input is not an output
                        outputs = _scaled(outputs, factor)
                return method(outputs, *inputs, _with_sum(opts))
            work = method(outputs, *inputs, _with_sum(opts))
            size = real.size()
            if work is None:
                _divide(results, size)
                return None
            return PostWork(work, lambda: _divide(results, size))

        return call


def wrap(inner: Any, backends: list[str]) -> Any:
    """``inner`` wrapped where one of its backends (by name) is gloo; else ``inner`` itself."""
    return GlooReduceOps(inner) if "gloo" in backends else inner


__all__ = ["GlooReduceOps", "PostWork", "wrap"]
