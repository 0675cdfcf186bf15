"""Object collectives in solo mode (``broadcast_object_list``, ``all_gather_object``,
``gather_object``, ``scatter_object_list``, ``send_object_list``/``recv_object_list``): wrapped
so that rules can answer with objects; by default, the objects that the solo ranks of the same
capture contributed to the call (:class:`SharedObjects`), else the local object(s) replicated
(see prismllm.generate). A ``recv_object_list`` that no rule answers reads a recorded tensor
store (``--tensors``) like any receive, else what its sender sent, where the sender is a solo
rank that ran before it or beside it.

A root's small tensor broadcast (``dist.broadcast``: a micro-batch's token ids, flags, seeds) and
a rank's small tensor send (``dist.send``: a flag, a count, a small model's activations) are kept
the same way (:meth:`SharedObjects.keep_broadcast`, :meth:`SharedObjects.keep_sent`): they answer
the capture's ranks that receive them, and go with the graph (``objects/broadcast-*``,
``objects/sent-*``), where a sandbox rank whose root or sender is virtual receives them in
emulation and in ``prism time``'s slices (:class:`CapturedMessages`).

Each wrapper takes the keywords a newer torch adds and passes them on (2.13: ``use_batch``,
which pipelining's metadata exchange sets)."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import msgpack
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from prismllm.childenv import ChildEnv, user_setting
from prismllm.fsutil import write_file_atomically
from prismllm.generate.errors import GenerateError
from prismllm.generate.generator import DEFAULT, Call, TensorGenerator
from prismllm.trace.schema import MANIFEST_FILE, OBJECTS_DIR  # objects: in the capture's spool, then in its graph

_ORIG: dict[str, Any] = {}
_GEN: TensorGenerator | None = None


class SharedObjects:
    """What the solo ranks of one capture contribute to object collectives, shared through the
    capture's spool (``SPOOL/objects``). The objects a root broadcasts at start-up (a config, a
    run id) or a rank-dependent value every rank gathers cannot be generated from this rank's
    own state, but the rank that owns it is a solo rank of the same capture. Each rank writes
    its contribution when it issues the call (torch's own object payload: the pickle the real
    collective would carry); a rank that needs a peer's reads it when that peer already ran, or
    waits for it (``PRISM_SOLO_OBJECT_WAIT`` seconds at most) when the peer runs in the same
    batch (``ChildEnv.solo_batch``); otherwise (a peer that runs later, a replica that never
    runs) the default stands: this rank's own object. Rules and the recorded store come first."""

    def __init__(self, spool: str | None, batch: tuple[int, ...] | None, wait_s: float):
        self.dir = os.path.join(spool, OBJECTS_DIR) if spool else None
        self.batch = set(batch or ())
        self.wait_s = wait_s
        self._count: dict[tuple, int] = {}  # (group, src, dst) -> messages so far (point to point)
        self._sent: dict[tuple, int] = {}  # the same for tensors sent (send / isend) ...
        self._received: dict[tuple, int] = {}  # ... and received (recv / irecv)

    def _prefix(self, call: Call) -> str:
        return f"{call.op}-{_group_key(call.group_ranks)}-{call.index}-r"

    def _path(self, call: Call, rank: int) -> str:
        return os.path.join(self.dir, f"{self._prefix(call)}{rank}.obj")

    def publish(self, call: Call, obj: Any) -> None:
        if self.dir is not None:
            self._write(self._path(call, call.rank), obj)

    def _write(self, path: str, obj: Any) -> None:
        payload, _ = c10d._object_to_tensor(obj, "cpu", None)
        write_file_atomically(path, payload.numpy().tobytes())  # a reader never sees half a payload

    # -- a root's small broadcast (token ids, flags, seeds): kept, it answers the capture's other
    # -- members (the root ran before, or beside them), and in emulation a sandbox rank whose root
    # -- is virtual (:meth:`CapturedMessages.broadcast`)
    def keep_broadcast(self, call: Call) -> None:
        """Called on the root of ``call``: its tensor, where it is small, written for the others."""
        self._keep(call.input, broadcast_file(call.group_ranks, call.index, call.rank))

    def broadcast(self, call: Call) -> torch.Tensor | None:
        """What the root of ``call`` broadcast (waiting for a root of this batch), or None where it
        kept nothing (a later batch, a replica that never runs, a tensor over the bound)."""
        if call.root == call.rank:
            return None
        return self._kept(call, broadcast_file(call.group_ranks, call.index, call.root), call.root)

    # -- a small tensor sent point to point (a pipeline stage's activations of a small model, a
    # -- flag, a count): kept, it answers the receiver's recv (the sender ran before, or beside
    # -- it); the k-th tensor from a rank to another on a group, counted on each side
    def keep_sent(self, call: Call) -> None:
        """Called on a send: its tensor, where it is small, written for the receiver."""
        k = _next_message(self._sent, call.group_ranks, call.rank, call.peer)
        self._keep(call.input, sent_file(call.group_ranks, call.rank, call.peer, k))

    def count_received(self, call: Call) -> int:
        """The number of the tensor ``call`` receives from its sender (every receive counts,
        whatever answers it: a store, a rule, an object list's payload)."""
        return _next_message(self._received, call.group_ranks, call.peer, call.rank)

    def received(self, call: Call, k: int) -> torch.Tensor | None:
        """The ``k``-th tensor the sender of ``call`` sent this rank (waiting for a sender of this
        batch), or None where it kept none (a later batch, a replica that never runs, a tensor
        over the bound)."""
        return self._kept(call, sent_file(call.group_ranks, call.peer, call.rank, k), call.peer)

    def _keep(self, t: Any, name: str) -> None:
        """``t`` written to the spool as ``name`` for the ranks that receive it, where it is small."""
        if self.dir is not None and isinstance(t, torch.Tensor) and kept_size(t):
            write_file_atomically(os.path.join(self.dir, name), msgpack.packb(encode(t)))

    def _kept(self, call: Call, name: str, sender: int) -> torch.Tensor | None:
        """What ``sender`` kept as ``name`` for ``call``'s one target (waiting for a sender of this
        batch); None where it kept none."""
        ts = call.targets
        if self.dir is None or len(ts) != 1 or not kept_size(ts[0]):
            return None  # (the sender keeps none of this size: no wait)
        path = os.path.join(self.dir, name)
        _wait_for(path, time.monotonic() + (self.wait_s if sender in self.batch else 0.0))
        return read_tensor(path)

    def _wait_for_batch(self, call: Call, ranks: list[int]) -> None:
        """Peers running in this batch publish soon: wait for them (at most ``wait_s``)."""
        end = time.monotonic() + self.wait_s
        for r in ranks:
            if r in self.batch and r != call.rank:
                _wait_for(self._path(call, r), end)

    # -- point to point: the k-th object list a rank sends another on a group. A rank's calls on
    # -- a group are numbered by its own history, which differs between a sender and its receiver
    # -- (pipeline stages), so the pair's own count names the message on both sides
    def message(self, group_ranks: Any, src: int, dst: int) -> str:
        """The next message's file from ``src`` to ``dst`` on the group of ``group_ranks`` (the
        count advances on each side whether or not the payload is used: a rule may answer one
        receive)."""
        k = _next_message(self._count, group_ranks, src, dst)
        return os.path.join(self.dir or "", message_file(group_ranks, src, dst, k))

    def send(self, group_ranks: Any, src: int, dst: int, objs: list) -> None:
        path = self.message(group_ranks, src, dst)
        if self.dir is not None:
            self._write(path, objs)

    def receive(self, path: str, src: int) -> Any:
        """The objects ``src`` sent in message ``path``, waiting for a sender of this batch; DEFAULT
        where the sender has not run (a later batch, a replica that never runs)."""
        if self.dir is None:
            return DEFAULT
        _wait_for(path, time.monotonic() + (self.wait_s if src in self.batch else 0.0))
        return self._read(path)

    def _published(self, call: Call) -> dict[int, str]:
        """rank -> payload file of the peers that published ``call``: one directory scan, not
        one lookup per member (a world-sized group at 8192 ranks cost ~10 s of lookups)."""
        prefix, out = self._prefix(call), {}
        try:
            entries = os.scandir(self.dir)
        except OSError:
            return out
        with entries:
            for e in entries:
                if e.name.startswith(prefix) and e.name.endswith(".obj"):
                    rank = e.name[len(prefix) : -len(".obj")]
                    if rank.isdigit():
                        out[int(rank)] = e.path
        return out

    @staticmethod
    def _read(path: str) -> Any:
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            return DEFAULT
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return c10d._tensor_to_object(payload, payload.numel(), None)

    def get(self, call: Call, rank: int) -> Any:
        """``rank``'s contribution to ``call``, or DEFAULT."""
        if self.dir is None or rank == call.rank:
            return DEFAULT
        self._wait_for_batch(call, [rank])
        return self._read(self._path(call, rank))

    def slots(self, call: Call, own: Any) -> list[Any]:
        """One object per group member: each member's published one, else this rank's own."""
        if self.dir is None:
            return [own] * len(call.group_ranks)
        self._wait_for_batch(call, list(call.group_ranks))
        published = self._published(call)
        out = []
        for r in call.group_ranks:
            v = self._read(published[r]) if r in published and r != call.rank else DEFAULT
            out.append(own if v is DEFAULT else v)
        return out


