"""The assistant: one process that plays every virtual rank for the sandbox's real ranks.

    python -m prismllm.assistant          (started by ``prismllm.launch.sandbox``)

Settings: ``MASTER_ADDR``/``MASTER_PORT`` (the launcher's TCPStore) and its ``ChildEnv``
(``prismllm.childenv``): ``sandbox`` (the real ranks), ``graph``, ``tensor_store`` (recorded
tensors with inputs: ``prism record --save-tensors all,inputs``) or ``inputs=generated`` (zeros
for the virtual members' inputs), ``timeout_s`` (a small group's creation and ops; default
1800), ``emulate_backend`` (``gloo``, the default, or ``nccl``: the small groups are NCCL and the
proxy's buffers live on this process's GPU), ``replay_timing`` (``fast``, the default, or
``real``); the user settings ``PRISM_STAGE_AHEAD`` and ``PRISM_IN_FLIGHT``.

What it does (docs/internals/assistant.md):

1. For every group of the graph with both sandbox and virtual members it makes its side of
   the group's small ``ProcessGroupGloo`` -- the proxy, last small rank -- under
   ``prism/pruned/<group name>/``, as the sandbox does (``prismllm.comm.sandbox``). A gloo
   constructor blocks until every member joined, and the sandbox makes its groups in program
   order, so each group has its own worker thread (the constructor releases the GIL): no
   order has to be agreed. Each worker has its own store connection: a TCPStore client
   serves one request at a time, so a worker blocked reading the keys of a group the sandbox
   has not made yet would otherwise hold up the group it is making now (seen: a hang in
   about 5 runs out of 6 with one shared client).
2. It replays the virtual ranks with :class:`~prismllm.replay.engine.Replay`, the sandbox
   ranks external, and never waits there for a real call: an instance with the sandbox is
   completed in the replay as soon as its virtual members have all arrived, at a planned
   end, so the whole schedule of calls with the sandbox is known at once. Each call is handed
   to its group's worker, which enters the proxy's part (``pruning.proxy_call`` from the
   virtual members' recorded or generated inputs); a completer thread per group waits for
   the calls in order and runs the proxy's post steps. Two timings:

   - ``fast`` (slice timing): compute, transfer and issue all zero, "as fast as
     dependencies allow": planned end = ready time; the worker enters its calls back to
     back (at most ``IN_FLIGHT`` outstanding), so the proxy is always there before the
     sandbox and the sandbox measures its calls as the last member to arrive would.
   - ``real`` (emulation with a calibrated graph): the virtual ranks keep the graph's
     durations (the calibration's: compute spans, each instance's transfer as the member
     that waited least measured it, issue gaps; ``prismllm.replay.solve.durations_for``);
     planned end = where the solve of the whole graph (the sandbox ranks with their calibrated
     times too) ends the instance. Each call is entered at its ready time, once the sandbox's
     calls its virtual members last waited on (its gates, ``prismllm.replay.gates``) completed,
     moved by how late (or early) they completed against their planned ends
     (``prismllm.assistant.clock``: on a GPU the schedule is kept and waited on by the device
     itself, so the host only enqueues, ahead of time).

3. Staging: each worker prepares the proxy's buffers of its group's next call(s) (inputs
   read, reduced and copied to the device; on GPU on a staging stream of its own) while the
   current call is in flight, and its first call as soon as the small group exists, so a
   call is entered without preparation on its path.

Per group the proxy enters calls in the group's call order (seq; point-to-point in the
virtual rank's program order; the ops of one coalesced batch together, in one NCCL group as
the sandbox's ``batch_isend_irecv`` does): gloo and NCCL match collectives by their order on
a group, and the sandbox issues them in that same order. On NCCL every call, on every group,
is launched in the sandbox ranks' program order (``_turn``). Calls on different groups run
concurrently (one worker each), so a sandbox rank that waits on group A while an op on
group B is outstanding does not deadlock the assistant.

It ends when every call with the sandbox completed for real;
exit status 0, or 1 with one line ``prism assistant: error: ...`` (also reported to the launcher
through ``prismllm.childenv.report_error``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import queue
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import torch

from prismllm import pruning as C, replay as R
from prismllm.assistant.clock import DeviceClock, HostClock, Schedule, schedule_table
from prismllm.childenv import TIMINGS, user_setting
from prismllm.errors import PrismError
from prismllm.generate.store import TensorStore, dtype_from_name
from prismllm.outputs import SCHEDULE_FILE
from prismllm.replay import INST_COLLECTIVE, ExternalEvent, Replay, ReplayGraph
from prismllm.replay.gates import external_gates, planned_idle
from prismllm.replay.mirror import mirror_plan
from prismllm.trace.edges import match_p2p
from prismllm.trace.graph import PrismTrace
from prismllm.trace.schema import KIND_COMM, P2P_OPS, split_reduce_op
from prismllm.trace.summary import warmup_of

IN_FLIGHT = 16  # calls a proxy may have entered on a group and not seen complete (PRISM_IN_FLIGHT)


def wait_asleep(stream: torch.cuda.Stream) -> None:
    """Return once the device has run what ``stream`` holds, this thread asleep meanwhile. An event
    made with ``blocking=True`` (cudaEventBlockingSync) sleeps its waiting thread, whereas
    ``Stream.synchronize`` spins a host core for as long as the wait lasts (CUDA's default
    scheduling where a process has fewer contexts than cores). The completer waits so on every
    call, while the proxy's side waits for its due time and for the sandbox: the spin kept one of
    the assistant's threads at 98 % of a core for the whole emulation (nvidia-h100-x4, lease 18),
    on the host whose pace the sandbox's slices and emulation measure."""
    done = torch.cuda.Event(blocking=True)
    done.record(stream)
    done.synchronize()


