"""Does the program still issue what its graph says? One rank's expected calls, and the check.

In emulation the assistant plays the virtual ranks from the graph and meets the sandbox in
every call the graph has; a sandbox program that deviates from it (another op, another size,
another root, one call too many) would otherwise show as a gloo error far from its cause, or
as a hang. :class:`GraphExpectation` holds what the graph says *one* rank issues on each of its
groups, and ``check`` compares a call with it before the call is issued: a deviation raises
:class:`GraphDeviation`, one line naming the rank, the call and the fix.

Keys, as ``prismllm.comm.recording`` numbers the calls it records (the ``seq`` column):

* a collective: (group, seq), seq counting the rank's collectives on the group from 0;
* a send or recv: (group, op, peer, seq), seq counting the rank's sends (or recvs) with that
  peer on the group from 0 (``RecordingProcessGroup._p2p_seq``); peer is a global rank.

Only the rank's communication nodes are read (a filtered read of the nodes table), and the
lookup structure is built with array operations, so building it for one rank of a graph of
thousands of ranks reads and keeps only that rank's calls.
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from prismllm.errors import PrismError
from prismllm.trace.graph import TraceError, group_desc, ranks_text
from prismllm.trace.schema import FILES, KIND_COMM, MANIFEST_FILE

_COLUMNS = ["op", "group", "seq", "peer", "in_bytes", "out_bytes", "dtype", "shape", "iteration"]
_P2P_CODE = {"send": 1, "recv": 2}  # collectives: 0
_ROOTED = ("broadcast", "reduce", "gather", "scatter")  # their peer column is the root


class GraphDeviation(PrismError):
    """The program issued a call its graph does not have: another op, size or root, or a call
    beyond the graph's last on that group. The message names the rank, the call and the fix."""


