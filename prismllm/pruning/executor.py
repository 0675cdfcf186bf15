"""A reference executor of pruned calls on any ``ProcessGroup`` object (what the tests use with
gloo), and the logical result every real member must see."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from prismllm.pruning.calls import SmallCall, a2a_in_chunks
from prismllm.pruning.plans import Plan, PruningError
from prismllm.pruning.tensors import chunks, flat, post_reduce, reduce

# ---------------------------------------------------------------------- reference executor
_TORCH_REDOP = {
    "sum": "SUM",
    "avg": "AVG",
    "max": "MAX",
    "min": "MIN",
    "product": "PRODUCT",
    "band": "BAND",
    "bor": "BOR",
    "bxor": "BXOR",
}


def _torch_redop(name: str) -> Any:

    return getattr(dist.ReduceOp, _TORCH_REDOP[name])


@functools.lru_cache(maxsize=64)
def _premul_sum(factor: float) -> Any:
    """NCCL's pre-multiplied sum with ``factor``, one ReduceOp per factor (a call reads it)."""
    return dist._make_nccl_premul_sum(factor)


def _call_redop(call: SmallCall) -> Any:
    """The ReduceOp a call is issued with: NCCL's pre-multiplied sum with this member's own factor
    (``SmallCall.factor``), or the named op."""
    if call.reduce_op == "premul_sum":
        return _premul_sum(float(call.factor))
    return _torch_redop(call.reduce_op)


def issue(pg: Any, call: SmallCall, sync: bool = False) -> list:
    """Issue ``call`` on a ``ProcessGroup`` object (the small communicator) through its own
    methods; returns the Work objects (wait on all, then ``call.finish()``). ``sync``: as a
    program's ``async_op=False`` call, which a ProcessGroupNCCL (torch 2.8 on) runs on the current
    stream and answers with no Work (none in the list), where an asynchronous call goes through
    the group's own stream, with an event each way."""

    def opts(o: Any) -> Any:
        if hasattr(o, "asyncOp"):  # torch 2.7 on
            o.asyncOp = not sync
        return o

    op = call.op
    if op == "all_reduce":
        o = opts(dist.AllreduceOptions())
        o.reduceOp = _call_redop(call)
        if call.parts:
            if _nccl(pg):  # one NCCL group, issued by one call (a batch of two is four: ~2x the host time)
                oc = opts(dist.AllreduceCoalescedOptions())
                oc.reduceOp = o.reduceOp
                works = [pg.allreduce_coalesced(call.parts, oc)]
            else:
                works = [pg.allreduce([t], o) for t in call.parts]  # gloo has no batches: one after the other
        else:
            works = [pg.allreduce([call.input], o)]
    elif op == "reduce_scatter":
        o = opts(dist.ReduceScatterOptions())
        o.reduceOp = _call_redop(call)
        works = [pg._reduce_scatter_base(call.output, call.input, o)]
    elif op == "all_gather":
        works = [pg._allgather_base(call.output, call.input, opts(torch._C._distributed_c10d.AllgatherOptions()))]
    elif op == "broadcast":
        o = opts(dist.BroadcastOptions())
        o.rootRank, o.rootTensor = call.root, 0
        works = [pg.broadcast([call.input], o)]
    elif op == "reduce":
        o = opts(dist.ReduceOptions())
        o.rootRank, o.rootTensor = call.root, 0
        o.reduceOp = _torch_redop(call.reduce_op)
        works = [pg.reduce([call.input], o)]
    elif op == "all_to_all":
        works = [
            pg.alltoall_base(call.output, call.input, call.out_splits, call.in_splits, opts(dist.AllToAllOptions()))
        ]
    elif op == "p2p":
        works = issue_batch(pg, [call])
    elif op == "barrier":
        works = [pg.barrier(opts(dist.BarrierOptions()))]
    else:
        raise PruningError(f"cannot issue {op!r}")
    return [w for w in works if w is not None]


# the small calls the native lane issues again from a template
_LANE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


def lane_template(call: SmallCall, program: Sequence[torch.Tensor]) -> tuple | None:
    """What the native lane (``prismllm/comm/native/pruned_lane.h``) needs to issue ``call`` again
    for another call of the same signature without Python, as :func:`issue` issues it: (op,
    reduce op code, pre-multiplied factor or NaN, small root, input role, output role, padding
    tensor or None), a role being (index in ``program``, offset, numel) of a tensor that lies
    inside one of the program's tensors (flattened). None when the call does more than that: a
    step before or after it, scratch of its own, a tensor of neither kind."""
    if call.op not in _LANE_OPS or call.post is not None or call.release is not None:
        return None
    parts = list(call.parts)
    if parts and (call.op != "all_reduce" or len(parts) != 2):
        return None
    inp = parts[0] if parts else call.input
    if inp is None or (call.op in ("all_reduce", "broadcast") and call.output is not None and call.output is not inp
                       and call.output.data_ptr() != inp.data_ptr()):  # fmt: skip
        return None
    in_role = _role(inp, program)
    out_role = _role(call.output, program) if call.op in ("all_gather", "reduce_scatter") else None
    if in_role is None or (call.op in ("all_gather", "reduce_scatter") and out_role is None):
        return None
    red = -1
    factor = float("nan")
    if call.op in ("all_reduce", "reduce_scatter"):
        if call.reduce_op == "premul_sum":
            red, factor = int(dist.ReduceOp.RedOpType.PREMUL_SUM.value), float(call.factor)
        else:
            red = int(getattr(dist.ReduceOp.RedOpType, _TORCH_REDOP[call.reduce_op]).value)
    return (call.op, red, factor, int(call.root), in_role, out_role, parts[1] if parts else None)


