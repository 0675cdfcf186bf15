"""Tensor helpers of the pruned calls' buffers: flat views, chunks, reductions in the order a
real backend reduces, and the virtual members' inputs by logical group rank."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from prismllm.pruning.plans import Plan, PruningError


def contig_flat(t: torch.Tensor) -> torch.Tensor | None:
    return t.view(-1) if t.is_contiguous() else None


def flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1)


def chunks(x: torch.Tensor | Sequence[torch.Tensor], n: int) -> list:
    """The n flat chunks of a tensor of n*c elements (the program's [n*rows, ...] buffer),
    or of a list of n tensors."""
    if isinstance(x, torch.Tensor):
        if x.numel() % n:
            raise PruningError(f"a tensor of {x.numel()} elements does not split into {n} chunks")
        return list(flat(x).view(n, -1).unbind(0)) if x.is_contiguous() else list(x.reshape(n, -1).unbind(0))
    if len(x) != n:
        raise PruningError(f"expected {n} tensors, got {len(x)}")
    return [flat(t) for t in x]


class Reducer:
    """A running reduction with the logical op, one tensor at a time (the proxy may reduce
    thousands of virtual members' inputs: never all of them in memory at once). AVG gives the
    SUM (the divide is the sandbox's post step), PREMUL_SUM gives sum(factor * t); sums of
    half-precision tensors accumulate in float32 and are rounded once."""

    def __init__(self, op: str, factor: Any = None):
        self.op, self.factor = op, factor
        self.acc: torch.Tensor | None = None
        self.dtype: torch.dtype | None = None

    def add(self, t: torch.Tensor) -> None:
        op = self.op
        if op == "premul_sum":
            t = t * self.factor
        if self.acc is None:
            self.dtype = t.dtype
            low = t.dtype in (torch.float16, torch.bfloat16) and op in ("sum", "avg", "premul_sum")
            self.acc = t.float() if low else t.clone()
            return
        acc = self.acc
        if op in ("sum", "avg", "premul_sum"):
            acc.add_(t)
        elif op == "product":
            acc.mul_(t)
        elif op == "max":
            torch.maximum(acc, t, out=acc)
        elif op == "min":
            torch.minimum(acc, t, out=acc)
        elif op == "band":
            acc.bitwise_and_(t)
        elif op == "bor":
            acc.bitwise_or_(t)
        elif op == "bxor":
            acc.bitwise_xor_(t)
        else:  # pragma: no cover - _redop validated
            raise PruningError(f"unsupported reduce op {op!r}")

    def result(self) -> torch.Tensor:
        if self.acc is None:
            raise PruningError("nothing to reduce")
        return self.acc if self.acc.dtype == self.dtype else self.acc.to(self.dtype)


def reduce(ts: Iterable[torch.Tensor], op: str, factor: Any = None) -> torch.Tensor:
    """Reduce flat tensors (any iterable, consumed one at a time) with the logical op."""
    r = Reducer(op, factor)
    for t in ts:
        r.add(t)
    return r.result()


def post_reduce(t: torch.Tensor, op: str, n: int) -> None:
    """The sandbox's post step after the small SUM: AVG divides by the logical n (NCCL's
    integer AVG truncates, as ``rounding_mode='trunc'``)."""
    if op == "avg":
        if t.is_floating_point() or t.is_complex():
            t.div_(n)
        else:
            t.div_(n, rounding_mode="trunc")


def pre_reduce(t: torch.Tensor, op: str, factor: Any) -> None:
    """The sandbox's pre step: PREMUL_SUM multiplies the member's own input by the factor."""
    if op == "premul_sum":
        t.mul_(factor)


class VirtualInputs:
    """The virtual members' inputs, fetched from ``inputs`` when first read and not kept:
    a member missing is one clear error."""

    def __init__(self, p: Plan, inputs: Any):
        self.p, self.inputs = p, inputs

    def __getitem__(self, v: int) -> Any:
        try:
            x = self.inputs[v]
        except (IndexError, KeyError, TypeError):
            x = None
        if x is None:
            raise PruningError(f"{self.p.op}: the proxy has no input for virtual member {v}")
        return x


def virtual_inputs(p: Plan, inputs: Any) -> VirtualInputs:
    return VirtualInputs(p, inputs)
