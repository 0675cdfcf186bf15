"""A torchrun-shaped process launcher, reused by every stage that runs rank processes
(``prism record``, solo capture, slice timing, emulation).

``launch(LaunchSpec(...))`` starts one process per rank, each running

    <python> -m prismllm.comm.bootstrap SCRIPT ARGS...      (``runner=None``: <python> SCRIPT ARGS)

with the environment torchrun gives its workers (RANK, LOCAL_RANK, WORLD_SIZE, ... see
``torchrun_env``), and supervises them:

- Output: each rank's stdout and stderr are passed through line by line (never interleaved
  inside a line), optionally prefixed with the rank, optionally also written to per-rank log
  files (torchrun's ``--tee``), and the last lines of each are kept in a bounded buffer.
- Failure: as soon as a rank exits non-zero or is killed by a signal, every other rank is
  ended (SIGTERM to its process group, SIGKILL after ``grace_period``; ``settle`` seconds
  first, in which a process already on its way out keeps its own exit status) and the result
  names the *first* rank that failed, its exit code or signal, and the last lines of its
  stderr. A first failure whose error only says that a peer went away (gloo's "Connection
  closed by peer", ...) is the consequence of another's: when another process failed on its
  own with an error of its own (or a signal), that one is named instead.
- Timeout: ``timeout`` seconds after the start, all ranks still running are ended and named.
- No progress: every child answers status requests (``prismllm.launch.status``). When no process made
  a communication call, wait or iteration boundary for ``status_after`` seconds, the launcher
  prints where each stands (its program's line, the call it is in, its last calls; the
  assistant: each proxy's call with the sandbox), again after twice as long, and so on; the
  same report ends a timeout's message, and is printed on Ctrl-C after 10 s without progress.
- No process is left behind, however the launcher ends: children run in their own session
  (so a terminal's Ctrl-C reaches only the launcher, which then ends them), every exit path of
  ``launch`` goes through one clean-up, SIGTERM/SIGHUP/SIGINT to the launcher end the children
  first, and on Linux each child has ``PR_SET_PDEATHSIG=SIGKILL`` so it dies even when the
  launcher is SIGKILLed. (PDEATHSIG follows the *thread* that started the child: call
  ``launch`` from a thread that outlives the run, e.g. the main thread; it blocks until the end.)

Devices: ``"cpu"`` hides GPUs from the ranks (``CUDA_VISIBLE_DEVICES=""``; processes stand in
for devices). A list of GPU indices gives rank ``local_rank`` the GPU ``devices[local_rank]``;
as with torchrun, LOCAL_RANK selects the GPU: when the list is ``0..nproc-1`` the parent's
``CUDA_VISIBLE_DEVICES`` is left alone, otherwise it is narrowed to the listed GPUs (indices
into the parent's visible list) so that LOCAL_RANK still selects the right one. A list that
names a GPU twice (``[0, 0]``), or ``LaunchSpec.own_hosts``, makes every process its own host
to NCCL (``NCCL_HOSTID``; LOCAL_RANK 0, its GPU alone visible), so that several may share one
GPU: NCCL then connects them through its network transport, which gives the right values and
memory but not the timing of GPUs linked directly (for one-GPU machines: tests, correctness).

Helpers (``LaunchSpec.extra``, e.g. an emulation assistant) are children like the ranks: same
supervision, output and clean-up; they appear under negative ids and their own names.

Every child always gets ``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` and
``NVSHMEM_DISABLE_NVLS=1`` (NVLink multicast stays off on the lent machines).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from datetime import timedelta
from pathlib import Path

from prismllm.childenv import ChildEnv, read_error
from prismllm.errors import StorageError
from prismllm.launch.environment import (
    build_env,
    build_extra_env,
    child_command,
    device_env,
)
from prismllm.launch.gate import StoreGate, StoreTunnel
from prismllm.launch.messages import (
    error_file_message,
    error_line,
    failure_message,
    has_error_line,
    lost_peer,
    says_storage_error,
    who_is,
)
from prismllm.launch.output import OutputPump, Stream, default_sink
from prismllm.launch.processes import Watchdog, groups_alive, killpg, pdeathsig_preexec, proc_state
from prismllm.launch.spec import (
    LAUNCHER_ID,
    STATUS_PREFIX,
    LaunchError,
    LaunchInterrupted,
    LaunchResult,
    LaunchSpec,
    RankFailure,
)
from prismllm.launch.status import StatusBoard


def host_store(addr: str, port: int = 0):
    """The run's rendezvous TCPStore, hosted by the launcher on ``port`` (0: one the kernel
    picks) that stays bound until the store is dropped (torchrun's agent store).

    It listens on ``addr`` alone (127.0.0.1 unless a multi-host run named its endpoint): torch's
    TCPStore server binds every interface whatever host it is given (seen with ``ss -ltnp``:
    ``*:PORT``, IPv4 and IPv6, and it served other addresses), so the launcher binds the socket
    itself and hands it over (``master_listen_fd``)."""
    # torch once a run starts: the CLI's parsing and its refusals of bad input never load it
    from torch.distributed import TCPStore

    try:
        family, _, _, _, where = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as e:
        raise LaunchError(f"cannot host the rendezvous store on {addr}:{port}: {e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(where)
        sock.listen(512)
        kw = dict(is_master=True, wait_for_workers=False, timeout=timedelta(minutes=30), master_listen_fd=sock.fileno())
        try:
            store = TCPStore(addr, sock.getsockname()[1], **kw)
        except (RuntimeError, ValueError):  # a torch whose libuv server cannot take a socket: the older server can
            store = TCPStore(addr, sock.getsockname()[1], use_libuv=False, **kw)
    except (RuntimeError, ValueError, OSError) as e:
        sock.close()
        raise LaunchError(f"cannot host the rendezvous store on {addr}:{port}: {e}") from None
    sock.detach()  # the store's server owns the listening socket now
    return store


def _resolve_ranks(spec: LaunchSpec) -> list[int]:
    ranks = list(range(spec.nproc)) if spec.ranks is None else [int(r) for r in spec.ranks]
    if len(ranks) != spec.nproc:
        raise LaunchError(f"{len(ranks)} ranks given for nproc={spec.nproc}")
    world = spec.world_size if spec.world_size is not None else spec.nproc
    if len(set(ranks)) != len(ranks) or any(r < 0 or r >= world for r in ranks):
        raise LaunchError(f"ranks {ranks} are not distinct ranks of a world of {world}")
    return ranks


# ---------------------------------------------------------------------------------------------
# The launcher


class _Signalled(BaseException):
    def __init__(self, signum: int):
        self.signum = signum


@dataclasses.dataclass
class _Job:
    """A child to start: id (a rank, or an extra's negative id), local rank (-1: an extra),
    command, environment, torchelastic's error file, output prefix, passed through or not, name
    of its logs."""

    id: int
    local_rank: int
    cmd: list[str]
    env: dict[str, str]
    error_file: str | None
    prefix: str
    visible: bool
    log_name: str


@dataclasses.dataclass
class _Child:
    rank: int
    local_rank: int
    proc: subprocess.Popen
    error_file: str | None  # torch.distributed.elastic's (@record)
    prism_error_file: str  # the ChildError prism reports (prismllm.childenv.report_error)
    returncode: int | None = None
    ended_by_launcher: bool = False
    exit_t: float | None = None  # when the launcher saw it exit (monotonic)


def _stopped(pid: int) -> bool:
    """Whether the process is stopped (SIGSTOP: switch mode's coordinator stops a rank that waits;
    or a debugger): it cannot answer a status request until it is continued."""
    return proc_state(f"/proc/{pid}/stat") in ("T", "t")


class _Launcher:
    def __init__(self, spec: LaunchSpec):
        self.spec = spec
        self.children: list[_Child] = []
        self.exits: queue.Queue[tuple[int, int, float]] = queue.Queue()
        self.pump: OutputPump | None = None
        self.watchdog: Watchdog | None = None
        self.store = None  # the rendezvous TCPStore when the launcher hosts it
        self.gate: StoreGate | StoreTunnel | None = None  # multi-host with a token (prismllm.launch.gate)
        self.cleaning = False
        self.deferring = False
        self.deferred = 0
        self.escalate = threading.Event()
        self.old_handlers: dict[int, object] = {}
        self.names: dict[int, str] = {}  # extra id -> name
        self.board: StatusBoard | None = None  # the children's status files (prismllm.launch.status)
        self.status_kept = False  # a report named the status directory: keep it
        self.status_lines: list[str] = []  # the report a timeout's message ends with

    # -- signals -----------------------------------------------------------------------------
    def _on_signal(self, signum, frame) -> None:
        if self.cleaning:
            self.escalate.set()  # a second signal while ending the ranks: SIGKILL now
            return
        if self.deferring:  # inside Popen: raising there could lose a started child
            self.deferred = self.deferred or signum
            return
        raise _Signalled(signum)

    def _raise_deferred(self) -> None:
        if self.deferred:
            signum, self.deferred = self.deferred, 0
            raise _Signalled(signum)

    def _install_signals(self) -> None:
        if not self.spec.handle_signals or threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            try:
                self.old_handlers[sig] = signal.signal(sig, self._on_signal)
            except (ValueError, OSError):
                pass

    def _restore_signals(self) -> None:
        for sig, h in self.old_handlers.items():
            try:
                signal.signal(sig, h)
            except (ValueError, OSError, TypeError):
                pass
        self.old_handlers.clear()

    # -- processes ---------------------------------------------------------------------------
    def _waiter(self, child: _Child) -> None:
        rc = child.proc.wait()
        self.exits.put((child.rank, rc, time.monotonic()))

    def _alive(self) -> list[_Child]:
        # proc.returncode is set by the waiter thread's wait() even if its event was lost.
        return [c for c in self.children if c.returncode is None and c.proc.returncode is None]

    def _drain_exits(self, timeout: float) -> list[tuple[int, int, float]]:
        """Collect exit events, blocking up to ``timeout`` for the first."""
        out = []
        try:
            out.append(self.exits.get(timeout=timeout) if timeout > 0 else self.exits.get_nowait())
            while True:
                out.append(self.exits.get_nowait())
        except queue.Empty:
            pass
        by_rank = {c.rank: c for c in self.children}
        for rank, rc, t in out:
            by_rank[rank].returncode = rc
            by_rank[rank].exit_t = t
        return out

    def _settle(self, seconds: float) -> None:
        """Let the live children exit on their own for up to ``seconds``."""
        deadline = time.monotonic() + max(0.0, seconds)
        while self._alive() and time.monotonic() < deadline:
            self._drain_exits(min(0.05, max(0.0, deadline - time.monotonic())))

    def _cause(self, failure: RankFailure, stderr_tail: Mapping[int, list[str]]) -> RankFailure:
        """The first failure, unless its error only says that a peer went away and another
        process failed on its own: it exited with an error of its own or a signal, or it had
        already reported an error of its own when the launcher ended it (a process still
        tearing down after its exception, on a loaded machine). Then the earliest of those,
        the cause of the cascade."""
        if not lost_peer(stderr_tail.get(failure.rank, [])):
            return failure

        def own_error(c: _Child) -> bool:
            tail = stderr_tail.get(c.rank, [])
            if lost_peer(tail):
                return False
            return not c.ended_by_launcher or has_error_line(tail)

        causes = [c for c in self.children if c.rank != failure.rank and (c.returncode or 0) != 0 and own_error(c)]
        if not causes:
            return failure
        c = min(causes, key=lambda c: c.exit_t if c.exit_t is not None else float("inf"))
        return RankFailure("exit" if c.returncode > 0 else "signal", c.rank, c.returncode, [], [])

    def _end_all(self) -> None:
        """SIGTERM every live child's process group, SIGKILL after the grace period, and end
        whatever the children left in their groups. A stopped child (switch mode's coordinator
        stops the ranks that wait) is continued, or it would hold its SIGTERM until the SIGKILL."""
        alive = self._alive()
        for c in alive:
            c.ended_by_launcher = True
            killpg(c.proc.pid, signal.SIGTERM)
            killpg(c.proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + max(0.0, self.spec.grace_period)
        while self._alive() and time.monotonic() < deadline and not self.escalate.is_set():
            self._drain_exits(0.05)
        for c in self._alive():
            killpg(c.proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10.0
        while self._alive() and time.monotonic() < deadline:
            self._drain_exits(0.05)
        # Grandchildren (e.g. data-loader workers) that outlive their rank.
        leftover = groups_alive([c.proc.pid for c in self.children])
        for pg in leftover:
            killpg(pg, signal.SIGTERM)
        deadline = time.monotonic() + min(max(0.0, self.spec.grace_period), 2.0)
        while leftover and time.monotonic() < deadline and not self.escalate.is_set():
            time.sleep(0.02)
            leftover = groups_alive(leftover)
        for pg in leftover:
            killpg(pg, signal.SIGKILL)

    # -- run ---------------------------------------------------------------------------------
    def run(self) -> LaunchResult:
        spec = self.spec
        if spec.nproc < 1 and not (spec.nproc == 0 and spec.extra and spec.master_port is not None):
            raise LaunchError(
                f"nproc must be at least 1, not {spec.nproc} (0 only for extras that "
                f"meet another launcher's store: master_port given)"
            )
        if spec.nproc and not os.path.isfile(spec.script):
            raise LaunchError(f"script not found: {spec.script}")
        ranks = _resolve_ranks(spec)
        device_env(spec.devices, spec.nproc, os.environ)  # validate before starting anything
        port = self._rendezvous()
        run_id = spec.run_id or uuid.uuid4().hex[:12]
        log_dir = Path(spec.log_dir) if spec.log_dir is not None else None
        try:
            if log_dir is not None:
                log_dir.mkdir(parents=True, exist_ok=True)
            err_dir = tempfile.mkdtemp(prefix="prism-launch-")
            try:
                return self._run(ranks, port, run_id, log_dir, err_dir)
            finally:
                shutil.rmtree(err_dir, ignore_errors=True)
        finally:
            if self.gate is not None:
                self.gate.close()

    def _rendezvous(self) -> int:
        """The port this launch's processes meet at. Hosted here (``master_port`` None): the store,
        on ``master_addr``, or with a token on loopback behind a gate on ``master_addr``; another
        launcher's (``master_port`` given): that port, or with a token a tunnel to it on loopback.
        Behind a gate or through a tunnel the processes are told 127.0.0.1."""
        spec = self.spec
        if spec.rdzv_token is None:
            if spec.master_port is not None:
                return spec.master_port
            self.store = host_store(spec.master_addr, spec.store_port)  # bound until the run ends
            return self.store.port

        def say(line: str) -> None:
            self._print([line])

        if spec.master_port is None:
            self.store = host_store("127.0.0.1", 0)
            self.gate = StoreGate(spec.master_addr, spec.store_port, self.store.port, spec.rdzv_token, say)
            port = self.store.port
        else:
            wait = spec.timeout if spec.timeout is not None else 1800.0
            self.gate = StoreTunnel((spec.master_addr, spec.master_port), spec.rdzv_token, say, wait)
            port = self.gate.port
        self.spec = dataclasses.replace(spec, master_addr="127.0.0.1")
        return port

    def _spawn(
        self,
        ranks: list[int],
        port: int,
        run_id: str,
        log_dir: Path | None,
        err_dir: str,
        streams: list[Stream],
        logs: list,
    ) -> None:
        spec = self.spec
        show = None if spec.show_ranks is None else {int(r) for r in spec.show_ranks}
        cmd = child_command(spec)
        preexec = pdeathsig_preexec(os.getpid())
        if spec.watchdog:
            try:
                self.watchdog = Watchdog(spec.python)
            except OSError:
                self.watchdog = None  # a bad spec.python: reported when starting rank 0
        jobs: list[_Job] = []
        for local_rank, rank in enumerate(ranks):
            error_file = os.path.join(err_dir, f"error-{rank}.json")
            env = build_env(
                spec,
                rank=rank,
                local_rank=local_rank,
                master_port=port,
                run_id=run_id,
                agent_store=self.store is not None,
                error_file=error_file,
            )
            prefix = (spec.line_prefix or "").format(rank=rank, local_rank=local_rank)
            visible = spec.passthrough and (show is None or rank in show)
            jobs.append(_Job(rank, local_rank, cmd, env, error_file, prefix, visible, f"rank-{rank:06d}"))
        for i, ex in enumerate(spec.extra):
            xid = -(i + 1)
            self.names[xid] = ex.name
            env = build_extra_env(spec, ex, i, master_port=port, run_id=run_id)
            prefix = f"[{ex.name}]: " if spec.line_prefix else ""
            slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", ex.name)
            jobs.append(_Job(xid, -1, list(ex.argv), env, None, prefix, spec.passthrough, slug))
        status_dir = log_dir / "status" if log_dir is not None else Path(tempfile.mkdtemp(prefix="prism-status-"))
        if self.watchdog is not None:  # a launcher killed with SIGKILL leaves no temporary directory either
            self.watchdog.remove(err_dir)
            if log_dir is None:
                self.watchdog.remove(status_dir)
        self.board = StatusBoard(status_dir, {j.id: j.log_name for j in jobs})
        for job in jobs:
            rank, cmd, env = job.id, job.cmd, job.env
            prism_error = os.path.join(err_dir, f"prism-error-{rank}.json")
            env.update(self.board.env(rank))
            env.update(ChildEnv(error_file=prism_error).to_env())
            what = f"rank {rank}" if rank >= 0 else self.names[rank]
            self.deferring = True
            try:
                proc = subprocess.Popen(
                    cmd,
                    env=env,
                    cwd=spec.cwd,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    start_new_session=True,
                    preexec_fn=preexec,
                    close_fds=True,
                )
            except OSError as e:
                raise LaunchError(f"could not start {what} ({cmd[0]}): {e}") from e
            finally:
                self.deferring = False
            child = _Child(rank, job.local_rank, proc, job.error_file, prism_error)
            self.children.append(child)
            if self.watchdog is not None:
                self.watchdog.watch(proc.pid)  # start_new_session: pgid == pid
            for name, pipe in (("stdout", proc.stdout), ("stderr", proc.stderr)):
                fd = os.dup(pipe.fileno())  # owned by the pump from here on
                pipe.close()
                log = None
                if log_dir is not None:
                    log = open(log_dir / f"{job.log_name}.{name}.log", "wb")
                    logs.append(log)
                tail = collections.deque(maxlen=max(1, spec.tail_lines))
                streams.append(Stream(rank, job.local_rank, name, fd, tail, job.visible, job.prefix, log))
            threading.Thread(
                target=self._waiter, args=(child,), daemon=True, name=f"prism-launcher-wait-{rank}"
            ).start()
            self._raise_deferred()

    def _who(self, ids: Sequence[int]) -> str:
        return who_is(ids, self.names)

    def _status_report(self, head: str) -> list[str]:
        """``head`` and where each live child stands (``prismllm.launch.status``)."""
        if self.board is None:
            return []
        live = self._alive()
        alive = sorted((c.rank for c in live), key=lambda r: (r < 0, abs(r)))
        stopped = {c.rank for c in live if _stopped(c.proc.pid)}
        where = self.board.report(alive, self._who, stopped=stopped)
        if not where:  # plain scripts: nothing to ask
            return []
        self.status_kept = True
        if self.watchdog is not None:
            self.watchdog.keep(self.board.dir)
        return [head, *where, f"  every thread's stack, per process: {self.board.dir}{os.sep}*.status"]

    def _print(self, lines: list[str]) -> None:
        sink = self.spec.sink or default_sink
        for ln in lines:
            sink(LAUNCHER_ID, "stderr", f"{STATUS_PREFIX}{ln}\n")

    def _supervise(self, t0: float) -> RankFailure | None:
        spec = self.spec
        deadline = None if spec.timeout is None else t0 + spec.timeout
        linger: float | None = None  # when every rank had exited 0 while extras still ran
        report_after = spec.status_after
        next_check = time.monotonic()
        while self._alive():
            if spec.cancel is not None and spec.cancel.is_set():
                raise _Signalled(signal.SIGTERM)
            now = time.monotonic()
            if spec.status_after is not None and self.board is not None and now >= next_check:
                next_check = now + 1.0
                idle = self.board.poll_progress()
                if idle < spec.status_after:
                    report_after = spec.status_after
                elif idle >= report_after:
                    self._print(self._status_report(f"no communication for {idle:.0f} s; where each process stands:"))
                    report_after = 2 * idle
            wait = 0.25 if deadline is None else min(0.25, max(0.0, deadline - time.monotonic()))
            events = self._drain_exits(wait)
            failed = [e for e in events if e[1] != 0]
            if failed:
                self._settle(spec.settle)
                rank, rc, _ = min(failed, key=lambda e: e[2])  # the earliest exit is the cause
                return RankFailure("exit" if rc > 0 else "signal", rank, rc, [], [])
            if deadline is not None and time.monotonic() >= deadline and self._alive():
                running = sorted(c.rank for c in self._alive())
                self.status_lines = self._status_report("where each process stood:")
                return RankFailure("timeout", None, None, running, [])
            alive = self._alive()
            if spec.nproc and alive and all(c.rank < 0 for c in alive):  # only extras left
                now = time.monotonic()
                linger = now if linger is None else linger
                if now - linger >= spec.extra_grace:
                    return RankFailure("lingering", None, None, sorted(c.rank for c in alive), [])
        # Everything exited; a failure may still sit in the queue or only in proc.returncode.
        self._drain_exits(0)
        failed = [c for c in self.children if (c.returncode or c.proc.returncode or 0) != 0]
        if failed:
            c = failed[0]
            rc = c.returncode if c.returncode is not None else c.proc.returncode
            return RankFailure("exit" if rc > 0 else "signal", c.rank, rc, [], [])
        return None

    def _run(self, ranks: list[int], port: int, run_id: str, log_dir: Path | None, err_dir: str) -> LaunchResult:
        spec = self.spec
        streams: list[Stream] = []
        logs: list = []
        t0 = time.monotonic()
        failure: RankFailure | None = None
        interrupted: int | None = None
        self._install_signals()
        try:
            try:
                self._spawn(ranks, port, run_id, log_dir, err_dir, streams, logs)
                self.pump = OutputPump(streams, spec.sink or default_sink)
                self.pump.start()
                if spec.on_start is not None:
                    spec.on_start({c.rank: c.proc.pid for c in self.children})
                failure = self._supervise(t0)
            except _Signalled as s:
                interrupted = s.signum
                self.cleaning = True  # a second signal now ends the children at once
                if s.signum == signal.SIGINT and self.board is not None and self.board.poll_progress() >= 10:
                    # stopped after a while without progress: most likely a hang, so say where
                    self._print(self._status_report("interrupted; where each process stood:"))
        finally:
            self.cleaning = True
            try:
                self._end_all()
                if self.pump is not None:
                    self.pump.finish(timeout=5.0)
                else:
                    for s in streams:
                        try:
                            os.close(s.fd)
                        except OSError:
                            pass
            finally:
                if self.watchdog is not None:
                    self.watchdog.release()
                for log in logs:
                    try:
                        log.close()
                    except OSError:
                        pass
                if self.board is not None and log_dir is None and not self.status_kept:
                    shutil.rmtree(self.board.dir, ignore_errors=True)
                self._restore_signals()
        if interrupted is not None:
            if interrupted == signal.SIGINT:
                raise KeyboardInterrupt
            raise LaunchInterrupted(interrupted)

        wall = time.monotonic() - t0
        for c in self.children:
            if c.returncode is None:
                c.returncode = c.proc.returncode
        stderr_tail = {s.rank: list(s.tail) for s in streams if s.name == "stderr"}
        stdout_tail = {s.rank: list(s.tail) for s in streams if s.name == "stdout"}
        ended = sorted(c.rank for c in self.children if c.ended_by_launcher)
        # what each child reported of its own error (prismllm.childenv.report_error), read once
        errors = {c.rank: e for c in self.children if (e := read_error(c.prism_error_file)) is not None}
        message = ""
        if failure is not None:
            efm = None
            if failure.rank is not None:
                failure = self._cause(failure, stderr_tail)
                failure.stderr_tail = stderr_tail.get(failure.rank, [])
                child = next(c for c in self.children if c.rank == failure.rank)
                efm = error_file_message(child.error_file)
                failure.error = errors.get(failure.rank)
            message = failure_message(
                failure,
                timeout=spec.timeout,
                stdout_tail=stdout_tail.get(failure.rank, []) if failure.rank is not None else [],
                error_file_msg=efm,
                ended=[r for r in ended if r != failure.rank],
                log_dir=log_dir,
                names=self.names,
                extra_grace=spec.extra_grace,
                status=self.status_lines,
            )
        return LaunchResult(
            ok=failure is None,
            ranks=ranks,
            returncodes={c.rank: c.returncode for c in self.children},
            ended_by_launcher=ended,
            pids={c.rank: c.proc.pid for c in self.children},
            wall_s=wall,
            master_port=port,
            run_id=run_id,
            log_dir=log_dir,
            failure=failure,
            message=message,
            stdout_tail=stdout_tail,
            stderr_tail=stderr_tail,
            names=dict(self.names),
            errors={c.rank: errors[c.rank] for c in self.children if c.rank in errors and (c.returncode or 0) > 0},
        )


def launch(spec: LaunchSpec) -> LaunchResult:
    """Run ``spec.nproc`` rank processes to completion (see the module docstring).

    Returns a LaunchResult (``ok`` False with ``message`` on a rank failure or timeout; call
    ``raise_for_failure()`` to turn that into a LaunchError). Raises LaunchError if the job
    cannot start, LaunchInterrupted on SIGTERM/SIGHUP, KeyboardInterrupt on SIGINT, and
    StorageError when a child failed on a full disk or a failing file system (no stage can do
    anything else with its failure), in every case after all children have been ended.
    """
    result = _Launcher(spec).run()
    for c in sorted(c for c, rc in result.returncodes.items() if (rc or 0) > 0):
        err, tail = result.errors.get(c), result.stderr_tail.get(c, [])
        if err is not None and err.kind == "storage":
            raise StorageError(f"{who_is([c], result.names)}: {err.message}")
        if err is None and says_storage_error(tail):  # a child that could not write its error file either
            raise StorageError(f"{who_is([c], result.names)}: {error_line(tail)[0]}")
    return result
