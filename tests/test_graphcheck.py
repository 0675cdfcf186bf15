"""GraphExpectation / GraphDeviation (prismllm.comm.graphcheck): what a graph says one rank
issues, and one clear line when the program issues something else.

Against a real graph: tests/programs/collectives.py recorded with 4 ranks on CPU (every
collective op, sub-groups, send/recv with several peers, rooted ops, coalesced calls). Every
recorded call of every rank passes its check; each kind of deviation (other op, other size,
other root, a call beyond the graph's last on a group, another group) raises one line naming
the rank, the call and the fix. Building the expectation for one rank of a 1024-rank graph of
a million nodes reads only that rank's calls and takes well under a second.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from conftest import COLLECTIVES

from prismllm.comm.graphcheck import GraphDeviation, GraphExpectation
from prismllm.errors import PrismError
from prismllm.trace import PrismTrace
from prismllm.trace.schema import EDGE_SCHEMA, ITERATION_SCHEMA, P2P_OPS

FIX = (
    "The program or its arguments differ from the captured run: capture the graph again with the same "
    "command as this run (`prism record` / `prism capture`), or run the command the graph was captured "
    "with (`" + COLLECTIVES + "`)"
)


@pytest.fixture(scope="module")
def graph(collectives_native) -> Path:
    """The session's 4-rank recording of collectives.py (conftest.collectives_native)."""
    return collectives_native[0]


def comm_rows(graph: Path, rank: int) -> list[dict]:
    t = PrismTrace.load(graph)
    names = {gid: g["name"] for gid, g in t.group_info().items()}
    rows = t.nodes_of(rank).select(["kind", "op", "group", "seq", "peer", "in_bytes", "out_bytes"]).to_pylist()
    return [{**r, "group": names[r["group"]]} for r in rows if r["kind"] == "comm"]


def deviation(e: GraphExpectation, *args) -> str:
    with pytest.raises(GraphDeviation) as info:
        e.check(*args)
    msg = str(info.value)
    assert "\n" not in msg and msg.endswith(FIX), msg
    return msg[: -len(FIX) - 2]  # without ". " + the fix


def test_every_recorded_call_passes(graph):
    """The program as recorded: every call of every rank is what the graph has, with its
    rooted ops' roots (P2P keyed by peer and the index among calls to that peer)."""
    for rank in range(4):
        e = GraphExpectation(graph, rank)
        rows = comm_rows(graph, rank)
        assert {r["op"] for r in rows} >= {"all_reduce", "broadcast", "send", "recv", "all_to_all", "barrier"}
        for r in rows:
            e.check(r["group"], r["op"], r["seq"], r["in_bytes"], r["out_bytes"], r["peer"])
        for r in rows:  # collectives without their root: also fine
            if r["op"] not in P2P_OPS:
                e.check(r["group"], r["op"], r["seq"], r["in_bytes"], r["out_bytes"])


def test_other_op_size_or_root_is_one_clear_line(graph):
    e = GraphExpectation(graph, 1)
    head = "rank 1 deviates from its graph at "
    assert deviation(e, "0", "all_gather", 0, 16, 64) == (
        head + "all_gather #0 on group 0 (default_pg) [0, 1, 2, 3]: the program issued all_gather of 16 bytes in, "
        "64 bytes out, the graph has all_reduce of 16 bytes (float32 [4], iteration 0)"
    )
    assert deviation(e, "0", "all_reduce", 0, 32, 32) == (
        head + "all_reduce #0 on group 0 (default_pg) [0, 1, 2, 3]: the program issued all_reduce of 32 bytes, "
        "the graph has all_reduce of 16 bytes (float32 [4], iteration 0)"
    )
    # collectives.py: broadcast #11 on the default group from root 2
    assert deviation(e, "0", "broadcast", 11, 0, 20, 0) == (
        head + "broadcast #11 on group 0 (default_pg) [0, 1, 2, 3]: the program issued broadcast of 0 bytes in, "
        "20 bytes out from root 0, the graph has broadcast of 0 bytes in, 20 bytes out from root 2 "
        "(float32 [5], iteration 0)"
    )
    # the first recv from rank 0 carries 3 floats
    assert deviation(e, "0", "recv", 0, 0, 16, 0) == (
        head + "recv #0 from rank 0 on group 0 (default_pg) [0, 1, 2, 3]: the program issued recv of 16 bytes, "
        "the graph has recv of 12 bytes (float32 [3], iteration 0)"
    )


