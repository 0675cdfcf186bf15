"""Switch mode's coordinator: it carries out every collective and point-to-point call of the N
ranks on the host, with their real inputs (the paper's CPU collective executor, §5.2).

Each rank process connects once (``prismllm.comm.switch``: an abstract Unix socket, the run's
token first) and sends each call with its inputs. A collective instance is one (group name,
sequence number): when every member's part is in, the coordinator computes each member's
outputs and answers it; a send is kept and answered at once, a receive answered when its send
(the k-th from that sender on that group) is there. Members must agree on the call: the op, the
group's ranks, the reduce op and the root; a disagreement (a program that deviates between its
ranks) fails every member's call with one line naming the instance.

Reductions are the emulation's (``prismllm.pruning.tensors``), member by member in group order
(sum, avg, product, min, max, the bitwise ops, premul_sum); an average of integers truncates, as
NCCL's.

With ``slots`` K, at most K ranks run at a time (the paper's context switching, Appendix A): a
rank that waits on a call the coordinator has not completed is stopped and its slot given to
another, chosen by the paper's rule: among the ranks that can go on (never run, or a call of
theirs completed since they stopped), the one the most incomplete calls wait for. Which waiting
ranks are stopped is :meth:`Coordinator._to_stop`'s: not one whose peer runs, and not one whose
peer is ready to take a slot that another waiting rank gives up (the ranks of a group come to
share the slots). A rank waits, for the coordinator, when it has a call in and its threads have
run under 2 ms of CPU time between two looks 20 ms apart with none of them runnable: a Future
waited on in torch's C++ (DDP's reducer) tells no one else. On the CPU a rank is stopped with
SIGSTOP and goes on with SIGCONT. On GPUs (``gpus``: each rank's GPU) each GPU has its own K/G
slots, and a rank stopped there has its device state moved to the host first and back before it
goes on (``prismllm.capture.gpuswap``): one thread per GPU does a GPU's swaps in the order they
were decided, so a rank's memory is out before the next one's comes in, and the scheduler leaves
a rank alone while its swap runs.
Where no rank can run and every stopped rank was stopped after the last progress, the ranks are
deadlocked (a program whose ranks part ways): the coordinator says who waits for whom and ends
them. Where the host's available memory falls under 1 GiB (or a twentieth of it), it ends them
too, saying so, before the kernel's OOM killer picks one.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import secrets
import signal
import socket
import threading
import time
from typing import Any

import torch

from prismllm.capture.gpuswap import GpuSwap, SwapError, send_signal
from prismllm.comm.switch import decode, encode, recv_frame, send_frame
from prismllm.errors import PrismError
from prismllm.launch.processes import proc_state
from prismllm.pruning.tensors import post_reduce, reduce
from prismllm.specs import format_ranks
from prismllm.trace.schema import split_reduce_op


@dataclasses.dataclass
class _Part:
    rank: int
    conn: _Conn
    msg: dict[str, Any]


@dataclasses.dataclass
class _Instance:
    op: str
    granks: tuple[int, ...]
    parts: dict[int, _Part] = dataclasses.field(default_factory=dict)  # group rank -> part


class _Conn:
    """One rank's connection. Replies go out on a thread of its own: a stopped rank reads nothing,
    and whoever answers it (the thread of the member that completed a call) must not wait."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.rank = -1
        self.pid = -1
        self._out: queue.SimpleQueue[dict[str, Any] | None] = queue.SimpleQueue()
        threading.Thread(target=self._send, daemon=True, name="prism-coordinator-send").start()

    def reply(self, msg: dict[str, Any]) -> None:
        self._out.put(msg)

    def _send(self) -> None:
        while (msg := self._out.get()) is not None:
            try:
                send_frame(self.sock, msg)
            except OSError:
                return  # the rank is gone: the launcher reports it

    def close(self) -> None:
        self._out.put(None)


@dataclasses.dataclass
class _Rank:
    """A rank as the scheduler sees it."""

    pid: int
    state: str = "ready"  # running | ready (stopped, may go on) | waiting (stopped on a call) | done
    calls: set = dataclasses.field(default_factory=set)  # its calls not yet answered
    stopped_at: int = -1  # the progress count when it was stopped for waiting
    cpu: int = -1  # its threads' CPU time (ns) at the last look
    gpu: int | None = None  # its GPU (its slots' pool); None on the CPU
    swapping: bool = False  # going on, its device state on its way back: not looked at


