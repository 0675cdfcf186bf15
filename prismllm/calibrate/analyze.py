"""What a solved graph says: iteration times, the critical path, busy/idle time per rank, and the
pipeline bubble. Definitions in docs/commands/calibrate.md; everything but the critical-path walk is
vectorised over node positions (the walk visits one node per step of the path).

Time accounting of one rank (all from the solved times): between the moment its host passed
the previous node (``prev``) and the moment it passes this one (``return``), a node position
contributes

- a *gap* ``start - prev``: the node is a wait point and the rank stalls until the awaited
  asynchronous op completes;
- its *own* time ``return - start``: compute (its duration), a non-blocking call's issue, or a
  blocking call's wait until the op (or its coalesced batch) completes.

A stall (gap, or own time of a blocking call) ends when a determining instance ends; the part
of it after that instance started (``end - max(stall start, instance start)``) is *exposed
communication*; the part before is *idle*: waiting for peers to arrive. Idle on a send/recv
instance is *P2P wait*, the pipeline bubble.
"""

from __future__ import annotations

import numpy as np

from prismllm.replay import INST_P2P, Solution, ranges

_I64 = np.int64


# ---------------------------------------------------------------------- helpers
def _last_per_segment(values: np.ndarray, seg: np.ndarray, ptr: np.ndarray, items: np.ndarray) -> np.ndarray:
    """For each CSR segment (``ptr``), the item whose value is largest (ties: the later one)."""
    if not len(items):
        return np.zeros(len(ptr) - 1, dtype=_I64)
    o = np.lexsort((values, seg))
    last = ptr[1:] - 1
    out = np.full(len(ptr) - 1, -1, dtype=_I64)
    ok = ptr[1:] > ptr[:-1]
    out[ok] = items[o][last[ok]]
    return out


