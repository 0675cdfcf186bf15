"""`prism show`, `prism export --perfetto`, `prism compare`, and their error handling."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from prismllm.cli import main as climain
from prismllm.errors import ExitCode
from prismllm.trace import PrismTrace, assemble, compare_traces
from prismllm.trace.edges import build_edges
from prismllm.trace.synth import example_logs

MANIFEST = {"mode": "record", "command": ["python", "train.py", "--tp", "2"]}


@pytest.fixture
def cli(capsys, monkeypatch):
    # only this module's subcommands: other stages' CLI modules may be mid-change
    monkeypatch.setattr(climain, "SUBCOMMANDS", ("show", "export", "compare"))

    def run(*argv):
        rc = climain.main([str(a) for a in argv])
        out, err = capsys.readouterr()
        return rc, out, err

    return run


def save(logs, path, manifest=MANIFEST):
    return assemble(logs, manifest).save(path)


@pytest.fixture
def graph(tmp_path):
    return save(example_logs(), tmp_path / "g")


def assert_one_line_error(rc, out, err, command, *needles, code=ExitCode.BAD_INPUT):
    assert rc == code, err
    assert "Traceback" not in err and "Traceback" not in out
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"prism {command}: error: ")
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


# ---------------------------------------------------------------------- show
def test_show_json(cli, graph):
    rc, out, err = cli("show", graph, "--json")
    assert rc == 0, err
    s = json.loads(out)
    assert set(s) == {
        "path",
        "world_size",
        "mode",
        "device",
        "clock",
        "command",
        "format_version",
        "ranks",
        "nodes",
        "edges",
        "edges_by_kind",
        "iterations",
        "nodes_by_op",
        "bytes_by_group",
        "iteration_times",
        "steady_iterations",
        "iteration_time_ns",
        "iteration_time_mean_ns",
        "peak_memory_bytes",
    }
    assert (s["world_size"], s["mode"], s["device"], s["command"]) == (4, "record", "cpu", "python train.py --tp 2")
    assert (s["ranks"], s["nodes"], s["iterations"]) == (4, 92, 2)
    assert s["edges_by_kind"] == {"order": 88, "wait": 8, "sync": 30}
    assert s["nodes_by_op"] == {
        "compute": 44,
        "all_reduce": 16,
        "all_gather": 8,
        "all_to_all": 8,
        "reduce_scatter": 8,
        "recv": 4,
        "send": 4,
    }
    world = s["bytes_by_group"][0]
    assert world == {
        "group": 0,
        "name": "0",
        "desc": "default_pg",
        "size": 4,
        "ops": {"all_gather": 8, "all_to_all": 8, "reduce_scatter": 8, "recv": 4, "send": 4},
        "in_bytes": 8 * 1024 + 8 * 4096 + 2 * (16 + 20 + 24 + 28) * 64 + 4 * 2048,
    }
    assert {g["desc"]: g["in_bytes"] for g in s["bytes_by_group"][1:]} == {
        "dp0": 4 * 8192,
        "dp1": 4 * 8192,
        "tp0": 4 * 4096,
        "tp1": 4 * 4096,
    }
    # each iteration: 11 nodes of 10 µs; rank r ends r µs later
    assert s["iteration_times"] == [
        {"iteration": 0, "ranks": 4, "mean_ns": 111_500, "max_ns": 113_000},
        {"iteration": 1, "ranks": 4, "mean_ns": 111_500, "max_ns": 113_000},
    ]
    assert s["steady_iterations"] == [1]
    assert s["iteration_time_ns"] == 113_000 and s["iteration_time_mean_ns"] == 111_500
    assert s["peak_memory_bytes"] == {str(r): (1 << 30) + r * 1024 for r in range(4)}


def test_show_human(cli, graph):
    rc, out, err = cli("show", graph)
    assert rc == 0, err
    for needle in (
        "world size",
        "record",
        "python train.py --tp 2",
        "all_to_all",
        "default_pg",
        "113.0 µs",
        "peak memory",
    ):
        assert needle in out


def test_show_without_times(cli, tmp_path):
    g = save(example_logs(times=False), tmp_path / "bare", {"mode": "capture"})
    rc, out, _ = cli("show", g, "--json")
    s = json.loads(out)
    assert rc == 0 and s["iteration_times"] == [] and s["iteration_time_ns"] is None
    rc, out, _ = cli("show", g)
    assert rc == 0 and "no times" in out


def test_show_errors(cli, graph, tmp_path):
    line = assert_one_line_error(*cli("show", tmp_path / "nowhere"), "show", "does not exist")
    assert str(tmp_path / "nowhere") in line
    # truncated parquet
    data = (graph / "nodes.parquet").read_bytes()
    (graph / "nodes.parquet").write_bytes(data[: len(data) // 2])
    assert_one_line_error(*cli("show", graph), "show", "nodes.parquet", "re-record")
    # missing file
    g2 = save(example_logs(), tmp_path / "g2")
    (g2 / "edges.parquet").unlink()
    assert_one_line_error(*cli("show", g2, "--json"), "show", "missing edges.parquet")
    # newer format
    g3 = save(example_logs(), tmp_path / "g3")
    m = json.loads((g3 / "manifest.json").read_text())
    m["format_version"] = 2
    (g3 / "manifest.json").write_text(json.dumps(m))
    line = assert_one_line_error(*cli("show", g3), "show")
    assert line.endswith(f"graph {g3} has format version 2, newer than this prismllm reads (1): upgrade prismllm")
    # corrupt manifest
    (g3 / "manifest.json").write_text("{not json")
    assert_one_line_error(*cli("show", g3), "show", "manifest.json is unreadable")
    # an invalid graph
    logs = example_logs()
    logs[1].nodes[2]["in_bytes"] = 2048
    g4 = save(logs, tmp_path / "g4")
    assert_one_line_error(*cli("show", g4), "show", "rank 1 node 2 passes 2048 bytes")


def test_real_entry_point(graph, tmp_path):
    """The installed `prism` script: JSON on stdout; a corrupt graph is one line on stderr, exit 3."""
    exe = Path(sys.executable).with_name("prism")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "prismllm.cli.main"]
    p = subprocess.run(cmd + ["show", str(graph), "--json"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["world_size"] == 4
    data = (graph / "edges.parquet").read_bytes()
    (graph / "edges.parquet").write_bytes(data[:100])
    p = subprocess.run(cmd + ["show", str(graph)], capture_output=True, text=True, timeout=120)
    assert p.returncode == ExitCode.BAD_INPUT and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "edges.parquet" in p.stderr


# ---------------------------------------------------------------------- export
def load_events(path):
    doc = json.loads(Path(path).read_text())
    return doc, doc["traceEvents"]


def test_export_perfetto(cli, graph, tmp_path):
    out = tmp_path / "trace.json"
    rc, stdout, err = cli("export", graph, "--perfetto", out)
    assert rc == 0, err
    assert "92 nodes" in stdout and "30 sync flows" in stdout
    doc, ev = load_events(out)
    procs = {e["pid"]: e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "process_name"}
    assert procs == {r: f"rank {r}" for r in range(4)}
    threads = {}
    for e in ev:
        if e["ph"] == "M" and e["name"] == "thread_name":
            threads.setdefault(e["pid"], {})[e["tid"]] = e["args"]["name"]
    assert set(threads[0].values()) == {"iterations", "compute", "comm:default_pg", "comm:tp0", "comm:dp0"}
    assert set(threads[3].values()) == {"iterations", "compute", "comm:default_pg", "comm:tp1", "comm:dp1"}
    xs = [e for e in ev if e["ph"] == "X" and e["cat"] in ("compute", "comm")]
    assert len(xs) == 92
    assert Counter(e["cat"] for e in xs) == {"compute": 44, "comm": 48}
    # every node sits on its stream's track
    for e in xs:
        name = threads[e["pid"]][e["tid"]]
        assert name == "compute" if e["cat"] == "compute" else name.startswith("comm:")
    a2a = next(e for e in xs if e["pid"] == 1 and e["name"] == "all_to_all")
    assert a2a["args"]["in_splits"] == [2, 4, 6, 8] and a2a["args"]["out_splits"] == [3, 4, 5, 6]
    assert a2a["args"]["group"] == "0 (default_pg)" and a2a["args"]["iteration"] == 0
    assert a2a["dur"] == pytest.approx(10.0) and a2a["ts"] == pytest.approx(90.0)
    flows_s = [e for e in ev if e["ph"] == "s"]
    flows_f = [e for e in ev if e["ph"] == "f"]
    assert len(flows_s) == len(flows_f) == 30
    assert all(e["bp"] == "e" for e in flows_f)
    assert {e["id"] for e in flows_s} == {e["id"] for e in flows_f}
    its = [e for e in ev if e["ph"] == "X" and e["cat"] == "iteration"]
    assert len(its) == 8 and all(e["tid"] == 0 for e in its)
    assert doc["metadata"]["prismtrace"]["timeline"].startswith("recorded")


@pytest.mark.parametrize("fmt", ["perfetto", "hta", "chakra"])
def test_export_json(cli, graph, tmp_path, fmt):
    out = tmp_path / fmt
    rc, stdout, err = cli("export", graph, f"--{fmt}", out, "--ranks", "0-1", "--json")
    assert rc == 0, err
    res = json.loads(stdout)  # one document, nothing else on stdout
    assert res["format"] == fmt and res["out"] == str(out) and res["graph"] == str(graph) and res["world_size"] == 4
    assert res["nodes_without_times"] == 0 and (res["nodes"] == 46 if fmt != "hta" else res["kernels"] > 0)


def test_export_bare_graph(cli, tmp_path):
    g = save(example_logs(times=False), tmp_path / "bare", {"mode": "capture"})
    out = tmp_path / "bare.json"
    rc, stdout, err = cli("export", g, "--perfetto", out)
    assert rc == 0, err
    assert "program order" in stdout
    doc, ev = load_events(out)
    assert doc["metadata"]["prismtrace"]["timeline"].startswith("synthetic")
    xs = [e for e in ev if e["ph"] == "X" and e["cat"] in ("compute", "comm")]
    assert len(xs) == 92
    async_ar = next(e for e in xs if e["pid"] == 0 and e["args"]["index"] == 4)
    assert async_ar["ts"] == pytest.approx(4.0) and async_ar["dur"] == pytest.approx(2.0)  # spans to its wait
    assert all(e["dur"] == pytest.approx(1.0) for e in xs if e["args"]["index"] != 4 and e["args"]["index"] != 15)
    assert len([e for e in ev if e["ph"] == "X" and e["cat"] == "iteration"]) == 8


def test_export_needs_a_format(cli, graph):
    assert_one_line_error(*cli("export", graph), "export", "--perfetto", code=ExitCode.USAGE)


def test_export_some_ranks(cli, graph, tmp_path):
    out = tmp_path / "some.json"
    rc, stdout, err = cli("export", graph, "--perfetto", out, "--ranks", "0,2")
    assert rc == 0, err
    assert "2 of 4 ranks" in stdout
    _, ev = load_events(out)
    assert {e["pid"] for e in ev} == {0, 2}
    # flows only where both ends are kept: dp0 all_reduce (0-2) and send 0 -> 2, per iteration
    assert len([e for e in ev if e["ph"] == "s"]) == 4
    assert_one_line_error(
        *cli("export", graph, "--perfetto", out, "--ranks", "3-9"), "export", "rank 4", code=ExitCode.USAGE
    )


# ---------------------------------------------------------------------- compare
def scaled(logs, f):
    """The same program with every duration (and iteration) f times as long."""
    logs = copy.deepcopy(logs)
    t0 = min(n["start_ns"] for log in logs for n in log.nodes)
    for log in logs:
        for n in log.nodes:
            for k in ("issue_ns", "start_ns", "end_ns"):
                n[k] = t0 + round((n[k] - t0) * f)
            n["duration_ns"] = n["end_ns"] - n["start_ns"]
        for it in log.iterations:
            it["start_ns"] = t0 + round((it["start_ns"] - t0) * f)
            it["end_ns"] = t0 + round((it["end_ns"] - t0) * f)
    return logs


def test_compare_self(cli, graph):
    rc, out, err = cli("compare", graph, graph, "--json")
    assert rc == 0, err
    r = json.loads(out)
    assert r["structure"] == {"equal": True, "first_difference": None, "differences": []}
    assert r["manifest"] == []
    t = r["timing"]
    assert t["iteration_time_a_ns"] == t["iteration_time_b_ns"] == 113_000
    assert t["rel_error"] == 0.0 and t["per_rank"] == {str(i): 0.0 for i in range(4)}
    rc, out, _ = cli("compare", graph, graph)
    assert rc == 0 and "equal" in out


def test_compare_timing(cli, tmp_path):
    a = save(example_logs(), tmp_path / "a")
    b = save(scaled(example_logs(), 1.1), tmp_path / "b")
    rc, out, err = cli("compare", a, b, "--json")
    assert rc == 0, err
    t = json.loads(out)["timing"]
    assert t["iteration_time_b_ns"] == 124_300
    assert t["rel_error"] == pytest.approx(0.1, abs=1e-9)
    assert all(v == pytest.approx(0.1, abs=1e-6) for v in t["per_rank"].values())
    assert t["compute_ns"]["0"]["a_ns"] == 11 * 10_000  # 11 compute spans of 10 µs
    assert t["compute_ns"]["0"]["rel_error"] == pytest.approx(0.1, abs=1e-6)
    assert [x["iteration"] for x in t["iterations"]] == [0, 1]


def test_compare_first_difference(cli, tmp_path):
    a = save(example_logs(), tmp_path / "a")
    logs = example_logs()
    logs[0].nodes[10]["in_bytes"] = 4096  # send 0 -> 2, iteration 0, and its recv: still valid
    logs[2].nodes[10]["out_bytes"] = 4096
    b = save(logs, tmp_path / "b")
    rc, out, err = cli("compare", a, b, "--json")
    assert rc == 1, err
    d = json.loads(out)["structure"]["first_difference"]
    assert (d["rank"], d["comm_index"], d["field"], d["a"], d["b"]) == (0, 5, "in_bytes", 2048, 4096)
    assert d["node_a"]["op"] == "send" and d["node_a"]["index"] == 10
    assert d["node_a"]["group"] == {"id": 0, "desc": "default_pg", "ranks": [0, 1, 2, 3]}
    rc, out, _ = cli("compare", a, b)
    assert rc == 1 and "rank 0 comm #5" in out and "in_bytes differs: A 2048, B 4096" in out
    rc, out, _ = cli("compare", a, b, "--timing-only", "--json")
    assert rc == 0 and json.loads(out)["structure"] is None
    rc, out, _ = cli("compare", a, b, "--structure-only", "--json")
    assert rc == 1 and json.loads(out)["timing"] is None


def test_compare_api_one_rank_changed():
    a = assemble(example_logs(), {})
    logs = example_logs()
    logs[2].nodes[13]["in_bytes"] = 1  # rank 2's second tp all_reduce (comm #6)
    res = compare_traces(a, assemble(logs, {}))
    assert res.structure_equal is False
    d = res.first_difference
    assert (d["rank"], d["comm_index"], d["field"], d["a"], d["b"]) == (2, 6, "in_bytes", 4096, 1)
    assert d["node_b"]["group"]["desc"] == "tp1"
    assert res.to_dict()["structure"]["equal"] is False


def test_compare_groups_by_ranks_not_id():
    a = assemble(example_logs(), {})
    logs = example_logs()
    for log in logs:
        log.groups.reverse()  # other group ids, same groups
    b = assemble(logs, {})
    assert a.groups.column("ranks").to_pylist() != b.groups.column("ranks").to_pylist()
    assert compare_traces(a, b).structure_equal is True
    logs2 = example_logs()  # the tp all_reduces moved to the world group
    for log in logs2:
        for n in log.nodes:
            if n.get("group_name") in ("tp0", "tp1"):
                n["group_name"] = "0"
    res = compare_traces(a, assemble(logs2, {}))
    d = res.first_difference
    assert (d["rank"], d["comm_index"], d["field"]) == (0, 0, "group")
    assert d["a"]["ranks"] == [0, 1] and d["b"]["ranks"] == [0, 1, 2, 3]


def test_compare_count_difference():
    a = assemble(example_logs(iterations=2), {})
    b = assemble(example_logs(iterations=1), {})
    d = compare_traces(a, b).first_difference
    assert (d["rank"], d["comm_index"], d["field"], d["a"], d["b"]) == (0, 6, "count", 12, 6)
    assert d["node_b"] is None and d["node_a"]["op"] == "all_reduce"


def test_compare_names_a_rank_host_bound_in_one_graph_only(cli, tmp_path):
    """On a device clock, the host lead (device start - host issue of each call) tells a rank
    whose device waited for its host (spans = host pace) from one whose host ran ahead."""

    def on_device(logs, lead_ns):
        for log in logs:
            log.clock = "cuda"
            for n in log.nodes:
                if n["kind"] == "comm":
                    n["issue_ns"] = n["start_ns"] - lead_ns.get(log.rank, 100_000)
        return logs

    a = save(on_device(example_logs(), {0: 5_000_000}), tmp_path / "a")  # rank 0's host 5 ms ahead
    b = save(on_device(example_logs(), {}), tmp_path / "b")  # every device waits for its host
    rc, out, err = cli("compare", a, b, "--json")
    assert rc == 0, err
    t = json.loads(out)["timing"]
    assert t["compute_ns"]["0"]["host_lead_a_ns"] == 5_000_000
    assert t["compute_ns"]["0"]["host_lead_b_ns"] == t["compute_ns"]["1"]["host_lead_a_ns"] == 100_000
    assert t["host_bound_differs"] == [0]
    rc, out, _ = cli("compare", a, b)
    assert "host-bound in one graph only: rank 0" in out and "5.000 ms (A)" in out
    # on a host clock (the CPU) issue and start are one: no lead, no note
    rc, out, _ = cli("compare", save(example_logs(), tmp_path / "c"), b, "--json")
    t = json.loads(out)["timing"]
    assert t["compute_ns"]["0"]["host_lead_a_ns"] is None and t["host_bound_differs"] == []


# ---------------------------------------------------------------------- compare: every table
def changed(graph, out, *, nodes=None, edges=None, groups=None, iterations=None, manifest=None):
    """The graph at ``graph`` with some of its parts replaced (each a function of the old one),
    saved at ``out`` by PrismTrace.save, so its checksums are valid: only compare can tell."""
    t = PrismTrace.load(graph)

    def keep(f, x):
        return f(x) if f else x

    return PrismTrace(
        manifest=keep(manifest, dict(t.manifest)),
        nodes=keep(nodes, t.nodes),
        edges=keep(edges, t.edges),
        groups=keep(groups, t.groups),
        iterations=keep(iterations, t.iterations),
    ).save(out)


def with_cells(table, column, rows, value):
    """``table`` with ``column`` set to ``value`` in ``rows`` (row numbers)."""
    values = table.column(column).to_pylist()
    for r in rows:
        values[r] = value
    i = table.schema.get_field_index(column)
    return table.set_column(i, table.schema.field(i), pa.array(values, table.schema.field(i).type))


def node_row(nodes, rank, index):
    return next(i for i, (r, x) in enumerate(zip(nodes["rank"].to_pylist(), nodes["index"].to_pylist()))
                if (r, x) == (rank, index))  # fmt: skip


def node_cell(rank, index, column, value):
    return lambda n: with_cells(n, column, [node_row(n, rank, index)], value)


def rebuilt_edges(nodes_fn):
    """A node change and the edges its nodes then imply (the graph stays consistent)."""

    def apply(t):
        nodes = nodes_fn(t.nodes)
        return {"nodes": lambda _: nodes, "edges": lambda _: build_edges(nodes, t.groups, t.manifest["world_size"])}

    return apply


def swapped(rank, i, j):
    """Nodes i and j of ``rank`` swapped in program order (rows stay sorted by rank, index)."""

    def swap(n):
        ri, rj = node_row(n, rank, i), node_row(n, rank, j)
        perm = list(range(n.num_rows))
        perm[ri], perm[rj] = rj, ri
        return with_cells(with_cells(n.take(perm), "index", [ri], i), "index", [rj], j)

    return swap


def with_group(desc, ranks):
    def add(t):
        row = {"group_id": [pc.max(t["group_id"]).as_py() + 1], "name": [desc], "desc": [desc], "ranks": [ranks]}
        return pa.concat_tables([t, pa.table(row, schema=t.schema)])

    return add


# one change each, to the example with a group no node uses ("spare", ranks 0 and 3). Rank 0's
# program: 0 setup, 1 forward, 2 tp all_reduce, 3 compute, 4 async dp all_reduce, 5, 6 (its
# wait), 7 all_gather, 8 reduce_scatter, 9 all_to_all, 10 send, 11 optimizer, then iteration 1
CHANGES = {
    "iteration row dropped": ({"iterations": lambda t: t.slice(1)}, "iterations", "iteration"),
    "iteration relabelled": ({"iterations": lambda t: with_cells(t, "label", [3], "warm-up")}, "iterations", "label"),
    "edge row duplicated": ({"edges": lambda t: pa.concat_tables([t, t.slice(3, 1)])}, "edges", "implied"),
    "edges emptied": ({"edges": lambda t: t.slice(0, 0)}, "edges", "implied"),
    "tag": ({"nodes": node_cell(0, 10, "tag", 7)}, "nodes", "tag"),
    "async_op": ({"nodes": node_cell(1, 2, "async_op", True)}, "nodes", "async_op"),
    "shape": ({"nodes": node_cell(3, 7, "shape", [128, 2])}, "nodes", "shape"),
    "label": ({"nodes": node_cell(2, 9, "label", "moe")}, "nodes", "label"),
    "iteration": ({"nodes": node_cell(1, 8, "iteration", 1)}, "nodes", "iteration"),
    "group added": ({"groups": with_group("extra", [1, 2])}, "groups", "group"),
    "group dropped": ({"groups": lambda t: t.filter(pc.not_equal(t["desc"], "spare"))}, "groups", "group"),
    # the tp all_reduce after the compute span that followed it, edges rebuilt: only the kinds move
    "compute span moved": (rebuilt_edges(swapped(0, 2, 3)), "nodes", "kind"),
}


@pytest.mark.parametrize("case", sorted(CHANGES))
def test_compare_names_every_changed_table(cli, tmp_path, case):
    parts, table, field = CHANGES[case]
    a = changed(save(example_logs(), tmp_path / "g"), tmp_path / "a", groups=with_group("spare", [0, 3]))
    b = changed(a, tmp_path / "b", **(parts(PrismTrace.load(a)) if callable(parts) else parts))
    rc, out, err = cli("compare", a, b, "--structure-only", "--json")
    assert rc == 1, err
    s = json.loads(out)["structure"]
    assert s["equal"] is False and s["first_difference"] is not None
    found = [d for d in s["differences"] if (d["table"], d["field"]) == (table, field)]
    assert found, s["differences"]  # one entry a kind (the edges: a graph and edge kind)
    d = found[0]
    assert d["count"] >= 1 and not d["informational"] and d["first"]["message"]
    rc, out, _ = cli("compare", a, b, "--structure-only")
    assert rc == 1 and "structure: different" in out and d["message"] in out, out
    # and the other way round
    rc, _, _ = cli("compare", b, a, "--structure-only")
    assert rc == 1


def test_compare_edges_against_what_the_nodes_imply(tmp_path):
    a = save(example_logs(), tmp_path / "a")
    t = PrismTrace.load(a)
    dup = PrismTrace.load(changed(a, tmp_path / "dup", edges=lambda e: pa.concat_tables([e, e.slice(3, 1)])))
    res = compare_traces(t, dup, timing=False)
    implied = [d for d in res.differences if d["field"] == "implied"]
    assert [(d["graph"], d["first"]["kind"], d["first"]["missing"], d["first"]["extra"]) for d in implied] == [
        ("B", "order", 0, 1)
    ]
    counts = next(d for d in res.differences if (d["table"], d["field"]) == ("edges", "count"))
    assert counts["first"] == {"table": "edges", "field": "count", "kind": "order", "a": 88, "b": 89,
                               "message": "order edges: A has 88, B 89"}  # fmt: skip
    empty = PrismTrace.load(changed(a, tmp_path / "empty", edges=lambda e: e.slice(0, 0)))
    res = compare_traces(empty, t, timing=False)  # A is the damaged one now
    implied = {d["first"]["kind"]: d for d in res.differences if d["field"] == "implied"}
    assert {k: (d["graph"], d["first"]["missing"], d["first"]["extra"]) for k, d in implied.items()} == {
        "order": ("A", 88, 0),
        "wait": ("A", 8, 0),
        "sync": ("A", 30, 0),
    }
    assert implied["order"]["message"] == (
        "edges.implied (A, against its own nodes): 88 order edge(s) missing, 0 extra; "
        "first missing: rank 0 node 0 -> rank 0 node 1"
    )
    assert res.first_difference["message"].startswith("the edges table of A is not what its nodes imply: 88 order")


def test_compare_batches_and_wait_points_by_position(tmp_path):
    """Batch ids and wait indices differ between graphs of one program (ids are the recorder's,
    indices count compute spans): compared as communication positions."""

    def batch(gid):  # rank r's all_gather and reduce_scatter (comm #2 and #3) in batch gid
        return lambda n: with_cells(n, "coalesced", [node_row(n, r, i) for r in range(4) for i in (7, 8)], gid)

    def wait(index):  # the dp all_reduce (node 4, comm #1) waited for before node index
        return rebuilt_edges(lambda n: with_cells(n, "wait_index", [node_row(n, r, 4) for r in range(4)], index))

    a = changed(save(example_logs(), tmp_path / "g"), tmp_path / "a", nodes=batch(5))
    t = PrismTrace.load(a)
    # another batch id, the same members: equal
    assert compare_traces(t, PrismTrace.load(changed(a, tmp_path / "b", nodes=batch(9))), timing=False).structure_equal
    # rank 1's reduce_scatter out of the batch
    c = PrismTrace.load(changed(a, tmp_path / "c", nodes=node_cell(1, 8, "coalesced", -1)))
    d = compare_traces(t, c, timing=False).first_difference
    assert (d["rank"], d["comm_index"], d["field"], d["a"], d["b"]) == (1, 3, "coalesced", 2, -1)
    assert "coalesced differs: A the batch from comm #2, B no batch" in d["message"]
    # the wait one compute span earlier (node 5 instead of 6: still before comm #2), edges rebuilt: equal
    e = PrismTrace.load(changed(a, tmp_path / "e", **wait(5)(t)))
    assert e.column("wait_index")[node_row(e.nodes, 0, 4)] == 5
    assert compare_traces(t, e, timing=False).structure_equal
    # ... after the all_gather (before comm #3)
    d = compare_traces(t, PrismTrace.load(changed(a, tmp_path / "f", **wait(8)(t))), timing=False).first_difference
    assert (d["rank"], d["comm_index"], d["field"], d["a"], d["b"]) == (0, 1, "wait_point", 2, 3)
    assert "wait_point differs: A waits before comm #2, B waits before comm #3" in d["message"]


def test_compare_lists_every_difference_and_starts_with_the_first(cli, tmp_path):
    a = changed(save(example_logs(), tmp_path / "g"), tmp_path / "a", groups=with_group("spare", [0, 3]))
    b = changed(
        a,
        tmp_path / "b",
        nodes=lambda n: node_cell(3, 9, "tag", 4)(node_cell(2, 10, "label", "pp")(n)),
        iterations=lambda t: t.slice(0, t.num_rows - 1),  # rank 3's iteration 1
        groups=lambda t: t.filter(pc.not_equal(t["desc"], "spare")),
    )
    rc, out, err = cli("compare", a, b, "--structure-only", "--json")
    assert rc == 1, err
    s = json.loads(out)["structure"]
    # the lowest rank first, then the comm index: rank 2's label before rank 3's tag
    d = s["first_difference"]
    assert (d["table"], d["rank"], d["comm_index"], d["field"], d["a"], d["b"]) == ("nodes", 2, 5, "label", "", "pp")
    assert [(x["table"], x["field"], x["count"]) for x in s["differences"]] == [
        ("nodes", "tag", 1),
        ("nodes", "label", 1),
        ("iterations", "iteration", 1),
        ("groups", "group", 1),
    ]
    msgs = [x["message"] for x in s["differences"]]
    assert msgs[2] == "iterations.iteration: 1 row(s) in one graph only; first: rank 3 iteration 1: A has 1 row(s), B 0"
    assert msgs[3] == "groups: 1 group(s) in one graph only; first: group ('spare', ranks [0, 3]) only in A"
    rc, out, _ = cli("compare", a, b, "--structure-only")
    lines = out.splitlines()
    assert lines[2].startswith("structure: different: rank 2 comm #5"), out
    assert lines[3:] == [f"  {m}" for m in msgs]


def test_compare_reports_manifest_differences_without_failing(cli, tmp_path):
    """A solo capture differs from the recording in mode and layout: said, not a difference of
    structure (exit 0). A different world size is one."""
    a = save(example_logs(), tmp_path / "a")
    layout = {"tp": 2, "dp": 2, "pp": 1}
    b = changed(a, tmp_path / "b", manifest=lambda m: {**m, "layout": layout, "mode": "solo", "hostname": "x"})
    rc, out, err = cli("compare", a, b, "--json")
    assert rc == 0, err
    r = json.loads(out)
    assert r["structure"]["equal"] is True and r["structure"]["first_difference"] is None
    assert [(m["key"], m["a"], m["b"]) for m in r["manifest"]] == [("layout", None, layout), ("mode", "record", "solo")]
    info = r["structure"]["differences"]
    assert [(x["table"], x["field"], x["informational"]) for x in info] == [
        ("manifest", "layout", True),
        ("manifest", "mode", True),
    ]
    rc, out, _ = cli("compare", a, b, "--structure-only")
    assert rc == 0 and "structure: equal" in out, out
    assert out.splitlines()[3:] == [
        "manifest:",
        '  layout: A null, B {"dp": 2, "pp": 1, "tp": 2}',  # the manifest's keys are sorted
        '  mode: A "record", B "solo"',
    ]
    # the program's arguments: the item that differs
    c = changed(a, tmp_path / "c", manifest=lambda m: {**m, "command": ["python", "train.py", "--tp", "4"]})
    rc, out, _ = cli("compare", a, c, "--structure-only")
    assert rc == 0 and '  command: A 4 items, B 4; item 3: A "2", B "4"' in out.splitlines(), out
    # peak memory: the ranks that differ
    d = changed(a, tmp_path / "d", manifest=lambda m: {**m, "peak_memory_bytes": {**m["peak_memory_bytes"], "2": 5}})
    rc, out, _ = cli("compare", a, d, "--json")
    assert rc == 0
    assert json.loads(out)["manifest"] == [
        {
            "key": "peak_memory_bytes",
            "a": {"2": (1 << 30) + 2048},
            "b": {"2": 5},
            "message": f"peak_memory_bytes: 1 rank(s) differ; rank 2: A {(1 << 30) + 2048}, B 5",
        }
    ]
    # the world size is structure: a difference, and in the manifest's list too
    t = PrismTrace.load(a)
    wider = PrismTrace(**{**{k: getattr(t, k) for k in ("nodes", "edges", "groups", "iterations")},
                          "manifest": {**t.manifest, "world_size": 8}})  # fmt: skip
    res = compare_traces(t, wider, timing=False)
    assert res.structure_equal is False and res.first_difference["field"] == "world_size"
    assert [(m["key"], m["a"], m["b"]) for m in res.manifest] == [("world_size", 4, 8)]


def test_compare_names_a_node_whose_own_time_differs(cli, tmp_path):
    """One call's duration changed (the iteration time and the compute totals stay): the timing
    part says how many nodes differ in a time of their own, and the largest difference."""
    a = save(example_logs(), tmp_path / "a")
    t = PrismTrace.load(a)
    row = t.nodes.column("kind").to_pylist().index("comm")
    rank, index = t.nodes["rank"][row].as_py(), t.nodes["index"][row].as_py()
    old = t.nodes["duration_ns"][row].as_py()
    b = changed(a, tmp_path / "b", nodes=node_cell(rank, index, "duration_ns", old + 5000))
    rc, out, _ = cli("compare", a, b, "--json")
    nt = json.loads(out)["timing"]["node_times"]
    assert nt["differ"] == 1 and nt["of"] == t.num_nodes, nt
    assert nt["largest"] == {"rank": rank, "index": index, "column": "duration_ns", "a": old, "b": old + 5000}
    rc, out, _ = cli("compare", a, b)
    assert "nodes whose own times differ" in out and f"rank {rank} node {index} duration_ns" in out, out
