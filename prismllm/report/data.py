"""What a report shows, gathered from the files the stages wrote (a report never runs a stage).

``collect(run_dir)`` reads a ``prism run`` directory: ``bare/`` (the capture: layout, per-rank
peak memory), ``cal/`` (the calibration: ``summary.json``, ``calibrated.parquet``, and ``graph/``
for what each node is), ``emulate/emulate.json`` when the run emulated, and ``run.json`` (stage
wall times). It returns one JSON-able dict, the report's data model (``docs/commands/report.md``):

- ``title``, ``command``, ``world_size``, ``layout``, ``device``, ``created``, ``prismllm``;
- ``stages``: [{name, wall_s, what}];
- ``prediction``: the predicted (steady median) iteration time and every iteration's;
- ``breakdown``: per rank of the median iteration, compute / exposed communication / P2P wait /
  idle and the span (the calibration's per_rank);
- ``bubble``, ``critical_path`` (the median iteration's: total, shares by kind, end rank, ranks
  visited) and ``critical_paths`` (every iteration's, the same keys; the median's alone from a
  calibration that kept no other);
- ``memory``: peak bytes per rank (-1 unknown), the largest and where, and a grid PP stage x
  model-parallel coordinate (ep, cp, tp, those of size > 1; ``cols``, ``col_labels``) with the
  data-parallel replicas folded (max over them);
- ``timeline``: a few ranks' spans in each iteration of ``critical_paths`` (``iteration``: the
  one shown first, the median), ``[lane, kind, start_ns, end_ns, name, critical]``: lane 0 the
  rank's program (compute, and the blocking calls it waits in), lane 1 its asynchronous
  communication; kinds ``compute``, ``wait`` (arrived, waiting for the group's last member) and
  ``comm`` (the transfer); times from the iteration's begin; critical 1 on its critical path;
- ``perfetto``: the Perfetto traces in the run directory (``prism export``), linked from the page;
- ``communicators`` and ``emulation`` from the emulation; ``reference``: predicted against a real
  recorded run, per rank (``--reference``);
- ``compare``: this run's figures beside another run's (``--compare``, :func:`compare`).
"""

from __future__ import annotations

import datetime
import itertools
import os
from pathlib import Path
from typing import Any
from urllib.parse import quote

import numpy as np

from prismllm import __version__
from prismllm.errors import InputError, PrismError
from prismllm.fsutil import read_json
from prismllm.layout import Layout
from prismllm.outputs import (
    BARE_DIR,
    CAL_DIR,
    EMULATE_DIR,
    EMULATE_FILE,
    GRAPH_DIR,
    REPORT_FILE,
    RUN_FILE,
    SUMMARY_FILE,
)
from prismllm.trace.graph import PrismTrace, group_desc, ranks_text, read_manifest, read_rows_of_ranks
from prismllm.trace.summary import WARMUP, steady_iteration_time, steady_rows

FORMAT = "prism-report"
MAX_TIMELINE_RANKS = 8
# The memory grid's column dimensions, slowest first (tp fastest, as in the rank order).
GRID_COLS = ("ep", "cp", "tp")
# How a file of `prism export --perfetto` begins (prismllm.trace.perfetto writes it so); the
# protobuf export is known by its suffix.
PERFETTO_JSON_HEAD = b'{"traceEvents":'
PERFETTO_PROTO_SUFFIX = ".pftrace"


