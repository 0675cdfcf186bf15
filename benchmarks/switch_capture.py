"""Switch-mode capture against the real run: `prism capture --mode switch` with K ranks running at a
time, and `prism record` of the same command, on this machine's CPU or its GPUs.

    .venv/bin/python benchmarks/switch_capture.py [--cases gpt3d8,ddp16,moe8] [--parallel all,2,1] [--out DIR]
    python3 benchmarks/switch_capture.py --devices cuda:0,1 --cases gpt3d4-gpu,gpt3d16-gpu --parallel 2,4 \
        --out benchmarks/results/switch_gpu

Per case and K: wall time of each command, the stops of waiting ranks (`capture.switches`) per
iteration, the peak host memory of the whole process tree (prism and every rank, sampled every
0.2 s), and whether the captured graph equals the recording (`prism compare`'s structure). On GPUs
(K: ranks at a time over all listed GPUs) also what moving a waiting rank's device state out and
back cost (`capture.swaps`: seconds and bytes a swap) and whether every rank's peak memory equals
the recording's; the recording shares the GPUs among the N ranks (each NCCL's own host), and a case
whose real run does not fit there is captured without one (``--no-record``). Writes
benchmarks/results/switch_cpu.json and .md (or ``--out``).
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
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PRISM = str(Path(sys.executable).with_name("prism"))
GPT3D = str(ROOT / "examples" / "gpt3d.py")
DDP = str(ROOT / "tests" / "programs" / "ddp_train.py")
TINY = ["--layers", "2", "--hidden", "32", "--heads", "4", "--seq", "16", "--vocab", "128", "--micro-batch", "1",
        "--global-batch", "8", "--iters", "3"]  # fmt: skip
GPU_MODEL = ["--layers", "4", "--hidden", "2048", "--heads", "16", "--seq", "1024", "--vocab", "32000",
             "--micro-batch", "1", "--global-batch", "4", "--iters", "2"]  # fmt: skip
# name -> (world, program and arguments; {out} is a scratch directory the program may write)
CASES = {
    "gpt3d8": (8, [GPT3D, "--tp", "2", "--pp", "2", *TINY]),
    "ddp16": (16, [DDP, "{out}", "3"]),
    # routing depends on the values: solo capture without a recording differs from the first all-to-all
    "moe8": (8, [GPT3D, "--tp", "2", "--num-experts", "8", "--topk", "2", "--ep", "4", *TINY]),
    # GPUs: a model whose state is GBs a rank, so that a swap moves what a real job's would
    "gpt3d4-gpu": (4, [GPT3D, "--tp", "2", "--pp", "2", *GPU_MODEL]),
    "gpt3d16-gpu": (16, [GPT3D, "--tp", "2", "--pp", "2", *GPU_MODEL]),
}


def _tree_rss(root: int) -> int:
    """Resident bytes of ``root`` and every process below it."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            children.setdefault(int(fields[1]), []).append(int(d.name))
            rss[int(d.name)] = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            continue
    total, todo, seen = 0, [root], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        total += rss.get(p, 0)
        todo.extend(children.get(p, []))
    return total


