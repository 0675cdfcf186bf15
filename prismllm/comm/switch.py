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
completes the Work's Future. The Works are solo mode's, as ProcessGroupNCCL's hold what they hold
(``GeneratedBackend._run``): only where the outputs come from differs (``_write``). On a GPU the
inputs are read and the outputs written on the stream a communicator would use (the current one,
or the group's), and the Future records its events there once they are written, so ``wait()``
makes the program's stream wait for them; while the rank waits, the coordinator moves its device
state out (``prismllm.capture.gpuswap``).
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
from prismllm.comm.solo import GeneratedBackend, _flat, on_stream
from prismllm.comm.solo_objects import decode, encode
from prismllm.errors import PrismError
from prismllm.generate.generator import Call

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
        try:
            k = sock.recv_into(view[got:])
        except ConnectionResetError:  # the other side is gone (a rank killed mid-call): as closed
            return None
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


class _Batch:
    """The calls of one Work (a coalesced batch has several): its Future is completed, with the
    value the Work holds, once every call's outputs are written; on a GPU they are written on the
    Work's stream and the Future records its events there, so that waiting on it makes the
    program's current stream wait for them (torch's Future semantics, as a communicator's Work)."""

    def __init__(self, calls: list[Call], device: torch.device | None, stream: Any, value: list) -> None:
        self.left = len(calls)
        self.device, self.stream, self.value = device, stream, value
        self.fut: torch.futures.Future = torch.futures.Future(devices=[device] if device is not None else None)
        self.failed = False
        if not calls:
            self._complete()

    def on_stream(self) -> Any:
        return on_stream(self.device, self.stream)

    def done(self) -> None:
        self.left -= 1
        if self.left == 0 and not self.failed:
            self._complete()

    def _complete(self) -> None:
        with self.on_stream():
            self.fut.set_result(self.value)

    def fail(self, e: Exception) -> None:
        if not self.failed:
            self.failed = True
            self.fut.set_exception(e)


class SwitchClient:
    """This process's connection to the coordinator: :meth:`submit` sends a Work's calls with their
    inputs and returns a Future completed (outputs written) when the coordinator has answered them."""

    def __init__(self, address: str, token: str, rank: int) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.connect("\0" + address)
        except OSError as e:
            raise SwitchError(f"rank {rank}: cannot reach the switch-mode coordinator ({e.strerror or e})") from None
        self.rank = rank
        self._ids = itertools.count()
        self._pending: dict[int, tuple[Call, _Batch]] = {}
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

    def submit(self, calls: list[Call], device: torch.device | None, stream: Any, value: list) -> torch.futures.Future:
        """Send the calls with their inputs (read on ``stream`` on a GPU: where a communicator reads
        them); the Future is completed, with ``value``, once the coordinator's outputs are written."""
        batch = _Batch(calls, device, stream, value)
        for c in calls:
            with batch.on_stream():
                ins = [encode(t) for t in _tensors(c.input)]
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
                "in": ins,
                "out_numel": sum(t.numel() for t in c.targets),
            }
            if c.op == "all_to_all":
                msg["chunks"] = _chunks(c)
            with self._lock:
                msg["id"] = i = next(self._ids)
                self._pending[i] = (c, batch)
                send_frame(self.sock, msg)
        return batch.fut

    def _receive(self) -> None:
        while True:
            try:
                msg = recv_frame(self.sock)
            except OSError:
                msg = None
            if msg is None:  # the coordinator is gone: every call still waiting fails
                with self._lock:
                    waiting, self._pending = list(self._pending.values()), {}
                for _, batch in waiting:
                    batch.fail(SwitchError(f"rank {self.rank}: the switch-mode coordinator closed"))
                return
            self._answered(msg)

    def _answered(self, msg: dict[str, Any]) -> None:
        """Write one call's outputs. A function of its own so that nothing of the call outlives it:
        a loop's variables would keep its tensors alive until the next answer, longer than a
        communicator does (what the allocator sees must be ProcessGroupNCCL's)."""
        with self._lock:
            c, batch = self._pending.pop(msg["id"])
        if msg["t"] == "error":
            batch.fail(SwitchError(msg["message"]))
            return
        try:
            with batch.on_stream():
                _fill(c, decode(msg["out"]))
            batch.done()
        except (RuntimeError, ValueError) as e:  # the program's call gets it, not this thread
            batch.fail(SwitchError(f"rank {self.rank}: {c.op} #{c.index}: cannot write its outputs: {e}"))


def _fill(c: Call, flat: torch.Tensor) -> None:
    """Write ``flat`` into the call's output tensors, in order. Outside autograd, as a backend's
    C++ writes them: a receive buffer may be a leaf that requires grad (torch.distributed.pipelining's).
    A dtype differing from the output's is converted on the host: a copy that converts onto a GPU
    would allocate there, which no communicator does."""
    at = 0
    with torch.no_grad():
        for t in c.targets:
            n = t.numel()
            t.copy_(flat[at : at + n].view(t.shape).to(t.dtype))
            at += n


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

    def _write(self, calls: list[Call], device: torch.device | None, stream, value: list) -> torch.futures.Future:
        return _CLIENT.submit(calls, device, stream, value)


__all__ = ["SwitchBackend", "SwitchClient", "SwitchError", "decode", "encode", "prepare", "recv_frame", "send_frame"]
