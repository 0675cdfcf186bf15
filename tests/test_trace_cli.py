"""`prism show`, `prism export --perfetto`, `prism compare`, and their error handling."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from prismllm.cli import main as climain
from prismllm.errors import ExitCode
from prismllm.trace import assemble, compare_traces
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
    assert r["structure"] == {"equal": True, "first_difference": None}
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
