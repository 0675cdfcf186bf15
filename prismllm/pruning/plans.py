"""Plans of pruned collectives: for a collective on a logical group of ``n`` members of which
``k`` are real, what runs on the small communicator of the real members and the proxy (op,
reduce op, root, layout, padding, point-to-point messages), the pre/post steps it needs, the
proxy's contribution, and the bytes each real member moves against a rank of the logical
group's ring algorithm (:class:`LinkBytes`). Pure: no tensors, no communication.
``prismllm.pruning`` says how the pieces fit."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from prismllm.errors import PrismError
from prismllm.trace.schema import split_reduce_op

REDUCE_OPS = ("sum", "avg", "max", "min", "product", "premul_sum", "band", "bor", "bxor")
# What the small communicator runs for a logical reduce op: AVG and PREMUL_SUM become SUM
# with a local step (gloo has neither; NCCL's AVG would divide by k+1, not n).
_SMALL_REDOP = {"avg": "sum", "premul_sum": "sum"}
_REDOP_ALIASES = {"prod": "product", "premulsum": "premul_sum", "mul": "product"}


class PruningError(PrismError):
    """A collective cannot be planned as asked (bad membership, sizes, reduce op)."""


# ---------------------------------------------------------------------- membership
@dataclasses.dataclass(frozen=True)
class Pruned:
    """A logical group of ``n`` members with real members ``real`` (logical group ranks).

    Small communicator: with one virtual member (n = k + 1) the small ranks are the logical
    ranks, the proxy standing in the virtual member's place, so that a gather or a scatter of
    slots lays them out in logical order and runs on the program's tensors as they are, wherever
    the virtual member sits; otherwise small rank ``i`` is ``real[i]`` (logical order) and the
    proxy is small rank ``k`` (last). Every virtual member is represented by the proxy."""

    n: int
    real: tuple

    def __post_init__(self) -> None:
        real = tuple(sorted(int(r) for r in self.real))
        object.__setattr__(self, "real", real)
        if self.n < 2:
            raise PruningError(f"a pruned group needs n >= 2 members, got n={self.n}")
        if len(set(real)) != len(real) or not real or real[0] < 0 or real[-1] >= self.n:
            raise PruningError(f"real members {list(real)} are not distinct ranks of a group of {self.n}")
        if len(real) == self.n:
            raise PruningError("every member is real: run the collective on the real backend, not pruned")

    @property
    def k(self) -> int:
        return len(self.real)

    @property
    def in_logical_order(self) -> bool:
        """Whether small rank ``s`` is logical rank ``s`` (one virtual member)."""
        return self.n == len(self.real) + 1

    @property
    def proxy(self) -> int:
        """Small rank of the proxy."""
        return self.virtual[0] if self.in_logical_order else len(self.real)

    @property
    def slots(self) -> tuple:
        """The logical members in small-rank order, the proxy's place holding every virtual
        member (logical order): how a small collective lays out the members' slots."""
        if self.in_logical_order:
            return tuple(range(self.n))
        return self.real + self.virtual

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
        """Small rank standing for logical group rank ``g``: its own if real, else the proxy's."""
        if not 0 <= g < self.n:
            raise PruningError(f"rank {g} is not in a group of {self.n}")
        if self.in_logical_order:
            return g
        try:
            return self.real.index(g)
        except ValueError:
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
    p2p: tuple = ()  # per small rank: tuple of P2POp, in posting order
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
    return (
        f"{p.op}{red} n={p.group.n} real={list(p.group.real)}{root}: small {p.small_op}{sred} "
        f"on {p.group.size} ranks; sandbox: {p.sandbox}; proxy: {p.proxy}"
    )


# ---------------------------------------------------------------------- helpers
def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def _redop(name: Any) -> str:
    if not isinstance(name, str):  # a ReduceOp / RedOpType
        key = getattr(name, "op", name)
        name = getattr(key, "name", None) or str(key).rsplit(".", 1)[-1]
    name = split_reduce_op(name.lower())[0]  # the graph's "premul_sum:<factor>": the factor is passed apart
    name = _REDOP_ALIASES.get(name, name)
    if name not in REDUCE_OPS:
        raise PruningError(f"unsupported reduce op {name!r} (supported: {', '.join(REDUCE_OPS)})")
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


def _check_factor(op: str, factor: Any) -> None:
    if op == "premul_sum" and factor is None:
        raise PruningError("premul_sum needs its factor")


