"""What a launch is given and what it returns: :class:`LaunchSpec`, :class:`LaunchResult`
and the launcher's errors (``prismllm.launch.launcher`` runs it)."""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from prismllm.childenv import ChildError, user_setting
from prismllm.errors import ExitCode, PrismError
from prismllm.fromfields import FromFields

DEFAULT_RUNNER = "prismllm.comm.bootstrap"

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

    exit_code = ExitCode.FAILED

    def __init__(self, message: str, result: LaunchResult | None = None):
        super().__init__(message)
        self.result = result


class RankOutOfMemory(LaunchError):
    """A rank of the program ran out of memory: what the program needs at this scale, found by
    the run (a result, not a failure of prism); ``rank`` is the rank that ran out."""

    def __init__(self, message: str, result: LaunchResult | None, rank: int):
        super().__init__(message, result)
        self.rank = rank


class LaunchInterrupted(PrismError):
    """The launcher received SIGTERM or SIGHUP; every rank has been ended."""

    def __init__(self, signum: int):
        self.signum = signum
        self.exit_code = 128 + signum  # the shell's code for a process ended by signal N
        super().__init__(f"received {signal.Signals(signum).name}; all ranks were ended")


@dataclasses.dataclass
class LaunchSpec(FromFields):
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
    # Multi-host with a shared token (prismllm.launch.gate): the store hosted here listens on
    # loopback behind a gate on master_addr:store_port, or, with master_port given, this host's
    # processes reach the other launcher's gate through a tunnel on loopback. None: no gate.
    rdzv_token: bytes | None = dataclasses.field(default=None, repr=False)
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
    # (prismllm.launch.status; None: never, except in a timeout's message); default $PRISM_STATUS_AFTER
    # ("off": never), else 300
    status_after: float | None = dataclasses.field(default_factory=lambda: status_after_default())
    grace_period: float = 5.0  # between SIGTERM and SIGKILL when ending ranks
    handle_signals: bool = True  # install SIGTERM/SIGHUP/SIGINT handlers (main thread only)
    # Set by another thread to end the run as SIGTERM would (LaunchInterrupted): how a caller
    # that runs several launches from threads stops them all.
    cancel: threading.Event | None = None
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
    v = user_setting("PRISM_STATUS_AFTER").strip()
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
    error: ChildError | None = None  # what the failed child reported of its own error, if it did


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
    # what each failed rank reported of its own error (prismllm.childenv.report_error)
    errors: dict[int, ChildError] = dataclasses.field(default_factory=dict)

    def raise_for_failure(self) -> None:
        if not self.ok:
            raise LaunchError(self.message, self)
