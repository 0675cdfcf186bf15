"""Recorded-tensor store: collective outputs saved by a record run, replayed by solo runs.

Record mode saves when told to (``prism record --save-tensors SELECTOR [--tensor-store DIR]``)
are set (selector: ``all``, or a comma list of op names -- ``all_reduce``, ``all_gather``,
``reduce_scatter``, ``all_to_all``, ``broadcast``, ``reduce``, ``gather``, ``scatter``,
``recv`` -- and/or ``label:<label>`` items, a ``prismllm.mark`` label; the item ``inputs``
adds the selected calls' inputs, entries with ``io: "in"``, e.g. ``all,inputs``: what a
virtual member contributes to a pruned collective). Solo mode replays when
``prism capture --tensors DIR`` is given: the store answers before rules and defaults.

Format (no pickle, no torch.save): per rank two files in the directory,

* ``rank-<rank:06d>.bin``: the raw bytes of the saved tensors, back to back (C order, the
  tensor's own dtype; bf16 etc. as their bit patterns);
* ``rank-<rank:06d>.idx``: a stream of msgpack maps, one per saved call, appended as the run
  goes (a crash loses at most the call being written)::

      {"io": "out", "group_name": "4", "group": [global ranks in group-rank order],
       "op": "all_gather",
       "index": 3,
       "peer": -1, "label": "", "tensors": [{"dtype": "int64", "shape": [8],
       "offset": 1024, "nbytes": 64}, ...]}

Key: (rank, group name, group ranks, op, index, peer) -- the name too, since two groups may
hold the same ranks (e.g. DP and EP groups when ep == dp) -- where ``index`` is the per-group call index that
the recorder stores as ``seq`` (for send/recv: the index among calls to that peer, and
``peer`` is the global peer; -1 for collectives). ``tensors`` are the call's outputs in
order (one for in-place/single-output ops, the list for list outputs such as
``dist.all_gather``). A later entry with the same key replaces an earlier one.

Reading for a graph of another run: a solo capture names a DP replica's groups after its
representative's (``3@3``), where the recording that filled the store named them as torch
does (``6``). A name the store does not hold for those ranks is read as the store's one group
of those ranks, when it holds exactly one (two groups of the same ranks stay apart: no entry).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgpack
import torch

Key = tuple[str, tuple[int, ...], str, int, int, str]
OPS = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "recv",
    "send",
)  # ops a selector can name (send: inputs only)


def _paths(root: str | os.PathLike, rank: int) -> tuple[Path, Path]:
    d = Path(root)
    return d / f"rank-{rank:06d}.idx", d / f"rank-{rank:06d}.bin"


def dtype_from_name(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


class Selector:
    """``all`` | comma list of op names and ``label:<label>`` items."""

    def __init__(self, spec: str, strict: bool = False):
        self.spec = spec
        items = [s.strip() for s in spec.split(",") if s.strip()]
        if strict:
            if not items:
                raise ValueError("empty selector: give 'all', op names or label:<label>")
            bad = [s for s in items if s not in ("all", "inputs") and not s.startswith("label:") and s not in OPS]
            if bad:
                raise ValueError(f"unknown op(s) {', '.join(bad)}; known: all, {', '.join(OPS)}, label:<label>, inputs")
        self.all = "all" in items
        self.inputs = "inputs" in items  # also save the selected calls' inputs
        self.ops = {s for s in items if not s.startswith("label:") and s not in ("all", "inputs")}
        self.labels = {s[len("label:") :] for s in items if s.startswith("label:")}

    def __call__(self, op: str, label: str) -> bool:
        return self.all or op in self.ops or (bool(label) and label in self.labels)

    def __bool__(self) -> bool:
        return self.all or bool(self.ops) or bool(self.labels)


class TensorStoreWriter:
    """Appends one rank's saved outputs (thread-safe: gloo's completion callbacks call it)."""

    def __init__(self, root: str | os.PathLike, rank: int):
        os.makedirs(root, exist_ok=True)
        idx, binp = _paths(root, rank)
        self._idx = open(idx, "ab")
        self._bin = open(binp, "ab")
        self._off = self._bin.tell()
        self._lock = threading.Lock()

    def save(self, group_name: str, group: Iterable[int], op: str, index: int, peer: int,
             label: str, tensors: list[torch.Tensor], io: str = "out") -> None:  # fmt: skip
        metas, blobs = [], []
        for t in tensors:
            c = t.detach()
            if c.device.type != "cpu":
                c = c.cpu()
            c = c.contiguous().reshape(-1)
            b = c.view(torch.uint8).numpy().tobytes() if c.numel() else b""
            metas.append({"dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape),
                          "nbytes": len(b)})  # fmt: skip
            blobs.append(b)
        with self._lock:
            for m, b in zip(metas, blobs):
                m["offset"] = self._off
                self._bin.write(b)
                self._off += len(b)
            self._bin.flush()
            entry = {"io": io, "group_name": group_name, "group": list(group), "op": op, "index": int(index), "peer": int(peer),
                     "label": label, "tensors": metas}  # fmt: skip
            self._idx.write(msgpack.packb(entry, use_bin_type=True))
            self._idx.flush()

    def close(self) -> None:
        with self._lock:
            self._idx.close()
            self._bin.close()


def _pread_all(fd: int, n: int, off: int, path: Path) -> bytearray:
    """``n`` bytes at ``off`` (one pread returns at most ~2 GiB on Linux)."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = os.preadv(fd, [view[got:]], off + got)
        if k <= 0:
            raise OSError(f"{path}: truncated ({got} of {n} bytes at offset {off})")
        got += k
    return buf


