"""Assembly of a solo capture that ran one representative per replica class: the replicas'
nodes, groups and iterations are the representative's, renamed (``prismllm.layout``)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from prismllm.specs import format_ranks
from prismllm.trace.assemble import (
    LOG_FIELDS,
    Part,
    assemble_groups,
    assemble_iterations,
    assemble_nodes,
    gc_paused,
    graph_manifest,
    groups_table,
    rank_list,
    read_parts,
)
from prismllm.trace.edges import build_edges, group_members, group_rank_lookup
from prismllm.trace.graph import PrismTrace, TraceError
from prismllm.trace.ranklog import GroupInfo
from prismllm.trace.schema import ITERATION_SCHEMA, KIND_COMM, NODE_SCHEMA, REPLICAS_KEY

_ROOTED_OPS = ("broadcast", "reduce", "gather", "scatter")


class UnreplicableGroup(TraceError):
    """A group the representatives used that the renaming cannot give one of its members: that
    member is a replica, and no group of its representative is renamed onto this one, so it
    would never take part in the group's collectives. The renaming (a layout) and the
    program's own groups disagree."""

    def __init__(self, gid: int, members: list[int], replica: int, representative: int):
        self.gid, self.members, self.replica, self.representative = gid, members, replica, representative
        super().__init__(
            f"group {gid} ({format_ranks(members)}) cannot be given to rank {replica}, a replica of rank "
            f"{representative}: no group of rank {representative} is renamed onto it"
        )


def assemble_replicated(
    spool_dir: str | os.PathLike,
    manifest: dict[str, Any],
    *,
    replica_of: np.ndarray,
    map_of: np.ndarray,
    rename,
) -> PrismTrace:
    """Assemble a graph of all ranks from the logs of a few *representatives* (solo capture).

    ``replica_of[r]`` is the representative whose graph rank r takes (r itself for a
    representative, whose log must be in the spool; no other log is read). ``map_of[r]`` is
    the renaming that turns that representative into r (-1 for a representative) and
    ``rename(map_ids, ranks)`` applies renamings elementwise: a permutation of the world per
    map, with ``rename(map_of[r], replica_of[r]) == r`` (e.g. a shift of the DP coordinate).

    Groups are identified by their members, not their torch names (a representative knows only
    the groups it is a member of, and names need not agree across runs): key = (desc, sorted
    member set, ordinal among the rank's groups with that same desc and set, in creation
    order). Groups with one key are one group, whatever their names. A replica's group for a
    representative's group G under map m is the group whose key is (desc, rename(m, G), same
    ordinal): an existing one (e.g. the DP group, mapped onto itself) or a new one named
    ``<G's name>@<m>`` with members ``rename(m, G)`` in G's order.

    A replica's nodes are its representative's, with: ``group`` -> the replica's group;
    ``peer`` of send/recv -> ``rename(m, peer)``; the root of a rooted collective -> the member
    at the root's group-rank position in the replica's group (a root given as a group rank,
    the usual case, stays put in a group mapped onto itself); ``stream`` "comm:<gid>" follows
    the group; everything else (sizes, splits, times, iterations) unchanged. Edges are then
    derived over all ranks as :func:`assemble` does. Each rank's peak memory is its
    representative's. Fully columnar: an 8192-rank graph expands in seconds.
    """
    replica_of = np.asarray(replica_of, dtype=np.int64)
    map_of = np.asarray(map_of, dtype=np.int64)
    world_size = len(replica_of)
    if world_size < 1 or len(map_of) != world_size:
        raise TraceError("replica_of and map_of must give one entry per rank")
    reps = np.unique(replica_of)
    if np.any(replica_of[reps] != reps) or np.any(map_of[reps] != -1):
        raise TraceError("every representative must stand for itself (replica_of[r] == r, map_of[r] == -1)")
    spool = Path(spool_dir)
    if not spool.is_dir():
        raise TraceError(f"spool directory {spool} does not exist")
    paths = [(int(r), str(spool / f"rank-{int(r):06d}.msgpack")) for r in reps]
    missing = [r for r, p in paths if not os.path.exists(p)]
    if missing:
        raise TraceError(
            f"spool directory {spool} lacks the log of {rank_list(missing)} "
            f"(expected rank-{missing[0]:06d}.msgpack): that rank did not finish; see its output and re-run"
        )
    parts = read_parts(paths)
    sizes = sorted({p.world_size for p in parts})
    if sizes != [world_size]:
        raise TraceError(
            f"rank logs give world size {', '.join(map(str, sizes))}, expected {world_size}; they come from another run"
        )
    with gc_paused():
        parts = _canonical_group_names(parts)
        groups, name_to_gid = assemble_groups(parts)
        rep_nodes = assemble_nodes(parts, groups, name_to_gid, world_size)
        keys = _group_keys(parts, name_to_gid)
        all_groups, gmap = _replica_groups(groups, keys, np.unique(map_of[map_of >= 0]), rename)
        _check_replicable(rep_nodes, groups, gmap, replica_of, map_of)
        nodes = _expand_nodes(rep_nodes, groups, all_groups, gmap, replica_of, map_of, rename, world_size)
        edges = build_edges(nodes, all_groups, world_size)
        iterations = _expand_iterations(assemble_iterations(parts), replica_of)

    peak = {p.rank: p.peak_memory_bytes for p in parts}
    out = graph_manifest(
        manifest, parts, world_size, {str(r): peak[int(rep)] for r, rep in enumerate(replica_of.tolist())}
    )
    if len(reps) < world_size:
        out[REPLICAS_KEY] = {"representatives": len(reps), "copies": world_size - len(reps)}
    return PrismTrace(manifest=out, nodes=nodes, edges=edges, groups=all_groups, iterations=iterations)


