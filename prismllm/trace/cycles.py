"""Check 6 of ``validate``: the graph's dependencies (program order, waits, synchronisation)
have no cycle -- a cycle is a deadlock the program would hit -- and name the first one found."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from prismllm.trace.edges import run_starts
from prismllm.trace.graph import TraceError

if TYPE_CHECKING:
    from prismllm.trace.validate import Ctx


def _components(n: int, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Connected components (label = smallest member) by hooking + pointer jumping."""
    parent = np.arange(n, dtype=_index_dtype(n))
    while len(u):
        ru, rv = parent[u], parent[v]
        diff = ru != rv
        if not diff.any():
            break
        u, v, ru, rv = u[diff], v[diff], ru[diff], rv[diff]
        np.minimum.at(parent, np.maximum(ru, rv), np.minimum(ru, rv))
        while True:
            pp = parent[parent]
            if np.array_equal(pp, parent):
                break
            parent = pp
    return parent


def _index_dtype(n: int) -> type:
    """The narrowest integer type for positions below ``n`` (and -1): the cycle check holds a
    dozen arrays of one entry a node, 19 M nodes at 131,072 ranks."""
    return np.int32 if n < 2**31 - 1 else np.int64


def check_cycles(c: Ctx) -> None:
    ro = c.prog_order  # rows in (rank, index) order
    n = c.n
    ix = _index_dtype(2 * n + 1)  # slots and sync components together are at most 2n vertices
    r = c.rank[ro]
    co = c.coalesced[ro]
    new_rank = run_starts([r])
    slot_start = new_rank.copy()
    slot_start[1:] |= (co[1:] < 0) | (co[1:] != co[:-1])
    slot_start[0] = True
    del co
    slot_pos = (np.cumsum(slot_start, dtype=np.int64) - 1).astype(ix)  # slot id of each position
    n_slots = int(slot_pos[-1]) + 1
    rank_first_slot = slot_pos[np.flatnonzero(new_rank)][np.cumsum(new_rank) - 1]
    slot = np.empty(n, dtype=ix)
    slot[ro] = slot_pos
    first_slot = np.empty(n, dtype=ix)
    first_slot[ro] = rank_first_slot
    del rank_first_slot
    slot_rank = np.empty(n_slots, dtype=np.int64)
    slot_rank[slot_pos] = r
    slot_last_row = np.empty(n_slots, dtype=np.int64)
    slot_last_row[slot_pos] = ro  # the last row of each slot wins
    del r

    # vertices: gates 0..n_slots-1, then one per sync component of comm nodes
    comm_rows = np.flatnonzero(c.is_comm)
    su, sv = c.sync_rows
    comp_label = _components(n, su, sv)[comm_rows]
    uniq, comp_idx = np.unique(comp_label, return_inverse=True)
    del comp_label
    vert_of_row = np.full(n, -1, dtype=ix)
    vert_of_row[comm_rows] = n_slots + comp_idx.reshape(-1)
    n_vert = n_slots + len(uniq)
    del uniq, comp_idx

    # edges, with the comm node each one leaves (src_node) or enters (dst_node)
    e_src, e_dst, e_snode, e_dnode = [], [], [], []
    chain = np.flatnonzero(~new_rank[1:] & slot_start[1:]) + 1  # positions starting a slot, not first in rank
    gs = slot_pos[chain]
    del chain, new_rank, slot_start, slot_pos
    e_src.append(gs - 1)
    e_dst.append(gs)
    e_snode.append(np.full(len(gs), -1, dtype=ix))
    e_dnode.append(np.full(len(gs), -1, dtype=ix))
    notfirst = comm_rows[slot[comm_rows] != first_slot[comm_rows]]
    del first_slot
    e_src.append(slot[notfirst] - 1)
    e_dst.append(vert_of_row[notfirst])
    e_snode.append(np.full(len(notfirst), -1, dtype=ix))
    e_dnode.append(notfirst.astype(ix))
    blocking = comm_rows[~c.async_op[comm_rows]]
    e_src.append(vert_of_row[blocking])
    e_dst.append(slot[blocking])
    e_snode.append(blocking.astype(ix))
    e_dnode.append(np.full(len(blocking), -1, dtype=ix))
    del notfirst, blocking, comm_rows
    wu, wv = c.wait_rows
    wsel = c.is_comm[wu]
    wu, wv = wu[wsel], wv[wsel]
    e_src.append(vert_of_row[wu])
    e_dst.append(np.maximum(slot[wv] - 1, slot[wu]))
    e_snode.append(wu.astype(ix))
    e_dnode.append(np.full(len(wu), -1, dtype=ix))
    del slot, vert_of_row, gs, wu, wv
    src = np.concatenate(e_src).astype(ix)
    dst = np.concatenate(e_dst).astype(ix)
    del e_src, e_dst

    remaining = _kahn(n_vert, src, dst)
    if remaining is None:
        return
    snode = np.concatenate(e_snode).astype(np.int64)
    dnode = np.concatenate(e_dnode).astype(np.int64)
    cyc = _find_cycle(remaining, src, dst)
    raise TraceError(_cycle_message(c, cyc, src, dst, snode, dnode, n_slots, slot_rank, slot_last_row))