class AssistantError(PrismError):
    """The assistant cannot play its part (missing recorded tensor, failed small call...)."""


@dataclasses.dataclass
class _Group:
    """One pruned group as the proxy sees it: membership, small group, and its worker."""

    gid: int
    name: str
    ranks: list[int]  # global ranks in group-rank order
    pruned: C.Pruned
    jobs: queue.Queue[tuple[int, list[_Job]] | None]  # (slot in the schedule, the calls entered together)
    upcoming: list[int] = dataclasses.field(default_factory=list)  # external instances, call order
    staged: dict[int, C.SmallCall] = dataclasses.field(default_factory=dict)  # instance -> prepared
    stream: Any = None  # CUDA stream the staged buffers are written on
    generated: C.GeneratedBuffers | None = None  # without a tensor store: the proxy's kept buffers
    entered: bool = False  # a call was entered on it (host clock: the first goes at once)
    issued: int = 0  # calls entered on the small group
    finished: int = 0  # ... and completed
    waiting: tuple[list[_Job], float] | None = None  # the entered job the completer waits on, since
    pg: Any = None
    copies: list[tuple[int, int]] | None = None  # (group rank of a copy left out of the replay, its image's)
    thread: threading.Thread | None = None


@dataclasses.dataclass
class _Job:
    """One external instance handed to its group's worker, with the logical time the replay
    completed it at (``fast``: its ready time; ``real``: the whole graph's solved end)."""

    event: ExternalEvent
    end_ns: int


class _Inputs:
    """The virtual members' inputs of one call by logical group rank, read when the plan
    uses them (the proxy of a group of thousands reduces them one at a time)."""

    def __init__(self, read: Callable[[int], torch.Tensor], members: dict[int, int]):
        self.read, self.members = read, members

    def __getitem__(self, v: int) -> torch.Tensor:
        if v not in self.members:
            raise KeyError(v)
        return self.read(v)


