"""The report's data (prismllm/report/data.py): the memory heat map's grid keeps every
model-parallel coordinate within a stage (ep, cp, tp) as a column and folds only the
data-parallel replicas, so MoE routing skew across expert ranks stays visible."""

from __future__ import annotations

import numpy as np

from prismllm.layout import Layout
from prismllm.report.data import _memory, memory_grid
from prismllm.report.html import render_html


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
