"""Solo-mode memory against the real run (GPU): for N=2 layouts of gpt3d, each rank's
``torch.cuda.max_memory_allocated`` when it runs alone under the prism backend (`prism
capture --mode solo`) against the same rank in the real 2-GPU run (`prism record`, NCCL).
Target: equal to the byte. Also the graphs' structure (`compare_traces`), and a
configuration that runs out of memory for real: it must run out in solo mode too, at the
same point (same allocation request, same number of communication calls before it, same
peak).

    python benchmarks/solo_memory.py [--cases tp2,pp2,dp2-distopt,ep2,oom]
        [--json benchmarks/results/solo_memory.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tracing_overhead import machine

ROOT = Path(__file__).resolve().parents[1]
GPT3D = str(ROOT / "examples" / "gpt3d.py")
PRISM = str(Path(sys.executable).with_name("prism"))
MODEL = [
    "--hidden",
    "1024",
    "--heads",
    "16",
    "--layers",
    "4",
    "--seq",
    "1024",
    "--vocab",
    "32000",
    "--micro-batch",
    "2",
    "--global-batch",
    "8",
    "--iters",
    "3",
]
CASES: dict[str, list[str]] = {
    "tp2": ["--tp", "2", *MODEL],
    "pp2": ["--pp", "2", *MODEL],
    "dp2-distopt": ["--dist-opt", *MODEL],
    "ep2": ["--ep", "2", "--num-experts", "4", "--topk", "2", *MODEL],
    # Activations of one micro-batch outgrow an H200 (~23 GB a layer): out of memory in the
    # first forward pass, a few layers in.
    "oom": [
        "--tp",
        "2",
        "--hidden",
        "4096",
        "--heads",
        "32",
        "--layers",
        "8",
        "--seq",
        "4096",
        "--vocab",
        "32000",
        "--micro-batch",
        "64",
        "--global-batch",
        "64",
        "--iters",
        "1",
    ],
}
STORE_CASES = ("pp2", "ep2")  # also replayed from a recorded-tensor store
OOM_RE = re.compile(r"CUDA out of memory\. Tried to allocate ([0-9.]+ [KMG]iB)")


HISTORY: Path | None = None  # --history: where the runs write their allocator histories


def run(cmd: list[str], timeout: float = 900) -> tuple[int, str, float]:
    env = dict(os.environ)
    if HISTORY is not None:  # one directory per run: <history>/<name of its --out>
        env["PRISM_MEMORY_HISTORY"] = str(HISTORY / Path(cmd[cmd.index("--out") + 1]).name)
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    return p.returncode, p.stdout + p.stderr, time.perf_counter() - t0


def real_cmd(args: list[str], out: Path, *extra: str) -> list[str]:
    return [
        PRISM,
        "record",
        "--nproc",
        "2",
        "--devices",
        "cuda",
        "--out",
        str(out),
        "--force",
        *extra,
        "--",
        GPT3D,
        *args,
    ]


def solo_cmd(args: list[str], out: Path, *extra: str) -> list[str]:
    return [
        PRISM,
        "capture",
        "--mode",
        "solo",
        "--world",
        "2",
        "--devices",
        "cuda",
        "--parallel",
        "2",
        "--out",
        str(out),
        "--force",
        *extra,
        "--",
        GPT3D,
        *args,
    ]


def peaks(graph: Path) -> dict[int, int]:
    manifest = json.loads((graph / "manifest.json").read_text())
    return {int(r): int(b) for r, b in manifest["peak_memory_bytes"].items()}


def spool_state(graph: Path) -> dict[int, dict]:
    """Per rank, from the logs a failed run leaves in its spool: communication calls made
    and peak memory."""
    from prismllm.trace.ranklog import read_ranklog

    out = {}
    for f in sorted((graph / ".spool").glob("rank-*.msgpack")):
        log = read_ranklog(f)
        out[log.rank] = {
            "comm_calls": sum(n["kind"] == "comm" for n in log.nodes),
            "peak_memory_bytes": log.peak_memory_bytes,
        }
    return out


def memory_case(name: str, args: list[str], work: Path) -> dict:
    """Real run, solo run with generated outputs, and -- for layouts whose path depends on
    received values (MoE routing) -- a real run saving every output (`--save-tensors all`)
    and a solo run replaying them (`--tensors`)."""
    from prismllm.trace.compare import compare_traces
    from prismllm.trace.graph import PrismTrace

    variants = {"solo": solo_cmd(args, work / f"{name}-solo")}
    runs = [("real", real_cmd(args, work / f"{name}-real"))]
    if name in STORE_CASES:
        store = str(work / f"{name}-store")
        runs.append(
            (
                "real_saving",
                real_cmd(args, work / f"{name}-real-saving", "--save-tensors", "all", "--tensor-store", store),
            )
        )
        variants["solo_store"] = solo_cmd(args, work / f"{name}-solo-store", "--tensors", store)
    runs += list(variants.items())
    res: dict = {"case": name, "args": args}
    graphs: dict[str, Path] = {}
    for label, cmd in runs:
        rc, out, wall = run(cmd)
        res[f"{label}_wall_s"] = round(wall, 1)
        if rc:
            res[f"{label}_error"] = out[-2000:]
            continue
        graphs[label] = Path(cmd[cmd.index("--out") + 1])
        res[f"peak_{label}"] = peaks(graphs[label])
    if "real" not in graphs:
        return res
    if HISTORY is not None:
        res["peak_blocks"] = history_diffs(graphs)
    pr = res["peak_real"]
    ref = PrismTrace.load(graphs["real"])
    for label in [v for v in graphs if v != "real"]:
        ps = res[f"peak_{label}"]
        res[f"{label}_diff_bytes"] = {r: ps[r] - pr[r] for r in pr}
        res[f"{label}_memory_exact"] = all(ps[r] == pr[r] for r in pr)
        cmp = compare_traces(ref, PrismTrace.load(graphs[label]), timing=False)
        res[f"{label}_structure_equal"] = cmp.structure_equal
        if not cmp.structure_equal:
            res[f"{label}_first_difference"] = cmp.first_difference
    return res


def history_diffs(graphs: dict[str, Path]) -> dict[str, dict]:
    """Per variant and rank: the blocks live at peak in one run and not in the real one."""
    from prismllm.comm import memhistory

    out: dict[str, dict] = {}
    real = HISTORY / graphs["real"].name
    for label, g in graphs.items():
        if label == "real":
            continue
        for f in sorted((HISTORY / g.name).glob("rank-*.msgpack")):
            a = memhistory.load(f)["events"]
            b = memhistory.load(real / f.name)["events"]
            out[f"{label}/{f.stem}"] = memhistory.diff_at_peak(a, b)
    return out


def oom_case(args: list[str], work: Path) -> dict:
    real, solo = work / "oom-real", work / "oom-solo"
    rc_r, out_r, t_r = run(real_cmd(args, real))
    rc_s, out_s, t_s = run(solo_cmd(args, solo))
    res = {
        "case": "oom",
        "args": args,
        "real_rc": rc_r,
        "solo_rc": rc_s,
        "real_wall_s": round(t_r, 1),
        "solo_wall_s": round(t_s, 1),
        "real_request": sorted(set(OOM_RE.findall(out_r))),
        "solo_request": sorted(set(OOM_RE.findall(out_s))),
        "real_ranks": spool_state(real),
        "solo_ranks": spool_state(solo),
    }
    res["both_oom"] = bool(rc_r and rc_s and res["real_request"] and res["solo_request"])
    res["same_point"] = (
        res["both_oom"] and res["real_request"] == res["solo_request"] and res["real_ranks"] == res["solo_ranks"]
    )
    if not res["both_oom"]:
        res["real_tail"], res["solo_tail"] = out_r[-1500:], out_s[-1500:]
    return res


def _cell(c: dict, label: str, r: str) -> str:
    peak = c.get(f"peak_{label}")
    if peak is None:
        return "failed" if f"{label}_error" in c else "–"
    if label == "real":
        return f"{peak[r]:,}"
    same = "same graph" if c[f"{label}_structure_equal"] else "other graph"
    return f"{c[f'{label}_diff_bytes'][r]:+,} ({same})"


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = [
        f"Machine: {m.get('gpus')}× {m.get('gpu')}, torch {m.get('torch')}; "
        f"gpt3d `{' '.join(MODEL)}` plus the layout flags.",
        "",
        "| case | rank | real max_memory_allocated | solo, generated: diff | real saving tensors: "
        "diff | solo, recorded tensors: diff |",
        "|---|---|---|---|---|---|",
    ]
    for c in result["cases"]:
        if c["case"] == "oom":
            continue
        for r in sorted(c.get("peak_real", {"-": 0})):
            lines.append(
                f"| {c['case']} | {r} | "
                + " | ".join(
                    _cell(c, label, r) if "peak_real" in c else "failed"
                    for label in ("real", "solo", "real_saving", "solo_store")
                )
                + " |"
            )
    for c in result["cases"]:
        if c["case"] == "oom":
            lines += [
                "",
                f"Out of memory (`{' '.join(c['args'])}`): real run "
                f"{'OOM' if c['real_request'] else 'no OOM'} {c['real_request']}, solo "
                f"{'OOM' if c['solo_request'] else 'no OOM'} {c['solo_request']}; per rank "
                f"(communication calls before it, peak) real {c['real_ranks']}, solo "
                f"{c['solo_ranks']}: same point: {c['same_point']}.",
            ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "solo_memory.json"))
    ap.add_argument("--keep", default=None, metavar="DIR", help="keep the graphs in DIR")
    ap.add_argument(
        "--history",
        action="store_true",
        help="record the allocator history of every run (PRISM_MEMORY_HISTORY) and "
        "list the blocks live at peak in a variant but not in the real run",
    )
    a = ap.parse_args(argv)
    names = [c for c in a.cases.split(",") if c]
    unknown = [c for c in names if c not in CASES]
    if unknown:
        ap.error(f"unknown case(s) {unknown}; known: {list(CASES)}")
    work = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="prism-solo-mem-"))
    work.mkdir(parents=True, exist_ok=True)
    global HISTORY
    HISTORY = work / "history" if a.history else None
    result = {"benchmark": "solo_memory", "machine": machine(), "date": time.strftime("%Y-%m-%d"), "cases": []}
    try:
        for name in names:
            c = oom_case(CASES[name], work) if name == "oom" else memory_case(name, CASES[name], work)
            print(json.dumps(c), flush=True)
            result["cases"].append(c)
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(result, indent=1) + "\n")
    Path(a.json).with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
