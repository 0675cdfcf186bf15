"""Wall time of the whole pipeline against logical world size: `prism demo`'s pipeline
(capture solo -> time -> calibrate -> emulate with one real rank) on gpt3d TP2 x PP2 x DP(N/4),
for N = 64 ... 1024, one fresh run per N; per stage wall time and the figures it produced.

    python benchmarks/pipeline_cost.py [--worlds 64,256,1024] [--devices cpu|cuda]
        [--json benchmarks/results/pipeline_cost_<machine>.json]

Only the representatives of the DP replicas run in capture and time (4 ranks whatever N), so
what grows with N is the graph (assembly, calibration) and the assistant's replay.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from tracing_overhead import machine

from prismllm.demo import DemoOptions, run_demo


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="64,256,1024")
    ap.add_argument("--devices", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    rows = []
    out_json = Path(a.json) if a.json else None
    with tempfile.TemporaryDirectory(prefix="prism-pipeline-") as work:
        for n in (int(w) for w in a.worlds.split(",")):
            t0 = time.monotonic()
            try:
                f = run_demo(DemoOptions(out=Path(work) / f"n{n}", world=n, devices=a.devices))
                row = {"world": n, **{k: f[k] for k in ("stage_wall_s", "total_wall_s", "predicted_iteration_ns",
                                                          "emulated_iteration_ns")}}
            except Exception as e:  # noqa: BLE001 - one failing N is a row, the others go on
                row = {"world": n, "error": str(e)[-800:], "wall_s": round(time.monotonic() - t0, 1)}
            rows.append(row)
            print(json.dumps(row), flush=True)
            if out_json:
                out_json.write_text(json.dumps({"machine": machine(), "devices": a.devices, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
