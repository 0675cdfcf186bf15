"""Allocator history of a rank, for explaining a peak-memory difference (GPU).

``PRISM_MEMORY_HISTORY=<dir>`` (``ChildEnv.memory_history``; record and solo modes): the
bootstrap starts the CUDA caching allocator's own history (``torch.cuda.memory._record_memory_history``, Python stacks) before
the program runs, and at exit writes ``<dir>/rank-<rank:06d>.msgpack``: every allocator event
of the rank's device (action, address, size, stream, the innermost Python frames). Written
with msgpack from the snapshot dict, not torch's pickle dump.

``live_at_peak(events)`` replays the events (``alloc`` adds a block, ``free_requested``
removes it: the allocator's ``allocated_bytes`` moves at those two points) and returns the
peak and the blocks live at it, so that two runs' peaks can be compared block by block.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

import msgpack
import torch

FRAMES_KEPT = 6


def start(local_rank: int) -> bool:
    """Start the history on this rank's device (LOCAL_RANK, as torchrun programs select it);
    False where there is no CUDA."""

    if not torch.cuda.is_available():
        return False
    torch.cuda.set_device(local_rank)
    torch.cuda.memory._record_memory_history(max_entries=2_000_000)
    return True


def dump(directory: str | os.PathLike, rank: int) -> Path:
    """Write this rank's allocator events (see the module docstring)."""

    snap = torch.cuda.memory._snapshot()
    dev = torch.cuda.current_device()
    traces = snap.get("device_traces", [])
    events = []
    for e in traces[dev] if dev < len(traces) else []:
        frames = [(f.get("filename", ""), int(f.get("line", 0)), f.get("name", ""))
                  for f in e.get("frames", [])[:FRAMES_KEPT]]  # fmt: skip
        events.append({"action": e["action"], "addr": int(e["addr"]), "size": int(e["size"]),
                       "stream": int(e.get("stream", 0)), "frames": frames})  # fmt: skip
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"rank-{rank:06d}.msgpack"
    path.write_bytes(msgpack.packb({"rank": rank, "device": dev, "events": events}, use_bin_type=True))
    return path


def load(path: str | os.PathLike) -> dict[str, Any]:
    return msgpack.unpackb(Path(path).read_bytes(), raw=False)


def live_at_peak(events: list[dict[str, Any]]) -> tuple[int, list[dict[str, Any]]]:
    """(peak allocated bytes, the blocks live at the first time it was reached)."""
    live: dict[int, dict[str, Any]] = {}
    cur = peak = 0
    at_peak: list[dict[str, Any]] = []
    for e in events:
        if e["action"] == "alloc":
            live[e["addr"]] = e
            cur += e["size"]
            if cur > peak:
                peak, at_peak = cur, list(live.values())
        elif e["action"] == "free_requested" and e["addr"] in live:
            cur -= live.pop(e["addr"])["size"]
    return peak, at_peak


def site(block: dict[str, Any]) -> str:
    """Where a block was allocated: its innermost Python frames outside torch."""
    frames = [f for f in block["frames"] if "/torch/" not in f[0]] or block["frames"]
    return " < ".join(f"{Path(f[0]).name}:{f[1]}:{f[2]}" for f in frames[:3]) or "?"


def diff_at_peak(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> dict[str, Any]:
    """Blocks live at peak in one run and not the other, counted by (size, allocation site)."""
    (pa, la), (pb, lb) = live_at_peak(a), live_at_peak(b)
    ka = Counter((x["size"], site(x)) for x in la)
    kb = Counter((x["size"], site(x)) for x in lb)

    def rows(c: Counter) -> list[list]:
        return sorted(([size, where, n] for (size, where), n in c.items()), reverse=True)

    return {"peak_a": pa, "peak_b": pb, "only_a": rows(ka - kb), "only_b": rows(kb - ka)}