def _role(t: torch.Tensor | None, program: Sequence[torch.Tensor]) -> tuple[int, int, int] | None:
    """Where ``t`` lies in the program's tensors: (index, offset, numel), or None."""
    if t is None or not t.is_contiguous():
        return None
    size = t.element_size()
    for i, p in enumerate(program):
        if p.dtype != t.dtype or p.device != t.device or not p.is_contiguous():
            continue
        start = t.data_ptr() - p.data_ptr()
        if 0 <= start and start % size == 0 and start + t.numel() * size <= p.numel() * size:
            return i, start // size, t.numel()
    return None


def _nccl(pg: Any) -> bool:
    return type(pg).__name__ == "ProcessGroupNCCL"


def _coalescing(pg: Any, name: str, device: Any) -> Any:
    """``_start_coalescing``/``_end_coalescing`` of a backend object: torch 2.11's bindings
    take no device, newer ones take it."""
    fn = getattr(pg, name)
    try:
        return fn(device)
    except TypeError:
        return fn()


def issue_batch(pg: Any, calls: Sequence[SmallCall]) -> list:
    """Issue several calls as one batch (``batch_isend_irecv``'s). On NCCL the point-to-point
    ops of the batch go into one NCCL group (``_start_coalescing``/``_end_coalescing``, as
    torch does): posted one by one on the communicator's single stream, a send waiting for
    its receiver could block a receive the peer needs first. Gloo posts them one by one."""
    p2p = [op for c in calls if c.op == "p2p" for op in c.ops]
    other = [c for c in calls if c.op != "p2p"]
    works = [w for c in other for w in issue(pg, c)]
    if not p2p:
        return works

    def post() -> list:
        return [pg.send([t], peer, tag) if kind == "send" else pg.recv([t], peer, tag) for kind, peer, t, tag in p2p]

    return works + _batched(pg, p2p[0][2].device, post)


def _batched(pg: Any, device: Any, post: Any) -> list:
    """The Works of the ops ``post()`` issues, in one NCCL group on NCCL (the batch's Work from
    ``_end_coalescing``); gloo, which has no batches, issues them one after the other."""
    nccl = _nccl(pg)
    if nccl:
        _coalescing(pg, "_start_coalescing", device)
    works: list = []
    try:
        works = [w for w in post() if w is not None]
    finally:
        if nccl:
            w = _coalescing(pg, "_end_coalescing", device)
            if w is not None:
                works.append(w)
    return works


def run(pg: Any, call: SmallCall) -> SmallCall:
    """Issue, wait, finish: the blocking form."""
    for w in issue(pg, call):
        w.wait()
    call.finish()
    return call


# ---------------------------------------------------------------------- logical reference
def reference(p: Plan, inputs: Sequence[Any]) -> dict:
    """The logical result every real member must see, computed directly from all n
    members' inputs (indexed by logical group rank): real member g -> its output (a tensor,
    or a list for gather at the root; None where the op leaves it nothing defined). For
    p2p plans: message index -> payload. For tests and for checking a replay."""
    G = p.group
    op = p.op
    out = {}
    if op == "all_reduce":
        red = reduce([flat(x) for x in inputs], p.reduce_op, p.factor)
        post_reduce(red, p.reduce_op, G.n)
        return {r: red.view(inputs[r].shape) for r in G.real}
    if op == "reduce_scatter":
        ch = [chunks(x, G.n) for x in inputs]
        for r in G.real:
            red = reduce([ch[s][r] for s in range(G.n)], p.reduce_op, p.factor)
            post_reduce(red, p.reduce_op, G.n)
            out[r] = red
        return out
    if op == "all_gather":
        full = torch.cat([flat(x) for x in inputs])
        return {r: full for r in G.real}
    if op == "broadcast":
        return {r: inputs[p.root] for r in G.real}
    if op == "reduce":
        red = reduce([flat(x) for x in inputs], p.reduce_op, p.factor)
        post_reduce(red, p.reduce_op, G.n)
        return {r: (red if r == p.root else None) for r in G.real}
    if op == "gather":
        return {r: ([inputs[s] for s in range(G.n)] if r == p.root else None) for r in G.real}
    if op == "scatter":
        return {r: inputs[p.root][r] for r in G.real}
    if op == "all_to_all":
        for r in G.real:
            out[r] = torch.cat([a2a_in_chunks(p, s, inputs[s])[r] for s in range(G.n)])
        return out
    if op in ("send", "recv", "p2p"):
        return {m: inputs[m] for m in range(len(p.messages))}
    if op == "barrier":
        return {r: None for r in G.real}
    raise PruningError(f"no reference for op {op!r}")
