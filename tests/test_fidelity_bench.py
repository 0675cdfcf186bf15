"""benchmarks/fidelity.py (issue 13's fidelity table): the harness runs its smallest case end to
end on the CPU (N = 2, TP2, 2 iterations: record, record saving tensors, solo capture, time, calibrate, emulate with
real and fast timing, the pure model) and fills every column of its JSON row; the timing values
themselves are not judged here (2 shared cores); with `--repeats K` a row takes the medians of
the K real runs and emulations. Plus the parts that need no process: the
layouts per N, the alpha-beta fit and the per-collective transfer model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import fidelity  # noqa: E402

SMALL = "--layers 1 --hidden 16 --heads 2 --seq 8 --vocab 64 --micro-batch 1"


def test_layouts_divide_every_world():
    for n in (2, 4, 8, 16, 32):
        for name in fidelity.CASES:
            c = fidelity.make_case(name, n)
            if isinstance(c, str):
                assert name == "mixed" and n == 2, (name, n, c)
                continue
            assert n % (c.tp * c.pp) == 0 and c.dp % c.ep == 0, (name, n)
            args = c.args(fidelity.SIZES["cpu"], 3)
            gb = int(args[args.index("--global-batch") + 1])
            assert gb % c.dp == 0 and (gb // c.dp) % (c.pp if c.vpp > 1 else 1) == 0
    assert fidelity.make_case("mixed", 8).title == "TP2·PP2·DP2 SP dist-opt 1F1B"
    assert fidelity.make_case("moe", 8).title == "DP8·EP4 MoE 8 experts"
    assert fidelity.sandbox_ranks("auto", 2, "cuda", 2) == [1]
    assert fidelity.sandbox_ranks("auto", 8, "cpu", 0) == [0, 7]
    assert fidelity.sandbox_ranks("3,last", 8, "cpu", 0) == [3, 7]


def test_shared_gpu_puts_every_process_on_the_first_gpu():
    """--shared-gpu (memory columns on a one-GPU machine): each launch lists the one GPU once a
    process, so prism makes every process its own NCCL host; without it, a GPU each."""
    from types import SimpleNamespace

    shared = SimpleNamespace(devices="cuda", shared_gpu=True)
    assert fidelity.launch_devices(shared, 4) == "cuda:0,0,0,0"
    assert fidelity.launch_devices(SimpleNamespace(devices="cuda", shared_gpu=False), 4) == "cuda"
    assert fidelity.launch_devices(SimpleNamespace(devices="cpu", shared_gpu=False), 4) == "cpu"
    assert fidelity.sandbox_ranks("auto", 4, "cuda", 1, shared=True) == [0, 3]
    assert fidelity.sandbox_ranks("auto", 4, "cuda", 1) == [3]
    with pytest.raises(SystemExit):
        fidelity.main(["--devices", "cpu", "--shared-gpu"])


def test_alpha_beta_fit_and_transfer_model(tmp_path):
    fit = fidelity.fit_alpha_beta([{"bytes": 4 << 20, "median_us": 4094.0 + 100}, {"bytes": 4096, "median_us": 104.0}])
    assert fit["bandwidth_Bps"] == pytest.approx(((4 << 20) - 4096) / 4090e-6)
    assert fit["alpha_s"] == pytest.approx(104e-6 - 4096 / fit["bandwidth_Bps"])

    from prismllm.replay import ReplayGraph
    from prismllm.trace.assemble import assemble
    from prismllm.trace.synth import example_logs

    trace = assemble(example_logs(4, iterations=2), {"mode": "record"})
    g = ReplayGraph(trace)
    t = fidelity.alpha_beta_transfer(g, trace, 1e-6, 1e9)  # 1 µs + 1 ns a byte
    want = {
        ("all_reduce", 2): 1000 + 4096,
        ("all_reduce", 2, "dp"): 1000 + 8192,
        ("all_gather", 4): 1000 + 3 * 1024,
        ("reduce_scatter", 4): 1000 + 3 * 1024,
        ("send", 2): 1000 + 2048,
    }
    seen = {}
    for i in range(g.num_instances):
        op = g.op_names[g.inst_op[i]]
        seen.setdefault(op, set()).add(int(t[i]))
    assert seen["all_reduce"] == {want[("all_reduce", 2)], want[("all_reduce", 2, "dp")]}
    assert seen["all_gather"] == {want[("all_gather", 4)]} and seen["reduce_scatter"] == {want[("reduce_scatter", 4)]}
    assert seen["send"] == {want[("send", 2)]}
    # all_to_all: the busiest member's send or receive volume (rank 3 receives 34 rows of 64 B), x 3/4
    assert seen["all_to_all"] == {1000 + 3 * 34 * 64 // 4}
    # the pure model solves the graph: every rank's iterations timed
    trace.save(tmp_path / "g")
    res = fidelity.pure_model(tmp_path / "g", tmp_path / "g", {"alpha_s": 1e-6, "bandwidth_Bps": 1e9}, [0, 3], 1)
    assert res["rank_ns"]["0"] > 0 and res["job_ns"] >= res["rank_ns"]["3"] > 0 and res["unknown_compute"] == 0


def test_harness_smallest_case_fills_every_column(tmp_path):
    out = tmp_path / "fidelity.json"
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "fidelity.py"),
        "--devices",
        "cpu",
        "--worlds",
        "2",
        "--cases",
        "tp",
        "--iters",
        "2",
        "--micro-batches",
        "1",
        "--model-args",
        SMALL,
        "--time-parallel",
        "2",
        "--alpha-beta",
        "1e-4,1e9",
        "--repeats",
        "1",
        "--json",
        str(out),
        "--keep",
        str(tmp_path / "work"),
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-3000:]
    res = json.loads(out.read_text())
    (case,) = res["cases"]
    assert case["error"] is None and case["sandbox"] == [1]
    assert set(case["stage_wall_s"]) == {
        "record",
        "record_tensors",
        "capture",
        "time",
        "calibrate",
        "emulate",
        "emulate_fast",
        "pure_model",
    }
    (row,) = case["rows"]
    missing = [k for k, v in row.items() if v is None and k != "error"]
    assert not missing, missing
    # --repeats K: real and emulated are the medians of the K runs, every run kept (a second run of
    # each made up from the first: the harness's own runs took a minute of CI)
    for key in ("real", "emulated"):
        (run,) = case[key]["runs"]
        case[key]["runs"].append(
            {f: {r: v * 3 for r, v in d.items()} if isinstance(d, dict) else d for f, d in run.items()}
        )
    (two,) = fidelity.rows(case)
    assert two["real_runs_ms"] == [row["real_ms"], pytest.approx(3 * row["real_ms"], abs=2e-3)]
    assert two["real_ms"] == pytest.approx(2 * row["real_ms"], abs=2e-3)
    assert two["emulated_ms"] == pytest.approx(2 * row["emulated_ms"], abs=2e-3)
    assert two["real_spread"] == pytest.approx(1.0, abs=1e-3)  # (3x - x) / 2x
    for key in ("real", "emulated"):  # compute spans too: the median over the runs
        assert two[f"{key}_compute_ms"] == pytest.approx(2 * row[f"{key}_compute_ms"], abs=2e-3)
    assert all(row[k] == "n/a" for k in row if k.startswith("peak_"))  # device memory: CPU has none
    assert case["emulated"]["timing"] == "real" and case["baseline_b"]["timing"] == "fast"
    assert case["emulated"]["losses_equal_recorded"] is True  # recorded inputs: the real run's numbers
    assert case["emulated"]["losses_max_rel_diff"] == 0.0
    assert case["baseline_a"]["compute_from"] == "solo capture"
    md = out.with_suffix(".md").read_text()
    assert "| tp | 2 | TP2 | 1 |" in md and "Whole job" in md


def test_gpu_suite_compares_periods_where_the_program_prints_them():
    """benchmarks/fidelity_gpu.py: the prediction (one graph boundary to the next: the whole loop) is
    compared with the real runs' periods when every real run printed them, the emulated sandbox's
    period with them, and its iter time with the real iter time; a line's period is the iteration
    before it's."""
    import fidelity_gpu as fg

    def log(times: list[float], periods: list[float] | None) -> str:
        lines = []
        for i, ms in enumerate(times, 1):
            tail = f" | period {periods[i - 2]} ms" if periods and i > 1 else ""
            lines.append(
                f"iteration {i}/{len(times)} | loss 10.5 | iter time {ms} ms | max mem 100 B | host wait 70.0 %{tail}"
            )
        return "\n".join(lines)

    # iterations 3-6 steady; their periods are on lines 4-7
    real = fg.steady(fg.iterations(log([500, 120, 97, 97, 98, 97, 99], [130, 121, 98, 98, 99, 98])), warmup=2)
    assert (real["ms"], real["period_ms"], real["host_wait"]) == (97, 98, 0.7)
    emu = fg.steady(fg.iterations(log([500, 120, 98, 98, 98, 98, 98], [130, 121, 100, 100, 100, 100])), warmup=2)
    row = {"stack": "PyTorch DDP", "real_ms": [97.0], "real_runs": [{**real, "peak_bytes": 100}]}
    row["prism"] = {"predicted_ms": 99.0, "emulated_ms": emu["ms"], "emulated_period_ms": emu["period_ms"]}
    fg.finish(row)
    assert row["basis"] == "period" and row["real_basis_ms"] == [98]
    assert row["predicted_error"] == round(1 / 98, 5) and row["emulated_error"] == round(2 / 98, 5)
    assert row["emulated_iter_time_error"] == round(1 / 97, 5)
    assert row["emulated_vs_predicted"] == round(100 / 99 - 1, 5)  # the emulation against its own prediction
    assert " 7 (2) | 98.00 p |" in fg.markdown({"rows": [{**row, "case": "ddp-2", "world": 2, "layout": "tp=1"}]})
    # a program that prints no period (Megatron's line): its iter time
    old = fg.steady(fg.iterations(log([500, 120, 97, 97, 97], None)), warmup=2)
    assert old["period_ms"] is None
    row = {"stack": "x", "real_ms": [97.0], "real_runs": [{**old, "peak_bytes": 100}], "prism": {"predicted_ms": 99.0}}
    fg.finish(row)
    assert row["basis"] == "iter time" and row["predicted_error"] == round(2 / 97, 5)


