"""Compensation for pruned collectives: what the sandbox and the proxy issue so that real
members of a partly virtual group get the logical group's result.

A collective on a logical group of ``n`` members, of which only ``k`` (1 <= k < n) are real
(run the program on a sandbox device), runs for real on a *small communicator*: the real
members, in logical group-rank order, as small ranks ``0 .. k-1``, plus one *proxy*
process (an assistant) as small rank ``k``. The proxy knows what every virtual member would
contribute (recorded tensors) and sends data so that every real member's output equals what
the full logical group would produce. Real members keep calling the same
``torch.distributed`` API; the sandbox backend rewrites the call it issues on the small
communicator (reduce op, layout, padding, local pre/post steps). NCCL and gloo are used as
they are: the compensation is in the data, not in the library (the paper patches NCCL's
ring and tree; we do not).

Three layers, each usable alone (docs/pruning.md has the long form and the byte tables):

1. ``plan_<op>(...)`` / :func:`plan` -- pure: from the logical group (``n``, the real
   members' logical group ranks), the op and its arguments, a :class:`Plan`: the op, reduce
   op, root, layout (slot size, padding, splits, point-to-point messages) on the small
   communicator, one-line descriptions of the sandbox's pre/post steps and of the proxy's
   contribution, the bytes each real member moves on the small communicator against a rank
   of the logical group's ring algorithm (:class:`LinkBytes`), and sandbox scratch memory.
2. :func:`sandbox_call` / :func:`proxy_call` -- pure tensor work, no communication: build
   the buffers of the small-communicator call (:class:`SmallCall`) from the program's
   tensors (sandbox) or from the virtual members' inputs indexed by logical group rank
   (proxy); ``SmallCall.finish()`` does the sandbox's post step (copy back, reorder,
   divide for AVG).
3. :func:`issue` / :func:`run` -- a reference executor on any ``ProcessGroup`` object
   (``pg.allreduce``, ``pg._reduce_scatter_base``, ...): what the tests use with gloo.

Byte accounting: ``LinkBytes.send/recv`` is what a real member moves on its link when the
small communicator runs the ring (or chain, or point-to-point) algorithm -- what the sandbox
*measures*; ``logical_send/logical_recv`` is what a rank at the same logical position moves
in the logical group's ring algorithm -- what the model says the target would see. With
``match_bytes=True`` (the default) all-reduce and reduce-scatter pad the small call so that
the two agree (to an element); see each plan for the rest.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

import torch

from prismllm.errors import PrismError

__all__ = [
    "CompensationError",
    "LinkBytes",
    "Message",
    "P2POp",
    "Plan",
    "Pruned",
    "REDUCE_OPS",
    "SmallCall",
    "describe",
    "issue",
    "plan",
    "plan_all_gather",
    "plan_all_reduce",
    "plan_all_to_all",
    "plan_once",
    "plan_barrier",
    "plan_broadcast",
    "plan_gather",
    "plan_p2p",
    "plan_recv",
    "plan_reduce",
    "plan_reduce_scatter",
    "plan_scatter",
    "plan_send",
    "proxy_call",
    "reference",
    "run",
    "sandbox_call",
]

REDUCE_OPS = ("sum", "avg", "max", "min", "product", "premul_sum", "band", "bor", "bxor")
# What the small communicator runs for a logical reduce op: AVG and PREMUL_SUM become SUM
# with a local step (gloo has neither; NCCL's AVG would divide by k+1, not n).
_SMALL_REDOP = {"avg": "sum", "premul_sum": "sum"}
_REDOP_ALIASES = {"prod": "product", "premulsum": "premul_sum", "mul": "product"}


class CompensationError(PrismError):
    """A collective cannot be planned as asked (bad membership, sizes, reduce op)."""


# ---------------------------------------------------------------------- membership
@dataclasses.dataclass(frozen=True)
class Pruned:
    """A logical group of ``n`` members with real members ``real`` (logical group ranks).

    Small communicator: small rank ``i`` is ``real[i]`` (logical order), the proxy is small
    rank ``k`` (last). Every virtual member is represented by the proxy."""

    n: int
    real: tuple

    def __post_init__(self) -> None:
        real = tuple(sorted(int(r) for r in self.real))
        object.__setattr__(self, "real", real)
        if self.n < 2:
            raise CompensationError(f"a pruned group needs n >= 2 members, got n={self.n}")
        if len(set(real)) != len(real) or not real or real[0] < 0 or real[-1] >= self.n:
            raise CompensationError(f"real members {list(real)} are not distinct ranks of a group of {self.n}")
        if len(real) == self.n:
            raise CompensationError("every member is real: run the collective on the real backend, not pruned")

    @property
    def k(self) -> int:
        return len(self.real)

    @property
    def proxy(self) -> int:
        """Small rank of the proxy."""
        return len(self.real)

    @property
    def size(self) -> int:
        """Size of the small communicator, k + 1."""
        return len(self.real) + 1

    @property
    def virtual(self) -> tuple:
        rs = set(self.real)
        return tuple(g for g in range(self.n) if g not in rs)

    def is_real(self, g: int) -> bool:
        return g in self.real

    def small(self, g: int) -> int:
        """Small rank standing for logical group rank ``g``: itself if real, else the proxy."""
        try:
            return self.real.index(g)
        except ValueError:
            if not 0 <= g < self.n:
                raise CompensationError(f"rank {g} is not in a group of {self.n}") from None
            return self.proxy


# ---------------------------------------------------------------------- plan records
@dataclasses.dataclass(frozen=True)
class LinkBytes:
    """Bytes one real member sends/receives. ``send``/``recv``: on the small communicator
    (measured); ``logical_send``/``logical_recv``: the same member in the logical group's
    ring (or chain, or point-to-point) algorithm (modelled)."""

    send: int
    recv: int
    logical_send: int
    logical_recv: int

    @property
    def ratio(self) -> float:
        """(send + recv) on the small communicator over the logical algorithm's; 1.0 if both 0."""
        lg = self.logical_send + self.logical_recv
        sm = self.send + self.recv
        return 1.0 if lg == 0 and sm == 0 else (math.inf if lg == 0 else sm / lg)


@dataclasses.dataclass(frozen=True)
class Message:
    """A logical point-to-point message: ``numel`` elements from ``src`` to ``dst``
    (logical group ranks), in the order the program posts them."""

    src: int
    dst: int
    numel: int
    tag: int = 0


@dataclasses.dataclass(frozen=True)
class P2POp:
    """One point-to-point op on the small communicator: ``kind`` "send"/"recv", ``peer`` a
    small rank, ``message`` the index in ``Plan.messages``."""

    kind: str
    peer: int
    message: int
    tag: int = 0


