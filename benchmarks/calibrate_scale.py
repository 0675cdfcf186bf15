"""`prism calibrate` at scale: wall time and peak RSS of solving 1024- and 8192-rank graphs.

    .venv/bin/python benchmarks/calibrate_scale.py [--cases gpt3d1024,gpt3d8192,synth1024,synth8192]
        [--work DIR] [--repeat R] [--quick]

Graphs (built once into the work directory, default out/calibrate_scale, and reused):
- ``gpt3dN``: examples/gpt3d.py captured solo at N ranks (`prism capture --mode solo --layout
  tp=2,pp=8`, 16 representatives run on 2 CPU processes, the DP replicas renamed), tiny sizes,
  3 iterations, 1F1B with 2 micro-batches per replica: about 155 nodes per rank. Its durations are
  the solo run's (compute measured on the CPU, communication = the tensor generator's time):
  a real structure with stand-in times.
- ``synthN``: prismllm.trace.synth.synthetic_logs(N, 500, tp 8, pp 4, 3 iterations): 500 nodes
  per rank (4.1 M nodes at 8192 ranks), lockstep times.

Each case runs the whole command `prism calibrate GRAPH --out CAL --json` in a fresh process
(load, validate, build, solve, critical path, per-rank accounting, write) ``repeat`` times,
then as often with ``--no-validate``;
reported: wall time of the command, peak RSS of that process (``wait4``), and the command's own
per-stage seconds. Writes benchmarks/results/calibrate_scale.json and .md.
``--quick``: 64/128-rank versions (a smoke test of the script).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPT3D = ROOT / "examples" / "gpt3d.py"
RESULTS = ROOT / "benchmarks" / "results"
PRISM = str(Path(sys.executable).with_name("prism"))
TINY = [
    "--hidden",
    "32",
    "--heads",
    "4",
    "--seq",
    "16",
    "--vocab",
    "128",
    "--micro-batch",
    "1",
    "--iters",
    "3",
    "--bucket-mb",
    "0.01",
]


def cases(quick: bool) -> dict[str, dict]:
    small, large = (64, 128) if quick else (1024, 8192)
    out = {}
    for n in (small, large):
        tag = str(n)
        dp = n // 16
        out[f"gpt3d{tag}"] = {
            "kind": "gpt3d",
            "world": n,
            "layout": "tp=2,pp=8",
            "args": ["--tp", "2", "--pp", "8", "--layers", "8", "--global-batch", str(2 * dp)],
        }
        out[f"synth{tag}"] = {"kind": "synth", "world": n, "nodes_per_rank": 500, "tp": 8, "pp": 4}
    return out


def build(name: str, case: dict, work: Path) -> tuple[Path, dict]:
    """The case's graph in ``work/graphs/name`` (made once; a stamp file holds how)."""
    g = work / "graphs" / name
    stamp = work / "graphs" / f"{name}.json"
    if stamp.exists() and (g / "manifest.json").exists() and json.loads(stamp.read_text()).get("case") == case:
        return g, json.loads(stamp.read_text())
    g.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if case["kind"] == "gpt3d":
        cmd = [
            PRISM,
            "capture",
            "--mode",
            "solo",
            "--world",
            str(case["world"]),
            "--devices",
            "cpu",
            "--parallel",
            "2",
            "--layout",
            case["layout"],
            "--out",
            str(g),
            "--force",
            "--",
            str(GPT3D),
            *TINY,
            *case["args"],
        ]
        print(f"[{name}] {' '.join(cmd)}", file=sys.stderr, flush=True)
        p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if p.returncode != 0:
            raise SystemExit(f"[{name}] capture failed:\n{p.stderr[-3000:]}")
        how = {"command": cmd[1:]}
    else:
        # in a child process: this one stays small, so the children's peak RSS (wait4, which
        # counts the forked copy of this process before exec) is theirs alone
        code = (
            "import sys\n"
            "from prismllm.trace import assemble\n"
            "from prismllm.trace.synth import synthetic_logs\n"
            "w, n, tp, pp, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]\n"
            "assemble(synthetic_logs(w, n, tp=tp, pp=pp, iterations=3), {'mode': 'record', 'command': ['synthetic']}).save(out)\n"
        )
        print(f"[{name}] synthetic_logs({case['world']}, {case['nodes_per_rank']})", file=sys.stderr, flush=True)
        subprocess.run(
            [
                sys.executable,
                "-c",
                code,
                str(case["world"]),
                str(case["nodes_per_rank"]),
                str(case["tp"]),
                str(case["pp"]),
                str(g),
            ],
            check=True,
        )
        how = {"synthetic_logs": [case["world"], case["nodes_per_rank"]], "tp": case["tp"], "pp": case["pp"]}
    meta = {"case": case, **how, "build_s": round(time.perf_counter() - t0, 1)}
    stamp.write_text(json.dumps(meta, indent=1) + "\n")
    return g, meta


