"""Where each process of a run stands: how the launcher diagnoses a run that makes no progress.

Every process the launcher starts (ranks and helpers such as an emulation assistant) is told
a status directory and its name in it (``ChildEnv.status_dir`` / ``status_name``). In it, the process's :class:`StatusReporter`
thread keeps ``<name>.progress`` current (a count of the communication calls it made, written
when it moved) and answers requests: when the file ``request`` holds a number it has not
answered, it writes ``<name>.status``: the lines its describers give (the recorder: its last
calls; the assistant: each proxy's calls) and every thread's Python stack.

A thread that polls a file, not a signal handler: a stuck rank's main thread sits in a C++
wait (a collective, a Work's ``wait``) that never returns to the interpreter, so a Python
handler would never run, whereas ``faulthandler`` reads every thread's stack from C while they
are blocked. Polling twice a second costs nothing on the program's path and needs no
connection, so it works before the process group exists too.

The launcher side (:class:`StatusBoard`) watches the progress files and, when nothing moved for
a while, on a timeout or on Ctrl-C, asks every live process and turns the answers into one line
per process: where its program is (its innermost frame outside torch, prismllm and the
standard library), which distributed call it is in, and what its describers said.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import importlib.util
import os
import re
import sysconfig
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path

from prismllm.childenv import ChildEnv

REQUEST = "request"
POLL_S = 0.5
_STACKS = "--- stacks ---"

Describe = Callable[[], list[str]]
Progress = Callable[[], int]


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# ------------------------------------------------------------------------------ the process
class StatusReporter:
    """One per process: a daemon thread answering the launcher's status requests (see the
    module docstring). ``add`` registers what the process can say about itself."""

    def __init__(self, directory: str | os.PathLike, name: str, poll_s: float = POLL_S):
        self.dir = Path(directory)
        self.name = name
        self.poll_s = poll_s
        self.describers: list[Describe] = []
        self.progress_fns: list[Progress] = []
        self.answered = 0
        self.progress = -1
        self.main_ident = threading.main_thread().ident or 0
        self.thread: threading.Thread | None = None

    def add(self, describe: Describe | None = None, progress: Progress | None = None) -> None:
        if describe is not None:
            self.describers.append(describe)
        if progress is not None:
            self.progress_fns.append(progress)

    def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.thread = threading.Thread(target=self._loop, daemon=True, name="prism-status")
        self.thread.start()

    def _loop(self) -> None:
        while True:
            time.sleep(self.poll_s)
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - a diagnosis aid must never end the program
                pass

    def tick(self) -> None:
        """Write the progress file if it moved, and the status file if a request is new."""
        n = 0
        for fn in self.progress_fns:
            try:
                n += int(fn())
            except Exception:  # noqa: BLE001 - e.g. a recorder that is finishing
                pass
        if n != self.progress:
            self.progress = n
            _write_atomic(self.dir / f"{self.name}.progress", str(n))
        try:
            gen = int((self.dir / REQUEST).read_text().strip() or 0)
        except (OSError, ValueError):
            return
        if gen > self.answered:
            self.write_status(gen)
            self.answered = gen

    def write_status(self, generation: int) -> None:
        lines = [f"generation {generation}", f"pid {os.getpid()}", f"main-thread {self.main_ident}"]
        for fn in self.describers:
            try:
                lines += [f"say {ln}" for ln in fn()]
            except Exception as e:  # noqa: BLE001 - say what could not be said
                lines.append(f"say (its state could not be read: {type(e).__name__}: {e})")
        path = self.dir / f"{self.name}.status"
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(tmp, "w") as f:
            f.write("\n".join(lines) + f"\n{_STACKS}\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        os.replace(tmp, path)


_reporter: StatusReporter | None = None
_reporter_lock = threading.Lock()


def reporter() -> StatusReporter | None:
    """This process's reporter, started on first use when the launcher asked for one
    (``ChildEnv.status_dir`` set); None otherwise."""
    global _reporter
    with _reporter_lock:
        child = ChildEnv.current()
        if _reporter is None and child.status_dir:
            _reporter = StatusReporter(child.status_dir, child.status_name or f"pid-{os.getpid()}")
            _reporter.start()
        return _reporter


# ------------------------------------------------------------------------------ the launcher
@dataclasses.dataclass
class Frame:
    file: str
    line: int
    func: str

    def __str__(self) -> str:
        return f"{os.path.basename(self.file)}:{self.line} in {self.func}"


@dataclasses.dataclass
class ProcessStatus:
    """One process's answer: what it said about itself and its main thread's stack (most
    recent call first)."""

    said: list[str]
    main_stack: list[Frame]

    def _program_index(self) -> int:
        return next((k for k, f in enumerate(self.main_stack) if not _is_library(f.file)), -1)

    def program_frame(self) -> Frame | None:
        """The innermost frame of the program's own code (not torch, prismllm or the
        standard library)."""
        k = self._program_index()
        return self.main_stack[k] if k >= 0 else None

    def library_call(self) -> Frame | None:
        """The library function the program's innermost frame called (``all_reduce``,
        ``wait``), past torch's logging wrappers."""
        k = self._program_index() - 1
        while k > 0 and self.main_stack[k].file.endswith("c10d_logger.py"):
            k -= 1
        return self.main_stack[k] if k >= 0 else None

    def summary(self) -> str:
        prog, call = self.program_frame(), self.library_call()
        if prog is None:  # prism's own process (an assistant): its innermost frame of prism's
            ours = next((f for f in self.main_stack if _is_ours(f.file)), None)
            top = ours or (self.main_stack[0] if self.main_stack else None)
            return f"at {top}" if top is not None else "no Python stack"
        return f"at {prog}" + (f", in {call.func} ({os.path.basename(call.file)})" if call is not None else "")