def test_a_call_beyond_the_graph_is_a_deviation(graph):
    e = GraphExpectation(graph, 1)
    rows = comm_rows(graph, 1)
    n = sum(1 for r in rows if r["group"] == "0" and r["op"] not in P2P_OPS)
    sends = sum(1 for r in rows if r["group"] == "0" and r["op"] == "send" and r["peer"] == 2)
    assert n > 20 and sends == 3
    assert deviation(e, "0", "all_reduce", n, 4, 4) == (
        f"rank 1 deviates from its graph at all_reduce #{n} on group 0 (default_pg) [0, 1, 2, 3]: the program "
        f"issued all_reduce of 4 bytes, the graph has no more collectives on this group (it has {n})"
    )
    assert deviation(e, "0", "send", 3, 12, 0, 2).endswith(
        "send #3 to rank 2 on group 0 (default_pg) [0, 1, 2, 3]: the program issued send of 12 bytes, the graph "
        "has no more sends to rank 2 on this group (it has 3)"
    )
    # rank 1 never sends to rank 0 on the default group: the peer is part of the key
    assert deviation(e, "0", "send", 0, 12, 0, 0).endswith(
        "the graph has no more sends to rank 0 on this group (it has 0)"
    )


def test_another_group_is_a_deviation(graph):
    e = GraphExpectation(graph, 1)
    # group "1" is new_group([0, 2]): rank 1 is not in it
    assert deviation(e, "1", "all_reduce", 0, 4, 4) == (
        "rank 1 deviates from its graph at all_reduce #0 on group 1: the program issued all_reduce of 4 bytes, "
        "the graph does not have rank 1 in it"
    )
    assert deviation(e, "7", "barrier", 0, 0, 0).endswith("the graph has no such group")


def test_unreadable_graph_or_rank_outside_it(graph, tmp_path):
    with pytest.raises(PrismError, match="re-record the graph"):
        GraphExpectation(tmp_path, 0)
    with pytest.raises(PrismError, match="rank 4 is not in its world of 4 ranks"):
        GraphExpectation(graph, 4)


def test_building_one_rank_of_a_large_graph_is_fast(tmp_path):
    """1024 ranks x 1024 calls (and as many compute spans): 2M nodes. One rank's expectation
    reads only its rows (a filtered read, array operations, no loop over nodes)."""
    R, C = 1024, 1024
    index = np.tile(np.arange(2 * C, dtype=np.int32), R)
    comm = index % 2 == 1
    k = index // 2
    nbytes = np.where(comm, 4096 + 8 * (k % 7), 0).astype(np.int64)
    nodes = pa.table(
        {
            "node_id": np.arange(len(index), dtype=np.int64),
            "rank": np.repeat(np.arange(R, dtype=np.int32), 2 * C),
            "index": index,
            "kind": np.where(comm, "comm", "compute"),
            "op": np.where(comm, np.where(k % 4 == 3, "all_gather", "all_reduce"), "compute"),
            "group": np.where(comm, 0, -1).astype(np.int32),
            "seq": np.where(comm, k, -1).astype(np.int64),
            "in_bytes": nbytes,
            "out_bytes": nbytes,
        }
    )
    groups = pa.table(
        {
            "group_id": pa.array([0], pa.int32()),
            "name": ["0"],
            "desc": ["default_pg"],
            "ranks": pa.array([list(range(R))], pa.list_(pa.int32())),
        }
    )
    PrismTrace(
        {"world_size": R, "command": ["big.py"]},
        nodes,
        EDGE_SCHEMA.empty_table(),
        groups,
        ITERATION_SCHEMA.empty_table(),
    ).save(tmp_path / "big")
    t0 = time.perf_counter()
    e = GraphExpectation(tmp_path / "big", 517)
    took = time.perf_counter() - t0
    assert took < 1.0, took
    assert len(e) == C  # only rank 517's calls were kept
    e.check("0", "all_gather", 3, 4096 + 8 * 3, 4096 + 8 * 3)
    with pytest.raises(
        GraphDeviation,
        match=r"rank 517 deviates .* the graph has no more collectives on this "
        r"group \(it has 1024\)",
    ):
        e.check("0", "all_reduce", C, 4096, 4096)
