"""`prism sweep` against reality: sweep a grid of configurations of a program, then run some of
its points for real and put the real iteration time and peak memory beside the sweep's prediction.

    .venv/bin/python benchmarks/sweep_check.py [--program gpt3d|megatron] [--devices cpu|cuda:0,0]
        [--world N] [--layout L] [--real K] [--work DIR] [--tag NAME] [-- PROGRAM ARGS]

The grid (6 points): gpt3d (world 2, pp=2): micro-batch 1, 2, 4 x recompute off, on;
megatron (examples/megatron_gpt.py, world 2: DP 2): micro-batch 1, 2, 4 x Megatron's
distributed optimizer off, on (a real run of N ranks is fair on the CPU while N <= cores). On
the CPU Megatron-core runs with --cuda-on-cpu. Then `prism record --nproc N` of K points (the
first, the middle and the last by default), with the same arguments as the point: the real
run's median steady iteration (slowest rank) and per-rank peak memory
(`torch.cuda.max_memory_allocated`, on a GPU) beside the sweep's. Writes
benchmarks/results/sweep_check_<tag>.json and .md; the sweep's own table and report stay in
WORK/sweep (sweep.json, sweep.html).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.tracing_overhead import machine  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
PRISM = str(Path(sys.executable).with_name("prism"))
# program -> (script, world, layout, default arguments, grid)
PROGRAMS = {
    "gpt3d": (
        "examples/gpt3d.py", 2, "pp=2",
        ["--pp", "2", "--layers", "4", "--hidden", "256", "--heads", "8", "--seq", "128", "--vocab", "512",
         "--global-batch", "8", "--iters", "6"],
        ["--grid", "micro-batch=1,2,4", "--grid", "recompute=off,on"],
    ),
    "megatron": (
        "examples/megatron_gpt.py", 2, "",
        ["--layers", "4", "--hidden", "256", "--heads", "8", "--seq-len", "128", "--vocab", "512",
         "--global-batch", "8", "--iters", "6"],
        ["--grid", "micro-batch=1,2,4", "--grid", "dist-opt=off,on"],
    ),
}  # fmt: skip


def prism(*args: str, env: dict) -> subprocess.CompletedProcess:
    p = subprocess.run([PRISM, *args], capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise SystemExit(f"prism {' '.join(args)} failed:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    return p


def real_figures(graph: Path) -> tuple[int, dict[int, int]]:
    """The real run's median steady iteration (the slowest rank per iteration) and per-rank peak."""
    from prismllm.trace.graph import PrismTrace
    from prismllm.trace.summary import steady_iteration_time

    trace = PrismTrace.load(graph)
    peaks = {int(r): int(v) for r, v in (trace.manifest.get("peak_memory_bytes") or {}).items() if int(v) >= 0}
    return steady_iteration_time(trace), peaks


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--program", default="gpt3d", choices=sorted(PROGRAMS))
    ap.add_argument("--devices", default="cpu")
    ap.add_argument("--world", type=int, default=None, help="default: the program's (2)")
    ap.add_argument("--layout", default=None, help="default: the program's (gpt3d pp=2, megatron none: DP)")
    ap.add_argument("--real", default="0,2,5", help="indices of the points run for real")
    ap.add_argument("--work", default="out/sweep_check")
    ap.add_argument("--tag", default=None)
    ap.add_argument("program_args", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    script, world, layout, default_args, grid = PROGRAMS[a.program]
    a.world = a.world or world
    a.layout = a.layout or layout
    script = str(ROOT / script)
    extra = a.program_args[1:] if a.program_args[:1] == ["--"] else a.program_args
    args = extra or default_args
    # Megatron-core hard-codes CUDA: on the CPU its calls are mapped (prism --cuda-on-cpu)
    on_cpu = ["--cuda-on-cpu"] if a.program == "megatron" and a.devices == "cpu" else []
    tag = a.tag or (a.devices.split(":")[0] + ("" if a.program == "gpt3d" else f"_{a.program}"))
    work = Path(a.work) / tag
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}

    t0 = time.monotonic()
    layout_flag = ["--layout", a.layout] if a.layout else []
    prism("sweep", *grid, "--world", str(a.world), *layout_flag, "--devices", a.devices, *on_cpu,
          "--out", str(work / "sweep"), "--force", "--", script, *args, env=env)  # fmt: skip
    sweep_s = time.monotonic() - t0
    sweep = json.loads((work / "sweep" / "sweep.json").read_text())
    rows = []
    for i in [int(x) for x in a.real.split(",")]:
        pt = sweep["points"][i]
        g = work / f"real-{i}"
        t1 = time.monotonic()
        prism("record", "--nproc", str(a.world), "--devices", a.devices, *on_cpu, "--out", str(g), "--force",
              "--", script, *pt["args"], env=env)  # fmt: skip
        real_ns, peaks = real_figures(g)
        pred = pt["predicted_iteration_ns"]
        row = {
            "point": i,
            "values": pt["values"],
            "predicted_iteration_ns": pred,
            "real_iteration_ns": real_ns,
            "iteration_error": (pred - real_ns) / real_ns if pred and real_ns else None,
            "predicted_peak_bytes": pt.get("peak_memory_bytes"),
            "real_peak_bytes": max(peaks.values()) if peaks else None,
            "real_peak_rank": max(peaks, key=peaks.get) if peaks else None,
            "predicted_peak_rank": pt.get("peak_memory_rank"),
            "record_wall_s": round(time.monotonic() - t1, 1),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {
        "benchmark": "sweep_check",
        "machine": machine(),  # host, CPUs, torch, GPU
        "devices": a.devices,
        "world": a.world,
        "layout": a.layout,
        "program": [str(Path(script).relative_to(ROOT)), *args],
        "grid": grid,
        "sweep_wall_s": round(sweep_s, 1),
        "points": [
            {
                k: p.get(k)
                for k in (
                    "point",
                    "values",
                    "status",
                    "predicted_iteration_ns",
                    "peak_memory_bytes",
                    "peak_memory_rank",
                )
            }
            for p in sweep["points"]
        ],  # fmt: skip
        "real": rows,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"sweep_check_{tag}.json").write_text(json.dumps(result, indent=1) + "\n")

    def ms(x):
        return "–" if x is None else f"{x / 1e6:.2f}"

    def mib(x):
        return "–" if x is None else f"{x:,}"

    real = {r["point"]: r for r in rows}
    lines = [
        f"# prism sweep vs reality ({a.program}, {a.devices}, world {a.world}, layout {a.layout or 'none (DP)'}; sweep {sweep_s:.0f} s)",
        "",
        "| point | values | status | predicted ms | real ms | error | predicted peak B (rank) | real peak B (rank) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in sweep["points"]:
        r = real.get(p["point"], {})
        err = r.get("iteration_error")
        vals = ", ".join(f"{k}={v}" for k, v in p["values"].items())
        lines.append(
            f"| {p['point']} | {vals} | {p['status']} | {ms(p.get('predicted_iteration_ns'))} | "
            f"{ms(r.get('real_iteration_ns'))} | {'–' if err is None else f'{100 * err:+.1f} %'} | "
            f"{mib(p.get('peak_memory_bytes'))} ({p.get('peak_memory_rank')}) | "
            f"{mib(r.get('real_peak_bytes'))} ({r.get('real_peak_rank', '–')}) |"
        )
    (RESULTS / f"sweep_check_{tag}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
