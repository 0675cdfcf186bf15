"""What a recording rank says of itself in a status report (``prismllm.launch.status``): the
call it waits on, the calls not yet waited, its last call. Read from the reporter's thread,
under the GIL."""

from __future__ import annotations

import time

from prismllm.comm.recorder import Recorder

_now = time.time_ns


def call_words(index: int, op: str, group: str, peer: int) -> str:
    """'call 3 recv on group '0' from rank 1': one call in a status report (prismllm.launch.status);
    ``peer`` is a send's destination, a recv's source, a rooted op's root (-1: none)."""
    to = {"send": "to", "recv": "from"}.get(op, "root")
    return f"call {index} {op} on group {group!r}" + (f" {to} rank {peer}" if peer >= 0 else "")


def _call_text(rec: Recorder, j: int, now: int) -> str:
    age = (now - rec.p_host[rec.m_p0[j]]) / 1e9
    return (
        call_words(j, rec.m_op[j], rec.m_group[j], rec.m_peer[j])
        + f" (seq {rec.m_seq[j]}, {rec.m_api[j]}), issued {age:.1f} s ago"
    )


def status_lines(rec: Recorder) -> list[str]:
    """Where the rank stands in its communication: the call it waits on, the calls not
    yet waited, its last call."""
    if rec.native is not None:
        return _native_status_lines(rec)
    n = len(rec.m_op)
    if not n:
        return ["no communication call yet"]
    now = _now()
    lines = [f"{n} call(s) so far, in iteration {rec.iteration}"]
    waiting = rec.waiting
    if waiting is not None:
        lines.append("waiting on " + "; ".join(_call_text(rec, j, now) for j in waiting._rows))
    open_rows = [j for w in list(rec.outstanding.values()) if w is not waiting for j in w._rows]
    if open_rows:
        lines.append(
            f"{len(open_rows)} call(s) issued, not yet waited; the oldest: " + _call_text(rec, min(open_rows), now)
        )
    if waiting is None or waiting._rows[-1] != n - 1:
        lines.append("last: " + _call_text(rec, n - 1, now))
    return lines


def _native_status_lines(rec: Recorder) -> list[str]:
    st = rec.native.status()
    groups = rec.native.group_table(rec.groups)
    ops = rec.native.OPS

    def text(row) -> str:
        k, op, gid, peer = row
        return call_words(k, ops[op], groups.get(gid, (f"gid{gid}",))[0], peer)

    lines = [f"{st['calls']} call(s), {st['waits']} wait(s), {st['boundaries']} iteration boundaries so far"]
    if st["waiting"] is not None:
        lines.append("waiting on " + text(st["waiting"]))
    if st["last"] is not None and st["last"] != st["waiting"]:
        lines.append("last: " + text(st["last"]))
    return lines
