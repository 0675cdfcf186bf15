"""Child processes that end with the launcher: their own session, PDEATHSIG, a watchdog for a
SIGKILLed launcher, and ending whole process groups."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence


def pdeathsig_preexec(parent_pid: int) -> Callable[[], None] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
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
# process groups of the ranks and the launcher's temporary directories from a pipe and, if the
# pipe closes without "done" (the launcher died without cleaning up), ends those groups, and with
# them what the ranks started (PDEATHSIG only reaches the ranks themselves), then removes the
# directories it was not told to keep.
_WATCHDOG_SRC = r"""
import os, shutil, signal, sys, time
groups, dirs, done = [], [], False
for line in sys.stdin:
    line = line.rstrip("\n")
    if line == "done":
        done = True
        break
    if line.isdigit():
        groups.append(int(line))
    elif line.startswith("dir "):
        dirs.append(line[4:])
    elif line.startswith("keep "):
        dirs = [d for d in dirs if d != line[5:]]
if not done:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pg in groups:
            try:
                os.killpg(pg, sig)
            except OSError:
                pass
        time.sleep(1.0)
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
"""


class Watchdog:
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
        self._say(str(pgid))

    def remove(self, directory: str | os.PathLike) -> None:
        """Remove ``directory`` (a temporary one of the launcher's) if the launcher dies."""
        self._say(f"dir {directory}")

    def keep(self, directory: str | os.PathLike) -> None:
        """Keep ``directory`` after all (a message named it)."""
        self._say(f"keep {directory}")

    def _say(self, line: str) -> None:
        try:
            self.proc.stdin.write(f"{line}\n".encode())
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


def killpg(pgid: int, sig: int) -> bool:
    """Signal a child's process group (the child and anything it started). False if empty."""
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return False


def proc_state(stat_path: str) -> str | None:
    """The state letter of a process or thread (``/proc/PID/stat``, ``/proc/PID/task/TID/stat``):
    R running, S sleeping, T stopped, ...; None when it is gone."""
    try:
        with open(stat_path) as f:
            stat = f.read()
        return stat[stat.rindex(")") + 2]
    except (OSError, ValueError, IndexError):
        return None


def groups_alive(pgids: Sequence[int]) -> list[int]:
    """The process groups among ``pgids`` that still have a live (non-zombie) member. Orphaned
    zombies wait for init to reap them, which can take a while: they do not count."""
    if not pgids:
        return []
    if not os.path.isdir("/proc/self"):
        return [pg for pg in pgids if killpg(pg, 0)]
    wanted = set(pgids)
    alive: set[int] = set()
    try:
        entries = os.listdir("/proc")
    except OSError:
        return [pg for pg in pgids if killpg(pg, 0)]
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
