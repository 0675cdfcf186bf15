"""Which ranks a replay may leave out: the copies of a solo capture's DP replicas.

A solo capture with a layout runs one representative per replica class and writes each replica
as its representative renamed by a shift of the edp coordinate (``prismllm.trace.replicate``,
which marks the graph's manifest with :data:`REPLICAS_KEY`). Such a graph is the same program
``edp`` times over, one *world* per edp coordinate, tied together by the groups that span the
edp dimension (DP, expert-DP, the world group). A replay that must play some ranks for what
they are (its sandbox ranks' worlds, whose virtual ranks meet real ones) plays those worlds and
one more, the *generic* world, and leaves out every other world: each of its ranks arrives at
each call when its image in the generic world does (same durations, same peers' classes), so
it is no member an instance needs to wait for. The cost of a slice or an emulation then grows
with the layout (ranks per world), not with the world size.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from prismllm.layout import Layout, replica_plan
from prismllm.trace.graph import PrismTrace
from prismllm.trace.schema import REPLICAS_KEY

_I64 = np.int64


def mirror_plan(trace: PrismTrace, keep: Iterable[int] = ()) -> np.ndarray | None:
    """Per rank of the world: the rank of the generic world it moves with, or -1 for a rank the
    replay plays (its world holds a rank of ``keep``, or is the generic one). None where nothing
    can be left out: a graph whose replicas are not marked as copies (a real run's recording, a
    slice timing of every rank), a layout without replicas, or ``keep`` in every world but one;
    and where a group spans worlds without being whole along edp (the program's own groups
    across a few DP replicas), since a copy in it would meet ranks its image does not."""
    return plan_of(trace.manifest, trace.groups, keep)


def plan_of(manifest: dict[str, Any], groups: pa.Table, keep: Iterable[int] = ()) -> np.ndarray | None:
    """:func:`mirror_plan` from a graph's manifest and groups table alone (what a reader knows
    before it reads the nodes: ``PrismTrace.load(ranks=...)``)."""
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


def _groups_whole_along_edp(groups: pa.Table, class_of: np.ndarray, edp_of: np.ndarray, edp: int) -> bool:
    """Every group is within one world (copied world by world) or holds each class it touches
    whole, all ``edp`` of its members (its own copy in every world)."""
    ranks = groups.column("ranks").combine_chunks()
    size = pc.list_value_length(ranks).to_numpy(zero_copy_only=False).astype(_I64)
    flat = pc.list_flatten(ranks).to_numpy(zero_copy_only=False).astype(_I64)
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


__all__ = ["mirror_plan", "plan_of"]
