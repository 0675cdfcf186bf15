"""`prism whatif` against reality: slow one labelled span of a real program by a known amount, run
it for real, and compare the real change of the iteration time with what `prism whatif` predicts
from the calibration of the unchanged run.

    .venv/bin/python benchmarks/whatif_check.py [--devices cpu|cuda] [--nproc N] [--spin-ms D]
        [--label mlp] [--pairs P] [--work DIR] [--tag NAME] [-- GPT3D ARGS]

For each of P pairs (alternating, so that drift of the machine falls on both sides): `prism record`
of examples/gpt3d.py --labels (A) and of the same with --spin LABEL=D (B: every LABEL span first
spins D ms, a busy CPU or a GPU spin kernel). A is calibrated; `prism whatif` adds D ms to A's
spans `op=compute,label=LABEL`; with 2 ranks or more, `prism whatif --spin LABEL=D` also measures
the change (A's graph timed again with the spin). Real iteration: the recording's median steady
iteration.
Reported per pair and as medians: real A, real B, the real change B - A, the calibrated A, the
what-if, its change, and the errors: of the change (what-if change vs real change, relative to
the real change) and of the new time (what-if vs real B). Writes
benchmarks/results/whatif_check_<tag>.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.tracing_overhead import machine  # noqa: E402

GPT3D = str(ROOT / "examples" / "gpt3d.py")
RESULTS = ROOT / "benchmarks" / "results"
PRISM = str(Path(sys.executable).with_name("prism"))
DEFAULT_ARGS = ["--tp", "2", "--layers", "4", "--hidden", "256", "--heads", "8", "--seq", "128",
                "--micro-batch", "4", "--global-batch", "16", "--iters", "6"]  # fmt: skip


def prism(*args: str, env: dict) -> dict:
    p = subprocess.run([PRISM, *args], capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise SystemExit(f"prism {' '.join(args)} failed:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    return json.loads(p.stdout) if "--json" in args else {}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", default="cpu")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--spin-ms", type=float, default=5.0)
    ap.add_argument("--label", default="mlp", choices=["mlp", "attention"])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--work", default="out/whatif_check")
    ap.add_argument("--tag", default=None)
    ap.add_argument("gpt3d_args", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    extra = a.gpt3d_args[1:] if a.gpt3d_args[:1] == ["--"] else a.gpt3d_args
    args = (extra or DEFAULT_ARGS) + ["--labels"]
    tag = a.tag or a.devices.split(":")[0]
    work = Path(a.work) / tag
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    # imported here: the script's --help needs no torch
    from prismllm.calibrate.whatif import parse_change, whatif

    change = parse_change(f"op=compute,label={a.label}:+{a.spin_ms:g}ms")
    spin = f"{a.label}={a.spin_ms:g}"
    pairs = []
    for i in range(a.pairs):
        row: dict = {"pair": i}
        for side, more in (("A", []), ("B", ["--spin", spin])):
            g, cal = work / f"{side}{i}", work / f"cal{side}{i}"
            rec = ["record", "--nproc", str(a.nproc), "--devices", a.devices, "--out", str(g), "--force"]
            t0 = time.monotonic()
            prism(*rec, "--", GPT3D, *args, *more, env=env)
            s = prism("calibrate", str(g), "--out", str(cal), "--force", "--json", env=env)
            row[f"real_{side}_ns"] = s["recorded_iteration_ns"]
            row[f"calibrated_{side}_ns"] = s["predicted_iteration_ns"]
            row[f"wall_{side}_s"] = round(time.monotonic() - t0, 1)
        r = whatif(work / f"calA{i}", [change])
        if a.nproc > 1:  # the measured what-if: A's graph timed again with the spin (a slice needs a virtual rank)
            m = prism("whatif", str(work / f"calA{i}"), "--spin", spin + "ms", "--devices", a.devices,
                      "--out", str(work / f"spin{i}"), "--force", "--json", "--", GPT3D, *args, env=env)  # fmt: skip
            row["measured_whatif_ns"] = m["measured_iteration_ns"]
            row["measured_change_ns"] = m["measured_iteration_ns"] - m["baseline_iteration_ns"]
        row["baseline_ns"] = r["baseline_iteration_ns"]
        row["whatif_ns"] = r["whatif_iteration_ns"]
        row["spans_scaled"] = r["applied"][0]["compute_spans"]
        row["real_change_ns"] = row["real_B_ns"] - row["real_A_ns"]
        row["whatif_change_ns"] = row["whatif_ns"] - row["baseline_ns"]
        row["change_error"] = (row["whatif_change_ns"] - row["real_change_ns"]) / row["real_change_ns"]
        row["new_time_error"] = (row["whatif_ns"] - row["real_B_ns"]) / row["real_B_ns"]
        row["calibrated_B_vs_whatif"] = (row["whatif_ns"] - row["calibrated_B_ns"]) / row["calibrated_B_ns"]
        if "measured_change_ns" in row:
            row["measured_change_error"] = (row["measured_change_ns"] - row["real_change_ns"]) / row["real_change_ns"]
        pairs.append(row)
        print(json.dumps(row), flush=True)
    med = {k: statistics.median(p[k] for p in pairs) for k in pairs[0] if k != "pair"}
    med["change_error_of_medians"] = (
        statistics.median(p["whatif_change_ns"] for p in pairs) - statistics.median(p["real_change_ns"] for p in pairs)
    ) / statistics.median(p["real_change_ns"] for p in pairs)
    result = {
        "benchmark": "whatif_check",
        "machine": machine(),  # host, CPUs, torch, GPU
        "devices": a.devices,
        "nproc": a.nproc,
        "program": ["examples/gpt3d.py", *args],
        "change": change.text,
        "spin_flag": f"--spin {spin}",
        "pairs": pairs,
        "median": med,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"whatif_check_{tag}.json").write_text(json.dumps(result, indent=1) + "\n")

    def ms(x):
        return f"{x / 1e6:.2f}"

    lines = [
        f"# what-if vs reality ({a.devices}, {a.nproc} ranks, {change.text} vs --spin {spin})",
        "",
        "| pair | real A ms | real B ms | real change ms | calibrated A ms | what-if ms | what-if change ms | change error | new-time error | measured (--spin) change ms | its change error |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in pairs + [{"pair": "median", **med}]:
        measured = (
            f"{ms(p['measured_change_ns'])} | {100 * p['measured_change_error']:+.1f} %"
            if "measured_change_ns" in p
            else "– | –"
        )
        lines.append(
            f"| {p['pair']} | {ms(p['real_A_ns'])} | {ms(p['real_B_ns'])} | {ms(p['real_change_ns'])} | "
            f"{ms(p['baseline_ns'])} | {ms(p['whatif_ns'])} | {ms(p['whatif_change_ns'])} | "
            f"{100 * p['change_error']:+.1f} % | {100 * p['new_time_error']:+.1f} % | {measured} |"
        )
    lines.append("")
    lines.append(f"Change error of the medians: {100 * med['change_error_of_medians']:+.1f} %.")
    (RESULTS / f"whatif_check_{tag}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
