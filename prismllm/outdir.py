"""An output directory while a command writes it: one writer at a time, a full disk said in one
line, and an end by SIGTERM that still cleans up.

Every command that writes a directory runs inside :func:`writing`:

- **One writer.** DIR's lock is the file ``.NAME.prism-lock`` beside DIR (in its parent: replacing
  or deleting DIR, as ``--force`` and atomic renames do, never touches it). It holds the holder's
  pid, host and start time and is ``flock``-ed for the whole run. The kernel drops a flock when
  its process dies, so the lock of a killed run is free at once and the next writer takes it
  over without a word. A second writer is refused at once, with or without ``--force`` (nothing
  is deleted before the lock is taken), and so is a writer of a directory inside DIR or around it
  (``prism capture --out RUN/bare`` while ``prism run --out RUN`` goes on, or the reverse).
- **An earlier output is replaced only with ``--force``** (:func:`must_replace`), and only when it
  is the command's own: a directory that holds anything else is never deleted.
- **Within a process the lock is shared.** A stage that another calls (``prism run`` runs
  capture, time, calibrate, emulate and report into DIR's subdirectories; ``prism sweep`` runs
  ``prism run`` into its own) writes under the lock its caller holds. The processes a stage
  starts (ranks, assistants) take no lock: they write where their stage tells them.
- **A full disk or a failing file system** (ENOSPC, EDQUOT, EIO, EROFS), raised inside or
  reported by a child process (``prismllm.launch``), becomes a :class:`StorageError`: one line
  with the path, the free space on its file system, and that the output so far is kept,
  incomplete. Every stage writes the file that marks its output complete last, so a partial
  output is never taken for a complete one, and the same command run again redoes or resumes
  what is missing.
- **SIGTERM and SIGHUP** end the command as an exception does (``SystemExit(128 + signal)``), so
  every clean-up runs (temporary directories, the lock); the launcher's own handlers take over
  while it runs processes.

Where the file system has no flock (Lustre mounted without ``flock``), the pid in the lock file
decides: a holder on this host whose pid is gone is stale, one on another host is taken as live.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import errno
import fcntl
import json
import os
import shutil
import signal
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

from prismllm.errors import OutputBusy, PrismError, StorageError

LOCK_SUFFIX = ".prism-lock"
# a full disk, a full quota, a failing device, a file system mounted read-only
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS})
# what flock says on a file system without locks
_NO_FLOCK = frozenset({errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL})

# the directories this process holds the lock of -> the lock file's descriptor
_held: dict[Path, int] = {}


@dataclasses.dataclass(frozen=True)
class Holder:
    """Who holds a lock, as its lock file says."""

    pid: int
    host: str
    started: str

    def __str__(self) -> str:
        return f"pid {self.pid} on {self.host}, since {self.started}"

    def alive(self) -> bool:
        """Whether the holder may still run: its pid is alive on this host, or it is on another."""
        if self.host != socket.gethostname():
            return True
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # another user's live process
            return True
        return True


def lock_path(directory: Path) -> Path:
    """The lock file of ``directory`` (an absolute path): beside it, in its parent."""
    return directory.parent / f".{directory.name}{LOCK_SUFFIX}"


@contextlib.contextmanager
def writing(out: str | os.PathLike | None) -> Iterator[None]:
    """Run the block as the one writer of ``out`` (None: nothing is written, nothing to hold); see
    the module docstring. Raises OutputBusy when another live run writes ``out``, a directory
    inside it or around it; turns a storage error inside the block into a StorageError."""
    if out is None:
        yield
        return
    directory = Path(out).resolve()
    if any(d in _held for d in (directory, *directory.parents)):  # a stage called by one that holds it
        with _storage_errors(directory):
            yield
        return
    with _storage_errors(directory), _signals_end_the_run():
        fd = _acquire(directory)
        try:
            # after taking its own lock: of two runs that start together on nested directories,
            # one at least sees the other's
            _refuse_if_written_around(directory)
            _held[directory] = fd
            yield
        finally:
            _held.pop(directory, None)
            _release(directory, fd)


def must_replace(out: Path, force: bool, ours: tuple[str, ...], what: str) -> bool:
    """Whether ``out`` holds an earlier output that a command must clear before it writes there.
    A path that is no directory is refused, and so is a non-empty directory without ``force``;
    with ``force`` only a directory that holds one of ``ours`` (the files that mark ``what``,
    prism's output) is replaced, never another. Changes nothing."""
    if out.exists() and not out.is_dir():
        raise PrismError(f"output path {out} exists and is not a directory")
    if not (out.is_dir() and any(out.iterdir())):
        return False
    if not force:
        raise PrismError(f"output directory {out} exists and is not empty (use --force to replace it)")
    if not any((out / name).exists() for name in ours):
        raise PrismError(
            f"output directory {out} is not empty and holds no {what}; refusing to delete it even with --force"
        )
    return True


# ------------------------------------------------------------------------------ the lock
def _acquire(directory: Path) -> int:
    """Take ``directory``'s lock; the descriptor that holds it."""
    path = lock_path(directory)
    while True:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except PermissionError as e:
            raise PrismError(
                f"cannot lock {directory}: {e.strerror} creating {path} (a run's lock is a file beside its "
                f"directory): choose an --out inside a directory you can write"
            ) from None
        try:
            if not _lock(fd):
                raise OutputBusy(_busy(str(directory), _read_holder(fd)))
            if _same_file(fd, path):
                _write_holder(fd)
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # its holder removed the file between our open and our lock: lock the new one


def _release(directory: Path, fd: int) -> None:
    """Remove the lock file while still holding it, then let it go: a writer that opened the old
    file meanwhile sees it gone and takes a new one (``_acquire``)."""
    path = lock_path(directory)
    try:
        if _same_file(fd, path):
            path.unlink()
    except OSError:
        pass
    os.close(fd)


def _lock(fd: int) -> bool:
    """Lock ``fd`` exclusively, without waiting; False if a live process holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as e:
        if e.errno not in _NO_FLOCK:
            raise
    holder = _read_holder(fd)
    return holder is None or holder.pid == os.getpid() or not holder.alive()


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _write_holder(fd: int) -> None:
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    text = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": started})
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, text.encode() + b"\n", 0)
    except OSError:  # a full disk: the flock alone is the lock, the holder's details a courtesy
        pass


def _read_holder(fd: int) -> Holder | None:
    try:
        d = json.loads(os.pread(fd, 4096, 0))
        return Holder(int(d["pid"]), str(d["host"]), str(d["started"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _busy(what: str, holder: Holder | None) -> str:
    """The refusal: ``what`` (the directory, as the reader should see it) and who writes it."""
    return (
        f"{what} is being written by another prism run ({holder or 'its pid unknown'}); wait for it to end "
        f"or choose another --out"
    )


def _refuse_if_written_around(directory: Path) -> None:
    """OutputBusy when a live run writes a directory around ``directory`` or inside it."""
    around = [(lock_path(d), f"{d}, which holds {directory},") for d in directory.parents if d.name]
    inside = []
    if directory.is_dir():
        for root, _, files in os.walk(directory):
            for name in files:
                if name.startswith(".") and name.endswith(LOCK_SUFFIX):
                    inner = Path(root) / name[1 : -len(LOCK_SUFFIX)]
                    inside.append((Path(root) / name, f"{inner}, inside {directory},"))
    for path, what in around + inside:
        try:
            fd = os.open(path, os.O_RDWR)  # (NFS locks a descriptor opened for writing only)
        except OSError:  # no lock file (nobody writes there), or not ours to judge
            continue
        try:
            if not _lock(fd):  # (a free lock is let go again when the descriptor closes)
                raise OutputBusy(_busy(what, _read_holder(fd)))
        finally:
            os.close(fd)


# ------------------------------------------------------------------------------ a full disk
def storage_problem(e: BaseException, where: str | os.PathLike) -> str | None:
    """``PATH: No space left on device (1.2 MiB free on its file system)`` when ``e`` is, or was
    raised from or while handling, an OSError of a full disk or a failing file system; else None.
    ``where``: the path named when the error names none (a write to an open file)."""
    seen: set[int] = set()
    err: BaseException | None = e
    while err is not None and id(err) not in seen:
        if isinstance(err, OSError) and err.errno in STORAGE_ERRNOS:
            # the second path of a two-path call (a copy, a rename) is the one written
            named = err.filename2 if isinstance(err.filename2, str) else err.filename
            path = named if isinstance(named, str) else str(where)
            free = _free_space(path)
            return f"{path}: {err.strerror or os.strerror(err.errno)}" + (
                f" ({free} free on its file system)" if free is not None else ""
            )
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def _free_space(path: str) -> str | None:
    """The free space on ``path``'s file system (of its nearest existing ancestor), or None when
    the file system cannot say."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        n = float(shutil.disk_usage(p).free)
    except OSError:
        return None
    units = ["B", "KiB", "MiB", "GiB", "TiB"]
    while n >= 1024 and len(units) > 1:
        n /= 1024
        units.pop(0)
    return f"{n:.0f} B" if units[0] == "B" else f"{n:.1f} {units[0]}"


@contextlib.contextmanager
def _storage_errors(directory: Path) -> Iterator[None]:
    try:
        yield
    except StorageError as e:
        if e.kept is not None:  # a stage inside said it already
            raise
        raise StorageError(e.problem, kept=directory) from e
    except Exception as e:
        problem = storage_problem(e, directory)
        if problem is None:
            raise
        raise StorageError(problem, kept=directory) from e


# ------------------------------------------------------------------------------ signals
@contextlib.contextmanager
def _signals_end_the_run() -> Iterator[None]:
    """SIGTERM and SIGHUP raise SystemExit(128 + signal) in the main thread for the block, where
    nothing else handles them, so that every ``finally`` runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    for s, h in old.items():
        if h == signal.SIG_DFL:
            signal.signal(s, _exit_on_signal)
    try:
        yield
    finally:
        for s, h in old.items():
            if h == signal.SIG_DFL:
                signal.signal(s, h)


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


__all__ = ["LOCK_SUFFIX", "STORAGE_ERRNOS", "Holder", "lock_path", "must_replace", "storage_problem", "writing"]