_SHARED = SharedObjects(None, None, 0.0)


def _group_key(group_ranks: Any) -> str:
    """A group's name in the files of its objects: a digest of its members."""
    return hashlib.sha1(",".join(map(str, group_ranks)).encode()).hexdigest()[:16]


def _wait_for(path: str, end: float) -> None:
    """Until ``path`` exists or the monotonic clock passes ``end``."""
    while not os.path.exists(path) and time.monotonic() < end:
        time.sleep(0.05)


def _next_message(counts: dict[tuple, int], group_ranks: Any, src: int, dst: int) -> int:
    """The index of the next message from ``src`` to ``dst`` on the group; counted in ``counts``."""
    key = (tuple(group_ranks), src, dst)
    k = counts[key] = counts.get(key, -1) + 1
    return k


def message_file(group_ranks: Any, src: int, dst: int, k: int) -> str:
    """The file name of the ``k``-th object list ``src`` sent ``dst`` on the group of ``group_ranks``."""
    return f"p2p-{_group_key(group_ranks)}-{src}-{dst}-{k}.obj"


# A broadcast root's tensor is kept up to this size: what programs broadcast to keep their ranks on
# one path (a micro-batch's token ids, flags, seeds, shapes) fits; parameters and activations do
# not, and stay the receiver's own copy.
KEPT_BROADCAST_BYTES = 1 << 20