def collect(
    run_dir: str | Path,
    reference: str | Path | None = None,
    ranks: list[int] | None = None,
    against: str | Path | None = None,
    timeline: bool = True,
    page: str | Path | None = None,
) -> dict[str, Any]:
    """The report's data for a ``prism run`` directory (see the module docstring). ``ranks``:
    the timeline's ranks (default one per pipeline stage); ``against``: another run directory
    whose figures go beside this one's (``compare``); ``timeline=False``: no timeline (which reads
    the calibrated graph: the other run of a comparison shows none); ``page``: where the page
    goes (default DIR/report.html), which the links to the run's files are relative to."""
    run_dir = Path(run_dir)
    cal = run_dir / CAL_DIR
    summary = read_json(cal / SUMMARY_FILE)
    if summary is None or summary.get("format") != "prism-calibration":
        raise InputError(
            f"{run_dir} holds no calibration ({CAL_DIR}/{SUMMARY_FILE}): `prism report` reads the "
            f"directory of a `prism run` that got at least as far as calibrate"
        )
    bare = read_manifest(run_dir / BARE_DIR) if (run_dir / BARE_DIR).is_dir() else {}
    world = int(summary["world_size"])
    layout = Layout.parse(bare.get("layout"), world) if bare.get("layout") else None
    run = read_json(run_dir / RUN_FILE) or {}
    emu = read_json(run_dir / EMULATE_DIR / EMULATE_FILE)
    command = list(bare.get("command") or run.get("command") or [])
    # every iteration's critical path; a calibration from before they were kept has the median's alone
    paths = [cp for cp in summary.get("critical_paths") or [summary.get("critical_path")] if cp]
    data: dict[str, Any] = {
        "format": FORMAT,
        "version": 1,
        "title": f"{Path(command[0]).name if command else 'job'}: {world} ranks"
        + (f" ({_layout_text(layout)})" if layout is not None else ""),
        "command": command,
        "world_size": world,
        "layout": layout.to_dict() if layout is not None else None,
        "device": _device(bare),
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "prismllm": __version__,
        "stages": run.get("stages", []),
        "prediction": {
            "iteration_ns": summary.get("predicted_iteration_ns"),
            "median_iteration": summary.get("median_iteration"),
            "steady_iterations": summary.get("steady_iterations", []),
            "iterations": [
                {"iteration": it["iteration"], "predicted_ns": it["predicted_ns"]}
                for it in summary.get("iterations", [])
            ],
        },
        "breakdown": _breakdown(summary),
        "bubble": summary.get("pipeline_bubble"),
        "critical_path": _critical(summary.get("critical_path")),
        "critical_paths": [_critical(cp) for cp in paths],
        "memory": _memory(bare, world, layout),
        "timeline": _timeline(cal, summary, layout, ranks, paths) if timeline else None,
        "perfetto": _perfetto(run_dir, Path(page) if page is not None else run_dir / REPORT_FILE),
        "communicators": (emu or {}).get("communicators"),
        "emulation": _emulation(emu),
        "reference": _reference(Path(reference), summary, bare) if reference is not None else None,
    }
    if against is not None:
        try:
            other = collect(against, timeline=False)
        except PrismError as e:
            raise type(e)(f"--compare: {e}") from None
        data["compare"] = compare(data, other, str(against))
    else:
        data["compare"] = None
    return data


def _mean(xs: list | None) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _figures(d: dict[str, Any]) -> list[tuple[str, Any, str]]:
    """One run's figures that two runs are compared by: (what, value, kind); kinds "text",
    "layout" (the layout's dict), "count", "ns", "bytes", "share", "s" (seconds)."""
    out: list[tuple[str, Any, str]] = [
        ("Job", d.get("title"), "text"),
        ("Ranks", d.get("world_size"), "count"),
        ("Layout", d.get("layout"), "layout"),
        ("Device", d.get("device"), "text"),
        ("Predicted iteration", (d.get("prediction") or {}).get("iteration_ns"), "ns"),
    ]
    cp = d.get("critical_path") or {}
    out.append(("Critical path", cp.get("total_ns"), "ns"))
    for kind, ns in sorted((cp.get("by_kind") or {}).items(), key=lambda kv: -kv[1]):
        out.append((f"Critical path: {kind}", ns, "ns"))
    b = d.get("breakdown") or {}
    for key, what in (("compute_ns", "compute"), ("comm_exposed_ns", "exposed communication"),
                      ("p2p_wait_ns", "point-to-point wait"), ("idle_ns", "idle")):  # fmt: skip
        out.append((f"Mean over ranks: {what}", _mean(b.get(key)), "ns"))
    out.append(("Pipeline bubble", (d.get("bubble") or {}).get("fraction"), "share"))
    mx = (d.get("memory") or {}).get("max") or {}
    out.append(("Largest peak memory", mx.get("bytes"), "bytes"))
    out.append(("Largest peak memory: where", mx.get("where"), "text"))
    emu = d.get("emulation") or {}
    for r, m in sorted((emu.get("per_rank") or {}).items(), key=lambda kv: int(kv[0])):
        out.append((f"Emulated iteration, rank {r}", m.get("median_steady_iteration_ns"), "ns"))
    if emu:
        out.append(("Virtual ranks' iteration", emu.get("virtual_ranks_iteration_ns"), "ns"))
    stages = d.get("stages") or []
    for st in stages:
        out.append((f"Stage: {st.get('name')}", st.get("wall_s"), "s"))
    if stages:
        out.append(("All stages", sum(st.get("wall_s") or 0 for st in stages), "s"))
    return out


