"""`prism export --perfetto-proto`: the Perfetto protobuf trace (issue 40).

Perfetto's trace_processor cannot run here: its Python package downloads the
trace_processor_shell binary on first use, and this machine (as CI's) has no network. So the
file is read with Perfetto's own message definitions, the ``perfetto_trace_pb2`` module the
``perfetto`` package ships (generated from perfetto_trace.proto, not from this exporter), and
what a trace processor does with it is replayed here: sequences (incremental state, defaults,
the incremental clock), interning, slice begin/end on each track, flows, counters. Every
node, iteration, flow and counter is checked against the graph, and every node's args against
the JSON export's.
"""

from __future__ import annotations

import json
import os
from collections import Counter, defaultdict
from pathlib import Path

import pyarrow.compute as pc
import pytest

from prismllm.cli import main as climain
from prismllm.trace import assemble
from prismllm.trace.perfetto import export_perfetto
from prismllm.trace.perfetto_proto import _nest, export_perfetto_proto
from prismllm.trace.schema import EDGE_SYNC
from prismllm.trace.synth import STEP_NS, example_logs, synthetic_logs

MANIFEST = {"mode": "record", "command": ["python", "train.py"]}
INCREMENTAL_CLOCK, BOOTTIME = 64, 6


@pytest.fixture(scope="module")
def pb():
    mod = pytest.importorskip(
        "perfetto.protos.perfetto.trace.perfetto_trace_pb2",
        reason="perfetto (Perfetto's Python package, in the test extras) is not installed",
    )
    return mod


@pytest.fixture(scope="module")
def trace():
    return assemble(example_logs(), MANIFEST)


# ---------------------------------------------------------------------- reading a trace back
def no_unknown_fields(msg) -> None:
    """Every field of ``msg`` and its sub-messages is one perfetto_trace.proto defines, with its
    wire type (a field number or type of our own would land among the unknown fields)."""
    from google.protobuf.unknown_fields import UnknownFieldSet

    assert len(UnknownFieldSet(msg)) == 0, f"unknown fields in {type(msg).__name__}: {msg}"
    for field, value in msg.ListFields():
        if field.message_type is not None:
            for sub in value if field.is_repeated else [value]:
                no_unknown_fields(sub)


def read(path: Path, pb) -> dict:
    """What a trace processor makes of the file: tracks {uuid: descriptor}, slices per track
    [{ts, dur, name, cat, args, flows}], counters per track [(ts, value)], trace attributes."""
    trace = pb.Trace()
    trace.ParseFromString(path.read_bytes())
    tracks, attributes = {}, {}
    sequences: dict[int, dict] = {}
    events = defaultdict(list)  # track uuid -> [(ts, TrackEvent, its strings)]
    for p in trace.packet:
        no_unknown_fields(p)
        for a in p.trace_attributes.attribute:
            attributes[a.key] = a.long_value if a.HasField("long_value") else a.string_value
        if p.HasField("track_descriptor"):
            td = p.track_descriptor
            assert td.uuid and td.uuid not in tracks
            assert not td.parent_uuid or td.parent_uuid in tracks, "a parent is described before its children"
            tracks[td.uuid] = td
        sid = p.trusted_packet_sequence_id
        if not sid:
            assert not p.HasField("track_event") and not p.HasField("interned_data")
            continue
        assert sid != 1, "sequence 1 is the tracing service's"
        if p.sequence_flags & pb.TracePacket.SEQ_INCREMENTAL_STATE_CLEARED:
            assert p.first_packet_on_sequence and sid not in sequences, "one sequence per track"
            sequences[sid] = {"strings": defaultdict(dict), "track": None, "clock": None}
        seq = sequences[sid]  # KeyError: a packet before its sequence's state was set
        if p.HasField("trace_packet_defaults"):
            seq["track"] = p.trace_packet_defaults.track_event_defaults.track_uuid
            seq["clock"] = p.trace_packet_defaults.timestamp_clock_id
        if p.HasField("clock_snapshot"):
            clocks = {c.clock_id: c for c in p.clock_snapshot.clocks}
            assert clocks[INCREMENTAL_CLOCK].is_incremental and not clocks[BOOTTIME].is_incremental
            # the incremental clock counts from its snapshot value, which is BOOTTIME's there
            seq["now"] = clocks[INCREMENTAL_CLOCK].timestamp
            seq["offset"] = clocks[BOOTTIME].timestamp - clocks[INCREMENTAL_CLOCK].timestamp
        for kind, entries in p.interned_data.ListFields():
            for entry in entries:
                value = entry.str.decode() if kind.name == "debug_annotation_string_values" else entry.name
                assert seq["strings"][kind.name].setdefault(entry.iid, value) == value
        if p.HasField("track_event"):
            assert seq["clock"] == INCREMENTAL_CLOCK and p.HasField("timestamp")
            seq["now"] += p.timestamp
            te = p.track_event
            track = te.track_uuid if te.HasField("track_uuid") else seq["track"]
            events[track].append((seq["now"] + seq["offset"], te, seq["strings"]))

    slices, counters = defaultdict(list), defaultdict(list)
    for track, evs in events.items():
        assert track in tracks
        assert [ts for ts, _, _ in evs] == sorted(ts for ts, _, _ in evs)
        open_ = []
        for ts, te, strings in evs:
            if te.type == pb.TrackEvent.TYPE_SLICE_BEGIN:
                args = {}
                for da in te.debug_annotations:
                    key = strings["debug_annotation_names"][da.name_iid]
                    if da.array_values:
                        args[key] = [x.int_value for x in da.array_values]
                    elif da.WhichOneof("value") == "string_value_iid":
                        args[key] = strings["debug_annotation_string_values"][da.string_value_iid]
                    else:
                        args[key] = getattr(da, da.WhichOneof("value"))
                s = {
                    "ts": ts,
                    "name": strings["event_names"][te.name_iid],
                    "cat": [strings["event_categories"][i] for i in te.category_iids],
                    "args": args,
                    "flows": list(te.flow_ids),
                }
                open_.append(s)
            elif te.type == pb.TrackEvent.TYPE_SLICE_END:
                s = open_.pop()  # IndexError: an end without a begin
                s["dur"] = ts - s["ts"]
                slices[track].append(s)
            else:
                assert te.type == pb.TrackEvent.TYPE_COUNTER
                counters[track].append((ts, te.counter_value))
        assert not open_, "a slice left open"
    return {"tracks": tracks, "slices": slices, "counters": counters, "attributes": attributes}


