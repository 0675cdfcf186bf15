"""The report's data (prismllm/report/data.py): the memory heat map's grid keeps every
model-parallel coordinate within a stage (ep, cp, tp) as a column and folds only the
data-parallel replicas, so MoE routing skew across expert ranks stays visible; every iteration
of a calibration has its critical path and timeline; the run's Perfetto traces are found and
linked from where the page is."""

from __future__ import annotations

import json

import numpy as np

from prismllm.calibrate import calibrate
from prismllm.layout import Layout
from prismllm.report.data import _memory, collect, memory_grid
from prismllm.report.html import render_html
from prismllm.trace import assemble
from prismllm.trace.synth import synthetic_logs


def peaks(layout: Layout) -> dict[str, int]:
    """Per-rank peak bytes that differ by every coordinate: pp, ep and tp by a lot (the skew the
    grid must show), the replica (edp) coordinate by a little (what a cell takes the max of)."""
    out = {}
    for r in range(layout.world):
        c = layout.coords(r)
        out[str(r)] = 10**9 + 10**7 * c["pp"] + 10**6 * c["ep"] + 10**5 * c["tp"] + 10**3 * c["edp"]
    return out


def expected(layout: Layout, per_rank: dict[str, int], cols: list[str]) -> list[list[int]]:
    """The grid by brute force: per (pp, column) the max over the ranks that fall in it."""
    sizes = layout.to_dict()
    n = int(np.prod([sizes[d] for d in cols]))
    grid = [[-1] * n for _ in range(layout.pp)]
    for r in range(layout.world):
        c = layout.coords(r)
        j = 0
        for d in cols:
            j = j * sizes[d] + c[d]
        grid[c["pp"]][j] = max(grid[c["pp"]][j], per_rank[str(r)])
    return grid


def test_memory_grid_keeps_expert_ranks_apart():
    layout = Layout.parse("pp=2,ep=4", world=16)  # dp 8 = ep 4 x edp 2
    assert layout is not None and layout.edp == 2
    per = peaks(layout)
    g = _memory({"peak_memory_bytes": per}, 16, layout)["grid"]
    assert g["rows"] == "pp" and g["cols"] == "ep"
    assert g["col_labels"] == ["ep 0", "ep 1", "ep 2", "ep 3"]
    assert len(g["values"]) == 2 and all(len(row) == 4 for row in g["values"])
    assert g["values"] == expected(layout, per, ["ep"])
    # the skew is there: within a stage the expert ranks differ (a folded ep would be one column)
    assert all(len(set(row)) == 4 for row in g["values"])
    assert g["values"][1][3] == 10**9 + 10**7 + 3 * 10**6 + 10**3  # stage 1, ep 3, the max of edp 0 and 1
    assert "data-parallel replicas" in g["folded"] and "ep" not in g["folded"].split()


def test_memory_grid_columns_ep_then_tp():
    layout = Layout.parse("tp=2,pp=2,ep=2", world=16)  # dp 4 = ep 2 x edp 2
    assert layout is not None
    per = peaks(layout)
    g = _memory({"peak_memory_bytes": per}, 16, layout)["grid"]
    assert g["cols"] == "ep · tp"
    assert g["col_labels"] == ["ep 0 · tp 0", "ep 0 · tp 1", "ep 1 · tp 0", "ep 1 · tp 1"]
    assert g["values"] == expected(layout, per, ["ep", "tp"])
    assert all(len(set(row)) == 4 for row in g["values"])
    # the caption names the columns' dimensions, not "tensor-parallel ranks" alone
    d = {"title": "t", "world_size": 16, "memory": {**_memory({"peak_memory_bytes": per}, 16, layout)}}
    page = render_html(d)
    assert "expert-parallel, tensor-parallel" in page