def _library_roots() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(prismllm's and torch's directories, the standard library's)."""
    ours = [_PACKAGE]
    try:
        spec = importlib.util.find_spec("torch")
        if spec is not None and spec.origin:
            ours.append(os.path.dirname(spec.origin))
    except (ImportError, ValueError):
        pass
    std = {os.path.abspath(p) for k in ("stdlib", "platstdlib") if (p := sysconfig.get_paths().get(k))}
    return tuple(r + os.sep for r in ours), tuple(r + os.sep for r in std)


_LIBRARY: tuple[tuple[str, ...], tuple[str, ...]] | None = None
_PACKAGE = str(Path(__file__).resolve().parents[1])  # prismllm's own directory


def _is_ours(path: str) -> bool:
    """Whether a frame's file is prismllm's."""
    return os.path.abspath(path).startswith(_PACKAGE + os.sep)


def _is_library(path: str) -> bool:
    """Whether a frame's file is torch's, prismllm's or the standard library's (not the
    program's: installed packages such as Megatron are the program's, also where they sit
    under the standard library's directory, as a base interpreter's site-packages does)."""
    global _LIBRARY
    if _LIBRARY is None:
        _LIBRARY = _library_roots()
    if path.startswith("<"):
        return True
    ours, std = _LIBRARY
    path = os.path.abspath(path)
    if path.startswith(ours):
        return True
    return (
        path.startswith(std)
        and f"{os.sep}site-packages{os.sep}" not in path
        and f"{os.sep}dist-packages{os.sep}" not in path
    )


_THREAD = re.compile(r"^(?:Current thread|Thread) 0x([0-9a-fA-F]+)")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')


def parse_status(text: str) -> ProcessStatus:
    """A status file's content (see :meth:`StatusReporter.write_status`)."""
    head, _, stacks = text.partition(f"\n{_STACKS}\n")
    said, main = [], 0
    for ln in head.splitlines():
        key, _, value = ln.partition(" ")
        if key == "say":
            said.append(value)
        elif key == "main-thread":
            main = int(value or 0)
    frames: dict[int, list[Frame]] = {}
    cur: list[Frame] | None = None
    for ln in stacks.splitlines():
        m = _THREAD.match(ln)
        if m:
            cur = frames.setdefault(int(m.group(1), 16), [])
            continue
        m = _FRAME.match(ln)
        if m and cur is not None:
            cur.append(Frame(m.group(1), int(m.group(2)), m.group(3)))
    return ProcessStatus(said, frames.get(main, []))


class StatusBoard:
    """The launcher's view of its children's status files (``names``: launcher id -> the
    child's ``ChildEnv.status_name``; ranks >= 0, helpers < 0)."""

    def __init__(self, directory: str | os.PathLike, names: Mapping[int, str]):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        for f in self.dir.iterdir():  # an earlier run's answers would pass for this one's
            if f.name == REQUEST or f.suffix in (".status", ".progress", ".tmp"):
                f.unlink(missing_ok=True)
        self.names = dict(names)
        self.generation = 0
        self._seen: dict[int, str] = {}
        self.last_progress = time.monotonic()

    def env(self, child: int) -> dict[str, str]:
        return ChildEnv(status_dir=str(self.dir), status_name=self.names[child]).to_env()

    def poll_progress(self) -> float:
        """Read the progress files; returns the seconds since any of them last moved."""
        now = time.monotonic()
        for child, name in self.names.items():
            try:
                v = (self.dir / f"{name}.progress").read_text()
            except OSError:
                continue
            if self._seen.get(child) != v:
                self._seen[child] = v
                self.last_progress = now
        return now - self.last_progress

    def request(self, children: Sequence[int], wait_s: float = 3.0) -> dict[int, ProcessStatus | None]:
        """Ask ``children`` where they stand; each answer, or None for one that gave none
        within ``wait_s`` (a process that has not started Python, or is stopped)."""
        self.generation += 1
        gen = self.generation
        _write_atomic(self.dir / REQUEST, str(gen))
        out: dict[int, ProcessStatus | None] = {c: None for c in children}
        deadline = time.monotonic() + wait_s
        while True:
            for c in children:
                if out[c] is not None:
                    continue
                try:
                    text = (self.dir / f"{self.names[c]}.status").read_text()
                except OSError:
                    continue
                if text.startswith(f"generation {gen}\n"):
                    out[c] = parse_status(text)
            if all(v is not None for v in out.values()) or time.monotonic() >= deadline:
                return out
            time.sleep(0.05)

    def report(
        self,
        children: Sequence[int],
        who: Callable[[Sequence[int]], str],
        wait_s: float = 3.0,
        detail_up_to: int = 8,
        stopped: Collection[int] = (),
    ) -> list[str]:
        """Where ``children`` stand: one line per distinct place (``who(ids)`` names the
        processes there), and what each process said about itself, for every process when at
        most ``detail_up_to`` answered, else for the first of each place. ``stopped``: children
        stopped by a signal, not asked (they cannot answer). Empty when none of them runs a reporter."""
        # a child that never wrote its progress file runs no reporter (a plain script): not asked
        live = [c for c in children if (self.dir / f"{self.names[c]}.progress").exists()]
        if not live:
            return []
        asked = [c for c in live if c not in stopped]
        answers: dict[int, ProcessStatus | None | str] = dict(self.request(asked, wait_s) if asked else [])
        answers.update({c: "stopped (SIGSTOP: switch mode's turn, or a debugger)" for c in live if c in stopped})
        answers.update({c: "no status (not a prism process)" for c in children if c not in answers})
        places: dict[str, list[int]] = {}
        for c, st in answers.items():
            place = st if isinstance(st, str) else st.summary() if st is not None else f"no answer within {wait_s:g} s"
            places.setdefault(place, []).append(c)
        many = sum(isinstance(st, ProcessStatus) for st in answers.values()) > detail_up_to
        lines = []
        for place, ids in places.items():
            lines.append(f"  {who(ids)}: {place}")
            for c in ids[:1] if many else ids:
                st = answers[c]
                if isinstance(st, ProcessStatus) and st.said:
                    lines.extend(f"    {who([c]) + ': ' if len(ids) > 1 else ''}{s}" for s in st.said)
        return lines


__all__ = ["ProcessStatus", "StatusBoard", "StatusReporter", "parse_status", "reporter"]
