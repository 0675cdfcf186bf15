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
- No progress: every child answers status requests (``prismllm.status``). When no process made
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
import json
import os
import queue
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Callable, Mapping, Sequence

from prismllm.errors import PrismError
from prismllm.status import StatusBoard

DEFAULT_RUNNER = "prismllm.comm.bootstrap"

# Set in every child, after any override: multicast/NVLS must stay off on these machines.
NVLS_OFF_ENV: dict[str, str] = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}

# Variables the elastic agent of torchrun sets for each worker
# (torch/distributed/elastic/agent/server/local_elastic_agent.py, _start_workers).
TORCHRUN_ENV_VARS = (
    "RANK",
    "LOCAL_RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_NAME",
    "LOCAL_WORLD_SIZE",
    "WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "TORCHELASTIC_ERROR_FILE",
)

LineSink = Callable[[int, str, str], None]  # (rank, "stdout" | "stderr", line with its "\n")
LAUNCHER_ID = -(10**9)  # the id the launcher's own lines (status reports) carry to a sink
STATUS_PREFIX = "prism: "  # how the launcher's own lines begin


@dataclasses.dataclass
class ExtraProcess:
    """A helper process supervised with the ranks (an emulation assistant): started after
    them, with the launcher's environment plus MASTER_ADDR/MASTER_PORT (the run's store),
    ``LaunchSpec.env`` and ``env`` (no torchrun rank variables; GPUs hidden with "cpu");
    ended with them however the run ends; a failure of it ends the run like a rank's.
    In results it appears under a negative id (-1 for the first extra, -2, ...) and in
    messages under ``name``."""

    name: str  # e.g. "assistant"
    argv: Sequence[str]  # the full command line
    env: Mapping[str, str | None] = dataclasses.field(default_factory=dict)


class LaunchError(PrismError):
    """A launch that could not start, or whose ranks failed; ``result`` has the details."""

    def __init__(self, message: str, result: "LaunchResult | None" = None):
        super().__init__(message)
        self.result = result


