"""Pure tensor work, no communication: the buffers of a pruned call on the small communicator
(:class:`SmallCall`) built from the program's tensors (:func:`sandbox_call`) or from the
virtual members' inputs (:func:`proxy_call`); ``SmallCall.finish()`` is the sandbox's post step."""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from prismllm.generate.generator import keep_local
from prismllm.pruning.plans import Plan, PruningError
from prismllm.pruning.tensors import (
    Reducer,
    chunks,
    contig_flat,
    flat,
    post_reduce,
    pre_reduce,
    reduce,
    virtual_inputs,
)


# ---------------------------------------------------------------------- small calls
@dataclasses.dataclass
class SmallCall:
    """One member's call on the small communicator: buffers ready to issue, and the local
    post step (``finish``), to run once the call completed (for async work: on wait, after
    the communication on its stream)."""

    op: str
    small_rank: int
    reduce_op: str = ""
    root: int = -1
    input: torch.Tensor | None = None
    output: torch.Tensor | None = None
    in_splits: list | None = None
    out_splits: list | None = None
    ops: list = dataclasses.field(default_factory=list)  # p2p: (kind, peer, tensor, tag)
    # all_reduce split in parts issued as one batch (one NCCL group): the program's tensor in place
    # and the padding apart, instead of a copy into a padded buffer and back (``coalesce``)
    parts: list = dataclasses.field(default_factory=list)
    factor: float = 1.0  # reduce_op "premul_sum": this member's own scalar (NCCL's pre-multiplied sum)
    post: Callable[[], None] | None = None
    result: Any = None  # proxy: what it received, when useful (reduce to a virtual root)
    release: Callable[[], None] | None = None  # sandbox: gives its scratch back, after ``post``

    def finish(self) -> None:
        if self.post is not None:
            self.post()
        if self.release is not None:
            self.release()
            self.release = None


