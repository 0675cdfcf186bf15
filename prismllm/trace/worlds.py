"""The worlds of a graph whose DP replicas are copies of their representatives.

A solo capture with a layout runs one representative per replica class and writes each replica
as its representative renamed by a shift of the edp coordinate (``prismllm.trace.replicate``,
which marks the graph's manifest with :data:`REPLICAS_KEY`). Such a graph is the same program
``edp`` times over, one *world* per edp coordinate, tied together by the groups that span the
edp dimension (DP, expert-DP, the world group). What one world shows, every world shows: a
replay plays a few worlds and moves the others with them (``prismllm.replay.mirror``), and a
check of the graph reads one world (:func:`one_world`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from prismllm.layout import Layout, replica_plan
from prismllm.trace.edges import build_edges, group_members
from prismllm.trace.graph import PrismTrace
from prismllm.trace.schema import KIND_COMM, REPLICAS_KEY

_I64 = np.int64


def plan_of(manifest: dict[str, Any], groups: pa.Table, keep: Iterable[int] = ()) -> np.ndarray | None:
    """Per rank of the world: the rank of the generic world it moves with, or -1 for a rank that
    stands for itself (its world holds a rank of ``keep``, or is the generic one: the first world
    without one). None where no world is a copy of another: a graph whose replicas are not marked
    as copies (a real run's recording, a slice timing of every rank), a layout without replicas,
    or ``keep`` in every world but one; and where a group spans worlds without being whole along
    edp (the program's own groups across a few DP replicas), since a copy in it would meet ranks
    its image does not. Reads the manifest and the groups only (what a reader knows before it
    reads the nodes: ``PrismTrace.load(ranks=...)``)."""
    spec = manifest.get("layout")
    if not manifest.get(REPLICAS_KEY) or not spec:
        return None
    world = int(manifest["world_size"])
    layout = Layout.parse(spec, world)  # a manifest's layout reads back
    if layout is None or layout.edp < 2:
        return None
    edp = layout.coords_array()["dp"]
    keep = np.fromiter((int(r) for r in keep), dtype=_I64)
    if len(keep) and (keep.min() < 0 or keep.max() >= world):
        return None  # the caller's check of its ranks says what is wrong
    kept = np.unique(edp[keep])
    free = np.setdiff1d(np.arange(layout.edp, dtype=_I64), kept)
    if len(free) < 2:
        return None
    generic = int(free[0])
    if not _groups_whole_along_edp(groups, replica_plan(layout).replica_of, edp, layout.edp):
        return None
    ranks = np.arange(layout.world, dtype=_I64)
    left_out = ~np.isin(edp, np.r_[kept, generic])
    mirror = np.full(layout.world, -1, dtype=_I64)
    mirror[left_out] = layout.shift(generic - edp[left_out], ranks[left_out])
    return mirror


def one_world(trace: PrismTrace) -> tuple[PrismTrace, np.ndarray] | None:
    """The generic world of a graph whose replicas are copies (:func:`plan_of`), as a graph to
    check in place of the whole one, and its ranks; None where there is none, or where a send or
    recv crosses worlds (a pair the world could not hold).

    The world's graph holds the world's nodes and iterations, every group as it is (members in
    other worlds included: sizes and roots stay the program's), and the edges derived from its
    nodes as the assembly derived the whole graph's, a collective over a group that spans worlds
    joining the world's members only. A check of it checks the whole graph: every other world
    is this one renamed, so a problem in the graph is a problem here (a dependency cycle
    through several worlds maps onto a closed walk in this one), and the files' checksums hold
    the copies to that."""
    if trace.partial:
        return None
    mirror = plan_of(trace.manifest, trace.groups)
    if mirror is None:
        return None
    ranks = np.flatnonzero(mirror < 0)
    world = np.zeros(len(mirror), dtype=bool)
    world[ranks] = True
    nodes = _rows_in(trace.nodes, world)
    is_comm = pc.equal(nodes.column("kind"), KIND_COMM).to_numpy(zero_copy_only=False)
    p2p = pc.is_in(nodes.column("op"), value_set=pa.array(["send", "recv"])).to_numpy(zero_copy_only=False) & is_comm
    peer = nodes.column("peer").to_numpy()[p2p].astype(_I64)
    if len(peer) and not world[peer[(peer >= 0) & (peer < len(world))]].all():
        return None
    sub = PrismTrace(
        manifest=trace.manifest,
        nodes=nodes,
        edges=build_edges(nodes, trace.groups, len(world)),
        groups=trace.groups,
        iterations=_rows_in(trace.iterations, world),
    )
    sub.partial = True  # never saved
    return sub, ranks


def _rows_in(table: pa.Table, world: np.ndarray) -> pa.Table:
    """The rows whose ``rank`` is in the world, chunk by chunk (no column of the whole table
    is copied)."""
    rank = table.column("rank")
    mask = pa.chunked_array([pa.array(world[c.to_numpy(zero_copy_only=False)]) for c in rank.chunks], pa.bool_())
    return table.filter(mask).combine_chunks()


def _groups_whole_along_edp(groups: pa.Table, class_of: np.ndarray, edp_of: np.ndarray, edp: int) -> bool:
    """Every group is within one world (copied world by world) or holds each class it touches
    whole, all ``edp`` of its members (its own copy in every world)."""
    _, size, flat = group_members(groups)
    if not len(flat):
        return True
    if flat.min() < 0 or flat.max() >= len(class_of):
        return False
    owner = np.repeat(np.arange(len(size), dtype=_I64), size)
    e = edp_of[flat]
    lo = np.full(len(size), edp, dtype=_I64)
    hi = np.full(len(size), -1, dtype=_I64)
    np.minimum.at(lo, owner, e)
    np.maximum.at(hi, owner, e)
    spans = (hi > lo)[owner]
    _, counts = np.unique(owner[spans] * len(class_of) + class_of[flat[spans]], return_counts=True)
    return bool(np.all(counts == edp))


__all__ = ["one_world", "plan_of"]