class Assistant:
    """Serves the virtual ranks of ``trace`` to the sandbox ranks ``sandbox`` (see the module
    docstring). ``connect()``: a new client of the launcher's TCPStore (one per group worker);
    ``tensors``: the directory of the recorded-tensor store."""

    def __init__(
        self,
        trace: PrismTrace,
        sandbox: tuple[int, ...],
        tensors: str | None,
        connect: Callable[[], Any],
        timeout: timedelta = timedelta(minutes=30),
        backend: str = "gloo",
        timing: str = "fast",
        stage_ahead: int = 1,
        index: int = 0,
        count: int = 1,
        sandbox_order: bool | None = None,
        copies: bool = True,
        left_out: Callable[[], int] | None = None,
    ) -> None:
        """``sandbox_order``: launch every call in the sandbox ranks' program order (default: on
        NCCL, which needs it; see ``_turn`` below). ``copies``: leave the DP replicas' copies out
        of the replay where the graph allows it (:func:`prismllm.replay.mirror.mirror_plan`;
        MirrorError where its point-to-point calls do not). ``left_out``: the host time the
        sandbox ranks have left out of their clocks so far, which the host clock of ``real``
        timing leaves out of its own (prismllm.comm.leftout)."""
        if timing not in TIMINGS:
            raise AssistantError(f"replay timing {timing!r}: expected one of {', '.join(TIMINGS)}")
        if stage_ahead < 0:
            raise AssistantError(f"stage ahead {stage_ahead}: expected 0 or more calls")
        self.trace = trace
        self.timing, self.stage_ahead = timing, stage_ahead
        self.left_out = left_out
        self.in_flight = max(1, int(user_setting("PRISM_IN_FLIGHT", str(IN_FLIGHT))))
        # "nccl": small groups are NCCL, the proxy's buffers on this process's GPU
        self.backend = backend
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None
        self.sandbox = tuple(sorted(sandbox))
        self.tensors = tensors
        self.connect = connect
        self.timeout = timeout
        # the worlds of the sandbox ranks and one more are replayed; the other DP replicas, copies
        # of the one more, move with it (prismllm.replay.mirror)
        mirror = mirror_plan(trace, keep=self.sandbox) if copies else None
        self.graph = ReplayGraph(trace, external=list(self.sandbox), mirror=mirror)
        self.mirrored = int((mirror >= 0).sum()) if mirror is not None else 0
        warmup = warmup_of(trace.manifest)  # the calibration's: the replay's medians leave out as many
        if timing == "real":  # the calibration's durations (it solved this graph with the same rules)
            d = R.durations_for(
                self.graph, R.measured(trace, self.graph.row), R.resolve_rule("auto", trace), R.slice_of_rank(trace)
            )
            self.replay = Replay(
                self.graph,
                compute=d.compute_ns,
                transfer=d.transfer_ns,
                issue=d.issue_ns,
                warmup=warmup,
            )
            self._transfer_ns = d.transfer_ns  # per instance: a blocking call's wait is the rest (gates)
            # the planned end of each instance with the sandbox: where the solve of the whole
            # graph (sandbox ranks with their calibrated times) ends it
            sol = R.solve(trace, validate_graph=False, mirror=mirror)
            full = sol.graph
            pos = np.empty(trace.num_nodes, dtype=np.int64)
            pos[full.row] = np.arange(full.num_nodes)
            first = self.graph.inst_nodes[self.graph.inst_ptr[:-1]]
            self._planned_end = sol.result.instance_end_ns[full.inst_of[pos[self.graph.row[first]]]]
        else:
            self.replay = Replay(self.graph, compute="zero", transfer="zero", issue="zero", warmup=warmup)
        # generated inputs: what each group's proxy keeps of its buffers (an eighth of the GPU)
        self._kept_limit = torch.cuda.get_device_properties(self.device).total_memory // 8 if self.device else 1 << 30
        # "real" timing: the schedule of the calls with the sandbox (made once they are planned)
        self.clock: DeviceClock | HostClock | None = None
        self._plan: list[list[_Job]] = []  # the calls with the sandbox, one job list a slot (schedule)
        self._stores: dict[int, TensorStore] = {}
        self._done: queue.Queue[tuple[_Group, BaseException | None]] = queue.Queue()  # workers' ends
        self.groups: dict[int, _Group] = {}
        self.answered = 0
        self.staged_hits = 0  # calls whose buffers were ready when they came due
        real = set(self.sandbox)
        if not 0 <= index < count:
            raise AssistantError(f"assistant {index} of {count}: expected 0 <= index < count")
        self.index, self.count = index, count
        self.others: set[int] = set()  # pruned groups another assistant plays
        pruned = 0
        for gid, info in sorted(trace.group_info().items()):
            ranks = list(info["ranks"])
            mine = tuple(g for g, r in enumerate(ranks) if r in real)
            if 0 < len(mine) < len(ranks):
                if pruned % count == index:  # round robin over the pruned groups, in creation order
                    self.groups[gid] = _Group(gid, info["name"], ranks, C.Pruned(len(ranks), mine), queue.Queue())
                else:
                    self.others.add(gid)
                pruned += 1
        g = self.graph
        ext = np.flatnonzero(g.inst_external)
        first = g.inst_nodes[g.inst_ptr[ext]]
        # each group's external instances in the order its worker serves them (see _order)
        order = np.lexsort(
            (
                g.index[first],
                g.rank_pos[first],
                np.where(g.inst_kind[ext] == 0, g.inst_seq[ext], 0),
                g.inst_kind[ext],
                g.inst_group[ext],
            )
        )
        for i in ext[order]:
            grp = self.groups.get(int(g.inst_group[i]))
            if grp is not None:
                grp.upcoming.append(int(i))
        # a group without calls with the sandbox gets no small group: the sandbox makes its side
        # at the group's first call, so there would be no one to meet
        self.groups = {gid: grp for gid, grp in self.groups.items() if grp.upcoming}
        # NCCL: every member of the small communicators must launch its calls in one order (NCCL
        # kernels of different communicators on one device need not run concurrently, and a
        # communicator is made by a blocking collective at its first call): the proxy, which
        # could run ahead on one group while the sandbox waits on another, launches its calls
        # in the sandbox ranks' program order (seen: a TP2-PP2 slice on one GPU hung with the
        # proxy 17 calls ahead on the TP group and the sandbox in its first pipeline recv).
        # gloo makes its small groups up front and runs each call on its own threads: no order.
        # Each group's worker then serves its calls in that order too: sorted by peer (the order
        # above, for gloo), a pipeline stage's P2P group queued all sends to the previous stage
        # before the receives from the next, and the worker waited for its turn on a call that its
        # own queue held behind (seen: every middle stage's slice of a PP4 run on NCCL hung).
        in_order = backend == "nccl" if sandbox_order is None else sandbox_order
        self._turn = self._sandbox_order() if in_order else None
        if self._turn is not None:
            for grp in self.groups.values():
                grp.upcoming.sort(key=self._turn.__getitem__)
        self._place = {i: k for grp in self.groups.values() for k, i in enumerate(grp.upcoming)}
        self._turn_next = 0
        self._turn_done: set[int] = set()
        self._turn_cv = threading.Condition()
        # node columns the proxy's plans read, trace row -> value, for the members of the calls it
        # plays alone (the whole columns as Python lists took 3.5 s of a 4,096-rank slice's ~9.5 s)
        mine = np.asarray(sorted(self._place), dtype=np.int64)
        cnt = g.inst_ptr[mine + 1] - g.inst_ptr[mine]
        rows = np.unique(g.row[g.inst_nodes[R.ranges(g.inst_ptr[mine], cnt)]])
        names = ["shape", "dtype", "reduce_op", "tag", "in_splits", "out_splits", "out_bytes"]
        cols = trace.nodes.select(names).take(rows).to_pydict()
        at = rows.tolist()
        self._shape, self._dtype, self._red, self._tag, self._in_splits, self._out_splits, self._out_bytes = (
            dict(zip(at, cols[name])) for name in names
        )

    def _sandbox_order(self) -> dict[int, int]:
        """Each external instance this assistant plays -> its place in one order in which every
        sandbox rank makes its calls (each rank's program order, merged over the sandbox ranks)."""
        trace, g = self.trace, self.graph
        row_inst = np.full(trace.num_nodes, -1, dtype=np.int64)
        row_inst[g.row] = g.inst_of
        mine = {i for grp in self.groups.values() for i in grp.upcoming}
        coll = {
            (int(gr), int(sq)): int(i)
            for i, (gr, sq, k) in enumerate(zip(g.inst_group, g.inst_seq, g.inst_kind))
            if k == INST_COLLECTIVE and int(i) in mine
        }
        row_of_id = np.empty(int(trace.column("node_id").max()) + 1, dtype=np.int64)
        row_of_id[trace.column("node_id")] = np.arange(trace.num_nodes)
        sends, recvs = match_p2p(trace.nodes)
        partner = dict(zip(row_of_id[sends].tolist(), row_of_id[recvs].tolist()))
        partner.update(zip(row_of_id[recvs].tolist(), row_of_id[sends].tolist()))
        rank, kind = trace.column("rank"), trace.column("kind")
        group, seq, op = trace.column("group"), trace.column("seq"), trace.column("op")
        order = trace.program_order()
        chains = []
        for r in self.sandbox:
            chain: list[int] = []
            for row in order[(rank[order] == r) & (kind[order] == KIND_COMM)].tolist():
                if op[row] in P2P_OPS:
                    i = int(row_inst[partner[row]]) if row in partner else -1
                else:
                    i = coll.get((int(group[row]), int(seq[row])), -1)
                if i in mine and (not chain or chain[-1] != i):
                    chain.append(i)
            chains.append(chain)
        merged = _merge_orders(chains)
        if merged is None:
            raise AssistantError(
                "the sandbox ranks make their calls with the proxy in orders that no single order "
                "keeps (a program that would deadlock on NCCL): emulate them in separate slices"
            )
        rest = sorted(mine - set(merged))
        return {i: k for k, i in enumerate(merged + rest)}

    def _my_turn(self, jobs: list[_Job]) -> None:
        """Wait until the calls before ``jobs`` in the sandbox's order were launched (NCCL)."""
        if self._turn is None:
            return
        first = min(self._turn[j.event.instance] for j in jobs)
        with self._turn_cv:
            while self._turn_next < first:
                self._turn_cv.wait()

    def _launched(self, jobs: list[_Job]) -> None:
        if self._turn is None:
            return
        with self._turn_cv:
            self._turn_done.update(self._turn[j.event.instance] for j in jobs)
            while self._turn_next in self._turn_done:
                self._turn_done.discard(self._turn_next)
                self._turn_next += 1
            self._turn_cv.notify_all()

    # ------------------------------------------------------------------ groups
    def start(self) -> None:
        """Start one worker per pruned group; each first makes its side of the small group,
        then enters the group's calls as :meth:`run` hands them over (see :meth:`_work`)."""
        for grp in self.groups.values():
            grp.thread = threading.Thread(target=self._work, args=(grp,), daemon=True, name=f"prism-proxy-{grp.name}")
            grp.thread.start()

    def _work(self, grp: _Group) -> None:
        """A group's worker: enter each job (a call, or the calls of one coalesced batch) on the
        small group in order, without waiting for the one before (a completer thread waits, at
        most ``IN_FLIGHT`` calls behind); ``real`` timing: not before it is due (``self.clock``)."""
        inflight: queue.Queue[tuple[int, list[_Job], list[C.SmallCall], list, Any] | None] = queue.Queue(self.in_flight)
        completer = None
        try:
            if self.device is not None:  # the worker thread's current device
                torch.cuda.set_device(self.device)
                grp.stream = torch.cuda.Stream(self.device)
                # a stream of its own to issue from: on the shared default stream, another
                # group's completer waiting for its call would hold this group's next call back
                # on the device (a deadlock when the sandbox needs this call first)
                torch.cuda.set_stream(torch.cuda.Stream(self.device))
            try:
                store = self.connect()
                # the sandbox says which backend it made its side with, at the group's first call
                theirs = store.get(f"{C.PRUNED_PREFIX}{grp.name}/backend").decode()
                if theirs != self.backend:
                    raise AssistantError(
                        f"group {grp.name} {grp.ranks}: the program runs it on {theirs} while this emulation's "
                        f"proxies run {self.backend}; a {theirs} group with virtual members on a "
                        f"{'GPU' if self.backend == 'nccl' else 'CPU'} run is not supported yet"
                    )
                grp.pg = C.small_group(store, grp.name, grp.pruned.proxy, grp.pruned.size, self.timeout, self.backend)
            except AssistantError:
                raise
            except BaseException as e:  # noqa: BLE001
                raise AssistantError(
                    f"group {grp.name} {grp.ranks}: could not make the small group with the sandbox: {e}"
                ) from e
            completer = threading.Thread(
                target=self._complete, args=(grp, inflight), daemon=True, name=f"prism-done-{grp.name}"
            )
            completer.start()
            self._stage(grp, -1)  # the first call, before it is due
            while True:
                item = grp.jobs.get()
                if item is None:
                    break
                slot, jobs = item
                clock = self.clock  # set before the first job is handed out (run)
                calls = [self._staged_or_prepared(grp, j.event) for j in jobs]
                if grp.stream is not None:  # the NCCL op (after the current stream) reads what staging wrote
                    torch.cuda.current_stream(self.device).wait_stream(grp.stream)
                self._my_turn(jobs)
                if isinstance(clock, DeviceClock):  # the device waits until it is due
                    clock.enter(slot)
                elif clock is not None:
                    clock.enter(slot, first_of_group=not grp.entered)
                grp.entered = True
                t0 = self._now()
                # on a GPU a call goes on this thread's stream, right after its entry (synchronous:
                # no hop to NCCL's own stream and back between the clock's kernels and the call's)
                on_gpu = self.device is not None
                works = C.issue(grp.pg, calls[0], sync=on_gpu) if len(calls) == 1 else C.issue_batch(grp.pg, calls)
                self._launched(jobs)
                grp.issued += len(calls)
                if isinstance(clock, DeviceClock):
                    for w in works:  # NCCL: the current stream waits for the call (the host does not)
                        w.wait()
                    clock.completed(slot)
                elif clock is not None:
                    clock.issue_ns += (self._now() - t0 - clock.issue_ns) // 8  # running mean (a rough figure)
                issued = None
                if on_gpu:  # what the completer waits for: a synchronous NCCL call has no Work
                    issued = torch.cuda.Event()
                    issued.record()
                inflight.put((slot, jobs, calls, works, issued))  # blocks while IN_FLIGHT calls are outstanding
                self._stage(grp, jobs[-1].event.instance)
                if isinstance(clock, HostClock):
                    # the group's next call waits for this one's real end: a virtual rank cannot
                    # go on before the op it is in completes (on a GPU the group's stream orders
                    # its calls the same way)
                    inflight.join()
        except BaseException as e:  # noqa: BLE001 - reported by the main loop
            self._done.put((grp, e))
            return
        inflight.put(None)
        completer.join()
        self._done.put((grp, None))

    def _complete(self, grp: _Group, inflight: queue.Queue) -> None:
        """Wait for a group's calls in order; run their post steps; with ``real`` timing, move
        the replay's clock by how late (or early) the call really completed."""
        if self.device is not None:  # its own stream to wait on (see _work)
            torch.cuda.set_device(self.device)
            torch.cuda.set_stream(torch.cuda.Stream(self.device))
        while True:
            item = inflight.get()
            if item is None:
                return
            slot, jobs, calls, works, issued = item
            grp.waiting = (jobs, time.monotonic())
            try:
                self._finish(grp, slot, calls, works, issued)
                grp.waiting = None
            except BaseException as e:  # noqa: BLE001
                self._done.put(
                    (
                        grp,
                        AssistantError(f"{self.graph.describe(jobs[0].event.nodes[0])}: the proxy's call failed: {e}"),
                    )
                )
                return
            finally:
                inflight.task_done()

    def _finish(
        self, grp: _Group, slot: int, calls: list[C.SmallCall], works: list, issued: torch.cuda.Event | None
    ) -> None:
        """Wait for one entered job (its Works, and on a GPU the worker's stream after it: ``issued``),
        run its post steps; ``real`` timing on the host: pin or move the clock (a DeviceClock
        stamps completions on the device itself)."""
        for w in works:
            w.wait()
        if issued is not None:
            torch.cuda.current_stream(self.device).wait_event(issued)
        for c in calls:
            c.finish()
        if self.device is not None:  # done on the device, as this thread's stream now waits on it
            wait_asleep(torch.cuda.current_stream(self.device))
        if isinstance(self.clock, HostClock):
            self.clock.completed(slot)
        grp.finished += len(calls)

    # ------------------------------------------------------------------ status
    @property
    def completed(self) -> int:
        """Calls the sandbox and the proxies completed for real."""
        return sum(grp.finished for grp in self.groups.values())

    def progress(self) -> int:
        """A count that moves with every call a proxy enters or completes."""
        return sum(grp.issued + grp.finished for grp in self.groups.values())

    def status_lines(self, limit: int = 12) -> list[str]:
        """Where each proxy stands with the sandbox (prismllm.launch.status): the groups whose calls
        are not all done, the longest-waiting first."""
        now = time.monotonic()
        lines = [
            f"{self.answered} call(s) with the sandbox planned, {self.completed} completed "
            f"({self.timing} timing, {len(self.groups)} group(s))"
        ]
        open_groups = []
        for grp in self.groups.values():
            label = f"group {self.trace.group_label(grp.gid)}"
            if grp.pg is None:
                open_groups.append((float("inf"), f"{label}: making its small group (the sandbox has not joined)"))
                continue
            if grp.finished == len(grp.upcoming):
                continue
            state = f"{label}: {grp.issued} of {len(grp.upcoming)} call(s) entered, {grp.finished} completed"
            waiting = grp.waiting
            if waiting is None:
                open_groups.append((0.0, state))
                continue
            age = now - waiting[1]
            open_groups.append(
                (
                    age,
                    f"{state}; waiting {age:.1f} s for "
                    f"{self.graph.describe(waiting[0][0].event.nodes[0])} with the sandbox",
                )
            )
        open_groups.sort(key=lambda t: -t[0])
        lines += [t[1] for t in open_groups[:limit]]
        if len(open_groups) > limit:
            lines.append(f"... and {len(open_groups) - limit} more group(s)")
        return lines

    # ------------------------------------------------------------------ one call
    def _store(self, rank: int) -> TensorStore:
        st = self._stores.get(rank)
        if st is None:
            st = self._stores[rank] = TensorStore(self.tensors, rank)
        return st

    def _input(self, grp: _Group, pos: int, op: str, peer: int = -1, rank: int | None = None) -> torch.Tensor:
        """A virtual member's recorded input of the call at node position ``pos`` (``rank``: a
        copy left out of the replay, whose call is its image's at ``pos``)."""
        g = self.graph
        rank, seq = g.rank_of(pos) if rank is None else rank, int(g.seq[pos])
        ts = self._store(rank).get(grp.name, grp.ranks, op, seq, peer, io="in")
        if not ts:
            raise AssistantError(
                f"no recorded input for {g.describe(pos)} in {self.tensors} (record the graph with "
                f"`prism record --save-tensors all,inputs`, or emulate with generated inputs)"
            )
        # a list form (reduce_scatter's n input chunks, scatter's root list) stays a list:
        # the plans take a list of n tensors where they take a buffer of n chunks
        return ts[0] if len(ts) == 1 else ts

    def plan(self, grp: _Group, ev: ExternalEvent) -> tuple[C.Plan, Any]:
        """The plan of an external instance, as the sandbox makes it from its own call, and
        the virtual members' recorded inputs by logical group rank (read when used)."""
        g = self.graph
        p0 = ev.nodes[0]
        row = int(g.row[p0])
        n, G, op = grp.pruned.n, grp.pruned, ev.op
        shape = tuple(self._shape[row] or ())  # a tuple: plans are cached by it
        red, factor = split_reduce_op(self._red[row])  # premul_sum carries its factor
        dtype = dtype_from_name(self._dtype[row]) if self._dtype[row] else torch.uint8
        gr = {r: i for i, r in enumerate(grp.ranks)}
        members = {gr[g.rank_of(p)]: p for p in ev.nodes}
        if self.mirrored and op not in P2P_OPS:  # a copy's call is its image's, in the same group
            if grp.copies is None:
                mirror = g.mirror[grp.ranks]
                grp.copies = [(v, gr[int(mirror[v])]) for v in np.flatnonzero(mirror >= 0).tolist()]
            for v, image in grp.copies:
                members[v] = members[image]
        if op in P2P_OPS:
            me, peer = gr[g.rank_of(p0)], gr[int(g.peer[p0])]
            src, dst = (me, peer) if op == "send" else (peer, me)
            p = C.plan_once(C.plan_send, n, G, src, dst, shape, tag=int(self._tag[row]), dtype=dtype)
            if op != "send":
                return p, {}
            return p, _Inputs(lambda m: self._input(grp, p0, "send", int(g.peer[p0])), {0: p0})
        if op == "barrier":
            return C.plan_once(C.plan_barrier, n, G), {}
        ins = _Inputs(lambda v: self._input(grp, members[v], op, rank=grp.ranks[v]), members)  # read when used
        if op == "all_reduce":
            return C.plan_once(C.plan_all_reduce, n, G, shape, red, dtype=dtype, factor=factor), ins
        if op == "broadcast":
            return C.plan_once(C.plan_broadcast, n, G, shape, gr[int(g.peer[p0])], dtype=dtype), ins
        if op == "reduce":
            return C.plan_once(C.plan_reduce, n, G, shape, gr[int(g.peer[p0])], red, dtype=dtype, factor=factor), ins
        if op == "all_gather":
            return C.plan_once(C.plan_all_gather, n, G, shape, dtype=dtype), ins
        if op == "reduce_scatter":  # a member's output is one chunk (the recorded shape is the
            # whole input of the tensor form, one chunk of the list form)
            chunk = int(self._out_bytes[row]) // dtype.itemsize
            return C.plan_once(C.plan_reduce_scatter, n, G, chunk, red, dtype=dtype, factor=factor), ins
        if op == "gather":  # the recorded shape is a member's input
            return C.plan_once(C.plan_gather, n, G, shape, gr[int(g.peer[p0])], dtype=dtype), ins
        if op == "scatter":  # the recorded shape is one chunk; the root's input is the list of n
            root = gr[int(g.peer[p0])]

            def root_list(v: int) -> Any:
                x = self._input(grp, members[v], op, rank=grp.ranks[v])
                return [x] * n if isinstance(x, torch.Tensor) else x  # generated: zeros of one chunk

            return C.plan_once(C.plan_scatter, n, G, shape, root, dtype=dtype), _Inputs(root_list, members)
        if op == "all_to_all":
            numel = math.prod(int(x) for x in shape)
            if not any(self._in_splits[int(g.row[q])] or self._out_splits[int(g.row[q])] for q in ev.nodes):
                return C.plan_once(C.plan_all_to_all, n, G, None, numel=numel, dtype=dtype), ins
            # uneven: the virtual members' rows (what they send) and columns (what they
            # receive), from their recorded split sizes
            row_numel = math.prod(int(x) for x in shape[1:])
            rows, cols = {}, {}
            for v, q in members.items():
                r = int(g.row[q])
                rs = int(self._shape[r][0]) if self._shape[r] else 0
                out_rows = self._out_bytes[r] // max(1, dtype.itemsize * row_numel)
                rows[v] = list(self._in_splits[r]) or [rs // n] * n
                cols[v] = list(self._out_splits[r]) or [out_rows // n] * n
            return C.plan_once(
                C.plan_all_to_all, n, G, C.splits_matrix(n, rows, cols), row_numel=row_numel, dtype=dtype
            ), ins
        raise AssistantError(f"{g.describe(p0)}: {op} is not supported in emulation yet")

    def _event(self, inst: int) -> ExternalEvent:
        """An external instance as the plan needs it (its virtual members' nodes and op), before
        the replay made it pending (for staging)."""
        g = self.graph
        return ExternalEvent(
            instance=inst,
            ready_ns=-1,
            op=g.op_names[g.inst_op[inst]],
            group=int(g.inst_group[inst]),
            virtual_ranks=(),
            external_ranks=(),
            nodes=tuple(int(x) for x in g.inst_nodes[g.inst_ptr[inst] : g.inst_ptr[inst + 1]]),
        )

    def _prepare(self, grp: _Group, ev: ExternalEvent) -> C.SmallCall:
        try:
            p, ins = self.plan(grp, ev)
            nccl = self.backend == "nccl"  # batches and pre-multiplied sums, as the sandbox issues them
            with torch.cuda.stream(grp.stream) if grp.stream is not None else contextlib.nullcontext():
                if self.tensors is not None:
                    return C.proxy_call(p, ins, self.device, coalesce=nccl, premul=nccl)
                if grp.generated is None:  # generated: kept buffers, filled once (pruning.generated)
                    grp.generated = C.GeneratedBuffers(self.device, self._kept_limit)
                return C.generated_proxy_call(p, grp.generated, coalesce=nccl, premul=nccl)
        except AssistantError:
            raise
        except Exception as e:  # noqa: BLE001 - named with the call it failed on
            raise AssistantError(
                f"{self.graph.describe(ev.nodes[0])}: the proxy could not prepare its part: {e}"
            ) from e

    def _stage(self, grp: _Group, after: int | None) -> None:
        """Prepare the proxy's buffers of the group's next ``stage_ahead`` calls after the
        instance ``after`` (-1: from the first); drop what was staged for calls before it."""
        if after is None or not self.stage_ahead:
            return
        k = self._place[after] if after >= 0 else -1
        for i in [i for i in grp.staged if self._place[i] <= k]:
            del grp.staged[i]
        for i in grp.upcoming[k + 1 : k + 1 + self.stage_ahead]:
            if i not in grp.staged:
                grp.staged[i] = self._prepare(grp, self._event(i))

    def _now(self) -> int:
        return time.perf_counter_ns()

    def _staged_or_prepared(self, grp: _Group, ev: ExternalEvent) -> C.SmallCall:
        call = grp.staged.pop(ev.instance, None)
        if call is None:
            return self._prepare(grp, ev)
        self.staged_hits += 1  # one worker per group: += under the GIL is enough for a count
        return call

    # ------------------------------------------------------------------ the loop
    def _order(self, ev: ExternalEvent) -> tuple:
        """Issue order within a batch of new pending instances: per group, call order."""
        p = ev.nodes[0]
        if ev.op in P2P_OPS:
            return (ev.group, 1, self.graph.rank_of(p), int(self.graph.index[p]))
        return (ev.group, 0, int(self.graph.seq[p]), 0)

    def run(self) -> None:
        """Plan every call with the sandbox, hand it to its group's worker, wait for the workers.

        The replay never waits for a real call: an external instance is completed in the replay
        when its virtual members have all arrived, at its ready time (``fast``), or at the end
        the solve of the whole calibrated graph gives it (``real``). So the whole schedule is known before the sandbox reaches its first call,
        and each worker enters its group's calls back to back (``fast``), or each at its time
        (``real``), where the sandbox's real completions move the calls that wait on them (``clock``)."""
        self.start()
        plan = self._plan = self.schedule()
        if self.timing == "real":
            sch = self._clock_schedule(plan)
            self.clock = DeviceClock(self.device, sch) if self.device else HostClock(sch, self.left_out)
        for slot, jobs in enumerate(plan):
            self.groups[jobs[0].event.group].jobs.put((slot, jobs))
        for grp in self.groups.values():
            grp.jobs.put(None)
        left = len(self.groups)
        while left:
            grp, err = self._done.get()
            if err is not None:
                if isinstance(err, PrismError):
                    raise err
                raise AssistantError(f"group {grp.name} {grp.ranks}: {err}") from err
            left -= 1

    def schedule(self) -> list[list[_Job]]:
        """Replay the virtual ranks to the end; every call with the sandbox, as the jobs (one
        call, or the calls of a coalesced batch) in the order the workers enter them: per group
        its call order, or with ``_turn`` the sandbox ranks' program order."""
        rep = self.replay
        g = self.graph
        plan: list[list[_Job]] = []
        while True:
            st = rep.advance()
            batches: dict[tuple, list[_Job]] = {}
            for ev in sorted(st.pending, key=self._order):
                end = ev.ready_ns if self.timing == "fast" else max(ev.ready_ns, int(self._planned_end[ev.instance]))
                if ev.group in self.others:  # another assistant plays it, on the same plan
                    rep.external_done(ev.instance, end)
                    continue
                if ev.group not in self.groups:
                    raise AssistantError(f"{g.describe(ev.nodes[0])}: its group has no small group with the sandbox")
                b = int(g.batch_of[ev.nodes[0]]) if ev.op in P2P_OPS else -1
                # the point-to-point ops of one coalesced batch are entered together (one NCCL
                # group on both sides: ops posted one by one could wait on each other)
                batches.setdefault((ev.group, b) if b >= 0 else (ev.group, -1, ev.instance), []).append(_Job(ev, end))
                rep.external_done(ev.instance, end)
                self.answered += 1
            plan.extend(batches[k] for k in sorted(batches, key=lambda k: self._order(batches[k][0].event)))
            if st.finished:
                break
        if self._turn is not None:
            turn = self._turn
            plan.sort(key=lambda jobs: min(turn[j.event.instance] for j in jobs))
        return plan

    def _clock_schedule(self, plan: list[list[_Job]]) -> Schedule:
        """The real-time schedule of ``plan`` (one entry a slot): when each call is due, where it was
        planned to end, and the earlier calls it waits behind with their
        offsets (``replay.gates``: the sandbox's calls its virtual members last waited on, less the
        plan's waits since; those another assistant plays are not followed)."""
        slot_of = {j.event.instance: s for s, jobs in enumerate(plan) for j in jobs}
        ptr, gates, offsets = external_gates(self.graph, planned_idle(self.replay.result(), self._transfer_ns))
        gate_ptr, gate, gate_offset = [0], [], []
        for s, jobs in enumerate(plan):
            mine: dict[int, int] = {}  # gate slot -> the least offset any of the slot's calls has on it
            for j in jobs:
                a, b = ptr[j.event.instance], ptr[j.event.instance + 1]
                for i, o in zip(gates[a:b].tolist(), offsets[a:b].tolist()):
                    k = slot_of.get(i, s)
                    if k != s:
                        mine[k] = min(o, mine.get(k, o))
            for k in sorted(mine):
                gate.append(k)
                gate_offset.append(mine[k])
            gate_ptr.append(len(gate))
        return Schedule(
            ready_ns=[jobs[0].event.ready_ns for jobs in plan],
            planned_end_ns=[max(j.end_ns for j in jobs) for jobs in plan],
            gate_ptr=gate_ptr,
            gate=gate,
            gate_offset_ns=gate_offset,
        )

    def write_result(self, path: str) -> None:
        """The virtual ranks' iteration times as the replay ran them (``real`` timing: with
        the sandbox's real completions fed back), as JSON."""

        res = self.replay.result()
        its = self.graph.iterations
        doc = {
            "timing": self.timing,
            "virtual_ranks": len(self.graph.ranks) + self.mirrored,
            "replayed_ranks": len(self.graph.ranks),  # the others moved with the ranks they copy
            "iterations": [int(k) for k in its],
            "iteration_ns": [int(x) for x in res.iteration_ns],
            "steady_iterations": [int(k) for k in res.steady_iterations],
            "median_steady_iteration_ns": res.predicted_iteration_ns,
            "answered": self.answered,
            "staged_ahead": self.staged_hits,
            "completed": self.completed,
        }
        if self.clock is not None:  # how late the virtual ranks' arrivals came against their schedule
            doc["arrivals"] = self.clock.arrivals()
            self._write_schedule(os.path.join(os.path.dirname(path), SCHEDULE_FILE))
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(tmp, path)

    def _write_schedule(self, path: str) -> None:
        """The real-time schedule call by call (:func:`prismllm.assistant.clock.schedule_table`),
        each call named by its first virtual member: rank, node index, iteration."""
        g = self.graph
        first = [jobs[0].event.nodes[0] for jobs in self._plan]
        calls = {
            "group": [jobs[0].event.group for jobs in self._plan],
            "op": ["+".join(j.event.op for j in jobs) for jobs in self._plan],
            "rank": [g.rank_of(p) for p in first],
            "index": [int(g.index[p]) for p in first],
            "iteration": [int(g.iteration[p]) for p in first],
        }
        rows, origin = self.clock.log()
        tmp = f"{path}.tmp"
        pq.write_table(schedule_table(self.clock.schedule, rows, origin, calls), tmp)
        os.replace(tmp, path)


def _merge_orders(chains: list[list[int]]) -> list[int] | None:
    """One sequence that keeps the order of every chain (Kahn over their consecutive pairs), or
    None when the chains contradict each other."""
    succ: dict[int, list[int]] = {}
    indeg: dict[int, int] = {}
    for chain in chains:
        for i in chain:
            indeg.setdefault(i, 0)
        for a, b in zip(chain, chain[1:]):
            succ.setdefault(a, []).append(b)
            indeg[b] += 1
    ready = sorted((i for i, d in indeg.items() if d == 0), reverse=True)
    out: list[int] = []
    while ready:
        i = ready.pop()
        out.append(i)
        for j in succ.get(i, ()):
            indeg[j] -= 1
            if indeg[j] == 0:
                ready.append(j)
                ready.sort(reverse=True)
    return out if len(out) == len(indeg) else None
