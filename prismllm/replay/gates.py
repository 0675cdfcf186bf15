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
late its gates came (``prismllm.assistant.clock``).

One hop: a lateness that reaches a virtual rank only through another virtual rank (a virtual
peer that waited on the sandbox, then on which this one waits) is not followed; the direct
gates of pipeline stages and data-parallel replicas, which wait on the sandbox themselves, are.
"""

from __future__ import annotations

import numpy as np

from prismllm.replay.graph import ReplayGraph, _csr, ranges

_I64 = np.int64


def _last_at_or_before(mask: np.ndarray, first_of_rank: np.ndarray) -> np.ndarray:
    """Per position p: the last position q <= p on p's rank with ``mask[q]``, else -1."""
    pos = np.where(mask, np.arange(len(mask), dtype=_I64), -1)
    last = np.maximum.accumulate(pos) if len(pos) else pos
    return np.where(last >= first_of_rank, last, -1)


def external_gates(graph: ReplayGraph) -> tuple[np.ndarray, np.ndarray]:
    """CSR over instances: ``gates[ptr[j]:ptr[j + 1]]`` are the external instances the virtual
    members of instance ``j`` last waited on before arriving at it (sorted, without ``j``);
    empty for an instance that is not external or whose members waited on none."""
    g = graph
    n, ni = g.num_nodes, g.num_instances
    if not n or not ni:
        return np.zeros(ni + 1, dtype=_I64), np.zeros(0, dtype=_I64)
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
    pairs = []  # (instance j, a node whose completion gates it)
    qa = blocking_before[members]
    ok = qa >= 0
    pairs.append((inst[ok], qa[ok]))
    qb = waited[members]
    ok = qb >= 0
    if ok.any():
        j, q = inst[ok], qb[ok]
        c = wn[q]
        srcs = src[ranges(g.wait_ptr[q], c)]
        jj = np.repeat(j, c)
        keep = ext_node[srcs]
        pairs.append((jj[keep], srcs[keep]))
    j = np.concatenate([p[0] for p in pairs])
    q = np.concatenate([p[1] for p in pairs])
    # a batched call completes with its batch: every external op of the batch gates
    bq = g.batch_of[q]
    inb = bq >= 0
    if inb.any():
        bc = g.batch_ptr[bq[inb] + 1] - g.batch_ptr[bq[inb]]
        mates = g.batch_nodes[ranges(g.batch_ptr[bq[inb]], bc)]
        jm = np.repeat(j[inb], bc)
        keep = ext_node[mates]
        j = np.r_[j[~inb], jm[keep]]
        q = np.r_[q[~inb], mates[keep]]
    gate = g.inst_of[q]
    keep = gate != j
    key = np.unique(np.stack([j[keep], gate[keep]]), axis=1) if keep.any() else np.zeros((2, 0), _I64)
    ptr, order = _csr(key[0], ni)
    return ptr, key[1][order]


__all__ = ["external_gates"]
