"""One progress display for the commands that run for a while (capture, time, run): a rich bar
per stage on a terminal (done / total, elapsed, ETA) with the program's and prism's lines printed
above it; elsewhere (pipes, files, CI) plain lines, a progress line at most every
``PLAIN_EVERY_S`` seconds."""

from __future__ import annotations

import sys
import threading
import time

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

from prismllm.terminal import Table

PLAIN_EVERY_S = 10.0


def fmt_seconds(s: float) -> str:
    if s < 60:
        return f"{s:.0f} s"
    if s < 3600:
        return f"{s // 60:.0f} min {s % 60:02.0f} s"
    return f"{s // 3600:.0f} h {s % 3600 // 60:02.0f} min"


class Display:
    """``say`` prism's own lines (``prism COMMAND: ...``), ``sink`` the program's, ``stage`` and
    ``update`` the bar. ``stop`` before printing a summary. With ``json`` stdout is the result's
    alone: the program's stdout goes to stderr too."""

    def __init__(self, command: str, tty: bool | None = None, json: bool = False):
        self.command = command
        self.json = json
        self.tty = (sys.stdout.isatty() and sys.stderr.isatty()) if tty is None else tty
        self.console = Console(stderr=True) if self.tty else None
        self.bar: Progress | None = None
        self.task: TaskID | None = None
        self.name = ""
        self.unit = ""
        self.started = 0.0
        self.last_plain = 0.0
        self.lock = threading.Lock()

    # ---- lines
    def say(self, text: str) -> None:
        line = f"prism {self.command}: {text}"
        if self.console is not None:
            self.console.print(line, highlight=False, markup=False, soft_wrap=True)
        else:
            print(line, file=sys.stderr, flush=True)

    def sink(self, rank: int, stream: str, line: str) -> None:
        """A LineSink (prismllm.launch) for the program's output."""
        if self.console is not None:
            self.console.print(Text.from_ansi(line.rstrip("\n")), soft_wrap=True, highlight=False)
        else:
            f = sys.stdout if stream == "stdout" and not self.json else sys.stderr
            with self.lock:
                f.write(line)
                f.flush()

    # ---- the bar
    def stage(self, name: str, total: int | None = None, unit: str = "", done: int = 0) -> None:
        """A new stage: the previous one's bar goes, this one's starts."""
        self.finish()
        self.name, self.unit, self.started, self.last_plain = name, unit, time.monotonic(), 0.0
        if self.console is not None:
            self.bar = Progress(
                TextColumn(f"[bold]{name}[/]"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn(unit),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                TextColumn("{task.description}"),
                console=self.console,
                transient=True,
            )
            self.bar.start()
            self.task = self.bar.add_task("", total=total, completed=done)

    def update(self, done: int, total: int | None = None, note: str = "") -> None:
        if self.bar is not None and self.task is not None:
            self.bar.update(self.task, completed=done, total=total, description=note)
            return
        now = time.monotonic()
        if now - self.last_plain < PLAIN_EVERY_S and not (total and done >= total):
            return
        self.last_plain = now
        elapsed = now - self.started
        of = f"/{total}" if total else ""
        self.say(f"{self.name}: {done}{of} {self.unit} done in {fmt_seconds(elapsed)}" + (f" ({note})" if note else ""))

    def finish(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None
            self.task = None

    stop = finish


def key_values(rows: list[tuple[str, str]], title: str | None = None) -> None:
    """A result as two columns (what, value), after an optional green title line, on stdout."""
    table = Table(show_header=False, box=None, padding=(0, 1))
    table.add_column(style="bold")
    table.add_column()
    for k, v in rows:
        table.add_row(k, v)
    console = Console()
    if title:
        console.print(f"[green]{title}[/green]")
    console.print(table)


def count(v: int | None) -> str:
    return "?" if v is None else f"{v:,}"


__all__ = ["Display", "count", "fmt_seconds", "key_values"]
