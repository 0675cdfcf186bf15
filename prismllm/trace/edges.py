"""The edges of a graph from its nodes: program order on each rank, issue -> wait of
asynchronous calls, and synchronisation (a collective instance chained in group-rank order; the
k-th send a->b on a group matched with the k-th recv on b from a)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from prismllm.trace.schema import (
    COLLECTIVE_OPS,
    EDGE_KINDS,
    EDGE_ORDER,
    EDGE_SCHEMA,
    EDGE_SYNC,
    EDGE_WAIT,
    KIND_COMM,
)


def group_members(groups: pa.Table) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A groups table as arrays (int64, in table order): each group's id, its member count, and
    every group's members one after another."""
    ranks = groups.column("ranks").combine_chunks()
    gids = groups.column("group_id").to_numpy(zero_copy_only=False).astype(np.int64)
    lengths = pc.list_value_length(ranks).to_numpy(zero_copy_only=False).astype(np.int64)
    return gids, lengths, pc.list_flatten(ranks).to_numpy(zero_copy_only=False).astype(np.int64)


def group_rank_lookup(groups: pa.Table, world_size: int):
    """Return ``f(gid, rank) -> group rank`` (vectorised; -1 where rank is no member)."""
    gids, lengths, flat = group_members(groups)
    pair_gid = np.repeat(gids, lengths)
    pair_grank = np.arange(len(flat)) - np.repeat((np.cumsum(lengths) - lengths), lengths)
    ws = max(int(world_size), int(flat.max()) + 1 if len(flat) else 1)
    keys = pair_gid * ws + flat
    order = np.argsort(keys, kind="stable")
    keys = keys[order]
    pair_grank = pair_grank[order]

    def lookup(gid: np.ndarray, rank: np.ndarray) -> np.ndarray:
        q = gid.astype(np.int64) * ws + rank.astype(np.int64)
        i = np.searchsorted(keys, q)
        i = np.minimum(i, max(len(keys) - 1, 0))
        if not len(keys):
            return np.full(len(q), -1, dtype=np.int64)
        hit = (keys[i] == q) & (gid >= 0) & (rank >= 0) & (rank < ws)
        return np.where(hit, pair_grank[i], -1)

    return lookup


def build_edges(nodes: pa.Table, groups: pa.Table, world_size: int) -> pa.Table:
    """Derive the order, wait and sync edges of a node table sorted by (rank, index). Columns
    are read in their own (32-bit) types and each array is dropped once used: at 131,072
    ranks a column is 19 M entries, and this runs beside the graph of every rank."""
    node_id = nodes.column("node_id").to_numpy()
    rank = nodes.column("rank").to_numpy()
    n = len(node_id)
    srcs, dsts, kinds = [], [], []
    new_rank = np.r_[True, rank[1:] != rank[:-1]] if n else np.zeros(0, dtype=bool)

    # order
    same = ~new_rank[1:]
    srcs.append(node_id[:-1][same])
    dsts.append(node_id[1:][same])
    kinds.append(EDGE_KINDS.index(EDGE_ORDER))
    del same

    # wait: to the node at ``wait_index`` of the same rank
    index = nodes.column("index").to_numpy()
    wait_index = nodes.column("wait_index").to_numpy()
    starts = np.flatnonzero(new_rank)
    run_id = np.cumsum(new_rank, dtype=np.int64) - 1
    del new_rank
    w = np.flatnonzero((wait_index > index) & (wait_index < np.diff(np.r_[starts, n])[run_id]))
    srcs.append(node_id[w])
    dsts.append(node_id[starts[run_id[w]] + wait_index[w]])
    kinds.append(EDGE_KINDS.index(EDGE_WAIT))
    del index, wait_index, starts, run_id, w

    # sync: collectives by (group, seq), chained in group-rank order
    is_coll = pc.and_(
        pc.equal(nodes.column("kind"), KIND_COMM), pc.is_in(nodes.column("op"), value_set=pa.array(COLLECTIVE_OPS))
    )
    ci = np.flatnonzero(is_coll.to_numpy(zero_copy_only=False))
    g = nodes.column("group").to_numpy()[ci].astype(np.int64)
    ci, g = ci[g >= 0], g[g >= 0]
    lookup = group_rank_lookup(groups, world_size)
    if len(ci):
        s = nodes.column("seq").to_numpy()[ci].astype(np.int64)
        r = rank[ci].astype(np.int64)
        gr = lookup(g, r)
        o = np.lexsort((r, gr, s, g))
        g, s, ids = g[o], s[o], node_id[ci][o]
        link = (g[1:] == g[:-1]) & (s[1:] == s[:-1])
        srcs.append(ids[:-1][link])
        dsts.append(ids[1:][link])
        kinds.append(EDGE_KINDS.index(EDGE_SYNC))

    # sync: the k-th send a->b on g with the k-th recv on b from a on g
    src_pair, dst_pair = match_p2p(nodes)
    srcs.append(src_pair)
    dsts.append(dst_pair)
    kinds.append(EDGE_KINDS.index(EDGE_SYNC))

    lens = np.array([len(s) for s in srcs], dtype=np.int64)
    kind_codes = np.repeat(np.array(kinds, dtype=np.int8), lens)
    kind_arr = pa.DictionaryArray.from_arrays(pa.array(kind_codes), pa.array(list(EDGE_KINDS))).cast(pa.string())
    return pa.Table.from_arrays(
        [pa.array(np.concatenate(srcs).astype(np.int64)), pa.array(np.concatenate(dsts).astype(np.int64)), kind_arr],
        schema=EDGE_SCHEMA,
    )


