"""Solo capture vs real run (structure): for gpt3d layouts at N ranks, the bare graph that
`prism capture --mode solo` writes must equal the graph recorded from the real N-process run.

    python benchmarks/solo_structure.py --world 8 --world 16 [--layout-filter NAME]
        [--variants layout,nolayout,gen] [--devices 2] [--keep DIR]
        [--out benchmarks/results/solo_structure_cpu.json]

Per world N and layout: the real run (`prism record --nproc N`, gloo, CPU processes), then
solo captures of the same command line (`prism capture --mode solo --world N --parallel G`),
each judged by `prism compare REAL SOLO --json --structure-only` (same ops, order, groups,
sizes, splits, peers on every rank). Capture variants:

- ``layout``: with the ``--layout`` hint (one representative per (tp, cp, ep, pp) coordinate;
  the DP / expert-DP replicas are renamed copies);
- ``nolayout``: every rank runs (skipped where the layout already runs every rank);
- ``gen`` (MoE only, not in the default set): ``layout`` without the recorded tensors.

MoE layouts route tokens by value, so their real run saves every collective's output
(`prism record --save-tensors all`) and their captures replay it (`--tensors`); dense layouts
use the tensor generator's default rules only.

Figures: equal yes/no, the first difference (rank, comm index, field, op, group), the ranks
whose communication differs at all, wall time of record and capture, ranks actually run,
nodes and bytes on disk. Results are written after every case (JSON, and a Markdown table
beside it with the same name), so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from capture_scale import du
from tracing_overhead import machine

ROOT = Path(__file__).resolve().parents[1]
GPT3D = str(ROOT / "examples" / "gpt3d.py")
PRISM = str(Path(sys.executable).with_name("prism"))
RESULTS = ROOT / "benchmarks" / "results"
# The tiny sizes of tests/test_record_gpt3d.py (SIZES) and tests/test_capture_solo.py.
SIZES = [
    "--layers",
    "4",
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
VARIANTS = ("layout", "nolayout", "gen")
TIMEOUT_S = 900


@dataclasses.dataclass(frozen=True)
class Case:
    """One gpt3d layout. The global batch is the world size: at N=8 it is the tests' 8, and the
    micro-batches per DP rank stay the same as DP grows with N."""

    name: str
    flags: tuple[str, ...]
    layout: str  # the --layout hint of the capture
    tp: int = 1
    pp: int = 1
    moe: bool = False

    def args(self, world: int) -> list[str]:
        return [*self.flags, "--global-batch", str(world)]

    def dp(self, world: int) -> int:
        return world // (self.tp * self.pp)

    def title(self, world: int) -> str:
        ep = re.search(r"ep=(\d+)", self.layout)
        dp = self.dp(world)
        parts = [
            f"TP{self.tp}" if self.tp > 1 else "",
            f"PP{self.pp}" if self.pp > 1 else "",
            "VPP2" if "--vpp" in self.flags else "",
            f"DP{dp}",
            f"EP{ep.group(1)}" if ep else "",
        ]
        extra = " dist-opt" if "--dist-opt" in self.flags else ""
        if self.moe:
            extra += f" MoE {self.flags[self.flags.index('--num-experts') + 1]} experts"
        return "·".join(p for p in parts if p) + extra


CASES = [
    Case("tp2pp2", ("--tp", "2", "--pp", "2"), "tp=2,pp=2", tp=2, pp=2),
    Case("pp4", ("--pp", "4"), "pp=4", pp=4),
    Case("pp2vpp2_distopt", ("--pp", "2", "--vpp", "2", "--dist-opt"), "pp=2,vpp=2", pp=2),
    Case("tp2ep4_moe", ("--tp", "2", "--num-experts", "8", "--topk", "2", "--ep", "4"), "tp=2,ep=4", tp=2, moe=True),
    Case(
        "tp2pp2ep2_moe",
        ("--tp", "2", "--pp", "2", "--num-experts", "4", "--topk", "2", "--ep", "2"),
        "tp=2,pp=2,ep=2",
        tp=2,
        pp=2,
        moe=True,
    ),
]


def run(cmd: list[str]) -> tuple[int, str, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    print("  $ " + " ".join(cmd), file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=TIMEOUT_S)
        rc, out = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        rc, out = 124, f"timed out after {TIMEOUT_S} s\n{e.stdout or ''}{e.stderr or ''}"
    return rc, out, time.perf_counter() - t0


def representatives(layout: str | None, world: int) -> list[int]:
    from prismllm.layout import Layout, replica_plan

    return replica_plan(Layout.parse(layout, world), world).representatives


def graph_figures(path: Path) -> dict:
    m = json.loads((path / "manifest.json").read_text())
    import pyarrow.parquet as pq

    nodes = pq.read_metadata(path / "nodes.parquet").num_rows
    return {"nodes": nodes, "graph_bytes": du(path), "manifest": m}


def comm_by_rank(path: Path) -> dict[int, list[tuple]]:
    """Per rank, the tuple of compared fields of each communication node, in program order,
    groups by their ranks (what prismllm.trace.compare compares)."""
    from prismllm.trace import PrismTrace
    from prismllm.trace.compare import FIELDS

    t = PrismTrace.load(path)
    ranks_of = {gid: tuple(g["ranks"]) for gid, g in t.group_info().items()}
    out = {}
    for r in t.ranks().tolist():
        rows = t.nodes_of(r).to_pylist()
        out[r] = [
            tuple(
                ranks_of.get(n["group"], ()) if f == "group" else (tuple(n[f]) if isinstance(n[f], list) else n[f])
                for f in FIELDS
            )
            for n in sorted(rows, key=lambda n: n["index"])
            if n["kind"] == "comm"
        ]
    return out


def differing(real: Path, solo: Path) -> dict:
    """The ranks whose communication differs anywhere, and which fields differ."""
    from prismllm.trace.compare import FIELDS

    a, b = comm_by_rank(real), comm_by_rank(solo)
    ranks, fields = [], set()
    for r in sorted(set(a) | set(b)):
        x, y = a.get(r, []), b.get(r, [])
        if x == y:
            continue
        ranks.append(r)
        if len(x) != len(y):
            fields.add("count")
        for nx, ny in zip(x, y):
            fields.update(f for f, vx, vy in zip(FIELDS, nx, ny) if vx != vy)
    return {"differing_ranks": ranks, "differing_fields": sorted(fields)}


def judge(real: Path, solo: Path) -> dict:
    rc, out, _ = run([PRISM, "compare", str(real), str(solo), "--json", "--structure-only"])
    if rc not in (0, 1):
        return {"equal": None, "compare_error": out[-2000:]}
    s = json.loads(out[out.index("{") :])["structure"]
    res = {"equal": s["equal"]}
    fd = s["first_difference"]
    if fd is not None:
        res["first_difference"] = fd
        res.update(differing(real, solo))
    return res


def short_difference(fd: dict) -> str:
    if "node_a" not in fd:
        return fd.get("message", "")
    n = fd["node_a"] or fd["node_b"]
    return (
        f"rank {fd['rank']} comm #{fd['comm_index']} {n['op']} on ranks {n['group']['ranks']}: "
        f"{fd['field']} {fd['a']} (real) vs {fd['b']} (solo)"
    )


def capture_variant(case: Case, world: int, variant: str, real: Path, work: Path, devices: int) -> dict:
    layout = None if variant == "nolayout" else case.layout
    tensors = real / "tensors" if case.moe and variant != "gen" else None
    out = work / f"{case.name}-{world}-{variant}"
    cmd = [
        PRISM,
        "capture",
        "--mode",
        "solo",
        "--world",
        str(world),
        "--devices",
        "cpu",
        "--parallel",
        str(devices),
        "--out",
        str(out),
        "--force",
    ]
    if layout:
        cmd += ["--layout", layout]
    if tensors:
        cmd += ["--tensors", str(tensors)]
    cmd += ["--", GPT3D, *SIZES, *case.args(world)]
    rc, text, wall = run(cmd)
    res: dict = {
        "variant": variant,
        "layout_hint": layout,
        "tensors": bool(tensors),
        "rc": rc,
        "wall_s": round(wall, 1),
    }
    if rc != 0:
        res["error"] = text[-2000:]
        return res
    g = graph_figures(out)
    cap = g.pop("manifest")["capture"]
    res.update(
        ranks_run=cap["ranks_run"],
        representatives=cap["representatives"],
        run_s=cap["run_wall_s"],
        all_to_all_reconciled=cap["all_to_all_reconciled"],
        **g,
    )
    res.update(judge(real, out))
    if res.get("differing_ranks"):
        reps = set(cap["representatives"])
        res["differing_ranks_are_replicas"] = all(r not in reps for r in res["differing_ranks"])
    return res


def run_case(case: Case, world: int, variants: list[str], work: Path, devices: int, keep: bool) -> dict:
    real = work / f"{case.name}-{world}-real"
    res: dict = {
        "case": case.name,
        "title": case.title(world),
        "world": world,
        "gpt3d_args": case.args(world),
        "layout_hint": case.layout,
        "moe": case.moe,
    }
    cmd = [PRISM, "record", "--nproc", str(world), "--devices", "cpu", "--out", str(real), "--force"]
    if case.moe:
        cmd += ["--save-tensors", "all"]
    rc, text, wall = run(cmd + ["--", GPT3D, *SIZES, *case.args(world)])
    rec = {"rc": rc, "wall_s": round(wall, 1)}
    if rc != 0:
        rec["error"] = text[-2000:]
        res["record"] = rec
        return res
    g = graph_figures(real)
    g.pop("manifest")
    rec.update(g)
    if case.moe:
        rec["tensor_store_bytes"] = du(real / "tensors")
        rec["graph_bytes"] -= rec["tensor_store_bytes"]
    res["record"] = rec
    res["captures"] = []
    everyone = len(representatives(case.layout, world)) == world
    for v in variants:
        if v == "gen" and not case.moe:
            continue
        if v == "nolayout" and everyone:
            res["captures"].append({"variant": v, "skipped": "the layout hint already runs every rank"})
            continue
        c = capture_variant(case, world, v, real, work, devices)
        print(
            f"  [{case.name} N={world} {v}] "
            + json.dumps({k: c.get(k) for k in ("rc", "wall_s", "ranks_run", "equal", "differing_ranks")}),
            file=sys.stderr,
            flush=True,
        )
        res["captures"].append(c)
        if not keep:
            shutil.rmtree(work / f"{case.name}-{world}-{v}", ignore_errors=True)
    if not keep:
        shutil.rmtree(real, ignore_errors=True)
    return res


VARIANT_TEXT = {"layout": "--layout", "nolayout": "every rank", "gen": "--layout, no store"}


def markdown(result: dict) -> str:
    m = result["meta"]
    lines = [
        "# Solo capture vs real run (structure), examples/gpt3d.py on CPU",
        "",
        f"{m['host']}: {m['cpus']} CPUs, python {m['python']}, torch {m['torch']}, "
        f"OMP_NUM_THREADS=1; {result['date']}; prismllm {m['commit'][:7]}"
        f"{' + uncommitted changes' if m['dirty'] else ''}. Capture runs G = {m['devices']} ranks "
        f"at a time. gpt3d `{' '.join(SIZES)} --global-batch N`. MoE: real run with "
        '`--save-tensors all`, capture with `--tensors` (except "no store").',
        "",
        "| N | layout | capture | ranks run | record s | capture s | nodes | graph KB real / solo | equal | first difference (differing ranks) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["results"]:
        rec = r.get("record", {})
        head = f"| {r['world']} | {r['case']}: {r['title']} |"
        if rec.get("rc"):
            err = rec["error"].strip().splitlines()[-1][:100] if rec.get("error") else ""
            lines.append(f"{head} real run failed (rc {rec['rc']}): {err} | | | | | | | |")
            continue
        for c in r.get("captures", []):
            what = VARIANT_TEXT[c["variant"]]
            if "skipped" in c:
                lines.append(f"{head} {what} | – | {rec['wall_s']:.1f} | – | | | | skipped: {c['skipped']} |")
                continue
            if c["rc"]:
                err = c["error"].strip().splitlines()[-1][:100] if c.get("error") else ""
                lines.append(f"{head} {what} | | {rec['wall_s']:.1f} | {c['wall_s']:.1f} | | | failed | {err} |")
                continue
            eq = {True: "yes", False: "**no**", None: "compare failed"}[c["equal"]]
            diff = ""
            if c.get("first_difference"):
                diff = short_difference(c["first_difference"])
                diff += f" ({len(c['differing_ranks'])} ranks: {c['differing_ranks']}"
                diff += f"; fields {', '.join(c['differing_fields'])}"
                if c.get("differing_ranks_are_replicas"):
                    diff += "; all replicas, no representative"
                diff += ")"
            nodes = f"{c['nodes']:,}" if c["nodes"] == rec["nodes"] else f"{rec['nodes']:,} / {c['nodes']:,}"
            lines.append(
                f"{head} {what} | {c['ranks_run']} of {r['world']} | {rec['wall_s']:.1f} | {c['wall_s']:.1f} | "
                f"{nodes} | {rec['graph_bytes'] / 1e3:.0f} / {c['graph_bytes'] / 1e3:.0f} | {eq} | {diff} |"
            )
    return "\n".join(lines) + "\n"


def git_state() -> tuple[str, bool]:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "prismllm", "examples"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        return head, bool(dirty)
    except OSError:
        return "", False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, action="append", help="world size N (repeat); default 8")
    ap.add_argument(
        "--layout-filter",
        action="append",
        default=None,
        metavar="NAME",
        help=f"run only case NAME, or those whose name contains NAME (repeat); cases: {', '.join(c.name for c in CASES)}",
    )
    ap.add_argument("--variants", default="layout,nolayout", help=f"capture variants, from {', '.join(VARIANTS)}")
    ap.add_argument("--devices", type=int, default=2, help="ranks a capture runs at a time")
    ap.add_argument("--keep", default=None, metavar="DIR", help="keep the graphs in DIR")
    ap.add_argument(
        "--out",
        default=str(RESULTS / "solo_structure_cpu.json"),
        help="JSON results path (the .md table is written beside it)",
    )
    a = ap.parse_args(argv)
    worlds = a.world or [8]
    variants = [v for v in a.variants.split(",") if v]
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        ap.error(f"unknown variant(s) {bad}; known: {', '.join(VARIANTS)}")
    names = {c.name for c in CASES}
    cases = [
        c
        for c in CASES
        if not a.layout_filter or any(f == c.name if f in names else f in c.name for f in a.layout_filter)
    ]
    if not cases:
        ap.error(f"--layout-filter matches no case; cases: {', '.join(c.name for c in CASES)}")
    from prismllm.errors import PrismError
    from prismllm.layout import Layout

    for w in worlds:
        for c in cases:
            try:
                Layout.parse(c.layout, w)
            except PrismError as e:
                ap.error(f"case {c.name} at --world {w}: {e}")
    head, dirty = git_state()
    meta = {
        **machine(),
        "commit": head,
        "dirty": dirty,
        "devices": a.devices,
        "omp_num_threads": 1,
        "gpt3d_sizes": SIZES,
        "variants": variants,
    }
    result = {"benchmark": "solo_structure", "date": time.strftime("%Y-%m-%d"), "meta": meta, "results": []}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="prism-solo-structure-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    try:
        for w in worlds:
            for c in cases:
                print(f"[{c.name} N={w}]", file=sys.stderr, flush=True)
                result["results"].append(run_case(c, w, variants, work, a.devices, bool(a.keep)))
                result["total_wall_s"] = round(time.perf_counter() - t0, 1)
                meta["load_average_1min_at_end"] = round(os.getloadavg()[0], 1)
                out.write_text(json.dumps(result, indent=1) + "\n")
                out.with_suffix(".md").write_text(markdown(result))
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(markdown(result))
    ok = all(
        c.get("equal")
        for r in result["results"]
        for c in r.get("captures", [])
        if "skipped" not in c and c["variant"] != "gen"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