def _set_key(desc: str, ranks) -> tuple[str, bytes]:
    return (str(desc), np.sort(np.asarray(ranks, dtype=np.int64)).tobytes())


def _rank_group_keys(groups: list[GroupInfo]) -> list[tuple[str, bytes, int]]:
    """Each group's key on one rank: (desc, member set, ordinal among equal (desc, set))."""
    seen: dict[tuple[str, bytes], int] = {}
    keys = []
    for g in groups:
        k = _set_key(g.desc, g.ranks)
        n = seen.get(k, 0)
        seen[k] = n + 1
        keys.append((k[0], k[1], n))
    return keys


def _canonical_group_names(parts: list[Part]) -> list[Part]:
    """Give every group one name on every rank: the name under which its key was first seen
    (ranks in order). A no-op when the producers' names already agree (torch's names do)."""
    key_name: dict[tuple, str] = {}
    name_key: dict[str, tuple] = {}
    out = []
    for p in parts:
        renames: dict[str, str] = {}
        new_groups = []
        for g, key in zip(p.groups, _rank_group_keys(p.groups)):
            name = key_name.get(key)
            if name is None:
                name = g.name
                n = 1
                while name in name_key:  # the name is already another group's: make it unique
                    name = f"{g.name}#{n}"
                    n += 1
                key_name[key] = name
                name_key[name] = key
            if name != g.name:
                renames[g.name] = name
            new_groups.append(GroupInfo(name=name, desc=g.desc, ranks=list(g.ranks)))
        if renames:
            gname = p.nodes.field("group_name")
            old = pa.array(list(renames), type=pa.string())
            new = pa.array(list(renames.values()), type=pa.string())
            idx = pc.index_in(gname, value_set=old)
            gname = pc.if_else(idx.is_null(), gname, pc.take(new, idx))
            fields = [p.nodes.field(f.name) if f.name != "group_name" else gname for f in LOG_FIELDS]
            nodes = pa.StructArray.from_arrays(fields, fields=LOG_FIELDS)
            p = dataclasses.replace(p, groups=new_groups, nodes=nodes)
        else:
            p = dataclasses.replace(p, groups=new_groups)
        out.append(p)
    return out


def _group_keys(parts: list[Part], name_to_gid: dict[str, int]) -> dict[int, tuple]:
    keys: dict[int, tuple] = {}
    for p in parts:
        for g, key in zip(p.groups, _rank_group_keys(p.groups)):
            keys.setdefault(name_to_gid[g.name], key)
    return keys