def compare(a: dict[str, Any], b: dict[str, Any], source: str) -> dict[str, Any]:
    """Run ``a``'s figures beside run ``b``'s (``prism report A --compare B``: two sweep points, a
    job before and after a change): ``rows`` [{what, kind, a, b}] in ``a``'s order, then what
    only ``b`` has (None where a run lacks the figure), and where both measured every rank's peak
    memory, ``memory``: how many ranks' peaks differ and the largest difference."""
    fa, fb = _figures(a), _figures(b)
    va, vb = {w: v for w, v, _ in fa}, {w: v for w, v, _ in fb}
    rows = [{"what": w, "kind": k, "a": v, "b": vb.get(w)} for w, v, k in fa]
    rows += [{"what": w, "kind": k, "a": None, "b": v} for w, v, k in fb if w not in va]
    out: dict[str, Any] = {"source": source, "title": b.get("title"), "command": b.get("command"), "rows": rows}
    ma, mb = a.get("memory") or {}, b.get("memory") or {}
    pa, pb = ma.get("per_rank") or [], mb.get("per_rank") or []
    if ma.get("known") and mb.get("known") and len(pa) == len(pb):
        diff = [(abs(x - y), r, x, y) for r, (x, y) in enumerate(zip(pa, pb)) if x >= 0 and y >= 0 and x != y]
        big = max(diff) if diff else None
        out["memory"] = {
            "ranks": len(pa),
            "differ": len(diff),
            "largest": {"rank": big[1], "a": big[2], "b": big[3]} if big else None,
        }
    return out


def _layout_text(layout: Layout) -> str:
    d = layout.to_dict()
    parts = [f"{k}={d[k]}" for k in ("tp", "cp", "ep", "pp", "dp") if d[k] > 1 or k == "dp"]
    return ", ".join(parts)


def _device(manifest: dict[str, Any]) -> str:
    gpus = manifest.get("gpus")
    if gpus:
        return gpus[0] if len(set(gpus)) == 1 else ", ".join(sorted(set(gpus)))
    dev = manifest.get("device")
    return dev if isinstance(dev, str) else ", ".join(dev or ["cpu"])


def _breakdown(s: dict[str, Any]) -> dict[str, Any] | None:
    pr = s.get("per_rank")
    if not pr:
        return None
    keys = ("rank", "span_ns", "compute_ns", "comm_exposed_ns", "p2p_wait_ns", "idle_ns")
    return {"iteration": pr["iteration"], **{k if k != "rank" else "ranks": pr[k] for k in keys}}


def _critical(cp: dict[str, Any] | None) -> dict[str, Any] | None:
    """A calibration's critical path without its segments (the timeline marks them)."""
    if not cp:
        return None
    return {k: cp[k] for k in ("iteration", "total_ns", "iteration_ns", "end_rank", "ranks_visited", "by_kind")}