def track_path(doc: dict, uuid: int) -> list[str]:
    path = []
    while uuid:
        path.insert(0, doc["tracks"][uuid].name)
        uuid = doc["tracks"][uuid].parent_uuid
    return path


def by_rank(doc: dict) -> dict[int, dict[str, list]]:
    """rank -> track name (a stream's lanes "<name> (2)"... as "<name>") -> its slices."""
    out: dict[int, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for uuid, slices in doc["slices"].items():
        root, rank, name = track_path(doc, uuid)
        assert root == "ranks" and rank.startswith("rank ")
        out[int(rank[5:])][name.split(" (")[0]] += slices
    return out


def json_nodes(trace, tmp_path: Path, ranks=None) -> tuple[dict, dict]:
    """The JSON export's node events by node id, and its tracks' names by (pid, tid)."""
    export_perfetto(trace, tmp_path / "trace.json", ranks=ranks)
    ev = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "thread_name"}
    nodes = {e["args"]["node_id"]: e for e in ev if e["ph"] == "X" and e["cat"] != "iteration"}
    return nodes, names


def graph_t0(trace) -> int:
    start = trace.column("start_ns")
    its = trace.iterations.column("start_ns").to_numpy()
    return int(min(start[start >= 0].min(), its[its >= 0].min(initial=start.max())))


def check_against_graph(trace, doc: dict, tmp_path: Path, ranks=None) -> None:
    """Every node of (the kept ``ranks`` of) the graph is one slice on its rank's track of its
    stream, at its time, with the JSON export's name, category and args; nothing else is."""
    keep = set(ranks if ranks is not None else range(trace.world_size))
    jnodes, jnames = json_nodes(trace, tmp_path, ranks)
    t0 = graph_t0(trace)
    rank, node_id = trace.column("rank"), trace.column("node_id")
    start, end = trace.column("start_ns"), trace.column("end_ns")
    row_of = {int(i): k for k, i in enumerate(node_id)}
    seen = []
    for r, tracks in by_rank(doc).items():
        assert r in keep
        for name, slices in tracks.items():
            if name == "iterations":
                continue
            for s in slices:
                k = row_of[s["args"]["node_id"]]
                j = jnodes[s["args"]["node_id"]]
                assert rank[k] == r and jnames[(r, j["tid"])] == name
                assert (s["ts"], s["dur"]) == (start[k] - t0, end[k] - start[k])
                assert (s["ts"], s["dur"]) == (round(j["ts"] * 1000), round(j["dur"] * 1000))
                assert (s["name"], s["cat"], s["args"]) == (j["name"], [j["cat"]], j["args"])
                seen.append(s["args"]["node_id"])
    expected = [int(i) for i, r in zip(node_id, rank) if r in keep]
    assert sorted(seen) == sorted(expected) == sorted(jnodes)


