"""`prism whatif` (prismllm.calibrate.whatif): re-solving a calibration with spans changed.

- Exact: the hand-made two-stage graph of test_calibrate (iteration 215 ns: rank 0 computes
  100, the send/recv pair takes 10, rank 1 computes 100, the all-reduce 5), re-solved with
  each kind of change, every new iteration time worked out by hand.
- The network table: an all-reduce of 64 bytes over 2 ranks at 0.064 GB/s bus bandwidth and
  0.5 us latency takes 500 + 64 * 2(2-1)/2 / 0.064 = 1500 ns.
- Bad input: one line `prism whatif: error: ...`, exit 2.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from test_calibrate import ENV, PRISM, hand_made_pipeline, make_trace

from prismllm.calibrate import calibrate
from prismllm.calibrate.whatif import WhatIfError, load_network, parse_change, whatif


@pytest.fixture(scope="module")
def cal(tmp_path_factory) -> Path:
    """The hand-made PP graph (labels on rank 0's compute: ``fwd``), saved and calibrated."""
    base = tmp_path_factory.mktemp("whatif")
    make_trace(list(hand_made_pipeline(label="fwd")), 2).save(base / "graph")
    summary = calibrate(base / "graph", base / "cal")
    assert summary["predicted_iteration_ns"] == 215
    return base / "cal"


@pytest.mark.parametrize(
    "changes, expected",
    [
        (["op=compute:x2"], 100 * 2 + 10 + 100 * 2 + 5),
        (["op=compute,rank=1:2"], 100 + 10 + 200 + 5),
        (["rank=1:2"], 100 + 10 + 200 + 5),  # no communication named: compute spans only
        (["label=fwd:+20ns"], 120 + 10 + 100 + 5),
        (["label~^f:=1us"], 1000 + 10 + 100 + 5),
        (["op=send|recv:=50ns"], 100 + 50 + 100 + 5),
        (["op=send|compute,rank=0:=50ns"], 50 + 50 + 100 + 5),  # rank 0's compute and its pair
        (["size=2:0"], 100 + 0 + 100 + 0),
        (["op=all_reduce:-5ns"], 100 + 10 + 100 + 0),
        (["op=compute:x2", "op=compute,rank=0:0.5"], 100 + 10 + 200 + 5),  # applied in order
        (["label=nothing:x5"], 215),
    ],
)
def test_changes_re_solve_exactly(cal, changes, expected):
    r = whatif(cal, [parse_change(c) for c in changes])
    assert r["baseline_iteration_ns"] == 215
    assert r["whatif_iteration_ns"] == expected
    assert r["change_ns"] == expected - 215
    cp = r["critical_path_after"]
    assert cp["total_ns"] == expected
    if expected == 215:
        assert r["matched_nothing"] == [changes[0]]


def test_network_table(cal, tmp_path):
    net = tmp_path / "net.toml"
    net.write_text('[[link]]\nop = "all_reduce"\nbusbw_gbps = 0.064\nlatency_us = 0.5\n')
    r = whatif(cal, [], load_network(net))
    assert r["whatif_iteration_ns"] == 100 + 10 + 100 + 1500
    assert r["applied"][0]["instances"] == 2 and r["applied"][0]["after_ns"] == 3000
    # a link without conditions covers all communication; the first matching link wins
    net.write_text(
        '[[link]]\nop = "all_reduce"\nbusbw_gbps = 0.064\nlatency_us = 0.5\n'
        "[[link]]\nbusbw_gbps = 0.064\nlatency_us = 0\n"
    )
    r = whatif(cal, [parse_change("op=compute:0")], load_network(net))
    assert r["whatif_iteration_ns"] == 0 + 1000 + 0 + 1500  # send/recv: 64 bytes x 1 / 0.064


def test_group_kinds_read_the_layout(cal):
    with pytest.raises(WhatIfError, match="needs the graph's layout"):
        whatif(cal, [parse_change("group=pp:0")])
    r = whatif(cal, [parse_change("group=pp:0")], layout="pp=2")
    assert r["whatif_iteration_ns"] == 200  # the pair and the all-reduce both span pp
    r = whatif(cal, [parse_change("group=tp:0")], layout="pp=2")
    assert r["whatif_iteration_ns"] == 215 and r["matched_nothing"]


def test_out_writes_a_calibration(cal, tmp_path):
    out = tmp_path / "faster"
    whatif(cal, [parse_change("op=compute:0.5")], out=out)
    s = json.loads((out / "summary.json").read_text())
    assert s["predicted_iteration_ns"] == 50 + 10 + 50 + 5
    assert s["whatif"]["changes"] == ["op=compute:x0.5"]


def test_the_what_if_leaves_out_the_calibrations_warmup(tmp_path):
    """A calibration with ``warmup=2`` (of three iterations): the what-if's baseline and its
    changed solve take their medians from iteration 2 alone, as the calibration did."""
    make_trace(list(hand_made_pipeline(3, label="fwd")), 3).save(tmp_path / "graph")
    calibrate(tmp_path / "graph", tmp_path / "cal", warmup=2)
    whatif(tmp_path / "cal", [parse_change("op=compute:0.5")], out=tmp_path / "faster")
    s = json.loads((tmp_path / "faster" / "summary.json").read_text())
    assert (s["warmup"], s["steady_iterations"], s["predicted_iteration_ns"]) == (2, [2], 50 + 10 + 50 + 5)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--scale", "op=compute"], "expected SELECTOR:AMOUNT"),
        (["--scale", "oops=1:2"], "bad condition 'oops=1'"),
        (["--scale", "op=alltoall:2"], "op='alltoall' is not an op"),
        (["--scale", "op=compute:fast"], "amount 'fast'"),
        (["--scale", "op=compute:+3parsecs"], "is not a duration"),
        (["--scale", "label~(:2"], "not a regular expression"),
        ([], "nothing to change"),
        (["--network", "missing.toml"], "missing.toml"),
    ],
)
def test_bad_input_is_one_line(cal, args, needle, tmp_path):
    p = subprocess.run([PRISM, "whatif", str(cal), *args], capture_output=True, text=True, env=ENV, cwd=tmp_path)
    assert p.returncode == 2, p.stdout + p.stderr
    err = p.stderr.strip()
    assert err.startswith("prism whatif: error: ") and "\n" not in err and needle in err, err


