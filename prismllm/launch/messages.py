"""The launcher's messages: how a child ended, the error line of its output, and one message for
a failed run."""

from __future__ import annotations

import json
import os
import re
import signal
from collections.abc import Mapping, Sequence
from pathlib import Path

from prismllm.launch.spec import RankFailure
from prismllm.outdir import STORAGE_ERRNOS
from prismllm.specs import format_ranks


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
_ERROR_LINE = re.compile(
    r"^(?:(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Interrupt|Exit)(?::|$)|"
    r"prism(?: \w+)?: error: )"
)
# An error that only says a peer went away: the consequence of another process's failure.
_LOST_PEER = re.compile(
    r"Connection (?:closed|reset) by peer|Broken pipe|remote process exited|"
    r"communicator was aborted|failed to recv, got 0 bytes",
    re.IGNORECASE,
)


# What an allocation failure says: torch (CUDA, CPU allocator), Python, numpy, NCCL/cuBLAS.
_OUT_OF_MEMORY = re.compile(
    r"MemoryError|out of memory|can(?:'|no)t allocate memory|not enough memory|_ALLOC_FAILED",
    re.IGNORECASE,
)


# What a full disk or a failing file system says (the messages of prismllm.outdir.STORAGE_ERRNOS).
_STORAGE = re.compile("|".join(re.escape(os.strerror(e)) for e in sorted(STORAGE_ERRNOS)))


def says_storage_error(lines: Sequence[str]) -> bool:
    """Whether the error a process reported last (:func:`error_line`) is a write that failed on a
    full disk or a failing file system."""
    return any(_STORAGE.search(ln) for ln in error_line(lines)[1])


def says_out_of_memory(lines: Sequence[str]) -> bool:
    """Whether the error a process reported last (:func:`error_line`) is an allocation failure."""
    return any(is_out_of_memory(ln) for ln in error_line(lines)[1])


def is_out_of_memory(text: str) -> bool:
    """Whether an error's text (``"Type: message"``) says an allocation failed."""
    return _OUT_OF_MEMORY.search(text) is not None


def error_line(lines: Sequence[str]) -> tuple[str, list[str]]:
    """The error a process reported last, from the tail of its output: the last traceback or
    prism error line (what follows it may be the exception's further lines, or noise printed
    at exit), else the last line; and the lines from there on. Rank prefixes are removed."""
    lines = [ln for ln in (_RANK_PREFIX.sub("", ln, count=1).rstrip() for ln in lines) if ln.strip()]
    for i in range(len(lines) - 1, -1, -1):
        if _ERROR_LINE.match(lines[i]):
            return lines[i], lines[i:]
    return (lines[-1].strip(), lines[-1:]) if lines else ("", [])


def has_error_line(lines: Sequence[str]) -> bool:
    """Whether the output holds the last line of a traceback or a prism error line."""
    return any(_ERROR_LINE.match(_RANK_PREFIX.sub("", ln, count=1).rstrip()) for ln in lines)


def lost_peer(lines: Sequence[str]) -> bool:
    return any(_LOST_PEER.search(ln) for ln in error_line(lines)[1])


def error_file_message(path: str | None) -> str | None:
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


def who_is(ids: Sequence[int], names: Mapping[int, str] | None) -> str:
    """ "ranks 0-2, assistant": ranks by number, extras (negative ids) by name."""
    names = names or {}
    ranks = [r for r in ids if r >= 0]
    parts = [f"rank{'s' if len(ranks) > 1 else ''} {format_ranks(ranks)}"] if ranks else []
    parts += [names.get(r, f"extra {-r}") for r in sorted(ids, reverse=True) if r < 0]
    return ", ".join(parts)


def failure_message(
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
        what = (
            f"ranks still running: {format_ranks(running)}"
            if all(r >= 0 for r in running)
            else f"still running: {who_is(running, names)}"
        )
        lines.append(f"timed out{after}; {what} (ended by the launcher)")
        lines.extend(status)
    elif failure.kind == "lingering":
        lines.append(
            f"{who_is(failure.running_ranks, names)} still running {extra_grace or 0:g} s after every "
            f"rank ended successfully (ended by the launcher)"
        )
    else:
        rank = failure.rank
        who = who_is([rank], names)
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
            others = format_ranks(ended) if all(r >= 0 for r in ended) else who_is(ended, names)
            lines.append(f"  other ranks ended by the launcher: {others}")
    if log_dir is not None:
        lines.append(f"  per-rank logs: {log_dir}")
    return "\n".join(lines)
