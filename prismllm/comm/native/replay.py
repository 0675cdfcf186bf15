"""Turn the native recording backend's log into RankLog nodes, at exit.

The log (``recording_backend.cpp``) holds the rank's points (host time, resolved device time)
and its entries in program order. :class:`ReplayRecorder` is the Python :class:`Recorder`
driven by those entries instead of live calls: each entry calls the method the Python
recording path would have called at that moment, and every point that method takes is the
one the backend took then. So the node model's rules (sync and async calls, settled waits,
coalescing scopes, boundaries, labels) are the Recorder's, in one place, for both paths.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch.distributed as dist

from prismllm.comm.recorder import ST_PENDING, ST_WAITED, Recorder, dtype_name

# Entry types (recording_backend.cpp, enum EntryType)
E_START, E_CALL, E_WAIT, E_COAL_BEGIN, E_COAL_END, E_BATCH = 0, 1, 2, 3, 4, 5
E_BWD_END, E_BOUNDARY, E_MARK, E_FINISH, E_COAL_START = 6, 7, 8, 9, 10
F_SYNC, F_FIRST_BWD = 1, 2

_RED_NAMES = {int(v.value): k.lower() for k, v in dist.ReduceOp.RedOpType.__members__.items()}


def red_name(code: int, factor: float | None) -> str:
    """A row's reduction as the graph names it: "" for none, "premul_sum:<factor>" with its factor
    (recorder.redop_name's form)."""
    if code < 0:
        return ""
    name = _RED_NAMES.get(code, "")
    return f"{name}:{factor!r}" if factor is not None else name


class NativeLogError(RuntimeError):
    """The log and the Recorder's rules disagree (a defect of prism, not of the program)."""


class _Completed:
    """The real Work as the Recorder sees it at replay: complete, with NCCL's duration."""

    def __init__(self, dur_ns: int):
        self._dur_ns = dur_ns

    def is_completed(self) -> bool:
        return True

    def _get_duration(self) -> float:
        if self._dur_ns == -3:
            raise RuntimeError("NCCL timing was not enabled")
        return self._dur_ns / 1e6 if self._dur_ns > 0 else 0.0


class _Work:
    """What the Recorder keeps of a Work: its rows and state."""

    _anysource = False
    _on_wait = None

    def __init__(self, rows: tuple, done_ns: int, dur_ns: int):
        self._rows = rows
        self._state = ST_PENDING
        self._inner = _Completed(dur_ns)
        self.done_ns = done_ns


class ReplayRecorder(Recorder):
    """A Recorder whose points come from the log (see the module docstring)."""

    def __init__(self, live: Recorder, log: dict[str, Any]):
        super().__init__(live.rank, live.world_size)
        self.cuda = live.cuda
        self.durations_ok = live.durations_ok  # off: the log holds no NCCL time (prism emulate)
        self.all_points_on_device = live.all_points_on_device  # off: device points at boundaries only
        self.groups = live.groups
        self.explicit_steps = False
        self._log_host = log["p_host"]
        self._log_ns = log["p_ns"]
        self._log_dev = log["p_dev"]
        self._pts: deque[int] = deque()  # points the next Recorder call takes, in order
        self._rets: deque[int] = deque()  # ... and the host point where its call returned
        self._first_bwd = False
        self._watch: list[tuple] = []  # rows whose completion the Recorder watches (host clock)
        self._made: dict[int, int] = {}  # log point -> this recorder's point id

    # ---- points come from the log ----
    def _materialize(self, lp: int) -> int:
        pid = self._made.get(lp)
        if pid is None:
            pid = len(self.p_host)
            dev = self._log_dev[lp]
            self.p_host.append(self._log_host[lp])
            self.p_ns.append(self._log_ns[lp])
            self.p_dev.append(dev)
            self.p_ev.append(None)
            if dev >= 0:
                self.cuda_live = True
            self._made[lp] = pid
        return pid

    def point(self, boundary: bool = False) -> int:  # the log already holds where it was taken
        if not self._pts:
            raise NativeLogError(f"rank {self.rank}: the Recorder takes a point the log lacks")
        return self._materialize(self._pts.popleft())

    def _ret_point(self) -> int:
        if not self._rets:
            raise NativeLogError(f"rank {self.rank}: a call's return point is missing from the log")
        return self._materialize(self._rets.popleft())

    def _check_backward(self) -> None:
        if self._first_bwd:
            self.bwd_cb_queued = True

    def _watch_completion(self, inner: Any, rows: tuple) -> None:
        self._watch.append(rows)

    def _feed(self, pts=(), rets=()) -> None:
        self._pts.clear()
        self._rets.clear()
        self._pts.extend(p for p in pts if p >= 0)
        self._rets.extend(p for p in rets if p >= 0)


def group_table(groups: list[Any]) -> dict[int, tuple[str, list[int]]]:
    """gid of each native backend -> (group name, global ranks)."""
    table: dict[int, tuple[str, list[int]]] = {}
    for pg in groups:
        for dev in pg._device_types:
            be = pg._get_backend(dev)
            gid = getattr(be, "gid", None)
            if gid is not None and gid not in table:
                table[gid] = (pg.group_name, list(be.global_ranks))
    return table


class NativeSession:
    """The native backend as the live Recorder drives it (``Recorder.native``): the module's
    calls (start, mark, boundary, status, self_time, ...), the groups it records, and at exit
    the replay of its log."""

    def __init__(self, module: Any):
        self.module = module

    def __getattr__(self, name: str) -> Any:
        return getattr(self.module, name)

    def group_table(self, groups: list[Any]) -> dict[int, tuple[str, list[int]]]:
        return group_table(groups)

    def replay_into(self, live: Recorder) -> ReplayRecorder:
        """End the log and replay it through a Recorder (returned, finished)."""
        self.module.finish()
        return replay(live, self.module.export())


def replay(live: Recorder, log: dict[str, Any]) -> ReplayRecorder:
    """Replay ``log`` (``native.export()``) through a Recorder; returns it (finished)."""
    mod = live.native.module
    ops, apis = list(mod.OPS), list(mod.APIS)
    rec = ReplayRecorder(live, log)
    groups = group_table(live.groups)
    rows, lists, works_log, labels = log["rows"], log["lists"], log["works"], log["labels"]
    factors = log["factors"]
    works: dict[int, _Work] = {}
    seq: dict[str, int] = {}
    p2p: dict[tuple[str, int, str], int] = {}
    coal_async: list[Any] = []

    def work_of(wid: int, rws: tuple) -> _Work:
        done, dur = works_log[wid]
        w = works[wid] = _Work(rws, done, dur)
        return w

    def next_p2p(g: str, peer: int, op: str) -> int:
        key = (g, peer, op)
        s = p2p.get(key, 0)
        p2p[key] = s + 1
        return s

    for et, flag, a, b, c, p0, p1, p2 in log["entries"]:
        if et == E_CALL:
            first = -1
            out = []
            rec._first_bwd = bool(flag & F_FIRST_BWD)
            for k in range(a, a + b):
                op_c, api_c, red, dt, cuda, gid, peer, tag, inb, outb = rows[k]
                shape, insp, outsp = lists[k]
                gname = groups.get(gid, (f"gid{gid}", []))[0]
                op = ops[op_c]
                api = apis[api_c]
                if op in ("send", "recv"):
                    s = -1 if api == "recv_anysource" else next_p2p(gname, peer, op)
                else:
                    s = seq.get(gname, 0)
                    seq[gname] = s + 1
                rec._feed((p0,), (p1,) if first < 0 else ())
                j = rec.issue(
                    op, api, gname, s, peer, tag, red_name(red, factors.get(k)),
                    dtype_name(dt) if dt is not None else "", shape, inb, outb, insp, outsp,
                    bool(cuda), first,
                )  # fmt: skip
                if first < 0:
                    first = j
                out.append(j)
            rws = tuple(out)
            w = work_of(c, rws) if c >= 0 else None
            rec._watch = []
            rec._feed((p2,), (p1,))
            rec.issued(w, rws, bool(flag & F_SYNC))
            for wr in rec._watch:
                for j in wr:
                    if rec.m_done[j] < 0 and w is not None and w.done_ns >= 0:
                        rec.m_done[j] = w.done_ns
        elif et == E_WAIT:
            w = works.get(c)
            if w is None:
                raise NativeLogError(f"rank {rec.rank}: a wait on Work {c} that no call returned")
            if w._state == ST_WAITED:
                continue
            if rec.pending_sync is w:
                rec._feed((p1,))
            else:
                if p0 < 0:
                    raise NativeLogError(f"rank {rec.rank}: Work {c}'s wait has no point before it")
                rec._feed((p0, p1))
            rec.wait(w, _nothing, ())
            if b >= 0:  # the source of an any-source recv, known once it completed
                for j in w._rows:
                    rec.m_peer[j] = b
                    rec.m_seq[j] = next_p2p(rec.m_group[j], b, "recv")
        elif et == E_COAL_START:
            rec.begin_coalesce()
        elif et == E_COAL_BEGIN:
            rec.begin_coalesce()
            coal_async.append(rec.coal_async if flag >= 0 else None)
            if flag >= 0:
                rec.coal_async = bool(flag)
        elif et == E_COAL_END:
            prev = coal_async.pop() if coal_async else None
            if prev is not None:
                rec.coal_async = prev
            rec.end_coalesce()
        elif et == E_BATCH:
            rws = rec.end_coalesce()
            rec._feed((p2,))
            if c < 0:
                rec.complete_rows(rws)
            else:
                w = work_of(c, tuple(rws))
                rec.bind_batch(w, rws)
        elif et == E_BWD_END:
            rec._feed((p0,))
            rec._settle_backward()
        elif et == E_BOUNDARY:
            rec._feed((p0,))
            Recorder.boundary(rec, explicit=bool(flag))
        elif et == E_MARK:
            rec._feed((p0,))
            Recorder.mark(rec, str(labels[a]))
        elif et == E_START:
            rec._feed((p0,))
            rec.start()
        elif et == E_FINISH:
            rec._feed((p0,))
            rec.finish()
    if not rec.finished:
        raise NativeLogError(f"rank {rec.rank}: the log has no end")
    return rec


def _nothing() -> None:
    return None
