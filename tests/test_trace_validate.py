"""PrismTrace validation: each failure gives one message naming rank, node, op and group."""

from __future__ import annotations

import copy

import pyarrow as pa
import pytest

from prismllm.trace import TraceError, assemble, validate
from prismllm.trace.ranklog import GroupInfo, RankLog
from prismllm.trace.synth import example_logs


def build(logs):
    return assemble(logs, {"mode": "record"})


def check(logs, pattern):
    with pytest.raises(TraceError, match=pattern) as e:
        validate(build(logs))
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def drop(log: RankLog, index: int) -> None:
    """Remove node ``index`` from a rank log and renumber (wait points follow)."""
    del log.nodes[index]
    for n in log.nodes:
        if n["index"] > index:
            n["index"] -= 1
        if n.get("wait_index", -1) > index:
            n["wait_index"] -= 1


@pytest.fixture
def logs():
    return example_logs()


def test_example_is_valid(logs):
    validate(build(logs))


def test_mismatched_bytes(logs):
    logs[1].nodes[2]["in_bytes"] = 2048
    msg = check(logs, r"rank 1 node 2 passes 2048 bytes but rank 0 node 2 passes 4096")
    assert "all_reduce #0 on group 1 ('tp0', ranks 0-1)" in msg


def test_all_gather_output_size(logs):
    logs[2].nodes[7]["out_bytes"] = 1024
    check(
        logs,
        r"rank 2 node 7 \(all_gather, group 0 \('default_pg', ranks 0-3\)\): all_gather output is 1024 bytes, "
        r"but input 1024 bytes x group size 4 = 4096",
    )


def test_reduce_scatter_sizes(logs):
    logs[3].nodes[8]["out_bytes"] = 2048
    check(
        logs,
        r"rank 3 node 8 \(reduce_scatter, .*\): reduce_scatter input is 4096 bytes, but output 2048 bytes x group size 4",
    )


def test_all_to_all_splits(logs):
    logs[1].nodes[9]["out_splits"] = [2, 4, 5, 6]  # rank 0 sends 1+0+2 = 3 rows to rank 1
    check(
        logs,
        r"all_to_all #2 on group 0 .*: rank 0 node 9 sends 3 rows to rank 1 \(in_splits\[1\]\) but "
        r"rank 1 node 9 expects 2 rows from rank 0 \(out_splits\[0\]\)",
    )


def test_all_to_all_totals(logs):
    logs[1].nodes[9]["out_bytes"] += 64
    check(logs, r"all_to_all #2 on group 0 .*: its members send \d+ bytes in total but receive \d+")


def test_op_disagreement(logs):
    logs[3].nodes[8]["op"] = "all_reduce"
    logs[3].nodes[8]["out_bytes"] = 4096
    check(
        logs,
        r"collective #1 on group 0 .*: rank 0 node 8 is reduce_scatter but rank 3 node 8 is all_reduce; "
        r"every member of a group must issue the same collectives in the same order",
    )


def test_reduce_op_and_root_disagreement(logs):
    bad = copy.deepcopy(logs)
    bad[0].nodes[2]["reduce_op"] = "max"
    check(bad, r"rank 0 node 2 reduces with 'max' but rank 1 node 2 with 'sum'")
    for r in range(4):
        logs[r].nodes[7].update(op="broadcast", peer=0 if r != 2 else 1, out_bytes=1024)
    check(logs, r"broadcast #0 on group 0 .*: rank 0 node 7 uses root 0 but rank 2 node 7 uses root 1")


def test_missing_member(logs):
    drop(logs[1], 13)  # rank 1 skips its second tp all_reduce
    msg = check(
        logs,
        r"collective all_reduce #1 on group 1 \('tp0', ranks 0-1\) is missing rank 1: rank 1 issued 1 "
        r"collectives on this group, rank 0 issued 2",
    )
    assert "same order" in msg


def test_unmatched_send(logs):
    drop(logs[2], 21)  # rank 2 never posts its second recv from rank 0
    check(
        logs,
        r"rank 0 node 21 \(send, to rank 2, group 0 .*\) \(2048 bytes\) has no matching recv on rank 2: "
        r"rank 0 posts 2 send\(s\) to rank 2 on this group, rank 2 posts 1 recv\(s\) from rank 0",
    )