def _reduce(flats: list[torch.Tensor], op: str) -> torch.Tensor:
    """The members' inputs reduced as the emulation's proxies reduce them (``pruning.tensors``:
    a real backend's order, half precision summed in float32 and rounded once), then AVG's
    divide by the group size (an integer AVG truncates, as NCCL's)."""
    name, factor = split_reduce_op(op)
    out = reduce(flats, name, factor)
    post_reduce(out, name, len(flats))
    return out


def _flat_input(msg: dict[str, Any]) -> torch.Tensor:
    """A call's inputs (its message's), as one flat tensor."""
    ins = [decode(d) for d in msg["in"]]
    if not ins:  # a scatter's or broadcast's non-root
        return torch.empty(0)
    return torch.cat(ins) if len(ins) > 1 else ins[0]


def _outputs(inst: _Instance, reduce_op: str, root: int) -> dict[int, torch.Tensor]:
    """Each member's (group rank's) outputs, flat, in the order of its output tensors."""
    n = len(inst.granks)
    parts = [inst.parts[i] for i in range(n)]
    op = inst.op
    if op == "barrier":
        return {i: torch.empty(0) for i in range(n)}
    if op == "broadcast":
        src = _flat_input(parts[root].msg)
        return {i: (torch.empty(0) if i == root else src) for i in range(n)}
    flats = [_flat_input(p.msg) for p in parts]
    if op == "all_reduce":
        r = _reduce(flats, reduce_op)
        return {i: r for i in range(n)}
    if op == "reduce":
        r = _reduce(flats, reduce_op)
        return {i: (r if i == root else torch.empty(0)) for i in range(n)}
    if op == "all_gather":
        r = torch.cat(flats)
        return {i: r for i in range(n)}
    if op == "gather":
        return {i: (torch.cat(flats) if i == root else torch.empty(0)) for i in range(n)}
    if op in ("reduce_scatter", "scatter"):
        whole = _reduce(flats, reduce_op) if op == "reduce_scatter" else flats[root]
        m = [int(p.msg["out_numel"]) for p in parts]
        return {i: whole[i * m[i] : (i + 1) * m[i]] for i in range(n)}
    if op == "all_to_all":
        chunks = [list(torch.split(f, list(p.msg["chunks"]))) for f, p in zip(flats, parts)]
        return {j: torch.cat([chunks[i][j] for i in range(n)]) for j in range(n)}
    raise PrismError(f"switch mode cannot carry out {op!r}")


IDLE_SHARE = 0.1  # of the time between two looks: a rank that ran less waits (Coordinator._watch)
LOW_MEMORY_BYTES = 1 << 30  # below this available (or a twentieth of the host's), the capture ends
MEMORY_EVERY = 10  # looks between two checks of the host's memory
DEADLOCK_GRACE_S = 2.0  # how long no rank can go on before the ranks are taken for deadlocked