def test_gpu_suite_runs_longer_jobs_and_leaves_out_their_first_iterations():
    """benchmarks/fidelity_gpu.py --iters N --warmup W: every case's program runs N iterations, and
    the medians leave out the first W (a power-bound GPU's clock still falls over the first ten)."""
    import fidelity_gpu as fg

    assert {c.iters for c in fg.cases(40)} == {40}
    assert {c.iters for c in fg.cases()} == {30} and fg.WARMUP == 10
    lines = [
        f"iteration {i}/8 | loss 10.5 | iter time {ms} ms | max mem 100 B | period {ms + 1} ms"
        for i, ms in enumerate([500, 90, 92, 94, 96, 98, 98, 98], 1)
    ]
    its = fg.iterations("\n".join(lines))
    assert fg.steady(its, warmup=2)["ms"] == 97 and fg.steady(its, warmup=5)["ms"] == 98
    assert fg.steady(its, warmup=5)["period_ms"] == 99


def test_gpu_suite_places_the_sandbox_on_the_real_ranks_gpu_and_reports_its_clocks():
    """benchmarks/fidelity_gpu.py: prism's sandbox runs on the GPU the real runs gave the sandbox rank
    (two H200s at their power limit clock one program ~10 % apart); each row carries the sandbox
    GPU's SM clock in the real runs, in the last slice and in the emulation (the prism run's last two
    busy stretches), and the table shows them."""
    import argparse

    import fidelity_gpu as fg

    suite = fg.Suite.__new__(fg.Suite)
    suite.doc = {"machine": {"gpus": 2}}
    suite.a = argparse.Namespace(prism_devices="auto")
    ddp = next(c for c in fg.cases() if c.name == "ddp-2")
    assert ddp.sandbox == 1 and suite.devices(ddp, concurrent=False) == "cuda:1,0"
    assert suite.devices(ddp, concurrent=True) == "cuda:0,1"  # the real runs hold GPUs 2-3
    suite.a.prism_devices = "cuda:0,1"
    assert suite.devices(ddp, concurrent=False) == "cuda:0,1"  # as given

    sampler = fg.Sampler(0)  # no NVML here: no samples of its own
    sampler.stop()
    # (time, utilisation %, SM MHz, W) every 0.05 s: idle, capture 1 s, idle 2 s, slice 1 s, idle, emulation 1 s
    busy = {(0.5, 1.5): 1980, (3.5, 4.5): 1850, (6.5, 7.5): 1890}
    sampler.samples = []
    for i in range(160):
        t = i * 0.05
        mhz = next((m for (a, b), m in busy.items() if a <= t <= b), None)
        sampler.samples.append((t, 99 if mhz else 0, mhz or 1980, 690.0 if mhz else 120.0))
    bursts = sampler.bursts()
    assert [b["sm_clock_mhz"] for b in bursts] == [1980, 1850, 1890] and all(b["power_w"] == 690 for b in bursts)
    assert sampler.clocks(3.0, 5.0) == {"sm_clock_mhz": 1850, "power_w": 690}
    assert sampler.clocks(2.0, 3.0) is None  # no busy sample

    runs = [{"ms": 97.0, "peak_bytes": 1, "gpu": {"sm_clock_mhz": m, "power_w": 690}} for m in (1700, 1720, 1690)]
    row = {
        "stack": "x",
        "real_ms": [97.0] * 3,
        "real_runs": runs,
        "prism": {"predicted_ms": 99.0, "gpu_bursts": bursts},
    }
    fg.finish(row)
    assert row["sm_clock_mhz"] == {"real": 1700, "slice": 1850, "emulated": 1890}
    md = fg.markdown({"rows": [{**row, "case": "ddp-2", "world": 2, "layout": "tp=1"}]})
    assert "| 1700 / 1850 / 1890 |" in md
    # prism's own reading of its slice's and its emulation's GPU (emulate.json) before the stretches
    row["prism"].update(slice_gpu={"sm_clock_mhz": 1860}, emulated_gpu={"sm_clock_mhz": 1870})
    fg.finish(row)
    assert row["sm_clock_mhz"] == {"real": 1700, "slice": 1860, "emulated": 1870}