class Timeline:
    """Solved times laid out for analysis (per node position of the ReplayGraph)."""

    def __init__(self, sol: Solution) -> None:
        g, res = sol.graph, sol.result
        self.sol, self.g, self.res = sol, g, res
        n = g.num_nodes
        self.start = res.start_ns
        self.end = res.end_ns
        self.ret = res.return_ns
        first = np.zeros(n, dtype=bool)
        first[g.off[:-1][g.off[:-1] < g.off[1:]]] = True
        self.first = first
        self.prev = np.where(first, 0, np.r_[0, self.ret[:-1]]).astype(_I64)
        self.inst_start = res.instance_start_ns
        self.inst_end = res.instance_end_ns
        # the instance whose end a comm node's completion is: its own, or for a coalesced
        # batch the member instance that ended last
        det = g.inst_of.copy()
        if g.num_batches:
            bn = g.batch_nodes
            seg = np.repeat(np.arange(g.num_batches), g.batch_size)
            best = _last_per_segment(self.inst_end[g.inst_of[bn]], seg, g.batch_ptr, bn)
            det[bn] = g.inst_of[best[seg]]
        self.det_inst = det
        # per node: the awaited async node whose completion is latest (-1 without waits)
        nw = np.diff(g.wait_ptr)
        has = np.flatnonzero(nw)
        self.wait_on = np.full(n, -1, dtype=_I64)
        if len(has):
            src = g.wait_src[ranges(g.wait_ptr[has], nw[has])]
            seg = np.repeat(np.arange(len(has)), nw[has])
            ptr = np.r_[0, np.cumsum(nw[has])]
            self.wait_on[has] = _last_per_segment(self.end[src], seg, ptr, src)

    # ------------------------------------------------------------------ accounting
    def accounting(self) -> dict[str, np.ndarray]:
        """Per rank x iteration (``graph.ranks`` x ``graph.iterations``): span, compute,
        exposed communication (issue included), idle, P2P wait. -1 span where the rank has no
        node of that iteration."""
        g = self.g
        gap = np.where(self.first, 0, self.start - self.prev)
        own = self.ret - self.start
        n = g.num_nodes
        exposed = np.zeros(n, dtype=_I64)
        idle = np.zeros(n, dtype=_I64)
        p2p = np.zeros(n, dtype=_I64)
        compute = np.where(g.is_comm, 0, own)
        # stalls at wait points
        st = np.flatnonzero((gap > 0) & (self.wait_on >= 0))
        if len(st):
            inst = self.det_inst[self.wait_on[st]]
            e = np.clip(self.start[st] - np.maximum(self.prev[st], self.inst_start[inst]), 0, gap[st])
            exposed[st] += e
            idle[st] += gap[st] - e
            p2p[st] += np.where(g.inst_kind[inst] == INST_P2P, gap[st] - e, 0)
        # (a gap without a wait cannot happen; count it as idle if it does)
        odd = np.flatnonzero((gap > 0) & (self.wait_on < 0))
        idle[odd] += gap[odd]
        # blocking calls
        b = np.flatnonzero(g.is_comm & g.blocking)
        if len(b):
            inst = self.det_inst[b]
            e = np.clip(self.ret[b] - np.maximum(self.start[b], self.inst_start[inst]), 0, own[b])
            exposed[b] += e
            idle[b] += own[b] - e
            p2p[b] += np.where(g.inst_kind[inst] == INST_P2P, own[b] - e, 0)
        nb = np.flatnonzero(g.is_comm & ~g.blocking)
        exposed[nb] += own[nb]
        its = g.iterations
        nr, nk = len(g.ranks), len(its)
        k = np.searchsorted(its, g.iteration)
        inside = (k < nk) & (g.iteration == its[np.minimum(k, max(nk - 1, 0))]) if nk else np.zeros(n, bool)
        key = g.rank_pos[inside] * nk + k[inside]

        def per(x: np.ndarray) -> np.ndarray:
            return (
                np.bincount(key, weights=x[inside].astype(np.float64), minlength=nr * nk).astype(_I64).reshape(nr, nk)
            )

        has = np.bincount(key, minlength=nr * nk).reshape(nr, nk) > 0
        span = np.where(has, per(gap + own), -1)
        return {
            "span": span,
            "compute": per(compute),
            "comm_exposed": per(exposed),
            "idle": per(idle),
            "p2p_wait": per(p2p),
            "has": has,
        }

    # ------------------------------------------------------------------ critical path
    def iteration_bounds(self, r: int, k: int) -> tuple[int, int, int]:
        """(begin, finish, last node position) of rank position ``r`` in iteration number ``k``,
        as the engine measures a rank's iteration."""
        g = self.g
        lo, hi = int(g.off[r]), int(g.off[r + 1])
        its = g.iteration[lo:hi]
        last = lo + int(np.searchsorted(its, k, side="right")) - 1
        prev = lo + int(np.searchsorted(its, k - 1, side="right")) - 1
        begin = int(self.ret[prev]) if prev >= lo else int(self.start[lo])
        return begin, int(self.ret[last]), last

    def critical_path(self, k: int) -> dict:
        """The chain of segments that makes iteration ``k`` last as long as it does, walked from
        the end of its slowest rank back to that rank's iteration begin. Segments are contiguous
        in logical time, so their durations add up to the iteration time exactly."""
        g, res = self.g, self.res
        col = int(np.searchsorted(g.iterations, k))
        r = int(np.argmax(res.rank_iteration_ns[:, col]))
        begin, finish, p = self.iteration_bounds(r, k)
        segs: list[tuple[int, int, str, str, int, int]] = []  # (pos, inst, kind, op, start, end)
        came_from = -1
        state, x = "ret", p
        guard = 4 * g.num_nodes + 4 * g.num_instances + 16
        while guard > 0:
            guard -= 1
            t = self.ret[x] if state == "ret" else self.inst_end[x] if state == "inst" else self.start[x]
            if t <= begin:
                break
            if state == "ret":  # at the return of node x: what it did
                if not g.is_comm[x]:
                    segs.append((x, -1, "compute", "compute", int(self.start[x]), int(self.ret[x])))
                    state = "start"
                elif not g.blocking[x]:
                    segs.append((x, -1, "issue", g.op(x), int(self.start[x]), int(self.ret[x])))
                    state = "start"
                else:
                    came_from, x, state = x, int(self.det_inst[x]), "inst"
            elif state == "inst":  # at the end of instance x: its transfer, then its last arrival
                members = g.inst_nodes[g.inst_ptr[x] : g.inst_ptr[x + 1]]
                late = members[self.start[members] == self.inst_start[x]]
                q = came_from if came_from in late.tolist() else int(late[0])
                segs.append(
                    (q, x, "transfer", g.op_names[g.inst_op[x]], int(self.inst_start[x]), int(self.inst_end[x]))
                )
                x, state = q, "start"
            else:  # at the start of node x: what held it
                w = int(self.wait_on[x])
                if self.first[x]:
                    break
                if w >= 0 and self.start[x] > self.prev[x]:
                    came_from, x, state = w, int(self.det_inst[w]), "inst"
                else:
                    x, state = x - 1, "ret"
        out = []
        total = 0
        for pos, _inst, kind, op, s, e in segs:
            s = max(s, begin)
            d = e - s
            if d <= 0:
                continue
            total += d
            out.append(
                {
                    "rank": g.rank_of(pos),
                    "index": int(g.index[pos]),
                    "op": op,
                    "kind": kind,
                    "start_ns": s,
                    "duration_ns": d,
                }
            )
        by_kind: dict[str, int] = {}
        for sgm in out:
            key = "compute" if sgm["kind"] == "compute" else f"{sgm['kind']} {sgm['op']}"
            by_kind[key] = by_kind.get(key, 0) + sgm["duration_ns"]
        return {
            "iteration": int(k),
            "end_rank": int(g.ranks[r]),
            "begin_ns": begin,
            "end_ns": finish,
            "total_ns": int(total),
            "iteration_ns": int(res.rank_iteration_ns[r, col]),
            "ranks_visited": sorted({s["rank"] for s in out}),
            "by_kind": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
            "segments": out,
        }
