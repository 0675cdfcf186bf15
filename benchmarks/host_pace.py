"""Host pace against device time, per rank, of GPU graphs: which ranks were host-bound.

    .venv/bin/python benchmarks/host_pace.py NAME=GRAPH [NAME=GRAPH ...] [--tag TAG]

For each graph (a recording, or the timed graph of `prism time`) and each rank, the medians over
the steady iterations (all but the first) of: the rank's iteration time; its compute and its
communication time (sums of span durations, device clock); its host span (host time from its
first to its last communication call of the iteration); and its host lead (how long before the
device reached a call the host had issued it, `prismllm.trace.summary.host_lead_by_rank`). A lead
of about a launch (0.1 ms) marks a host-bound rank: its compute spans are the host's pace. For a
timed graph also the emulation layer's host time on the rank over the whole run (the manifest's
``timing.emulation_host_ns``). Writes
benchmarks/results/host_pace_<tag>.json and .md. The graphs name the machine they were made on
(their manifest); this script only reads them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"


def per_rank(graph: Path) -> tuple[dict, dict]:
    from prismllm.trace.graph import PrismTrace
    from prismllm.trace.summary import host_lead_by_rank, rank_iteration_times, steady_rows

    t = PrismTrace.load(graph)
    col = {k: t.column(k).astype(np.int64) for k in ("rank", "iteration", "issue_ns", "duration_ns")}
    kind = np.asarray(t.nodes.column("kind").to_pylist())
    steady = steady_rows(col["iteration"], col["iteration"] >= 0)
    lead, iter_ns = host_lead_by_rank(t), rank_iteration_times(t)
    emulation = (t.manifest.get("timing") or {}).get("emulation_host_ns") or {}
    out = {}
    for r in np.unique(col["rank"]):
        mine = steady & (col["rank"] == r)
        row: dict = {"iteration_ns": iter_ns.get(int(r)), "host_lead_ns": lead.get(int(r))}
        for name, sel in (("compute_ns", kind == "compute"), ("comm_ns", kind == "comm")):
            m = mine & sel & (col["duration_ns"] >= 0)
            sums = [col["duration_ns"][m & (col["iteration"] == i)].sum() for i in np.unique(col["iteration"][m])]
            row[name] = int(np.median(sums)) if sums else None
        calls = mine & (kind == "comm") & (col["issue_ns"] >= 0)
        spans = []
        for i in np.unique(col["iteration"][calls]):
            x = col["issue_ns"][calls & (col["iteration"] == i)]
            spans.append(int(x.max() - x.min()))
        row["host_span_ns"] = int(np.median(spans)) if spans else None
        if str(int(r)) in emulation:
            row["emulation_host_ns_whole_run"] = int(emulation[str(int(r))])
        out[str(int(r))] = row
    m = t.manifest
    made_on = {"gpus": m.get("gpus"), "versions": m.get("versions"), "created": m.get("created"), "mode": m.get("mode")}
    return out, made_on


def ms(ns: int | None) -> str:
    return "–" if ns is None else f"{ns / 1e6:.2f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("graphs", nargs="+", metavar="NAME=GRAPH")
    ap.add_argument("--tag", default="gpu")
    a = ap.parse_args()
    rows, lines = {}, []
    lines.append("| graph | rank | iteration ms | compute ms | comm ms | host span ms | host lead ms |")
    lines.append("|---|---|---|---|---|---|---|")
    for spec in a.graphs:
        name, _, path = spec.partition("=")
        if not path:
            raise SystemExit(f"host_pace: {spec!r}: give NAME=GRAPH")
        ranks, made_on = per_rank(Path(path))
        rows[name] = {"graph": path, "made_on": made_on, "ranks": ranks}
        for r, x in ranks.items():
            lines.append(
                f"| {name} | {r} | {ms(x['iteration_ns'])} | {ms(x['compute_ns'])} | {ms(x['comm_ns'])} | "
                f"{ms(x['host_span_ns'])} | {ms(x['host_lead_ns'])} |"
            )
    table = "\n".join(lines)
    print(table)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"host_pace_{a.tag}.json").write_text(json.dumps({"benchmark": "host_pace", "graphs": rows}, indent=1))
    (RESULTS / f"host_pace_{a.tag}.md").write_text(f"# host pace against device time ({a.tag})\n\n{table}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
