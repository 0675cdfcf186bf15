"""Solo capture at scale: `prism capture --mode solo` of examples/gpt3d.py at 1024 and 8192
logical ranks on this machine's CPU.

    .venv/bin/python benchmarks/capture_scale.py [--cases dense1024,moe1024,dense8192]
        [--devices G] [--out DIR] [--keep] [--quick]

Per case: wall time of the whole `prism capture` command (and its run / assemble / validate /
save parts from the manifest), ranks actually run (the representatives) of the world, nodes,
graph size on disk, and the time to load the graph (``PrismTrace.load`` plus reading every
node column, i.e. the graph fully in memory). Also, to judge a compact store: the size and
load time of the representatives' nodes alone (what a store of representatives + renaming
would hold). Writes benchmarks/results/capture_scale.json and .md.

``--quick``: the same cases at 64 / 128 ranks, a smoke test of the script.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPT3D = ROOT / "examples" / "gpt3d.py"
RESULTS = ROOT / "benchmarks" / "results"
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
    "2",
    "--bucket-mb",
    "0.01",
]


def cases(quick: bool) -> dict[str, dict]:
    scale = {"1024": 64 if quick else 1024, "8192": 128 if quick else 8192}
    pp = 4 if quick else 8
    ep = 2 if quick else 8  # quick: dp 8 (64 ranks), ep 2 leaves 4 expert-DP replicas to dedup
    out = {}
    for size in ("1024", "8192"):
        world = scale[size]
        dp = world // (2 * pp)
        out[f"dense{size}"] = {
            "world": world,
            "layout": f"tp=2,pp={pp}",
            "args": ["--tp", "2", "--pp", str(pp), "--layers", str(pp), "--global-batch", str(2 * dp)],
        }
        out[f"moe{size}"] = {
            "world": world,
            "layout": f"tp=2,pp={pp},ep={ep}",
            "args": [
                "--tp",
                "2",
                "--pp",
                str(pp),
                "--layers",
                str(pp),
                "--global-batch",
                str(2 * dp),
                "--num-experts",
                "8",
                "--topk",
                "2",
                "--ep",
                str(ep),
            ],
        }
    return out


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def load_time(path: Path) -> tuple[float, int]:
    """Seconds to load the graph and materialise every node column, in a fresh process."""
    code = (
        "import sys, time\n"
        "t0 = time.perf_counter()\n"
        "from prismllm.trace import PrismTrace\n"
        "t1 = time.perf_counter()\n"
        "g = PrismTrace.load(sys.argv[1])\n"
        "for name in g.nodes.column_names: g.nodes.column(name).combine_chunks()\n"
        "n = g.num_nodes + g.edges.num_rows\n"
        "print(time.perf_counter() - t1, g.num_nodes)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True)
    s, n = out.stdout.split()
    return float(s), int(n)


def compact_estimate(path: Path, reps: list[int], work: Path) -> dict:
    """Size and load time of the representatives' nodes only (a compact store's main table)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    t = pq.read_table(path / "nodes.parquet")
    mask = np.isin(t.column("rank").to_numpy(), np.asarray(reps))
    sub = t.filter(pa.array(mask))
    f = work / "reps-nodes.parquet"
    pq.write_table(sub, f, compression="zstd", row_group_size=1 << 20)
    t0 = time.perf_counter()
    pq.read_table(f, memory_map=True)
    dt = time.perf_counter() - t0
    size = f.stat().st_size
    f.unlink()
    return {"rep_nodes": sub.num_rows, "rep_nodes_bytes": size, "rep_nodes_load_s": round(dt, 3)}


