"""Which of the external ranks' completions each call with them waits behind: the dependency a
real-time replay follows when a real completion comes late or early.

In a replay with external ranks (an emulation: the sandbox's real ranks), every instance with
an external member is a call the virtual members enter for real. When one of those calls
completes later than planned, not every later call of the virtual ranks moves: a virtual rank
that issued an asynchronous call goes on computing (DDP's next bucket, FSDP's next prefetch)
and is held back only where it *waits* for that call -- a blocking call, or the wait point of
an asynchronous one. So for each external instance ``j`` this module finds its *gates*: for
each virtual member, the external instances whose completion it last waited on before it
arrives at ``j`` (the last blocking external call before it, and the external calls waited on
at the last wait point at or before it; a coalesced batch completes as a whole, so all its
external instances). The real-time schedule then enters ``j`` at its planned time moved by how
late its gates came (``prismllm.assistant.clock``), each gate's lateness less what the member
waited, by the plan, after it (its *offset*: the slack that absorbs an early or late completion
before it reaches ``j``). Without offsets an old gate was a floor: a pipeline's blocking shape
exchange in iteration 0 held its virtual stage to that call's lateness in every later iteration,
so it never followed a sandbox that ran ahead of its calibrated pace.

One hop: a lateness that reaches a virtual rank only through another virtual rank (a virtual
peer that waited on the sandbox, then on which this one waits) is not followed; the direct
gates of pipeline stages and data-parallel replicas, which wait on the sandbox themselves, are.
"""

from __future__ import annotations

import numpy as np

from prismllm.replay.engine import ReplayResult
from prismllm.replay.graph import ReplayGraph, _csr, ranges

_I64 = np.int64


def _last_at_or_before(mask: np.ndarray, first_of_rank: np.ndarray) -> np.ndarray:
    """Per position p: the last position q <= p on p's rank with ``mask[q]``, else -1."""
    pos = np.where(mask, np.arange(len(mask), dtype=_I64), -1)
    last = np.maximum.accumulate(pos) if len(pos) else pos
    return np.where(last >= first_of_rank, last, -1)


def planned_idle(result: ReplayResult, transfer_ns: np.ndarray) -> np.ndarray:
    """Per node position of a finished replay, cumulative: the time its rank waited, by the plan,
    at or before it (for another rank or a call: the gap before a node starts, and inside a
    blocking call what is not the call's ``transfer_ns``, per instance). ``S[p] - S[q]`` on one
    rank is how long it waited after position ``q`` up to ``p``: how much of a lateness at ``q``
    those waits absorb."""
    g = result.graph
    prev = np.r_[0, result.return_ns[:-1]]
    idle = np.where(np.arange(g.num_nodes) > g.off[g.rank_pos], np.maximum(result.start_ns - prev, 0), 0)
    blocking = np.flatnonzero(g.blocking & (g.inst_of >= 0))
    inside = result.end_ns[blocking] - result.start_ns[blocking] - transfer_ns[g.inst_of[blocking]]
    idle[blocking] += np.maximum(inside, 0)
    return np.cumsum(idle)  # across ranks: only differences within a rank are read


def external_gates(graph: ReplayGraph, idle: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """CSR over instances: ``gates[ptr[j]:ptr[j + 1]]`` are the external instances the virtual
    members of instance ``j`` last waited on before arriving at it (sorted, without ``j``),
    empty for an instance that is not external or whose members waited on none, and
    ``offsets[ptr[j]:ptr[j + 1]]`` what a member waited, by the plan, between waiting on each
    up to its later wait with the sandbox (from :func:`planned_idle` of the plan; 0 without
    ``idle``): of a member's two gates (its last blocking call with the sandbox, its last wait
    point on calls with it) the later one counts in full, the older one less the waits since,
    which absorb its lateness, not as a floor (an iteration-0 blocking call, the pipeline's shape
    exchange, held a virtual stage to its lateness in every later iteration)."""
    g = graph
    n, ni = g.num_nodes, g.num_instances
    if not n or not ni:
        return np.zeros(ni + 1, dtype=_I64), np.zeros(0, dtype=_I64), np.zeros(0, dtype=_I64)
    ext_node = g.is_comm & (g.inst_of >= 0)
    ext_node[ext_node] = g.inst_external[g.inst_of[ext_node]]
    first = g.off[g.rank_pos]
    # a blocking external call gates the positions after it; a wait point on an external call gates itself
    after = _last_at_or_before(g.blocking & ext_node, first)
    blocking_before = np.r_[-1, after[:-1]]
    blocking_before = np.where(blocking_before >= first, blocking_before, -1)
    wn = np.diff(g.wait_ptr)
    src = g.wait_src
    src_ext = ext_node[src]
    ext_waits = np.zeros(n, dtype=bool)
    if len(src):
        np.logical_or.at(ext_waits, np.repeat(np.arange(n), wn), src_ext)
    waited = _last_at_or_before(ext_waits, first)
    # the members of every external instance, and the gate positions each points at
    ext = np.flatnonzero(g.inst_external)
    cnt = g.inst_ptr[ext + 1] - g.inst_ptr[ext]
    members = g.inst_nodes[ranges(g.inst_ptr[ext], cnt)]
    inst = np.repeat(ext, cnt)
    # (instance j, a node whose completion gates it, where the member waited on it, the member's
    # later wait of the two)
    pairs = []
    qa = blocking_before[members]
    qb = waited[members]
    last = np.maximum(qa, qb)
    ok = qa >= 0
    pairs.append((inst[ok], qa[ok], qa[ok], last[ok]))
    ok = qb >= 0
    if ok.any():
        jb, qw, lb = inst[ok], qb[ok], last[ok]
        c = wn[qw]
        srcs = src[ranges(g.wait_ptr[qw], c)]
        keep = ext_node[srcs]
        pairs.append((np.repeat(jb, c)[keep], srcs[keep], np.repeat(qw, c)[keep], np.repeat(lb, c)[keep]))
    j, q, w, lw = (np.concatenate([p[k] for p in pairs]) for k in range(4))
    # a batched call completes with its batch: every external op of the batch gates
    bq = g.batch_of[q]
    inb = bq >= 0
    if inb.any():
        bc = g.batch_ptr[bq[inb] + 1] - g.batch_ptr[bq[inb]]
        mates = g.batch_nodes[ranges(g.batch_ptr[bq[inb]], bc)]
        keep = ext_node[mates]

        def spread(x: np.ndarray) -> np.ndarray:  # each batched pair once per op of its batch
            return np.r_[x[~inb], np.repeat(x[inb], bc)[keep]]

        j, w, lw, q = spread(j), spread(w), spread(lw), np.r_[q[~inb], mates[keep]]
    gate = g.inst_of[q]
    # the waits after it up to the later of the two (the later one's own wait included)
    offset = idle[lw] - idle[w] if idle is not None else np.zeros(len(w), dtype=_I64)
    keep = gate != j
    j, gate, offset = j[keep], gate[keep], offset[keep]
    # one entry per (instance, gate): the member that waited least since counts
    order = np.lexsort((offset, gate, j))
    j, gate, offset = j[order], gate[order], offset[order]
    firsts = np.r_[True, (j[1:] != j[:-1]) | (gate[1:] != gate[:-1])] if len(j) else np.zeros(0, dtype=bool)
    j, gate, offset = j[firsts], gate[firsts], offset[firsts]
    ptr, order = _csr(j, ni)
    return ptr, gate[order], offset[order].astype(_I64)


__all__ = ["external_gates", "planned_idle"]