def match_p2p(nodes: pa.Table, *, unmatched: bool = False):
    """Pair sends with recvs by order. Returns (send node ids, recv node ids) of the pairs, and
    with ``unmatched=True`` also (unmatched send rows, unmatched recv rows) as row positions."""
    is_comm = pc.equal(nodes.column("kind"), KIND_COMM)
    op = nodes.column("op")
    is_send = pc.and_(is_comm, pc.equal(op, "send")).to_numpy(zero_copy_only=False)
    is_recv = pc.and_(is_comm, pc.equal(op, "recv")).to_numpy(zero_copy_only=False)
    rows = np.flatnonzero(is_send | is_recv)  # the sends and recvs alone, in row order
    empty = np.zeros(0, dtype=np.int64)
    if not len(rows):
        return (empty, empty, empty, empty) if unmatched else (empty, empty)
    recv = is_recv[rows]
    del is_send, is_recv
    rank, index, group, peer = (
        nodes.column(c).to_numpy()[rows].astype(np.int64) for c in ("rank", "index", "group", "peer")
    )
    flag = recv.astype(np.int64)
    # ordinal per (rank, group, peer, direction), in program order
    k = ordinal([rank, group, peer, flag], index, np.ones(len(rows), dtype=bool))
    a = np.where(recv, peer, rank)  # sender
    b = np.where(recv, rank, peer)  # receiver
    o = np.lexsort((flag, k, b, a, group))
    a, b, g, k, flag, sorted_rows = a[o], b[o], group[o], k[o], flag[o], rows[o]
    pair = (
        (a[1:] == a[:-1])
        & (b[1:] == b[:-1])
        & (g[1:] == g[:-1])
        & (k[1:] == k[:-1])
        & (flag[:-1] == 0)
        & (flag[1:] == 1)
    )
    send_rows, recv_rows = sorted_rows[:-1][pair], sorted_rows[1:][pair]
    if not unmatched:
        node_id = nodes.column("node_id").to_numpy()
        return node_id[send_rows], node_id[recv_rows]
    matched = np.zeros(len(rows), dtype=bool)
    matched[o[:-1][pair]] = True
    matched[o[1:][pair]] = True
    return send_rows, recv_rows, rows[~recv & ~matched], rows[recv & ~matched]


def ordinal(keys: list[np.ndarray], pos: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """For rows in ``mask``: their rank (0, 1, ...) among rows with equal keys, by ``pos``."""
    out = np.full(len(pos), -1, dtype=np.int64)
    idx = np.flatnonzero(mask)
    if not len(idx):
        return out
    sub = [k[idx] for k in keys]
    order = np.lexsort([pos[idx]] + sub[::-1])
    starts = run_starts([k[order] for k in sub])
    run_id = np.cumsum(starts) - 1
    first = np.flatnonzero(starts)
    ordinal = np.arange(len(idx)) - first[run_id]
    out[idx[order]] = ordinal
    return out


def run_starts(sorted_keys: list[np.ndarray]) -> np.ndarray:
    """Boolean: True where a run of equal key tuples starts (keys already sorted)."""
    n = len(sorted_keys[0])
    starts = np.zeros(n, dtype=bool)
    if n:
        starts[0] = True
        for k in sorted_keys:
            starts[1:] |= k[1:] != k[:-1]
    return starts