def run_case(name: str, case: dict, devices: int, work: Path) -> dict:
    out = work / name
    prism = str(Path(sys.executable).with_name("prism"))
    cmd = [
        prism,
        "capture",
        "--mode",
        "solo",
        "--world",
        str(case["world"]),
        "--devices",
        "cpu",
        "--parallel",
        str(devices),
        "--layout",
        case["layout"],
        "--out",
        str(out),
        "--force",
        "--",
        str(GPT3D),
        *TINY,
        *case["args"],
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    print(f"[{name}] {' '.join(cmd)}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        return {
            "case": name,
            "world": case["world"],
            "layout": case["layout"],
            "ok": False,
            "error": (proc.stderr or proc.stdout)[-2000:],
        }
    m = json.loads((out / "manifest.json").read_text())
    cap = m["capture"]
    load_s, nodes = load_time(out)
    res = {
        "case": name,
        "ok": True,
        "world": case["world"],
        "layout": case["layout"],
        "gpt3d_args": case["args"],
        "devices": devices,
        "ranks_run": cap["ranks_run"],
        "representatives": len(cap["representatives"]),
        "wall_s": round(wall, 2),
        "run_s": cap["run_wall_s"],
        "assemble_s": cap.get("assemble_s"),
        "validate_s": cap.get("validate_s"),
        "nodes": nodes,
        "graph_bytes": du(out),
        "load_s": round(load_s, 3),
    }
    res.update(compact_estimate(out, cap["representatives"], work))
    print(f"[{name}] {json.dumps(res)}", file=sys.stderr, flush=True)
    return res


def markdown(results: list[dict], meta: dict) -> str:
    lines = [
        "# Solo capture at scale (examples/gpt3d.py, CPU)",
        "",
        f"{meta['host']}, {meta['cpus']} CPUs, python {meta['python']}; G = {meta['devices']} ranks at a time; "
        f"gpt3d {' '.join(TINY)}.",
        "",
        "| case | world | layout | ranks run | wall s | run s | assemble s | validate s | nodes | graph MB | load s | reps-only MB | reps-only load s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if not r.get("ok"):
            lines.append(
                f"| {r['case']} | {r['world']} | {r['layout']} | failed: {r['error'].strip().splitlines()[-1][:80]} |"
            )
            continue
        lines.append(
            f"| {r['case']} | {r['world']} | {r['layout']} | {r['ranks_run']} | {r['wall_s']:.1f} | {r['run_s']:.1f} | "
            f"{r['assemble_s']:.1f} | {r['validate_s']:.1f} | {r['nodes']:,} | {r['graph_bytes'] / 1e6:.1f} | "
            f"{r['load_s']:.2f} | {r['rep_nodes_bytes'] / 1e6:.2f} | {r['rep_nodes_load_s']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="dense1024,moe1024,dense8192,moe8192")
    ap.add_argument("--devices", type=int, default=os.cpu_count() or 1, help="ranks run at a time")
    ap.add_argument("--out", default=None, help="work directory (default: a temp dir, removed)")
    ap.add_argument("--keep", action="store_true", help="keep the graphs")
    ap.add_argument("--quick", action="store_true", help="64/128-rank versions of the cases (smoke test)")
    ap.add_argument("--results", default=str(RESULTS / "capture_scale"), help="results path without suffix")
    args = ap.parse_args(argv)
    all_cases = cases(args.quick)
    names = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [n for n in names if n not in all_cases]
    if unknown:
        ap.error(f"unknown case(s) {unknown}; known: {', '.join(all_cases)}")
    work = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="capture_scale-"))
    work.mkdir(parents=True, exist_ok=True)
    results = []
    try:
        for n in names:
            results.append(run_case(n, all_cases[n], args.devices, work))
            if not args.keep:
                shutil.rmtree(work / n, ignore_errors=True)
    finally:
        if not args.keep and not args.out:
            shutil.rmtree(work, ignore_errors=True)
    meta = {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "devices": args.devices,
        "quick": args.quick,
    }
    path = Path(args.results + ("-quick" if args.quick else ""))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    md = markdown(results, meta)
    path.with_suffix(".md").write_text(md)
    print(md)
    return 0 if all(r.get("ok") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
