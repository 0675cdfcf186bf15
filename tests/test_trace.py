"""PrismTrace: assembly, edges, save/load round trip, load errors."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from prismllm.errors import ExitCode, PrismError
from prismllm.trace import PrismTrace, TraceError, assemble, assemble_spool, validate
from prismllm.trace.ranklog import GroupInfo, RankLog, ranklog_path, write_ranklog
from prismllm.trace.schema import EDGE_SCHEMA, FORMAT_VERSION, NODE_SCHEMA
from prismllm.trace.synth import STEP_NS, example_logs, synthetic_logs

MANIFEST = {"mode": "record", "command": ["python", "train.py", "--tp", "2"]}


def nid(rank: int, index: int, per_rank: int) -> int:
    return rank * per_rank + index


@pytest.fixture
def logs():
    return example_logs()


@pytest.fixture
def trace(logs):
    return assemble(logs, MANIFEST)


# ---------------------------------------------------------------------- assembly
def test_manifest_and_groups(trace):
    m = trace.manifest
    assert m["format"] == "prismtrace" and m["format_version"] == FORMAT_VERSION
    assert m["world_size"] == 4 and trace.world_size == 4
    assert m["mode"] == "record" and m["command"] == MANIFEST["command"]
    assert m["device"] == "cpu" and m["clock"] == "host"
    assert m["peak_memory_bytes"] == {str(r): (1 << 30) + r * 1024 for r in range(4)}
    g = trace.groups.to_pydict()
    assert g["group_id"] == [0, 1, 2, 3, 4]
    assert g["name"] == ["0", "tp0", "tp1", "dp0", "dp1"]
    assert g["ranks"] == [[0, 1, 2, 3], [0, 1], [2, 3], [0, 2], [1, 3]]
    assert list(trace.ranks()) == [0, 1, 2, 3]


def test_nodes_columns(trace):
    n = trace.nodes
    assert n.schema.equals(NODE_SCHEMA)
    per_rank = 1 + 2 * 11
    assert n.num_rows == 4 * per_rank
    assert n.column("node_id").to_pylist() == list(range(4 * per_rank))
    assert n.column("rank").to_pylist() == [r for r in range(4) for _ in range(per_rank)]
    assert n.column("index").to_pylist() == list(range(per_rank)) * 4
    r1 = trace.nodes_of(1).to_pylist()
    assert [x["index"] for x in r1] == list(range(per_rank))
    ar = r1[2]
    assert (ar["op"], ar["kind"], ar["group"], ar["seq"], ar["stream"]) == ("all_reduce", "comm", 1, 0, "comm:1")
    assert ar["in_bytes"] == 4096 and ar["dtype"] == "float32" and ar["shape"] == [32, 32]
    # defaults filled
    c = r1[0]
    assert (c["op"], c["kind"], c["group"], c["seq"], c["stream"], c["tag"], c["in_splits"], c["label"]) == (
        "compute",
        "compute",
        -1,
        -1,
        "compute",
        0,
        [],
        "setup",
    )
    # seq: per (rank, group) for collectives -> second tp all_reduce is #1; world group #0..2
    assert [x["seq"] for x in r1 if x["group"] == 0 and x["op"] not in ("send", "recv")] == [0, 1, 2, 3, 4, 5]
    assert r1[4]["async_op"] and r1[4]["wait_index"] == 6 and r1[4]["group"] == 4
    # p2p seq per (rank, group, peer, op)
    assert [x["seq"] for x in trace.nodes_of(3).to_pylist() if x["op"] == "recv"] == [0, 1]
    a2a = r1[9]
    assert a2a["in_splits"] == [2, 4, 6, 8] and a2a["out_splits"] == [3, 4, 5, 6]


def test_edges_exact():
    t = assemble(example_logs(iterations=1), {})
    assert t.edges.schema.equals(EDGE_SCHEMA)
    per = 12
    e = t.edges.to_pydict()
    got = {k: set() for k in ("order", "wait", "sync")}
    for s, d, k in zip(e["src"], e["dst"], e["kind"]):
        got[k].add((s, d))
    assert len(e["src"]) == sum(len(v) for v in got.values())  # no duplicates
    assert got["order"] == {(nid(r, i, per), nid(r, i + 1, per)) for r in range(4) for i in range(per - 1)}
    assert got["wait"] == {(nid(r, 4, per), nid(r, 6, per)) for r in range(4)}
    sync = set()
    sync |= {(nid(0, 2, per), nid(1, 2, per)), (nid(2, 2, per), nid(3, 2, per))}  # tp all_reduce
    sync |= {(nid(0, 4, per), nid(2, 4, per)), (nid(1, 4, per), nid(3, 4, per))}  # dp async all_reduce
    for idx in (7, 8, 9):  # all_gather, reduce_scatter, all_to_all on the world: chain 0-1-2-3
        sync |= {(nid(r, idx, per), nid(r + 1, idx, per)) for r in range(3)}
    sync |= {(nid(0, 10, per), nid(2, 10, per)), (nid(1, 10, per), nid(3, 10, per))}  # send -> recv
    assert got["sync"] == sync


def test_sync_chain_follows_group_rank_order():
    # group ranks listed as [3, 1]: the chain goes 3 -> 1
    logs = []
    for r in range(4):
        nodes = [{"index": 0, "op": "compute"}]
        if r in (1, 3):
            nodes.append({"index": 1, "op": "all_reduce", "group_name": "odd", "in_bytes": 8, "out_bytes": 8})
        logs.append(RankLog(r, 4, "cpu", "host", nodes, [GroupInfo("odd", "odd", [3, 1])], []))
    t = assemble(logs, {})
    e = t.edges.filter(t.edges.column("kind").to_numpy(zero_copy_only=False) == "sync").to_pylist()
    ids = {(x["rank"], x["index"]): x["node_id"] for x in t.nodes.to_pylist()}
    assert e == [{"src": ids[(3, 1)], "dst": ids[(1, 1)], "kind": "sync"}]
    validate(t)


def test_nodes_out_of_index_order_and_missing_seq(logs):
    for log in logs:
        for n in log.nodes:
            n.pop("seq", None)
            n.pop("kind")
        log.nodes.reverse()
    t = assemble(logs, {})
    ref = assemble(example_logs(), {})
    assert t.nodes.column("index").to_pylist() == ref.nodes.column("index").to_pylist()
    assert t.nodes.column("seq").to_pylist() == ref.nodes.column("seq").to_pylist()
    assert t.nodes.column("kind").to_pylist() == ref.nodes.column("kind").to_pylist()
    assert t.edges.equals(ref.edges)


def test_assemble_errors(logs):
    bad = copy.deepcopy(logs)
    bad[1].groups[1] = GroupInfo("tp0", "tp0", [0, 2])
    with pytest.raises(TraceError, match=r"group 'tp0' .*\[0, 1\] on rank 0 but \[0, 2\] on rank 1"):
        assemble(bad, {})
    bad = copy.deepcopy(logs)
    bad[2].nodes[2]["group_name"] = "nope"
    with pytest.raises(TraceError, match=r"rank 2 node 2 \(all_reduce\) names group 'nope'"):
        assemble(bad, {})
    with pytest.raises(TraceError, match=r"no rank log for rank 3"):
        assemble(logs[:3], {})
    bad = copy.deepcopy(logs)
    bad[1].nodes[5]["index"] = 4
    with pytest.raises(TraceError, match=r"rank 1: node indices are not 0..22"):
        assemble(bad, {})
    bad = copy.deepcopy(logs)
    bad[0].nodes[3]["in_bytes"] = "lots"
    with pytest.raises(TraceError, match=r"rank 0 node 3 has a value of the wrong type"):
        assemble(bad, {})


def test_assemble_spool(tmp_path, logs):
    spool = tmp_path / "spool"
    spool.mkdir()
    for log in logs:
        write_ranklog(spool, log)
    t = assemble_spool(spool, dict(MANIFEST))
    assert t.equals(assemble(example_logs(), MANIFEST))
    ranklog_path(spool, 2).unlink()
    with pytest.raises(TraceError, match=r"lacks the log of rank 2 \(expected rank-000002.msgpack"):
        assemble_spool(spool, {})
    ranklog_path(spool, 2).write_bytes(b"\x93\x01")
    with pytest.raises(TraceError, match=r"rank-000002.msgpack is unreadable"):
        assemble_spool(spool, {})


# ---------------------------------------------------------------------- disk
def test_save_load_roundtrip(tmp_path, trace):
    out = trace.save(tmp_path / "g")
    assert sorted(p.name for p in out.iterdir()) == [
        "edges.parquet",
        "groups.parquet",
        "iterations.parquet",
        "manifest.json",
        "nodes.parquet",
    ]
    back = PrismTrace.load(out)
    assert back.equals(trace)
    assert back.manifest == json.loads(json.dumps(trace.manifest))
    assert back.nodes.schema.equals(NODE_SCHEMA)
    # replacing an existing graph works and leaves no temp dirs behind
    trace.save(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g"]
    validate(back)


def test_save_refuses_foreign_directory(tmp_path, trace):
    d = tmp_path / "stuff"
    d.mkdir()
    (d / "precious.txt").write_text("x")
    with pytest.raises(PrismError, match="not empty and holds no graph") as e:
        trace.save(d)
    assert e.value.exit_code == ExitCode.USAGE  # an output path, not a graph that was read
    assert (d / "precious.txt").exists()


def test_load_errors(tmp_path, trace):
    g = trace.save(tmp_path / "g")
    with pytest.raises(TraceError, match="does not exist"):
        PrismTrace.load(tmp_path / "nothing")
    m = json.loads((g / "manifest.json").read_text())
    m["format_version"] = FORMAT_VERSION + 1
    (g / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(TraceError) as e:
        PrismTrace.load(g)
    assert str(e.value) == (
        f"graph {g} has format version {FORMAT_VERSION + 1}, newer than this "
        f"prismllm reads ({FORMAT_VERSION}): upgrade prismllm"
    )
    g = trace.save(tmp_path / "g")
    data = (g / "nodes.parquet").read_bytes()
    (g / "nodes.parquet").write_bytes(data[: len(data) // 2])
    with pytest.raises(
        TraceError, match=rf"nodes.parquet is {len(data) // 2} bytes, its manifest says {len(data)} .*re-record"
    ):
        PrismTrace.load(g)
    with pytest.raises(TraceError, match=r"nodes.parquet is unreadable, truncated or corrupt .*re-record"):
        PrismTrace.load(g, verify=False)  # the reader's own check behind the checksums
    g = trace.save(tmp_path / "g")
    (g / "groups.parquet").unlink()
    with pytest.raises(TraceError, match=r"missing groups.parquet"):
        PrismTrace.load(g)


def test_the_manifest_seals_every_table_file(tmp_path, trace):
    """Integrity by construction: the manifest lists each table file's size and CRC-32 and its own
    values' CRC-32; any change to a file or a value is refused in one line naming it, unless
    verify=False; the seal is the directory's, not the graph's (trace.manifest lacks it)."""
    import zlib

    g = trace.save(tmp_path / "g")
    m = json.loads((g / "manifest.json").read_text())
    assert sorted(m["files"]) == ["edges.parquet", "groups.parquet", "iterations.parquet", "nodes.parquet"]
    data = (g / "nodes.parquet").read_bytes()
    assert m["files"]["nodes.parquet"] == {"bytes": len(data), "crc32": f"{zlib.crc32(data):08x}"}
    back = PrismTrace.load(g)
    assert back.equals(trace) and "files" not in back.manifest and "manifest_crc32" not in back.manifest

    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x10
    (g / "nodes.parquet").write_bytes(bytes(flipped))
    with pytest.raises(TraceError) as e:
        PrismTrace.load(g)
    assert str(e.value) == (
        f"graph {g}: nodes.parquet does not match its checksum in the manifest (changed since it was written); "
        "re-record the graph"
    )
    assert e.value.exit_code == ExitCode.BAD_INPUT
    (g / "nodes.parquet").write_bytes(data)

    edges, groups = (g / "edges.parquet").read_bytes(), (g / "groups.parquet").read_bytes()
    (g / "edges.parquet").write_bytes(groups)  # two files swapped
    (g / "groups.parquet").write_bytes(edges)
    with pytest.raises(TraceError, match=r"edges.parquet is \d+ bytes, its manifest says"):
        PrismTrace.load(g)
    (g / "edges.parquet").write_bytes(edges)
    (g / "groups.parquet").write_bytes(groups)

    for key, value in (("device", "cpv"), ("files", {}), ("manifest_crc32", "0" * 8)):
        (g / "manifest.json").write_text(json.dumps({**m, key: value}))
        with pytest.raises(TraceError, match=rf"graph {g}: the manifest"):
            PrismTrace.load(g)
        assert PrismTrace.load(g, verify=False).nodes.equals(trace.nodes)  # --no-verify: not checked
    (g / "manifest.json").write_text(json.dumps({k: v for k, v in m.items() if k != "manifest_crc32"}))
    with pytest.raises(TraceError, match="the manifest has no manifest_crc32"):
        PrismTrace.load(g)


def test_a_graph_written_before_seals_still_loads(tmp_path, trace):
    g = trace.save(tmp_path / "g")
    m = json.loads((g / "manifest.json").read_text())
    (g / "manifest.json").write_text(json.dumps({k: v for k, v in m.items() if k not in ("files", "manifest_crc32")}))
    assert PrismTrace.load(g).equals(trace)


def test_a_string_column_holds_one_object_per_distinct_value(trace):
    """trace.column of a string column: the values of the table, each distinct one a single Python
    object (a str per row cost 1.3 GB a column at 131,072 ranks); across chunks, and with nulls."""
    import pyarrow as pa

    from prismllm.trace.graph import strings_as_objects

    op = trace.column("op")
    assert list(op) == trace.nodes.column("op").to_pylist()
    assert len({id(x) for x in op}) == len(set(op))
    chunked = pa.chunked_array([pa.array(["a", None, "b"]), pa.array([], pa.string()), pa.array(["b", "a"])])
    got = strings_as_objects(chunked)
    assert list(got) == ["a", None, "b", "b", "a"] and got[2] is got[3] and got[0] is got[4]
    assert strings_as_objects(pa.chunked_array([], pa.string())).shape == (0,)


def test_load_fills_added_columns_and_keeps_extra(tmp_path, trace):
    import pyarrow.parquet as pq

    g = trace.save(tmp_path / "g")
    t = pq.read_table(g / "nodes.parquet").drop_columns(["label"])
    t = t.append_column("future", t.column("rank"))
    pq.write_table(t, g / "nodes.parquet")
    back = PrismTrace.load(g, verify=False)  # rewritten since its manifest was sealed
    assert back.nodes.column_names[: len(NODE_SCHEMA)] == NODE_SCHEMA.names
    assert set(back.nodes.column("label").to_pylist()) == {""}
    assert "future" in back.nodes.column_names
    t = pq.read_table(g / "nodes.parquet").drop_columns(["op"])
    pq.write_table(t, g / "nodes.parquet")
    with pytest.raises(TraceError, match=r"nodes.parquet lacks column\(s\) op"):
        PrismTrace.load(g, verify=False)


def test_graph_without_times(tmp_path):
    t = assemble(example_logs(times=False), {"mode": "capture"})
    assert not t.has_times()
    back = PrismTrace.load(t.save(tmp_path / "g"))
    assert back.equals(t)
    validate(back)


def test_moderate_scale_roundtrip(tmp_path):
    """128 ranks x ~200 nodes through the whole path (correctness, not timing)."""
    logs = synthetic_logs(128, 200, tp=8, pp=4)
    t = assemble(logs, {"mode": "record"})
    validate(t)
    back = PrismTrace.load(t.save(tmp_path / "g"))
    validate(back)
    assert back.nodes.num_rows == sum(len(x.nodes) for x in logs)
    kinds = back.edges.column("kind").to_numpy(zero_copy_only=False)
    assert (kinds == "wait").sum() == 128 * 2
    assert np.array_equal(back.column("node_id"), np.arange(back.nodes.num_rows))


def test_example_times():
    t = assemble(example_logs(), {})
    r0 = t.nodes_of(0).to_pylist()
    assert r0[1]["start_ns"] - r0[0]["start_ns"] == STEP_NS