def _meminfo() -> tuple[int | None, int]:
    """(MemAvailable, MemTotal) in bytes; None where /proc/meminfo cannot say."""
    try:
        fields = dict(ln.split(":", 1) for ln in open("/proc/meminfo").read().splitlines() if ":" in ln)
        return int(fields["MemAvailable"].split()[0]) * 1024, int(fields["MemTotal"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None, 0


def _cpu(pid: int) -> tuple[int | None, bool]:
    """(CPU time of the process's threads in ns, whether one of them is runnable); None when gone."""
    total, runnable = 0, False
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None, False
    for t in tasks:
        try:
            with open(f"/proc/{pid}/task/{t}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue
        runnable |= proc_state(f"/proc/{pid}/task/{t}/stat") == "R"
    return total, runnable


class Coordinator:
    """Serves the ranks of one switch-mode capture; :meth:`close` ends it. ``address`` and
    ``token`` go to every rank (``ChildEnv.switch_address``/``switch_token``)."""

    def __init__(self, world: int, slots: int | None = None, gpus: list[int] | None = None) -> None:
        # every rank at once still watches: a rank that waits is stopped, so that ranks which all
        # wait on one another are found deadlocked instead of hanging
        self.world, self.slots = world, slots if slots is not None else world
        self._look_s = 0.02 if self.slots < world else 0.1
        # on GPUs: each rank's GPU, the slots shared out among them, one swap thread each
        self._gpus = gpus
        pools = sorted(set(gpus)) if gpus is not None else [None]
        self._pool_slots = {g: max(1, self.slots // len(pools)) for g in pools}
        self._swap = GpuSwap() if gpus is not None else None
        self._swaps: dict[int, queue.SimpleQueue] = {g: queue.SimpleQueue() for g in pools if g is not None}
        self.address = f"prism-switch-{secrets.token_hex(8)}"
        self.token = secrets.token_hex(16)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind("\0" + self.address)
        self.sock.listen(1024)
        self._lock = threading.Lock()
        self._instances: dict[tuple[str, int], _Instance] = {}
        self._sends: dict[tuple[str, int, int, int], dict[str, Any]] = {}  # (group, src, dst, k) -> send msg
        self._recvs: dict[tuple[str, int, int, int], _Part] = {}
        self._conns: list[_Conn] = []
        self._closed = False
        self._ranks: dict[int, _Rank] = {}
        self._progress = 0  # calls in and calls answered: what a stopped rank may have waited for
        self.switches = 0  # ranks stopped for waiting
        # why the coordinator ended the ranks, the first line the reason, then what each waited on:
        # a deadlock, or host memory about to run out
        self.ended: list[str] = []
        self._looks = 0
        self._stuck_since: float | None = None  # when no rank could go on, at progress _stuck_at
        self._stuck_at = -1
        for g in self._swaps:
            threading.Thread(target=self._swapper, args=(g,), daemon=True, name=f"prism-swap-gpu{g}").start()
        threading.Thread(target=self._accept, daemon=True, name="prism-coordinator").start()
        self._watcher = threading.Thread(target=self._watch, daemon=True, name="prism-scheduler")
        self._watcher.start()

    # -- connections --
    def _accept(self) -> None:
        while True:
            try:
                s, _ = self.sock.accept()
            except OSError:
                return
            conn = _Conn(s)
            with self._lock:
                if self._closed:
                    s.close()
                    return
                self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: _Conn) -> None:
        hello = recv_frame(conn.sock)
        if not hello or hello.get("t") != "hello" or not secrets.compare_digest(str(hello.get("token")), self.token):
            conn.sock.close()  # not one of this run's ranks: served nothing
            return
        conn.rank, conn.pid = int(hello["rank"]), int(hello.get("pid", -1))
        self._arrive(conn)
        while (msg := recv_frame(conn.sock)) is not None:
            try:
                self._call(conn, msg)
            except PrismError as e:
                conn.reply({"t": "error", "id": msg["id"], "message": str(e)})
        conn.close()
        with self._lock:
            self._ranks[conn.rank].state = "done"
            self._schedule()

    # -- calls --
    def _call(self, conn: _Conn, msg: dict[str, Any]) -> None:
        op, group = msg["op"], msg["group"]
        part = _Part(conn.rank, conn, msg)
        with self._lock:
            self._ranks[conn.rank].calls.add(msg["id"])
            self._progress += 1
        if op in ("send", "recv"):
            src, dst = (conn.rank, msg["peer"]) if op == "send" else (msg["peer"], conn.rank)
            key = (group, src, dst, int(msg["seq"]))
            with self._lock:
                if op == "send":
                    recv = self._recvs.pop(key, None)
                    if recv is None:
                        self._sends[key] = msg
                else:
                    send = self._sends.pop(key, None)
                    if send is None:
                        self._recvs[key] = part
            if op == "send":
                self._answer(part, torch.empty(0))
                if recv is not None:
                    self._answer(recv, _flat_input(msg))
            elif send is not None:
                self._answer(part, _flat_input(send))
            return
        key = (group, int(msg["seq"]))
        granks = tuple(msg["granks"])
        with self._lock:
            inst = self._instances.setdefault(key, _Instance(op, granks))
            if inst.op != op or inst.granks != granks:
                first = next(iter(inst.parts.values()))
                raise PrismError(
                    f"rank {conn.rank} calls {op} #{key[1]} on group {group!r} (ranks {format_ranks(granks)}) where "
                    f"rank {first.rank} called {inst.op} on ranks {format_ranks(inst.granks)}: the ranks' programs "
                    "differ at this call"
                )
            inst.parts[int(msg["grank"])] = part
            complete = len(inst.parts) == len(granks)
            if complete:
                del self._instances[key]
        if complete:
            self._complete(key, inst)

    def _complete(self, key: tuple[str, int], inst: _Instance) -> None:
        first = inst.parts[0].msg
        reduce_op, root = first["reduce"], first["root"]
        for p in inst.parts.values():
            if p.msg["reduce"] != reduce_op or p.msg["root"] != root:
                line = (
                    f"{inst.op} #{key[1]} on group {key[0]!r}: rank {p.rank} asks reduce op {p.msg['reduce']!r}, root "
                    f"{p.msg['root']}, rank {inst.parts[0].rank} {reduce_op!r}, root {root}: the ranks' programs differ"
                )
                for q in inst.parts.values():
                    q.conn.reply({"t": "error", "id": q.msg["id"], "message": line})
                return
        group_root = inst.granks.index(root) if root in inst.granks else -1
        try:
            outs = _outputs(inst, reduce_op, group_root)
        except (PrismError, RuntimeError, ValueError) as e:
            line = f"{inst.op} #{key[1]} on group {key[0]!r} (ranks {format_ranks(inst.granks)}): {e}"
            for q in inst.parts.values():
                q.conn.reply({"t": "error", "id": q.msg["id"], "message": line})
            return
        for i, p in inst.parts.items():
            self._answer(p, outs[i])

    def _answer(self, p: _Part, flat: torch.Tensor) -> None:
        want = int(p.msg["out_numel"])
        if flat.numel() != want:
            p.conn.reply(
                {
                    "t": "error",
                    "id": p.msg["id"],
                    "message": f"rank {p.rank}: {p.msg['op']} #{p.msg['seq']} on group {p.msg['group']!r} gives "
                    f"{flat.numel()} element(s) for an output of {want}: the ranks' tensors differ in size",
                }
            )
            return
        p.conn.reply({"t": "done", "id": p.msg["id"], "out": encode(flat)})
        with self._lock:
            r = self._ranks[p.rank]
            r.calls.discard(p.msg["id"])
            self._progress += 1
            if r.state == "waiting":  # what it waited for may be this
                r.state = "ready"
            self._schedule()

    # -- scheduling (slots) --
    def _arrive(self, conn: _Conn) -> None:
        """A rank's first message: it runs on if a slot of its pool is free, else it stops until one is."""
        with self._lock:
            gpu = self._gpus[conn.rank] if self._gpus is not None else None
            running = self._running_on(gpu)
            self._ranks[conn.rank] = r = _Rank(conn.pid, state="ready", gpu=gpu)
            if running >= self._pool_slots[gpu] or self.ended:
                self._stop(conn.rank, r)
            elif gpu is None:
                r.state = "running"
            else:  # held until the swaps its GPU has queued are done: a rank's memory is out first
                send_signal(r.pid, signal.SIGSTOP)
                self._go_on(conn.rank, r)
            if self.ended:  # a rank that starts after the capture was ended
                send_signal(r.pid, signal.SIGKILL)
                send_signal(r.pid, signal.SIGCONT)
            self._schedule()

    def _schedule(self) -> None:
        """Give free slots to the ranks that can go on, the most waited-for first (under the lock)."""
        while True:
            wanted = None
            for pool, n in self._pool_slots.items():
                free = n - self._running_on(pool)
                ready = [k for k, r in self._ranks.items() if r.state == "ready" and r.gpu == pool]
                if free <= 0 or not ready:
                    continue
                wanted = wanted if wanted is not None else self._wanted()
                for best in sorted(ready, key=lambda k: (-wanted.get(k, 0), k))[:free]:
                    self._go_on(best, self._ranks[best])
            if not self._unstick():
                return

    def _running_on(self, pool: int | None) -> int:
        """How many ranks hold a slot of ``pool`` (a GPU; None on the CPU)."""
        return sum(r.state == "running" and r.gpu == pool for r in self._ranks.values())

    def _stop(self, k: int, r: _Rank) -> None:
        """Stop a rank (under the lock); on a GPU its device state goes out first, on its GPU's thread."""
        if r.gpu is None:
            send_signal(r.pid, signal.SIGSTOP)
        else:
            self._swaps[r.gpu].put(("out", k, r))

    def _go_on(self, k: int, r: _Rank) -> None:
        """Let a rank go on (under the lock); on a GPU once its device state is back."""
        r.state, r.cpu = "running", -1
        if r.gpu is None:
            send_signal(r.pid, signal.SIGCONT)
        else:
            r.swapping = True
            self._swaps[r.gpu].put(("back", k, r))

    def _swapper(self, gpu: int) -> None:
        """One GPU's swaps, in the order decided: a rank's memory is out before the next one's is in.
        A swap the driver refuses ends the capture, saying which rank and call."""
        q = self._swaps[gpu]
        while (item := q.get()) is not None:
            how, k, r = item
            if self.ended:
                continue
            try:
                if how == "out":
                    self._swap.out(r.pid, k, gpu)
                else:
                    self._swap.back(r.pid, k)
            except SwapError as e:
                with self._lock:
                    self._end(f"GPU {gpu}: {e}")
                continue
            if how == "back":
                with self._lock:
                    r.swapping, r.cpu = False, -1

    def _unstick(self) -> bool:
        """No rank can go on and no rank runs: the stopped ranks that stopped before the latest
        progress are given their turn again (what they wait for may have come); where every one
        stopped after it, nothing will come: the ranks are deadlocked. False when none is freed."""
        if any(r.state == "running" for r in self._ranks.values()):
            return False
        stale = [r for r in self._ranks.values() if r.state == "waiting" and r.stopped_at < self._progress]
        for r in stale:
            r.state = "ready"
        if stale:
            return True
        arrived = len(self._ranks) == self.world
        if not (arrived and any(r.state == "waiting" for r in self._ranks.values())):
            self._stuck_since = None
            return False
        # a rank that crashed leaves the others waiting too: the launcher ends the run for it, and
        # names it, within this grace; a deadlock of the program outlasts it
        now = time.monotonic()
        if self._stuck_since is None or self._stuck_at != self._progress:
            self._stuck_since, self._stuck_at = now, self._progress
        elif now - self._stuck_since >= DEADLOCK_GRACE_S:
            self._end("the ranks are deadlocked: every one waits for a call no other rank will make")
        return False

    def _end(self, why: str) -> None:
        """End every rank (under the lock), saying why once."""
        if self.ended:
            return
        self.ended = [why, *self._waiting_lines()]
        for r in self._ranks.values():
            if r.state != "done":
                send_signal(r.pid, signal.SIGCONT)
                send_signal(r.pid, signal.SIGKILL)

    def _memory_check(self) -> None:
        """Host memory about to run out (the ranks' own and the inputs held here): the capture ends
        with a line that says so, before the kernel's OOM killer picks a process."""
        available, total = _meminfo()
        if available is None or available >= min(LOW_MEMORY_BYTES, total // 20):
            return
        held = sum(len(d["data"]) for p in self._held() for d in p["in"])
        self._end(
            f"host memory is about to run out ({available / 2**30:.2f} of {total / 2**30:.1f} GiB available; the "
            f"coordinator holds {held / 2**20:.1f} MiB of inputs): run fewer ranks at a time (--parallel), or a "
            "smaller world, or on a machine with more memory"
        )

    def _held(self) -> list[dict[str, Any]]:
        """The messages whose inputs the coordinator holds (parts of incomplete calls, sends not received)."""
        return [p.msg for inst in self._instances.values() for p in inst.parts.values()] + list(self._sends.values())

    def _wanted(self) -> dict[int, int]:
        """Per rank: how many incomplete calls wait for it (its part not in)."""
        out: dict[int, int] = {}
        for inst in self._instances.values():
            for i, r in enumerate(inst.granks):
                if i not in inst.parts:
                    out[r] = out.get(r, 0) + 1
        for _, src, _, _ in self._recvs:
            out[src] = out.get(src, 0) + 1
        return out

    def _watch(self) -> None:
        """Every 20 ms (100 ms with every rank at once): a running rank with a call in that ran (almost)
        no CPU time since the last look, none of its threads runnable, waits for the coordinator:
        stopped (:meth:`_to_stop` says which), its slot given on."""
        while True:
            time.sleep(self._look_s)
            with self._lock:
                if self._closed:
                    return
                idle = set()
                for k, r in self._ranks.items():
                    if r.state != "running" or not r.calls or r.swapping:
                        continue
                    cpu, runnable = _cpu(r.pid)
                    # a waiting rank's threads still wake now and then (the status board, torch's
                    # own): idle is under a tenth of the time between looks, nothing runnable
                    if (
                        cpu is not None
                        and r.cpu >= 0
                        and cpu - r.cpu < IDLE_SHARE * self._look_s * 1e9
                        and not runnable
                    ):
                        idle.add(k)
                    r.cpu = cpu if cpu is not None else -1
                for k in self._to_stop(idle):
                    r = self._ranks[k]
                    self._stop(k, r)
                    r.state, r.stopped_at = "waiting", self._progress
                    self.switches += 1
                self._looks += 1
                if self._looks % MEMORY_EVERY == 0:
                    self._memory_check()
                self._schedule()

    def _to_stop(self, idle: set[int]) -> list[int]:
        """Of the ranks that wait (``idle``), those to stop (under the lock). A rank stays while a
        member it waits for runs (its answer comes with no switch: two GPU swaps saved). Where a
        pool's slots are all taken and a rank is ready to come in, a waiting rank stays whose
        missing member is among those ready, so that the ranks of a group come to share the slots
        (else a TP pair that took turns on one slot would switch at every collective): the ranks
        none of whose members are ready are stopped, or else the one with the fewest of them."""
        missing = {k: self._missing(k) for k in idle}
        busy = {k for k, r in self._ranks.items() if r.state == "running" and k not in idle}
        waiting = [k for k in sorted(idle) if not missing[k] & busy]
        ready = {k for k, r in self._ranks.items() if r.state == "ready"}
        out = []
        for pool, n in self._pool_slots.items():
            ws = [k for k in waiting if self._ranks[k].gpu == pool]
            full = self._running_on(pool) >= n
            if not (ws and full and any(self._ranks[k].gpu == pool for k in ready)):
                out += ws
                continue
            score = {k: len(missing[k] & ready) for k in ws}  # its missing members that could come in
            none_ready = [k for k in ws if score[k] == 0]
            out += none_ready or [min(ws, key=lambda k: (score[k], -k))]
        return out

    def _missing(self, k: int) -> set[int]:
        """The ranks whose parts the incomplete calls of rank ``k`` wait for."""
        out: set[int] = set()
        for inst in self._instances.values():
            if any(p.rank == k for p in inst.parts.values()):
                out.update(r for i, r in enumerate(inst.granks) if i not in inst.parts)
        out.update(src for _, src, dst, _ in self._recvs if dst == k)
        return out

    # -- state --
    def waiting(self) -> list[str]:
        """One line per call that waits for a member: what is in and who is missing (for a stall)."""
        with self._lock:
            return self._waiting_lines()

    def _waiting_lines(self) -> list[str]:
        lines = []
        for (group, seq), inst in sorted(self._instances.items()):
            members = [inst.granks[i] for i in sorted(inst.parts)]
            missing = [r for i, r in enumerate(inst.granks) if i not in inst.parts]
            lines.append(
                f"{inst.op} #{seq} on group {group!r}: in from rank(s) {format_ranks(members)}, "
                f"waiting for {format_ranks(missing)}"
            )
        for group, src, dst, k in sorted(self._recvs):
            lines.append(f"recv #{k} on group {group!r}: rank {dst} waits for rank {src}'s send")
        return lines

    def swaps(self) -> dict[str, Any] | None:
        """What moving the GPU ranks' device state out and back cost (None on the CPU)."""
        return self._swap.summary() if self._swap is not None else None

    def close(self) -> None:
        for q in self._swaps.values():
            q.put(None)
        with self._lock:
            self._closed = True
            conns = list(self._conns)
            for r in self._ranks.values():  # none is left stopped
                if r.state != "done":
                    send_signal(r.pid, signal.SIGCONT)
        if self._watcher is not threading.current_thread():
            self._watcher.join()  # no look after the close (at a rank it no longer serves)
        for c in conns:
            c.close()
        for s in [self.sock, *(c.sock for c in conns)]:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()


__all__ = ["Coordinator"]
