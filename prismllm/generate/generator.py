"""The tensor generator: what a solo rank receives from its (absent) peers.

Order: the recorded-tensor store (``prism capture --tensors``), then user rules
(``--rules``), then the defaults below. Every answer is written *into the program's own
output tensors* (never a new tensor handed back), so shapes, dtypes, devices and the
caching allocator's view of memory are the program's.

Default rules (chosen to keep programs on their normal path):

==================  =========================================================================
all_reduce          sum: input x group size; avg, max, min, band, bor, premul_sum (assumed
                    factor 1/size), product: the input unchanged; bxor: zeros when the size
                    is even; bool: unchanged (or of equal values)
all_gather          every slot holds the local input (object sizes/bytes: see below)
reduce_scatter      the local chunk (group rank's) x size for sum, the chunk otherwise
all_to_all          output chunk j = the first rows of what this rank sends to j (zero rows
                    beyond); even splits: an exact copy
broadcast (non-src) what the root sent, where it is a solo rank of the same capture that ran
                    before or beside this one and the tensor is small (1 MiB at most:
                    token ids, flags, seeds; ``comm.solo_objects``); else
                    the local buffer kept: a rank's own copy of replicated state is what the
                    source sends (DDP's parameter-shape check, its initial parameter sync
                    and bucket order; seeds, flags). Except what uninitialised memory holds
                    (a ``torch.empty`` receive buffer, e.g. token ids from TP rank 0):
                    floats: NaN/inf replaced by 0; int64 with a value beyond 2**31, int32
                    beyond 2**24 (pointers, float bit patterns: no size, index or token id
                    is that large), bool with a byte other than 0/1: all zeros (valid token
                    ids, indices, "not done" flags)
reduce (dst)        as all_reduce
gather (dst)        every slot holds the local input
scatter (non-src)   zeros; src: its own chunk
recv                what the sender sent, where it is a solo rank of the same capture that
                    ran before or beside this one and the tensor is small (1 MiB at most: a
                    small model's activations, a flag, a count; ``comm.solo_objects``); else
                    zeros
barrier             nothing
==================  =========================================================================

Consequence for MoE: an all_gather of routing counts in the EP group returns the local
counts in every slot, so every split size a rank derives is consistent with the data it
sends and receives (each peer is assumed to route like this rank: balanced).

Object collectives (``all_gather_object``, ``broadcast_object_list``, ``gather_object``):
default: the objects the capture's other solo ranks contributed (``prismllm.comm.solo_objects``),
else replicate the local object(s) -- the size and byte tensors of torch's protocol are
generated from those pickled objects (exactly what torch would pickle), so unpickling on
the receiving side yields them. ``scatter_object_list`` and ``recv_object_list`` on a
receiving rank have nothing local to replicate: they need a rule or a recorded tensor store
(else GenerateError).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed.distributed_c10d as c10d

from prismllm.generate.errors import GenerateError
from prismllm.generate.rules import Rule, load_rules
from prismllm.generate.store import TensorStore

DEFAULT = object()  # a rule returns this to fall through to the defaults


@dataclasses.dataclass
class Call:
    """One collective (or receive) as the generator and rules see it."""

    rank: int  # global rank of this process
    op: str  # recorded op name (all_reduce, broadcast, ...) or an object-collective name
    api: str  # the process-group method reached (allreduce, all_gather_single, ...)
    group_ranks: tuple[int, ...]  # global ranks in group-rank order
    group_desc: str
    group_name: str
    group_rank: int
    index: int  # per-group call index (= recorded seq); send/recv: index among calls to peer
    label: str = ""  # prismllm.mark label
    reduce_op: str = ""
    root: int = -1  # global src/dst of rooted ops
    peer: int = -1  # global peer of send/recv
    in_splits: tuple[int, ...] = ()
    out_splits: tuple[int, ...] = ()
    input: Any = None  # the local input tensor (list for list inputs), None where none
    output: Any = None  # the tensor (or list of tensors) to fill
    objects: Any = None  # object collectives: the local object / list
    is_root: bool = False

    @property
    def group_size(self) -> int:
        return len(self.group_ranks)

    @property
    def targets(self) -> list[torch.Tensor]:
        o = self.output
        if o is None:
            return []
        return [o] if isinstance(o, torch.Tensor) else list(o)

    @property
    def shape(self) -> tuple[int, ...] | None:
        """The shape a rule must return: the output's, or (n, *slot) for n equal slots."""
        o = self.output
        if isinstance(o, torch.Tensor):
            return tuple(o.shape)
        ts = self.targets
        if ts and all(t.shape == ts[0].shape for t in ts):
            return (len(ts), *ts[0].shape)
        return None

    @property
    def dtype(self) -> torch.dtype | None:
        ts = self.targets
        return ts[0].dtype if ts else None

    @property
    def device(self) -> torch.device | None:
        ts = self.targets
        return ts[0].device if ts else None

    def where(self) -> str:
        desc = f" ({self.group_desc})" if self.group_desc else ""
        lab = f" label {self.label!r}" if self.label else ""
        peer = f" peer {self.peer}" if self.peer >= 0 else ""
        return (f"rank {self.rank}: {self.op} on group {self.group_name} "
                f"{_ranks_str(self.group_ranks)}{desc} call {self.index}{peer}{lab}")  # fmt: skip


