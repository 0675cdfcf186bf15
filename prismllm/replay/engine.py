"""The replay engine: walk the graphs of virtual ranks in logical time.

An assistant (docs/internals/assistant.md) serves many virtual ranks from one process:
no CUDA context and no process per rank, only an event loop over the graph. This module is
that loop, without any device or network: it computes *when* every node of every virtual rank
starts and ends, given how long compute and transfers take, and it tells a driver (the
assistant) when a communication with a rank it does not simulate (an *external* rank: a
sandbox rank, or a rank another assistant serves) is due, then waits to be told when that
communication completed.

    graph = ReplayGraph(trace)                     # columnar, built once (seconds at 8192 ranks)
    result = Replay(graph).run_to_end()            # ReplayResult: node times, iteration times
    result.predicted_iteration_ns

    rep = Replay(ReplayGraph(trace, external=[3])) # rank 3 runs for real elsewhere
    while not rep.advance().finished:              # advance() returns when blocked on rank 3
        for ev in rep.pending_external():          # all virtual members are in
            rep.external_done(ev.instance, t_end)  # the real collective finished at t_end

Timing model (docs/internals/replay.md has the long form):

- A rank is a cursor over its nodes in program order, with a host clock. A node starts when the
  rank reaches it and every asynchronous operation whose wait point is this node has completed.
- compute: lasts its duration (recorded ``duration_ns``, an override, or zero).
- communication: the rank *arrives* at the op's instance when it reaches the node. An instance
  (collective: same group and seq; P2P: a matched send/recv) starts when its last member
  arrives and ends ``transfer`` later, at the same time for every member. The recorded transfer
  of an instance is the ``duration_ns`` seen by its last-arriving member: a recorded duration
  includes waiting for late peers (docs/internals/replay.md), and only the last member to arrive waited for
  nobody.
- a blocking op holds its rank until the op ends; an asynchronous op lets the rank go on after
  ``issue`` (the host time the call took, measured in the graph as the gap between the op and
  the next node), and its completion gates the node at its ``wait_index``.
- coalesced ops (same rank, same ``coalesced`` id) complete together, when the last of them
  ends; a blocking batch blocks once, at its last op.

Everything is numpy: the loop advances every runnable rank by one node per round (a frontier
step), so the cost is rounds x numpy calls, not nodes x Python statements.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from prismllm.replay.graph import INST_P2P, ReplayError, ReplayGraph, ranges
from prismllm.trace.graph import PrismTrace
from prismllm.trace.summary import WARMUP, steady as steady_of

# A duration source: "graph" (recorded), "zero", an int64 array, or a function of the graph
# returning one (vectorised: one call, never one call per node).
DurationSource = str | np.ndarray | Callable[["ReplayGraph"], np.ndarray]

# Rank states.
_RUN, _BLOCKED, _DONE = 0, 1, 2

_I64 = np.int64


# ---------------------------------------------------------------------- results
@dataclasses.dataclass(frozen=True)
class ExternalEvent:
    """An instance with external members whose virtual members have all arrived: the driver
    should now enter it for real and report its end with :meth:`Replay.external_done`."""

    instance: int
    ready_ns: int  # logical time the last virtual member arrived
    op: str
    group: int  # group id (for P2P, the group the pair was issued on)
    virtual_ranks: tuple[int, ...]
    external_ranks: tuple[int, ...]
    nodes: tuple[int, ...]  # the virtual members' node positions in the ReplayGraph


@dataclasses.dataclass(frozen=True)
class ReplayStatus:
    """What :meth:`Replay.advance` stopped at."""

    finished: bool  # every virtual rank ran its last node and every instance completed
    pending: tuple[ExternalEvent, ...]  # external instances waiting for external_done
    next_ns: int | None  # earliest time of work held back by ``until``; None if none


@dataclasses.dataclass
class ReplayResult:
    """Logical times (ns from the replay's time 0) of a finished replay.

    Per node position (see :class:`ReplayGraph`): ``start_ns`` (compute: begins; comm: the rank
    arrives), ``end_ns`` (compute: ends; comm: completes for this rank, a coalesced batch's
    completion for batched ops), ``return_ns`` (the rank's host goes on: ``end_ns`` except
    for non-blocking comm, where it is start + issue). Per instance: ``instance_start_ns``
    (last arrival) and ``instance_end_ns``. Per rank x iteration (``graph.iterations``):
    ``rank_iteration_ns``, -1 where the rank has no node of that iteration."""

    graph: ReplayGraph
    start_ns: np.ndarray
    end_ns: np.ndarray
    return_ns: np.ndarray
    instance_start_ns: np.ndarray
    instance_end_ns: np.ndarray
    rank_iteration_ns: np.ndarray
    iteration_ns: np.ndarray  # per iteration, max over ranks
    steady_iterations: np.ndarray  # all but the first ``warmup`` (trace.summary.steady)
    predicted_iteration_ns: int | None  # median over steady iterations of iteration_ns
    warmup: int = WARMUP  # the iterations left out of steady_iterations

    def node_times(self, rank: int) -> tuple[np.ndarray, np.ndarray]:
        """(start_ns, end_ns) of one virtual rank's nodes in program order."""
        r = int(np.searchsorted(self.graph.ranks, rank))
        if r >= len(self.graph.ranks) or self.graph.ranks[r] != rank:
            raise KeyError(f"rank {rank} is not a virtual rank of this replay")
        a, b = self.graph.off[r], self.graph.off[r + 1]
        return self.start_ns[a:b], self.end_ns[a:b]


# ---------------------------------------------------------------------- the loop
class Replay:
    """The event loop over a ReplayGraph, in logical time (ns, from 0).

    ``compute``: duration of each node position (only compute nodes are read): "graph"
    (recorded ``duration_ns``), "zero" (as fast as dependencies allow), an array of
    ``graph.num_nodes``, or ``f(graph) -> array``. ``transfer``: per instance ("graph": the
    last arrival's recorded duration; "zero"; an array of ``graph.num_instances``; or a
    function). ``issue``: per node position, the host time an asynchronous call holds its rank
    ("graph": the recorded gap; "zero"; array; function).

    Drive it with :meth:`advance` (all work up to a logical time, or everything) and, for
    external instances, :meth:`pending_external` / :meth:`external_done`; read the outcome with
    :meth:`result`. :meth:`run_to_end` does it all for a graph without external ranks.
    """

    def __init__(
        self,
        graph: ReplayGraph,
        *,
        compute: DurationSource = "graph",
        transfer: DurationSource = "graph",
        issue: DurationSource = "graph",
        warmup: int = WARMUP,
    ) -> None:
        self.graph = graph
        self.warmup = warmup  # iterations left out of the steady median (trace.summary.steady)
        n, ni, nr = graph.num_nodes, graph.num_instances, len(graph.ranks)
        self.compute_ns = self._resolve(compute, graph.recorded_compute_ns, n, "compute")
        self.transfer_ns = self._resolve(transfer, graph.recorded_transfer_ns, ni, "transfer")
        self.issue_ns = self._resolve(issue, graph.recorded_issue_ns, n, "issue")
        self.start_ns = np.full(n, -1, dtype=_I64)
        self.end_ns = np.full(n, -1, dtype=_I64)  # completion as seen by the rank; -1 unknown
        self.inst_arrived = np.zeros(ni, dtype=_I64)
        self.inst_start_ns = np.full(ni, -1, dtype=_I64)
        self.inst_end_ns = np.full(ni, -1, dtype=_I64)
        self._batch_left = graph.batch_size.copy()
        self._batch_end = np.full(graph.num_batches, -1, dtype=_I64)
        self._cur = graph.off[:-1].copy()
        self._clock = np.zeros(nr, dtype=_I64)
        self._state = np.where(self._cur == graph.off[1:], _DONE, _RUN).astype(np.int8)
        self._blk = np.full(nr, -1, dtype=_I64)  # node a blocked rank waits on
        self._pending: dict[int, ExternalEvent] = {}
        self.rounds = 0

    def _resolve(self, src: DurationSource, recorded: np.ndarray, n: int, what: str) -> np.ndarray:
        """An int64 array of n durations (>= 0) from a DurationSource source."""
        if isinstance(src, str):
            if src == "graph":
                return recorded.astype(_I64, copy=True)
            if src == "zero":
                return np.zeros(n, dtype=_I64)
            raise ValueError(f"{what}={src!r}: expected 'graph', 'zero', an array or a function")
        arr = np.asarray(src(self.graph) if callable(src) else src)
        if arr.shape != (n,):
            raise ValueError(f"{what}: expected {n} durations, got shape {arr.shape}")
        arr = np.rint(arr).astype(_I64) if arr.dtype.kind == "f" else arr.astype(_I64)
        if len(arr) and arr.min() < 0:
            raise ValueError(f"{what}: durations must be >= 0 (got {arr.min()} at {int(np.argmin(arr))})")
        return arr

    # ------------------------------------------------------------------ driving
    def advance(self, until: int | None = None) -> ReplayStatus:
        """Run every node that can start at or before ``until`` (all of them if None).

        Returns when nothing more can run: the replay finished, or it waits for external
        instances (``status.pending``), or the rest starts after ``until`` (``next_ns``).
        Raises :class:`ReplayError` when it is stuck for good (a member never arrives)."""
        while self._round(until):
            self.rounds += 1
        return self._status(until)

    def run_to_end(self) -> ReplayResult:
        """Replay everything; for graphs without external instances (else ReplayError)."""
        st = self.advance()
        if st.pending:
            ev = st.pending[0]
            raise ReplayError(
                f"the replay waits for external rank(s) {', '.join(map(str, ev.external_ranks))} in "
                f"{self.graph.describe(ev.nodes[0])}: drive it with advance() / external_done()",
                rank=self.graph.rank_of(ev.nodes[0]),
                index=int(self.graph.index[ev.nodes[0]]),
                op=ev.op,
                group=ev.group,
            )
        return self.result()

    def pending_external(self) -> list[ExternalEvent]:
        """External instances whose virtual members have all arrived, earliest first."""
        return sorted(self._pending.values(), key=lambda e: (e.ready_ns, e.instance))

    def external_done(self, instance: int, end_ns: int) -> None:
        """The external instance ``instance`` completed at logical time ``end_ns`` (for every
        member); the virtual members go on from there at the next :meth:`advance`."""
        ev = self._pending.get(int(instance))
        if ev is None:
            g = self.graph
            if not (0 <= instance < g.num_instances) or not g.inst_external[instance]:
                raise ValueError(f"instance {instance} is not an external instance of this replay")
            raise ValueError(
                f"instance {instance} is not pending: its virtual members have not all arrived, or it was completed already"
            )
        if int(end_ns) < ev.ready_ns:
            p = ev.nodes[0]
            raise ReplayError(
                f"external completion of {self.graph.describe(p)} at {int(end_ns)} ns is before its "
                f"last virtual member arrived ({ev.ready_ns} ns)",
                rank=self.graph.rank_of(p),
                index=int(self.graph.index[p]),
                op=ev.op,
                group=ev.group,
            )
        del self._pending[int(instance)]
        self._complete(np.array([instance], dtype=_I64), np.array([end_ns], dtype=_I64))

    @property
    def finished(self) -> bool:
        return bool(np.all(self._state == _DONE)) and bool(np.all(self.inst_end_ns >= 0))

    # ------------------------------------------------------------------ one round
    def _round(self, until: int | None) -> bool:
        """Advance every runnable rank by one node; complete what became complete; unblock.
        Returns whether anything changed."""
        g = self.graph
        progress = False
        rr = np.flatnonzero(self._state == _RUN)
        if until is not None:
            rr = rr[self._clock[rr] <= until]
        if len(rr):
            ready, go = self._ready(rr)
            if until is not None:
                go &= ready <= until
            rr, ready = rr[go], ready[go]
            p = self._cur[rr]
        if len(rr):
            progress = True
            self.start_ns[p] = ready
            comm = g.is_comm[p]
            c = ~comm
            pc_, e = p[c], ready[c] + self.compute_ns[p[c]]
            self.end_ns[pc_] = e
            self._clock[rr[c]] = e
            pm, rm, tm = p[comm], rr[comm], ready[comm]
            if len(pm):
                inst = g.inst_of[pm]
                np.add.at(self.inst_arrived, inst, 1)
                np.maximum.at(self.inst_start_ns, inst, tm)
                blk = g.blocking[pm]
                nb = ~blk
                self._clock[rm[nb]] = tm[nb] + self.issue_ns[pm[nb]]
                self._state[rm[blk]] = _BLOCKED
                self._blk[rm[blk]] = pm[blk]
                touched = np.unique(inst)
                full = touched[self.inst_arrived[touched] == g.inst_needed[touched]]
                ext = full[g.inst_external[full]]
                for i in ext.tolist():
                    self._pending[i] = self._event(i)
                internal = full[~g.inst_external[full]]
                if len(internal):
                    self._complete(internal, self.inst_start_ns[internal] + self.transfer_ns[internal])
            self._cur[rr] += 1
            end = (self._cur[rr] == g.off[rr + 1]) & (self._state[rr] == _RUN)
            self._state[rr[end]] = _DONE
        # blocked ranks whose op completed go on from its completion
        b = np.flatnonzero(self._state == _BLOCKED)
        if len(b):
            t = self.end_ns[self._blk[b]]
            ok = t >= 0
            if ok.any():
                progress = True
                b, t = b[ok], t[ok]
                self._clock[b] = t
                self._state[b] = np.where(self._cur[b] == g.off[b + 1], _DONE, _RUN)
                self._blk[b] = -1
        return progress

    def _complete(self, insts: np.ndarray, end: np.ndarray) -> None:
        """Instances ``insts`` end at ``end``: set their members' completion, and that of the
        coalesced batches they close."""
        g = self.graph
        self.inst_end_ns[insts] = end
        cnt = g.inst_ptr[insts + 1] - g.inst_ptr[insts]
        nodes = g.inst_nodes[ranges(g.inst_ptr[insts], cnt)]
        t = np.repeat(end, cnt)
        bat = g.batch_of[nodes]
        solo = bat < 0
        self.end_ns[nodes[solo]] = t[solo]
        if not solo.all():
            bn, bt = bat[~solo], t[~solo]
            np.add.at(self._batch_left, bn, -1)
            np.maximum.at(self._batch_end, bn, bt)
            ub = np.unique(bn)
            closed = ub[self._batch_left[ub] == 0]
            if len(closed):
                bc = g.batch_ptr[closed + 1] - g.batch_ptr[closed]
                members = g.batch_nodes[ranges(g.batch_ptr[closed], bc)]
                self.end_ns[members] = np.repeat(self._batch_end[closed], bc)

    def _event(self, i: int) -> ExternalEvent:
        g = self.graph
        nodes = g.inst_nodes[g.inst_ptr[i] : g.inst_ptr[i + 1]]
        members = g.instance_ranks(i)
        virt = tuple(r for r in members if g._is_virtual[r])
        return ExternalEvent(
            instance=i,
            ready_ns=int(self.inst_start_ns[i]),
            op=g.op_names[g.inst_op[i]],
            group=int(g.inst_group[i]),
            virtual_ranks=virt,
            external_ranks=tuple(r for r in members if g.is_external(r)),
            nodes=tuple(int(x) for x in nodes),
        )

    def _ready(self, rr: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For runnable ranks ``rr``: when their next node can start (their clock, or the
        latest completion of the async ops waited on there) and whether all those completed."""
        g = self.graph
        p = self._cur[rr]
        ready = self._clock[rr].copy()
        ok = np.ones(len(rr), dtype=bool)
        w0 = g.wait_ptr[p]
        wn = g.wait_ptr[p + 1] - w0
        hw = np.flatnonzero(wn)
        if len(hw):
            t = self.end_ns[g.wait_src[ranges(w0[hw], wn[hw])]]
            seg = np.repeat(np.arange(len(hw)), wn[hw])
            tmax = np.full(len(hw), -1, dtype=_I64)
            np.maximum.at(tmax, seg, t)
            ready[hw] = np.maximum(ready[hw], tmax)
            ok[hw[np.bincount(seg, weights=(t < 0), minlength=len(hw)) > 0]] = False
        return ready, ok

    def _status(self, until: int | None) -> ReplayStatus:
        pending = tuple(self.pending_external())
        held: int | None = None
        if until is not None:  # the earliest start held back by ``until``
            ready, ok = self._ready(np.flatnonzero(self._state == _RUN))
            later = ready[ok & (ready > until)]
            held = int(later.min()) if len(later) else None
        if self.finished:
            return ReplayStatus(True, pending, held)
        if pending or held is not None:
            return ReplayStatus(False, pending, held)
        raise self._deadlock()

    # ------------------------------------------------------------------ results
    def result(self) -> ReplayResult:
        """Times of the replay so far (complete once :attr:`finished`), with iteration times."""
        g = self.graph
        nonblocking = g.is_comm & ~g.blocking
        ret = np.where(nonblocking, np.where(self.start_ns >= 0, self.start_ns + self.issue_ns, -1), self.end_ns)
        its = g.iterations
        nr, nk = len(g.ranks), len(its)
        per = np.full((nr, nk), -1, dtype=_I64)
        if nk and g.num_nodes:
            prev, last, has, lo = g.iteration_bounds()
            first_start = self.start_ns[np.minimum(lo, max(g.num_nodes - 1, 0))]
            begin = np.where(prev >= lo, ret[np.maximum(prev, 0)], first_start)
            finish = ret[np.maximum(last, 0)]
            known = has & (begin >= 0) & (finish >= 0)
            per.reshape(-1)[known] = (finish - begin)[known]
        iteration_ns = np.where((per >= 0).any(axis=0), per.max(axis=0, initial=-1), -1) if nk else np.zeros(0, _I64)
        steady = np.asarray(steady_of(list(range(nk)), self.warmup), dtype=np.int64)
        vals = iteration_ns[steady]
        vals = vals[vals >= 0]
        pred = int(np.median(vals)) if len(vals) else None
        return ReplayResult(
            graph=g,
            start_ns=self.start_ns.copy(),
            end_ns=self.end_ns.copy(),
            return_ns=ret,
            instance_start_ns=self.inst_start_ns.copy(),
            instance_end_ns=self.inst_end_ns.copy(),
            rank_iteration_ns=per,
            iteration_ns=iteration_ns,
            steady_iterations=its[steady],
            predicted_iteration_ns=pred,
            warmup=self.warmup,
        )

    # ------------------------------------------------------------------ deadlock
    def _deadlock(self) -> ReplayError:
        g = self.graph
        partial = np.flatnonzero((self.inst_end_ns < 0) & (self.inst_arrived > 0))
        partial = partial[~np.isin(partial, list(self._pending))]
        if not len(partial):  # cannot happen with consistent state; say what is known
            r = int(np.flatnonzero(self._state != _DONE)[0])
            p = int(self._cur[r])
            return ReplayError(
                f"replay stuck: {g.describe(min(p, g.off[r + 1] - 1))} cannot go on", rank=int(g.ranks[r])
            )
        i = int(partial[np.lexsort((partial, self.inst_start_ns[partial]))[0]])
        nodes = g.inst_nodes[g.inst_ptr[i] : g.inst_ptr[i + 1]]
        arrived = nodes[self.start_ns[nodes] >= 0]
        lead = int(arrived[0])
        here = {g.rank_of(int(x)) for x in arrived}
        missing = [r for r in g.instance_ranks(i) if g._is_virtual[r] and r not in here]
        if g.inst_kind[i] == INST_P2P and not missing:
            missing = [int(g.peer[lead])]
        why = "; ".join(self._where(r, i) for r in missing[:4]) + ("; ..." if len(missing) > 4 else "")
        arrived_at = int(self.inst_start_ns[i])
        return ReplayError(
            f"replay deadlock: {g.describe(lead)} waits from {arrived_at} ns for "
            f"{'rank' if len(missing) == 1 else 'ranks'} {', '.join(map(str, missing[:8]))}"
            f"{' ...' if len(missing) > 8 else ''} to join, which never happens: {why}. Every member "
            f"of a group must issue the same collectives in the same order, and every send needs "
            f"its recv (`prism show` validates the graph and names the first mismatch)",
            rank=g.rank_of(lead),
            index=int(g.index[lead]),
            op=g.op(lead),
            group=int(g.group[lead]),
        )

    def _where(self, rank: int, inst: int) -> str:
        """Where a missing member is: finished, blocked at a node, or waiting at a wait point."""
        g = self.graph
        r = int(np.searchsorted(g.ranks, rank))
        if r >= len(g.ranks) or g.ranks[r] != rank:
            return f"rank {rank} has no nodes in this replay"
        nodes = g.inst_nodes[g.inst_ptr[inst] : g.inst_ptr[inst + 1]]
        own = [int(x) for x in nodes if g.rank_pos[x] == r]
        its = f" (its part is node {g.index[own[0]]})" if own else " (it never issues it)"
        n = int(g.off[r + 1] - g.off[r])
        if self._state[r] == _DONE:
            return f"rank {rank} ran to its end ({n} nodes){its}"
        if self._state[r] == _BLOCKED:
            return f"rank {rank} is blocked in {g.describe(int(self._blk[r]))}{its}"
        p = int(self._cur[r])
        w = g.wait_src[g.wait_ptr[p] : g.wait_ptr[p + 1]]
        w = [int(x) for x in w if self.end_ns[x] < 0]
        on = f" for {g.describe(w[0])} to complete" if w else ""
        return f"rank {rank} waits at node {g.index[p]}{on}{its}"


def replay(
    trace: PrismTrace,
    *,
    compute: DurationSource = "graph",
    transfer: DurationSource = "graph",
    issue: DurationSource = "graph",
) -> ReplayResult:
    """Replay every rank of a graph (no external ranks) and return the result."""
    return Replay(ReplayGraph(trace), compute=compute, transfer=transfer, issue=issue).run_to_end()