@dataclasses.dataclass(frozen=True)
class Plan:
    """How one logical collective runs on the small communicator. Sizes are in elements of
    ``dtype``; group ranks are logical unless named ``small_*``."""

    op: str  # logical op
    group: Pruned
    dtype: torch.dtype
    small_op: str  # what the small communicator runs ("p2p": a batch of sends/recvs)
    numel: int = 0  # logical per-member size: see each plan_<op>
    reduce_op: str = ""
    small_reduce_op: str = ""
    factor: Any = None  # premul_sum
    root: int = -1
    small_root: int = -1
    slot: int = 0  # elements per member buffer (all_reduce) or per slot (reduce_scatter, all_gather)
    pad: int = 0  # padding elements in each such buffer/slot
    splits: tuple = ()  # all_to_all: n x n elements, splits[src][dst]
    small_send: tuple = ()  # all_to_all: per small rank, elements it sends to each small rank
    small_recv: tuple = ()  # all_to_all: per small rank, elements it receives from each small rank
    messages: tuple = ()  # p2p / gather / scatter: logical Messages
    p2p: tuple = ()  # per small rank (proxy last): tuple of P2POp, in posting order
    sandbox: str = ""  # the sandbox side's local steps, one line
    proxy: str = ""  # the proxy's contribution, one line
    bytes: Mapping[int, LinkBytes] = dataclasses.field(default_factory=dict)  # per real member g
    scratch: Mapping[int, int] = dataclasses.field(default_factory=dict)  # sandbox temp bytes per real g

    @property
    def itemsize(self) -> int:
        return _itemsize(self.dtype)


def describe(p: Plan) -> str:
    """One line: logical op -> small op, and the two sides' steps."""
    red = f"({p.reduce_op})" if p.reduce_op else ""
    sred = f"({p.small_reduce_op})" if p.small_reduce_op else ""
    root = f" root {p.root}->{p.small_root}" if p.root >= 0 else ""
    return (f"{p.op}{red} n={p.group.n} real={list(p.group.real)}{root}: small {p.small_op}{sred} "
            f"on {p.group.size} ranks; sandbox: {p.sandbox}; proxy: {p.proxy}")


# ---------------------------------------------------------------------- helpers
def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def _redop(name: Any) -> str:
    if not isinstance(name, str):  # a ReduceOp / RedOpType
        key = getattr(name, "op", name)
        name = getattr(key, "name", None) or str(key).rsplit(".", 1)[-1]
    name = name.lower()
    name = _REDOP_ALIASES.get(name, name)
    if name not in REDUCE_OPS:
        raise CompensationError(f"unsupported reduce op {name!r} (supported: {', '.join(REDUCE_OPS)})")
    return name


def _numel(shape: Any) -> int:
    if isinstance(shape, int):
        return int(shape)
    return int(math.prod(shape))


def _group(n: int, real: Sequence[int]) -> Pruned:
    return real if isinstance(real, Pruned) else Pruned(int(n), tuple(real))


def _ring_bytes(m: int, total: float) -> int:
    """Per-rank bytes sent (= received) by a ring reduce-scatter or all-gather of ``m``
    ranks whose full buffer is ``total`` bytes: (m-1)/m of it."""
    return int(round((m - 1) * total / m))


def _chain(g: int, root: int, m: int) -> tuple:
    """(is first after the root, is last) in a chain root -> root+1 -> ... -> root-1."""
    pos = (g - root) % m
    return pos == 1, pos == m - 1


def _contig_flat(t: torch.Tensor) -> Optional[torch.Tensor]:
    return t.view(-1) if t.is_contiguous() else None


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1)


def _chunks(x: Union[torch.Tensor, Sequence[torch.Tensor]], n: int) -> list:
    """The n flat chunks of a tensor of n*c elements (the program's [n*rows, ...] buffer),
    or of a list of n tensors."""
    if isinstance(x, torch.Tensor):
        if x.numel() % n:
            raise CompensationError(f"a tensor of {x.numel()} elements does not split into {n} chunks")
        return list(_flat(x).view(n, -1).unbind(0)) if x.is_contiguous() else list(x.reshape(n, -1).unbind(0))
    if len(x) != n:
        raise CompensationError(f"expected {n} tensors, got {len(x)}")
    return [_flat(t) for t in x]


class _Reducer:
    """A running reduction with the logical op, one tensor at a time (the proxy may reduce
    thousands of virtual members' inputs: never all of them in memory at once). AVG gives the
    SUM (the divide is the sandbox's post step), PREMUL_SUM gives sum(factor * t); sums of
    half-precision tensors accumulate in float32 and are rounded once."""

    def __init__(self, op: str, factor: Any = None):
        self.op, self.factor = op, factor
        self.acc: Optional[torch.Tensor] = None
        self.dtype: Optional[torch.dtype] = None

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
            raise CompensationError(f"unsupported reduce op {op!r}")

    def result(self) -> torch.Tensor:
        if self.acc is None:
            raise CompensationError("nothing to reduce")
        return self.acc if self.acc.dtype == self.dtype else self.acc.to(self.dtype)


def _reduce(ts: Iterable[torch.Tensor], op: str, factor: Any = None) -> torch.Tensor:
    """Reduce flat tensors (any iterable, consumed one at a time) with the logical op."""
    r = _Reducer(op, factor)
    for t in ts:
        r.add(t)
    return r.result()


def _post_reduce(t: torch.Tensor, op: str, n: int) -> None:
    """The sandbox's post step after the small SUM: AVG divides by the logical n (NCCL's
    integer AVG truncates, as ``rounding_mode='trunc'``)."""
    if op == "avg":
        if t.is_floating_point() or t.is_complex():
            t.div_(n)
        else:
            t.div_(n, rounding_mode="trunc")


def _pre_reduce(t: torch.Tensor, op: str, factor: Any) -> None:
    """The sandbox's pre step: PREMUL_SUM multiplies the member's own input by the factor."""
    if op == "premul_sum":
        t.mul_(factor)


class _VirtualInputs:
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
            raise CompensationError(f"{self.p.op}: the proxy has no input for virtual member {v}")
        return x


def _virtual_inputs(p: Plan, inputs: Any) -> _VirtualInputs:
    return _VirtualInputs(p, inputs)


def _check_factor(op: str, factor: Any) -> None:
    if op == "premul_sum" and factor is None:
        raise CompensationError("premul_sum needs its factor")


