"""Switch mode's coordinator: it carries out every collective and point-to-point call of the N
ranks on the host, with their real inputs (the paper's CPU collective executor, §5.2).

Each rank process connects once (``prismllm.comm.switch``: an abstract Unix socket, the run's
token first) and sends each call with its inputs. A collective instance is one (group name,
sequence number): when every member's part is in, the coordinator computes each member's
outputs and answers it; a send is kept and answered at once, a receive answered when its send
(the k-th from that sender on that group) is there. Members must agree on the call: the op, the
group's ranks, the reduce op and the root; a disagreement (a program that deviates between its
ranks) fails every member's call with one line naming the instance.

Reductions run in the tensors' dtype, member by member in group order (sum, avg, product, min,
max, the bitwise ops, premul_sum); an average of integers truncates, as NCCL's.
"""

from __future__ import annotations

import dataclasses
import functools
import secrets
import socket
import threading
from typing import Any

import torch

from prismllm.comm.switch import decode, encode, recv_frame, send_frame
from prismllm.errors import PrismError
from prismllm.specs import format_ranks


@dataclasses.dataclass
class _Part:
    rank: int
    conn: _Conn
    msg: dict[str, Any]


@dataclasses.dataclass
class _Instance:
    op: str
    granks: tuple[int, ...]
    parts: dict[int, _Part] = dataclasses.field(default_factory=dict)  # group rank -> part


