"""Check a PrismTrace for the errors that would make its replay wrong or hang.

``validate(trace)`` returns None or raises one :class:`TraceError` whose message names the
rank, node index, op and group involved (and the fix where there is one). Checks, in order:

1. structure: node ids unique; (rank, index) unique and 0..n-1 per rank; ranks inside the
   world; kinds and ops known; edges reference existing nodes and have known kinds; sync edges
   join communication nodes.
2. groups: a comm node's group exists and the rank is a member; send/recv peers are members
   of the group, inside the world and not the rank itself.
3. wait points: ``wait_index`` is -1 or after the node and inside the rank's program.
4. collectives, per instance (group, seq): no rank issues the same instance twice; no member
   is missing (a member that issued fewer collectives on the group); all participants agree on
   op, root (rooted ops), reduce op, dtype and sizes:
   all_reduce / reduce / barrier / gather: equal ``in_bytes``;
   broadcast: equal ``max(in_bytes, out_bytes)`` (the root contributes the tensor, the others
   receive it: in_bytes on the root, out_bytes elsewhere);
   all_gather: equal ``in_bytes`` and ``out_bytes == in_bytes * size``;
   reduce_scatter: equal ``in_bytes`` and ``in_bytes == out_bytes * size``;
   scatter: equal ``out_bytes``;
   all_to_all: total in == total out, and with recorded splits rank i's ``in_splits[j]`` equals
   rank j's ``out_splits[i]`` (splits of length group size).
5. send/recv: every send has its recv (the k-th send a->b on a group pairs with the k-th recv
   on b from a on that group) and the pair moves the same bytes (``max(in_bytes, out_bytes)``
   of each side).
6. deadlock: no dependency cycle. The host program of each rank is a chain of *points*: a node
   starts after the previous point; a blocking node (not async) must complete before the next
   point; the nodes of one coalesced batch share a point; an async node must complete before
   the point preceding its ``wait_index`` node. Each sync instance (collective instance or
   send/recv pair, the connected components of the sync edges) is contracted to one vertex;
   Kahn's algorithm (numpy, frontier by frontier) finds any cycle, and the message walks it.
   Cycles through stream order alone (e.g. NCCL ops queued on one stream) are not modelled.

Everything is vectorised (numpy / pyarrow.compute, group-by via sorting): an 8192-rank graph
with ~1000 nodes per rank validates in seconds.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from prismllm.trace.cycles import check_cycles
from prismllm.trace.edges import group_members, group_rank_lookup, match_p2p, run_starts
from prismllm.trace.graph import PrismTrace, TraceError, string_codes
from prismllm.trace.schema import (
    COLLECTIVE_OPS,
    COMM_OPS,
    EDGE_KINDS,
    EDGE_SYNC,
    EDGE_WAIT,
    KIND_COMM,
    KIND_COMPUTE,
)
from prismllm.trace.worlds import one_world

_SAME_IN = ("all_reduce", "reduce", "barrier", "gather", "all_gather", "reduce_scatter")
_ROOTED = ("broadcast", "reduce", "gather", "scatter")
_REDUCING = ("all_reduce", "reduce", "reduce_scatter")
_SAME_ORDER_FIX = "every member of a group must issue the same collectives in the same order"


class Ctx:
    """Columns of the node table as numpy, and message helpers. ``ranks``: the ranks the node
    table holds where it holds some ranks only (one world of copies: a group's instance is whole
    with its members among them); None for every rank."""

    def __init__(self, trace: PrismTrace, ranks: np.ndarray | None = None) -> None:
        self.trace = trace
        self.ranks = ranks
        nodes = trace.nodes
        self.n = nodes.num_rows
        self.node_id = _np(nodes.column("node_id"))
        self.rank = _np(nodes.column("rank"))
        self.index = _np(nodes.column("index"))
        self.group = _np(nodes.column("group"))
        self.seq = _np(nodes.column("seq"))
        self.peer = _np(nodes.column("peer"))
        self.in_bytes = _np(nodes.column("in_bytes"))
        self.out_bytes = _np(nodes.column("out_bytes"))
        self.wait_index = _np(nodes.column("wait_index"))
        self.async_op = nodes.column("async_op").to_numpy(zero_copy_only=False).astype(bool)
        self.coalesced = _np(nodes.column("coalesced"))
        self.op_codes, self.op_names = string_codes(nodes.column("op"))
        self.kind_codes, self.kind_names = string_codes(nodes.column("kind"))
        kind_comm = self.kind_names.index(KIND_COMM) if KIND_COMM in self.kind_names else -1
        self.is_comm = self.kind_codes == kind_comm
        self.world_size = trace.world_size
        self.groups = trace.group_info()

    def op(self, i: int) -> str:
        return self.op_names[self.op_codes[i]]

    def mask_ops(self, ops) -> np.ndarray:
        codes = [k for k, name in enumerate(self.op_names) if name in ops]
        return np.isin(self.op_codes, codes) & self.is_comm

    def group_size(self, gid: int) -> int:
        return len(self.groups.get(int(gid), {}).get("ranks", []))

    def held_members(self, gid: int) -> list[int]:
        """The group's members whose nodes the table holds."""
        members = self.groups.get(int(gid), {}).get("ranks", [])
        if self.ranks is None:
            return members
        held = set(self.ranks.tolist())
        return [r for r in members if r in held]

    def held_sizes(self) -> np.ndarray:
        """Per group id: how many of its members the table holds (``ranks`` given)."""
        gids, lengths, flat = group_members(self.trace.groups)
        held = np.zeros(self.world_size, dtype=bool)
        held[self.ranks] = True
        out = np.zeros(int(gids.max()) + 1 if len(gids) else 0, dtype=np.int64)
        out[gids] = np.bincount(np.repeat(np.arange(len(gids)), lengths), weights=held[flat], minlength=len(gids))
        return out

    def node(self, i: int, *, with_group: bool = True) -> str:
        """'rank 3 node 17 (all_reduce, group 1 ('tp', ranks 2-3))'."""
        op = self.op(i)
        parts = [op]
        if op in ("send", "recv") or op in _ROOTED:
            if self.peer[i] >= 0:
                parts.append({"send": "to", "recv": "from"}.get(op, "root") + f" rank {self.peer[i]}")
        if with_group and self.group[i] >= 0:
            parts.append(f"group {self.trace.group_label(int(self.group[i]))}")
        return f"rank {self.rank[i]} node {self.index[i]} ({', '.join(parts)})"

    def instance(self, i: int) -> str:
        return f"{self.op(i)} #{self.seq[i]} on group {self.trace.group_label(int(self.group[i]))}"