# ---------------------------------------------------------------------- plans
def plan_all_reduce(
    n: int,
    real: Sequence[int],
    shape: Any,
    reduce_op: Any = "sum",
    *,
    dtype: torch.dtype = torch.float32,
    factor: Any = None,
    match_bytes: bool = True,
) -> Plan:
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
        op="all_reduce",
        group=g,
        dtype=dtype,
        small_op="all_reduce",
        numel=S,
        reduce_op=red,
        small_reduce_op=_SMALL_REDOP.get(red, red),
        factor=factor,
        slot=slot,
        pad=pad,
        sandbox=(pre + where + ("; " + post if post else "")),
        proxy=f"{_SMALL_REDOP.get(red, red)} of the virtual members' tensors"
        + (" (each x factor)" if red == "premul_sum" else "")
        + (f", zero-padded to {slot}" if pad else ""),
        bytes={r: lb for r in g.real},
        scratch={r: (slot * it if pad else 0) for r in g.real},
    )


def plan_reduce_scatter(
    n: int,
    real: Sequence[int],
    chunk_shape: Any,
    reduce_op: Any = "sum",
    *,
    dtype: torch.dtype = torch.float32,
    factor: Any = None,
    match_bytes: bool = True,
) -> Plan:
    """reduce_scatter: logical member r gets reduce_j input_j[chunk r] (c elements a chunk).

    Small call: reduce_scatter over k+1 slots of ``slot`` elements. Sandbox: scratch input
    whose slot small(r) holds its own chunk r for each real member r (then zero padding), the
    proxy's slot zeros; output slot -> its chunk. Proxy: slot small(r) = reduce over virtual
    members of their chunk r. With one virtual member the slots are the logical chunks (the
    small ranks are the logical ranks): the program's input and output as they are, no scratch.
    avg: SUM then /n; premul_sum: x factor before.

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
    as_is = g.in_logical_order and not pad and red != "premul_sum"
    return Plan(
        op="reduce_scatter",
        group=g,
        dtype=dtype,
        small_op="reduce_scatter",
        numel=c,
        reduce_op=red,
        small_reduce_op=_SMALL_REDOP.get(red, red),
        factor=factor,
        slot=slot,
        pad=pad,
        sandbox=(
            "input and output as they are" + ("; /= n" if red == "avg" else "")
            if as_is
            else f"scratch [{k + 1} x {slot}]: slot small(r) <- own chunk r"
            + (" (x factor)" if red == "premul_sum" else "")
            + f", slot {g.proxy} zeros; "
            + "output <- small output[:c]"
            + ("; /= n" if red == "avg" else "")
        ),
        proxy=f"slot small(r) <- {_SMALL_REDOP.get(red, red)} over virtual members of chunk r"
        + (" (x factor)" if red == "premul_sum" else "")
        + "; own slot zeros",
        bytes={r: lb for r in g.real},
        scratch={r: 0 if as_is else ((k + 1) * slot + (slot if pad else 0)) * it for r in g.real},
    )


def plan_all_gather(
    n: int, real: Sequence[int], shape: Any, *, dtype: torch.dtype = torch.float32, match_bytes: bool = True
) -> Plan:
    """all_gather of c elements a member: output = all n inputs in logical rank order.

    Small call: all_gather of k+1 slots of (n-k)*c elements. Proxy: its slot = the virtual
    members' inputs concatenated in logical order. Sandbox: own input in a zero-padded slot;
    post: output[r] <- small slot small(r)[:c], output[virtual[i]] <- proxy slot[i*c:(i+1)*c]
    (logical order, not small-rank order). With one virtual member the slots are in logical
    order (the small ranks are the logical ranks): gathered into the program's output as it is.

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
        op="all_gather",
        group=g,
        dtype=dtype,
        small_op="all_gather",
        numel=c,
        slot=slot,
        pad=pad,
        sandbox="input and output as they are"
        if g.in_logical_order
        else (f"input -> slot of {slot} (+{pad} zeros); " if pad else "input as is; ")
        + "output[r] <- small slot small(r), output[virtual[i]] <- proxy slot part i",
        proxy=f"slot <- virtual members' inputs concatenated in logical order ({n_ - k} x {c})",
        bytes={r: lb for r in g.real},
        scratch={r: 0 if g.in_logical_order else ((k + 1) * slot + (slot if pad else 0)) * it for r in g.real},
    )


