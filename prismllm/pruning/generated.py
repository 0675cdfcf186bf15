"""The proxy's part of a pruned call when the virtual ranks' inputs are generated (no recording):
buffers on the proxy's device that carry no virtual member's data, made once and reused.

What the sandbox then sees (its ``like_me`` side, ``pruning.calls.sandbox_call``): a reduction
over the real members scaled to the group (the proxy contributes nothing: the reduce op's
identity, or on NCCL a PREMUL_SUM factor of 0), zeros where the proxy's data reach it
(broadcast, all_to_all, point-to-point), and for an integer all_gather its own input in every
virtual slot.

A float all_gather's virtual slots hold what a real member contributed to the first all_gather of
the same size on the group (zeros in that first one): the proxy's kept input is filled from its
output once that call completed (an echo, on the proxy's device; a call already in flight may
read it half filled, every element then zero or a real member's value). The values are a real
member's, not the virtual members' own, but of their kind: a GPU's matrix multiplications run
faster on zeros than on such data (their power draw is lower), and with FSDP2's parameters
gathered half zeros (N = 2) or three quarters (N = 4), slices and emulations ran 6.6 % and 9.7 %
faster than the real jobs on four H100s. Once per kept buffer, not after every call: the echo
copies the whole input, and after every call back-to-back all_gathers of 1-8 GB waited for it
on the proxy's device (7-12 % over the real calls on two H200s).

Reuse: a buffer the small call never writes (a send payload, a reduce-scatter or all-gather input,
a broadcast root's tensor) or whose contents no longer matter (an output the proxy never reads,
an all_reduce buffer contributed with factor 0) is made once per size and kept, per proxy group:
no allocation, no fill and no device memory per call, whatever the number of calls in flight. A
buffer the call overwrites and that must hold the identity again (a max/min/product all_reduce,
an integer sum) is made afresh for each call.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from prismllm.pruning.calls import SmallCall, _p2p_call, premul_factors, premultiplied, split_padding
from prismllm.pruning.plans import Plan, PruningError


def identity(op: str, dtype: torch.dtype) -> Any:
    """The element a reduction with ``op`` leaves its other operand unchanged with."""
    if op in ("sum", "avg", "premul_sum", "bor", "bxor"):
        return 0
    if op == "product":
        return 1
    if op == "band":
        return True if dtype == torch.bool else -1
    if op in ("max", "min"):
        if dtype == torch.bool:
            return op == "min"
        info = torch.finfo(dtype) if dtype.is_floating_point else torch.iinfo(dtype)
        return info.min if op == "max" else info.max
    raise PruningError(f"no identity for reduce op {op!r}")


class GeneratedBuffers:
    """One proxy group's kept buffers, by (role, elements, dtype, fill value), at most ``limit_bytes``
    of them: past it the least recently used go (a call in flight holds its own reference, so its
    memory is freed only once it completed), never those of the call being made (:meth:`begin`).
    Seen without a limit: a sweep of sizes up to 8 GB kept every size and ran the assistant's GPU
    out of memory. Seen when a call's own buffers could go: an 8 GB all_gather at N = 4 (a 6 GB
    input and a 12 GB output on the proxy, over a limit of 17.5 GB) evicted its input to keep its
    output and the reverse, so every call made 18 GB anew, and the 16 calls in flight ran the
    assistant's H200 out of memory."""

    def __init__(self, device: Any = None, limit_bytes: int = 8 << 30):
        self.device = device
        self.limit_bytes = limit_bytes
        self._kept: OrderedDict[tuple, torch.Tensor] = OrderedDict()
        self._this_call: set[tuple] = set()  # the keys the call being made took (begin)

    def begin(self) -> None:
        """A new call: the buffers it takes from now on are kept until the next call begins, even
        where they alone exceed the limit."""
        self._this_call = set()

    def kept(self, role: str, numel: int, dtype: torch.dtype, fill: Any = None) -> torch.Tensor:
        """A buffer made once: filled with ``fill`` (or left as allocated, for one never read)."""
        key = (role, int(numel), dtype, fill)
        self._this_call.add(key)
        t = self._kept.get(key)
        if t is not None:
            self._kept.move_to_end(key)
            return t
        t = torch.empty(int(numel), dtype=dtype, device=self.device)
        if fill is not None:
            t.fill_(fill)
        self._kept[key] = t
        # the least recently used first; once one of this call's is first, every later one is too
        while self.nbytes > self.limit_bytes and next(iter(self._kept)) not in self._this_call:
            self._kept.popitem(last=False)
        return t

    def holds(self, role: str, numel: int, dtype: torch.dtype, fill: Any = None) -> bool:
        """Whether ``kept`` of these keys would hand back a buffer made before (not a new one)."""
        return (role, int(numel), dtype, fill) in self._kept

    def fresh(self, numel: int, dtype: torch.dtype, fill: Any) -> torch.Tensor:
        return torch.full((int(numel),), fill, dtype=dtype, device=self.device)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self._kept.values())


