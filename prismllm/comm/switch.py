"""Switch mode, the rank's side: every rank of the N-rank world runs the unmodified program, and
each collective and point-to-point call is carried out by the capture's coordinator
(``prismllm.capture.coordinator``) on the host with every member's real inputs: the program gets
the values a real run would give it, so a program whose path depends on them (a skipped step on
a non-finite norm, a stop on a reduced loss, a start-up check of its peers) takes the real run's
path, where solo mode's generated answers may lead it elsewhere.

The process is built as in solo mode (``prismllm.comm.solo``): a local store instead of a
rendezvous (no rank waits for another to start), every group a ``RecordingProcessGroup`` whose
``_inner`` is a :class:`SwitchBackend` -- solo's backend, with the generator's answers replaced by
the coordinator's. Calls are recorded exactly as in record and solo mode. Object collectives are
not wrapped: torch carries them as tensor collectives, which the coordinator answers.

The wire: one Unix socket per process (an abstract address, so nothing on the file system or the
network; the first message carries the run's token), frames of an 8-byte length and a msgpack
map, tensors as raw bytes with their dtype and shape (never pickled). A call returns a Work at
once (its inputs copied out); the coordinator answers when every member's inputs are in (a send:
at once), and this process's receiver thread writes the outputs into the program's tensors and
completes the Work's Future. CPU tensors only for now: on a GPU, switch mode needs a rank's device
state swapped out while it waits (the driver's checkpoint API), not built yet.
"""

from __future__ import annotations

import atexit
import itertools
import os
import socket
import struct
import threading
from typing import Any

import msgpack
import torch

from prismllm.childenv import ChildEnv
from prismllm.comm.solo import GeneratedBackend, _flat
from prismllm.errors import PrismError
from prismllm.generate.generator import Call

_C = torch._C._distributed_c10d
_LEN = struct.Struct("<Q")


# ---- the wire (both sides) ------------------------------------------------------------------
def send_frame(sock: socket.socket, msg: dict[str, Any]) -> None:
    data = msgpack.packb(msg, use_bin_type=True)
    sock.sendall(_LEN.pack(len(data)))
    sock.sendall(data)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            return None
        got += k
    return bytes(buf)


def recv_frame(sock: socket.socket) -> dict[str, Any] | None:
    """The next message, or None when the other side closed."""
    head = _recv_exact(sock, _LEN.size)
    if head is None:
        return None
    body = _recv_exact(sock, _LEN.unpack(head)[0])
    return None if body is None else msgpack.unpackb(body, raw=False, strict_map_key=False)


def encode(t: torch.Tensor) -> dict[str, Any]:
    """A tensor as bytes with its dtype and shape."""
    flat = t.detach().contiguous().reshape(-1)
    data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "data": data}


def decode(d: dict[str, Any]) -> torch.Tensor:
    """The flat tensor of :func:`encode`'s map (a fresh, writable one)."""
    dtype = getattr(torch, d["dtype"])
    if not d["data"]:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(bytearray(d["data"]), dtype=torch.uint8).view(dtype)


# ---- the rank's client ----------------------------------------------------------------------
class SwitchError(PrismError):
    pass


def _tensors(x: Any) -> list[torch.Tensor]:
    """A call's input or output (a tensor, a list or list of lists, None) as its tensors."""
    return _flat([x])


