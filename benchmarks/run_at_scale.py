"""`prism run` at scale: the wall time of one command from program to report, and how fast the
report it writes opens in Chromium.

    .venv/bin/python benchmarks/run_at_scale.py [--world 1024] [--devices cpu] [--work DIR] [--tag NAME]
        [--tp 2] [--pp 2] [--layers 2] [--global-batch N] [--sandbox RANKS]
        [--ep 8 --num-experts 8 --routing FILE]

Runs `prism run --world N --layout tp=TP,pp=PP[,ep=EP] --sandbox N-1` on examples/gpt3d.py (tiny
model, dense or MoE; global batch N unless given), then opens OUT/report.html in headless Chromium (Debian's
/usr/bin/chromium through playwright) twice and times each open until the first frame painted
after the load event; saves a screenshot beside the results. The largest process's peak RSS is
the kernel's figure for the command's descendants (``RUSAGE_CHILDREN``). Writes
benchmarks/results/run_at_scale_<tag>.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

from emulate_bootstrap import assistant_fields

ROOT = Path(__file__).resolve().parents[1]
GPT3D = str(ROOT / "examples" / "gpt3d.py")
RESULTS = ROOT / "benchmarks" / "results"
PRISM = str(Path(sys.executable).with_name("prism"))
CHROMIUM = "/usr/bin/chromium"


def open_times(report: Path, screenshot: Path) -> list[float]:
    from playwright.sync_api import sync_playwright

    times = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        try:
            for _ in range(2):  # the first open also warms the browser's caches
                page = browser.new_page(viewport={"width": 1280, "height": 900})
                errors: list[str] = []
                page.on("pageerror", lambda e, errors=errors: errors.append(str(e)))
                t0 = time.perf_counter()
                page.goto(report.as_uri(), wait_until="load")
                page.evaluate("() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")
                times.append(round(time.perf_counter() - t0, 3))
                if errors:
                    raise SystemExit(f"{report}: script errors: {errors}")
                page.screenshot(path=str(screenshot), full_page=True)
                page.close()
        finally:
            browser.close()
    return times


def gb(by_stage: dict) -> str:
    return ", ".join(f"{k} {v / 1e9:.2f}" for k, v in by_stage.items() if v is not None) or "-"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=1024)
    ap.add_argument("--devices", default="cpu")
    ap.add_argument("--work", default="out/run_at_scale")
    ap.add_argument("--tag", default=None)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--global-batch", type=int, default=None, help="default: the world size")
    ap.add_argument("--ep", type=int, default=1, help="expert parallel size (an MoE layout with --num-experts)")
    ap.add_argument("--num-experts", type=int, default=0, help="experts per MoE layer (0: dense)")
    ap.add_argument(
        "--routing",
        default=None,
        help="MoE: force this routing file on gpt3d's Router (prism run --router-module Router --routing FILE); without "
        "one a slice's routing is its generated values' and leaves the captured graph",
    )
    ap.add_argument("--sandbox", default=None, help="default: the last rank")
    ap.add_argument("--parallel", type=int, default=None, help="prism run --parallel (default: its own)")
    ap.add_argument(
        "--machine", default=platform.node(), help="what the results name as the machine (default: host name)"
    )
    ap.add_argument("--no-browser", action="store_true", help="do not open the report (a machine without Chromium)")
    a = ap.parse_args()
    tag = a.tag or f"{a.devices.split(':')[0]}_{a.world}"
    out = Path(a.work) / tag
    prog = [GPT3D, "--tp", str(a.tp), "--pp", str(a.pp), "--layers", str(a.layers), "--hidden", "32",
            "--heads", "4", "--seq", "16", "--vocab", "128", "--micro-batch", "1",
            "--global-batch", str(a.global_batch or a.world), "--iters", "3"]  # fmt: skip
    if a.num_experts:
        prog += ["--num-experts", str(a.num_experts), "--ep", str(a.ep)]
    layout = f"tp={a.tp},pp={a.pp}" + (f",ep={a.ep}" if a.ep > 1 else "")
    cmd = [PRISM, "run", "--world", str(a.world), "--layout", layout,
           "--sandbox", a.sandbox or str(a.world - 1), "--devices", a.devices, "--out", str(out), "--force",
           *(["--parallel", str(a.parallel)] if a.parallel else []),
           *(["--router-module", "Router", "--routing", a.routing] if a.routing else []), "--", *prog]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.monotonic() - t0
    if p.returncode != 0:
        raise SystemExit(f"prism run failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    state = json.loads((out / "run.json").read_text())
    emulate_log = (out / "logs" / "emulate.log").read_text(errors="replace").splitlines()
    report = (out / "report.html").resolve()
    RESULTS.mkdir(parents=True, exist_ok=True)
    shot = RESULTS / f"run_at_scale_{tag}.png"
    times = [None, None] if a.no_browser else open_times(report, shot)
    result = {
        "benchmark": "run_at_scale",
        "machine": a.machine,
        "command": ["prism", *cmd[1:]],
        "wall_s": round(wall, 1),
        "stages_s": {st["name"]: st["wall_s"] for st in state.get("stages", [])},
        # the prism process's own peak in each stage (run.json); the largest of every process
        # the command started: RUSAGE_CHILDREN (a child forked from it may count its RSS too), or the
        # prism process's largest stage, which the kernel's figure misses (the process sets its peak
        # back at each stage, and the kernel keeps the last stage's)
        "stages_peak_rss_bytes": {st["name"]: st.get("peak_rss_bytes") for st in state.get("stages", [])},
        "largest_process_rss_bytes": max(
            resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
            *(st.get("peak_rss_bytes") or 0 for st in state.get("stages", [])),
        ),
        # each assistant's own last line: its peak RSS and (GPU) its tensors' peak reservation
        "assistants": [assistant_fields(line) for line in emulate_log if line.startswith("prism assistant")],
        "summary_lines": len(p.stdout.splitlines()),
        "report_bytes": report.stat().st_size,
        "report_open_s": times,
    }
    (RESULTS / f"run_at_scale_{tag}.json").write_text(json.dumps(result, indent=1) + "\n")
    md = [
        f"# prism run at {a.world} ranks ({a.devices})",
        "",
        "| world | wall s | stages s | prism process peak GB by stage | largest process GB | summary lines "
        "| report MB | report opens in s (cold, warm) |",
        "|---|---|---|---|---|---|---|---|",
        f"| {a.world} | {result['wall_s']} | {result['stages_s']} | {gb(result['stages_peak_rss_bytes'])} | "
        f"{result['largest_process_rss_bytes'] / 1e9:.2f} | {result['summary_lines']} | "
        f"{result['report_bytes'] / 1e6:.2f} | {times[0]}, {times[1]} |",
        "",
        "Assistants: "
        + "; ".join(
            f"RSS {x['assistant_rss_bytes'] / 2**20:.0f} MiB"
            + (
                f", GPU reserved {x['assistant_gpu_reserved_bytes'] / 2**20:.0f} MiB"
                if "assistant_gpu_reserved_bytes" in x
                else ""
            )
            for x in result["assistants"]
            if x
        ),
    ]
    (RESULTS / f"run_at_scale_{tag}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    print(p.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