def test_the_gpu_suites_pipelining_program_emulates_with_its_real_losses(tmp_path):
    """benchmarks/programs/torch_parallel.py --mode pp (the GPU suite's pipelining-pp2: PyTorch's
    PipelineStage and Schedule1F1B) on the CPU: plain torchrun, then prism run with its first stage
    virtual; the emulated last stage prints the real run's losses (the stages' shape metadata and
    activations, small here, are what the capture kept of the virtual stage's sends)."""
    prog = [str(ROOT / "benchmarks" / "programs" / "torch_parallel.py"), "--mode", "pp", "--layers", "2"]
    prog += ["--hidden", "32", "--heads", "2", "--seq", "16", "--vocab", "64", "--batch", "4", "--iters", "3"]
    prog += ["--dtype", "fp32"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    real = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *prog],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert real.returncode == 0, real.stderr[-2000:]
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "prismllm.cli.main", "run", "--world", "2", "--layout", "pp=2", "--devices", "cpu"]
    cmd += ["--parallel", "2", "--sandbox", "1", "--out", str(out), "--", *prog]
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]

    def losses(text: str) -> list[str]:
        return [ln.split(" | ")[1] for ln in text.splitlines() if ln.startswith("iteration ")]

    emulated = losses((out / "logs" / "emulate.log").read_text())
    assert len(emulated) == 3 and emulated == losses(real.stdout), (emulated, real.stdout)

    # benchmarks/sandbox_spans.py sets the sandbox's spans (on the CPU, the host's clock is its
    # device's) beside its slice's, and reads the proxy's calls from emulate/schedule.parquet
    import sandbox_spans

    assert sandbox_spans.main([str(out), "--warmup", "1", "--json", str(tmp_path / "spans.json")]) == 0
    doc = json.loads((tmp_path / "spans.json").read_text())
    assert doc["rank"] == 1 and doc["emulated_clock"] == "host"
    for name in ("slice", "emulated"):
        src = doc["sources"][name]
        assert src["iterations"] == 2 and 0 < src["compute_ms"] <= src["iteration_ms"], (name, src)
        assert src["span_ms"] and set(src["span_ms"]) <= set(doc["sources"]["slice"]["span_ms"])
    sch = doc["schedule"]
    assert sch["calls"] > 0 and sch["drift_ms_per_iteration"] is not None and sch["in_call_ms"] >= 0