def sent_file(group_ranks: Any, src: int, dst: int, k: int) -> str:
    """The file name of the ``k``-th tensor global rank ``src`` sent ``dst`` on the group."""
    return f"sent-{_group_key(group_ranks)}-{src}-{dst}-{k}.tensor"


def kept_size(t: torch.Tensor) -> bool:
    """Whether a broadcast of ``t`` is small enough to be kept (:data:`KEPT_BROADCAST_BYTES`)."""
    return t.numel() * t.element_size() <= KEPT_BROADCAST_BYTES


def broadcast_file(group_ranks: Any, index: int, root: int) -> str:
    """The file name of what global rank ``root`` broadcast in call ``index`` of the group."""
    return f"broadcast-{_group_key(group_ranks)}-{index}-r{root}.tensor"


def encode(t: torch.Tensor) -> dict[str, Any]:
    """A tensor as bytes with its dtype and shape (msgpack's map: no pickle). Copied to the host
    first: a contiguous copy on the device would add to the rank's device memory."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "data": data}


def decode(d: dict[str, Any]) -> torch.Tensor:
    """The flat tensor of :func:`encode`'s map (a fresh, writable one)."""
    dtype = getattr(torch, d["dtype"])
    if not d["data"]:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(bytearray(d["data"]), dtype=torch.uint8).view(dtype)


def read_tensor(path: str | os.PathLike) -> torch.Tensor | None:
    """The tensor :meth:`SharedObjects.keep_broadcast` wrote to ``path``, or None where there is none."""
    try:
        with open(path, "rb") as f:
            d = msgpack.unpackb(f.read())
    except (OSError, ValueError):
        return None
    return decode(d).reshape(d["shape"])


