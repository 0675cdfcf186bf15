"""A replay that leaves out the DP replicas' copies (prismllm.replay.mirror): a graph assembled
from its representatives (a solo capture's, a slice timing's) is the same program once per edp
coordinate; replaying the worlds that matter and one generic world gives every replayed rank
the times of the replay of all ranks, to the nanosecond."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from prismllm.layout import Layout, replica_plan
from prismllm.replay import ReplayGraph, solve
from prismllm.replay.graph import MirrorError
from prismllm.replay.mirror import mirror_plan
from prismllm.trace import validate
from prismllm.trace.graph import PrismTrace
from prismllm.trace.ranklog import write_ranklog
from prismllm.trace.replicate import assemble_replicated
from prismllm.trace.schema import REPLICAS_KEY
from prismllm.trace.synth import synthetic_logs

WORLD, TP, PP = 64, 2, 2  # 16 DP replicas of 4 representatives


def assembled(spool: Path, world: int, tp: int, pp: int, nodes: int = 60) -> PrismTrace:
    """The synthetic TP·PP·DP program's representatives' logs (durations of their own: each
    node's time depends on its rank), assembled as a solo capture assembles them."""
    layout = Layout.parse(f"tp={tp},pp={pp}", world)
    plan = replica_plan(layout)
    for log in synthetic_logs(world, nodes, tp=tp, pp=pp):
        if log.rank in plan.representatives:
            for k, node in enumerate(log.nodes):  # uneven durations, so that a wrong wait shows
                if node.get("kind") == "compute":
                    node["duration_ns"] = 1_000 * (1 + (k * 7 + log.rank * 13) % 11)
                    node["end_ns"] = node["start_ns"] + node["duration_ns"]
            write_ranklog(spool, log)
    manifest = {"mode": "solo", "command": ["train.py"], "layout": layout.to_dict()}
    return assemble_replicated(spool, manifest, replica_of=plan.replica_of, map_of=plan.map_of, rename=plan.rename)


@pytest.fixture(scope="module")
def replicated(tmp_path_factory):
    trace = assembled(tmp_path_factory.mktemp("spool"), WORLD, TP, PP)
    validate(trace)
    return trace


def test_the_worlds_kept_and_the_rest_moved_with_the_generic_one(replicated):
    assert replicated.manifest[REPLICAS_KEY] == {"representatives": 4, "copies": 60}
    mirror = mirror_plan(replicated, keep=[WORLD - 1])
    edp = Layout.parse(f"tp={TP},pp={PP}", WORLD).coords_array()["dp"]
    played = np.flatnonzero(mirror < 0)
    assert sorted(set(edp[played].tolist())) == [0, 15]  # the generic world (the first free) and rank 63's
    left = np.flatnonzero(mirror >= 0)
    assert len(left) == WORLD - 8 and np.all(edp[mirror[left]] == 0)
    assert np.array_equal(mirror[left] % (TP * 16), left % TP)  # same tp (and pp) coordinates
    assert mirror_plan(replicated, keep=range(WORLD - 4, WORLD)) is not None
    assert mirror_plan(replicated, keep=range(0, WORLD, TP)) is None  # every world holds a kept rank
    assert mirror_plan(replicated, keep=[WORLD]) is None  # a rank outside: the caller refuses it


def test_a_solve_of_the_played_worlds_gives_the_solve_of_every_rank(replicated):
    full = solve(replicated, validate_graph=False)
    mirror = mirror_plan(replicated, keep=[5, WORLD - 1])
    part = solve(replicated, validate_graph=False, mirror=mirror)
    assert part.graph.num_nodes < full.graph.num_nodes / 4
    assert part.result.predicted_iteration_ns == full.result.predicted_iteration_ns is not None
    assert np.array_equal(part.result.iteration_ns, full.result.iteration_ns)
    for r in part.graph.ranks.tolist():
        for a, b in zip(part.result.node_times(r), full.result.node_times(r)):
            assert np.array_equal(a, b), r
    # and a rank left out ran as its image did
    r = int(np.flatnonzero(mirror >= 0)[0])
    for a, b in zip(full.result.node_times(r), full.result.node_times(int(mirror[r]))):
        assert np.array_equal(a, b)
    assert part.replicas_copied and full.replicas_copied


def test_nothing_is_left_out_of_a_graph_whose_replicas_are_not_copies(replicated):
    """A recording, a slice timing of every rank, or a program's group across a few replicas."""
    unmarked = {k: v for k, v in replicated.manifest.items() if k != REPLICAS_KEY}
    assert mirror_plan(dataclasses.replace(replicated, manifest=unmarked)) is None
    g = replicated.groups
    across = pa.table(
        {
            c: pa.array([v], g.schema.field(c).type)
            for c, v in (("group_id", g.num_rows), ("name", "pair"), ("desc", "pair"), ("ranks", [0, TP]))
        }  # rank 0 and its first replica  # fmt: skip
    )
    uneven = dataclasses.replace(replicated, groups=pa.concat_tables([g, across.select(g.schema.names)]))
    assert mirror_plan(uneven) is None


def test_a_copy_whose_group_lacks_its_image_is_refused(replicated):
    mirror = np.full(WORLD, -1, dtype=np.int64)
    mirror[TP * 3] = TP * 16  # a replica of rank 0 given rank 32 (another pipeline stage) as its image
    with pytest.raises(MirrorError, match="cannot be left out"):
        ReplayGraph(replicated, mirror=mirror)


def test_a_reader_of_a_few_ranks_reads_their_nodes_alone(replicated, tmp_path):
    """What an assistant reads: the played ranks' nodes (no edges), from which the replay is the
    one of the whole graph with the copies left out; such a graph is not saved."""
    from prismllm.errors import PrismError
    from prismllm.trace.worlds import plan_of

    path = replicated.save(tmp_path / "g")
    part = PrismTrace.load(path, ranks=lambda m, g: np.flatnonzero(plan_of(m, g, [WORLD - 1]) < 0))
    mirror = mirror_plan(replicated, keep=[WORLD - 1])
    assert part.partial and part.edges.num_rows == 0
    assert sorted(set(part.column("rank").tolist())) == np.flatnonzero(mirror < 0).tolist()
    assert part.iterations.num_rows == 8 * 2
    a = solve(part, validate_graph=False, mirror=mirror_plan(part, keep=[WORLD - 1]))
    b = solve(replicated, validate_graph=False, mirror=mirror)
    assert np.array_equal(a.result.start_ns, b.result.start_ns) and np.array_equal(a.result.end_ns, b.result.end_ns)
    with pytest.raises(PrismError, match="cannot be saved"):
        part.save(tmp_path / "h")
    assert not PrismTrace.load(path, ranks=lambda m, g: None).partial


def test_a_calibration_keeps_the_mark_unless_its_durations_were_changed(replicated):
    """The calibrated graph of a graph of copies is one too (a replay of equal durations gives
    equal times), but not after `prism whatif` changed some ranks' durations."""
    from prismllm.calibrate.report import calibrated_trace

    assert REPLICAS_KEY in calibrated_trace(solve(replicated, validate_graph=False)).manifest
    changed = solve(replicated, validate_graph=False, adjust=lambda g, d: None)
    assert not changed.replicas_copied and REPLICAS_KEY not in calibrated_trace(changed).manifest


def _marked_and_plain(out: Path, world: int, tp: int, pp: int) -> tuple[Path, Path]:
    """The program at ``world`` ranks saved twice: as captured (its replicas marked as copies)
    and unmarked (every rank solved)."""
    (out / "spool").mkdir()
    trace = assembled(out / "spool", world, tp, pp, nodes=40)
    unmarked = {k: v for k, v in trace.manifest.items() if k != REPLICAS_KEY}
    return trace.save(out / "marked"), dataclasses.replace(trace, manifest=unmarked).save(out / "plain")


@pytest.mark.parametrize("world, tp, pp", [(1024, 8, 4), (8192, 8, 8)])
def test_calibrate_solves_one_world_for_all_and_says_what_the_rank_by_rank_solve_says(tmp_path, world, tp, pp):
    """`prism calibrate` of a graph whose replicas are copies replays one world (tp·pp ranks) and
    gives every rank its image's times: the summary (prediction, critical path, per-rank figures,
    node and instance counts), the per-node table and the calibrated graph equal the solve of
    every rank, to the nanosecond."""
    import pyarrow.parquet as pq

    from prismllm.calibrate import calibrate

    marked, plain = _marked_and_plain(tmp_path, world, tp, pp)
    a = calibrate(marked, tmp_path / "a", write_graph=True)
    b = calibrate(plain, tmp_path / "b", write_graph=True)
    assert a["replayed"]["ranks"] == tp * pp and "replayed" not in b
    assert a["predicted_iteration_ns"] == b["predicted_iteration_ns"] is not None
    skip = {"replayed", "solve", "graph"}
    assert {k: v for k, v in a.items() if k not in skip} == {k: v for k, v in b.items() if k not in skip}
    assert pq.read_table(tmp_path / "a" / "calibrated.parquet").equals(
        pq.read_table(tmp_path / "b" / "calibrated.parquet")
    )
    ga, gb = PrismTrace.load(tmp_path / "a" / "graph"), PrismTrace.load(tmp_path / "b" / "graph")
    assert ga.nodes.equals(gb.nodes) and ga.iterations.equals(gb.iterations)
    assert REPLICAS_KEY in ga.manifest and REPLICAS_KEY not in gb.manifest


def _planted(trace: PrismTrace, column: str, index: int, value: int, ranks=None) -> PrismTrace:
    """``trace`` with ``column`` of node ``index`` set to ``value`` on ``ranks`` (default: rank
    0 and its copies, the one change a graph of copies can carry)."""
    nodes = trace.nodes
    if ranks is None:
        ranks = np.flatnonzero(replica_plan(Layout.parse(f"tp={TP},pp={PP}", WORLD)).replica_of == 0)
    values = nodes.column(column).to_numpy(zero_copy_only=False).copy()
    rows = np.isin(nodes.column("rank").to_numpy(), ranks) & (nodes.column("index").to_numpy() == index)
    values[rows] = value
    col = pa.array(values, nodes.schema.field(column).type)
    return dataclasses.replace(trace, nodes=nodes.set_column(nodes.schema.get_field_index(column), column, col))


def _unmarked(trace: PrismTrace) -> PrismTrace:
    return dataclasses.replace(trace, manifest={k: v for k, v in trace.manifest.items() if k != REPLICAS_KEY})


def test_a_graph_of_copies_is_checked_over_one_world(replicated):
    """validate reads one world of a graph of copies: its nodes, and the edges the assembly
    derives between them, a collective over a group across worlds joining the world's members."""
    from prismllm.trace.worlds import one_world

    world, ranks = one_world(replicated)
    edp = Layout.parse(f"tp={TP},pp={PP}", WORLD).coords_array()["dp"]
    assert ranks.tolist() == np.flatnonzero(edp == 0).tolist() == sorted(set(world.column("rank").tolist()))
    assert world.nodes.num_rows == replicated.nodes.num_rows * TP * PP // WORLD
    ids = set(world.column("node_id").tolist())
    edges = lambda t: set(zip(*(t.edges.column(c).to_pylist() for c in ("src", "dst", "kind"))))  # noqa: E731
    within = {e for e in edges(replicated) if e[0] in ids and e[1] in ids}
    assert within and within <= edges(world)
    assert all(e[2] == "sync" for e in edges(world) - within)
    assert one_world(_unmarked(replicated)) is None
    # one world is all it reads: a change to a copy alone, which no writer makes (and the files'
    # checksums refuse after), is not seen
    copy_changed = _planted(replicated, "in_bytes", 1, 3, ranks=[TP])  # rank 2, of world 1
    validate(copy_changed)
    with pytest.raises(Exception, match="rank 2 node 1 passes 3;"):
        validate(_unmarked(copy_changed))


@pytest.mark.parametrize(
    "column, index, value, message",
    [("in_bytes", 1, 3, "rank 0 node 1 passes 3;"), ("wait_index", 1, 10**6, "has wait_index 1000000")],
)
def test_a_problem_of_the_program_is_found_in_one_world_as_over_every_rank(replicated, column, index, value, message):
    bad = _planted(replicated, column, index, value)
    with pytest.raises(Exception, match=message) as one:
        validate(bad)
    with pytest.raises(Exception, match=message) as every:
        validate(_unmarked(bad))
    assert str(one.value) == str(every.value)


def test_a_send_across_worlds_is_checked_over_every_rank(replicated):
    """A pair the world cannot hold (a send to a rank of another world): every rank is read."""
    from prismllm.trace.worlds import one_world

    nodes = replicated.nodes
    sends = (nodes.column("op").to_numpy(zero_copy_only=False) == "send") & (nodes.column("rank").to_numpy() == 0)
    first = int(nodes.column("index").to_numpy()[np.flatnonzero(sends)[0]])
    bad = _planted(replicated, "peer", first, TP, ranks=[0])  # rank 2: the next world's
    assert one_world(bad) is None
    with pytest.raises(Exception, match="has no matching recv on rank 2"):
        validate(bad)