def _replica_groups(groups: pa.Table, keys: dict[int, tuple], maps: np.ndarray, rename):
    """The representatives' groups plus the images of each under each map. Returns the group
    table and ``gmap`` [max map + 1, representatives' groups] -> group id."""
    names = groups.column("name").to_pylist()
    descs = groups.column("desc").to_pylist()
    granks = [list(r) for r in groups.column("ranks").to_pylist()]
    n_rep = len(names)
    key_gid = {keys[g]: g for g in range(n_rep)}
    maps = np.asarray(maps, dtype=np.int64)
    gmap = np.tile(np.arange(n_rep, dtype=np.int64), (int(maps.max()) + 1 if len(maps) else 1, 1))
    for g in range(n_rep):
        if not len(maps):
            break
        members = np.asarray(granks[g], dtype=np.int64)
        # A group the generating renaming maps onto itself is its own image under every
        # renaming (they are its powers): a DP or world group of thousands of members would
        # otherwise be renamed once per replica for nothing (seconds at 8192 ranks).
        if np.array_equal(np.sort(rename(np.ones(len(members), dtype=np.int64), members)), np.sort(members)):
            continue
        desc, _, ordinal = keys[g]
        images = rename(np.repeat(maps, len(members)), np.tile(members, len(maps))).reshape(len(maps), len(members))
        sorted_images = np.sort(images, axis=1)
        for i, m in enumerate(maps.tolist()):
            key = (desc, sorted_images[i].tobytes(), ordinal)
            gid = key_gid.get(key)
            if gid is None:
                gid = len(names)
                key_gid[key] = gid
                names.append(f"{names[g]}@{m}")
                descs.append(descs[g])
                granks.append(images[i].tolist())
            gmap[m, g] = gid
    table = groups_table(names, descs, granks)
    return table, gmap


def _check_replicable(
    rep_nodes: pa.Table, groups: pa.Table, gmap: np.ndarray, replica_of: np.ndarray, map_of: np.ndarray
) -> None:
    """Raise :class:`UnreplicableGroup` for the first group the representatives call collectives
    on with a replica member that the renaming does not make a member: its map renames no
    group of the representatives onto it (``gmap``)."""
    n_rep = groups.num_rows
    renamed_onto = np.zeros((gmap.shape[0], n_rep), dtype=bool)  # [map, group]: some group is renamed onto it
    for m in range(gmap.shape[0]):
        renamed_onto[m, gmap[m][gmap[m] < n_rep]] = True
    comm = pc.equal(rep_nodes.column("kind"), KIND_COMM).to_numpy(zero_copy_only=False)
    used = np.unique(rep_nodes.column("group").to_numpy()[comm])
    granks = groups.column("ranks").to_pylist()
    for g in used[used >= 0].tolist():
        members = np.asarray(granks[g], dtype=np.int64)
        maps = map_of[members]
        lost = members[(maps >= 0) & ~renamed_onto[np.maximum(maps, 0), g]]
        if len(lost):
            r = int(lost[0])
            raise UnreplicableGroup(g, members.tolist(), r, int(replica_of[r]))