def coords_text(layout: Layout | None, rank: int) -> str:
    """ "pp 1 · tp 0" (the dimensions of size > 1), or "rank R" without a layout."""
    if layout is None:
        return f"rank {rank}"
    c = layout.coords(rank)
    sizes = layout.to_dict()
    dims = [d for d in ("pp", "tp", "cp", "ep", "dp") if (sizes["edp"] if d == "dp" else sizes[d]) > 1]
    return " · ".join(f"{d} {c[d]}" for d in dims) or f"rank {rank}"


def _memory(bare: dict[str, Any], world: int, layout: Layout | None) -> dict[str, Any]:
    peaks = bare.get("peak_memory_bytes") or {}
    per_rank = [int(peaks.get(str(r), -1)) for r in range(world)]
    known = [b for b in per_rank if b >= 0]
    out: dict[str, Any] = {
        "per_rank": per_rank,
        "known": bool(known),
        "source": "solo capture: torch.cuda.max_memory_allocated of each rank run alone"
        if known
        else "not measured (a CPU capture has no device memory)",
        "max": None,
        "grid": None,
    }
    if not known:
        return out
    r = int(np.argmax(per_rank))
    out["max"] = {"rank": r, "bytes": per_rank[r], "where": coords_text(layout, r)}
    if layout is not None:
        out["grid"] = memory_grid(layout, np.asarray(per_rank, dtype=np.int64))
    return out


def memory_grid(layout: Layout, per_rank: np.ndarray) -> dict[str, Any]:
    """Peak bytes per pipeline stage (rows) x model-parallel coordinate within the stage
    (columns: the ep, cp, tp coordinates of size > 1, tp fastest; tp alone when none is), max
    over the data-parallel replicas (-1: none known). Only the replicas fold: they run the same
    program, while expert ranks route different tokens, so folding ep would hide MoE skew."""
    sizes = layout.to_dict()
    dims = [d for d in GRID_COLS if sizes[d] > 1] or ["tp"]
    c = layout.coords_array()
    col = np.zeros(layout.world, dtype=np.int64)
    for d in dims:  # mixed radix, the last dimension fastest
        col = col * sizes[d] + c[d]
    grid = np.full((layout.pp, int(np.prod([sizes[d] for d in dims]))), -1, dtype=np.int64)
    np.maximum.at(grid, (c["pp"], col), per_rank)
    labels = [
        " · ".join(f"{d} {k}" for d, k in zip(dims, ks, strict=True))
        for ks in itertools.product(*(range(sizes[d]) for d in dims))
    ]
    if layout.edp == 1:
        folded = "peak of its one rank (no data-parallel replicas to fold)"
    elif layout.ep > 1:  # the ranks of one (pp, ep, cp, tp) coordinate differ in edp alone
        folded = f"max over the {layout.edp} expert-data-parallel replicas"
    else:
        folded = f"max over the {layout.edp} data-parallel replicas"
    return {"rows": "pp", "cols": " · ".join(dims), "col_labels": labels, "values": grid.tolist(), "folded": folded}


def default_ranks(world: int, layout: Layout | None) -> list[int]:
    """One rank per pipeline stage (its first), at most MAX_TIMELINE_RANKS; without a layout the
    first and the last rank and some between."""
    if layout is not None and layout.pp > 1:
        c = layout.coords_array()
        first = np.flatnonzero((c["tp"] == 0) & (c["cp"] == 0) & (c["ep"] == 0) & (c["dp"] == 0))
        stages = sorted(first.tolist(), key=lambda r: int(c["pp"][r]))
        if len(stages) > MAX_TIMELINE_RANKS:
            pick = np.linspace(0, len(stages) - 1, MAX_TIMELINE_RANKS).round().astype(int)
            stages = [stages[i] for i in pick]
        return stages
    n = min(world, MAX_TIMELINE_RANKS if world > 2 else world)
    return sorted({int(x) for x in np.linspace(0, world - 1, n).round()})