def run_measured(graph: Path, cal: Path, extra: list[str]) -> dict:
    """One `prism calibrate` in a fresh process: wall seconds, peak RSS (wait4), its summary."""
    cal.parent.mkdir(parents=True, exist_ok=True)
    out_path = cal.with_suffix(".stdout")
    err_path = cal.with_suffix(".stderr")
    t0 = time.perf_counter()
    with open(out_path, "w") as fo, open(err_path, "w") as fe:
        p = subprocess.Popen(
            [PRISM, "calibrate", str(graph), "--out", str(cal), "--force", "--json", *extra], stdout=fo, stderr=fe
        )
        _, status, ru = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        raise SystemExit(f"prism calibrate {graph} failed ({p.returncode}):\n{err_path.read_text()[-3000:]}")
    s = json.loads(out_path.read_text())
    out_path.unlink()
    err_path.unlink()
    return {
        "wall_s": round(wall, 2),
        "peak_rss_mb": round(ru.ru_maxrss / 1024, 1),
        "cpu_s": round(ru.ru_utime + ru.ru_stime, 2),
        "stages_s": s["solve"],
        "predicted_iteration_ns": s["predicted_iteration_ns"],
        "critical_path_segments": len(s["critical_path"]["segments"]) if s["critical_path"] else None,
        "bubble_fraction": (s["pipeline_bubble"] or {}).get("fraction"),
        "nodes": s["nodes"],
        "instances": s["instances"],
        "ranks": s["ranks"],
    }


def loadavg() -> float:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return -1.0


def markdown(results: list[dict], meta: dict) -> str:
    lines = [
        "# `prism calibrate` at scale",
        "",
        f"{meta['machine']}; python {meta['python']}; {meta['date']}. Whole command (`prism calibrate GRAPH --out CAL "
        f"--json`, with and without `--no-validate`) in a fresh process; {meta['repeat']} run(s) per case and "
        f"variant, each listed.",
        "",
        "| case | ranks | nodes | instances | validated | wall s | peak RSS MB | load | validate | build | solve | analyze | write | rounds | load avg |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for run in r["runs"]:
            st = run["stages_s"]
            lines.append(
                f"| {r['case']} | {run['ranks']:,} | {run['nodes']:,} | {run['instances']:,} | "
                f"{'yes' if run['validate'] else 'no'} | {run['wall_s']:.1f} | "
                f"{run['peak_rss_mb']:.0f} | {st.get('load_s', 0):.2f} | {st.get('validate_s', 0):.2f} | "
                f"{st.get('build_s', 0):.2f} | {st.get('replay_s', 0):.2f} | {st.get('analyze_s', 0):.2f} | "
                f"{st.get('write_s', 0):.2f} | {st.get('rounds')} | {run['loadavg_before']} |"
            )
    lines += [
        "",
        "Stage columns are seconds inside the command (load = reading GRAPH; build = ReplayGraph; "
        "solve = the replay; analyze = critical path, per-rank accounting, summary; write = "
        "calibrated.parquet + summary.json); wall also counts the interpreter start and imports.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=None, help="default: all (gpt3d1024,gpt3d8192,synth1024,synth8192)")
    ap.add_argument("--work", default=str(ROOT / "out" / "calibrate_scale"), help="graphs and outputs (kept)")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="64/128-rank cases (smoke test)")
    ap.add_argument(
        "--machine", default=f"{platform.node()}, {os.cpu_count()} CPUs", help="how to name this machine in the results"
    )
    ap.add_argument("--results", default=str(RESULTS / "calibrate_scale"), help="results path without suffix")
    args = ap.parse_args(argv)
    all_cases = cases(args.quick)
    names = [c.strip() for c in args.cases.split(",") if c.strip()] if args.cases else list(all_cases)
    unknown = [n for n in names if n not in all_cases]
    if unknown:
        ap.error(f"unknown case(s) {unknown}; known: {', '.join(all_cases)}")
    work = Path(args.work)
    results = []
    for n in names:
        graph, meta = build(n, all_cases[n], work)
        runs = []
        for extra in ([], ["--no-validate"]):
            for i in range(args.repeat):
                la = loadavg()
                run = run_measured(graph, work / "cal" / n, extra)
                run["loadavg_before"] = la
                run["validate"] = not extra
                print(f"[{n}] run {i}: {json.dumps(run)}", file=sys.stderr, flush=True)
                runs.append(run)
        results.append({"case": n, "graph": meta, "runs": runs})
    meta = {
        "machine": args.machine,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "repeat": args.repeat,
        "quick": args.quick,
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    path = Path(args.results + ("-quick" if args.quick else ""))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    md = markdown(results, meta)
    path.with_suffix(".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
