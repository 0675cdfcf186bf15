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

Once the run is over, ``prism record`` seals the store (:func:`seal_store`): ``manifest.json``
lists every rank file with its size and CRC-32 (:mod:`prismllm.integrity`). Every index entry
is checked when a rank's store opens (known dtype, bytes = shape x item size, within the data
file); :func:`verify_store` checks the seal and every rank's index before any process starts,
and with a graph, each saved call against the graph's call (dtype, bytes, input shape). A store
written before seals (no manifest) is read unchecked by checksum.
"""

from __future__ import annotations

import json
import math
import os
import re
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgpack
import torch

from prismllm.errors import InputError
from prismllm.fsutil import write_file_atomically
from prismllm.integrity import check_sealed, sealed
from prismllm.trace.schema import KIND_COMM, P2P_OPS

if TYPE_CHECKING:
    from prismllm.trace.graph import PrismTrace

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


MANIFEST_FILE = "manifest.json"
FORMAT_NAME = "prism-tensor-store"
FORMAT_VERSION = 1
RANK_FILE = re.compile(r"rank-(\d{6})\.(idx|bin)")
_FIX = "record the store again (prism record --save-tensors)"
# ops whose one buffer is both the input and the output, on the root and off it: the graph
# counts its bytes on one side only (a broadcast's root sends, the others receive)
_ONE_BUFFER_OPS = ("all_reduce", "broadcast", "reduce")


class StoreError(InputError):
    """A tensor store that is incomplete, damaged or not the graph's; the message names the file."""


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