def _np(col) -> np.ndarray:
    """A numeric column as numpy, in its own dtype (no copy beyond joining chunks)."""
    return col.to_numpy()


def validate(trace: PrismTrace) -> None:
    """Raise TraceError with one clear message for the first problem found; None if sound. A
    graph whose DP replicas are copies of their representatives is checked over one world
    (:func:`prismllm.trace.worlds.one_world`): the others are that one renamed."""
    world = one_world(trace)
    c = Ctx(trace) if world is None else Ctx(*world)
    if c.n == 0:
        return
    _check_structure(c)
    _check_groups(c)
    _check_waits(c)
    _check_collectives(c)
    _check_p2p(c)
    check_cycles(c)


# ---------------------------------------------------------------------- 1. structure
def _check_structure(c: Ctx) -> None:
    if np.array_equal(c.node_id, np.arange(c.n)):  # as assembled: ids are row positions
        c.ids_are_rows = True
        o = ids = c.node_id
        dup = np.zeros(0, dtype=np.int64)
    else:
        c.ids_are_rows = False
        o = np.argsort(c.node_id, kind="stable")
        ids = c.node_id[o]
        dup = np.flatnonzero(ids[1:] == ids[:-1])
    if len(dup):
        i, j = o[dup[0]], o[dup[0] + 1]
        raise TraceError(
            f"node id {ids[dup[0]]} is used twice ({c.node(i)} and {c.node(j)}); the graph is corrupt: re-assemble it"
        )
    c.sorted_ids, c.id_order = ids, o

    bad = np.flatnonzero((c.rank < 0) | (c.rank >= c.world_size))
    if len(bad):
        raise TraceError(
            f"{c.node(bad[0])} has a rank outside the world size {c.world_size}; the manifest and the nodes disagree"
        )

    # program order: indices 0..n-1 per rank
    fast = bool(np.all(c.rank[1:] >= c.rank[:-1]))  # sorted by rank already (as assembled)
    while True:
        ro = np.arange(c.n) if fast else np.lexsort((c.index, c.rank))
        r, ix = c.rank[ro], c.index[ro]
        starts = run_starts([r])
        first = np.flatnonzero(starts)
        run = np.cumsum(starts) - 1
        expected = np.arange(c.n) - first[run]
        badp = np.flatnonzero(ix != expected)
        if len(badp) and fast:
            fast = False  # maybe just not in index order within a rank: sort and look again
            continue
        break
    if len(badp):
        p = badp[0]
        if p > 0 and not starts[p] and ix[p] == ix[p - 1]:
            raise TraceError(
                f"rank {r[p]} has two nodes with index {ix[p]} ({c.node(ro[p - 1])} and {c.node(ro[p])}); the graph is corrupt: re-assemble it"
            )
        raise TraceError(
            f"rank {r[p]} has no node with index {expected[p]} (its indices must be 0..n-1); the graph is corrupt: re-assemble it"
        )
    c.prog_order = ro  # rows in (rank, index) order
    c.rank_first = first  # positions (in prog_order) where each rank starts
    c.rank_of_run = r[first]
    run_len = np.diff(np.r_[first, c.n])
    c.rank_len_by_row = np.empty(c.n, dtype=np.int64)
    c.rank_len_by_row[ro] = run_len[run]

    kc = set(c.kind_names) - {KIND_COMM, KIND_COMPUTE}
    if kc:
        k = c.kind_names.index(sorted(kc)[0])
        i = int(np.flatnonzero(c.kind_codes == k)[0])
        raise TraceError(f"{c.node(i)} has kind {c.kind_names[k]!r}; expected {KIND_COMPUTE!r} or {KIND_COMM!r}")
    unknown = np.flatnonzero(c.is_comm & ~c.mask_ops(COMM_OPS))
    if len(unknown):
        i = unknown[0]
        raise TraceError(
            f"{c.node(i)} is a communication node with unknown op {c.op(i)!r}; known ops: {', '.join(COMM_OPS)}"
        )
    comp_code = c.op_names.index(KIND_COMPUTE) if KIND_COMPUTE in c.op_names else -2
    wrong = np.flatnonzero(~c.is_comm & (c.op_codes != comp_code))
    if len(wrong):
        raise TraceError(
            f"{c.node(wrong[0])} is a compute node with op {c.op(wrong[0])!r}; a compute node's op is 'compute'"
        )
    _check_compute_fields(c)

    edges = c.trace.edges
    if edges.num_rows:
        src = edges.column("src").to_numpy()
        dst = edges.column("dst").to_numpy()
        ekind_codes, ekind_names = string_codes(edges.column("kind"))
        badk = [k for k in ekind_names if k not in EDGE_KINDS]
        if badk:
            e = int(np.flatnonzero(ekind_codes == ekind_names.index(badk[0]))[0])
            raise TraceError(
                f"edge {e} ({src[e]} -> {dst[e]}) has unknown kind {badk[0]!r}; known: {', '.join(EDGE_KINDS)}"
            )
        srow, sok = _rows_of(c, src)
        drow, dok = _rows_of(c, dst)
        missing = np.flatnonzero(~(sok & dok))
        if len(missing):
            e = int(missing[0])
            which = src[e] if not sok[e] else dst[e]
            raise TraceError(
                f"edge {e} ({ekind_names[ekind_codes[e]]}: node {src[e]} -> node {dst[e]}) references "
                f"node {which}, which does not exist; the graph is corrupt: re-assemble it"
            )
        sync_code = ekind_names.index(EDGE_SYNC) if EDGE_SYNC in ekind_names else -2
        wait_code = ekind_names.index(EDGE_WAIT) if EDGE_WAIT in ekind_names else -2
        is_sync = ekind_codes == sync_code
        badsync = np.flatnonzero(is_sync & ~(c.is_comm[srow] & c.is_comm[drow]))
        if len(badsync):
            e = int(badsync[0])
            raise TraceError(
                f"sync edge {src[e]} -> {dst[e]} joins a compute node ({c.node(srow[e])} and {c.node(drow[e])}); only communication nodes meet"
            )
        c.sync_rows = (srow[is_sync], drow[is_sync])
        is_wait = ekind_codes == wait_code
        c.wait_rows = (srow[is_wait], drow[is_wait])
        cross = np.flatnonzero(is_wait & (c.rank[srow] != c.rank[drow]))
        if len(cross):
            e = int(cross[0])
            raise TraceError(
                f"wait edge {src[e]} -> {dst[e]} joins two ranks ({c.node(srow[e])} and {c.node(drow[e])}); a wait is on one rank"
            )
    else:
        z = np.zeros(0, dtype=np.int64)
        c.sync_rows = (z, z)
        c.wait_rows = (z, z)