def test_cli_prints_the_change(cal):
    p = subprocess.run([PRISM, "whatif", str(cal), "--scale", "op=compute:x2"], capture_output=True, text=True, env=ENV)
    assert p.returncode == 0, p.stderr
    assert "415 ns" in p.stdout and "+93.02%" in p.stdout and "unchanged" in p.stdout


def test_spin_measures_the_change_on_the_real_program(tmp_path):
    """`prism whatif --spin`: gpt3d at 2 ranks (TP2) through `prism run`, then timed again with
    every MLP span 50 ms longer. On the CPU, where a busy loop is the device's work, the measured
    change must be the re-solve's (4 MLP spans an iteration on each rank, all on the critical path:
    +200 ms), within the noise of two timings; the spins reach the slices (the time state says so).
    The spin is long beside the rest of the iteration, so that a busy machine's noise in the two
    timings stays within the tolerance (25 ms spins failed once under an outside load), and each
    median is of five steady iterations (of three, a spun median 70 ms slow failed a fresh clone's
    run, with the suite's other worker beside it)."""
    gpt3d = str(Path(__file__).resolve().parents[1] / "examples" / "gpt3d.py")
    prog = [gpt3d, "--tp", "2", "--layers", "2", "--hidden", "32", "--heads", "4", "--seq", "16", "--vocab", "64",
            "--micro-batch", "1", "--global-batch", "2", "--iters", "6", "--labels"]  # fmt: skip
    run = tmp_path / "run"
    p = subprocess.run([PRISM, "run", "--world", "2", "--devices", "cpu", "--out", str(run), "--", *prog],
                       capture_output=True, text=True, env=ENV, timeout=600)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    base = [PRISM, "whatif", str(run / "cal"), "--devices", "cpu", "--out", str(tmp_path / "spin")]
    p = subprocess.run([*base, "--spin", "mlp=50ms", "--json", "--", *prog], capture_output=True, text=True,
                       env=ENV, timeout=600)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout)
    assert r["spans_per_label"]["mlp"] > 0
    assert r["resolve_change_ns"] == pytest.approx(200e6, rel=0.01)
    assert r["measured_change_ns"] == pytest.approx(r["resolve_change_ns"], rel=0.25), r
    state = json.loads((tmp_path / "spin" / "time" / "time.json").read_text())
    assert state["spin"] == {"mlp": 50.0}

    p = subprocess.run([*base, "--spin", "nothing=1ms", "--force", "--", *prog], capture_output=True, text=True,
                       env=ENV, timeout=120)  # fmt: skip
    assert p.returncode == 2 and "no compute span" in p.stderr and "labelled 'nothing'" in p.stderr, p.stderr
    p = subprocess.run([*base, "--spin", "mlp=1ms"], capture_output=True, text=True, env=ENV, timeout=120)
    assert p.returncode == 2 and "--spin needs the program" in p.stderr, p.stderr
