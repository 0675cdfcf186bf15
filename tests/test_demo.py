"""`prism demo`: the whole pipeline (capture -> time -> calibrate -> emulate) on the embedded
job, here at 8 ranks (TP2 x PP2 x DP2): every stage ran, the figures are in OUT/demo.json and
in the printed table. The emulated rank is the last one, a DP replica in the solo capture, so
this also checks that a replica's groups (derived names in the graph) are found by members."""

from __future__ import annotations

import json

from prismllm.cli.main import main


def test_demo_runs_the_whole_pipeline(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--world", "8", "--out", str(out), "--devices", "cpu"]) == 0
    f = json.loads((out / "demo.json").read_text())
    assert set(f["stage_wall_s"]) == {"capture", "time", "calibrate", "emulate"}
    assert f["predicted_iteration_ns"] > 0 and f["emulated_iteration_ns"] > 0
    assert f["sandbox_rank"] == 7 and len(f["emulated_iterations_ns"]) == 3
    assert 0 <= f["pipeline_bubble"] < 1 and f["critical_path_by_kind_ns"]["compute"] > 0
    shown = capsys.readouterr().out
    assert "predicted iteration (calibrated, all ranks)" in shown and "whole pipeline" in shown
    # a second run needs --force; a foreign directory is never deleted
    assert main(["demo", "--world", "8", "--out", str(out), "--devices", "cpu"]) == 2
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "keep.txt").write_text("x")
    assert main(["demo", "--world", "8", "--out", str(tmp_path / "other"), "--force"]) == 2
    assert (tmp_path / "other" / "keep.txt").exists()