def test_memory_grid_without_model_parallel_columns():
    """Pure data parallelism within a stage: one tp column, as before; no replicas: nothing folds."""
    dp = Layout.parse("pp=2", world=8)
    assert dp is not None
    g = memory_grid(dp, np.arange(8, dtype=np.int64))
    assert g["cols"] == "tp" and g["col_labels"] == ["tp 0"] and g["values"] == [[3], [7]]
    assert g["folded"] == "max over the 4 data-parallel replicas"
    solo = Layout.parse("tp=2,cp=2,pp=2", world=8)
    assert solo is not None
    g = memory_grid(solo, np.arange(8, dtype=np.int64))
    assert g["cols"] == "cp · tp" and g["col_labels"][1:3] == ["cp 0 · tp 1", "cp 1 · tp 0"]
    assert g["values"] == [[0, 1, 2, 3], [4, 5, 6, 7]] and "no data-parallel replicas" in g["folded"]


def test_every_iteration_has_its_critical_path_and_timeline(tmp_path):
    """A calibrated 16-rank graph of 3 iterations: the report offers each (the median first),
    each with its path and the chosen ranks' spans, the path marked on them; a calibration that
    kept the median's path alone (an older one) offers that one."""
    graph = tmp_path / "graph"
    assemble(synthetic_logs(16, 60, tp=2, pp=4, iterations=3), {"mode": "record"}).save(graph)
    run = tmp_path / "run"
    s = calibrate(graph, out=run / "cal", write_graph=True)
    d = collect(run, ranks=[0, 15])
    its = [cp["iteration"] for cp in d["critical_paths"]]
    assert its == [0, 1, 2] and d["critical_path"]["iteration"] == s["median_iteration"]
    assert all("segments" not in cp for cp in d["critical_paths"])
    tl = d["timeline"]
    assert tl["iteration"] == s["median_iteration"] and [r["rank"] for r in tl["ranks"]] == [0, 15]
    assert [x["iteration"] for x in tl["iterations"]] == its
    for x, cp in zip(tl["iterations"], s["critical_paths"]):
        assert x["end_ns"] > 0 and all(len(spans) > 0 for spans in x["spans"])
        marked = {(r, sp[4]) for r, spans in zip((0, 15), x["spans"]) for sp in spans if sp[5]}
        assert marked, x["iteration"]  # each iteration's own path, not the median's, is marked
        assert cp["ranks_visited"] and cp["total_ns"] > 0
    # an older calibration: the median's path only
    summary = json.loads((run / "cal" / "summary.json").read_text())
    del summary["critical_paths"]
    (run / "cal" / "summary.json").write_text(json.dumps(summary))
    old = collect(run, ranks=[0])
    assert [cp["iteration"] for cp in old["critical_paths"]] == [s["median_iteration"]]
    assert [x["iteration"] for x in old["timeline"]["iterations"]] == [s["median_iteration"]]
    assert "<select" not in render_html(old)  # one iteration: nothing to choose


def test_perfetto_traces_of_the_run_are_linked_from_the_page(tmp_path):
    """The exports in the run directory or a directory of it (the JSON known by how it begins,
    the protobuf by its suffix), linked relative to where the page is written; other JSON files
    and deeper ones are not taken."""
    graph = tmp_path / "graph"
    assemble(synthetic_logs(8, 20, tp=2, pp=2, iterations=2), {"mode": "record"}).save(graph)
    run = tmp_path / "run"
    calibrate(graph, out=run / "cal")
    (run / "my trace.pftrace").write_bytes(b"\x0a\x00")
    (run / "cal" / "perfetto.json").write_text('{"traceEvents":[\n]}')
    (run / "other.json").write_text('{"format": "x"}')
    (run / "cal" / "deep").mkdir()
    (run / "cal" / "deep" / "t.pftrace").write_bytes(b"")
    d = collect(run, page=tmp_path / "pages" / "r.html")
    assert d["perfetto"] == [
        {"file": "cal/perfetto.json", "href": "../run/cal/perfetto.json", "format": "JSON", "bytes": 19},
        {"file": "my trace.pftrace", "href": "../run/my%20trace.pftrace", "format": "protobuf", "bytes": 2},
    ]
    assert collect(run)["perfetto"][1]["href"] == "my%20trace.pftrace"  # the page in the run directory
    page = render_html(d)
    assert '<a href="../run/my%20trace.pftrace">my trace.pftrace</a>' in page and "ui.perfetto.dev" in page
