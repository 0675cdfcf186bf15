"""The output pump: one thread reads every child's pipes and passes whole lines on (to the
terminal or a sink, to per-rank logs, and into a bounded tail kept for failure messages)."""

from __future__ import annotations

import collections
import dataclasses
import os
import selectors
import sys
import threading

from prismllm.launch.spec import LineSink

_write_lock = threading.Lock()


def default_sink(rank: int, stream: str, line: str) -> None:
    f = sys.stdout if stream == "stdout" else sys.stderr
    with _write_lock:
        try:
            f.write(line)
            f.flush()
        except (OSError, ValueError):  # closed or broken pipe: keep draining the children
            pass


@dataclasses.dataclass
class Stream:
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


class OutputPump:
    MAX_LINE = 64 * 1024  # a "line" longer than this is passed on in pieces
    TAIL_LINE_CHARS = 400

    def __init__(self, streams: list[Stream], sink: LineSink):
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

    def _emit(self, s: Stream, data: bytes) -> None:
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

    def _read(self, s: Stream) -> None:
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