def _timeline(
    cal: Path, s: dict[str, Any], layout: Layout | None, ranks: list[int] | None, paths: list[dict[str, Any]]
) -> dict[str, Any] | None:
    """The chosen ranks' spans in each iteration that has a critical path (``paths``, with their
    segments), each iteration's times from its own begin."""
    k = s.get("median_iteration")
    table_path = cal / "calibrated.parquet"
    if k is None or not table_path.is_file() or not (cal / GRAPH_DIR).is_dir():
        return None
    world = int(s["world_size"])
    ranks = sorted(set(ranks)) if ranks else default_ranks(world, layout)
    bad = [r for r in ranks if not 0 <= r < world]
    if bad:
        raise PrismError(f"--ranks: rank {bad[0]} is not in the graph's world of {world}")
    iterations = [int(cp["iteration"]) for cp in paths]
    # the chosen ranks' rows alone: a graph of 131,072 ranks is GBs in memory
    times = read_rows_of_ranks(table_path, ranks)
    graph = PrismTrace.load(cal / GRAPH_DIR, ranks=lambda manifest, groups: ranks)
    rank = times.column("rank").to_numpy()
    it = times.column("iteration").to_numpy()
    sel = np.flatnonzero(np.isin(rank, ranks) & np.isin(it, iterations))
    if not len(sel):
        return None
    rank, it = rank[sel], it[sel]
    node_id = times.column("node_id").to_numpy()[sel]
    start = times.column("start_ns").to_numpy()[sel]
    end = times.column("end_ns").to_numpy()[sel]
    op_start = times.column("op_start_ns").to_numpy()[sel]
    op_end = times.column("op_end_ns").to_numpy()[sel]
    gid = graph.column("node_id")
    by_id = np.argsort(gid, kind="stable")
    rows = by_id[np.searchsorted(gid, node_id, sorter=by_id)]
    kind = graph.column("kind")[rows]
    op = graph.column("op")[rows]
    label = graph.column("label")[rows]
    group = graph.column("group")[rows]
    index = graph.column("index")[rows]
    is_async = graph.column("async_op")[rows]
    info = graph.group_info()
    descs = {
        g: (f"'{group_desc(info[g])}' " if group_desc(info[g]) else "") + f"({ranks_text(info[g]['ranks'])})"
        for g in set(group.tolist())
        if g in info
    }

    def spans_of(r: int, j: int, begin: int, critical: set[tuple[int, int]]) -> list[list]:
        spans = []
        for i in np.flatnonzero((rank == r) & (it == j)):
            crit = int((r, int(index[i])) in critical)
            a, b = int(start[i]) - begin, int(end[i]) - begin
            if kind[i] == "compute":
                name = str(label[i]) or "compute"
                if b > a:
                    spans.append([0, "compute", a, b, name, crit])
                continue
            name = f"{op[i]} {descs.get(int(group[i]), '')}".rstrip() + (f" [{label[i]}]" if label[i] else "")
            # a blocking call holds the program (lane 0); an asynchronous one runs beside it (lane 1)
            lane = 1 if is_async[i] else 0
            s0, e0 = int(op_start[i]) - begin, int(op_end[i]) - begin
            if s0 > a:  # arrived before the last member: waited for peers
                spans.append([lane, "wait", a, s0, f"wait for peers: {name}", crit])
            if e0 > s0 >= 0:
                spans.append([lane, "comm", s0, e0, name, crit])
        return spans

    out_iterations = []
    for cp in paths:
        j = int(cp["iteration"])
        m = it == j
        # an entry for every iteration the page offers (empty where the chosen ranks have no node in it)
        begin, finish = (int(start[m].min()), int(np.maximum(end[m], op_end[m]).max())) if m.any() else (0, 0)
        critical = {(seg["rank"], seg["index"]) for seg in cp.get("segments", [])}
        out_iterations.append(
            {
                "iteration": j,
                "end_ns": finish - begin,
                "spans": [spans_of(r, j, begin, critical) for r in ranks],
            }
        )
    return {
        "iteration": int(k),
        "ranks": [{"rank": int(r), "label": coords_text(layout, int(r))} for r in ranks],
        "iterations": out_iterations,
    }