def test_unmatched_recv(logs):
    logs[1].nodes[10]["peer"] = 2  # rank 1 sends to rank 2, which does not expect it
    msg = check(logs, r"has no matching")
    assert "rank 1 node 10 (send, to rank 2" in msg or "rank 3 node 10 (recv, from rank 1" in msg


def test_p2p_bytes(logs):
    logs[3].nodes[21]["out_bytes"] = 4096
    check(
        logs,
        r"rank 1 node 21 \(send, to rank 3, .*\) sends 2048 bytes but its matching recv, rank 3 node 21, receives 4096",
    )


def test_wait_index(logs):
    bad = copy.deepcopy(logs)
    bad[2].nodes[4]["wait_index"] = 99
    check(
        bad,
        r"rank 2 node 4 \(all_reduce, group 3 \('dp0', ranks 0,2\)\) has wait_index 99, out of range "
        r"\(rank 2 has 23 nodes, 0..22\)",
    )
    logs[2].nodes[4]["wait_index"] = 3
    check(logs, r"rank 2 node 4 \(all_reduce, group 3 .*\) has wait_index 3, not after the node")


def test_not_a_member(logs):
    logs[2].nodes[2]["group_name"] = "tp0"
    logs[3].nodes[2]["group_name"] = "tp0"
    check(logs, r"rank 2 node 2 \(all_reduce, group 1 \('tp0', ranks 0-1\)\): rank 2 is not a member of that group")


def test_duplicate_node_ids_and_dangling_edges(logs):
    t = build(logs)
    ids = t.nodes.column("node_id").to_pylist()
    ids[5] = 4
    bad = copy.copy(t)
    bad.nodes = t.nodes.set_column(0, "node_id", pa.array(ids, pa.int64()))
    bad.__post_init__()
    with pytest.raises(TraceError, match=r"node id 4 is used twice \(rank 0 node 4 .* and rank 0 node 5 \(compute\)\)"):
        validate(bad)
    bad = copy.copy(t)
    extra = pa.table({"src": pa.array([3], pa.int64()), "dst": pa.array([10**6], pa.int64()), "kind": ["order"]})
    bad.edges = pa.concat_tables([t.edges, extra])
    bad.__post_init__()
    with pytest.raises(
        TraceError, match=r"edge \d+ \(order: node 3 -> node 1000000\) references node 1000000, which does not exist"
    ):
        validate(bad)


@pytest.mark.parametrize(
    "column, value", [("peer", 1), ("seq", 0), ("dtype", "float16"), ("async_op", True), ("shape", [1]), ("tag", 3)]
)
def test_a_compute_span_carries_no_communication_field(logs, column, value):
    """A value no writer puts in a compute span (a graph edited after it was written): refused,
    where the replay would ignore it and a comparison of two graphs would not see it."""
    t = build(logs)
    row = t.nodes.column("kind").to_pylist().index("compute")
    values = t.nodes.column(column).to_pylist()
    values[row] = value
    i = t.nodes.schema.get_field_index(column)
    bad = copy.copy(t)
    bad.nodes = t.nodes.set_column(i, t.nodes.schema.field(i), pa.array(values, t.nodes.schema.field(i).type))
    bad.__post_init__()
    with pytest.raises(TraceError, match=rf"is a compute span with {column} = .*carries no communication fields"):
        validate(bad)


def test_a_group_stored_twice_is_refused(logs):
    t = build(logs)
    bad = copy.copy(t)
    bad.groups = pa.concat_tables([t.groups, t.groups.slice(0, 1)])
    bad.__post_init__()
    with pytest.raises(TraceError, match=r"groups.parquet lists group \d+ more than once"):
        validate(bad)


# ---------------------------------------------------------------------- deadlocks
def two_ranks(prog0, prog1, groups=None):
    groups = groups or [GroupInfo("0", "default_pg", [0, 1])]
    out = []
    for r, prog in enumerate((prog0, prog1)):
        nodes = [{"index": 0, "op": "compute"}]
        for kw in prog:
            kw = dict(kw)
            kw.setdefault("group_name", "0")
            nodes.append({"index": len(nodes), **kw})
            nodes.append({"index": len(nodes), "op": "compute"})
        out.append(RankLog(r, 2, "cpu", "host", nodes, groups, []))
    return out