def _ranks_str(ranks) -> str:
    r = list(ranks)
    if len(r) > 8:
        return f"[{', '.join(map(str, r[:4]))}, ..., {r[-1]}] ({len(r)} ranks)"
    return str(r)


def _desc(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)} {str(t.dtype).replace('torch.', '')}"


def _fill_slots(slots: list[torch.Tensor], rows: torch.Tensor) -> None:
    """Slot i of ``slots`` (tensors of the same size) takes row i of ``rows`` (on the host).
    torch's object all-gather hands one slot per group member, each a view of one buffer: those
    are filled with one copy, since a copy a slot is an 8192-long run of tiny device copies at
    8192 ranks (on a GPU shared by many solo ranks, each waits its turn on the device)."""
    whole = _one_buffer(slots, rows.shape[1])
    if whole is not None:
        whole.copy_(rows.view(-1))
        return
    for t, row in zip(slots, rows):
        t.copy_(row.view_as(t))


def _one_buffer(slots: list[torch.Tensor], k: int) -> torch.Tensor | None:
    """The flat view covering ``slots`` where they lie back to back in one storage (each
    contiguous, ``k`` elements, in order), else None."""
    first = slots[0]
    ptr, start = first.untyped_storage().data_ptr(), first.storage_offset()
    for i, t in enumerate(slots):
        if (t.numel() != k or not t.is_contiguous() or t.storage_offset() != start + i * k
                or t.untyped_storage().data_ptr() != ptr or t.dtype != first.dtype):  # fmt: skip
            return None
    return first.as_strided((len(slots) * k,), (1,), start)


class _Payload:
    """Sizes then bytes of pickled objects, answering torch's object-collective protocol."""

    def __init__(self, objects: list[Any], per_slot: bool):

        self.tensors = [c10d._object_to_tensor(o, "cpu", None)[0] for o in objects]
        self.sizes = [int(t.numel()) for t in self.tensors]
        self.per_slot = per_slot  # all_gather_object: one object per slot
        self.stage = 0  # 0: sizes next, 1: bytes next, 2: done

    def fill(self, call: Call) -> bool:
        ts = call.targets
        if self.stage in (0, 2) and ts and ts[0].dtype == torch.long:
            vals = torch.tensor(self.sizes, dtype=torch.long)
            if self.per_slot:
                if len(ts) != len(self.sizes):
                    return False
                _fill_slots(ts, vals.view(-1, 1).expand(-1, ts[0].numel()).contiguous())
            else:
                if ts[0].numel() != len(self.sizes):
                    return False
                ts[0].copy_(vals.view_as(ts[0]))
            self.stage = 1
            return True
        if self.stage == 1 and ts and ts[0].dtype == torch.uint8:
            if self.per_slot:
                rows = torch.zeros(len(ts), ts[0].numel(), dtype=torch.uint8)
                for row, b in zip(rows, self.tensors):
                    row[: b.numel()] = b
                _fill_slots(ts, rows)
            else:
                flat = torch.cat(self.tensors) if self.tensors else torch.empty(0, dtype=torch.uint8)
                if flat.numel() != ts[0].numel():
                    return False
                ts[0].copy_(flat.view_as(ts[0]))
            self.stage = 2
            return True
        return False


