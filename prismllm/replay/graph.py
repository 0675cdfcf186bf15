"""The replay graph: the columnar form of a PrismTrace that the replay engine walks (nodes of the
replayed ranks in program order, collective and point-to-point instances, coalesced batches,
wait points, recorded times, iterations). Built once, with numpy; ``engine.py`` runs it."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import pyarrow as pa

from prismllm.errors import PrismError
from prismllm.trace.edges import group_members, match_p2p
from prismllm.trace.graph import PrismTrace, TraceError, string_codes
from prismllm.trace.schema import CALL_COLUMNS, COLLECTIVE_OPS, KIND_COMM, P2P_OPS

# Instance kinds.
INST_COLLECTIVE = 0
INST_P2P = 1

_I64 = np.int64


class ReplayError(PrismError):
    """The replay cannot go on (a member never arrives, an external answer is wrong). The
    message names the rank, node index, op and group; the attributes carry them too."""

    def __init__(self, message: str, *, rank: int = -1, index: int = -1, op: str = "", group: int = -1):
        super().__init__(message)
        self.rank, self.index, self.op, self.group = rank, index, op, group


class MirrorError(TraceError):
    """Ranks given as copies (``mirror``) that the graph's groups do not let the replay leave out."""


# ---------------------------------------------------------------------- helpers
def ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenation of arange(s, s + c) for each (s, c): CSR gathers without a Python loop."""
    counts = counts.astype(_I64)
    total = int(counts.sum())
    if not total:
        return np.zeros(0, dtype=_I64)
    shift = starts.astype(_I64) - (np.cumsum(counts) - counts)
    return np.repeat(shift, counts) + np.arange(total, dtype=_I64)


def _rows_of(table: pa.Table, rows: np.ndarray, max_runs: int = 4096) -> pa.Table:
    """``table.take(rows)``; where ``rows`` ascend in a few runs of consecutive rows (every rank's
    nodes but a sandbox rank's, in program order), zero-copy slices of the table instead (the take
    copied every column: 3.5 s of a 32,768-rank slice's assistant start on the 2-core dev VM)."""
    step = np.diff(rows)
    if len(rows) and np.all(step > 0):
        breaks = np.flatnonzero(step != 1) + 1
        if len(breaks) < max_runs:
            first, last = np.r_[0, breaks], np.r_[breaks, len(rows)]
            return pa.concat_tables([table.slice(int(rows[a]), int(b - a)) for a, b in zip(first, last)])
    return table.take(pa.array(rows))


def _csr(keys: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(ptr, order) such that order[ptr[k]:ptr[k+1]] are the positions with keys == k."""
    order = np.argsort(keys, kind="stable").astype(_I64)
    ptr = np.zeros(n + 1, dtype=_I64)
    np.cumsum(np.bincount(keys, minlength=n), out=ptr[1:])
    return ptr, order


# ---------------------------------------------------------------------- the graph
class ReplayGraph:
    """What the event loop needs from a PrismTrace, as flat numpy arrays.

    Nodes of the *virtual* ranks (``ranks`` minus ``external``; default: every rank) are laid
    out rank by rank in program order: position ``p`` of rank ``ranks[r]`` lies in
    ``off[r]:off[r + 1]``, and its program index is ``p - off[r]``. Communication nodes are
    grouped into *instances* (integer ids): a collective instance is the nodes of one
    (group, seq); a P2P instance is a matched send and recv (the k-th send a->b on a group with
    the k-th recv on b from a, as :func:`prismllm.trace.edges.match_p2p` pairs them). An
    instance with a member outside the virtual ranks is *external*: the replay does not
    complete it by itself, a driver does (:meth:`Replay.external_done`).

    Mismatches (a member that never issues its part) are not rejected here: they surface as a
    :class:`ReplayError` when the loop gets stuck on them. Run
    :func:`prismllm.trace.validate` first for a static check of the whole graph.

    ``mirror`` (per rank of the world: the virtual rank it moves with, or -1) leaves out ranks
    that are copies of a virtual rank (a solo capture's DP replicas, renamed: :func:`mirror_plan`):
    a mirrored rank arrives at each of its calls when the rank it mirrors does, so it is no
    member that an instance waits for, and an instance of mirrored ranks alone is not replayed.
    That is exact where every group holding a mirrored rank and a replayed or external one also
    holds the rank it mirrors (the DP group of a replica and its image); :class:`MirrorError`
    otherwise.
    """

    def __init__(
        self,
        trace: PrismTrace,
        ranks: Iterable[int] | None = None,
        external: Iterable[int] = (),
        mirror: np.ndarray | None = None,
    ) -> None:
        self.trace = trace
        self.world_size = trace.world_size
        all_rank = trace.column("rank").astype(_I64)
        want = np.unique(all_rank) if ranks is None else np.unique(np.fromiter((int(r) for r in ranks), dtype=_I64))
        bad = want[(want < 0) | (want >= self.world_size)]
        if len(bad):
            raise ValueError(f"rank {bad[0]} is outside the world (0..{self.world_size - 1})")
        ext = np.fromiter((int(r) for r in external), dtype=_I64)
        self.mirror: np.ndarray = (
            np.full(self.world_size, -1, dtype=_I64) if mirror is None else np.asarray(mirror, _I64)
        )
        self._is_mirrored = self.mirror >= 0
        if len(ext) and self._is_mirrored[ext].any():
            raise ValueError(f"rank {ext[self._is_mirrored[ext]][0]} is external and mirrored")
        self.ranks: np.ndarray = want[~np.isin(want, ext) & ~self._is_mirrored[want]]  # virtual ranks, ascending
        self.external_ranks: np.ndarray = np.setdiff1d(
            np.arange(self.world_size, dtype=_I64), np.r_[self.ranks, np.flatnonzero(self._is_mirrored)]
        )
        self._is_virtual = np.zeros(self.world_size, dtype=bool)
        self._is_virtual[self.ranks] = True
        if not self._is_virtual[self.mirror[self._is_mirrored]].all():
            raise ValueError("a mirrored rank must mirror a virtual rank")
        sub = self._select_nodes(all_rank)
        self._kinds(sub)
        self._groups()
        self._instances(sub)
        self._batches(sub)
        self._waits(sub)
        self._recorded_times(sub)
        self._iterations()

    # ------------------------------------------------------------------ building
    def _select_nodes(self, all_rank: np.ndarray) -> pa.Table:
        """The virtual ranks' node rows, in (rank, index) order, with the columns the loop
        reads; sets ``row``, ``off``, ``rank_pos``, ``index``, ``iteration``."""
        trace = self.trace
        rows = trace.program_order()
        sorted_ok = bool(np.all(rows[1:] > rows[:-1]))  # a permutation: increasing is the identity
        if not self._is_virtual[all_rank].all():
            rows = rows[self._is_virtual[all_rank[rows]]]
        self.row: np.ndarray = rows  # position -> row in trace.nodes
        sub = trace.nodes.select(
            [
                "rank",
                *CALL_COLUMNS,
                "coalesced",
                "async_op",
                "wait_index",
                "start_ns",
                "duration_ns",
            ]
        )
        if not (sorted_ok and len(rows) == trace.num_nodes):
            sub = _rows_of(sub, rows)
        n = self.num_nodes = sub.num_rows
        rank = sub.column("rank").to_numpy().astype(_I64)
        self.index: np.ndarray = sub.column("index").to_numpy().astype(_I64)
        self.iteration: np.ndarray = sub.column("iteration").to_numpy().astype(_I64)
        self.rank_pos: np.ndarray = np.searchsorted(self.ranks, rank).astype(_I64)
        self.off: np.ndarray = np.r_[np.searchsorted(rank, self.ranks), n].astype(_I64)
        expected = np.arange(n, dtype=_I64) - self.off[self.rank_pos]
        bad = np.flatnonzero(self.index != expected)
        if len(bad):
            p = int(bad[0])
            raise TraceError(
                f"rank {rank[p]} has no node with index {expected[p]} (indices must be 0..n-1); validate the graph"
            )
        back = np.flatnonzero((self.iteration[1:] < self.iteration[:-1]) & (rank[1:] == rank[:-1]))
        if len(back):
            p = int(back[0]) + 1
            raise TraceError(
                f"rank {rank[p]} node {self.index[p]} belongs to iteration {self.iteration[p]}, after a node of iteration {self.iteration[p - 1]}; iterations never go back"
            )
        return sub

    def _kinds(self, sub: pa.Table) -> None:
        """Kinds and ops as integer codes (no Python string per node)."""
        kind_codes, kind_names = string_codes(sub.column("kind"))
        self.is_comm: np.ndarray = kind_codes == (kind_names.index(KIND_COMM) if KIND_COMM in kind_names else -2)
        self.op_code, self.op_names = string_codes(sub.column("op"))
        coll = [k for k, name in enumerate(self.op_names) if name in COLLECTIVE_OPS]
        p2p = [k for k, name in enumerate(self.op_names) if name in P2P_OPS]
        self._is_coll = self.is_comm & np.isin(self.op_code, coll)
        self._is_p2p = self.is_comm & np.isin(self.op_code, p2p)
        self.group: np.ndarray = sub.column("group").to_numpy().astype(_I64)
        self.seq: np.ndarray = sub.column("seq").to_numpy().astype(_I64)
        self.peer: np.ndarray = sub.column("peer").to_numpy().astype(_I64)
        self.async_op: np.ndarray = sub.column("async_op").to_numpy(zero_copy_only=False).astype(bool) & self.is_comm
        other = np.flatnonzero(self.is_comm & ~self._is_coll & ~self._is_p2p)
        if len(other):
            raise TraceError(
                f"{self.describe(int(other[0]))} has an unknown communication op; known: {', '.join(COLLECTIVE_OPS + P2P_OPS)}"
            )

    def _groups(self) -> None:
        """Per group id: its size and how many of its members are virtual (a collective with
        fewer virtual members than its size is external)."""
        gids, glen, gflat = group_members(self.trace.groups)
        ng = int(max(gids.max() + 1 if len(gids) else 0, self.group.max() + 1 if self.num_nodes else 0))
        self.group_size: np.ndarray = np.zeros(ng, dtype=_I64)
        self.group_size[gids] = glen
        self.group_virtual: np.ndarray = np.zeros(ng, dtype=_I64)
        inside = (gflat >= 0) & (gflat < self.world_size)
        owner = np.repeat(gids, glen)[inside]
        np.add.at(self.group_virtual, owner, self._is_virtual[gflat[inside]].astype(_I64))
        # members that move with a virtual one: neither waited for nor external
        self.group_mirrored: np.ndarray = np.zeros(ng, dtype=_I64)
        if self._is_mirrored.any():
            member = gflat[inside]
            mirrored = self._is_mirrored[member]
            np.add.at(self.group_mirrored, owner, mirrored.astype(_I64))
            mixed = (self.group_mirrored[owner] > 0) & (self.group_mirrored[owner] < self.group_size[owner])
            check = mirrored & mixed
            if check.any():
                keys = np.unique(owner * self.world_size + member)
                image = owner[check] * self.world_size + self.mirror[member[check]]
                away = np.flatnonzero(~np.isin(image, keys))
                if len(away):
                    m, g = int(member[check][away[0]]), int(owner[check][away[0]])
                    raise MirrorError(
                        f"group {self.trace.group_label(g)} holds rank {m} but not rank {self.mirror[m]}, which "
                        f"rank {m} is a copy of: the copy cannot be left out of the replay"
                    )
        unknown = np.flatnonzero(self._is_coll & ((self.group < 0) | (self.group_size[np.maximum(self.group, 0)] == 0)))
        if len(unknown):
            raise TraceError(f"{self.describe(int(unknown[0]))} names a group that is not in groups.parquet")

    def _instances(self, sub: pa.Table) -> None:
        """Number the instances (collectives first, by (group, seq); then matched P2P pairs;
        then unmatched P2P ops alone), their member lists (CSR: ``inst_ptr``/``inst_nodes``),
        how many virtual members each needs, and which are external."""
        n = self.num_nodes
        ci = np.flatnonzero(self._is_coll)
        key = self.group[ci] * (int(self.seq[ci].max()) + 2 if len(ci) else 1) + (self.seq[ci] + 1)
        ukey, cinst = np.unique(key, return_inverse=True)
        n_coll = len(ukey)
        p2p = pa.table(
            {
                "node_id": pa.array(np.arange(n, dtype=_I64)),
                "rank": pa.array(self.ranks[self.rank_pos]),
                "index": pa.array(self.index),
                "group": pa.array(self.group),
                "peer": pa.array(self.peer),
                "op": sub.column("op"),
                "kind": sub.column("kind"),
            }
        )
        s_rows, r_rows, lone_s, lone_r = match_p2p(p2p, unmatched=True)
        lone = np.sort(np.r_[lone_s, lone_r]).astype(_I64)
        n_pair = len(s_rows)
        ni = self.num_instances = n_coll + n_pair + len(lone)
        inst_of = np.full(n, -1, dtype=_I64)
        inst_of[ci] = cinst.reshape(-1)
        inst_of[s_rows] = inst_of[r_rows] = n_coll + np.arange(n_pair)
        inst_of[lone] = n_coll + n_pair + np.arange(len(lone))
        self.inst_of: np.ndarray = inst_of
        self.inst_ptr, order = _csr(inst_of[self.is_comm], ni)
        self.inst_nodes: np.ndarray = np.flatnonzero(self.is_comm)[order]
        first = self.inst_nodes[self.inst_ptr[:-1]]
        self.inst_kind: np.ndarray = np.r_[np.full(n_coll, INST_COLLECTIVE), np.full(ni - n_coll, INST_P2P)].astype(
            np.int8
        )
        self.inst_group: np.ndarray = self.group[first]
        self.inst_seq: np.ndarray = self.seq[first]
        self.inst_op: np.ndarray = self.op_code[first]
        # a collective needs its virtual members; a pair both sides; a lone op whose peer is
        # outside the virtual ranks is the virtual half of an external pair, any other lone op
        # waits for a peer that never comes (the deadlock error names it)
        lpeer = self.peer[lone]
        peer_ext = (lpeer >= 0) & (lpeer < self.world_size)
        mirrored_peer = np.zeros(len(lone), dtype=bool)
        mirrored_peer[peer_ext] = self._is_mirrored[lpeer[peer_ext]]
        if mirrored_peer.any():
            p = int(lone[np.flatnonzero(mirrored_peer)[0]])
            raise MirrorError(
                f"{self.describe(p)}: its peer is a copy left out of the replay, and the pair would never meet"
            )
        peer_ext[peer_ext] = ~self._is_virtual[lpeer[peer_ext]]
        cg = self.inst_group[:n_coll]
        self.inst_needed: np.ndarray = np.r_[
            self.group_virtual[cg], np.full(n_pair, 2), np.where(peer_ext, 1, 2)
        ].astype(_I64)
        self.inst_external: np.ndarray = np.r_[
            self.group_virtual[cg] + self.group_mirrored[cg] < self.group_size[cg], np.zeros(n_pair, bool), peer_ext
        ]
        count = np.diff(self.inst_ptr)
        over = np.flatnonzero(count > self.inst_needed)
        if len(over):
            p = int(self.inst_nodes[self.inst_ptr[over[0]]])
            raise TraceError(
                f"{self.describe(p)}: {count[over[0]]} nodes for {self.inst_needed[over[0]]} virtual members (a rank issued it twice, or is no member); validate the graph"
            )
        op_bad = np.flatnonzero(
            (self.op_code[self.inst_nodes] != np.repeat(self.inst_op, count))
            & (np.repeat(self.inst_kind, count) == INST_COLLECTIVE)
        )
        if len(op_bad):
            b = int(self.inst_nodes[op_bad[0]])
            a = int(self.inst_nodes[self.inst_ptr[inst_of[b]]])
            raise TraceError(
                f"{self.describe(a)} and {self.describe(b)} are the same instance but different ops; every member of a group must issue the same collectives in the same order"
            )

    def _batches(self, sub: pa.Table) -> None:
        """Coalesced batches, one per (rank, coalesced id): their ops complete together. A
        batch waited on at once (its ops not async) blocks the rank once, at its last op; the
        ops before it only issue (blocking on the first would wait for ops not yet issued)."""
        n = self.num_nodes
        coal = sub.column("coalesced").to_numpy().astype(_I64)
        bi = np.flatnonzero(self.is_comm & (coal >= 0))
        key = self.rank_pos[bi] * (int(coal.max()) + 1 if len(bi) else 1) + coal[bi]
        _, binv = np.unique(key, return_inverse=True)
        self.batch_of: np.ndarray = np.full(n, -1, dtype=_I64)
        self.batch_of[bi] = binv.reshape(-1)
        self.num_batches = int(binv.max()) + 1 if len(bi) else 0
        self.batch_ptr, order = _csr(self.batch_of[bi], self.num_batches)
        self.batch_nodes: np.ndarray = bi[order]
        self.batch_size: np.ndarray = np.diff(self.batch_ptr)
        blocking = self.is_comm & ~self.async_op
        if self.num_batches:
            blocks = np.zeros(self.num_batches, dtype=bool)
            np.logical_or.at(blocks, self.batch_of[bi], blocking[bi])
            blocking[bi] = False
            blocking[self.batch_nodes[self.batch_ptr[1:] - 1][blocks]] = True
        self.blocking: np.ndarray = blocking

    def _waits(self, sub: pa.Table) -> None:
        """Wait points as CSR: node p waits for ``wait_src[wait_ptr[p]:wait_ptr[p + 1]]``."""
        wait_index = sub.column("wait_index").to_numpy().astype(_I64)
        src = np.flatnonzero(self.is_comm & (wait_index > self.index))
        dst = self.off[self.rank_pos[src]] + wait_index[src]
        oob = np.flatnonzero(dst >= self.off[self.rank_pos[src] + 1])
        if len(oob):
            p = int(src[oob[0]])
            raise TraceError(
                f"{self.describe(p)} has wait_index {wait_index[p]}, past the rank's last node; validate the graph"
            )
        self.wait_ptr, order = _csr(dst, self.num_nodes)
        self.wait_src: np.ndarray = src[order]

    def _recorded_times(self, sub: pa.Table) -> None:
        """The durations a replay "from the graph" uses (unknown, -1, counts as 0):
        compute = ``duration_ns``; transfer of an instance = ``duration_ns`` of its last
        member to arrive (latest ``start_ns``), who waited for nobody; issue of a non-blocking
        op = the gap to the next node's start (host time in the call), except before a wait
        point, whose start also holds the wait."""
        start = sub.column("start_ns").to_numpy().astype(_I64)
        dur = np.maximum(sub.column("duration_ns").to_numpy().astype(_I64), 0)
        self.recorded_compute_ns: np.ndarray = np.where(self.is_comm, 0, dur)
        ni = self.num_instances
        count = np.diff(self.inst_ptr)
        o = np.lexsort((start[self.inst_nodes], np.repeat(np.arange(ni), count)))
        last = self.inst_nodes[o][self.inst_ptr[1:] - 1] if ni else np.zeros(0, dtype=_I64)
        self.recorded_transfer_ns: np.ndarray = dur[last]
        nxt = np.r_[start[1:], -1]
        same_rank = np.r_[self.rank_pos[1:] == self.rank_pos[:-1], False]
        before_wait = np.r_[np.diff(self.wait_ptr)[1:] > 0, False]
        ok = self.is_comm & ~self.blocking & same_rank & ~before_wait & (start >= 0) & (nxt >= 0)
        self.recorded_issue_ns: np.ndarray = np.where(ok, np.maximum(nxt - start, 0), 0)

    def _iterations(self) -> None:
        """Iteration numbers (from the iterations table, else the nodes) and the recorded
        per rank x iteration times, for comparison with a replay."""
        it = self.trace.iterations
        it_rank = it.column("rank").to_numpy().astype(_I64)
        it_num = it.column("iteration").to_numpy().astype(_I64)
        mine = (it_rank >= 0) & (it_rank < self.world_size)
        mine[mine] = self._is_virtual[it_rank[mine]]
        nums = np.unique(it_num[mine])
        if not len(nums):
            nums = np.unique(self.iteration[self.iteration >= 0])
        self.iterations: np.ndarray = nums.astype(_I64)
        self.recorded_iteration_ns: np.ndarray = np.full((len(self.ranks), len(nums)), -1, dtype=_I64)
        if mine.any():
            s = it.column("start_ns").to_numpy().astype(_I64)[mine]
            e = it.column("end_ns").to_numpy().astype(_I64)[mine]
            good = (s >= 0) & (e >= s)
            r = np.searchsorted(self.ranks, it_rank[mine])
            k = np.searchsorted(nums, it_num[mine])
            self.recorded_iteration_ns[r[good], k[good]] = (e - s)[good]

    # ------------------------------------------------------------------ lookups
    def iteration_bounds(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per rank position x iteration of ``iterations`` (flattened, rank-major): the position of
        the node before the rank's first node of the iteration (< ``lo`` where there is none),
        of its last node, whether the rank has a node in the iteration, and the rank's first
        position ``lo``. What iteration times are measured between."""
        its = self.iterations
        nr, nk = len(self.ranks), len(its)
        base = int(min(its.min(), self.iteration.min())) - 1
        m = int(max(its.max(), self.iteration.max())) - base + 2
        key = self.rank_pos * m + (self.iteration - base)  # sorted: ranks ascending, iterations monotone
        r = np.repeat(np.arange(nr, dtype=_I64), nk)
        k = np.tile(its, nr)
        last = np.searchsorted(key, r * m + (k - base), side="right") - 1
        prev = np.searchsorted(key, r * m + (k - 1 - base), side="right") - 1
        lo = self.off[r]
        has = (last >= lo) & (self.iteration[np.maximum(last, 0)] == k)
        return prev, last, has, lo

    def position(self, rank: np.ndarray | int, index: np.ndarray | int) -> np.ndarray:
        """Node position(s) of (rank, program index); -1 where the rank is not virtual or the
        index is out of range."""
        rank = np.asarray(rank, dtype=_I64)
        index = np.asarray(index, dtype=_I64)
        r = np.clip(np.searchsorted(self.ranks, rank), 0, max(len(self.ranks) - 1, 0))
        if not len(self.ranks):
            return np.full(np.shape(rank), -1, dtype=_I64)
        ok = (self.ranks[r] == rank) & (index >= 0) & (index < self.off[r + 1] - self.off[r])
        return np.where(ok, self.off[r] + index, -1)

    def rank_of(self, pos: int) -> int:
        return int(self.ranks[self.rank_pos[pos]])

    def op(self, pos: int) -> str:
        return self.op_names[self.op_code[pos]]

    def is_external(self, rank: int) -> bool:
        """A rank the replay does not play: neither virtual nor moving with a virtual one."""
        return not self._is_virtual[rank] and not self._is_mirrored[rank]

    def instance_ranks(self, inst: int) -> list[int]:
        """Global ranks that take part in an instance (virtual, mirrored and external)."""
        if self.inst_kind[inst] == INST_COLLECTIVE:
            return list(self.trace.group_info()[int(self.inst_group[inst])]["ranks"])
        p = int(self.inst_nodes[self.inst_ptr[inst]])
        peer = int(self.peer[p])
        return sorted({self.rank_of(p)} | ({peer} if 0 <= peer < self.world_size else set()))

    def describe(self, pos: int) -> str:
        """'rank 3 node 17 (all_reduce #4, group 1 ('tp', ranks 2-3))'."""
        pos = int(pos)
        op = self.op(pos)
        if not self.is_comm[pos]:
            return f"rank {self.rank_of(pos)} node {self.index[pos]} (compute)"
        parts = [f"{op} #{self.seq[pos]}"]
        if op in P2P_OPS:
            parts.append(("to" if op == "send" else "from") + f" rank {self.peer[pos]}")
        parts.append(f"group {self.trace.group_label(int(self.group[pos]))}")
        return f"rank {self.rank_of(pos)} node {self.index[pos]} ({', '.join(parts)})"