def _rows_of(c: Ctx, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Row positions of node ids; ok=False where an id does not exist."""
    if c.ids_are_rows:
        ok = (ids >= 0) & (ids < c.n)
        return np.where(ok, ids, 0), ok
    pos = np.searchsorted(c.sorted_ids, ids)
    pos = np.minimum(pos, len(c.sorted_ids) - 1)
    ok = c.sorted_ids[pos] == ids
    return c.id_order[pos], ok


# ---------------------------------------------------------------------- 2. groups
# what a compute span holds in each communication column: nothing (every writer leaves these)
_COMPUTE_NEUTRAL = {"group": -1, "seq": -1, "peer": -1, "tag": 0, "coalesced": -1, "wait_index": -1,
                    "in_bytes": 0, "out_bytes": 0, "async_op": False, "reduce_op": "", "dtype": ""}  # fmt: skip
_COMPUTE_EMPTY = ("shape", "in_splits", "out_splits")


def _check_compute_fields(c: Ctx) -> None:
    """A compute span carries no communication: a value in one of those columns is a change no
    writer makes (the replay would ignore it, and a comparison of two graphs would not)."""
    comp = ~c.is_comm
    if not comp.any():
        return
    nodes = c.trace.nodes
    for col, neutral in _COMPUTE_NEUTRAL.items():
        values = nodes.column(col)
        if isinstance(neutral, str):
            differs = ~pc.equal(pc.fill_null(values, neutral), neutral).to_numpy(zero_copy_only=False).astype(bool)
        else:
            differs = values.to_numpy(zero_copy_only=False) != neutral
        bad = np.flatnonzero(comp & differs)
        if len(bad):
            i = bad[0]
            raise TraceError(
                f"{c.node(i)} is a compute span with {col} = {values[int(i)].as_py()!r}; a compute span carries no "
                "communication fields: the graph was changed after it was written, re-record it"
            )
    for col in _COMPUTE_EMPTY:
        lengths = pc.fill_null(pc.list_value_length(nodes.column(col)), 0).to_numpy(zero_copy_only=False)
        bad = np.flatnonzero(comp & (lengths > 0))
        if len(bad):
            i = bad[0]
            raise TraceError(
                f"{c.node(i)} is a compute span with {col} = {nodes.column(col)[int(i)].as_py()!r}; a compute span "
                "carries no communication fields: the graph was changed after it was written, re-record it"
            )


def _check_groups(c: Ctx) -> None:
    ids = c.trace.groups.column("group_id").to_numpy(zero_copy_only=False)
    if len(ids) != len(np.unique(ids)):
        dup = int(ids[np.flatnonzero(np.bincount(ids - ids.min()) > 1)[0] + ids.min()])
        raise TraceError(
            f"groups.parquet lists group {dup} more than once; each group is stored once: the graph is corrupt, re-record it"
        )
    nogroup = np.flatnonzero(c.is_comm & (c.group < 0))
    if len(nogroup):
        raise TraceError(f"{c.node(nogroup[0])} has no group; every communication node belongs to a process group")
    known = np.array(sorted(c.groups), dtype=np.int64)
    unknown = np.flatnonzero(c.is_comm & ~np.isin(c.group, known))
    if len(unknown):
        i = unknown[0]
        raise TraceError(
            f"rank {c.rank[i]} node {c.index[i]} ({c.op(i)}) names group {c.group[i]}, which is not in groups.parquet; the graph is corrupt: re-assemble it"
        )
    lookup = group_rank_lookup(c.trace.groups, c.world_size)
    c.grank = np.full(c.n, -1, dtype=np.int64)
    ci = np.flatnonzero(c.is_comm)
    c.grank[ci] = lookup(c.group[ci], c.rank[ci])
    notmember = np.flatnonzero(c.is_comm & (c.grank < 0))
    if len(notmember):
        i = notmember[0]
        raise TraceError(f"{c.node(i)}: rank {c.rank[i]} is not a member of that group")
    p2p = np.flatnonzero(c.mask_ops(("send", "recv")))
    if len(p2p):
        pr = c.peer[p2p]
        bad = np.flatnonzero((pr < 0) | (pr >= c.world_size) | (pr == c.rank[p2p]))
        if len(bad) and c.peer[p2p[bad[0]]] == -1 and c.op(p2p[bad[0]]) == "recv":
            raise TraceError(
                f"{c.node(p2p[bad[0]])} is a recv from any source whose source rank was never "
                f"recorded (the program did not wait on it before the recorder finished); its "
                f"send cannot be matched: wait on the recv, or re-record"
            )
        if len(bad):
            i = p2p[bad[0]]
            raise TraceError(
                f"{c.node(i)} has peer {c.peer[i]}: a send/recv peer must be another rank inside the world (0..{c.world_size - 1})"
            )
        pg = lookup(c.group[p2p], pr)
        bad = np.flatnonzero(pg < 0)
        if len(bad):
            i = p2p[bad[0]]
            raise TraceError(f"{c.node(i)}: peer rank {c.peer[i]} is not a member of that group")


# ---------------------------------------------------------------------- 3. waits
def _check_waits(c: Ctx) -> None:
    w = c.wait_index
    bad = np.flatnonzero((w != -1) & ((w <= c.index) | (w >= c.rank_len_by_row)))
    if len(bad):
        i = bad[0]
        n = c.rank_len_by_row[i]
        why = (
            "not after the node" if w[i] <= c.index[i] else f"out of range (rank {c.rank[i]} has {n} nodes, 0..{n - 1})"
        )
        raise TraceError(
            f"{c.node(i)} has wait_index {w[i]}, {why}: the wait point of an async operation "
            f"must be a later node of the same rank; the recorder lost it, re-record"
        )


# ---------------------------------------------------------------------- 4. collectives
def _check_collectives(c: Ctx) -> None:
    ci = np.flatnonzero(c.mask_ops(COLLECTIVE_OPS))
    if not len(ci):
        return
    g, s, gr = c.group[ci], c.seq[ci], c.grank[ci]
    o = np.lexsort((gr, s, g))
    rows = ci[o]
    g, s, gr = g[o], s[o], gr[o]

    # same instance twice on one rank
    dup = np.flatnonzero((g[1:] == g[:-1]) & (s[1:] == s[:-1]) & (gr[1:] == gr[:-1]))
    if len(dup):
        a, b = rows[dup[0]], rows[dup[0] + 1]
        raise TraceError(
            f"{c.node(a)} and node {c.index[b]} ({c.op(b)}) both carry seq {c.seq[a]} on that "
            f"group; a rank's collectives on a group must be numbered 0, 1, 2, ...: re-record"
        )

    starts = run_starts([g, s])
    first = np.flatnonzero(starts)
    run = np.cumsum(starts) - 1
    count = np.diff(np.r_[first, len(rows)])
    gsize = np.array([c.group_size(x) for x in range(int(g.max()) + 1)], dtype=np.int64)
    size_run = gsize[g[first]]
    short = np.flatnonzero(count != (size_run if c.ranks is None else c.held_sizes()[g[first]]))
    if len(short):
        # report the incomplete instance that comes first in program order of its members
        k = short[np.argmin(s[first[short]] * (c.world_size + 1) + g[first[short]])] if len(short) > 1 else short[0]
        members = rows[first[k] : first[k] + count[k]]
        gid = int(g[first[k]])
        granks = c.held_members(gid)
        present = set(int(x) for x in c.rank[members])
        absent = [r for r in granks if r not in present]
        lead = members[0]
        coll_mask = c.mask_ops(COLLECTIVE_OPS) & (c.group == gid)
        per_rank = np.bincount(c.rank[coll_mask], minlength=c.world_size)
        r_missing = absent[0]
        raise TraceError(
            f"collective {c.instance(lead)} is missing {_ranks(absent)}: rank {r_missing} issued "
            f"{per_rank[r_missing]} collectives on this group, rank {c.rank[lead]} issued "
            f"{per_rank[c.rank[lead]]} ({c.node(lead, with_group=False)} is #{s[first[k]]}); "
            f"{_SAME_ORDER_FIX}"
        )

    head = rows[first][run]  # each row's first member in group-rank order

    def first_bad(mask: np.ndarray) -> int | None:
        idx = np.flatnonzero(mask)
        return None if not len(idx) else int(idx[0])

    op_r = c.op_codes[rows]
    k = first_bad(op_r != c.op_codes[head])
    if k is not None:
        a, b = head[k], rows[k]
        raise TraceError(
            f"collective #{c.seq[a]} on group {c.trace.group_label(int(c.group[a]))}: "
            f"rank {c.rank[a]} node {c.index[a]} is {c.op(a)} but rank {c.rank[b]} node "
            f"{c.index[b]} is {c.op(b)}; {_SAME_ORDER_FIX}"
        )

    rooted = c.mask_ops(_ROOTED)[rows]
    k = first_bad(rooted & (c.peer[rows] != c.peer[head]))
    if k is not None:
        a, b = head[k], rows[k]
        raise TraceError(
            f"collective {c.instance(a)}: rank {c.rank[a]} node {c.index[a]} uses root "
            f"{c.peer[a]} but rank {c.rank[b]} node {c.index[b]} uses root {c.peer[b]}; all "
            f"participants must pass the same root"
        )

    nodes = c.trace.nodes
    red_codes, red_names = string_codes(nodes.column("reduce_op"))
    reducing = c.mask_ops(_REDUCING)[rows]
    k = first_bad(reducing & (red_codes[rows] != red_codes[head]))
    if k is not None:
        a, b = head[k], rows[k]
        raise TraceError(
            f"collective {c.instance(a)}: rank {c.rank[a]} node {c.index[a]} reduces with "
            f"{red_names[red_codes[a]]!r} but rank {c.rank[b]} node {c.index[b]} with "
            f"{red_names[red_codes[b]]!r}; all participants must pass the same reduce op"
        )

    dt_codes, dt_names = string_codes(nodes.column("dtype"))
    empty_dt = dt_names.index("") if "" in dt_names else -2
    dtr, dth = dt_codes[rows], dt_codes[head]
    k = first_bad((dtr != dth) & (dtr != empty_dt) & (dth != empty_dt) & ~c.mask_ops(("barrier",))[rows])
    if k is not None:
        a, b = head[k], rows[k]
        raise TraceError(
            f"collective {c.instance(a)}: rank {c.rank[a]} node {c.index[a]} passes "
            f"{dt_names[dth[k]]} but rank {c.rank[b]} node {c.index[b]} passes {dt_names[dtr[k]]}; "
            f"all participants must pass tensors of the same dtype"
        )

    inb, outb = c.in_bytes[rows], c.out_bytes[rows]
    size_row = size_run[run]
    k = first_bad(c.mask_ops(_SAME_IN)[rows] & (inb != c.in_bytes[head]))
    if k is not None:
        a, b = head[k], rows[k]
        raise TraceError(
            f"collective {c.instance(a)}: rank {c.rank[b]} node {c.index[b]} passes "
            f"{inb[k]} bytes but rank {c.rank[a]} node {c.index[a]} passes {c.in_bytes[a]}; all "
            f"participants must pass tensors of the same size"
        )
    bsize = np.maximum(inb, outb)
    k = first_bad(c.mask_ops(("broadcast",))[rows] & (bsize != np.maximum(c.in_bytes[head], c.out_bytes[head])))
    if k is not None:
        a, b = head[k], rows[k]
        raise TraceError(
            f"collective {c.instance(a)}: rank {c.rank[b]} node {c.index[b]} broadcasts a tensor "
            f"of {bsize[k]} bytes but rank {c.rank[a]} node {c.index[a]} one of "
            f"{max(c.in_bytes[a], c.out_bytes[a])}; all participants must pass tensors of the same size"
        )
    k = first_bad(c.mask_ops(("scatter",))[rows] & (outb != c.out_bytes[head]))
    if k is not None:
        a, b = head[k], rows[k]
        raise TraceError(
            f"collective {c.instance(a)}: rank {c.rank[b]} node {c.index[b]} receives "
            f"{outb[k]} bytes but rank {c.rank[a]} node {c.index[a]} receives {c.out_bytes[a]}; "
            f"all participants must pass output tensors of the same size"
        )
    k = first_bad(c.mask_ops(("all_gather",))[rows] & (outb != inb * size_row))
    if k is not None:
        b = rows[k]
        raise TraceError(
            f"{c.node(b)}: all_gather output is {outb[k]} bytes, but input {inb[k]} bytes x group "
            f"size {size_row[k]} = {inb[k] * size_row[k]}; the output must hold every member's input"
        )
    k = first_bad(c.mask_ops(("reduce_scatter",))[rows] & (inb != outb * size_row))
    if k is not None:
        b = rows[k]
        raise TraceError(
            f"{c.node(b)}: reduce_scatter input is {inb[k]} bytes, but output {outb[k]} bytes x "
            f"group size {size_row[k]} = {outb[k] * size_row[k]}; the input must hold one output "
            f"per member"
        )
    _check_all_to_all(c, rows, run, first, count, size_row)


def _check_all_to_all(c, rows, run, first, count, size_row) -> None:
    is_a2a = c.mask_ops(("all_to_all",))[rows]
    if not is_a2a.any():
        return
    # totals: what the instance sends equals what it receives
    runs = np.unique(run[is_a2a])
    tot_in = np.bincount(run, weights=c.in_bytes[rows], minlength=len(first))
    tot_out = np.bincount(run, weights=c.out_bytes[rows], minlength=len(first))
    bad = runs[tot_in[runs] != tot_out[runs]]
    if len(bad):
        a = rows[first[bad[0]]]
        raise TraceError(
            f"collective {c.instance(a)}: its members send {int(tot_in[bad[0]])} bytes in total "
            f"but receive {int(tot_out[bad[0]])}; the split sizes of the members disagree"
        )
    nodes = c.trace.nodes
    a_rows = rows[is_a2a]
    ins = nodes.column("in_splits").take(pa.array(a_rows)).combine_chunks()
    outs = nodes.column("out_splits").take(pa.array(a_rows)).combine_chunks()
    lin = pc.list_value_length(ins).to_numpy(zero_copy_only=False).astype(np.int64)
    lout = pc.list_value_length(outs).to_numpy(zero_copy_only=False).astype(np.int64)
    sz = size_row[is_a2a]
    for lens, what in ((lin, "in_splits"), (lout, "out_splits")):
        bad = np.flatnonzero((lens != 0) & (lens != sz))
        if len(bad):
            i = a_rows[bad[0]]
            raise TraceError(
                f"{c.node(i)} has {what} of length {lens[bad[0]]}, but the group has {sz[bad[0]]} members; one split per member"
            )
    # instances where every member recorded both splits (and every member is held: one world
    # of copies holds a group that spans worlds in part)
    arun = run[is_a2a]
    have = (lin == sz) & (lout == sz)
    complete_runs = (np.bincount(arun, weights=have, minlength=len(first)) == count) & (count == size_row[first])
    sel = complete_runs[arun]
    if not sel.any():
        return
    ins_v = pc.list_flatten(ins).to_numpy(zero_copy_only=False).astype(np.int64)
    outs_v = pc.list_flatten(outs).to_numpy(zero_copy_only=False).astype(np.int64)
    off_in = np.r_[0, np.cumsum(lin)]
    off_out = np.r_[0, np.cumsum(lout)]
    # expand the selected members: entry (instance, owner group rank, position)
    m = np.flatnonzero(sel)
    szm = sz[m]
    owner_row = np.repeat(a_rows[m], szm)
    inst = np.repeat(arun[m], szm)
    owner = c.grank[owner_row]
    pos = np.arange(int(szm.sum())) - np.repeat((np.cumsum(szm) - szm), szm)
    vin = ins_v[np.repeat(off_in[m], szm) + pos]
    vout = outs_v[np.repeat(off_out[m], szm) + pos]
    # in entry: sender=owner, receiver=pos; out entry: sender=pos, receiver=owner
    oi = np.lexsort((pos, owner, inst))
    oo = np.lexsort((owner, pos, inst))
    diff = np.flatnonzero(vin[oi] != vout[oo])
    if len(diff):
        d = diff[0]
        si, so = oi[d], oo[d]
        a, b = owner_row[si], owner_row[so]
        raise TraceError(
            f"collective {c.instance(a)}: rank {c.rank[a]} node {c.index[a]} sends {vin[si]} rows "
            f"to rank {c.rank[b]} (in_splits[{pos[si]}]) but rank {c.rank[b]} node {c.index[b]} "
            f"expects {vout[so]} rows from rank {c.rank[a]} (out_splits[{pos[so]}]); each rank's "
            f"output splits must be its peers' input splits"
        )


# ---------------------------------------------------------------------- 5. send / recv
def _check_p2p(c: Ctx) -> None:
    send_rows, recv_rows, lone_send, lone_recv = match_p2p(c.trace.nodes, unmatched=True)
    if len(lone_send) or len(lone_recv):
        cand = np.r_[lone_send, lone_recv]
        i = int(cand[np.argmin(c.node_id[cand])])
        is_send = c.op(i) == "send"
        a, b = (c.rank[i], c.peer[i]) if is_send else (c.peer[i], c.rank[i])
        same_g = c.group == c.group[i]
        n_send = int(np.sum(c.mask_ops(("send",)) & same_g & (c.rank == a) & (c.peer == b)))
        n_recv = int(np.sum(c.mask_ops(("recv",)) & same_g & (c.rank == b) & (c.peer == a)))
        if is_send:
            what = f"has no matching recv on rank {b}"
        else:
            what = f"has no matching send on rank {a}"
        raise TraceError(
            f"{c.node(i)} ({max(c.in_bytes[i], c.out_bytes[i])} bytes) {what}: rank {a} posts "
            f"{n_send} send(s) to rank {b} on this group, rank {b} posts {n_recv} recv(s) from "
            f"rank {a}; pair every send with a recv on the peer, same group, same order"
        )
    if len(send_rows):
        ps = np.maximum(c.in_bytes[send_rows], c.out_bytes[send_rows])
        pr = np.maximum(c.in_bytes[recv_rows], c.out_bytes[recv_rows])
        bad = np.flatnonzero(ps != pr)
        if len(bad):
            s, r = send_rows[bad[0]], recv_rows[bad[0]]
            raise TraceError(
                f"{c.node(s)} sends {ps[bad[0]]} bytes but its matching recv, rank {c.rank[r]} "
                f"node {c.index[r]}, receives {pr[bad[0]]}; a send and its recv must move "
                f"tensors of the same size"
            )


def _ranks(rs: list[int]) -> str:
    if len(rs) == 1:
        return f"rank {rs[0]}"
    return "ranks " + ", ".join(map(str, rs[:8])) + (f" and {len(rs) - 8} more" if len(rs) > 8 else "")