def _perfetto(run_dir: Path, page: Path) -> list[dict[str, Any]]:
    """The Perfetto traces in the run directory or a directory of it (no stage writes one: they
    are what `prism export --perfetto` / `--perfetto-proto` wrote there), each with ``file``
    (from the run directory), ``href`` (from the page's directory), ``format`` and ``bytes``."""
    out = []
    for f in sorted([*run_dir.glob("*"), *run_dir.glob("*/*")]):
        if not f.is_file():
            continue
        if f.suffix == PERFETTO_PROTO_SUFFIX:
            fmt = "protobuf"
        elif f.suffix == ".json" and _begins(f, PERFETTO_JSON_HEAD):
            fmt = "JSON"
        else:
            continue
        href = Path(os.path.relpath(f.resolve(), page.resolve().parent)).as_posix()
        out.append(
            {"file": f.relative_to(run_dir).as_posix(), "href": quote(href), "format": fmt, "bytes": f.stat().st_size}
        )
    return out


def _begins(path: Path, head: bytes) -> bool:
    with open(path, "rb") as f:
        return f.read(len(head)) == head


def _emulation(emu: dict[str, Any] | None) -> dict[str, Any] | None:
    if not emu:
        return None
    per_rank = {
        r: {k: m.get(k) for k in ("median_steady_iteration_ns", "peak_memory_bytes", "iteration_ns")}
        for r, m in (emu.get("sandbox_results") or {}).items()
    }
    return {
        "sandbox": emu.get("sandbox"),
        "timing": emu.get("timing"),
        "devices": emu.get("devices"),
        "shared_gpu": emu.get("shared_gpu"),
        "ok": emu.get("ok"),
        "per_rank": per_rank,
        "virtual_ranks_iteration_ns": (emu.get("replay") or {}).get("median_steady_iteration_ns"),
    }


def _reference(ref: Path, s: dict[str, Any], bare: dict[str, Any]) -> dict[str, Any]:
    """Predicted against a real run of the same program (a `prism record` graph): per rank the
    iteration time (the prediction's is the slowest rank's span in the median iteration) and
    the peak memory."""
    real = PrismTrace.load(ref)
    world = int(s["world_size"])
    warmup = int(s.get("warmup", WARMUP))  # the real run's steady iterations are the prediction's
    if real.world_size != world:
        raise PrismError(f"--reference {ref}: a run of {real.world_size} ranks, the report's job has {world}")
    pr = s.get("per_rank") or {}
    span = dict(zip(pr.get("rank", []), pr.get("span_ns", [])))
    rank, k, a, b = (real.iterations.column(c).to_numpy() for c in ("rank", "iteration", "start_ns", "end_ns"))
    ok = steady_rows(k, (a >= 0) & (b >= a), warmup)
    per: dict[int, list[int]] = {}
    for r, span_ns in zip(rank[ok].tolist(), (b - a)[ok].tolist()):
        per.setdefault(r, []).append(span_ns)
    real_peak = real.manifest.get("peak_memory_bytes") or {}
    pred_peak = bare.get("peak_memory_bytes") or {}
    rows = []
    for r in range(world):
        rt = per.get(r)
        rows.append(
            {
                "rank": r,
                "predicted_ns": span.get(r),
                "real_ns": int(np.median(rt)) if rt else None,
                "predicted_bytes": int(pred_peak.get(str(r), -1)),
                "real_bytes": int(real_peak.get(str(r), -1)),
            }
        )
    pred, truth = s.get("predicted_iteration_ns"), steady_iteration_time(real, warmup=warmup)
    return {
        "source": str(ref),
        "per_rank": rows,
        "iteration": {
            "predicted_ns": pred,
            "real_ns": truth,
            "rel_error": (pred - truth) / truth if pred and truth else None,
        },
    }


__all__ = ["collect", "coords_text", "default_ranks"]
