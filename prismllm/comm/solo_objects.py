"""Object collectives in solo mode (``broadcast_object_list``, ``all_gather_object``,
``gather_object``, ``scatter_object_list``, ``recv_object_list``): wrapped so that rules can
answer with objects; by default the local object(s) are replicated (see prismllm.generate)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from prismllm.generate.errors import GenerateError
from prismllm.generate.generator import DEFAULT, Call, TensorGenerator

_ORIG: dict[str, Any] = {}
_GEN: TensorGenerator | None = None


def install(generator: TensorGenerator) -> None:
    """Answer the object collectives from ``generator`` (the wrappers are installed once)."""
    global _GEN
    _GEN = generator
    if _ORIG:
        return
    for name, fn in (("broadcast_object_list", _broadcast_object_list),
                     ("all_gather_object", _all_gather_object),
                     ("gather_object", _gather_object),
                     ("scatter_object_list", _scatter_object_list),
                     ("recv_object_list", _recv_object_list)):  # fmt: skip
        _ORIG[name] = getattr(c10d, name)
        setattr(c10d, name, fn)
        setattr(dist, name, fn)


def _obj_call(op: str, group, objects, *, root: int = -1, peer: int = -1) -> Call | None:
    pg = group or c10d._get_default_group()
    if pg is None or c10d._rank_not_in_group(pg) or not hasattr(pg, "_global_ranks"):
        return None
    try:
        desc = pg.group_desc
    except Exception:
        desc = ""
    return Call(
        rank=pg._rec.rank, op=op, api=op, group_ranks=tuple(pg._global_ranks),
        group_desc=desc or "", group_name=pg.group_name, group_rank=pg.rank(), index=pg._seq,
        label=pg._rec.label_pending, root=root, peer=peer, objects=objects,
        is_root=root >= 0 and root == pg._global_ranks[pg.rank()],
    )  # fmt: skip


def _global_src(group, src, group_src) -> int:
    pg = group or c10d._get_default_group()
    if group_src is not None:
        return pg._global_ranks[group_src]
    return 0 if src is None else int(src)


def _check_list(call: Call, val, n: int, what: str) -> list:
    if not isinstance(val, (list, tuple)) or len(val) != n:
        raise GenerateError(f"{call.where()}: the rule must return a list of {n} objects "
                            f"({what}), got {val!r:.80}")  # fmt: skip
    return list(val)


def _broadcast_object_list(object_list, src=None, group=None, device=None, group_src=None):
    orig = _ORIG["broadcast_object_list"]
    g = _global_src(group, src, group_src)
    call = _obj_call("broadcast_object_list", group, object_list, root=g)
    if call is None or call.is_root:
        return orig(object_list, src=src, group=group, device=device, group_src=group_src)
    val = _GEN.objects(call)
    objs = list(object_list) if val is DEFAULT else _check_list(call, val, len(object_list), "one per list entry")
    _GEN.begin_payload(objs, per_slot=False)
    try:
        return orig(object_list, src=src, group=group, device=device, group_src=group_src)
    finally:
        _GEN.end_payload()


def _all_gather_object(object_list, obj, group=None):
    orig = _ORIG["all_gather_object"]
    call = _obj_call("all_gather_object", group, obj)
    if call is None:
        return orig(object_list, obj, group=group)
    val = _GEN.objects(call)
    n = call.group_size
    objs = [obj] * n if val is DEFAULT else _check_list(call, val, n, "one per group member")
    objs[call.group_rank] = obj
    _GEN.begin_payload(objs, per_slot=True)
    try:
        return orig(object_list, obj, group=group)
    finally:
        _GEN.end_payload()


def _gather_object(obj, object_gather_list=None, dst=None, group=None, group_dst=None):
    orig = _ORIG["gather_object"]
    call = _obj_call("gather_object", group, obj, root=_global_src(group, dst, group_dst))
    if call is None or not call.is_root:
        return orig(obj, object_gather_list, dst=dst, group=group, group_dst=group_dst)
    val = _GEN.objects(call)
    n = call.group_size
    objs = [obj] * n if val is DEFAULT else _check_list(call, val, n, "one per group member")
    objs[call.group_rank] = obj
    _GEN.begin_payload(objs, per_slot=True)
    try:
        return orig(obj, object_gather_list, dst=dst, group=group, group_dst=group_dst)
    finally:
        _GEN.end_payload()


def _scatter_object_list(scatter_object_output_list, scatter_object_input_list=None, src=None,
                         group=None, group_src=None):  # fmt: skip
    orig = _ORIG["scatter_object_list"]
    call = _obj_call("scatter_object_list", group, scatter_object_input_list,
                     root=_global_src(group, src, group_src))  # fmt: skip
    if call is None or call.is_root:
        return orig(scatter_object_output_list, scatter_object_input_list, src=src, group=group,
                    group_src=group_src)  # fmt: skip
    val = _GEN.objects(call)
    if val is DEFAULT:
        raise GenerateError(
            f"{call.where()}: no rule answers scatter_object_list (the object this rank "
            f"receives cannot be generated); add a rule with op='scatter_object_list' "
            f"returning [object]"
        )
    _GEN.begin_payload(_check_list(call, val, 1, "the received object"), per_slot=False)
    try:
        return orig(scatter_object_output_list, scatter_object_input_list, src=src, group=group,
                    group_src=group_src)  # fmt: skip
    finally:
        _GEN.end_payload()


def _recv_object_list(object_list, src=None, group=None, device=None, group_src=None):
    orig = _ORIG["recv_object_list"]
    call = _obj_call("recv_object_list", group, object_list,
                     peer=_global_src(group, src, group_src))  # fmt: skip
    if call is None:
        return orig(object_list, src=src, group=group, device=device, group_src=group_src)
    val = _GEN.objects(call)
    if val is DEFAULT:
        raise GenerateError(
            f"{call.where()}: no rule answers recv_object_list (the objects this rank "
            f"receives cannot be generated); add a rule with op='recv_object_list'"
        )
    _GEN.begin_payload(_check_list(call, val, len(object_list), "one per list entry"),
                       per_slot=False)  # fmt: skip
    try:
        return orig(object_list, src=src, group=group, device=device, group_src=group_src)
    finally:
        _GEN.end_payload()