class TensorStore:
    """One rank's saved outputs, read for replay."""

    def __init__(self, root: str | os.PathLike, rank: int):
        self.root = Path(root)
        self.rank = rank
        idx, self._binp = _paths(root, rank)
        self.entries: dict[Key, dict[str, Any]] = {}
        self._names: dict[tuple[int, ...], set[str]] = {}  # group ranks -> the names saved under
        if idx.exists():
            with open(idx, "rb") as f:
                for e in msgpack.Unpacker(f, raw=False, strict_map_key=False):
                    key = self.key(e["group_name"], e["group"], e["op"], e["index"], e["peer"], e.get("io", "out"))
                    self.entries[key] = e
                    self._names.setdefault(key[1], set()).add(key[0])
        self._fd: int | None = None
        self._open_lock = threading.Lock()

    @staticmethod
    def key(group_name: str, group: Iterable[int], op: str, index: int, peer: int = -1, io: str = "out") -> Key:
        return (str(group_name), tuple(int(r) for r in group), op, int(index), int(peer), io)

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, group_name: str, group, op: str, index: int, peer: int = -1,
            io: str = "out") -> list[torch.Tensor] | None:  # fmt: skip
        """The saved outputs (``io="out"``) or inputs (``"in"``) of one call, or None.
        Safe from several threads at once (the assistant's group workers share a rank's
        store): positional reads, no shared file position."""
        key = self.key(group_name, group, op, index, peer, io)
        names = self._names.get(key[1], ())
        if key[0] not in names and len(names) == 1:  # the group under this run's name
            key = (next(iter(names)), *key[1:])
        e = self.entries.get(key)
        if e is None:
            return None
        if self._fd is None:
            with self._open_lock:
                if self._fd is None:
                    self._fd = os.open(self._binp, os.O_RDONLY)
        out = []
        for m in e["tensors"]:
            raw = _pread_all(self._fd, m["nbytes"], m["offset"], self._binp)
            dt = dtype_from_name(m["dtype"])
            if raw:
                t = torch.frombuffer(raw, dtype=torch.uint8).view(dt)
            else:
                t = torch.empty(0, dtype=dt)
            out.append(t.reshape(m["shape"]))
        return out


__all__ = ["Selector", "TensorStore", "TensorStoreWriter", "dtype_from_name"]