class TensorGenerator:
    def __init__(self, rank: int, rules: list[Rule] | None = None,
                 store: TensorStore | None = None):  # fmt: skip
        self.rank = rank
        self.rules = list(rules or [])
        self.store = store
        self.payload: _Payload | None = None
        self.answered = {"store": 0, "rule": 0, "default": 0}
        # the capture's other ranks (comm.solo_objects.SharedObjects): a root's small broadcast,
        # kept by :meth:`sent`, answers the members that receive it
        self.peers: Any = None

    @classmethod
    def for_rank(cls, rank: int, rules: str | None = None, tensors: str | None = None) -> TensorGenerator:
        """The generator of ``rank`` with the user's rules file and recorded-tensor store, if given."""
        return cls(rank, load_rules(rules) if rules else [], TensorStore(tensors, rank) if tensors else None)

    # ---- tensors ------------------------------------------------------------------------
    def fill(self, call: Call) -> None:
        """Fill ``call.output`` (store, then rules, then defaults), outside autograd as a real
        backend writes: a receive buffer may be a leaf that requires grad (pipeline schedules
        make them so), which an in-place write under grad mode refuses ("a leaf Variable that
        requires grad is being used in an in-place operation")."""
        with torch.no_grad():
            self._fill(call)

    def _fill(self, call: Call) -> None:
        # a receive's number among its sender's messages, whatever answers it (the count must
        # stay the sender's; comm.solo_objects.SharedObjects.keep_sent)
        k = self.peers.count_received(call) if call.op == "recv" and call.peer >= 0 and self.peers is not None else -1
        if self.store is not None:
            saved = self.store.get(call.group_name, call.group_ranks, call.op, call.index,
                                   call.peer if call.op in ("send", "recv") else -1)  # fmt: skip
            if saved is not None:
                self._copy_saved(call, saved)
                self.answered["store"] += 1
                return
        for r in self.rules:
            try:
                hit = r.matches(call)
            except Exception as e:
                raise GenerateError(f"{call.where()}: {r} failed to match: {e!r}") from None
            if not hit:
                continue
            val = _invoke(r, call)
            if val is DEFAULT:
                break
            if val is not None:
                self._copy_rule(call, r, val)
            self.answered["rule"] += 1
            return
        self.answered["default"] += 1
        if self.peers is not None and self.payload is None and (call.op == "broadcast" or k >= 0):
            sent = self.peers.broadcast(call) if call.op == "broadcast" else self.peers.received(call, k)
            if sent is not None and [(t.shape, t.dtype) for t in call.targets] == [(sent.shape, sent.dtype)]:
                call.targets[0].copy_(sent)
                return
        default_fill(call, self.payload)

    def sent(self, call: Call) -> None:
        """A call whose outputs are not this rank's to fill (a broadcast's root, a send): what it
        sends is kept for the capture's other ranks."""
        if call.op == "broadcast" and self.peers is not None:
            self.peers.keep_broadcast(call)
        elif call.op == "send" and call.peer >= 0 and self.peers is not None:
            self.peers.keep_sent(call)

    def _copy_saved(self, call: Call, saved: list[torch.Tensor]) -> None:
        ts = call.targets
        if len(saved) != len(ts) or any(s.shape != t.shape or s.dtype != t.dtype for s, t in zip(saved, ts)):
            got = ", ".join(_desc(s) for s in saved)
            want = ", ".join(_desc(t) for t in ts)
            raise GenerateError(
                f"{call.where()}: the recorded tensor store holds {got}; the program's output is "
                f"{want} (the program took another path than in the recorded run)"
            )
        for s, t in zip(saved, ts):
            t.copy_(s)

    def _copy_rule(self, call: Call, r: Rule, val: Any) -> None:
        if not isinstance(val, torch.Tensor):
            raise GenerateError(f"{call.where()}: {r} returned {type(val).__name__}, not a tensor")
        shape, dtype = call.shape, call.dtype
        if shape is None or tuple(val.shape) != shape or val.dtype != dtype:
            want = (f"shape {shape} {str(dtype).replace('torch.', '')}" if shape is not None
                    else "unequal slots: fill call.output in place and return None")  # fmt: skip
            raise GenerateError(f"{call.where()}: {r} returned {_desc(val)}; the output is {want}")
        o = call.output
        if isinstance(o, torch.Tensor):
            o.copy_(val)
        else:
            for t, v in zip(o, val.unbind(0)):
                t.copy_(v)

    # ---- objects ------------------------------------------------------------------------
    def objects(self, call: Call) -> Any:
        """A rule's answer for an object collective, or DEFAULT."""
        for r in self.rules:
            if not r.matches(call):
                continue
            val = _invoke(r, call)
            if val is DEFAULT:
                break
            self.answered["rule"] += 1
            return val
        return DEFAULT

    def begin_payload(self, objects: list[Any], per_slot: bool) -> None:
        self.payload = _Payload(objects, per_slot)

    def end_payload(self) -> None:
        self.payload = None


