"""Record mode with ``--save-tensors SELECTOR`` (``ChildEnv.save_tensors``): save selected
collective outputs into the recorded-tensor store (``ChildEnv.tensor_store``, see
``prismllm.generate.store``); with the
selector item ``inputs``, also their inputs, copied at issue (before an in-place backend
overwrites them; a synchronous copy to the host: saving runs are not timing runs).

:class:`SavingInner` stands in for a RecordingProcessGroup's ``_inner``: it forwards every
call to the real group, then -- when the row just issued is selected -- saves the call's
outputs once the real Work completes (its Future's done callback: on gloo's worker thread,
before ``wait`` returns; a call without a Work is saved at once). Anything else is forwarded
unchanged (``__getattr__``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prismllm.childenv import ChildEnv, variable
from prismllm.errors import PrismError
from prismllm.generate.store import Selector, TensorStoreWriter

# method -> (rows, outputs per row) from the call's arguments
_OUTS: dict[str, Callable[..., list[list]]] = {
    "allreduce": lambda ts, *a: [list(ts)],
    "allreduce_coalesced": lambda ts, *a: [[t] for t in ts],
    "allgather": lambda outs, ins, *a: [list(outs[0])],
    "all_gather_single": lambda out, inp, *a: [[out]],
    "_allgather_base": lambda out, inp, *a: [[out]],
    "allgather_coalesced": lambda outs, ins, *a: [list(o) for o in outs],
    "all_gather_single_coalesced": lambda outs, ins, *a: [[o] for o in outs],
    "allgather_into_tensor_coalesced": lambda outs, ins, *a: [[o] for o in outs],
    "reduce_scatter": lambda outs, ins, *a: [[outs[0]]],
    "reduce_scatter_single": lambda out, inp, *a: [[out]],
    "_reduce_scatter_base": lambda out, inp, *a: [[out]],
    "reduce_scatter_single_coalesced": lambda outs, ins, *a: [[o] for o in outs],
    "reduce_scatter_tensor_coalesced": lambda outs, ins, *a: [[o] for o in outs],
    "alltoall": lambda outs, ins, *a: [list(outs)],
    "all_to_all_single": lambda out, *a: [[out]],
    "alltoall_base": lambda out, *a: [[out]],
    "broadcast": lambda ts, *a: [list(ts)],
    "reduce": lambda ts, *a: [list(ts)],
    "gather": lambda outs, ins, *a: [list(outs[0]) if outs else []],
    "scatter": lambda outs, ins, *a: [[outs[0]]],
    "recv": lambda ts, *a: [list(ts)],
}
# method -> inputs per row (saved at issue, before the backend can overwrite them in place):
# what a virtual member contributes, for the proxy of a pruned collective to send
_INS: dict[str, Callable[..., list[list]]] = {
    "allreduce": lambda ts, *a: [list(ts)],
    "allreduce_coalesced": lambda ts, *a: [[t] for t in ts],
    "allgather": lambda outs, ins, *a: [list(ins)],
    "all_gather_single": lambda out, inp, *a: [[inp]],
    "_allgather_base": lambda out, inp, *a: [[inp]],
    "allgather_coalesced": lambda outs, ins, *a: [[i] for i in ins],
    "all_gather_single_coalesced": lambda outs, ins, *a: [[i] for i in ins],
    "allgather_into_tensor_coalesced": lambda outs, ins, *a: [[i] for i in ins],
    "reduce_scatter": lambda outs, ins, *a: [list(ins[0])],
    "reduce_scatter_single": lambda out, inp, *a: [[inp]],
    "_reduce_scatter_base": lambda out, inp, *a: [[inp]],
    "reduce_scatter_single_coalesced": lambda outs, ins, *a: [[i] for i in ins],
    "reduce_scatter_tensor_coalesced": lambda outs, ins, *a: [[i] for i in ins],
    "alltoall": lambda outs, ins, *a: [list(ins)],
    "all_to_all_single": lambda out, inp, *a: [[inp]],
    "alltoall_base": lambda out, inp, *a: [[inp]],
    "broadcast": lambda ts, *a: [list(ts)],
    "reduce": lambda ts, *a: [list(ts)],
    "gather": lambda outs, ins, *a: [list(ins)],
    "scatter": lambda outs, ins, *a: [list(ins[0]) if ins else []],
    "send": lambda ts, *a: [list(ts)],
}

_WRITER: TensorStoreWriter | None = None
_SELECTOR: Selector | None = None


def saving_enabled() -> bool:
    return _WRITER is not None


def setup(rank: int, child: ChildEnv) -> None:
    """Open the store writer when the child was told to save tensors (``save_tensors``,
    ``tensor_store``)."""
    global _WRITER, _SELECTOR
    if not child.save_tensors:
        return
    if not child.tensor_store:
        raise PrismError(f"{variable('save_tensors')} is set but {variable('tensor_store')} (the directory) is not")
    sel = Selector(child.save_tensors)
    if sel:
        _SELECTOR = sel
        _WRITER = TensorStoreWriter(child.tensor_store, rank)


class SavingInner:
    def __init__(self, inner: Any, owner: Any):
        self.__dict__["_real"] = inner
        self.__dict__["_owner"] = owner

    def __getattr__(self, name):
        attr = getattr(self.__dict__["_real"], name)
        owner = self.__dict__["_owner"]
        if name in ("_end_coalescing", "end_coalescing"):

            def end(*args, **kwargs):
                work = attr(*args, **kwargs)
                saves = _BATCHED.pop(id(owner), [])
                if saves:

                    def save_batch():
                        for f in saves:
                            f()

                    # At the program's wait, never through the batch's Future: NCCL's coalesced
                    # Work completes its Future without ordering a callback after the batch's
                    # kernels, and on a GPU the receive buffers were read before the data
                    # arrived. After the wait, the host copy runs on the program's stream,
                    # which then waits for the batch.
                    _at_wait(save_batch, work)
                return work

            return end
        outs_of = _OUTS.get(name)
        ins_of = _INS.get(name) if _SELECTOR.inputs else None
        if outs_of is None and ins_of is None:
            return attr

        def call(*args, **kwargs):
            if ins_of is not None:
                try:
                    _save_now(owner, ins_of(*args), "in")
                except Exception:  # saving must never break the recorded program
                    pass
            work = attr(*args, **kwargs)
            if outs_of is not None:
                try:
                    _schedule(owner, outs_of(*args), work)
                except Exception:
                    pass
            return work

        return call


def _items(owner, per_row: list[list]) -> list[tuple]:
    """(group name, group ranks, op, index, peer, label, tensors) for the selected rows among
    the last ``len(per_row)`` rows the owner issued (the call being made)."""
    rec = owner._rec
    j0 = len(rec.m_op) - len(per_row)
    items = []
    for k, ts in enumerate(per_row):
        j = j0 + k
        op, label = rec.m_op[j], rec.m_label[j]
        if not ts or not _SELECTOR(op, label):
            continue
        peer = rec.m_peer[j] if op in ("send", "recv") else -1
        items.append((owner.group_name, tuple(owner._global_ranks), op, rec.m_seq[j], peer, label, ts))
    return items


def _save_now(owner, ins: list[list], io: str) -> None:
    for item in _items(owner, ins):
        _WRITER.save(*item, io=io)


def _schedule(owner, outs: list[list], work) -> None:
    items = _items(owner, outs)
    if not items:
        return

    def save(_f=None):
        for item in items:
            _WRITER.save(*item)

    if work is None and getattr(owner._rec, "coal_depth", 0):
        # inside a coalesced batch (NCCL's batch_isend_irecv): the op has no Work of its own
        # and completes with the batch's, which _end_coalescing returns; saving now would read
        # a receive buffer before the data arrived
        _BATCHED.setdefault(id(owner), []).append(save)
        return
    _attach(save, work)


def _attach(save: Callable[..., None], work) -> None:
    """Run ``save`` once ``work`` completed: through its Future, else when the program waits on
    it; at once without a Work (the call returned complete)."""
    fut = None
    if work is not None:
        try:
            fut = work.get_future()
        except Exception:
            fut = None
    if fut is None:  # no Work, or no Future (some gloo Works, e.g. p2p and reduce_scatter_single)
        _at_wait(save, work)
    else:
        fut.add_done_callback(save)


def _at_wait(save: Callable[[], None], work) -> None:
    """Run ``save`` when the program waits on ``work`` (RecordingWork -> Recorder.wait runs
    on_wait), or at exit for a Work never waited on (then the buffer's value at exit is
    saved); at once without a Work (the call returned complete)."""
    if work is None:
        save()
    else:
        _PENDING[id(work)] = (work, save)


_PENDING: dict[int, tuple] = {}
_BATCHED: dict[int, list] = {}  # id(owner) -> saves of the open coalesced batch


def on_wait(work):
    """A RecordingProcessGroup's hook on the program's waits: the save to run at the wait on
    ``work``, if one is pending."""
    entry = _PENDING.pop(id(work), None)
    if entry is None:
        return None

    def run():
        entry[1]()

    return run


def close() -> None:
    if _WRITER is not None:
        for _work, save in list(_PENDING.values()):
            try:
                save()
            except Exception:
                pass
        _PENDING.clear()
        for saves in list(_BATCHED.values()):  # a batch never ended: its buffers as they are
            for save in saves:
                try:
                    save()
                except Exception:
                    pass
        _BATCHED.clear()
        _WRITER.close()


__all__ = ["SavingInner", "close", "on_wait", "setup", "saving_enabled"]