class LaunchInterrupted(PrismError):
    """The launcher received SIGTERM or SIGHUP; every rank has been ended."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"received {signal.Signals(signum).name}; all ranks were ended")


@dataclasses.dataclass
class LaunchSpec:
    nproc: int  # processes to start on this host (LOCAL_WORLD_SIZE)
    script: str  # the user's program
    args: Sequence[str] = ()
    # Environment overrides for every rank, applied over the torchrun set (None removes a
    # variable); ``rank_env`` per global rank, applied after ``env``.
    env: Mapping[str, str | None] = dataclasses.field(default_factory=dict)
    rank_env: Mapping[int, Mapping[str, str | None]] = dataclasses.field(default_factory=dict)
    devices: str | Sequence[int] = "cpu"  # "cpu" or GPU indices, one per local rank
    # Every process (ranks and extras) is told it is its own host (``own_host_env``), so that
    # processes may share a GPU; implied by a GPU list that names a GPU twice.
    own_hosts: bool = False
    # Global ranks of the processes (default 0..nproc-1) and the world size they see
    # (default nproc): a stage may run a few ranks of a larger logical world.
    ranks: Sequence[int] | None = None
    world_size: int | None = None
    master_addr: str = "127.0.0.1"
    # None: the launcher hosts the rendezvous TCPStore itself on a port it keeps bound for
    # the whole run (torchrun's agent store), so no other process can take the port between
    # choosing it and rank 0 listening on it. A given port: rank 0 hosts the store there.
    master_port: int | None = None
    # With master_port None: the port the launcher's store binds (0: the kernel picks one). A
    # fixed one is a rendezvous endpoint other launchers' processes can reach (multi-host
    # emulation: torchrun's --rdzv-endpoint). With no ranks (nproc 0, extras only) and
    # master_port given, nothing is hosted: the extras meet another launcher's store.
    store_port: int = 0
    run_id: str | None = None  # TORCHELASTIC_RUN_ID; None: a fresh one
    runner: str | None = DEFAULT_RUNNER  # module run as ``python -m runner SCRIPT``; None: SCRIPT
    python: str = sys.executable
    cwd: str | None = None
    # Output.
    passthrough: bool = True  # pass each rank's lines to the launcher's stdout/stderr
    show_ranks: Sequence[int] | None = None  # pass through only these ranks (torchrun --local-ranks-filter)
    line_prefix: str | None = None  # e.g. "[rank{rank}]: " ({rank}, {local_rank})
    log_dir: str | os.PathLike | None = None  # per-rank log files (torchrun --tee)
    sink: LineSink | None = None  # where passed-through lines go; None: sys.stdout / sys.stderr
    tail_lines: int = 20  # lines of stdout and stderr kept per rank for the failure report
    # Supervision.
    timeout: float | None = None  # seconds; None: no limit
    # seconds without any child's progress before the launcher prints where each stands
    # (prismllm.status; None: never, except in a timeout's message); default $PRISM_STATUS_AFTER
    # ("off": never), else 300
    status_after: float | None = dataclasses.field(default_factory=lambda: status_after_default())
    grace_period: float = 5.0  # between SIGTERM and SIGKILL when ending ranks
    handle_signals: bool = True  # install SIGTERM/SIGHUP/SIGINT handlers (main thread only)
    watchdog: bool = True  # a helper process that ends the ranks' process groups if the
    #                        launcher itself is SIGKILLed (PDEATHSIG alone reaches only the ranks)
    # Helper processes (ids -1, -2, ... in results), and how long they may outlive the ranks:
    # once every rank exited 0, an extra still running after ``extra_grace`` s fails the run.
    extra: Sequence[ExtraProcess] = ()
    extra_grace: float = 30.0
    # After the first failure, how long the others may take to exit on their own before they
    # are ended: a process that failed too and is still tearing down keeps its own exit status
    # and error, so the cause of a cascade can be told from its consequences.
    settle: float = 0.0
    # Called once every child has started, with {id: pid} (ranks, then extras' negative ids),
    # while the run goes on: how a caller publishes the pids for whoever watches the run.
    on_start: Callable[[dict[int, int]], None] | None = None


def status_after_default() -> float | None:
    """``$PRISM_STATUS_AFTER`` (seconds, or "off"), else 300."""
    v = os.environ.get("PRISM_STATUS_AFTER", "").strip()
    if not v:
        return 300.0
    if v.lower() in ("off", "none", "0"):
        return None
    try:
        return float(v)
    except ValueError:
        raise LaunchError(f"PRISM_STATUS_AFTER={v!r}: expected seconds or 'off'") from None


@dataclasses.dataclass
class RankFailure:
    kind: str  # "exit" | "signal" | "timeout" | "lingering" (an extra outlived the ranks)
    rank: int | None  # first failing rank (None for "timeout")
    returncode: int | None  # exit code (> 0) or -signal number
    running_ranks: list[int]  # for "timeout": ranks still running when the time ran out
    stderr_tail: list[str]


@dataclasses.dataclass
class LaunchResult:
    ok: bool
    ranks: list[int]
    returncodes: dict[int, int | None]  # per global rank; -N: killed by signal N
    ended_by_launcher: list[int]  # ranks the launcher terminated (after a failure or timeout)
    pids: dict[int, int]
    wall_s: float
    master_port: int
    run_id: str
    log_dir: Path | None
    failure: RankFailure | None
    message: str  # "" when ok; else one clear message (first line says what happened)
    stdout_tail: dict[int, list[str]]
    stderr_tail: dict[int, list[str]]
    names: dict[int, str] = dataclasses.field(default_factory=dict)  # extra id -> its name

    def raise_for_failure(self) -> None:
        if not self.ok:
            raise LaunchError(self.message, self)


# ---------------------------------------------------------------------------------------------
# Environment


def host_store(addr: str, port: int = 0):
    """The run's rendezvous TCPStore, hosted by the launcher on ``port`` (0: one the kernel
    picks) that stays bound until the store is dropped (torchrun's agent store)."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    try:
        return TCPStore(addr, port, is_master=True, wait_for_workers=False,
                        timeout=timedelta(minutes=30))
    except (RuntimeError, OSError) as e:
        raise LaunchError(f"cannot host the rendezvous store on {addr}:{port}: {e}") from None


def _resolve_ranks(spec: LaunchSpec) -> list[int]:
    ranks = list(range(spec.nproc)) if spec.ranks is None else [int(r) for r in spec.ranks]
    if len(ranks) != spec.nproc:
        raise LaunchError(f"{len(ranks)} ranks given for nproc={spec.nproc}")
    world = spec.world_size if spec.world_size is not None else spec.nproc
    if len(set(ranks)) != len(ranks) or any(r < 0 or r >= world for r in ranks):
        raise LaunchError(f"ranks {ranks} are not distinct ranks of a world of {world}")
    return ranks


def shares_gpu(devices: str | Sequence[int]) -> bool:
    """Whether a GPU list names a GPU more than once (processes that share it)."""
    return not isinstance(devices, str) and len(set(devices)) != len(devices)


def gpu_ids(gpus: Sequence[int], parent: Mapping[str, str]) -> list[str]:
    """CUDA_VISIBLE_DEVICES entries of GPU indices (indices into the parent's visible list)."""
    visible = parent.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() != "":
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        if max(gpus) >= len(ids):
            raise LaunchError(f"GPU {max(gpus)} is not among CUDA_VISIBLE_DEVICES={visible}")
        return [ids[g] for g in gpus]
    return [str(g) for g in gpus]


def device_env(devices: str | Sequence[int], nproc: int, parent: Mapping[str, str]) -> dict[str, str]:
    """CUDA_VISIBLE_DEVICES for the children, or {} to leave the parent's as it is (or, for a
    list that shares a GPU, to set it per child: ``build_env``)."""
    if isinstance(devices, str):
        if devices == "cpu":
            return {"CUDA_VISIBLE_DEVICES": ""}
        raise LaunchError(f"devices must be 'cpu' or a list of GPU indices, not {devices!r}")
    gpus = [int(d) for d in devices]
    if len(gpus) < nproc:
        raise LaunchError(f"{nproc} ranks need {nproc} GPUs; {len(gpus)} given ({gpus})")
    gpus = gpus[:nproc]
    if any(g < 0 for g in gpus):
        raise LaunchError(f"GPU indices must be non-negative: {gpus}")
    if shares_gpu(gpus):
        gpu_ids(gpus, parent)  # validate
        return {}
    if gpus == list(range(nproc)):
        return {}  # as torchrun: CUDA_VISIBLE_DEVICES left alone, LOCAL_RANK selects the GPU
    return {"CUDA_VISIBLE_DEVICES": ",".join(gpu_ids(gpus, parent))}


def own_host_env(run_id: str, who: str | int) -> dict[str, str]:
    """What makes a process its own host to NCCL. NCCL refuses two members of a communicator
    on one GPU of one host ("Duplicate GPU detected"); members on different hosts may share a
    GPU, and NCCL then connects them through its network transport (sockets here)."""
    return {"NCCL_HOSTID": f"prism-{run_id}-{who}"}


def torchrun_env(
    *,
    rank: int,
    local_rank: int,
    world_size: int,
    local_world_size: int,
    master_addr: str,
    master_port: int,
    run_id: str,
    agent_store: bool,
) -> dict[str, str]:
    """The variables torchrun's agent sets for one worker of a single-node job."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "GROUP_RANK": "0",
        "ROLE_RANK": str(rank),
        "ROLE_NAME": "default",
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "WORLD_SIZE": str(world_size),
        "GROUP_WORLD_SIZE": "1",
        "ROLE_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": run_id,
        # True: the launcher hosts the TCPStore and rank 0 connects as a client (torchrun's
        # default); False: rank 0's env:// rendezvous hosts it.
        "TORCHELASTIC_USE_AGENT_STORE": str(agent_store),
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    }


def build_env(
    spec: LaunchSpec,
    *,
    rank: int,
    local_rank: int,
    master_port: int,
    run_id: str,
    agent_store: bool = False,
    error_file: str | None = None,
    parent: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The complete environment of one child. Order: the launcher's environment, device
    selection, torchrun's set, spec.env, spec.rank_env[rank], then the NVLS-off variables."""
    base = dict(os.environ if parent is None else parent)
    env = dict(base)
    env.update(device_env(spec.devices, spec.nproc, base))
    own_host = own_hosts(spec)
    if own_host:
        # Each process its own host with its own GPU (shared or not): LOCAL_RANK 0 selects it.
        if spec.devices != "cpu":
            env["CUDA_VISIBLE_DEVICES"] = gpu_ids([int(spec.devices[local_rank])], base)[0]
        env.update(own_host_env(run_id, rank))
    env.update(
        torchrun_env(
            rank=rank,
            local_rank=0 if own_host else local_rank,
            world_size=spec.world_size if spec.world_size is not None else spec.nproc,
            local_world_size=1 if own_host else spec.nproc,
            master_addr=spec.master_addr,
            master_port=master_port,
            run_id=run_id,
            agent_store=agent_store,
        )
    )
    if error_file is not None:
        env["TORCHELASTIC_ERROR_FILE"] = error_file
    if "OMP_NUM_THREADS" not in base and spec.nproc > 1:
        env["OMP_NUM_THREADS"] = "1"  # as torchrun, to keep N processes from oversubscribing
    env["PYTHONUNBUFFERED"] = "1"  # output reaches the launcher as it is written
    for overrides in (spec.env, spec.rank_env.get(rank, {})):
        for k, v in overrides.items():
            if v is None:
                env.pop(k, None)
            else:
                env[k] = str(v)
    env.update(NVLS_OFF_ENV)
    return env


def own_hosts(spec: LaunchSpec) -> bool:
    """Whether every process of this launch is told it is its own host (``own_host_env``)."""
    return spec.own_hosts or shares_gpu(spec.devices)


def child_command(spec: LaunchSpec) -> list[str]:
    if spec.runner:
        return [spec.python, "-m", spec.runner, spec.script, *spec.args]
    return [spec.python, spec.script, *spec.args]


# ---------------------------------------------------------------------------------------------
# Child start-up: own session, die with the launcher


def _pdeathsig_preexec(parent_pid: int) -> Callable[[], None] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    PR_SET_PDEATHSIG = 1
    sigkill = int(signal.SIGKILL)

    def preexec() -> None:  # runs in the forked child: no imports, no allocation-heavy work
        prctl(PR_SET_PDEATHSIG, sigkill, 0, 0, 0)
        if os.getppid() != parent_pid:  # the launcher died before prctl took effect
            os._exit(137)

    return preexec


# A tiny process, in its own session, that outlives a launcher killed with SIGKILL: it reads the
# process groups of the ranks from a pipe and, if the pipe closes without "done" (the launcher
# died without cleaning up), ends those groups, and with them what the ranks started (PDEATHSIG
# only reaches the ranks themselves).
_WATCHDOG_SRC = r"""
import os, signal, sys, time
groups, done = [], False
for line in sys.stdin:
    line = line.strip()
    if line == "done":
        done = True
        break
    if line.isdigit():
        groups.append(int(line))
if not done:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pg in groups:
            try:
                os.killpg(pg, sig)
            except OSError:
                pass
        time.sleep(1.0)
"""


class _Watchdog:
    def __init__(self, python: str):
        self.proc = subprocess.Popen(
            [python, "-I", "-S", "-c", _WATCHDOG_SRC],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            close_fds=True,
        )

    def watch(self, pgid: int) -> None:
        try:
            self.proc.stdin.write(f"{pgid}\n".encode())
            self.proc.stdin.flush()
        except (OSError, ValueError):
            pass

    def release(self) -> None:
        """Normal end: the launcher has ended everything itself."""
        try:
            self.proc.stdin.write(b"done\n")
            self.proc.stdin.close()
        except (OSError, ValueError):
            pass
        try:
            self.proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _killpg(pgid: int, sig: int) -> bool:
    """Signal a child's process group (the child and anything it started). False if empty."""
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return False


def _groups_alive(pgids: Sequence[int]) -> list[int]:
    """The process groups among ``pgids`` that still have a live (non-zombie) member. Orphaned
    zombies wait for init to reap them, which can take a while: they do not count."""
    if not pgids:
        return []
    if not os.path.isdir("/proc/self"):
        return [pg for pg in pgids if _killpg(pg, 0)]
    wanted = set(pgids)
    alive: set[int] = set()
    try:
        entries = os.listdir("/proc")
    except OSError:
        return [pg for pg in pgids if _killpg(pg, 0)]
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        # fields: state, ppid, pgrp, ...
        if len(fields) >= 3 and fields[0] not in (b"Z", b"X") and int(fields[2]) in wanted:
            alive.add(int(fields[2]))
    return [pg for pg in pgids if pg in alive]


# ---------------------------------------------------------------------------------------------
# Output pump: one thread reads every rank's pipes and passes whole lines on


_write_lock = threading.Lock()


def _default_sink(rank: int, stream: str, line: str) -> None:
    f = sys.stdout if stream == "stdout" else sys.stderr
    with _write_lock:
        try:
            f.write(line)
            f.flush()
        except (OSError, ValueError):  # closed or broken pipe: keep draining the children
            pass


@dataclasses.dataclass
class _Stream:
    rank: int
    local_rank: int
    name: str  # "stdout" | "stderr"
    fd: int
    tail: collections.deque
    show: bool
    prefix: str
    log: object | None  # binary file
    partial: bytearray = dataclasses.field(default_factory=bytearray)
    eof: threading.Event = dataclasses.field(default_factory=threading.Event)


class _OutputPump:
    MAX_LINE = 64 * 1024  # a "line" longer than this is passed on in pieces
    TAIL_LINE_CHARS = 400

    def __init__(self, streams: list[_Stream], sink: LineSink):
        self.streams = streams
        self.sink = sink
        self.sel = selectors.DefaultSelector()
        for s in streams:
            os.set_blocking(s.fd, False)
            self.sel.register(s.fd, selectors.EVENT_READ, s)
        self.thread = threading.Thread(target=self._run, name="prism-launcher-output", daemon=True)
        self._stop = threading.Event()

    def start(self) -> None:
        self.thread.start()

    def _emit(self, s: _Stream, data: bytes) -> None:
        if s.log is not None:
            try:
                s.log.write(data)
                s.log.flush()
            except (OSError, ValueError):
                pass
        text = data.decode("utf-8", errors="replace")
        stripped = text.rstrip("\r\n")
        if stripped.strip():
            if len(stripped) > self.TAIL_LINE_CHARS:
                stripped = stripped[: self.TAIL_LINE_CHARS] + "…"
            s.tail.append(stripped)
        if s.show:
            if not text.endswith("\n"):
                text += "\n"
            try:
                self.sink(s.rank, s.name, s.prefix + text if s.prefix else text)
            except Exception:  # a broken sink must not stop the draining of pipes
                pass

    def _read(self, s: _Stream) -> None:
        try:
            chunk = os.read(s.fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            if s.partial:
                self._emit(s, bytes(s.partial))
                s.partial.clear()
            self.sel.unregister(s.fd)
            os.close(s.fd)
            s.eof.set()
            return
        s.partial += chunk
        while True:
            i = s.partial.find(b"\n")
            if i < 0:
                break
            line = bytes(s.partial[: i + 1])
            del s.partial[: i + 1]
            self._emit(s, line)
        if len(s.partial) > self.MAX_LINE:
            self._emit(s, bytes(s.partial))
            s.partial.clear()

    def _run(self) -> None:
        while self.sel.get_map() and not self._stop.is_set():
            for key, _ in self.sel.select(timeout=0.2):
                self._read(key.data)
        for s in self.streams:  # stopped early: release what is left
            if not s.eof.is_set():
                if s.partial:
                    self._emit(s, bytes(s.partial))
                    s.partial.clear()

    def finish(self, timeout: float) -> None:
        self.thread.join(timeout)
        if self.thread.is_alive():
            self._stop.set()
            self.thread.join(1.0)
        if not self.thread.is_alive():
            for key in list(self.sel.get_map().values()):
                try:
                    self.sel.unregister(key.fd)
                    os.close(key.fd)
                except (OSError, KeyError, ValueError):
                    pass
            self.sel.close()


# ---------------------------------------------------------------------------------------------
# Messages


def format_ranks(ranks: Sequence[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2,5,7-8"."""
    rs = sorted(set(ranks))
    out: list[str] = []
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        out.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return ",".join(out)


def describe_returncode(rc: int) -> str:
    if rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = f"signal {-rc}"
        hint = " (out of memory?)" if -rc == signal.SIGKILL else ""
        return f"was killed by {name} ({-rc}){hint}"
    return f"exited with code {rc}"


# The last line of a Python traceback ("RuntimeError: boom", "torch.OutOfMemoryError: ...") or
# prism's one-line report of its own error ("prism: error: ...", "prism assistant: error: ...").
_ERROR_LINE = re.compile(r"^(?:(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Interrupt|Exit)(?::|$)|"
                         r"prism(?: \w+)?: error: )")
# An error that only says a peer went away: the consequence of another process's failure.
_LOST_PEER = re.compile(r"Connection (?:closed|reset) by peer|Broken pipe|remote process exited|"
                        r"communicator was aborted|failed to recv, got 0 bytes", re.IGNORECASE)


def error_line(lines: Sequence[str]) -> tuple[str, list[str]]:
    """The error a process reported last, from the tail of its output: the last traceback or
    prism error line (what follows it may be the exception's further lines, or noise printed
    at exit), else the last line; and the lines from there on. Rank prefixes are removed."""
    lines = [ln for ln in (_RANK_PREFIX.sub("", ln, count=1).rstrip() for ln in lines) if ln.strip()]
    for i in range(len(lines) - 1, -1, -1):
        if _ERROR_LINE.match(lines[i]):
            return lines[i], lines[i:]
    return (lines[-1].strip(), lines[-1:]) if lines else ("", [])


def _lost_peer(lines: Sequence[str]) -> bool:
    return any(_LOST_PEER.search(ln) for ln in error_line(lines)[1])


def _error_file_message(path: str | None) -> str | None:
    """The message torch.distributed.elastic's @record wrote for a failed rank, if any."""
    if not path or not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            data = json.load(f)
        msg = data.get("message")
        if isinstance(msg, dict):
            msg = msg.get("message")
        return str(msg).strip() if msg else None
    except (OSError, ValueError, AttributeError):
        return None


_RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s?")


def _who(ids: Sequence[int], names: Mapping[int, str] | None) -> str:
    """"ranks 0-2, assistant": ranks by number, extras (negative ids) by name."""
    names = names or {}
    ranks = [r for r in ids if r >= 0]
    parts = [f"rank{'s' if len(ranks) > 1 else ''} {format_ranks(ranks)}"] if ranks else []
    parts += [names.get(r, f"extra {-r}") for r in sorted(ids, reverse=True) if r < 0]
    return ", ".join(parts)


def _failure_message(
    failure: RankFailure,
    *,
    timeout: float | None = None,
    stdout_tail: list[str],
    error_file_msg: str | None,
    ended: list[int],
    log_dir: Path | None,
    shown_lines: int = 6,
    names: Mapping[int, str] | None = None,
    extra_grace: float | None = None,
    status: Sequence[str] = (),
) -> str:
    lines: list[str] = []
    if failure.kind == "timeout":
        after = f" after {timeout:g} s" if timeout is not None else ""
        running = failure.running_ranks
        what = (f"ranks still running: {format_ranks(running)}" if all(r >= 0 for r in running)
                else f"still running: {_who(running, names)}")
        lines.append(f"timed out{after}; {what} (ended by the launcher)")
        lines.extend(status)
    elif failure.kind == "lingering":
        lines.append(
            f"{_who(failure.running_ranks, names)} still running {extra_grace or 0:g} s after every "
            f"rank ended successfully (ended by the launcher)"
        )
    else:
        rank = failure.rank
        who = _who([rank], names)
        # torch prefixes a rank's traceback lines with "[rankN]:"; the message names the rank.
        tail = [_RANK_PREFIX.sub("", ln, count=1) for ln in (failure.stderr_tail or stdout_tail)]
        which = "stderr" if failure.stderr_tail else "output"
        head = f"{who} {describe_returncode(failure.returncode or 0)}"
        last = tail[-1].strip() if tail else (error_file_msg.splitlines()[-1] if error_file_msg else "")
        lines.append(f"{head}: {last}" if last else head)
        if len(tail) > 1:
            lines.append(f"  last lines of {who}'s {which}:")
            lines.extend("    " + ln for ln in tail[-shown_lines:])
        if ended:
            others = format_ranks(ended) if all(r >= 0 for r in ended) else _who(ended, names)
            lines.append(f"  other ranks ended by the launcher: {others}")
    if log_dir is not None:
        lines.append(f"  per-rank logs: {log_dir}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The launcher


class _Signalled(BaseException):
    def __init__(self, signum: int):
        self.signum = signum


@dataclasses.dataclass
class _Child:
    rank: int
    local_rank: int
    proc: subprocess.Popen
    error_file: str | None
    returncode: int | None = None
    ended_by_launcher: bool = False
    exit_t: float | None = None  # when the launcher saw it exit (monotonic)


class _Launcher:
    def __init__(self, spec: LaunchSpec):
        self.spec = spec
        self.children: list[_Child] = []
        self.exits: "queue.Queue[tuple[int, int, float]]" = queue.Queue()
        self.pump: _OutputPump | None = None
        self.watchdog: _Watchdog | None = None
        self.store = None  # the rendezvous TCPStore when the launcher hosts it
        self.cleaning = False
        self.deferring = False
        self.deferred = 0
        self.escalate = threading.Event()
        self.old_handlers: dict[int, object] = {}
        self.names: dict[int, str] = {}  # extra id -> name
        self.board: StatusBoard | None = None  # the children's status files (prismllm.status)
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
        process failed on its own (not ended by the launcher) with an error of its own or a
        signal: then the earliest of those, the cause of the cascade."""
        if not _lost_peer(stderr_tail.get(failure.rank, [])):
            return failure
        causes = [c for c in self.children
                  if c.rank != failure.rank and not c.ended_by_launcher and (c.returncode or 0) != 0
                  and not _lost_peer(stderr_tail.get(c.rank, []))]
        if not causes:
            return failure
        c = min(causes, key=lambda c: c.exit_t if c.exit_t is not None else float("inf"))
        return RankFailure("exit" if c.returncode > 0 else "signal", c.rank, c.returncode, [], [])

    def _end_all(self) -> None:
        """SIGTERM every live child's process group, SIGKILL after the grace period, and end
        whatever the children left in their groups."""
        alive = self._alive()
        for c in alive:
            c.ended_by_launcher = True
            _killpg(c.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + max(0.0, self.spec.grace_period)
        while self._alive() and time.monotonic() < deadline and not self.escalate.is_set():
            self._drain_exits(0.05)
        for c in self._alive():
            _killpg(c.proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10.0
        while self._alive() and time.monotonic() < deadline:
            self._drain_exits(0.05)
        # Grandchildren (e.g. data-loader workers) that outlive their rank.
        leftover = _groups_alive([c.proc.pid for c in self.children])
        for pg in leftover:
            _killpg(pg, signal.SIGTERM)
        deadline = time.monotonic() + min(max(0.0, self.spec.grace_period), 2.0)
        while leftover and time.monotonic() < deadline and not self.escalate.is_set():
            time.sleep(0.02)
            leftover = _groups_alive(leftover)
        for pg in leftover:
            _killpg(pg, signal.SIGKILL)

    # -- run ---------------------------------------------------------------------------------
    def run(self) -> LaunchResult:
        spec = self.spec
        if spec.nproc < 1 and not (spec.nproc == 0 and spec.extra and spec.master_port is not None):
            raise LaunchError(f"nproc must be at least 1, not {spec.nproc} (0 only for extras that "
                              f"meet another launcher's store: master_port given)")
        if spec.nproc and not os.path.isfile(spec.script):
            raise LaunchError(f"script not found: {spec.script}")
        ranks = _resolve_ranks(spec)
        device_env(spec.devices, spec.nproc, os.environ)  # validate before starting anything
        if spec.master_port is None:
            self.store = host_store(spec.master_addr, spec.store_port)  # bound until the run ends
            port = self.store.port
        else:
            port = spec.master_port
        run_id = spec.run_id or uuid.uuid4().hex[:12]
        log_dir = Path(spec.log_dir) if spec.log_dir is not None else None
        if log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)
        err_dir = tempfile.mkdtemp(prefix="prism-launch-")
        try:
            return self._run(ranks, port, run_id, log_dir, err_dir)
        finally:
            shutil.rmtree(err_dir, ignore_errors=True)

    def _spawn(self, ranks: list[int], port: int, run_id: str, log_dir: Path | None,
               err_dir: str, streams: list[_Stream], logs: list) -> None:
        spec = self.spec
        show = None if spec.show_ranks is None else {int(r) for r in spec.show_ranks}
        cmd = child_command(spec)
        preexec = _pdeathsig_preexec(os.getpid())
        if spec.watchdog:
            try:
                self.watchdog = _Watchdog(spec.python)
            except OSError:
                self.watchdog = None  # a bad spec.python: reported when starting rank 0
        jobs = []  # (id, local rank, command, env, error file, prefix, visible, log name)
        for local_rank, rank in enumerate(ranks):
            error_file = os.path.join(err_dir, f"error-{rank}.json")
            env = build_env(spec, rank=rank, local_rank=local_rank, master_port=port,
                            run_id=run_id, agent_store=self.store is not None,
                            error_file=error_file)
            prefix = (spec.line_prefix or "").format(rank=rank, local_rank=local_rank)
            visible = spec.passthrough and (show is None or rank in show)
            jobs.append((rank, local_rank, cmd, env, error_file, prefix, visible, f"rank-{rank:06d}"))
        for i, ex in enumerate(spec.extra):
            xid = -(i + 1)
            self.names[xid] = ex.name
            env = dict(os.environ)
            if spec.devices == "cpu":
                env["CUDA_VISIBLE_DEVICES"] = ""
            env.update({"MASTER_ADDR": spec.master_addr, "MASTER_PORT": str(port),
                        "TORCHELASTIC_RUN_ID": run_id, "PYTHONUNBUFFERED": "1"})
            if own_hosts(spec):
                env.update(own_host_env(run_id, f"x{i}"))
            for k, v in {**spec.env, **ex.env}.items():
                if v is None:
                    env.pop(k, None)
                else:
                    env[k] = str(v)
            env.update(NVLS_OFF_ENV)
            prefix = f"[{ex.name}]: " if spec.line_prefix else ""
            slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", ex.name)
            jobs.append((xid, -1, list(ex.argv), env, None, prefix, spec.passthrough, slug))
        status_dir = log_dir / "status" if log_dir is not None else Path(tempfile.mkdtemp(prefix="prism-status-"))
        self.board = StatusBoard(status_dir, {j[0]: j[7] for j in jobs})
        for rank, local_rank, cmd, env, error_file, prefix, visible, log_name in jobs:
            env.update(self.board.env(rank))
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
            child = _Child(rank, local_rank, proc, error_file)
            self.children.append(child)
            if self.watchdog is not None:
                self.watchdog.watch(proc.pid)  # start_new_session: pgid == pid
            for name, pipe in (("stdout", proc.stdout), ("stderr", proc.stderr)):
                fd = os.dup(pipe.fileno())  # owned by the pump from here on
                pipe.close()
                log = None
                if log_dir is not None:
                    log = open(log_dir / f"{log_name}.{name}.log", "wb")
                    logs.append(log)
                tail = collections.deque(maxlen=max(1, spec.tail_lines))
                streams.append(_Stream(rank, local_rank, name, fd, tail, visible, prefix, log))
            threading.Thread(target=self._waiter, args=(child,), daemon=True,
                             name=f"prism-launcher-wait-{rank}").start()
            self._raise_deferred()

    def _who(self, ids: Sequence[int]) -> str:
        return _who(ids, self.names)

    def _status_report(self, head: str) -> list[str]:
        """``head`` and where each live child stands (``prismllm.status``)."""
        if self.board is None:
            return []
        alive = sorted((c.rank for c in self._alive()), key=lambda r: (r < 0, abs(r)))
        where = self.board.report(alive, self._who)
        if not where:  # plain scripts: nothing to ask
            return []
        self.status_kept = True
        return [head, *where, f"  every thread's stack, per process: {self.board.dir}{os.sep}*.status"]

    def _print(self, lines: list[str]) -> None:
        sink = self.spec.sink or _default_sink
        for ln in lines:
            sink(LAUNCHER_ID, "stderr", f"{STATUS_PREFIX}{ln}\n")

    def _supervise(self, t0: float) -> RankFailure | None:
        spec = self.spec
        deadline = None if spec.timeout is None else t0 + spec.timeout
        linger: float | None = None  # when every rank had exited 0 while extras still ran
        report_after = spec.status_after
        next_check = time.monotonic()
        while self._alive():
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

    def _run(self, ranks: list[int], port: int, run_id: str, log_dir: Path | None,
             err_dir: str) -> LaunchResult:
        spec = self.spec
        streams: list[_Stream] = []
        logs: list = []
        t0 = time.monotonic()
        failure: RankFailure | None = None
        interrupted: int | None = None
        self._install_signals()
        try:
            try:
                self._spawn(ranks, port, run_id, log_dir, err_dir, streams, logs)
                self.pump = _OutputPump(streams, spec.sink or _default_sink)
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
        message = ""
        if failure is not None:
            efm = None
            if failure.rank is not None:
                failure = self._cause(failure, stderr_tail)
                failure.stderr_tail = stderr_tail.get(failure.rank, [])
                child = next(c for c in self.children if c.rank == failure.rank)
                efm = _error_file_message(child.error_file)
            message = _failure_message(
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
        )


def launch(spec: LaunchSpec) -> LaunchResult:
    """Run ``spec.nproc`` rank processes to completion (see the module docstring).

    Returns a LaunchResult (``ok`` False with ``message`` on a rank failure or timeout; call
    ``raise_for_failure()`` to turn that into a LaunchError). Raises LaunchError if the job
    cannot start, LaunchInterrupted on SIGTERM/SIGHUP and KeyboardInterrupt on SIGINT, in every
    case after all children have been ended.
    """
    return _Launcher(spec).run()