def timed(cmd: list[str]) -> dict:
    """Run ``cmd``; its wall time, exit status and the peak resident bytes of its process tree."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    peak = [0]

    def watch() -> None:
        while proc.poll() is None:
            peak[0] = max(peak[0], _tree_rss(proc.pid))
            time.sleep(0.2)

    th = threading.Thread(target=watch, daemon=True)
    th.start()
    out, err = proc.communicate()
    th.join()
    return {"wall_s": round(time.monotonic() - t0, 2), "rc": proc.returncode, "peak_rss_bytes": peak[0],
            "stderr_tail": err[-800:] if proc.returncode else ""}  # fmt: skip


def _swap_costs(swaps: dict | None) -> dict:
    """Seconds out and back, and bytes, a swap (switch mode on GPUs)."""
    if not swaps or not swaps.get("out"):
        return {}
    out = {"swaps": swaps, "out_s_each": round(swaps["out_s"] / swaps["out"], 3)}
    out["back_s_each"] = round(swaps["back_s"] / swaps["back"], 3) if swaps.get("back") else None
    out["bytes_each"] = swaps["bytes_out"] // swaps["out"] if swaps.get("bytes_out") is not None else None
    return out


def _yes(row: dict, key: str) -> str:
    return "-" if key not in row else "yes" if row[key] else "NO"


def _gpu_names() -> str:
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return "GPUs unknown"
    names = [ln.strip() for ln in q.stdout.splitlines() if ln.strip()]
    return f"{len(names)} x {names[0]}" if names else "GPUs unknown"


def _write(args: argparse.Namespace, rows: list[dict], gpus: list[int]) -> str:
    """The results so far (after every row: a run cut short keeps what it measured); the table."""
    machine = f"{platform.node()} ({os.cpu_count()} CPUs)" + (f", {_gpu_names()}" if gpus else "")
    args.out.with_suffix(".json").write_text(
        json.dumps({"machine": machine, "devices": args.devices, "rows": rows}, indent=1) + "\n"
    )
    lines = [f"machine: {machine}; devices {args.devices}", "",
             "| case | N | command | K | wall s | peak host memory | stops / iteration | s out / back a swap "
             "| GiB a swap | graph = recording | peak memory = recording |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for x in rows:
        swap = f"{x['out_s_each']} / {x['back_s_each']}" if "out_s_each" in x else "-"
        size = f"{x['bytes_each'] / 2**30:.2f}" if x.get("bytes_each") is not None else "-"
        lines.append(
            f"| {x['case']} | {x['world']} | {x['command']} | {x['parallel']} | {x['wall_s']} | "
            f"{x['peak_rss_bytes'] / 2**30:.2f} GiB | {x.get('switches_per_iteration', '-')} | {swap} | {size} | "
            f"{_yes(x, 'structure_equal')} | {_yes(x, 'peak_memory_equal')} |"
        )
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=None, help="default: the CPU cases, or with --devices cuda:.. the GPU ones")
    ap.add_argument("--parallel", default="all,2,1", help="K values: a number or 'all'")
    ap.add_argument("--out", type=Path, default=RESULTS / "switch_cpu")
    ap.add_argument("--devices", default="cpu", help="cpu, or the GPUs the ranks share: cuda:0,1")
    ap.add_argument("--no-record", default="", help="cases captured without a real run (it does not fit)")
    args = ap.parse_args()
    gpus = [int(g) for g in args.devices.removeprefix("cuda:").split(",")] if args.devices != "cpu" else []
    unrecorded = set(filter(None, args.no_record.split(",")))
    from prismllm.trace import PrismTrace
    from prismllm.trace.compare import compare_traces

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        on_gpus = args.devices.startswith("cuda")
        cases = args.cases.split(",") if args.cases else [c for c in CASES if c.endswith("-gpu") == on_gpus]
        for name in cases:
            world, prog = CASES[name]
            scratch = Path(tmp) / name
            scratch.mkdir()
            program = [a.replace("{out}", str(scratch)) for a in prog]
            rec = scratch / "rec" if name not in unrecorded else None
            if rec is not None:
                # on GPUs the N real ranks share the listed GPUs, as switch mode's do
                real = f"cuda:{','.join(str(gpus[r % len(gpus)]) for r in range(world))}" if gpus else "cpu"
                r = timed(
                    [PRISM, "record", "--nproc", str(world), "--devices", real, "--out", str(rec), "--", *program]
                )
                if r["rc"]:
                    raise SystemExit(f"{name}: prism record failed: {r['stderr_tail']}")
                rows.append({"case": name, "world": world, "command": "record", "parallel": world, **r})
                print(rows[-1], flush=True)
                _write(args, rows, gpus)
            for k in args.parallel.split(","):
                cap = scratch / f"switch-{k}"
                flag = [] if k == "all" else ["--parallel", k]
                c = timed([PRISM, "capture", "--mode", "switch", "--world", str(world), "--devices", args.devices,
                           *flag, "--out", str(cap), "--", *program])  # fmt: skip
                row = {"case": name, "world": world, "command": "capture --mode switch",
                       "parallel": world if k == "all" else int(k), **c}  # fmt: skip
                if not c["rc"]:
                    g = PrismTrace.load(cap)
                    iterations = len(g.iterations.column("iteration").unique())
                    row["switches"] = g.manifest["capture"]["switches"]
                    row["switches_per_iteration"] = round(row["switches"] / max(iterations, 1), 1)
                    row.update(_swap_costs(g.manifest["capture"].get("swaps")))
                    if rec is not None:
                        real = PrismTrace.load(rec)
                        row["structure_equal"] = bool(compare_traces(real, g, timing=False).structure_equal)
                        if gpus:
                            row["peak_memory_equal"] = (
                                g.manifest["peak_memory_bytes"] == real.manifest["peak_memory_bytes"]
                            )
                    if gpus:
                        row["peak_memory_bytes"] = g.manifest["peak_memory_bytes"]
                rows.append(row)
                print(row, flush=True)
                _write(args, rows, gpus)
                shutil.rmtree(cap, ignore_errors=True)
    print(_write(args, rows, gpus))
    return 0


if __name__ == "__main__":
    sys.exit(main())