def _kahn(n_vert: int, src: np.ndarray, dst: np.ndarray) -> np.ndarray | None:
    """Topological sort frontier by frontier; None if acyclic, else a bool mask of the
    vertices left over (those on a cycle or behind one)."""
    indeg = np.bincount(dst, minlength=n_vert).astype(dst.dtype)
    col = dst[np.argsort(src, kind="stable")]
    indptr = np.r_[0, np.cumsum(np.bincount(src, minlength=n_vert))]
    frontier = np.flatnonzero(indeg == 0)
    done = 0
    while len(frontier):
        done += len(frontier)
        s = indptr[frontier]
        cnt = indptr[frontier + 1] - s
        total = int(cnt.sum())
        if not total:
            break
        idx = np.repeat(s - (np.cumsum(cnt) - cnt), cnt) + np.arange(total)
        u, k = np.unique(col[idx], return_counts=True)
        indeg[u] -= k
        frontier = u[indeg[u] == 0]
    if done == n_vert:
        return None
    return indeg > 0


def _find_cycle(remaining: np.ndarray, src: np.ndarray, dst: np.ndarray) -> list[int]:
    """Edge indices of one cycle among the remaining vertices (each has a remaining predecessor)."""
    live = np.flatnonzero(remaining[src] & remaining[dst])
    pred_edge = np.full(len(remaining), -1, dtype=np.int64)
    pred_edge[dst[live]] = live
    v = int(np.flatnonzero(remaining)[0])
    seen: dict[int, int] = {}
    path: list[int] = []
    while v not in seen:
        seen[v] = len(path)
        e = int(pred_edge[v])
        path.append(e)
        v = int(src[e])
    cycle = path[seen[v] :]
    return cycle[::-1]  # forward order


def _cycle_message(c, cyc, src, dst, snode, dnode, n_slots, slot_rank, slot_last_row) -> str:
    # walk forward: for each sync vertex, the node the cycle enters it by and the node it leaves by
    k = len(cyc)
    steps = []
    for j in range(k):
        e_in, e_out = cyc[j], cyc[(j + 1) % k]
        v = dst[e_in]
        if v >= n_slots:  # a sync instance
            steps.append((int(dnode[e_in]), int(snode[e_out])))
    if not steps:  # a cycle through gates only cannot happen; be safe
        g = int(dst[cyc[0]])
        i = int(slot_last_row[g]) if g < n_slots else 0
        return f"dependency cycle at {c.node(i)}; the graph is corrupt: re-assemble it"
    # dependency order: leave_k waits for enter_k, which its rank issues only after leave_{k-1}
    chain = list(reversed(steps))  # (enter, leave) pairs
    first_leave = chain[0][1]
    ring = ""
    for j, (enter, leave) in enumerate(chain[:6]):
        if j:
            prev = chain[j - 1][0]
            ring += f", which rank {c.rank[prev]} issues only after {c.node(leave)} completes"
        else:
            ring += c.node(leave)
        if enter < 0 or enter == leave:
            ring += ", which never completes"
            break
        ring += f", which waits for rank {c.rank[enter]} node {c.index[enter]} ({c.op(enter)})"
    tail = "" if len(chain) <= 6 else f" ... ({len(chain)} steps)"
    last_enter = chain[min(len(chain), 6) - 1][0]
    close = ""
    if len(chain) <= 6 and last_enter >= 0 and first_leave >= 0 and last_enter != first_leave:
        close = f", which rank {c.rank[last_enter]} issues only after the first"
    return (
        f"deadlock: {ring}{tail}{close}. The ranks wait on each other; issue matching send/recv "
        f"and collectives in the same order on every rank (e.g. send first on one side, or "
        f"batch_isend_irecv / async ops waited on later)"
    )