def _whole(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _entry_problem(e: Any, data_bytes: int) -> str | None:
    """What is wrong with one index entry read back (None: nothing): its keys' types, each
    tensor's dtype, its bytes against its shape, and its place inside the data file."""
    if not isinstance(e, dict):
        return "is not a map"
    for k, ok in (
        ("group_name", isinstance(e.get("group_name"), str)),
        ("group", isinstance(e.get("group"), list) and all(_whole(r) and r >= 0 for r in e["group"])),
        ("op", e.get("op") in OPS),
        ("index", _whole(e.get("index")) and e["index"] >= 0),
        ("peer", _whole(e.get("peer")) and e["peer"] >= -1),
        ("io", e.get("io", "out") in ("in", "out")),
        ("tensors", isinstance(e.get("tensors"), list)),
    ):
        if not ok:
            return f"has a bad {k}"
    for i, m in enumerate(e["tensors"]):
        if not isinstance(m, dict):
            return f"tensor {i} is not a map"
        try:
            item = dtype_from_name(m.get("dtype")).itemsize
        except (ValueError, TypeError):
            return f"tensor {i} has dtype {str(m.get('dtype'))[:40]!r}, not one of torch's"
        shape, n, off = m.get("shape"), m.get("nbytes"), m.get("offset")
        if not (isinstance(shape, list) and all(_whole(d) and d >= 0 for d in shape)):
            return f"tensor {i} has a bad shape"
        if not (_whole(n) and n == math.prod(shape) * item):
            return f"tensor {i} has {n!r} bytes for shape {shape} of {m['dtype']}"
        if not (_whole(off) and 0 <= off and off + n <= data_bytes):
            return f"tensor {i}'s bytes {off!r}..+{n} are outside the data file ({data_bytes} bytes)"
    return None


class TensorStore:
    """One rank's saved outputs, read for replay. Every index entry is checked as it is read
    (StoreError naming the file and the entry): a damaged one is never used."""

    def __init__(self, root: str | os.PathLike, rank: int):
        self.root = Path(root)
        self.rank = rank
        idx, self._binp = _paths(root, rank)
        self.entries: dict[Key, dict[str, Any]] = {}
        self._names: dict[tuple[int, ...], set[str]] = {}  # group ranks -> the names saved under
        if idx.exists():
            data_bytes = self._binp.stat().st_size if self._binp.is_file() else 0
            for i, e in enumerate(_read_index(idx)):
                problem = _entry_problem(e, data_bytes)
                if problem is not None:
                    raise StoreError(f"tensor store {self.root}: {idx.name}: entry {i} {problem}; {_FIX}")
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

    def entry(self, group_name: str, group: Iterable[int], op: str, index: int, peer: int = -1,
              io: str = "out") -> dict[str, Any] | None:  # fmt: skip
        """The index entry of one call (its tensors' dtype, shape, offset, bytes), or None; a
        group name the store does not hold is read as the store's one group of those ranks."""
        key = self.key(group_name, group, op, index, peer, io)
        names = self._names.get(key[1], ())
        if key[0] not in names and len(names) == 1:  # the group under this run's name
            key = (next(iter(names)), *key[1:])
        return self.entries.get(key)

    def get(self, group_name: str, group, op: str, index: int, peer: int = -1,
            io: str = "out") -> list[torch.Tensor] | None:  # fmt: skip
        """The saved outputs (``io="out"``) or inputs (``"in"``) of one call, or None.
        Safe from several threads at once (the assistant's group workers share a rank's
        store): positional reads, no shared file position."""
        e = self.entry(group_name, group, op, index, peer, io)
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


def _read_index(idx: Path) -> list[Any]:
    """The entries of an index file as msgpack decodes them; StoreError if it cannot."""
    try:
        with open(idx, "rb") as f:
            return list(msgpack.Unpacker(f, raw=False, strict_map_key=False))
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise StoreError(
            f"tensor store {idx.parent}: {idx.name} is not an index ({type(e).__name__}); {_FIX}"
        ) from None


def rank_files(root: str | os.PathLike) -> list[str]:
    """The names of the store's rank files (index and data), sorted."""
    return sorted(p.name for p in Path(root).iterdir() if RANK_FILE.fullmatch(p.name))


def seal_store(root: str | os.PathLike) -> Path:
    """Write the store's manifest (every rank file's size and CRC-32), atomically, once the ranks
    that wrote the store have exited."""
    root = Path(root)
    manifest = sealed({"format": FORMAT_NAME, "format_version": FORMAT_VERSION}, root, rank_files(root))
    return write_file_atomically(root / MANIFEST_FILE, json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def verify_store(root: str | os.PathLike, graph: PrismTrace | None = None, graph_path: str = "") -> None:
    """Check the store at ``root`` before any process reads it: its manifest's seal (every rank
    file listed, of its size and checksum; a store written before seals has none), every rank's
    index (:class:`TensorStore`), and with ``graph`` every saved call against the graph's call
    of the same rank and key (dtype, bytes, the input's shape). StoreError on the first problem."""
    root = Path(root)
    where = f"tensor store {root}"
    names = rank_files(root)
    mpath = root / MANIFEST_FILE
    if mpath.exists():
        try:
            manifest = json.loads(mpath.read_text())
        except (OSError, ValueError, RecursionError) as e:
            raise StoreError(f"{where}: {MANIFEST_FILE} is unreadable ({type(e).__name__}); {_FIX}") from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
            raise StoreError(f"{where}: {MANIFEST_FILE} is not a tensor store's manifest; {_FIX}")
        if manifest.get("format_version") != FORMAT_VERSION:
            raise StoreError(
                f"{where}: {MANIFEST_FILE} has format_version {str(manifest.get('format_version'))[:20]}, this prismllm reads {FORMAT_VERSION}"
            )
        if not check_sealed(manifest, root, names, where, StoreError, _FIX):
            raise StoreError(f"{where}: {MANIFEST_FILE} has no checksums; {_FIX}")
    for rank in sorted({int(RANK_FILE.fullmatch(n).group(1)) for n in names}):
        store = TensorStore(root, rank)
        if graph is not None:
            _check_against(store, graph, f"{where}: rank-{rank:06d}.idx", graph_path)


def _check_against(store: TensorStore, graph: PrismTrace, where: str, graph_path: str) -> None:
    """Each of the graph's calls of the store's rank that the store holds (inputs and outputs):
    the dtype, the bytes and (inputs) the first tensor's shape the graph has for it."""
    groups = graph.group_info()
    nodes = graph.nodes_of(store.rank)
    cols = nodes.select(["kind", "op", "group", "seq", "peer", "dtype", "shape", "in_bytes", "out_bytes"]).to_pydict()
    for kind, op, gid, seq, peer, dtype, shape, nin, nout in zip(*cols.values()):
        if kind != KIND_COMM or gid not in groups:
            continue
        g = groups[gid]
        for io in ("in", "out"):
            e = store.entry(g["name"], g["ranks"], op, seq, peer if op in P2P_OPS else -1, io)
            if e is None:
                continue
            want = max(nin, nout) if op in _ONE_BUFFER_OPS else (nin if io == "in" else nout)
            ts = e["tensors"]
            got = sum(m["nbytes"] for m in ts)
            wrong = (
                got != want
                or any(m["dtype"] != dtype for m in ts)
                or (io == "in" and ts and list(ts[0]["shape"]) != list(shape))
            )
            if wrong:
                held = ", ".join(f"{m['dtype']} {m['shape']}" for m in ts) or "nothing"
                raise StoreError(
                    f"{where}: the {'inputs' if io == 'in' else 'outputs'} of {op} #{seq} on group {g['name']} "
                    f"are {held} ({got} bytes), the graph {graph_path} has {dtype} {list(shape)} ({want} bytes): "
                    f"the store is not this graph's; {_FIX}"
                )


__all__ = [
    "Selector",
    "StoreError",
    "TensorStore",
    "TensorStoreWriter",
    "dtype_from_name",
    "rank_files",
    "seal_store",
    "verify_store",
]