def keep_sent_messages(spool: str) -> None:
    """Record mode: every object list this rank sends (``send_object_list``) is also written to
    the spool, as a solo capture's are, and kept with the graph: in emulation without recorded
    tensors, what a virtual sender sends a sandbox rank."""
    kept = SharedObjects(spool, None, 0.0)
    orig = c10d.send_object_list

    def send_object_list(object_list, dst=None, group=None, device=None, group_dst=None, **kwargs):
        if dst is not None or group_dst is not None:  # (neither: torch's own error, unchanged)
            ranks = c10d.get_process_group_ranks(group or c10d._get_default_group())
            peer = ranks[group_dst] if group_dst is not None else int(dst)
            kept.send(ranks, dist.get_rank(), peer, list(object_list))
        return orig(object_list, dst=dst, group=group, device=device, group_dst=group_dst, **kwargs)

    c10d.send_object_list = dist.send_object_list = send_object_list


class CapturedMessages:
    """The object lists a solo capture's ranks sent each other, kept with its graph
    (``<graph>/objects``, :func:`message_file`): in emulation, what a virtual rank sends a sandbox
    rank's ``recv_object_list``. A replica (a rank the capture did not run: the manifest's
    ``capture.replica_of``) sends what its representative sent the receiver's representative."""

    def __init__(self, directory: Path, replica_of: list[int] | None):
        self.dir, self.replica_of = directory, replica_of
        self._count: dict[tuple, int] = {}
        # the broadcasts and sends kept, listed once: one the capture did not keep (too large, a
        # sender of a later batch) costs the emulated call a set lookup, not a failed open
        names = os.listdir(directory)
        self._broadcasts = {n for n in names if n.startswith("broadcast-")}
        self._sends = {n for n in names if n.startswith("sent-")}
        self._received: dict[tuple, int] = {}

    @classmethod
    def of_graph(cls, graph: str | os.PathLike) -> CapturedMessages | None:
        """The messages kept with ``graph``, or with the capture it was timed from (a timed or
        calibrated graph's ``timing.bare_graph``); None where there are none."""
        g = Path(graph)
        for _ in range(3):
            try:
                manifest = json.loads((g / MANIFEST_FILE).read_text())
            except (OSError, ValueError):
                return None
            if (g / OBJECTS_DIR).is_dir():
                return cls(g / OBJECTS_DIR, (manifest.get("capture") or {}).get("replica_of"))
            bare = (manifest.get("timing") or {}).get("bare_graph")
            if not bare:
                return None
            g = Path(bare)
        return None

    def next(self, group_ranks: Any, src: int, dst: int) -> Any:
        """The objects of the next message from ``src`` to ``dst`` on the group of ``group_ranks``;
        DEFAULT where the capture kept none."""
        k = _next_message(self._count, group_ranks, src, dst)
        rep = self.replica_of
        if rep is not None:
            group_ranks, src, dst = [rep[r] for r in group_ranks], rep[src], rep[dst]
        return SharedObjects._read(str(self.dir / message_file(group_ranks, src, dst, k)))

    def broadcast(self, group_ranks: Any, index: int, root: int) -> torch.Tensor | None:
        """What ``root`` broadcast in call ``index`` of the group, as the capture kept it (a
        replica's: its representative's, in the representative's group); None where it kept none."""
        rep = self.replica_of
        if rep is not None:
            group_ranks, root = [rep[r] for r in group_ranks], rep[root]
            if len(set(group_ranks)) != len(group_ranks):  # a group across replicas: no capture ran it
                return None
        name = broadcast_file(group_ranks, index, root)
        return read_tensor(self.dir / name) if name in self._broadcasts else None

    def sent(self, group_ranks: Any, src: int, dst: int) -> torch.Tensor | None:
        """The next tensor ``src`` sent ``dst`` on the group, as the capture kept it (a replica's:
        its representative's to the receiver's representative); None where it kept none. Every
        receive from ``src`` counts, whatever its size, as the sender's sends counted."""
        k = _next_message(self._received, group_ranks, src, dst)
        rep = self.replica_of
        if rep is not None:
            group_ranks, src, dst = [rep[r] for r in group_ranks], rep[src], rep[dst]
            if len(set(group_ranks)) != len(group_ranks):  # a group across replicas: no capture ran it
                return None
        name = sent_file(group_ranks, src, dst, k)
        return read_tensor(self.dir / name) if name in self._sends else None


