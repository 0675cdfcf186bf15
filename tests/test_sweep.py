"""`prism sweep` (prismllm.pipeline.sweep): the grid becomes runs, each point's figures a row.

- The plan: placeholders filled where they appear, other keys as program flags (on/off bare),
  world as prism's, the product in order; bad grids refused with one message.
- Real runs on the CPU: a point whose rank runs out of memory (a real allocator failure) is
  marked at that rank while the others complete; points that differ only after the capture
  (the sandbox rank) take the capture, timing and calibration of the first.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import GPT3D

from prismllm.cli.main import main
from prismllm.errors import PrismError, StorageError
from prismllm.launch import LaunchInterrupted
from prismllm.pipeline import sweep
from prismllm.pipeline.sweep import SweepOptions, parse_grid, plan_points

ROOT = Path(__file__).resolve().parents[1]
HUNGRY = str(ROOT / "tests" / "programs" / "memory_hungry.py")
SMALL = ["--layers", "2", "--hidden", "32", "--heads", "4", "--seq", "16", "--vocab", "128", "--iters", "3"]


def test_grid_parsing():
    assert parse_grid("micro-batch=1,2,4") == ("micro-batch", ["1", "2", "4"])
    assert parse_grid("layout=tp=2,pp=2|tp=4") == ("layout", ["tp=2,pp=2", "tp=4"])
    for bad, needle in (("mb", "expected KEY=V1"), ("mb=1,,2", "empty value"), ("mb=1,1", "listed twice")):
        with pytest.raises(PrismError, match=needle):
            parse_grid(bad)


def test_points_fill_placeholders_and_pass_other_keys_as_flags(tmp_path):
    opts = SweepOptions(
        out=tmp_path,
        script="train.py",
        world=8,
        layout="tp={tp},pp=2",
        args=["--tp", "{tp}"],
        grid=[("tp", ["1", "2"]), ("recompute", ["off", "on"]), ("micro-batch", ["4"])],
    )
    pts = plan_points(opts)
    assert [p.values for p in pts] == [
        {"tp": "1", "recompute": "off", "micro-batch": "4"},
        {"tp": "1", "recompute": "on", "micro-batch": "4"},
        {"tp": "2", "recompute": "off", "micro-batch": "4"},
        {"tp": "2", "recompute": "on", "micro-batch": "4"},
    ]
    assert [list(p.run.args) for p in pts] == [
        ["--tp", "1", "--micro-batch", "4"],
        ["--tp", "1", "--recompute", "--micro-batch", "4"],
        ["--tp", "2", "--micro-batch", "4"],
        ["--tp", "2", "--recompute", "--micro-batch", "4"],
    ]
    assert [p.run.layout for p in pts] == ["tp=1,pp=2", "tp=1,pp=2", "tp=2,pp=2", "tp=2,pp=2"]
    assert len({p.run.out for p in pts}) == 4
    w = plan_points(SweepOptions(out=tmp_path, script="t.py", grid=[("world", ["16", "32"])]))
    assert [p.run.world for p in w] == [16, 32] and all(not p.run.args for p in w)
    with pytest.raises(PrismError, match="give --world N"):
        plan_points(SweepOptions(out=tmp_path, script="t.py", grid=[("mb", ["1"])]))
    with pytest.raises(PrismError, match="given twice"):
        plan_points(SweepOptions(out=tmp_path, script="t.py", world=2, grid=[("mb", ["1"]), ("mb", ["2"])]))


def test_an_out_of_memory_point_is_marked_at_its_rank(tmp_path, capsys):
    out = tmp_path / "sweep"
    argv = ["sweep", "--world", "2", "--devices", "cpu", "--memory-only", "--out", str(out)]
    rc = main([*argv, "--grid", "hungry-rank=-1,1", "--", HUNGRY])
    assert rc == 0  # an OOM is a result of the sweep, not a failure
    state = json.loads((out / "sweep.json").read_text())
    ok, oom = state["points"]
    assert ok["status"] == "ok" and ok["oom_rank"] is None
    assert oom["status"] == "out_of_memory" and oom["oom_rank"] == 1 and "can't allocate memory" in oom["error"]
    shown = capsys.readouterr().out
    assert "OOM rank 1" in shown
    page = (out / "sweep.html").read_text()
    assert "out of memory (rank 1)" in page and "<script" not in page


def test_points_that_differ_after_the_capture_share_it(tmp_path):
    out = tmp_path / "sweep"
    argv = ["sweep", "--world", "2", "--layout", "pp=2", "--devices", "cpu", "--sandbox", "{s}", "--out", str(out)]
    assert main([*argv, "--grid", "s=0,1", "--", GPT3D, "--pp", "2", *SMALL]) == 0
    state = json.loads((out / "sweep.json").read_text())
    first, second = (Path(p["dir"]) for p in state["points"])
    stages = json.loads((second / "run.json").read_text())["stages"]
    assert [(s["name"], s["what"]) for s in stages[:3]] == [
        (name, f"the same as {first}") for name in ("capture", "time", "calibrate")
    ]
    p0, p1 = state["points"]
    assert p0["predicted_iteration_ns"] == p1["predicted_iteration_ns"] > 0
    assert (p0["emulated_rank"], p1["emulated_rank"]) == (0, 1)
    assert p0["emulated_iteration_ns"] > 0 and p1["emulated_iteration_ns"] > 0
    # run again: every point is read back, nothing runs

    def walls() -> list[list[tuple[str, float]]]:
        return [
            [(x["name"], x["wall_s"]) for x in json.loads((Path(p["dir"]) / "run.json").read_text())["stages"]]
            for p in state["points"]
        ]

    before = walls()
    assert main([*argv, "--grid", "s=0,1", "--", GPT3D, "--pp", "2", *SMALL]) == 0
    assert [[x for x in w if x[0] != "report"] for w in walls()] == [[x for x in w if x[0] != "report"] for w in before]


def test_the_peak_rank_is_named_with_its_layout_coordinates_once(tmp_path):
    """A point's peak is shown as "rank R, <coordinates>", and as "rank R" alone where the layout
    adds nothing (no layout: data parallel only), in the terminal table and in the page."""
    from rich.console import Console

    from prismllm.cli.sweep import render
    from prismllm.pipeline.sweep import _row
    from prismllm.report.sweep import render_sweep_html

    pts = plan_points(SweepOptions(out=tmp_path, script="t.py", world=2, grid=[("mb", ["1", "2"])]))
    peaks = [{"rank": 0, "bytes": 3 << 30, "where": "rank 0", "min_bytes": 1 << 30},
             {"rank": 5, "bytes": 4 << 30, "where": "pp 0 · ep 5", "min_bytes": 1 << 30}]  # fmt: skip
    rows = [
        _row(p, "ok", {"peak_memory": pk, "predicted_iteration_ns": 10**6}, None, None) for p, pk in zip(pts, peaks)
    ]
    assert [r["peak_memory_at"] for r in rows] == ["rank 0", "rank 5, pp 0 · ep 5"]
    state = {"grid": [("mb", ["1", "2"])], "script": "t.py", "points": rows, "memory_only": False, "report": "x"}
    console = Console(record=True, width=200)
    render(state, console)
    shown = console.export_text()
    assert "rank 0 " in shown and "rank 0, rank 0" not in shown and "rank 5, pp 0 · ep 5" in shown
    page = render_sweep_html(state, tmp_path)
    assert "(rank 0)" in page and "(rank 5, pp 0 · ep 5)" in page


@pytest.mark.parametrize(
    "stop", [StorageError("/out/points/000-mb-1/bare: No space left on device (0 B free)"), LaunchInterrupted(15)]
)
def test_a_full_disk_or_a_signal_ends_the_sweep(tmp_path, monkeypatch, stop):
    """Unlike a point that fails, a full disk (every later point would hit it too) or a signal
    ends the sweep at the point it stopped."""
    ran = []

    def run_pipeline(opts, ui):
        ran.append(opts.out)
        raise stop

    monkeypatch.setattr(sweep, "run_pipeline", run_pipeline)
    opts = SweepOptions(out=tmp_path / "sweep", script=GPT3D, world=2, grid=[("mb", ["1", "2"])])
    with pytest.raises(type(stop)):
        sweep.run_sweep(opts)
    assert len(ran) == 1


def test_every_pipeline_flag_reaches_each_points_run():
    """Each flag prism sweep shares with prism run (``PIPELINE_FLAGS``) is a field of the sweep's
    options, so that FromFields hands it to every point's run (a flag without one would be parsed
    and silently dropped, as --capture and --head-start once were)."""
    import argparse
    import dataclasses

    from prismllm.cli import options
    from prismllm.cli.run import PIPELINE_FLAGS
    from prismllm.pipeline.run import RunOptions

    p = argparse.ArgumentParser()
    options.add(p, *PIPELINE_FLAGS)
    dests = {a.dest for a in p._actions if a.dest not in ("help", "json")}
    for cls in (SweepOptions, RunOptions):
        assert dests <= {f.name for f in dataclasses.fields(cls)}, (cls.__name__, dests)