def test_cycle_recv_before_send():
    send = lambda p: {"op": "send", "peer": p, "in_bytes": 64}  # noqa: E731
    recv = lambda p: {"op": "recv", "peer": p, "out_bytes": 64}  # noqa: E731
    logs = two_ranks([recv(1), send(1)], [recv(0), send(0)])
    msg = check(
        logs,
        r"^deadlock: rank 0 node 1 \(recv, from rank 1, group 0 \('default_pg', ranks 0-1\)\), "
        r"which waits for rank 1 node 3 \(send\), which rank 1 issues only after rank 1 node 1 "
        r"\(recv, from rank 0, .*\) completes, which waits for rank 0 node 3 \(send\)",
    )
    assert "batch_isend_irecv" in msg


def test_cycle_collective_order():
    groups = [GroupInfo("a", "ga", [0, 1]), GroupInfo("b", "gb", [0, 1])]
    ar = lambda g: {"op": "all_reduce", "group_name": g, "in_bytes": 8, "out_bytes": 8}  # noqa: E731
    logs = two_ranks([ar("a"), ar("b")], [ar("b"), ar("a")], groups)
    msg = check(logs, r"deadlock")
    assert "all_reduce" in msg and "'ga'" in msg and "'gb'" in msg


def test_no_false_cycle_for_async_or_coalesced_p2p():
    # both ranks: isend, irecv (async), wait on both at the next node: fine
    s = lambda p: {"op": "send", "peer": p, "in_bytes": 64, "async_op": True, "wait_index": 4}  # noqa: E731
    r = lambda p: {"op": "recv", "peer": p, "out_bytes": 64, "async_op": True, "wait_index": 4}  # noqa: E731
    validate(build(two_ranks([s(1), r(1)], [s(0), r(0)])))
    # blocking but coalesced into one batch (batch_isend_irecv + immediate wait): fine
    logs = []
    for rk in range(2):
        p = 1 - rk
        nodes = [
            {"index": 0, "op": "compute"},
            {"index": 1, "op": "send", "group_name": "0", "peer": p, "in_bytes": 64, "coalesced": 0},
            {"index": 2, "op": "recv", "group_name": "0", "peer": p, "out_bytes": 64, "coalesced": 0},
            {"index": 3, "op": "compute"},
        ]
        logs.append(RankLog(rk, 2, "cpu", "host", nodes, [GroupInfo("0", "w", [0, 1])], []))
    validate(build(logs))
    # the same without the batch deadlocks (both send first, blocking)
    for log in logs:
        for n in log.nodes:
            n.pop("coalesced", None)
    check(logs, r"deadlock")


def test_async_wait_cycle():
    # rank 0 waits for its async recv before it sends; rank 1 does the same: deadlock via the wait
    r = lambda p: {"op": "recv", "peer": p, "out_bytes": 64, "async_op": True, "wait_index": 3}  # noqa: E731
    s = lambda p: {"op": "send", "peer": p, "in_bytes": 64}  # noqa: E731
    msg = check(two_ranks([r(1), s(1)], [r(0), s(0)]), r"deadlock")
    assert "recv" in msg and "send" in msg


def test_recv_from_any_source():
    send = {"op": "send", "peer": 1, "in_bytes": 64}
    logs = two_ranks(
        [send, send, send],
        [
            {"op": "recv", "peer": 0, "out_bytes": 64, "seq": 0},
            {"op": "recv", "peer": 0, "out_bytes": 64, "seq": -1, "api": "recv_anysource"},  # source fixed later
            {"op": "recv", "peer": 0, "out_bytes": 64, "seq": 1},  # the producer's counter skipped it
        ],
    )
    t = build(logs)
    validate(t)
    assert [x["seq"] for x in t.nodes_of(1).to_pylist() if x["op"] == "recv"] == [0, 1, 2]
    logs[1].nodes[3]["peer"] = -1  # never waited on: source unknown
    check(logs, r"rank 1 node 3 \(recv, group 0 .*\) is a recv from any source whose source rank was never recorded")


def test_broadcast_root_contributes_others_receive(logs):
    for r in range(4):  # as the recorder writes it: in_bytes on the root, out_bytes elsewhere
        logs[r].nodes[7].update(op="broadcast", peer=0, in_bytes=1024 if r == 0 else 0, out_bytes=0 if r == 0 else 1024)
    validate(build(logs))
    logs[3].nodes[7]["out_bytes"] = 512
    check(
        logs,
        r"broadcast #0 on group 0 .*: rank 3 node 7 broadcasts a tensor of 512 bytes but rank 0 node 7 one of 1024",
    )