class _Conn:
    """One rank's connection; replies are written under its own lock (several threads answer)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.rank = -1
        self.lock = threading.Lock()

    def reply(self, msg: dict[str, Any]) -> None:
        with self.lock:
            try:
                send_frame(self.sock, msg)
            except OSError:
                pass  # the rank is gone: the launcher reports it


def _reduce(flats: list[torch.Tensor], op: str) -> torch.Tensor:
    if op.startswith("premul_sum:"):
        factor = float(op.split(":", 1)[1])
        return _reduce([x * factor for x in flats], "sum").to(flats[0].dtype)
    if op in ("sum", "avg"):
        acc = flats[0].clone()
        for x in flats[1:]:
            acc += x
        if op == "avg":
            n = len(flats)
            acc = torch.div(acc, n, rounding_mode="trunc") if not acc.is_floating_point() else acc / n
        return acc
    if op == "product":
        acc = flats[0].clone()
        for x in flats[1:]:
            acc *= x
        return acc
    ops = {
        "min": torch.minimum,
        "max": torch.maximum,
        "band": torch.bitwise_and,
        "bor": torch.bitwise_or,
        "bxor": torch.bitwise_xor,
    }
    if op not in ops:
        raise PrismError(f"switch mode cannot reduce with {op!r}")
    return functools.reduce(ops[op], flats)


def _flat_input(p: _Part) -> torch.Tensor:
    ins = [decode(d) for d in p.msg["in"]]
    if not ins:  # a scatter's or broadcast's non-root
        return torch.empty(0)
    return torch.cat(ins) if len(ins) > 1 else ins[0]


def _outputs(inst: _Instance, reduce_op: str, root: int) -> dict[int, torch.Tensor]:
    """Each member's (group rank's) outputs, flat, in the order of its output tensors."""
    n = len(inst.granks)
    parts = [inst.parts[i] for i in range(n)]
    op = inst.op
    if op == "barrier":
        return {i: torch.empty(0) for i in range(n)}
    if op == "broadcast":
        src = _flat_input(parts[root])
        return {i: (torch.empty(0) if i == root else src) for i in range(n)}
    flats = [_flat_input(p) for p in parts]
    if op == "all_reduce":
        r = _reduce(flats, reduce_op)
        return {i: r for i in range(n)}
    if op == "reduce":
        r = _reduce(flats, reduce_op)
        return {i: (r if i == root else torch.empty(0)) for i in range(n)}
    if op == "all_gather":
        r = torch.cat(flats)
        return {i: r for i in range(n)}
    if op == "gather":
        return {i: (torch.cat(flats) if i == root else torch.empty(0)) for i in range(n)}
    if op in ("reduce_scatter", "scatter"):
        whole = _reduce(flats, reduce_op) if op == "reduce_scatter" else flats[root]
        m = [int(p.msg["out_numel"]) for p in parts]
        return {i: whole[i * m[i] : (i + 1) * m[i]] for i in range(n)}
    if op == "all_to_all":
        chunks = [list(torch.split(f, list(p.msg["chunks"]))) for f, p in zip(flats, parts)]
        return {j: torch.cat([chunks[i][j] for i in range(n)]) for j in range(n)}
    raise PrismError(f"switch mode cannot carry out {op!r}")


class Coordinator:
    """Serves the ranks of one switch-mode capture; :meth:`close` ends it. ``address`` and
    ``token`` go to every rank (``ChildEnv.switch_address``/``switch_token``)."""

    def __init__(self) -> None:
        self.address = f"prism-switch-{secrets.token_hex(8)}"
        self.token = secrets.token_hex(16)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind("\0" + self.address)
        self.sock.listen(1024)
        self._lock = threading.Lock()
        self._instances: dict[tuple[str, int], _Instance] = {}
        self._sends: dict[tuple[str, int, int, int], dict[str, Any]] = {}  # (group, src, dst, k) -> send msg
        self._recvs: dict[tuple[str, int, int, int], _Part] = {}
        self._conns: list[_Conn] = []
        self.calls = 0  # answered
        self.refused = 0  # connections without the token
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="prism-coordinator").start()

    # -- connections --
    def _accept(self) -> None:
        while True:
            try:
                s, _ = self.sock.accept()
            except OSError:
                return
            conn = _Conn(s)
            with self._lock:
                if self._closed:
                    s.close()
                    return
                self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: _Conn) -> None:
        hello = recv_frame(conn.sock)
        if not hello or hello.get("t") != "hello" or not secrets.compare_digest(str(hello.get("token")), self.token):
            self.refused += 1
            conn.sock.close()
            return
        conn.rank = int(hello["rank"])
        while (msg := recv_frame(conn.sock)) is not None:
            try:
                self._call(conn, msg)
            except PrismError as e:
                conn.reply({"t": "error", "id": msg["id"], "message": str(e)})

    # -- calls --
    def _call(self, conn: _Conn, msg: dict[str, Any]) -> None:
        op, group = msg["op"], msg["group"]
        part = _Part(conn.rank, conn, msg)
        if op in ("send", "recv"):
            src, dst = (conn.rank, msg["peer"]) if op == "send" else (msg["peer"], conn.rank)
            key = (group, src, dst, int(msg["seq"]))
            with self._lock:
                if op == "send":
                    recv = self._recvs.pop(key, None)
                    if recv is None:
                        self._sends[key] = msg
                else:
                    send = self._sends.pop(key, None)
                    if send is None:
                        self._recvs[key] = part
            if op == "send":
                self._answer(part, torch.empty(0))
                if recv is not None:
                    self._answer(recv, _flat_input(part))
            elif send is not None:
                self._answer(part, _flat_input(_Part(src, conn, send)))
            return
        key = (group, int(msg["seq"]))
        granks = tuple(msg["granks"])
        with self._lock:
            inst = self._instances.setdefault(key, _Instance(op, granks))
            if inst.op != op or inst.granks != granks:
                first = next(iter(inst.parts.values()))
                raise PrismError(
                    f"rank {conn.rank} calls {op} #{key[1]} on group {group!r} (ranks {format_ranks(granks)}) where "
                    f"rank {first.rank} called {inst.op} on ranks {format_ranks(inst.granks)}: the ranks' programs "
                    "differ at this call"
                )
            inst.parts[int(msg["grank"])] = part
            complete = len(inst.parts) == len(granks)
            if complete:
                del self._instances[key]
        if complete:
            self._complete(key, inst)

    def _complete(self, key: tuple[str, int], inst: _Instance) -> None:
        first = inst.parts[0].msg
        reduce_op, root = first["reduce"], first["root"]
        for p in inst.parts.values():
            if p.msg["reduce"] != reduce_op or p.msg["root"] != root:
                line = (
                    f"{inst.op} #{key[1]} on group {key[0]!r}: rank {p.rank} asks reduce op {p.msg['reduce']!r}, root "
                    f"{p.msg['root']}, rank {inst.parts[0].rank} {reduce_op!r}, root {root}: the ranks' programs differ"
                )
                for q in inst.parts.values():
                    q.conn.reply({"t": "error", "id": q.msg["id"], "message": line})
                return
        group_root = inst.granks.index(root) if root in inst.granks else -1
        try:
            outs = _outputs(inst, reduce_op, group_root)
        except (PrismError, RuntimeError, ValueError) as e:
            line = f"{inst.op} #{key[1]} on group {key[0]!r} (ranks {format_ranks(inst.granks)}): {e}"
            for q in inst.parts.values():
                q.conn.reply({"t": "error", "id": q.msg["id"], "message": line})
            return
        for i, p in inst.parts.items():
            self._answer(p, outs[i])

    def _answer(self, p: _Part, flat: torch.Tensor) -> None:
        want = int(p.msg["out_numel"])
        if flat.numel() != want:
            p.conn.reply(
                {
                    "t": "error",
                    "id": p.msg["id"],
                    "message": f"rank {p.rank}: {p.msg['op']} #{p.msg['seq']} on group {p.msg['group']!r} gives "
                    f"{flat.numel()} element(s) for an output of {want}: the ranks' tensors differ in size",
                }
            )
            return
        p.conn.reply({"t": "done", "id": p.msg["id"], "out": encode(flat)})
        self.calls += 1

    # -- state --
    def waiting(self) -> list[str]:
        """One line per call that waits for a member: what is in and who is missing (for a stall)."""
        with self._lock:
            lines = []
            for (group, seq), inst in sorted(self._instances.items()):
                members = [inst.granks[i] for i in sorted(inst.parts)]
                missing = [r for i, r in enumerate(inst.granks) if i not in inst.parts]
                lines.append(
                    f"{inst.op} #{seq} on group {group!r}: in from rank(s) {format_ranks(members)}, "
                    f"waiting for {format_ranks(missing)}"
                )
            for group, src, dst, k in sorted(self._recvs):
                lines.append(f"recv #{k} on group {group!r}: rank {dst} waits for rank {src}'s send")
            return lines

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns = list(self._conns)
        for s in [self.sock, *(c.sock for c in conns)]:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()


__all__ = ["Coordinator"]
