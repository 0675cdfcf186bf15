"""Wall time of the whole pipeline against logical world size: `prism run` (capture solo -> time ->
calibrate -> emulate with the last rank real -> report) on gpt3d TP2 x PP2 x DP(N/4), for
N = 64 ... 1024, one fresh run per N; per stage wall time and the figures it produced.

    python benchmarks/pipeline_cost.py [--worlds 64,256,1024] [--devices auto|cpu|cuda]
        [--json benchmarks/results/pipeline_cost_<machine>.json]

Only the representatives of the DP replicas run in capture and time (4 ranks whatever N), so
what grows with N is the graph (assembly, calibration), the assistant's replay and the report.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from tracing_overhead import machine

from prismllm.pipeline.run import RunOptions, run_pipeline

ROOT = Path(__file__).resolve().parents[1]
ARGS = [
    "--tp",
    "2",
    "--pp",
    "2",
    "--layers",
    "2",
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
]  # + --global-batch max(32, N): 4+ micro-batches


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="64,256,1024")
    ap.add_argument("--devices", default="cpu")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    rows = []
    out_json = Path(a.json) if a.json else None
    with tempfile.TemporaryDirectory(prefix="prism-pipeline-") as work:
        for n in (int(w) for w in a.worlds.split(",")):
            t0 = time.monotonic()
            try:
                s = run_pipeline(
                    RunOptions(
                        world=n,
                        out=Path(work) / f"n{n}",
                        script=str(ROOT / "examples" / "gpt3d.py"),
                        args=[*ARGS, "--global-batch", str(max(32, n))],
                        layout="tp=2,pp=2",
                        devices=a.devices,
                        sandbox=str(n - 1),
                    )
                )
                emulated = next(iter((s["emulated"] or {}).values()), {})
                row = {
                    "world": n,
                    "stage_wall_s": {x["name"]: x["wall_s"] for x in s["stages"]},
                    "total_wall_s": round(time.monotonic() - t0, 2),
                    "predicted_iteration_ns": s["predicted_iteration_ns"],
                    "emulated_iteration_ns": emulated.get("iteration_ns"),
                    "report_bytes": Path(s["report"]).stat().st_size,
                }
            except Exception as e:  # noqa: BLE001 - one failing N is a row, the others go on
                row = {"world": n, "error": str(e)[-800:], "wall_s": round(time.monotonic() - t0, 1)}
            rows.append(row)
            print(json.dumps(row), flush=True)
            if out_json:
                out_json.write_text(
                    json.dumps({"machine": machine(), "devices": a.devices, "rows": rows}, indent=1) + "\n"
                )


if __name__ == "__main__":
    main()