def plan_broadcast(n: int, real: Sequence[int], shape: Any, root: int, *, dtype: torch.dtype = torch.float32) -> Plan:
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
        bytes_[r] = LinkBytes(0 if last_s else B, 0 if r == root else B, 0 if last_l else B, 0 if r == root else B)
    return Plan(
        op="broadcast",
        group=g,
        dtype=dtype,
        small_op="broadcast",
        numel=S,
        root=root,
        small_root=sroot,
        sandbox="in place",
        proxy=("sends the virtual root's tensor" if not g.is_real(root) else "receives the root's tensor (discarded)"),
        bytes=bytes_,
        scratch={r: 0 for r in g.real},
    )


def plan_reduce(
    n: int,
    real: Sequence[int],
    shape: Any,
    root: int,
    reduce_op: Any = "sum",
    *,
    dtype: torch.dtype = torch.float32,
    factor: Any = None,
) -> Plan:
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
        bytes_[r] = LinkBytes(0 if r == root else B, 0 if first_s else B, 0 if r == root else B, 0 if first_l else B)
    return Plan(
        op="reduce",
        group=g,
        dtype=dtype,
        small_op="reduce",
        numel=S,
        reduce_op=red,
        small_reduce_op=_SMALL_REDOP.get(red, red),
        factor=factor,
        root=root,
        small_root=sroot,
        sandbox=("x factor (a copy on non-roots); " if red == "premul_sum" else "")
        + ("/= n at the root" if red == "avg" else "in place"),
        proxy=f"{_SMALL_REDOP.get(red, red)} of the virtual members' tensors",
        bytes=bytes_,
        scratch={r: (S * it if red == "premul_sum" and r != root else 0) for r in g.real},
    )


def plan_p2p(
    n: int, real: Sequence[int], messages: Sequence[Any], *, dtype: torch.dtype = torch.float32, op: str = "p2p"
) -> Plan:
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
                raise PruningError(f"message {i}: rank {x} is not in a group of {g.n}")
        if m.src == m.dst:
            raise PruningError(f"message {i}: send to self")
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
        op=op,
        group=g,
        dtype=dtype,
        small_op="p2p",
        messages=msgs,
        p2p=tuple(tuple(x) for x in per),
        sandbox="send/recv to small(peer): the proxy for a virtual peer",
        proxy="sends the virtual senders' recorded tensors, receives (discards) what goes to virtual members",
        bytes={r: LinkBytes(snd[r], rcv[r], snd[r], rcv[r]) for r in g.real},
        scratch={r: 0 for r in g.real},
    )


def plan_send(
    n: int, real: Sequence[int], src: int, dst: int, shape: Any, *, tag: int = 0, dtype: torch.dtype = torch.float32
) -> Plan:
    """One send from ``src`` to ``dst`` (one of them real): :func:`plan_p2p` of one message."""
    return plan_p2p(n, real, [Message(int(src), int(dst), _numel(shape), tag)], dtype=dtype, op="send")


plan_recv = plan_send  # a recv is the same message seen from the other end


def plan_gather(n: int, real: Sequence[int], shape: Any, root: int, *, dtype: torch.dtype = torch.float32) -> Plan:
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
        p,
        numel=c,
        root=root,
        small_root=g.small(root),
        sandbox="root: recv each member's input into output[src]; copy own; others: send input",
        proxy=(
            "sends each virtual member's input to the root (logical order)"
            if g.is_real(root)
            else "receives the real members' inputs (discarded)"
        ),
    )


def plan_scatter(n: int, real: Sequence[int], shape: Any, root: int, *, dtype: torch.dtype = torch.float32) -> Plan:
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
        p,
        numel=c,
        root=root,
        small_root=g.small(root),
        sandbox="root: send input[d] to small(d), copy own chunk; others: recv into output",
        proxy=(
            "sends each real member its chunk of the virtual root's list"
            if not g.is_real(root)
            else "receives the virtual members' chunks (discarded)"
        ),
    )


