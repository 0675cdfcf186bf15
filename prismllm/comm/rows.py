"""A recorder's nodes and iterations as RankLog rows (after ``Recorder.finish``): compute spans
between points, communication rows with their times on the host clock (device times mapped
through the anchors; NCCL's own durations where known)."""

from __future__ import annotations

from typing import Any

from prismllm.comm.recorder import Recorder, redop_name


def node_rows(rec: Recorder) -> list[dict[str, Any]]:
    """Every node as a RankLog row (after ``finish``)."""
    if rec.replayed is not None:
        return node_rows(rec.replayed)
    rank = rec.rank
    p_host, p_ns = rec.p_host, rec.p_ns
    out = []
    stream_end: dict[str, int] = {}
    for idx, (kind, k) in enumerate(zip(rec.n_kind, rec.n_sub)):
        if kind == 0:
            p0, p1 = rec.c_p0[k], rec.c_p1[k]
            start = p_ns[p0] if p0 >= 0 else -1
            end = p_ns[p1] if p1 >= 0 else -1
            if 0 <= end < start:  # its two points were on different streams
                end = start
            out.append({
                "rank": rank, "index": idx, "iteration": rec.c_iter[k], "kind": "compute",
                "op": "compute", "group_name": "", "seq": -1, "peer": -1, "tag": 0,
                "reduce_op": "", "dtype": "", "shape": [], "in_bytes": 0, "out_bytes": 0,
                "in_splits": [], "out_splits": [], "coalesced": -1, "async_op": False,
                "api": "", "stream": "compute", "wait_index": -1,
                "issue_ns": p_host[p0] if p0 >= 0 else -1, "start_ns": start,
                "end_ns": end, "duration_ns": end - start if start >= 0 <= end else -1,
                "label": rec.c_label[k],
            })  # fmt: skip
            continue
        grp = rec.m_group[k]
        stream = "comm:" + grp
        start, end, dur = _comm_times(rec, k, stream_end, stream)
        p0 = rec.m_p0[k]
        out.append({
            "rank": rank, "index": idx, "iteration": rec.m_iter[k], "kind": "comm",
            "op": rec.m_op[k], "group_name": grp, "seq": rec.m_seq[k],
            "peer": rec.m_peer[k], "tag": rec.m_tag[k],
            "reduce_op": redop_name(rec.m_red[k]), "dtype": rec.m_dtype[k],
            "shape": list(rec.m_shape[k]), "in_bytes": rec.m_in[k],
            "out_bytes": rec.m_out[k], "in_splits": list(rec.m_insp[k]),
            "out_splits": list(rec.m_outsp[k]), "coalesced": rec.m_coal[k],
            "async_op": bool(rec.m_async[k]), "api": rec.m_api[k], "stream": stream,
            "wait_index": rec.m_wait[k], "issue_ns": p_host[p0] if p0 >= 0 else -1,
            "start_ns": start, "end_ns": end, "duration_ns": dur, "label": rec.m_label[k],
        })  # fmt: skip
    return out


def _comm_times(rec: Recorder, k: int, stream_end: dict[str, int], stream: str):
    """(start, end, duration) of communication row ``k`` on the host clock."""
    p0, p1 = rec.m_p0[k], rec.m_p1[k]
    dur = rec.m_dur[k]
    ns = rec.p_ns
    if rec.m_cuda[k] and p0 >= 0 and rec.p_dev[p0] >= 0:
        # Device clock: it starts when the stream reached the issue point, or when the
        # previous op on this group's stream ended; it ends after NCCL's own duration if
        # known, else where the program's stream resumed after the wait.
        start = max(ns[p0], stream_end.get(stream, -1))
        if dur >= 0:
            end = start + dur
        elif p1 >= 0 and ns[p1] >= 0:
            end = max(ns[p1], start)
        else:
            end = -1
        if end >= 0:
            stream_end[stream] = end
        return start, end, (end - start if end >= 0 else -1)
    # Host clock: from the call to its completion (Future callback) or the wait's return.
    start = rec.p_host[p0] if p0 >= 0 else -1
    end = rec.p_host[p1] if p1 >= 0 else -1
    done = rec.m_done[k]
    if done >= 0 and (end < 0 or done < end):
        end = done
    if 0 <= end < start:
        end = start
    return start, end, (end - start if end >= 0 and start >= 0 else -1)


def iteration_rows(rec: Recorder) -> list[dict[str, Any]]:
    if rec.replayed is not None:
        return iteration_rows(rec.replayed)
    ns = rec.p_ns
    return [{"iteration": i, "start_ns": ns[s], "end_ns": ns[e], "label": lab} for i, s, e, lab in rec.iterations]