def _chunks(c: Call) -> list[int]:
    """An all-to-all's input as the element counts of its n chunks, one per member in group order."""
    ins, n = _tensors(c.input), c.group_size
    if len(ins) > 1:
        return [t.numel() for t in ins]
    t = ins[0]
    if c.in_splits:
        row = t.numel() // t.shape[0] if t.dim() and t.shape[0] else 0
        return [s * row for s in c.in_splits]
    return [t.numel() // n] * n


class SwitchClient:
    """This process's connection to the coordinator: :meth:`submit` sends a call's inputs and
    returns a Future completed (outputs written) when the coordinator answers."""

    def __init__(self, address: str, token: str, rank: int) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.connect("\0" + address)
        except OSError as e:
            raise SwitchError(f"rank {rank}: cannot reach the switch-mode coordinator ({e.strerror or e})") from None
        self.rank = rank
        self._ids = itertools.count()
        self._pending: dict[int, tuple[Call, torch.futures.Future]] = {}
        self._lock = threading.Lock()
        send_frame(self.sock, {"t": "hello", "rank": rank, "token": token, "pid": os.getpid()})
        self._receiver = threading.Thread(target=self._receive, daemon=True, name="prism-switch")
        self._receiver.start()
        # Ended before the interpreter finalizes: a daemon thread still in torch's C++ (writing
        # outputs, completing a Future) when Python stops its threads aborts the process
        # ("terminate called without an active exception").
        atexit.register(self.close)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._receiver.join(timeout=10)
        self.sock.close()

    def submit(self, c: Call) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        outs = c.targets
        msg = {
            "t": "call",
            "op": c.op,
            "group": c.group_name,
            "granks": list(c.group_ranks),
            "grank": c.group_rank,
            "seq": c.index,
            "reduce": c.reduce_op,
            "root": c.root,
            "peer": c.peer,
            "in": [encode(t) for t in _tensors(c.input)],
            "out_numel": sum(t.numel() for t in outs),
        }
        if c.op == "all_to_all":
            msg["chunks"] = _chunks(c)
        with self._lock:
            msg["id"] = k = next(self._ids)
            self._pending[k] = (c, fut)
            send_frame(self.sock, msg)
        return fut

    def _receive(self) -> None:
        while True:
            try:
                msg = recv_frame(self.sock)
            except OSError:
                msg = None
            if msg is None:  # the coordinator is gone: every call still waiting fails
                with self._lock:
                    waiting, self._pending = list(self._pending.values()), {}
                for _, fut in waiting:
                    fut.set_exception(SwitchError(f"rank {self.rank}: the switch-mode coordinator closed"))
                return
            with self._lock:
                c, fut = self._pending.pop(msg["id"])
            if msg["t"] == "error":
                fut.set_exception(SwitchError(msg["message"]))
                continue
            try:
                outs = _fill(c, decode(msg["out"]))
            except (RuntimeError, ValueError) as e:  # the program's call gets it, not this thread
                fut.set_exception(SwitchError(f"rank {self.rank}: {c.op} #{c.index}: cannot write its outputs: {e}"))
                continue
            fut.set_result(outs)


def _fill(c: Call, flat: torch.Tensor) -> list[torch.Tensor]:
    """Write ``flat`` into the call's output tensors, in order. Outside autograd, as a backend's
    C++ writes them: a receive buffer may be a leaf that requires grad (torch.distributed.pipelining's)."""
    outs, at = c.targets, 0
    with torch.no_grad():
        for t in outs:
            n = t.numel()
            t.copy_(flat[at : at + n].view(t.shape))
            at += n
    return outs


_CLIENT: SwitchClient | None = None


def prepare(rank: int, child: ChildEnv) -> None:
    """Connect to the coordinator named in the contract (``switch_address``, ``switch_token``)."""
    global _CLIENT
    if _CLIENT is None:
        if not child.switch_address or not child.switch_token:
            raise SwitchError(
                "PRISM_MODE=switch needs PRISM_SWITCH_ADDRESS and PRISM_SWITCH_TOKEN (the capture sets them)"
            )
        _CLIENT = SwitchClient(child.switch_address, child.switch_token, rank)


class SwitchBackend(GeneratedBackend):
    """Solo's backend with real values: each call's outputs come from the coordinator."""

    def _run(self, calls: list[Call], ins, outs, opts=None, *, p2p: bool = False):
        if any(t.device.type == "cuda" for t in _tensors(ins) + _tensors(outs)):
            raise SwitchError(
                "switch mode runs on the CPU for now (a GPU rank's state would have to be swapped out while it "
                "waits); capture with --devices cpu, or use --mode solo"
            )
        futs = [_CLIENT.submit(c) for c in calls]
        if len(futs) == 1:
            fut = futs[0]
        else:
            fut = torch.futures.collect_all(futs).then(lambda f: [t for x in f.value() for t in x.value()])
        return _C._create_work_from_future(fut)


__all__ = ["SwitchBackend", "SwitchClient", "SwitchError", "decode", "encode", "prepare", "recv_frame", "send_frame"]