def object_payload(objects: list, group: Any) -> list[torch.Tensor]:
    """What ``send_object_list(objects)`` sends: the objects' sizes, then their bytes."""
    pieces = [c10d._object_to_tensor(o, "cpu", group) for o in objects]
    return [torch.cat([size for _, size in pieces]), torch.cat([t for t, _ in pieces])]


def install(generator: TensorGenerator, child: ChildEnv) -> None:
    """Answer the object collectives from ``generator`` and the objects the ranks of ``child``'s
    capture share (the wrappers are installed once)."""
    global _GEN, _SHARED
    _GEN = generator
    _SHARED = SharedObjects(child.spool, child.solo_batch, float(user_setting("PRISM_SOLO_OBJECT_WAIT", "120")))
    generator.peers = _SHARED
    if _ORIG:
        return
    for name, fn in (("broadcast_object_list", _broadcast_object_list),
                     ("all_gather_object", _all_gather_object),
                     ("gather_object", _gather_object),
                     ("scatter_object_list", _scatter_object_list),
                     ("send_object_list", _send_object_list),
                     ("recv_object_list", _recv_object_list)):  # fmt: skip
        _ORIG[name] = getattr(c10d, name)
        setattr(c10d, name, fn)
        setattr(dist, name, fn)


def _obj_call(op: str, group, objects, *, root: int = -1, peer: int = -1) -> Call | None:
    pg = group or c10d._get_default_group()
    if pg is None or c10d._rank_not_in_group(pg) or not hasattr(pg, "_global_ranks"):
        return None
    try:
        desc = pg.group_desc
    except Exception:
        desc = ""
    return Call(
        rank=pg._rec.rank, op=op, api=op, group_ranks=tuple(pg._global_ranks),
        group_desc=desc or "", group_name=pg.group_name, group_rank=pg.rank(), index=pg._seq,
        label=pg._rec.label_pending, root=root, peer=peer, objects=objects,
        is_root=root >= 0 and root == pg._global_ranks[pg.rank()],
    )  # fmt: skip


def global_peer(group, src, group_src) -> int:
    """The global rank an object call names as its root or peer (``src``/``dst``, or the group
    rank ``group_src``/``group_dst``) on a group of prism's (which knows its global ranks)."""
    pg = group or c10d._get_default_group()
    if group_src is not None:
        return pg._global_ranks[group_src]
    return 0 if src is None else int(src)


def _check_list(call: Call, val, n: int, what: str) -> list:
    if not isinstance(val, (list, tuple)) or len(val) != n:
        raise GenerateError(f"{call.where()}: the rule must return a list of {n} objects "
                            f"({what}), got {val!r:.80}")  # fmt: skip
    return list(val)


def _member_objects(call: Call, own: Any) -> list:
    """A gathering call's object per group member, ``own`` in this rank's slot: the rule's, else
    what the capture's other ranks published (``own`` where one did not)."""
    val = _GEN.objects(call)
    if val is DEFAULT:
        objs = _SHARED.slots(call, own)
    else:
        objs = _check_list(call, val, call.group_size, "one per group member")
    objs[call.group_rank] = own
    return objs


def _broadcast_object_list(object_list, src=None, group=None, device=None, group_src=None, **kwargs):
    orig = _ORIG["broadcast_object_list"]
    g = global_peer(group, src, group_src)
    call = _obj_call("broadcast_object_list", group, object_list, root=g)
    if call is None or call.is_root:
        if call is not None:
            _SHARED.publish(call, list(object_list))
        return orig(object_list, src=src, group=group, device=device, group_src=group_src, **kwargs)
    val = _GEN.objects(call)
    if val is DEFAULT:  # the root's objects, where the root (a solo rank too) published them
        val = _SHARED.get(call, g)
        if val is not DEFAULT and (not isinstance(val, list) or len(val) != len(object_list)):
            val = DEFAULT
    objs = list(object_list) if val is DEFAULT else _check_list(call, val, len(object_list), "one per list entry")
    _GEN.begin_payload(objs, per_slot=False)
    try:
        return orig(object_list, src=src, group=group, device=device, group_src=group_src, **kwargs)
    finally:
        _GEN.end_payload()


