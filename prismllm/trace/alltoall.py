"""All-to-all split sizes of a graph assembled from ranks run alone: made to agree across the
members of each instance (:func:`reconcile_all_to_all`, used by solo capture)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from prismllm.trace.edges import group_members, group_rank_lookup
from prismllm.trace.schema import NODE_SCHEMA


def reconcile_all_to_all(trace: Any) -> int:
    """Make every all_to_all instance's split sizes agree: the senders' win.

    A rank run alone gets its peers' split sizes from the tensor generator (e.g. gpt3d's
    all-gather of routing counts), so member j's ``out_splits[i]`` need not equal member i's
    ``in_splits[j]`` (what i actually sends). For each instance (group, seq) whose members all
    recorded splits of the group's size, set ``out_splits`` of member j to
    ``[in_splits_i[j] for i]`` and ``out_bytes`` to match (bytes per row from the member's
    own ``in_bytes / sum(in_splits)``, else the instance's). Returns the number of instances
    changed; others are left for validation to judge."""

    nodes = trace.nodes
    op = nodes.column("op")
    rows = np.flatnonzero(
        pc.equal(op, "all_to_all").to_numpy(zero_copy_only=False)
        & pc.equal(nodes.column("kind"), "comm").to_numpy(zero_copy_only=False)
    )
    if not len(rows):
        return 0
    sub = nodes.take(pa.array(rows))
    group = sub.column("group").to_numpy().astype(np.int64)
    seq = sub.column("seq").to_numpy().astype(np.int64)
    rank = sub.column("rank").to_numpy().astype(np.int64)
    in_l = sub.column("in_splits").combine_chunks()
    out_l = sub.column("out_splits").combine_chunks()
    in_len = pc.list_value_length(in_l).to_numpy(zero_copy_only=False).astype(np.int64)
    out_len = pc.list_value_length(out_l).to_numpy(zero_copy_only=False).astype(np.int64)
    in_flat = pc.list_flatten(in_l).to_numpy(zero_copy_only=False).astype(np.int64)
    in_off = np.cumsum(in_len) - in_len
    gids, gsize_of, _ = group_members(trace.groups)
    gsize = np.zeros(int(gids.max()) + 1 if len(gids) else 0, dtype=np.int64)
    gsize[gids] = gsize_of
    k = np.where(group >= 0, gsize[np.maximum(group, 0)], 0)
    grank = group_rank_lookup(trace.groups, trace.world_size)(group, rank)
    usable = (group >= 0) & (in_len == k) & (out_len == k) & (grank >= 0) & (k > 0)
    o = np.lexsort((grank, seq, group))
    g_s, s_s = group[o], seq[o]
    start = np.r_[True, (g_s[1:] != g_s[:-1]) | (s_s[1:] != s_s[:-1])]
    inst = np.cumsum(start) - 1
    n_inst = int(inst[-1]) + 1
    members = np.bincount(inst, minlength=n_inst)
    ok_inst = np.ones(n_inst, dtype=bool)
    np.logical_and.at(ok_inst, inst, usable[o])
    first = np.flatnonzero(start)
    ok_inst &= members == k[o][first]
    # positions must be 0..k-1 in order
    pos_ok = grank[o] == (np.arange(len(o)) - first[inst])
    np.logical_and.at(ok_inst, inst, pos_ok)
    new_out = pc.list_flatten(out_l).to_numpy(zero_copy_only=False).astype(np.int64).copy()
    out_off = np.cumsum(out_len) - out_len
    in_bytes = sub.column("in_bytes").to_numpy().astype(np.int64)
    out_bytes = sub.column("out_bytes").to_numpy().astype(np.int64).copy()
    changed = 0
    for size in np.unique(k[o][first][ok_inst]):
        sel_inst = np.flatnonzero(ok_inst & (k[o][first] == size))
        if not len(sel_inst):
            continue
        size = int(size)
        member_rows = o[(first[sel_inst][:, None] + np.arange(size)[None, :])]  # [inst, member]
        send = in_flat[in_off[member_rows][..., None] + np.arange(size)]  # [inst, i, j]: i sends to j
        recv = send.transpose(0, 2, 1)  # [inst, j, i]: j receives from i
        cur = new_out[out_off[member_rows][..., None] + np.arange(size)]
        diff = np.any(cur != recv, axis=(1, 2))
        if not diff.any():
            continue
        changed += int(diff.sum())
        mr = member_rows[diff]
        rv = recv[diff]
        new_out[out_off[mr][..., None] + np.arange(size)] = rv
        in_tot = send[diff].sum(axis=2)
        bpr_member = np.where(in_tot > 0, in_bytes[mr] // np.maximum(in_tot, 1), 0)
        bpr_inst = bpr_member.max(axis=1, keepdims=True)
        bpr = np.where(bpr_member > 0, bpr_member, bpr_inst)
        out_bytes[mr] = rv.sum(axis=2) * bpr
    if not changed:
        return 0
    full_out = nodes.column("out_splits").combine_chunks()
    full_len = pc.list_value_length(full_out).to_numpy(zero_copy_only=False).astype(np.int64)
    full_off = np.r_[0, np.cumsum(full_len)]
    values = pc.list_flatten(full_out).to_numpy(zero_copy_only=False).astype(np.int64).copy()
    idx = np.repeat(full_off[rows], out_len) + (np.arange(len(new_out)) - np.repeat(out_off, out_len))
    values[idx] = new_out
    full_bytes = nodes.column("out_bytes").to_numpy().astype(np.int64).copy()
    full_bytes[rows] = out_bytes
    i = nodes.schema.get_field_index("out_splits")
    nodes = nodes.set_column(
        i,
        NODE_SCHEMA.field("out_splits"),
        pa.ListArray.from_arrays(pa.array(full_off, type=pa.int32()), pa.array(values, type=pa.int64())),
    )
    i = nodes.schema.get_field_index("out_bytes")
    nodes = nodes.set_column(i, NODE_SCHEMA.field("out_bytes"), pa.array(full_bytes))
    trace.nodes = nodes
    trace._cache.clear()
    return changed


__all__ = ["reconcile_all_to_all"]