def _expand_nodes(
    rep_nodes: pa.Table,
    rep_groups: pa.Table,
    groups: pa.Table,
    gmap: np.ndarray,
    replica_of: np.ndarray,
    map_of: np.ndarray,
    rename,
    world_size: int,
) -> pa.Table:
    world = len(replica_of)
    rrank = rep_nodes.column("rank").to_numpy().astype(np.int64)
    n_rep_rows = len(rrank)
    if n_rep_rows:
        starts = np.flatnonzero(np.r_[True, rrank[1:] != rrank[:-1]])
        ranks_present = rrank[starts]
        counts_present = np.diff(np.r_[starts, n_rep_rows])
    else:
        starts = ranks_present = counts_present = np.zeros(0, dtype=np.int64)
    start_of = np.zeros(world, dtype=np.int64)
    count_of = np.zeros(world, dtype=np.int64)
    start_of[ranks_present] = starts
    count_of[ranks_present] = counts_present
    counts = count_of[replica_of]
    n = int(counts.sum())
    out_start = np.cumsum(counts) - counts
    src = np.arange(n, dtype=np.int64) + np.repeat(start_of[replica_of] - out_start, counts)
    if np.array_equal(replica_of, np.arange(world)) and n == n_rep_rows:
        return rep_nodes  # nothing to expand
    table = rep_nodes.take(pa.array(src))
    m_row = np.repeat(map_of, counts)
    is_rep_row = m_row < 0

    old_g = rep_nodes.column("group").to_numpy().astype(np.int64)[src]
    new_g = old_g.copy()
    sel = ~is_rep_row & (old_g >= 0)
    new_g[sel] = gmap[m_row[sel], old_g[sel]]

    op = table.column("op")
    is_comm = pc.equal(table.column("kind"), KIND_COMM).to_numpy(zero_copy_only=False)
    peer = table.column("peer").to_numpy().astype(np.int64)
    new_peer = peer.copy()
    is_p2p = pc.is_in(op, value_set=pa.array(["send", "recv"])).to_numpy(zero_copy_only=False) & is_comm
    sel_p = ~is_rep_row & is_p2p & (peer >= 0)
    if sel_p.any():
        new_peer[sel_p] = rename(m_row[sel_p], peer[sel_p])
    is_rooted = pc.is_in(op, value_set=pa.array(list(_ROOTED_OPS))).to_numpy(zero_copy_only=False) & is_comm
    sel_r = ~is_rep_row & is_rooted & (peer >= 0) & (old_g >= 0)
    if sel_r.any():
        pos = group_rank_lookup(rep_groups, world_size)(old_g[sel_r], peer[sel_r])
        _, lens, flat = group_members(groups)
        offs = np.cumsum(lens) - lens
        g2 = new_g[sel_r]
        ok = (pos >= 0) & (pos < lens[g2])
        mapped = np.where(ok, flat[offs[g2] + np.where(ok, pos, 0)], rename(m_row[sel_r], peer[sel_r]))
        new_peer[sel_r] = mapped
        # the root's bytes differ from the others': where the role changes, so do they
        out_rank = np.repeat(np.arange(world, dtype=np.int64), counts)[sel_r]
        was_root = peer[sel_r] == rrank[src[sel_r]]
        is_root = mapped == out_rank
        change = was_root != is_root
        if change.any():
            in_b = table.column("in_bytes").to_numpy().astype(np.int64).copy()
            out_b = table.column("out_bytes").to_numpy().astype(np.int64).copy()
            rows = np.flatnonzero(sel_r)[change]
            ops = np.asarray(op.take(pa.array(rows)).to_pylist(), dtype=object)
            root = is_root[change]
            size = lens[g2[change]]
            i0, o0 = in_b[rows], out_b[rows]
            x = np.maximum(i0, o0)
            ni, no = i0.copy(), o0.copy()
            b = ops == "broadcast"  # root sends the tensor, the others receive it
            ni[b], no[b] = np.where(root[b], x[b], 0), np.where(root[b], 0, x[b])
            r = ops == "reduce"  # only the root receives the result
            no[r] = np.where(root[r], i0[r], 0)
            g_ = ops == "gather"  # only the root receives size x input
            no[g_] = np.where(root[g_], i0[g_] * size[g_], 0)
            s_ = ops == "scatter"  # only the root sends size x output
            ni[s_] = np.where(root[s_], o0[s_] * size[s_], 0)
            in_b[rows], out_b[rows] = ni, no
            extra_cols = {"in_bytes": pa.array(in_b), "out_bytes": pa.array(out_b)}
        else:
            extra_cols = {}
    else:
        extra_cols = {}

    stream = table.column("stream")
    old_stream = pc.binary_join_element_wise("comm:", pc.cast(pa.array(old_g), pa.string()), "")
    follow = pc.and_(pa.array(new_g != old_g), pc.equal(stream, old_stream))
    new_stream = pc.if_else(
        follow, pc.binary_join_element_wise("comm:", pc.cast(pa.array(new_g), pa.string()), ""), stream
    )

    replace = {
        "node_id": pa.array(np.arange(n, dtype=np.int64)),
        "rank": pa.array(np.repeat(np.arange(world, dtype=np.int32), counts)),
        "group": pa.array(new_g.astype(np.int32)),
        "peer": pa.array(new_peer.astype(np.int32)),
        "stream": new_stream,
        **extra_cols,
    }
    for name, arr in replace.items():
        i = table.schema.get_field_index(name)
        table = table.set_column(i, NODE_SCHEMA.field(name), arr)
    return table.combine_chunks()


def _expand_iterations(rep_iters: pa.Table, replica_of: np.ndarray) -> pa.Table:
    world = len(replica_of)
    if not rep_iters.num_rows:
        return rep_iters
    rrank = rep_iters.column("rank").to_numpy().astype(np.int64)
    start_of = np.zeros(world, dtype=np.int64)
    count_of = np.zeros(world, dtype=np.int64)
    starts = np.flatnonzero(np.r_[True, rrank[1:] != rrank[:-1]])
    start_of[rrank[starts]] = starts
    count_of[rrank[starts]] = np.diff(np.r_[starts, len(rrank)])
    counts = count_of[replica_of]
    n = int(counts.sum())
    src = np.arange(n, dtype=np.int64) + np.repeat(start_of[replica_of] - (np.cumsum(counts) - counts), counts)
    t = rep_iters.take(pa.array(src))
    return t.set_column(
        0, ITERATION_SCHEMA.field("rank"), pa.array(np.repeat(np.arange(world, dtype=np.int32), counts))
    )