# ---------------------------------------------------------------------- plans
def plan_all_reduce(n: int, real: Sequence[int], shape: Any, reduce_op: Any = "sum", *,
                    dtype: torch.dtype = torch.float32, factor: Any = None,
                    match_bytes: bool = True) -> Plan:
    """all_reduce of an S-byte tensor.

    Small call: all_reduce (SUM for avg/premul_sum, else the same op) of a buffer of
    ``slot`` elements. Proxy: the reduce of the virtual members' tensors (sum for avg,
    sum(factor*x) for premul_sum). Sandbox: premul_sum multiplies its own tensor first; avg
    divides by n after; with padding, the tensor is copied into a zero-padded scratch buffer
    and back.

    Bytes per real member, ring: small 2k/(k+1)*slot vs logical 2(n-1)/n*S. ``match_bytes``
    pads to slot = ceil(S(n-1)(k+1)/(nk)) so the two agree (k = n-1 needs no padding);
    without it the op runs in place and moves 2k/(k+1)*S (S for k=1: up to 2x less)."""
    g = _group(n, real)
    red = _redop(reduce_op)
    _check_factor(red, factor)
    S = _numel(shape)
    it = _itemsize(dtype)
    n_, k = g.n, g.k
    slot = S
    if match_bytes and S:
        slot = max(S, -(-S * (n_ - 1) * (k + 1) // (n_ * k)))
    pad = slot - S
    small_each = int(round(2 * k * slot * it / (k + 1)))
    logical_each = int(round(2 * (n_ - 1) * S * it / n_))
    lb = LinkBytes(small_each, small_each, logical_each, logical_each)
    pre = {"premul_sum": "x *= factor; ", "avg": ""}.get(red, "")
    post = "x /= n" if red == "avg" else ""
    where = f"copy into zero-padded scratch of {slot} (+{pad}), copy back" if pad else "in place"
    return Plan(
        op="all_reduce", group=g, dtype=dtype, small_op="all_reduce", numel=S, reduce_op=red,
        small_reduce_op=_SMALL_REDOP.get(red, red), factor=factor, slot=slot, pad=pad,
        sandbox=(pre + where + ("; " + post if post else "")),
        proxy=f"{_SMALL_REDOP.get(red, red)} of the virtual members' tensors"
        + (" (each x factor)" if red == "premul_sum" else "") + (f", zero-padded to {slot}" if pad else ""),
        bytes={r: lb for r in g.real}, scratch={r: (slot * it if pad else 0) for r in g.real},
    )


def plan_reduce_scatter(n: int, real: Sequence[int], chunk_shape: Any, reduce_op: Any = "sum", *,
                        dtype: torch.dtype = torch.float32, factor: Any = None,
                        match_bytes: bool = True) -> Plan:
    """reduce_scatter: logical member r gets reduce_j input_j[chunk r] (c elements a chunk).

    Small call: reduce_scatter over k+1 slots of ``slot`` elements. Sandbox: scratch input
    whose slot j holds its own chunk real[j] (then zero padding), slot k (the proxy's) zeros;
    output slot -> its chunk. Proxy: slot j = reduce over virtual members of their chunk
    real[j]. The naive layout (slot j = chunk j) would give small rank j the chunk j, not
    real[j]. avg: SUM then /n; premul_sum: x factor before.

    Bytes per real member, ring: small k*slot vs logical (n-1)*c. ``match_bytes`` (default)
    pads each slot to ceil((n-1)c/k) so the small ring carries the logical ring's bytes (and
    does the same amount of reduction work) in k steps instead of n-1; compact slots (c)
    move k*c ((n-1) times less for k=1). Scratch: (k+1)*slot input + slot output."""
    g = _group(n, real)
    red = _redop(reduce_op)
    _check_factor(red, factor)
    c = _numel(chunk_shape)
    it = _itemsize(dtype)
    n_, k = g.n, g.k
    slot = c
    if match_bytes and c:
        slot = max(c, -(-(n_ - 1) * c // k))
    pad = slot - c
    lb = LinkBytes(k * slot * it, k * slot * it, (n_ - 1) * c * it, (n_ - 1) * c * it)
    return Plan(
        op="reduce_scatter", group=g, dtype=dtype, small_op="reduce_scatter", numel=c, reduce_op=red,
        small_reduce_op=_SMALL_REDOP.get(red, red), factor=factor, slot=slot, pad=pad,
        sandbox=(f"scratch [{k + 1} x {slot}]: slot j <- own chunk real[j]"
                 + (" (x factor)" if red == "premul_sum" else "") + f", slot {k} zeros; "
                 + "output <- small output[:c]" + ("; /= n" if red == "avg" else "")),
        proxy=f"slot j <- {_SMALL_REDOP.get(red, red)} over virtual members of chunk real[j]"
        + (" (x factor)" if red == "premul_sum" else "") + "; own slot zeros",
        bytes={r: lb for r in g.real},
        scratch={r: ((k + 1) * slot + (slot if pad else 0)) * it for r in g.real},
    )


def plan_all_gather(n: int, real: Sequence[int], shape: Any, *,
                    dtype: torch.dtype = torch.float32, match_bytes: bool = True) -> Plan:
    """all_gather of c elements a member: output = all n inputs in logical rank order.

    Small call: all_gather of k+1 slots of (n-k)*c elements. Proxy: its slot = the virtual
    members' inputs concatenated in logical order. Sandbox: own input in a zero-padded slot;
    post: output[real[j]] <- small slot j[:c], output[virtual[i]] <- proxy slot[i*c:(i+1)*c]
    (logical order, not small-rank order).

    Bytes per real member, ring: small k(n-k)c vs logical (n-1)c: equal for k=1 and k=n-1,
    up to ~n/4 x more in between (all_gather needs equal slots on gloo and NCCL, and the
    proxy's slot must hold n-k inputs). ``match_bytes`` changes nothing: this slot is always
    at least the byte-matching one. Scratch: (k+1)*slot output (+ slot input when k < n-1)."""
    g = _group(n, real)
    c = _numel(shape)
    it = _itemsize(dtype)
    n_, k = g.n, g.k
    slot = (n_ - k) * c
    pad = slot - c
    lb = LinkBytes(k * slot * it, k * slot * it, (n_ - 1) * c * it, (n_ - 1) * c * it)
    return Plan(
        op="all_gather", group=g, dtype=dtype, small_op="all_gather", numel=c, slot=slot, pad=pad,
        sandbox=(f"input -> slot of {slot} (+{pad} zeros); " if pad else "input as is; ")
        + "output[real[j]] <- small slot j, output[virtual[i]] <- proxy slot part i",
        proxy=f"slot <- virtual members' inputs concatenated in logical order ({n_ - k} x {c})",
        bytes={r: lb for r in g.real},
        scratch={r: ((k + 1) * slot + (slot if pad else 0)) * it for r in g.real},
    )


def plan_broadcast(n: int, real: Sequence[int], shape: Any, root: int, *,
                   dtype: torch.dtype = torch.float32) -> Plan:
    """broadcast from logical ``root`` (real or virtual).

    Small call: broadcast from small(root): the root itself if real, else the proxy, which
    sends the virtual root's tensor; a real root's data reaches the proxy (discarded).
    Sandbox: nothing (in place).

    Bytes per real member, chain/ring pipeline from the root: receive S unless the root,
    send S unless last in the chain -- on k+1 ranks (measured) vs n (modelled); only the
    'last in chain' position can differ (ring order assumed = rank order)."""
    g = _group(n, real)
    S = _numel(shape)
    it = _itemsize(dtype)
    root = int(root)
    sroot = g.small(root)
    B = S * it
    bytes_ = {}
    for r in g.real:
        _, last_l = _chain(r, root, g.n)
        _, last_s = _chain(g.small(r), sroot, g.size)
        bytes_[r] = LinkBytes(0 if last_s else B, 0 if r == root else B,
                              0 if last_l else B, 0 if r == root else B)
    return Plan(
        op="broadcast", group=g, dtype=dtype, small_op="broadcast", numel=S, root=root, small_root=sroot,
        sandbox="in place",
        proxy=("sends the virtual root's tensor" if not g.is_real(root) else "receives the root's tensor (discarded)"),
        bytes=bytes_, scratch={r: 0 for r in g.real},
    )


def plan_reduce(n: int, real: Sequence[int], shape: Any, root: int, reduce_op: Any = "sum", *,
                dtype: torch.dtype = torch.float32, factor: Any = None) -> Plan:
    """reduce to logical ``root`` (real or virtual).

    Small call: reduce (SUM for avg/premul_sum) to small(root). Proxy: the reduce of the
    virtual members' tensors (root virtual: the proxy then holds the logical result, which
    no real member observes). Sandbox: premul_sum multiplies a copy (non-root) or the root's
    own tensor; avg divides at the root. Non-root buffers: whatever the backend leaves (NCCL
    keeps them, gloo leaves partial sums), in the logical run too.

    Bytes per real member, chain toward the root: send S unless the root, receive S unless
    first after the root -- small (k+1 ranks) vs logical (n)."""
    g = _group(n, real)
    red = _redop(reduce_op)
    _check_factor(red, factor)
    S = _numel(shape)
    it = _itemsize(dtype)
    root = int(root)
    sroot = g.small(root)
    B = S * it
    bytes_ = {}
    for r in g.real:
        first_l, _ = _chain(r, root, g.n)
        first_s, _ = _chain(g.small(r), sroot, g.size)
        bytes_[r] = LinkBytes(0 if r == root else B, 0 if first_s else B,
                              0 if r == root else B, 0 if first_l else B)
    return Plan(
        op="reduce", group=g, dtype=dtype, small_op="reduce", numel=S, reduce_op=red,
        small_reduce_op=_SMALL_REDOP.get(red, red), factor=factor, root=root, small_root=sroot,
        sandbox=("x factor (a copy on non-roots); " if red == "premul_sum" else "")
        + ("/= n at the root" if red == "avg" else "in place"),
        proxy=f"{_SMALL_REDOP.get(red, red)} of the virtual members' tensors",
        bytes=bytes_, scratch={r: (S * it if red == "premul_sum" and r != root else 0) for r in g.real},
    )


def plan_p2p(n: int, real: Sequence[int], messages: Sequence[Any], *,
             dtype: torch.dtype = torch.float32, op: str = "p2p") -> Plan:
    """Point-to-point messages (send/recv, batch_isend_irecv) within a logical group.

    ``messages``: logical :class:`Message` (or (src, dst, numel[, tag]) tuples) in the order
    the program posts them. A message between two real members goes direct; a virtual
    endpoint is replaced by the proxy: it sends what the virtual peer would send (its
    recorded tensor) and receives (and discards) what a real member sends to a virtual one.
    Messages between two virtual members are not instantiated. Several virtual peers share
    the proxy's link: the proxy posts its ops in the plan's order, which must be the real
    members' posting order (NCCL ignores tags; gloo matches by (peer, tag) in order).

    Bytes per real member: exactly the logical ones (same messages, same sizes)."""
    g = _group(n, real)
    it = _itemsize(dtype)
    msgs = tuple(m if isinstance(m, Message) else Message(*m) for m in messages)
    per = [[] for _ in range(g.size)]
    snd = {r: 0 for r in g.real}
    rcv = {r: 0 for r in g.real}
    for i, m in enumerate(msgs):
        for x in (m.src, m.dst):
            if not 0 <= x < g.n:
                raise CompensationError(f"message {i}: rank {x} is not in a group of {g.n}")
        if m.src == m.dst:
            raise CompensationError(f"message {i}: send to self")
        if not (g.is_real(m.src) or g.is_real(m.dst)):
            continue  # virtual -> virtual: never instantiated
        s, d = g.small(m.src), g.small(m.dst)
        per[s].append(P2POp("send", d, i, m.tag))
        per[d].append(P2POp("recv", s, i, m.tag))
        if g.is_real(m.src):
            snd[m.src] += m.numel * it
        if g.is_real(m.dst):
            rcv[m.dst] += m.numel * it
    return Plan(
        op=op, group=g, dtype=dtype, small_op="p2p", messages=msgs, p2p=tuple(tuple(x) for x in per),
        sandbox="send/recv to small(peer): the proxy for a virtual peer",
        proxy="sends the virtual senders' recorded tensors, receives (discards) what goes to virtual members",
        bytes={r: LinkBytes(snd[r], rcv[r], snd[r], rcv[r]) for r in g.real},
        scratch={r: 0 for r in g.real},
    )


def plan_send(n: int, real: Sequence[int], src: int, dst: int, shape: Any, *, tag: int = 0,
              dtype: torch.dtype = torch.float32) -> Plan:
    """One send from ``src`` to ``dst`` (one of them real): :func:`plan_p2p` of one message."""
    return plan_p2p(n, real, [Message(int(src), int(dst), _numel(shape), tag)], dtype=dtype, op="send")


plan_recv = plan_send  # a recv is the same message seen from the other end


def plan_gather(n: int, real: Sequence[int], shape: Any, root: int, *,
                dtype: torch.dtype = torch.float32) -> Plan:
    """gather of c elements a member to logical ``root``.

    Small call: a batch of sends/recvs (as NCCL implements gather): every member except the
    root sends its input to small(root); messages from virtual members come from the proxy,
    one per virtual member in logical order, straight into the root's output list (no
    scratch). Root virtual: real members send to the proxy (discarded).

    Bytes per real member: exact -- root receives (n-1)c, others send c. (A small gather
    would need equal slots of (n-k)c: k(n-k)c into the root.)"""
    g = _group(n, real)
    root = int(root)
    c = _numel(shape)
    msgs = [Message(s, root, c) for s in range(g.n) if s != root]
    p = plan_p2p(g.n, g, msgs, dtype=dtype, op="gather")
    return dataclasses.replace(
        p, numel=c, root=root, small_root=g.small(root),
        sandbox="root: recv each member's input into output[src]; copy own; others: send input",
        proxy=("sends each virtual member's input to the root (logical order)" if g.is_real(root)
               else "receives the real members' inputs (discarded)"))


def plan_scatter(n: int, real: Sequence[int], shape: Any, root: int, *,
                 dtype: torch.dtype = torch.float32) -> Plan:
    """scatter of c elements a member from logical ``root``.

    Small call: a batch of sends/recvs: the root sends chunk d to every d != root; chunks of
    virtual members go to the proxy (discarded), one message each; root virtual: the proxy
    sends each real member its chunk of the virtual root's list.

    Bytes per real member: exact -- root sends (n-1)c, others receive c."""
    g = _group(n, real)
    root = int(root)
    c = _numel(shape)
    msgs = [Message(root, d, c) for d in range(g.n) if d != root]
    p = plan_p2p(g.n, g, msgs, dtype=dtype, op="scatter")
    return dataclasses.replace(
        p, numel=c, root=root, small_root=g.small(root),
        sandbox="root: send input[d] to small(d), copy own chunk; others: recv into output",
        proxy=("sends each real member its chunk of the virtual root's list" if not g.is_real(root)
               else "receives the virtual members' chunks (discarded)"))


def plan_all_to_all(n: int, real: Sequence[int], splits: Optional[Sequence[Sequence[int]]] = None, *,
                    numel: Optional[int] = None, row_numel: int = 1,
                    dtype: torch.dtype = torch.float32) -> Plan:
    """all_to_all (single-tensor or list form, uneven splits).

    ``splits[src][dst]``: rows member src sends to dst (the recorded in_splits of every
    member; out_splits of dst are column dst), ``row_numel`` elements a row; or ``splits``
    None and ``numel`` per member input split evenly.

    Small call: all_to_all_single on flat buffers. Real member g: sends its chunk for each
    real member to it, and its chunks for all virtual members, concatenated in logical
    order, to the proxy; receives each real member's chunk for it, and from the proxy the
    virtual members' chunks for it concatenated in logical source order. Pre/post: permute
    chunks between logical order and [real..., virtual...] order (a no-op, no scratch, when
    the real members are the first k). Proxy: receives (discards) the real->virtual chunks.

    Bytes per real member: exact -- it sends sum_{d != g} splits[g][d] and receives
    sum_{s != g} splits[s][g] rows, as in the logical exchange (k peers instead of n-1)."""
    g = _group(n, real)
    n_, k = g.n, g.k
    if splits is None:
        if numel is None or numel % n_:
            raise CompensationError(f"all_to_all without splits needs numel divisible by n={n_}")
        el = [[numel // n_] * n_ for _ in range(n_)]
    else:
        if len(splits) != n_ or any(len(r) != n_ for r in splits):
            raise CompensationError(f"all_to_all splits must be {n_} x {n_}")
        el = [[int(x) * row_numel for x in row] for row in splits]
    vs = g.virtual
    send, recv = [], []
    for i, r in enumerate(g.real):
        send.append(tuple([el[r][d] for d in g.real] + [sum(el[r][v] for v in vs)]))
        recv.append(tuple([el[s][r] for s in g.real] + [sum(el[v][r] for v in vs)]))
    send.append(tuple([sum(el[v][d] for v in vs) for d in g.real] + [0]))
    recv.append(tuple([sum(el[s][v] for v in vs) for s in g.real] + [0]))
    it = _itemsize(dtype)
    identity = g.real == tuple(range(k))
    bytes_, scratch = {}, {}
    for i, r in enumerate(g.real):
        ls = sum(el[r][d] for d in range(n_) if d != r) * it
        lr = sum(el[s][r] for s in range(n_) if s != r) * it
        ss = (sum(send[i]) - send[i][i]) * it
        sr = (sum(recv[i]) - recv[i][i]) * it
        bytes_[r] = LinkBytes(ss, sr, ls, lr)
        scratch[r] = 0 if identity else (sum(send[i]) + sum(recv[i])) * it
    return Plan(
        op="all_to_all", group=g, dtype=dtype, small_op="all_to_all", splits=tuple(tuple(r) for r in el),
        small_send=tuple(send), small_recv=tuple(recv),
        sandbox=("as is (real members are the first k)" if identity
                 else "permute input chunks to [real..., virtual...]; permute output back to logical source order"),
        proxy="sends virtual->real chunks (per real member, logical source order); receives real->virtual (discarded)",
        bytes=bytes_, scratch=scratch,
    )


def splits_matrix(n: int, rows: Optional[dict] = None, cols: Optional[dict] = None) -> list:
    """The ``splits[src][dst]`` of :func:`plan_all_to_all` from what one side knows: ``rows``
    (member -> its in_splits: what it sends to each member) and ``cols`` (member -> its
    out_splits: what it receives from each). A sandbox member knows its own row and column,
    the proxy the virtual members'; that is all each side's small call reads. Entries no side
    gave are 0. A row and a column that disagree on an entry mean the members' calls do not
    match (a program that deviates from its graph)."""
    m = [[0] * n for _ in range(n)]
    given = [[False] * n for _ in range(n)]
    for src, sp in (rows or {}).items():
        if len(sp) != n:
            raise CompensationError(f"all_to_all: member {src} has {len(sp)} input splits for a group of {n}")
        for d, x in enumerate(sp):
            m[src][d], given[src][d] = int(x), True
    for dst, sp in (cols or {}).items():
        if len(sp) != n:
            raise CompensationError(f"all_to_all: member {dst} has {len(sp)} output splits for a group of {n}")
        for s_, x in enumerate(sp):
            if given[s_][dst] and m[s_][dst] != int(x):
                raise CompensationError(
                    f"all_to_all: member {s_} sends {m[s_][dst]} rows to member {dst}, which expects "
                    f"{int(x)} (the members' split sizes disagree)")
            m[s_][dst], given[s_][dst] = int(x), True
    return m


def plan_barrier(n: int, real: Sequence[int]) -> Plan:
    """barrier: a barrier on the small communicator; the proxy enters once every virtual
    member has arrived (the replay decides when). Bytes: none modelled."""
    g = _group(n, real)
    zero = LinkBytes(0, 0, 0, 0)
    return Plan(op="barrier", group=g, dtype=torch.uint8, small_op="barrier", sandbox="none",
                proxy="enters when every virtual member has arrived",
                bytes={r: zero for r in g.real}, scratch={r: 0 for r in g.real})


_PLANS = {
    "all_reduce": plan_all_reduce,
    "reduce_scatter": plan_reduce_scatter,
    "all_gather": plan_all_gather,
    "broadcast": plan_broadcast,
    "reduce": plan_reduce,
    "gather": plan_gather,
    "scatter": plan_scatter,
    "all_to_all": plan_all_to_all,
    "send": plan_send,
    "recv": plan_recv,
    "p2p": plan_p2p,
    "barrier": plan_barrier,
}


def plan(op: str, n: int, real: Sequence[int], *args: Any, **kwargs: Any) -> Plan:
    """Dispatch on the logical op name (prismtrace names: all_reduce, reduce_scatter,
    all_gather, broadcast, reduce, gather, scatter, all_to_all, send, recv, barrier; "p2p"
    for a batch of messages)."""
    try:
        fn = _PLANS[op]
    except KeyError:
        raise CompensationError(f"no compensation plan for op {op!r}") from None
    return fn(n, real, *args, **kwargs)


@functools.lru_cache(maxsize=4096)
def _plan_once(fn: Callable[..., Plan], args: tuple, kwargs: tuple) -> Plan:
    return fn(*args, **dict(kwargs))


def plan_once(fn: Callable[..., Plan], *args: Any, **kwargs: Any) -> Plan:
    """``fn(*args, **kwargs)`` (a ``plan_<op>``) computed once per distinct arguments: plans
    are pure and frozen, and a training loop issues the same few calls every iteration, each
    planned on the sandbox's critical path (planning every call took ~100 us of a 2-vCPU
    VM's time, on a call of a few hundred). Unhashable arguments (split lists) plan afresh."""
    kw = tuple(sorted(kwargs.items()))
    try:
        hash((args, kw))
    except TypeError:
        return fn(*args, **kwargs)
    return _plan_once(fn, args, kw)


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
    input: Optional[torch.Tensor] = None
    output: Optional[torch.Tensor] = None
    in_splits: Optional[list] = None
    out_splits: Optional[list] = None
    ops: list = dataclasses.field(default_factory=list)  # p2p: (kind, peer, tensor, tag)
    post: Optional[Callable[[], None]] = None
    result: Any = None  # proxy: what it received, when useful (reduce to a virtual root)
    release: Optional[Callable[[], None]] = None  # sandbox: gives its scratch back, after ``post``

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

    def __init__(self, scratch: Optional[Callable[[torch.device], Any]], device: torch.device):
        self.scratch = scratch(device) if scratch is not None else None  # None: PyTorch's allocator
        self.device = device
        self.taken: list[torch.Tensor] = []

    def new(self, numel: int, dtype: torch.dtype, zero: bool = False) -> torch.Tensor:
        if self.scratch is None:
            return (torch.zeros if zero else torch.empty)(numel, dtype=dtype, device=self.device)
        t = self.scratch.take(numel, dtype, zero)
        self.taken.append(t)
        return t

    def bind(self, call: SmallCall) -> SmallCall:
        if self.taken:
            taken, scratch = self.taken, self.scratch
            call.release = lambda: scratch.give_back(taken)
        return call


def sandbox_call(p: Plan, g: int, *, tensor: Optional[torch.Tensor] = None, input: Any = None,
                 output: Any = None, tensors: Optional[Mapping[int, torch.Tensor]] = None,
                 scratch: Optional[Callable[[torch.device], Any]] = None) -> SmallCall:
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
    """
    G = p.group
    if not G.is_real(g):
        raise CompensationError(f"{p.op}: member {g} is virtual; the proxy plays it")
    i = G.small(g)
    op = p.op
    if op in ("all_reduce", "reduce_scatter", "all_gather", "reduce", "all_to_all"):
        first = next((t for t in (tensor, input, output) if t is not None), None)
        ref = first if isinstance(first, torch.Tensor) else (first[0] if first else None)
        bufs = _Buffers(scratch, ref.device if isinstance(ref, torch.Tensor) else torch.device("cpu"))
        if op == "all_reduce":
            return bufs.bind(_sb_all_reduce(p, i, tensor, bufs))
        if op == "reduce_scatter":
            return bufs.bind(_sb_reduce_scatter(p, i, output, input, bufs))
        if op == "all_gather":
            return bufs.bind(_sb_all_gather(p, i, output, input, bufs))
        if op == "reduce":
            return bufs.bind(_sb_reduce(p, g, i, tensor, bufs))
        return bufs.bind(_sb_all_to_all(p, g, i, output, input, bufs))
    if op == "broadcast":
        return SmallCall("broadcast", i, root=p.small_root, input=tensor, output=tensor)
    if op == "gather":
        return _sb_gather(p, g, i, input, output)
    if op == "scatter":
        return _sb_scatter(p, g, i, input, output)
    if op in ("send", "recv", "p2p"):
        if tensors is None:
            if tensor is None or len(p.messages) != 1:
                raise CompensationError(f"{op}: pass tensors={{message index: tensor}}")
            tensors = {0: tensor}
        return _p2p_call(p, i, lambda m, kind: tensors[m])
    if op == "barrier":
        return SmallCall("barrier", i)
    raise CompensationError(f"no sandbox call for op {op!r}")


def proxy_call(p: Plan, inputs: Any = None, device: Any = None) -> SmallCall:
    """The proxy's small-communicator call. ``inputs``: what each virtual member would
    contribute, indexed by logical group rank (a list of n with None for real members, or a
    dict): its tensor (all_reduce, reduce, broadcast root), its input (reduce_scatter,
    all_gather, gather, all_to_all), the root's list of n chunks (scatter). For p2p: message
    index -> tensor of each message a virtual member sends. ``device``: where the small call's
    buffers live (the proxy's GPU for an NCCL small group; inputs may be on the host)."""
    G = p.group
    i = G.proxy
    op = p.op
    dt = p.dtype
    if op == "all_reduce":
        vin = _virtual_inputs(p, inputs)
        buf = torch.zeros(p.slot, dtype=dt, device=device)
        buf[: p.numel] = _reduce((_flat(vin[v]) for v in G.virtual), p.reduce_op, p.factor)
        return SmallCall("all_reduce", i, reduce_op=p.small_reduce_op, input=buf, output=buf)
    if op == "reduce_scatter":
        vin = _virtual_inputs(p, inputs)
        acc = [_Reducer(p.reduce_op, p.factor) for _ in G.real]
        for v in G.virtual:  # one virtual member's input in memory at a time
            ch = _chunks(vin[v], G.n)
            for j, r in enumerate(G.real):
                acc[j].add(ch[r])
        buf = torch.zeros(G.size, p.slot, dtype=dt, device=device)
        for j in range(len(G.real)):
            buf[j, : p.numel] = acc[j].result()
        return SmallCall("reduce_scatter", i, reduce_op=p.small_reduce_op, input=buf.view(-1),
                         output=torch.empty(p.slot, dtype=dt, device=device))
    if op == "all_gather":
        vin = _virtual_inputs(p, inputs)
        buf = (torch.cat([_flat(vin[v]) for v in G.virtual]).to(device) if p.numel
               else torch.empty(0, dtype=dt, device=device))
        return SmallCall("all_gather", i, input=buf, output=torch.empty(G.size * p.slot, dtype=dt, device=device))
    if op == "broadcast":
        if G.is_real(p.root):
            buf = torch.empty(p.numel, dtype=dt, device=device)
        else:
            buf = _flat(_virtual_inputs(p, inputs)[p.root]).to(device, copy=True)
        return SmallCall("broadcast", i, root=p.small_root, input=buf, output=buf, result=buf)
    if op == "reduce":
        vin = _virtual_inputs(p, inputs)
        buf = _reduce((_flat(vin[v]) for v in G.virtual), p.reduce_op, p.factor).to(device)
        post = None
        if not G.is_real(p.root) and p.reduce_op == "avg":
            post = lambda: _post_reduce(buf, "avg", G.n)  # noqa: E731 - the proxy's copy of the result
        return SmallCall("reduce", i, reduce_op=p.small_reduce_op, root=p.small_root, input=buf, output=buf,
                         post=post, result=buf)
    if op == "all_to_all":
        vin = _virtual_inputs(p, inputs)
        pieces = []
        ch = {v: _a2a_in_chunks(p, v, vin[v]) for v in G.virtual}
        for r in G.real:
            pieces.extend(ch[v][r] for v in G.virtual)
        buf = torch.cat(pieces).to(device) if pieces else torch.empty(0, dtype=dt, device=device)
        out = torch.empty(sum(p.small_recv[i]), dtype=dt, device=device)
        return SmallCall("all_to_all", i, input=buf, output=out,
                         in_splits=list(p.small_send[i]), out_splits=list(p.small_recv[i]), result=out)
    if op in ("gather", "scatter", "send", "recv", "p2p"):
        return _p2p_call(p, i, _proxy_payload(p, inputs, device))
    if op == "barrier":
        return SmallCall("barrier", i)
    raise CompensationError(f"no proxy call for op {op!r}")


# ---- sandbox helpers
def _sb_all_reduce(p: Plan, i: int, t: torch.Tensor, bufs: _Buffers) -> SmallCall:
    S = p.numel
    if t.numel() != S:
        raise CompensationError(f"all_reduce: tensor of {t.numel()} elements, plan says {S}")
    flat = _contig_flat(t)
    if p.pad == 0 and flat is not None:
        buf = flat
        _pre_reduce(buf, p.reduce_op, p.factor)

        def post() -> None:
            _post_reduce(t, p.reduce_op, p.group.n)
    else:
        buf = bufs.new(p.slot, t.dtype, zero=True)
        buf[:S].copy_(_flat(t))
        _pre_reduce(buf[:S], p.reduce_op, p.factor)

        def post() -> None:
            t.copy_(buf[:S].view(t.shape))
            _post_reduce(t, p.reduce_op, p.group.n)
    return SmallCall("all_reduce", i, reduce_op=p.small_reduce_op, input=buf, output=buf, post=post)


def _sb_reduce_scatter(p: Plan, i: int, output: Any, input: Any, bufs: _Buffers) -> SmallCall:
    G, c = p.group, p.numel
    ch = _chunks(input, G.n)
    if ch[0].numel() != c:
        raise CompensationError(f"reduce_scatter: input chunks of {ch[0].numel()} elements, plan says {c}")
    ref = ch[0]
    buf = bufs.new(G.size * p.slot, ref.dtype, zero=True).view(G.size, p.slot)
    for j, r in enumerate(G.real):
        buf[j, :c].copy_(ch[r])
    _pre_reduce(buf, p.reduce_op, p.factor)
    out_t = output if isinstance(output, torch.Tensor) else output[0]
    direct = _contig_flat(out_t) if p.pad == 0 else None
    obuf = direct if direct is not None else bufs.new(p.slot, ref.dtype)

    def post() -> None:
        if direct is None:
            out_t.copy_(obuf[:c].view(out_t.shape))
        _post_reduce(out_t, p.reduce_op, G.n)
    return SmallCall("reduce_scatter", i, reduce_op=p.small_reduce_op, input=buf.view(-1), output=obuf, post=post)


def _sb_all_gather(p: Plan, i: int, output: Any, input: torch.Tensor, bufs: _Buffers) -> SmallCall:
    G, c, slot = p.group, p.numel, p.slot
    if input.numel() != c:
        raise CompensationError(f"all_gather: input of {input.numel()} elements, plan says {c}")
    if p.pad:
        ibuf = bufs.new(slot, input.dtype, zero=True)
        ibuf[:c].copy_(_flat(input))
    else:
        ibuf = _contig_flat(input)
        if ibuf is None:
            ibuf = bufs.new(c, input.dtype)
            ibuf.copy_(_flat(input))
    obuf = bufs.new(G.size * slot, input.dtype)
    outs = _chunks(output, G.n) if isinstance(output, torch.Tensor) and _contig_flat(output) is not None else None

    def post() -> None:
        dst = outs if outs is not None else [None] * G.n
        src = {}
        for j, r in enumerate(G.real):
            src[r] = obuf[j * slot: j * slot + c]
        base = G.k * slot
        for x, v in enumerate(G.virtual):
            src[v] = obuf[base + x * c: base + (x + 1) * c]
        if outs is not None:
            for r in range(G.n):
                dst[r].copy_(src[r])
        elif isinstance(output, torch.Tensor):  # non-contiguous output tensor
            output.copy_(torch.cat([src[r] for r in range(G.n)]).view(output.shape))
        else:
            for r in range(G.n):
                output[r].copy_(src[r].view(output[r].shape))
    return SmallCall("all_gather", i, input=ibuf, output=obuf, post=post)


def _sb_reduce(p: Plan, g: int, i: int, t: torch.Tensor, bufs: _Buffers) -> SmallCall:
    is_root = g == p.root
    buf = t
    if p.reduce_op == "premul_sum" and not is_root:
        buf = bufs.new(t.numel(), t.dtype).view(t.shape)  # the program's non-root tensor stays as it was
        buf.copy_(t)
    if buf is t and not t.is_contiguous():
        raise CompensationError("reduce: non-contiguous tensor")
    _pre_reduce(buf, p.reduce_op, p.factor)
    post = (lambda: _post_reduce(t, p.reduce_op, p.group.n)) if is_root else None
    return SmallCall("reduce", i, reduce_op=p.small_reduce_op, root=p.small_root, input=buf, output=buf, post=post)


def _sb_gather(p: Plan, g: int, i: int, input: torch.Tensor, output: Any) -> SmallCall:
    if g == p.root:
        if output is None or len(output) != p.group.n:
            raise CompensationError(f"gather: the root needs an output list of {p.group.n}")

        def buf(m: int, kind: str) -> torch.Tensor:
            return output[p.messages[m].src]
        call = _p2p_call(p, i, buf)
        call.post = lambda: output[g].copy_(input.view(output[g].shape))
        return call
    return _p2p_call(p, i, lambda m, kind: input)


def _sb_scatter(p: Plan, g: int, i: int, input: Any, output: torch.Tensor) -> SmallCall:
    if g == p.root:
        if input is None or len(input) != p.group.n:
            raise CompensationError(f"scatter: the root needs an input list of {p.group.n}")
        call = _p2p_call(p, i, lambda m, kind: input[p.messages[m].dst])
        call.post = lambda: output.copy_(input[g].view(output.shape))
        return call
    return _p2p_call(p, i, lambda m, kind: output)


def _a2a_in_chunks(p: Plan, g: int, x: Any) -> list:
    if isinstance(x, torch.Tensor):
        return list(_flat(x).split(list(p.splits[g])))
    return [_flat(t) for t in x]


def _sb_all_to_all(p: Plan, g: int, i: int, output: Any, input: Any, bufs: _Buffers) -> SmallCall:
    G = p.group
    identity = G.real == tuple(range(G.k))
    order = list(G.real) + list(G.virtual)
    isp, osp = list(p.small_send[i]), list(p.small_recv[i])
    in_t = input if isinstance(input, torch.Tensor) else None
    out_t = output if isinstance(output, torch.Tensor) else None
    ib = _contig_flat(in_t) if (identity and in_t is not None) else None
    if ib is None:
        ch = _a2a_in_chunks(p, g, input)
        ib = bufs.new(sum(x.numel() for x in ch), ch[0].dtype)
        torch.cat([ch[d] for d in order], out=ib)
    ob = _contig_flat(out_t) if (identity and out_t is not None) else None
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
            raise CompensationError(f"{p.op}: the proxy has no data for message {m} ({msg.src} -> {msg.dst})")
        x = _flat(x)
        if x.numel() != msg.numel:
            raise CompensationError(f"{p.op}: message {m} has {msg.numel} elements, payload {x.numel()}")
        return x.to(device).contiguous()
    return buf


# ---------------------------------------------------------------------- reference executor
_TORCH_REDOP = {
    "sum": "SUM", "avg": "AVG", "max": "MAX", "min": "MIN", "product": "PRODUCT",
    "band": "BAND", "bor": "BOR", "bxor": "BXOR",
}


def _torch_redop(name: str) -> Any:
    import torch.distributed as dist

    return getattr(dist.ReduceOp, _TORCH_REDOP[name])


def issue(pg: Any, call: SmallCall) -> list:
    """Issue ``call`` on a ``ProcessGroup`` object (the small communicator) through its own
    methods; returns the Work objects (wait on all, then ``call.finish()``)."""
    import torch.distributed as dist

    op = call.op
    if op == "all_reduce":
        o = dist.AllreduceOptions()
        o.reduceOp = _torch_redop(call.reduce_op)
        return [pg.allreduce([call.input], o)]
    if op == "reduce_scatter":
        o = dist.ReduceScatterOptions()
        o.reduceOp = _torch_redop(call.reduce_op)
        return [pg._reduce_scatter_base(call.output, call.input, o)]
    if op == "all_gather":
        return [pg._allgather_base(call.output, call.input)]
    if op == "broadcast":
        o = dist.BroadcastOptions()
        o.rootRank, o.rootTensor = call.root, 0
        return [pg.broadcast([call.input], o)]
    if op == "reduce":
        o = dist.ReduceOptions()
        o.rootRank, o.rootTensor = call.root, 0
        o.reduceOp = _torch_redop(call.reduce_op)
        return [pg.reduce([call.input], o)]
    if op == "all_to_all":
        return [pg.alltoall_base(call.output, call.input, call.out_splits, call.in_splits, dist.AllToAllOptions())]
    if op == "p2p":
        return issue_batch(pg, [call])
    if op == "barrier":
        return [pg.barrier(dist.BarrierOptions())]
    raise CompensationError(f"cannot issue {op!r}")


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
    nccl = _nccl(pg)
    if nccl:
        dev = p2p[0][2].device
        _coalescing(pg, "_start_coalescing", dev)
    try:
        for kind, peer, t, tag in p2p:
            w = pg.send([t], peer, tag) if kind == "send" else pg.recv([t], peer, tag)
            if w is not None:
                works.append(w)
    finally:
        if nccl:
            w = _coalescing(pg, "_end_coalescing", dev)
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
        red = _reduce([_flat(x) for x in inputs], p.reduce_op, p.factor)
        _post_reduce(red, p.reduce_op, G.n)
        return {r: red.view(inputs[r].shape) for r in G.real}
    if op == "reduce_scatter":
        ch = [_chunks(x, G.n) for x in inputs]
        for r in G.real:
            red = _reduce([ch[s][r] for s in range(G.n)], p.reduce_op, p.factor)
            _post_reduce(red, p.reduce_op, G.n)
            out[r] = red
        return out
    if op == "all_gather":
        full = torch.cat([_flat(x) for x in inputs])
        return {r: full for r in G.real}
    if op == "broadcast":
        return {r: inputs[p.root] for r in G.real}
    if op == "reduce":
        red = _reduce([_flat(x) for x in inputs], p.reduce_op, p.factor)
        _post_reduce(red, p.reduce_op, G.n)
        return {r: (red if r == p.root else None) for r in G.real}
    if op == "gather":
        return {r: ([inputs[s] for s in range(G.n)] if r == p.root else None) for r in G.real}
    if op == "scatter":
        return {r: inputs[p.root][r] for r in G.real}
    if op == "all_to_all":
        for r in G.real:
            out[r] = torch.cat([_a2a_in_chunks(p, s, inputs[s])[r] for s in range(G.n)])
        return out
    if op in ("send", "recv", "p2p"):
        return {m: inputs[m] for m in range(len(p.messages))}
    if op == "barrier":
        return {r: None for r in G.real}
    raise CompensationError(f"no reference for op {op!r}")