def generated_proxy_call(p: Plan, bufs: GeneratedBuffers, coalesce: bool = False, premul: bool = False) -> SmallCall:
    """The proxy's small call for plan ``p`` with generated virtual inputs (module docstring);
    ``coalesce``, ``premul`` (NCCL): as the real members' call is issued."""
    G, i, op, dt = p.group, p.group.proxy, p.op, p.dtype
    bufs.begin()
    factors = premul_factors(p, like_me=True) if premul else None
    if op == "all_reduce":
        if factors is not None:  # contributed with factor 0: whatever it holds after a call
            buf = bufs.kept("all_reduce", p.slot, dt, 0)
        else:
            buf = bufs.fresh(p.slot, dt, identity(p.reduce_op, dt))
        call = SmallCall("all_reduce", i, reduce_op=p.small_reduce_op, input=buf, output=buf)
        return split_padding(premultiplied(call, factors, proxy=True), p, coalesce)
    if op == "reduce_scatter":
        buf = bufs.kept("reduce_scatter.in", G.size * p.slot, dt, identity(p.reduce_op, dt))
        out = bufs.kept("reduce_scatter.out", p.slot, dt)
        call = SmallCall("reduce_scatter", i, reduce_op=p.small_reduce_op, input=buf, output=out)
        return premultiplied(call, factors, proxy=True)
    if op == "reduce":
        root = not G.is_real(p.root)  # the root's buffer receives the result: made for each call
        fill = identity(p.reduce_op, dt)
        buf = bufs.fresh(p.numel, dt, fill) if root else bufs.kept("reduce", p.numel, dt, fill)
        return SmallCall("reduce", i, reduce_op=p.small_reduce_op, root=p.small_root, input=buf, output=buf, result=buf)
    if op == "all_gather":
        virtual, c = len(G.virtual), p.numel
        kept_in = ("all_gather.in", virtual * c, dt, 0)
        # integers: the sandbox puts its own there; floats: echoed by the call that makes the
        # buffer, once a buffer (module docstring)
        echo = (dt.is_floating_point or dt.is_complex) and not bufs.holds(*kept_in)
        buf = bufs.kept(*kept_in)
        out = bufs.kept("all_gather.out", G.size * p.slot, dt)
        if not echo:
            return SmallCall("all_gather", i, input=buf, output=out)
        real = G.small(G.real[0]) * p.slot
        heard = out[real : real + c]

        def echo() -> None:  # the virtual members hold what a real member held (module docstring)
            buf.view(virtual, c).copy_(heard.expand(virtual, c))

        return SmallCall("all_gather", i, input=buf, output=out, post=echo)
    if op == "broadcast":
        role = "zeros" if not G.is_real(p.root) else "broadcast.in"  # a real root's data: received, unread
        buf = bufs.kept(role, p.numel, dt, 0 if role == "zeros" else None)
        return SmallCall("broadcast", i, root=p.small_root, input=buf, output=buf, result=buf)
    if op == "all_to_all":
        buf = bufs.kept("zeros", sum(p.small_send[i]), dt, 0)
        out = bufs.kept("all_to_all.out", sum(p.small_recv[i]), dt)
        return SmallCall(
            "all_to_all", i, input=buf, output=out, in_splits=list(p.small_send[i]),
            out_splits=list(p.small_recv[i]), result=out,
        )  # fmt: skip
    if op in ("gather", "scatter", "send", "recv", "p2p"):

        def payload(m: int, kind: str) -> torch.Tensor:
            n = p.messages[m].numel
            return bufs.kept("recv", n, dt) if kind == "recv" else bufs.kept("zeros", n, dt, 0)

        return _p2p_call(p, i, payload)
    if op == "barrier":
        return SmallCall("barrier", i)
    raise PruningError(f"no proxy call for op {op!r}")


__all__ = ["GeneratedBuffers", "generated_proxy_call", "identity"]