class _Buffers:
    """Where a sandbox call's own buffers come from: PyTorch's allocator, or on a GPU a
    scratch arena outside it (``scratch(device)``, e.g. ``prismllm.comm.scratch.arena``: an
    object with ``take(numel, dtype, zero)`` and ``give_back(buffers)``, or None for a device
    it does not serve), so that the program's memory figures stay its own."""

    def __init__(self, scratch: Callable[[torch.device], Any] | None, device: torch.device):
        self.scratch = scratch(device) if scratch is not None else None  # None: PyTorch's allocator
        self.device = device
        self.taken: list[torch.Tensor] = []

    def new(self, numel: int, dtype: torch.dtype, zero: bool = False) -> torch.Tensor:
        if self.scratch is None:
            return (torch.zeros if zero else torch.empty)(numel, dtype=dtype, device=self.device)
        t = self.scratch.take(numel, dtype, zero)
        self.taken.append(t)
        return t

    def unread(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A buffer no one reads back (padding): shared by every call on a GPU (the arena's
        ``unread``), never handed back."""
        if self.scratch is None:
            return torch.empty(numel, dtype=dtype, device=self.device)
        return self.scratch.unread(numel, dtype)

    def bind(self, call: SmallCall) -> SmallCall:
        if self.taken:
            taken, scratch = self.taken, self.scratch
            call.release = lambda: scratch.give_back(taken)
        return call


def sandbox_call(
    p: Plan,
    g: int,
    *,
    tensor: torch.Tensor | None = None,
    input: Any = None,
    output: Any = None,
    tensors: Mapping[int, torch.Tensor] | None = None,
    scratch: Callable[[torch.device], Any] | None = None,
    like_me: bool = False,
    coalesce: bool = False,
    premul: bool = False,
) -> SmallCall:
    """The small-communicator call of real member ``g`` (logical group rank) for the
    program's tensors, as the program passed them:

    - all_reduce, broadcast, reduce: ``tensor`` (in place);
    - reduce_scatter: ``output`` (c elements), ``input`` ([n*c]-shaped tensor or list of n);
    - all_gather: ``output`` ([n*c]-shaped tensor or list of n), ``input``;
    - gather: ``input``, ``output`` (list of n, at the root); scatter: ``output``, ``input``
      (list of n, at the root);
    - all_to_all: ``output``, ``input`` (tensors split as the plan's splits, or lists of n);
    - send/recv/p2p: ``tensors``: message index -> the tensor sent or received (``tensor``
      alone for a one-message plan);
    - barrier: nothing.

    ``scratch``: on a GPU, the arena of a device where the call's own buffers come from (see
    :class:`_Buffers`; default: PyTorch's allocator); ``SmallCall.finish`` gives them back.
    ``like_me`` (the virtual ranks' inputs are generated, not recorded: the proxy contributes
    the reduce op's identity, ``pruning.generated``): every virtual member is taken to hold what
    this member holds, as solo capture's tensor generator answers (``generate.generator``), so
    that the program stays on its normal path: an all_gather's virtual slots get this member's
    own input (values that decide shapes, such as MoE routing counts, then agree with the
    graph), and a sum over the group (all_reduce, reduce_scatter, reduce; sum, avg,
    premul_sum) is scaled from the real members' to ``n`` members' (``n / k`` in the post
    step): a tensor-parallel partial sum or a data-parallel gradient keeps its magnitude
    where the virtual members' zeros would have left a k/n share of it (a vocabulary-parallel
    cross-entropy then went negative). Max, min, products and bitwise ops over the real
    members already are what every member holding the same gives. A broadcast from a virtual
    root leaves the member's own buffer (cleaned where it holds uninitialised memory), as the
    generator does: a replica's copy of replicated state is what the root sends (DDP's check of
    parameter shapes against rank 0's failed on the root's zeros).

    ``coalesce`` (the small communicator batches collectives, as NCCL does): a padded all_reduce
    runs as two all_reduces in one batch, the program's tensor in place and the padding in
    scratch, with no copy of the tensor on either side of the call (the proxy, with the same
    ``coalesce``, splits its buffer the same way). ``premul`` (NCCL): a sum-like reduction of
    floats runs as PREMUL_SUM with the factors of :func:`premul_factors`: the like_me scaling,
    AVG's divide and PREMUL_SUM's multiply happen inside the collective, not as passes over the
    program's tensor on its stream. Scratch a call does not read back (padding, the proxy's
    slot) is never cleared: its values reach no real member's result.
    """
    G = p.group
    if not G.is_real(g):
        raise PruningError(f"{p.op}: member {g} is virtual; the proxy plays it")
    i = G.small(g)
    op = p.op
    if op in ("all_reduce", "reduce_scatter", "all_gather", "reduce", "all_to_all"):
        first = next((t for t in (tensor, input, output) if t is not None), None)
        ref = first if isinstance(first, torch.Tensor) else (first[0] if first else None)
        bufs = _Buffers(scratch, ref.device if isinstance(ref, torch.Tensor) else torch.device("cpu"))
        scale = _like_me_scale(p) if like_me else 1.0
        factors = premul_factors(p, like_me) if premul else None
        if op == "all_reduce":
            return bufs.bind(_sb_all_reduce(p, i, tensor, bufs, scale, coalesce, factors))
        if op == "reduce_scatter":
            return bufs.bind(_sb_reduce_scatter(p, i, output, input, bufs, scale, factors))
        if op == "all_gather":  # values that decide shapes and flow are integers; floats keep the proxy's
            # (a real member's data of the last call, ``pruning.generated``: no post step here)
            like = like_me and not (input.dtype.is_floating_point or input.dtype.is_complex)
            return bufs.bind(_sb_all_gather(p, i, output, input, bufs, like))
        if op == "reduce":
            return bufs.bind(_sb_reduce(p, g, i, tensor, bufs, scale))
        return bufs.bind(_sb_all_to_all(p, g, i, output, input, bufs))
    if op == "broadcast":
        if like_me and not G.is_real(p.root):  # a replica's own copy is what the root sends (generator)
            buf = _Buffers(scratch, tensor.device)
            small = buf.new(p.numel, tensor.dtype)
            return buf.bind(
                SmallCall("broadcast", i, root=p.small_root, input=small, output=small, post=lambda: keep_local(tensor))
            )
        return SmallCall("broadcast", i, root=p.small_root, input=tensor, output=tensor)
    if op == "gather":
        return _sb_gather(p, g, i, input, output)
    if op == "scatter":
        return _sb_scatter(p, g, i, input, output)
    if op in ("send", "recv", "p2p"):
        if tensors is None:
            if tensor is None or len(p.messages) != 1:
                raise PruningError(f"{op}: pass tensors={{message index: tensor}}")
            tensors = {0: tensor}
        return _p2p_call(p, i, lambda m, kind: tensors[m])
    if op == "barrier":
        return SmallCall("barrier", i)
    raise PruningError(f"no sandbox call for op {op!r}")


def proxy_call(
    p: Plan, inputs: Any = None, device: Any = None, coalesce: bool = False, premul: bool = False
) -> SmallCall:
    """The proxy's small-communicator call. ``inputs``: what each virtual member would
    contribute, indexed by logical group rank (a list of n with None for real members, or a
    dict): its tensor (all_reduce, reduce, broadcast root), its input (reduce_scatter,
    all_gather, gather, all_to_all), the root's list of n chunks (scatter). For p2p: message
    index -> tensor of each message a virtual member sends. ``device``: where the small call's
    buffers live (the proxy's GPU for an NCCL small group; inputs may be on the host).

    Generated inputs (no recording): ``pruning.generated.generated_proxy_call``.

    ``coalesce``, ``premul`` (NCCL): as the real members' (:func:`sandbox_call`): a padded
    all_reduce in two parts, a sum-like reduction as PREMUL_SUM with the proxy's factor."""
    G = p.group
    i = G.proxy
    op = p.op
    dt = p.dtype
    factors = premul_factors(p, like_me=False) if premul else None
    if op == "all_reduce":
        vin = virtual_inputs(p, inputs)
        buf = torch.empty(p.slot, dtype=dt, device=device)
        buf[: p.numel] = reduce((flat(vin[v]) for v in G.virtual), p.reduce_op, p.factor)
        call = SmallCall("all_reduce", i, reduce_op=p.small_reduce_op, input=buf, output=buf)
        return split_padding(premultiplied(call, factors, proxy=True), p, coalesce)
    if op == "reduce_scatter":
        vin = virtual_inputs(p, inputs)
        acc = [Reducer(p.reduce_op, p.factor) for _ in G.real]
        for v in G.virtual:  # one virtual member's input in memory at a time
            ch = chunks(vin[v], G.n)
            for j, r in enumerate(G.real):
                acc[j].add(ch[r])
        buf = torch.zeros(G.size, p.slot, dtype=dt, device=device)
        for j, r in enumerate(G.real):
            buf[G.small(r), : p.numel] = acc[j].result()
        call = SmallCall(
            "reduce_scatter",
            i,
            reduce_op=p.small_reduce_op,
            input=buf.view(-1),
            output=torch.empty(p.slot, dtype=dt, device=device),
        )
        return premultiplied(call, factors, proxy=True)
    if op == "all_gather":
        vin = virtual_inputs(p, inputs)
        buf = (
            torch.cat([flat(vin[v]) for v in G.virtual]).to(device)
            if p.numel
            else torch.empty(0, dtype=dt, device=device)
        )
        return SmallCall("all_gather", i, input=buf, output=torch.empty(G.size * p.slot, dtype=dt, device=device))
    if op == "broadcast":
        if G.is_real(p.root):
            buf = torch.empty(p.numel, dtype=dt, device=device)
        else:
            buf = flat(virtual_inputs(p, inputs)[p.root]).to(device, copy=True)
        return SmallCall("broadcast", i, root=p.small_root, input=buf, output=buf, result=buf)
    if op == "reduce":
        vin = virtual_inputs(p, inputs)
        buf = reduce((flat(vin[v]) for v in G.virtual), p.reduce_op, p.factor).to(device)
        post = None
        if not G.is_real(p.root) and p.reduce_op == "avg":
            post = lambda: post_reduce(buf, "avg", G.n)  # noqa: E731 - the proxy's copy of the result
        return SmallCall(
            "reduce", i, reduce_op=p.small_reduce_op, root=p.small_root, input=buf, output=buf, post=post, result=buf
        )
    if op == "all_to_all":
        vin = virtual_inputs(p, inputs)
        pieces = []
        ch = {v: a2a_in_chunks(p, v, vin[v]) for v in G.virtual}
        for r in G.real:
            pieces.extend(ch[v][r] for v in G.virtual)
        buf = torch.cat(pieces).to(device) if pieces else torch.empty(0, dtype=dt, device=device)
        out = torch.empty(sum(p.small_recv[i]), dtype=dt, device=device)
        return SmallCall(
            "all_to_all",
            i,
            input=buf,
            output=out,
            in_splits=list(p.small_send[i]),
            out_splits=list(p.small_recv[i]),
            result=out,
        )
    if op in ("gather", "scatter", "send", "recv", "p2p"):
        return _p2p_call(p, i, _proxy_payload(p, inputs, device))
    if op == "barrier":
        return SmallCall("barrier", i)
    raise PruningError(f"no proxy call for op {op!r}")


def split_padding(call: SmallCall, p: Plan, coalesce: bool) -> SmallCall:
    """The proxy's padded all_reduce buffer in the two parts the real members issue (``coalesce``)."""
    if coalesce and call.op == "all_reduce" and p.pad:
        call.parts = [call.input[: p.numel], call.input[p.numel :]]
    return call


def premul_factors(p: Plan, like_me: bool) -> tuple[float, float] | None:
    """A sum-like all_reduce or reduce_scatter of floats on NCCL runs as PREMUL_SUM, each member
    scaling its own contribution inside the collective (NCCL's pre-multiplied sum takes the
    scalar locally), so that neither side needs a pass over the tensor before or after the call:
    (a real member's factor, the proxy's), or None where a plain SUM is right (a sum of
    recorded inputs) or the op is not sum-like. ``like_me`` (generated inputs): the real
    member's factor carries the group's n / k (avg: 1 / k) and the proxy contributes nothing
    (factor 0); recorded: avg is 1/n on both sides, premul_sum(f) is f on the real member and 1
    on the proxy, whose reduction already multiplied by f."""
    if p.op not in ("all_reduce", "reduce_scatter") or p.reduce_op not in ("sum", "avg", "premul_sum"):
        return None
    if not p.dtype.is_floating_point or isinstance(p.factor, torch.Tensor):
        return None
    n, k = p.group.n, p.group.k
    f = float(p.factor) if p.reduce_op == "premul_sum" else 1.0

    def ours(x: float) -> float:  # a factor of prismllm's making (the program's own f goes as it gave it)
        return nccl_premul_scalar(x, p.dtype)

    if like_me:
        return ours({"sum": n / k, "avg": 1.0 / k, "premul_sum": f * n / k}[p.reduce_op]), 0.0
    if p.reduce_op == "sum":
        return None
    return (ours(1.0 / n), ours(1.0 / n)) if p.reduce_op == "avg" else (f, ours(1.0))


def nccl_premul_scalar(factor: float, dtype: torch.dtype) -> float:
    """The host scalar to give NCCL's pre-multiplied sum of a ``dtype`` tensor so that NCCL
    multiplies by ``factor``. ProcessGroupNCCL (torch 2.11; pytorch/pytorch#190745) hands a
    bfloat16 PREMUL_SUM's factor to NCCL as a 4-byte float, of which NCCL reads bfloat16's 2
    bytes: the float's low half, zero for every factor exact in bfloat16 (1, 2, 0.5 ...), so the
    sandbox's bf16 gradients came back all zeros and its optimizer ran on them (AdamW's kernels 26 %
    slower on two H200s). The float returned holds the factor's bfloat16 bits in both halves: read
    as NCCL reads it there, it is the factor; rounded to bfloat16 as a fixed ProcessGroupNCCL
    does (a low half under 0x8000 rounds down), it is the factor too. A negative factor is exact
    on the first and one bfloat16 step larger in magnitude on the second. Other dtypes: ``factor``."""
    if dtype != torch.bfloat16:
        return factor
    bits = struct.unpack("<I", struct.pack("<f", factor))[0]
    b = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF  # to bfloat16, to nearest even
    return struct.unpack("<f", struct.pack("<I", (b << 16) | b))[0]


def premultiplied(call: SmallCall, factors: tuple[float, float] | None, proxy: bool) -> SmallCall:
    """``call`` as a PREMUL_SUM with its side's factor (:func:`premul_factors`), or as it was."""
    if factors is not None:
        call.reduce_op, call.factor = "premul_sum", factors[1] if proxy else factors[0]
    return call


def _like_me_scale(p: Plan) -> float:
    """What the sandbox multiplies a sum-like result by when every virtual member is taken to
    hold what the real members hold (``sandbox_call``'s ``like_me``): n / k."""
    if p.reduce_op in ("sum", "avg", "premul_sum"):
        return p.group.n / p.group.k
    return 1.0


def _scale(t: torch.Tensor, p: Plan, scale: float) -> None:
    """The post step's ``like_me`` scaling (integers: n times, then divided by k, truncated)."""
    if scale == 1.0:
        return
    if t.is_floating_point() or t.is_complex():
        t.mul_(scale)
    else:
        t.mul_(p.group.n)
        if p.group.k > 1:
            t.div_(p.group.k, rounding_mode="trunc")


def _reduces_after(p: Plan, scale: float, factors: tuple[float, float] | None) -> bool:
    """Whether a sum-like result needs a pass after the small call: AVG's division by n or the
    ``like_me`` scaling, unless the pre-multiplied ``factors`` do both inside the call."""
    return factors is None and (p.reduce_op == "avg" or scale != 1.0)


# ---- sandbox helpers
def _sb_all_reduce(
    p: Plan,
    i: int,
    t: torch.Tensor,
    bufs: _Buffers,
    scale: float = 1.0,
    coalesce: bool = False,
    factors: tuple[float, float] | None = None,
) -> SmallCall:
    S = p.numel
    if t.numel() != S:
        raise PruningError(f"all_reduce: tensor of {t.numel()} elements, plan says {S}")
    view = contig_flat(t)
    if view is not None and (p.pad == 0 or coalesce):
        buf = view
        post = None
        if factors is None:  # else the factors do it inside the call
            pre_reduce(buf, p.reduce_op, p.factor)
        if _reduces_after(p, scale, factors):  # else nothing to do after the call

            def post() -> None:
                post_reduce(t, p.reduce_op, p.group.n)
                _scale(t, p, scale)

        call = SmallCall("all_reduce", i, reduce_op=p.small_reduce_op, input=buf, output=buf, post=post)
        if p.pad:  # the padding apart, in the same batch: no copy of the program's tensor
            call.parts = [buf, bufs.unread(p.pad, t.dtype)]
        return premultiplied(call, factors, proxy=False)
    buf = bufs.new(p.slot, t.dtype)
    buf[:S].copy_(flat(t))
    if factors is None:
        pre_reduce(buf[:S], p.reduce_op, p.factor)

    def post() -> None:
        t.copy_(buf[:S].view(t.shape))
        if factors is None:
            post_reduce(t, p.reduce_op, p.group.n)
            _scale(t, p, scale)

    call = SmallCall("all_reduce", i, reduce_op=p.small_reduce_op, input=buf, output=buf, post=post)
    return premultiplied(call, factors, proxy=False)


def _sb_reduce_scatter(
    p: Plan,
    i: int,
    output: Any,
    input: Any,
    bufs: _Buffers,
    scale: float = 1.0,
    factors: tuple[float, float] | None = None,
) -> SmallCall:
    G, c = p.group, p.numel
    ch = chunks(input, G.n)
    if ch[0].numel() != c:
        raise PruningError(f"reduce_scatter: input chunks of {ch[0].numel()} elements, plan says {c}")
    ref = ch[0]
    flat_in = contig_flat(input) if isinstance(input, torch.Tensor) else None
    pre = factors is None and p.reduce_op == "premul_sum"  # a pass over the member's own input first
    if flat_in is not None and not pre and p.slot == c and G.in_logical_order:
        # the program's input is the small call's layout (one virtual member, whose chunk the
        # proxy's slot takes; no padding): issued as it is, no copy
        buf = flat_in
    else:
        slots = bufs.new(G.size * p.slot, ref.dtype).view(G.size, p.slot)
        for r in G.real:
            slots[G.small(r), :c].copy_(ch[r])
        if factors is None:
            pre_reduce(slots, p.reduce_op, p.factor)
        buf = slots.view(-1)
    out_t = output if isinstance(output, torch.Tensor) else output[0]
    direct = contig_flat(out_t) if p.pad == 0 else None
    obuf = direct if direct is not None else bufs.new(p.slot, ref.dtype)

    def post() -> None:
        if direct is None:
            out_t.copy_(obuf[:c].view(out_t.shape))
        if factors is None:
            post_reduce(out_t, p.reduce_op, G.n)
            _scale(out_t, p, scale)

    # a post step that would do nothing is none: the call is then the program's tensors alone, which
    # the native lane issues again from a template (FSDP2's gradient reduce-scatters went through
    # Python's plan every call, ~0.3 ms of the backward's host time each on an H200)
    idle = direct is not None and not _reduces_after(p, scale, factors)
    call = SmallCall(
        "reduce_scatter", i, reduce_op=p.small_reduce_op, input=buf, output=obuf, post=None if idle else post
    )
    return premultiplied(call, factors, proxy=False)


def copy_runs(at: Sequence[int], c: int) -> list[tuple[int, int, int, bool]]:
    """Chunks of ``c`` elements to copy to positions 0, 1, ... of an output from offsets ``at``
    of a source, merged into runs: (first position, chunks, source offset, repeated), a run
    reading one chunk after the next (``repeated`` False) or the same chunk again (True)."""
    runs: list[list] = []
    for r, a in enumerate(at):
        if runs:
            first, m, src, rep = runs[-1]
            if rep is not False and a == src:  # the same chunk again
                runs[-1][1:] = [m + 1, src, True]
                continue
            if rep is not True and a == src + m * c:  # the next chunk of the source
                runs[-1][1:] = [m + 1, src, False]
                continue
        runs.append([r, 1, a, None])
    return [(first, m, src, bool(rep)) for first, m, src, rep in runs]


def _sb_all_gather(p: Plan, i: int, output: Any, input: torch.Tensor, bufs: _Buffers, like_me: bool) -> SmallCall:
    G, c, slot = p.group, p.numel, p.slot
    if input.numel() != c:
        raise PruningError(f"all_gather: input of {input.numel()} elements, plan says {c}")
    if p.pad:
        ibuf = bufs.new(slot, input.dtype)
        ibuf[:c].copy_(flat(input))
    else:
        ibuf = contig_flat(input)
        if ibuf is None:
            ibuf = bufs.new(c, input.dtype)
            ibuf.copy_(flat(input))
    out_flat = contig_flat(output) if isinstance(output, torch.Tensor) else None
    if out_flat is not None and p.pad == 0 and slot == c and G.in_logical_order:
        # the small call's output is the program's (one virtual member, whose slot the proxy's
        # takes): gathered in place, no copy; like_me gives the virtual slot this input
        virtual_slot = out_flat[G.proxy * c : (G.proxy + 1) * c]

        def fill() -> None:
            virtual_slot.copy_(out_flat[i * c : (i + 1) * c])

        return SmallCall("all_gather", i, input=ibuf, output=out_flat, post=fill if like_me else None)
    obuf = bufs.new(G.size * slot, input.dtype)
    # where each member's chunk lies in the small call's output: a real member's slot, a virtual
    # one's part of the proxy's slot (or, like_me, this member's own)
    at = [0] * G.n
    for r in G.real:
        at[r] = G.small(r) * slot
    for x, v in enumerate(G.virtual):
        at[v] = i * slot if like_me else G.proxy * slot + x * c
    if out_flat is not None:  # one copy per run of chunks (on a GPU a kernel each: a few µs)
        spans = copy_runs(at, c)

        def post() -> None:
            for first, m, src, repeated in spans:
                dst = out_flat[first * c : (first + m) * c]
                if repeated:
                    dst.view(m, c).copy_(obuf[src : src + c].expand(m, c))
                else:
                    dst.copy_(obuf[src : src + m * c])

        return SmallCall("all_gather", i, input=ibuf, output=obuf, post=post)

    def post() -> None:
        src = [obuf[a : a + c] for a in at]
        if isinstance(output, torch.Tensor):  # non-contiguous output tensor
            output.copy_(torch.cat(src).view(output.shape))
        else:
            for r in range(G.n):
                output[r].copy_(src[r].view(output[r].shape))

    return SmallCall("all_gather", i, input=ibuf, output=obuf, post=post)


def _sb_reduce(p: Plan, g: int, i: int, t: torch.Tensor, bufs: _Buffers, scale: float = 1.0) -> SmallCall:
    is_root = g == p.root
    buf = t
    if p.reduce_op == "premul_sum" and not is_root:
        buf = bufs.new(t.numel(), t.dtype).view(t.shape)  # the program's non-root tensor stays as it was
        buf.copy_(t)
    if buf is t and not t.is_contiguous():
        raise PruningError("reduce: non-contiguous tensor")
    pre_reduce(buf, p.reduce_op, p.factor)

    def post() -> None:
        post_reduce(t, p.reduce_op, p.group.n)
        _scale(t, p, scale)

    return SmallCall(
        "reduce",
        i,
        reduce_op=p.small_reduce_op,
        root=p.small_root,
        input=buf,
        output=buf,
        post=post if is_root else None,
    )


def _sb_gather(p: Plan, g: int, i: int, input: torch.Tensor, output: Any) -> SmallCall:
    if g == p.root:
        if output is None or len(output) != p.group.n:
            raise PruningError(f"gather: the root needs an output list of {p.group.n}")

        def buf(m: int, kind: str) -> torch.Tensor:
            return output[p.messages[m].src]

        call = _p2p_call(p, i, buf)
        call.post = lambda: output[g].copy_(input.view(output[g].shape))
        return call
    return _p2p_call(p, i, lambda m, kind: input)


def _sb_scatter(p: Plan, g: int, i: int, input: Any, output: torch.Tensor) -> SmallCall:
    if g == p.root:
        if input is None or len(input) != p.group.n:
            raise PruningError(f"scatter: the root needs an input list of {p.group.n}")
        call = _p2p_call(p, i, lambda m, kind: input[p.messages[m].dst])
        call.post = lambda: output.copy_(input[g].view(output.shape))
        return call
    return _p2p_call(p, i, lambda m, kind: output)


def a2a_in_chunks(p: Plan, g: int, x: Any) -> list:
    if isinstance(x, torch.Tensor):
        return list(flat(x).split(list(p.splits[g])))
    return [flat(t) for t in x]


def _sb_all_to_all(p: Plan, g: int, i: int, output: Any, input: Any, bufs: _Buffers) -> SmallCall:
    G = p.group
    order = list(G.slots)
    identity = order == list(range(G.n))
    isp, osp = list(p.small_send[i]), list(p.small_recv[i])
    in_t = input if isinstance(input, torch.Tensor) else None
    out_t = output if isinstance(output, torch.Tensor) else None
    ib = contig_flat(in_t) if (identity and in_t is not None) else None
    if ib is None:
        ch = a2a_in_chunks(p, g, input)
        ib = bufs.new(sum(x.numel() for x in ch), ch[0].dtype)
        torch.cat([ch[d] for d in order], out=ib)
    ob = contig_flat(out_t) if (identity and out_t is not None) else None
    direct = ob is not None
    if not direct:
        ob = bufs.new(sum(osp), ib.dtype)

    def post() -> None:
        if direct:
            return
        parts = ob.split([p.splits[s][g] for s in order])
        src = dict(zip(order, parts))
        if out_t is not None:
            out_t.copy_(torch.cat([src[s] for s in range(G.n)]).view(out_t.shape))
        else:
            for s in range(G.n):
                output[s].copy_(src[s].view(output[s].shape))

    return SmallCall("all_to_all", i, input=ib, output=ob, in_splits=isp, out_splits=osp, post=post)


def _p2p_call(p: Plan, i: int, buf: Callable[[int, str], torch.Tensor]) -> SmallCall:
    ops = [(o.kind, o.peer, buf(o.message, o.kind), o.tag) for o in p.p2p[i]]
    return SmallCall("p2p", i, ops=ops)


def _proxy_payload(p: Plan, inputs: Any, device: Any = None) -> Callable[[int, str], torch.Tensor]:
    """Buffers of the proxy's p2p ops: what a virtual sender sends; scratch for receives."""
    received = {}

    def buf(m: int, kind: str) -> torch.Tensor:
        msg = p.messages[m]
        if kind == "recv":
            t = received[m] = torch.empty(msg.numel, dtype=p.dtype, device=device)
            return t
        try:
            if p.op == "gather":
                x = inputs[msg.src]
            elif p.op == "scatter":
                x = inputs[msg.src][msg.dst]
            else:
                x = inputs[m]
        except (IndexError, KeyError, TypeError):
            x = None
        if x is None:
            raise PruningError(f"{p.op}: the proxy has no data for message {m} ({msg.src} -> {msg.dst})")
        x = flat(x)
        if x.numel() != msg.numel:
            raise PruningError(f"{p.op}: message {m} has {msg.numel} elements, payload {x.numel()}")
        return x.to(device).contiguous()

    return buf