def sync_pairs(trace, ranks=None) -> set[frozenset]:
    e = trace.edges.filter(pc.equal(trace.edges.column("kind"), EDGE_SYNC)).to_pydict()
    keep = set(ranks if ranks is not None else range(trace.world_size))
    rank_of = dict(zip(trace.column("node_id").tolist(), trace.column("rank").tolist()))
    return {frozenset(p) for p in zip(e["src"], e["dst"]) if rank_of[p[0]] in keep and rank_of[p[1]] in keep}


def flow_pairs(doc: dict) -> set[frozenset]:
    ends = defaultdict(list)
    for slices in doc["slices"].values():
        for s in slices:
            for f in s["flows"]:
                ends[f].append(s["args"]["node_id"])
    assert all(len(v) == 2 for v in ends.values()), "a flow joins two slices"
    assert sorted(ends) == list(range(1, len(ends) + 1))
    return {frozenset(v) for v in ends.values()}


# ---------------------------------------------------------------------- tests
def test_every_node_flow_iteration_and_counter(pb, trace, tmp_path):
    out = tmp_path / "trace.pftrace"
    stats = export_perfetto_proto(trace, out)
    assert (stats["nodes"], stats["flows"], stats["iterations"], stats["memory_counters"]) == (92, 30, 8, 4)
    assert stats["nodes_without_times"] == 0 and not stats["synthetic"]
    doc = read(out, pb)
    check_against_graph(trace, doc, tmp_path)

    # per rank: a track per stream, in the JSON's order (sibling_order_rank), iterations first
    ranks = by_rank(doc)
    assert sorted(ranks) == [0, 1, 2, 3]
    children = defaultdict(list)
    for td in doc["tracks"].values():
        children[td.parent_uuid].append((td.sibling_order_rank, td.name))
    uuid = {td.name: u for u, td in doc["tracks"].items()}  # of the names only one track has
    assert [n for _, n in sorted(children[uuid["ranks"]])] == [f"rank {r}" for r in range(4)]
    assert [n for _, n in sorted(children[uuid["rank 0"]])] == [
        "iterations",
        "compute",
        "comm:default_pg",
        "comm:tp0",
        "comm:dp0",
        "peak memory",
    ]
    for siblings in children.values():
        assert len({o for o, _ in siblings}) == len(siblings), "siblings in one explicit order"
    counts = Counter((r, s["cat"][0]) for r, t in ranks.items() for n, ss in t.items() for s in ss)
    assert counts == Counter(
        {(r, c): n for r in range(4) for c, n in (("compute", 11), ("comm", 12), ("iteration", 2))}
    )

    # iterations: the graph's, per rank
    t0 = graph_t0(trace)
    it = trace.iterations.to_pydict()
    want = {(r, i, s - t0, e - s) for r, i, s, e in zip(it["rank"], it["iteration"], it["start_ns"], it["end_ns"])}
    got = {(r, s["args"]["iteration"], s["ts"], s["dur"]) for r, t in ranks.items() for s in t["iterations"]}
    assert got == want and all(
        s["name"] == f"iteration {s['args']['iteration']}" for t in ranks.values() for s in t["iterations"]
    )

    # a flow per sync edge, between its two nodes
    assert flow_pairs(doc) == sync_pairs(trace) and len(sync_pairs(trace)) == 30

    # peak memory: a counter in bytes per rank, spanning the trace
    t_end = max(trace.column("end_ns").max(), max(it["end_ns"])) - t0
    memory = {track_path(doc, u)[1]: (doc["tracks"][u].counter.unit, v) for u, v in doc["counters"].items()}
    peak = trace.manifest["peak_memory_bytes"]
    assert memory == {
        f"rank {r}": (pb.CounterDescriptor.UNIT_SIZE_BYTES, [(0, peak[str(r)]), (t_end, peak[str(r)])])
        for r in range(4)
    }
    assert all(track_path(doc, u)[-1] == "peak memory" for u in doc["counters"])

    a = doc["attributes"]
    assert (a["prismtrace.world_size"], a["prismtrace.nodes_exported"], a["prismtrace.flows"]) == (4, 92, 30)
    assert a["prismtrace.timeline"].startswith("recorded") and a["prismtrace.mode"] == "record"
    assert json.loads(a["prismtrace.command"]) == MANIFEST["command"]