class GraphExpectation:
    """What the graph at ``graph`` (a PrismTrace directory) says rank ``rank`` issues on each
    of its groups (module docstring); ``check`` raises GraphDeviation on a call that differs.
    Read-only once built: ``check`` may be called from any thread."""

    def __init__(self, graph: str | os.PathLike, rank: int) -> None:
        path = Path(graph)
        self.rank = int(rank)
        try:
            manifest = json.loads((path / MANIFEST_FILE).read_text())
            groups = pq.read_table(path / FILES["groups"][0], columns=["group_id", "name", "desc", "ranks"])
            nodes = pq.read_table(
                path / FILES["nodes"][0],
                columns=_COLUMNS,
                memory_map=True,
                filters=[("rank", "=", self.rank), ("kind", "=", KIND_COMM)],
            )
        except (OSError, ValueError, pa.ArrowException) as e:
            raise TraceError(
                f"graph {path}: cannot read the calls of rank {self.rank} "
                f"({str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}); "
                f"re-record the graph"
            ) from None
        manifest = manifest if isinstance(manifest, dict) else {}
        world = manifest.get("world_size")
        if isinstance(world, int) and not 0 <= self.rank < world:
            raise TraceError(f"graph {path}: rank {self.rank} is not in its world of {world} ranks")
        command = manifest.get("command")
        self._command = shlex.join(map(str, command)) if isinstance(command, list) and command else ""
        # the rank's groups by name -> (group id, global ranks, description); the others' names
        g = groups.to_pydict()
        self._groups: dict[str, tuple[int, list[int], str]] = {}
        self._others: set[str] = set()
        self._by_ranks: dict[tuple, list[str]] = {}  # members in group-rank order -> the graph's names
        self._named: dict[tuple, int] = {}  # how many of them name_of handed out
        for gid, name, desc, ranks in zip(g["group_id"], g["name"], g["desc"], g["ranks"]):
            if self.rank in ranks:
                self._groups[name] = (int(gid), list(ranks), group_desc({"desc": desc}))
                self._by_ranks.setdefault(tuple(ranks), []).append(name)  # gid order: creation order
            else:
                self._others.add(name)
        nodes = nodes.combine_chunks()
        self._op = nodes.column("op").to_numpy(zero_copy_only=False)
        group = nodes.column("group").to_numpy()
        seq = nodes.column("seq").to_numpy()
        self._peer = nodes.column("peer").to_numpy()
        self._in = nodes.column("in_bytes").to_numpy()
        self._out = nodes.column("out_bytes").to_numpy()
        self._dtype = nodes.column("dtype")
        self._shape = nodes.column("shape")
        self._iteration = nodes.column("iteration").to_numpy()
        # one key per (group, kind, peer): collectives share kind 0 and peer -1 on a group
        code = np.zeros(len(seq), np.int8)
        for op, c in _P2P_CODE.items():
            code[self._op == op] = c
        peer_key = np.where(code > 0, self._peer, -1)
        order = np.lexsort((seq, peer_key, code, group))
        kg, kc, kp = group[order], code[order], peer_key[order]
        new_key = (kg[1:] != kg[:-1]) | (kc[1:] != kc[:-1]) | (kp[1:] != kp[:-1])
        first = np.flatnonzero(np.r_[True, new_key]) if len(order) else np.zeros(0, np.int64)
        ends = np.r_[first[1:], len(order)]
        self._order = order
        self._seq = seq[order]  # ascending within each key's span
        self._spans = {(int(kg[s]), int(kc[s]), int(kp[s])): (int(s), int(e)) for s, e in zip(first, ends)}
        self._next: dict[tuple, int] = {}  # per key: where its next call should be

    def __len__(self) -> int:
        """The rank's communication calls in the graph (all that was read of it)."""
        return len(self._order)

    def name_of(self, ranks: list[int], torch_name: str) -> str | None:
        """The graph's name of the group the program just made (torch's name ``torch_name``,
        these members in group-rank order). A DP replica's groups in a solo-captured graph
        carry derived names (``13@1``, see trace.assemble), not the ones torch gives the
        program: such a group is found by its members, the k-th group the program makes with
        these members being the graph's k-th (two groups may have the same members)."""
        key = tuple(int(r) for r in ranks)
        names = self._by_ranks.get(key, [])
        if torch_name in names:
            return torch_name
        k = self._named.get(key, 0)
        self._named[key] = k + 1
        return names[k] if k < len(names) else None

    def check(self, group_name: str, op: str, seq: int, in_bytes: int, out_bytes: int, peer: int = -1) -> None:
        """Raise GraphDeviation unless the graph has this call of the rank: ``op`` #``seq`` on
        the group named ``group_name`` (torch's group name), with these input/output bytes.
        ``peer``: a send/recv's peer (global rank, part of its key); a rooted collective's root
        (global rank), compared when given (>= 0)."""
        grp = self._groups.get(group_name)
        code = _P2P_CODE.get(op, 0)
        if grp is None:
            why = f"does not have rank {self.rank} in it" if group_name in self._others else "has no such group"
            raise self._deviation(
                f"{self._at(op, seq, code, peer)} on group {group_name}: the program issued "
                f"{self._issued(op, code, in_bytes, out_bytes, peer)}, the graph {why}"
            )
        key = (grp[0], code, peer if code else -1)
        span = self._spans.get(key)
        i = None
        if span is not None:
            s, e = span
            j = self._next.get(key, s)  # calls come in seq order: the one after the last found
            if not (j < e and self._seq[j] == seq):
                j = s + int(np.searchsorted(self._seq[s:e], seq))
            if j < e and self._seq[j] == seq:
                i = int(self._order[j])
                self._next[key] = j + 1
        if i is not None:
            g_op, g_in, g_out, g_peer = self._op[i], int(self._in[i]), int(self._out[i]), int(self._peer[i])
            root_differs = not code and peer >= 0 and g_op in _ROOTED and g_peer != peer
            if g_op == op and g_in == in_bytes and g_out == out_bytes and not root_differs:
                return  # the common case: no message is built
        # a deviation: name it (built only here; a group's label can be long)
        where = f"{self._at(op, seq, code, peer)} on group {self._label(group_name)}"
        issued = self._issued(op, code, in_bytes, out_bytes, peer)
        if i is None:
            n = 0 if span is None else span[1] - span[0]
            calls = (
                "collectives" if not code else f"sends to rank {peer}" if op == "send" else f"recvs from rank {peer}"
            )
            raise self._deviation(
                f"{where}: the program issued {issued}, the graph has no more {calls} on this group (it has {n})"
            )
        shape = self._shape[i].as_py()
        context = f"{self._dtype[i].as_py() or 'no tensor'} {list(shape)}, iteration {int(self._iteration[i])}"
        graph_call = f"{g_op} of {_size(_P2P_CODE.get(g_op, 0), g_in, g_out)}"
        if g_op in _ROOTED:
            graph_call += f" from root {g_peer}"
        raise self._deviation(f"{where}: the program issued {issued}, the graph has {graph_call} ({context})")

    def collectives(self, group_name: str, ops: list[str]) -> list[tuple[int, int, int, int]]:
        """The rank's collectives on ``group_name`` by seq, as the native lane checks them
        (``prismllm/comm/native/pruned_lane.h``): (index of the op in ``ops``, bytes in, bytes
        out, root or -1); a seq the graph does not have, or an op not in ``ops``, is (-1, 0, 0,
        -1), which no call matches (the Python check then names the deviation)."""
        grp = self._groups.get(group_name)
        span = self._spans.get((grp[0], 0, -1)) if grp is not None else None
        if span is None:
            return []
        s, e = span
        code = {op: i for i, op in enumerate(ops)}
        table = [(-1, 0, 0, -1)] * (int(self._seq[e - 1]) + 1 if e > s else 0)
        for j in range(s, e):
            i = int(self._order[j])
            op = str(self._op[i])
            root = int(self._peer[i]) if op in _ROOTED else -1
            table[int(self._seq[j])] = (code.get(op, -1), int(self._in[i]), int(self._out[i]), root)
        return table

    @staticmethod
    def _at(op: str, seq: int, code: int, peer: int) -> str:
        return f"{op} #{seq}" + (f" {'to' if op == 'send' else 'from'} rank {peer}" if code else "")

    @staticmethod
    def _issued(op: str, code: int, in_bytes: int, out_bytes: int, peer: int) -> str:
        issued = f"{op} of {_size(code, in_bytes, out_bytes)}"
        if not code and peer >= 0:
            issued += f" from root {peer}"
        return issued

    def _label(self, name: str) -> str:
        """ "3 [0, 1]", "0 (default_pg) [0, 1, 2, 3]"; large groups compactly."""
        _, ranks, desc = self._groups[name]
        members = f"[{', '.join(map(str, ranks))}]" if len(ranks) <= 8 else f"[{ranks_text(ranks)}]"
        return f"{name} ({desc}) {members}" if desc else f"{name} {members}"

    def _deviation(self, what: str) -> GraphDeviation:
        cmd = self._command if len(self._command) <= 200 else self._command[:197] + "..."
        ran = f" (`{cmd}`)" if cmd else ""
        return GraphDeviation(
            f"rank {self.rank} deviates from its graph at {what}. The program or its arguments differ "
            f"from the captured run: capture the graph again with the same command as this run "
            f"(`prism record` / `prism capture`), or run the command the graph was captured with{ran}"
        )


def _size(p2p: int, in_bytes: int, out_bytes: int) -> str:
    """A send's or recv's payload; a collective's bytes in and out (once when equal)."""
    if p2p:
        return f"{in_bytes or out_bytes} bytes"
    if in_bytes == out_bytes:
        return f"{in_bytes} bytes"
    return f"{in_bytes} bytes in, {out_bytes} bytes out"


__all__ = ["GraphDeviation", "GraphExpectation"]