# ---- defaults ---------------------------------------------------------------------------
_KEEP = {"avg", "max", "min", "band", "bor", "premul_sum", "product"}


def _reduce_inplace(t: torch.Tensor, red: str, size: int) -> None:
    if red == "sum":
        if t.dtype != torch.bool and size != 1:
            t.mul_(size)
    elif red == "bxor":
        if size % 2 == 0:
            t.zero_()
    # everything else: the input unchanged


def _receive_fill(t: torch.Tensor) -> None:
    """A buffer receiving data nothing local can stand for."""
    t.zero_()


# An integer buffer holding a value beyond these holds uninitialised memory (see broadcast).
_INT_LIMIT = {torch.int64: 2**31, torch.int32: 2**24}


def keep_local(t: torch.Tensor) -> None:
    """A non-source buffer: kept, or cleaned where it holds uninitialised memory. Integer and
    bool buffers are checked on a host copy, so that nothing is allocated on the device (the
    real backend allocates nothing there: solo-mode peak memory must stay exact)."""
    if t.is_floating_point():
        torch.nan_to_num_(t, 0.0, 0.0, 0.0)
        return
    if t.numel() == 0 or (t.dtype != torch.bool and t.dtype not in _INT_LIMIT):
        return
    h = t.detach().cpu()
    if t.dtype == torch.bool:
        bad = bool(h.view(torch.uint8).max() > 1)
    else:
        lim = _INT_LIMIT[t.dtype]
        bad = bool(h.min() < -lim) or bool(h.max() >= lim)
    if bad:
        t.zero_()


def default_fill(call: Call, payload: _Payload | None = None) -> None:
    if payload is not None and payload.fill(call):
        return
    op = call.op
    n = call.group_size
    if op == "all_reduce":
        for t in call.targets:
            _reduce_inplace(t, call.reduce_op, n)
    elif op == "all_gather":
        inp = call.input
        o = call.output
        if isinstance(o, torch.Tensor):  # all_gather_into_tensor: [n*rows, ...] or [n, ...]
            o.view(n, -1).copy_(inp.reshape(1, -1).expand(n, -1))
        else:
            for t in o:
                if t is not inp:
                    t.copy_(inp)
    elif op == "reduce_scatter":
        o, inp = call.output, call.input
        if isinstance(inp, torch.Tensor):
            o.copy_(inp.reshape(n, -1)[call.group_rank].view_as(o))
        else:
            o.copy_(inp[call.group_rank])
        _reduce_inplace(o, call.reduce_op, n)
    elif op == "all_to_all":
        o, inp = call.output, call.input
        if isinstance(o, torch.Tensor):
            osp = list(call.out_splits) or [(o.shape[0] if o.dim() else 0) // n] * n
            isp = list(call.in_splits) or [(inp.shape[0] if inp.dim() else 0) // n] * n
            oo = ii = 0
            for j in range(n):
                k = min(osp[j], isp[j])
                if k:
                    o[oo : oo + k].copy_(inp[ii : ii + k])
                if osp[j] > k:
                    o[oo + k : oo + osp[j]].zero_()
                oo += osp[j]
                ii += isp[j]
        else:
            for t, s in zip(o, inp):
                if t.shape == s.shape:
                    t.copy_(s)
                else:
                    t.zero_()
    elif op == "broadcast":
        if not call.is_root:
            for t in call.targets:
                keep_local(t)
    elif op == "reduce":
        if call.is_root:
            for t in call.targets:
                _reduce_inplace(t, call.reduce_op, n)
    elif op == "gather":
        if call.is_root:
            for t in call.targets:
                t.copy_(call.input)
    elif op == "scatter":
        o = call.output
        if call.is_root and call.input:
            o.copy_(call.input[call.group_rank])
        else:
            _receive_fill(o)
    elif op == "recv":
        for t in call.targets:
            _receive_fill(t)
    else:  # pragma: no cover - every tensor op is above
        raise GenerateError(f"{call.where()}: no default for op {op!r}")


__all__ = ["Call", "TensorGenerator", "DEFAULT", "default_fill", "keep_local"]


def _invoke(r: Rule, call: Call) -> Any:
    """Run a user rule; anything it raises becomes one GenerateError naming the call."""
    try:
        return r.fn(call)
    except GenerateError:
        raise
    except Exception as e:
        raise GenerateError(f"{call.where()}: {r} raised {e!r}") from None