def test_some_ranks(pb, trace, tmp_path):
    out = tmp_path / "some.pftrace"
    stats = export_perfetto_proto(trace, out, ranks=[0, 2])
    doc = read(out, pb)
    check_against_graph(trace, doc, tmp_path, ranks=[0, 2])
    # flows only where both ends are kept: dp0 all_reduce (0-2) and send 0 -> 2, per iteration
    assert flow_pairs(doc) == sync_pairs(trace, [0, 2]) and stats["flows"] == 4
    assert stats["memory_counters"] == 2 and len(doc["counters"]) == 2


def test_bare_graph_by_program_order(pb, tmp_path):
    bare = assemble(example_logs(times=False), {"mode": "capture"})
    out = tmp_path / "bare.pftrace"
    stats = export_perfetto_proto(bare, out)
    assert stats["synthetic"] and stats["nodes"] == 92
    doc = read(out, pb)
    assert doc["attributes"]["prismtrace.timeline"].startswith("synthetic")
    jnodes, _ = json_nodes(bare, tmp_path)
    slices = [s for t in by_rank(doc).values() for n, ss in t.items() if n != "iterations" for s in ss]
    assert len(slices) == 92
    for s in slices:
        j = jnodes[s["args"]["node_id"]]
        assert (s["ts"], s["dur"]) == (round(j["ts"] * 1000), round(j["dur"] * 1000))
        assert s["ts"] == s["args"]["index"] * 1000  # 1 µs per node of program order


def test_spans_that_cross_go_to_a_second_track(pb, tmp_path):
    """Two async all_reduces of a group in flight together, the first ending inside the second:
    begin/end slices of one track must nest, so the second gets a track of its own."""
    logs = example_logs()
    for log in logs:
        first, second = [n for n in log.nodes if n.get("async_op")][:2]
        first["end_ns"] = second["start_ns"] + STEP_NS // 2
        first["duration_ns"] = first["end_ns"] - first["start_ns"]
    crossed = assemble(logs, MANIFEST)
    out = tmp_path / "crossed.pftrace"
    export_perfetto_proto(crossed, out)
    doc = read(out, pb)
    check_against_graph(crossed, doc, tmp_path)
    names = [track_path(doc, uuid)[-1] for uuid in doc["tracks"] if track_path(doc, uuid)[1:2] == ["rank 0"]]
    assert "comm:dp0" in names and "comm:dp0 (2)" in names


def test_nest():
    # (start, -end) order: A 0-100, B 10-20 inside A, C 15-30 crossing B, D 30-40 after B inside A
    start, end = [0, 10, 15, 30, 40], [100, 20, 30, 40, 40]
    lanes = _nest(start, end)
    assert lanes == [[0, 1, ~1, 3, ~3, 4, ~4, ~0], [2, ~2]]
    for events in lanes:  # each lane in time order
        times = [start[k] if k >= 0 else end[~k] for k in events]
        assert times == sorted(times)


def test_smaller_than_the_json(tmp_path):
    """The point of the format: a third of the JSON's bytes a node (measured: JSON ~290, proto
    ~94 bytes a node on this program), asserted with a margin."""
    big = assemble(synthetic_logs(16, 1000), MANIFEST)
    export_perfetto(big, tmp_path / "big.json")
    stats = export_perfetto_proto(big, tmp_path / "big.pftrace")
    per_node_json = os.path.getsize(tmp_path / "big.json") / big.num_nodes
    per_node_proto = os.path.getsize(tmp_path / "big.pftrace") / big.num_nodes
    assert stats["nodes"] == big.num_nodes == 16000
    assert per_node_proto < 0.4 * per_node_json, (per_node_proto, per_node_json)
    assert per_node_proto < 120


def test_cli(pb, trace, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(climain, "SUBCOMMANDS", ("export",))
    graph = trace.save(tmp_path / "g")
    out = tmp_path / "cli.pftrace"
    assert climain.main(["export", str(graph), "--perfetto-proto", str(out), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["format"] == "perfetto-proto" and res["out"] == str(out) and res["nodes"] == 92
    assert sum(len(s) for s in read(out, pb)["slices"].values()) == 92 + 8
    assert climain.main(["export", str(graph), "--perfetto-proto", str(out), "--ranks", "1"]) == 0
    assert "wrote" in capsys.readouterr().out and set(by_rank(read(out, pb))) == {1}