def _all_gather_object(object_list, obj, group=None, **kwargs):
    orig = _ORIG["all_gather_object"]
    call = _obj_call("all_gather_object", group, obj)
    if call is None:
        return orig(object_list, obj, group=group, **kwargs)
    _SHARED.publish(call, obj)
    _GEN.begin_payload(_member_objects(call, obj), per_slot=True)
    try:
        return orig(object_list, obj, group=group, **kwargs)
    finally:
        _GEN.end_payload()


def _gather_object(obj, object_gather_list=None, dst=None, group=None, group_dst=None, **kwargs):
    orig = _ORIG["gather_object"]
    call = _obj_call("gather_object", group, obj, root=global_peer(group, dst, group_dst))
    if call is not None:
        _SHARED.publish(call, obj)
    if call is None or not call.is_root:
        return orig(obj, object_gather_list, dst=dst, group=group, group_dst=group_dst, **kwargs)
    _GEN.begin_payload(_member_objects(call, obj), per_slot=True)
    try:
        return orig(obj, object_gather_list, dst=dst, group=group, group_dst=group_dst, **kwargs)
    finally:
        _GEN.end_payload()


def _scatter_object_list(scatter_object_output_list, scatter_object_input_list=None, src=None,
                         group=None, group_src=None, **kwargs):  # fmt: skip
    orig = _ORIG["scatter_object_list"]
    call = _obj_call("scatter_object_list", group, scatter_object_input_list,
                     root=global_peer(group, src, group_src))  # fmt: skip
    if call is None or call.is_root:
        return orig(scatter_object_output_list, scatter_object_input_list, src=src, group=group,
                    group_src=group_src, **kwargs)  # fmt: skip
    val = _GEN.objects(call)
    if val is DEFAULT:
        raise GenerateError(
            f"{call.where()}: no rule answers scatter_object_list (the object this rank "
            f"receives cannot be generated); add a rule with op='scatter_object_list' "
            f"returning [object]"
        )
    _GEN.begin_payload(_check_list(call, val, 1, "the received object"), per_slot=False)
    try:
        return orig(scatter_object_output_list, scatter_object_input_list, src=src, group=group,
                    group_src=group_src, **kwargs)  # fmt: skip
    finally:
        _GEN.end_payload()


def _send_object_list(object_list, dst=None, group=None, device=None, group_dst=None, **kwargs):
    """Sent as the program sends it, and published for the receiver, a solo rank of this capture
    (``torch.distributed.pipelining``'s stages send their output shapes this way at start-up)."""
    call = _obj_call("send_object_list", group, object_list, peer=global_peer(group, dst, group_dst))
    if call is not None:
        _SHARED.send(call.group_ranks, call.rank, call.peer, list(object_list))
    return _ORIG["send_object_list"](object_list, dst=dst, group=group, device=device, group_dst=group_dst, **kwargs)


def _recv_object_list(object_list, src=None, group=None, device=None, group_src=None, **kwargs):
    orig = _ORIG["recv_object_list"]
    call = _obj_call("recv_object_list", group, object_list,
                     peer=global_peer(group, src, group_src))  # fmt: skip
    if call is None:
        return orig(object_list, src=src, group=group, device=device, group_src=group_src, **kwargs)
    message = _SHARED.message(call.group_ranks, call.peer, call.rank)
    val = _GEN.objects(call)
    if val is DEFAULT and _GEN.store is not None:
        # a recorded run's tensor store (--tensors) holds the receives that carry the objects
        # (their size, then the pickled bytes): answered there like any receive
        return orig(object_list, src=src, group=group, device=device, group_src=group_src, **kwargs)
    if val is DEFAULT:  # what the sender, a solo rank of this capture, sent
        val = _SHARED.receive(message, call.peer)
    if val is DEFAULT:
        raise GenerateError(
            f"{call.where()}: no rule answers recv_object_list and its sender, rank {call.peer}, has not "
            f"run before this rank in the capture (the objects this rank receives cannot be generated); "
            f"capture the sender first or beside it (--parallel), add a rule with op='recv_object_list', "
            f"replay a recorded run's tensors (--tensors), or capture in switch mode (--mode switch; "
            f"prism run --capture switch: every rank, the real values)"
        )
    _GEN.begin_payload(_check_list(call, val, len(object_list), "one per list entry"),
                       per_slot=False)  # fmt: skip
    try:
        return orig(object_list, src=src, group=group, device=device, group_src=group_src, **kwargs)
    finally:
        _GEN.end_payload()