def plan_all_to_all(
    n: int,
    real: Sequence[int],
    splits: Sequence[Sequence[int]] | None = None,
    *,
    numel: int | None = None,
    row_numel: int = 1,
    dtype: torch.dtype = torch.float32,
) -> Plan:
    """all_to_all (single-tensor or list form, uneven splits).

    ``splits[src][dst]``: rows member src sends to dst (the recorded in_splits of every
    member; out_splits of dst are column dst), ``row_numel`` elements a row; or ``splits``
    None and ``numel`` per member input split evenly.

    Small call: all_to_all_single on flat buffers. Real member g: sends its chunk for each
    real member to it, and its chunks for all virtual members, concatenated in logical
    order, to the proxy; receives each real member's chunk for it, and from the proxy the
    virtual members' chunks for it concatenated in logical source order. Pre/post: permute
    chunks between logical order and small order (``Pruned.slots``; a no-op, no scratch, when
    that is the logical order: one virtual member, or the real members the first k). Proxy:
    receives (discards) the real->virtual chunks.

    Bytes per real member: exact -- it sends sum_{d != g} splits[g][d] and receives
    sum_{s != g} splits[s][g] rows, as in the logical exchange (k peers instead of n-1)."""
    g = _group(n, real)
    n_ = g.n
    if splits is None:
        if numel is None or numel % n_:
            raise PruningError(f"all_to_all without splits needs numel divisible by n={n_}")
        el = [[numel // n_] * n_ for _ in range(n_)]
    else:
        if len(splits) != n_ or any(len(r) != n_ for r in splits):
            raise PruningError(f"all_to_all splits must be {n_} x {n_}")
        el = [[int(x) * row_numel for x in row] for row in splits]
    vs = g.virtual
    # the members each small rank stands for, in small order (the proxy: every virtual member)
    stands = [[m] if g.is_real(m) else list(vs) for m in (range(n_) if g.in_logical_order else (*g.real, vs[0]))]

    def rows(a: list, b: list) -> int:  # what the members ``a`` send those ``b`` in all
        return sum(el[x][y] for x in a for y in b)

    px = g.proxy  # the proxy sends itself nothing: its members' chunks among themselves are no one's
    send = [tuple(0 if i == j == px else rows(a, b) for j, b in enumerate(stands)) for i, a in enumerate(stands)]
    recv = [tuple(0 if i == j == px else rows(b, a) for j, b in enumerate(stands)) for i, a in enumerate(stands)]
    it = _itemsize(dtype)
    identity = g.slots == tuple(range(n_))
    bytes_, scratch = {}, {}
    for r in g.real:
        i = g.small(r)
        ls = sum(el[r][d] for d in range(n_) if d != r) * it
        lr = sum(el[s][r] for s in range(n_) if s != r) * it
        ss = (sum(send[i]) - send[i][i]) * it
        sr = (sum(recv[i]) - recv[i][i]) * it
        bytes_[r] = LinkBytes(ss, sr, ls, lr)
        scratch[r] = 0 if identity else (sum(send[i]) + sum(recv[i])) * it
    return Plan(
        op="all_to_all",
        group=g,
        dtype=dtype,
        small_op="all_to_all",
        splits=tuple(tuple(r) for r in el),
        small_send=tuple(send),
        small_recv=tuple(recv),
        sandbox=(
            "as is (small order is logical order)"
            if identity
            else "permute input chunks to small order; permute output back to logical source order"
        ),
        proxy="sends virtual->real chunks (per real member, logical source order); receives real->virtual (discarded)",
        bytes=bytes_,
        scratch=scratch,
    )


def splits_matrix(n: int, rows: dict | None = None, cols: dict | None = None) -> list:
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
            raise PruningError(f"all_to_all: member {src} has {len(sp)} input splits for a group of {n}")
        for d, x in enumerate(sp):
            m[src][d], given[src][d] = int(x), True
    for dst, sp in (cols or {}).items():
        if len(sp) != n:
            raise PruningError(f"all_to_all: member {dst} has {len(sp)} output splits for a group of {n}")
        for s_, x in enumerate(sp):
            if given[s_][dst] and m[s_][dst] != int(x):
                raise PruningError(
                    f"all_to_all: member {s_} sends {m[s_][dst]} rows to member {dst}, which expects "
                    f"{int(x)} (the members' split sizes disagree)"
                )
            m[s_][dst], given[s_][dst] = int(x), True
    return m


def plan_barrier(n: int, real: Sequence[int]) -> Plan:
    """barrier: a barrier on the small communicator; the proxy enters once every virtual
    member has arrived (the replay decides when). Bytes: none modelled."""
    g = _group(n, real)
    zero = LinkBytes(0, 0, 0, 0)
    return Plan(
        op="barrier",
        group=g,
        dtype=torch.uint8,
        small_op="barrier",
        sandbox="none",
        proxy="enters when every virtual member has arrived",
        bytes={r: zero for r in g.real},
        scratch={r: 0 for r in g.real},
    )


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
        raise PruningError(f"no pruning plan for op {op!r}") from None
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
