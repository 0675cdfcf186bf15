"""What ``prism show`` reports about a graph, computed columnar.

``summarize(trace) -> dict``; ``prism show DIR --json`` prints exactly this object:

- ``path``: the graph directory (set by the CLI)
- ``world_size`` (int), ``mode``, ``device``, ``clock``, ``command`` (str or null; a command
  line list is joined shell-style), ``format_version`` (int)
- ``ranks``: number of ranks that have nodes; ``nodes``, ``edges`` (ints),
  ``edges_by_kind``: {kind: count}
- ``iterations``: number of distinct iterations in the iterations table
- ``nodes_by_op``: {op: count}, "compute" included, sorted by count descending
- ``bytes_by_group``: list, one per group with communication, sorted by in_bytes descending:
  {``group`` (id), ``name``, ``desc``, ``size`` (members), ``ops`` ({op: count}),
  ``in_bytes`` (sum of in_bytes over the group's nodes on all ranks)}
- ``iteration_times``: list per iteration (ascending): {``iteration``, ``ranks`` (ranks that
  timed it), ``mean_ns``, ``max_ns``} of end_ns - start_ns over ranks; empty without times
- ``steady_iterations``: the iteration numbers counted as steady (all but the first when there
  are at least two; of a graph calibrated with ``--warmup N``, all but the first N: see
  :func:`steady`)
- ``iteration_time_ns``: median over the steady iterations of the per-iteration ``max_ns``
  (the iteration is over when its slowest rank is), null without times
- ``iteration_time_mean_ns``: the same median taken over ``mean_ns``
- ``peak_memory_bytes``: {rank (str): bytes} for the ranks that recorded it, or null
"""

from __future__ import annotations

import shlex
from typing import Any

import numpy as np
import pyarrow.compute as pc

from prismllm.trace.graph import PrismTrace


def iteration_times(trace: PrismTrace) -> list[dict[str, Any]]:
    """Per iteration: mean and max over ranks of end_ns - start_ns (known times only)."""
    it = trace.iterations
    if not it.num_rows:
        return []
    start = it.column("start_ns").to_numpy()
    end = it.column("end_ns").to_numpy()
    num = it.column("iteration").to_numpy()
    ok = (start >= 0) & (end >= start)
    if not ok.any():
        return []
    num, dur = num[ok].astype(np.int64), (end[ok] - start[ok]).astype(np.int64)
    its, inv, counts = np.unique(num, return_inverse=True, return_counts=True)
    sums = np.bincount(inv, weights=dur.astype(np.float64))
    maxs = np.full(len(its), np.iinfo(np.int64).min, dtype=np.int64)
    np.maximum.at(maxs, inv, dur)
    return [
        {"iteration": int(i), "ranks": int(c), "mean_ns": int(round(s / c)), "max_ns": int(m)}
        for i, c, s, m in zip(its, counts, sums, maxs)
    ]


# iterations left out of a steady median unless told otherwise: the first, whose time holds the
# program's set-up (a GPU that heats up and throttles needs more: prism calibrate --warmup)
WARMUP = 1


def steady(items: list[dict[str, Any]], warmup: int = WARMUP) -> list[dict[str, Any]]:
    """The iterations after the first ``warmup``; the last alone when there are no more (prism
    calibrate refuses a ``--warmup`` that leaves its graph none)."""
    return items[warmup:] if len(items) > warmup else items[-1:]


def steady_rows(iteration: np.ndarray, sel: np.ndarray, warmup: int = WARMUP) -> np.ndarray:
    """``sel`` (a row mask) less the rows of its first ``warmup`` iterations: :func:`steady` for
    columns of iteration numbers."""
    its = steady(list(np.unique(iteration[sel])), warmup)
    return sel & (iteration >= its[0]) if its else sel


def warmup_of(manifest: dict[str, Any]) -> int:
    """The iterations a calibrated graph's prediction left out (``prism calibrate --warmup``), else
    the default: what an emulation of that graph leaves out of its own medians."""
    return int((manifest.get("calibration") or {}).get("warmup", WARMUP))


def steady_iteration_time(trace: PrismTrace, key: str = "max_ns", warmup: int = WARMUP) -> int | None:
    """Median over steady iterations of the per-iteration time (max over ranks by default)."""
    its = steady(iteration_times(trace), warmup)
    if not its:
        return None
    return int(np.median([x[key] for x in its]))


def rank_iteration_times(trace: PrismTrace) -> dict[int, int]:
    """Per rank: median over the steady iterations of that rank's end_ns - start_ns."""
    it = trace.iterations
    if not it.num_rows:
        return {}
    start = it.column("start_ns").to_numpy()
    end = it.column("end_ns").to_numpy()
    ok = (start >= 0) & (end >= start)
    if not ok.any():
        return {}
    ok = steady_rows(it.column("iteration").to_numpy(), ok)
    rank = it.column("rank").to_numpy()[ok].astype(np.int64)
    dur = (end - start)[ok].astype(np.int64)
    o = np.lexsort((dur, rank))
    rank, dur = rank[o], dur[o]
    starts = np.flatnonzero(np.r_[True, rank[1:] != rank[:-1]])
    ends = np.r_[starts[1:], len(rank)]
    out = {}
    for s, e in zip(starts, ends):
        out[int(rank[s])] = int(np.median(dur[s:e]))
    return out


def host_lead_by_rank(trace: PrismTrace) -> dict[int, int]:
    """Per rank, on a device clock: the median over the steady iterations of how long before the
    device reached a communication call the host had issued it (``start_ns - issue_ns``).

    A lead of about one launch (0.1 ms) means the device waited for the host: the rank's compute
    spans then measure the host's pace (Python and launch time), not its kernels. A lead of
    milliseconds means the host ran ahead and the spans are device time. Empty on a host clock
    (the CPU), where issue and start are one."""
    if trace.manifest.get("clock") != "cuda":
        return {}
    nodes = trace.nodes
    is_comm = pc.equal(nodes.column("kind"), "comm").to_numpy(zero_copy_only=False)
    issue, start = trace.column("issue_ns").astype(np.int64), trace.column("start_ns").astype(np.int64)
    it = trace.column("iteration").astype(np.int64)
    sel = steady_rows(it, is_comm & (issue >= 0) & (start >= issue) & (it >= 0))
    rank = trace.column("rank").astype(np.int64)[sel]
    lead = (start - issue)[sel]
    return {int(r): int(np.median(lead[rank == r])) for r in np.unique(rank)}


def compute_time_by_rank(trace: PrismTrace) -> dict[int, int]:
    """Per rank: total duration of its compute spans (duration_ns, or end - start), known ones."""
    nodes = trace.nodes
    is_compute = pc.equal(nodes.column("kind"), "compute").to_numpy(zero_copy_only=False)
    dur = trace.column("duration_ns").astype(np.int64)
    se = trace.column("end_ns") - trace.column("start_ns")
    d = np.where(dur >= 0, dur, np.where((trace.column("start_ns") >= 0) & (se >= 0), se, -1))
    sel = is_compute & (d >= 0)
    rank = trace.column("rank").astype(np.int64)
    if not sel.any():
        return {}
    ranks = np.unique(rank[sel])
    tot = np.bincount(rank[sel], weights=d[sel].astype(np.float64), minlength=int(ranks.max()) + 1)
    return {int(r): int(tot[r]) for r in ranks}


def summarize(trace: PrismTrace) -> dict[str, Any]:
    m = trace.manifest
    nodes = trace.nodes
    cmd = m.get("command")
    if isinstance(cmd, (list, tuple)):
        cmd = shlex.join(str(x) for x in cmd)

    op_counts = pc.value_counts(nodes.column("op")).to_pylist() if nodes.num_rows else []
    nodes_by_op = {d["values"]: int(d["counts"]) for d in sorted(op_counts, key=lambda d: (-d["counts"], d["values"]))}
    edge_counts = pc.value_counts(trace.edges.column("kind")).to_pylist() if trace.edges.num_rows else []
    edges_by_kind = {d["values"]: int(d["counts"]) for d in edge_counts}

    bytes_by_group: list[dict[str, Any]] = []
    comm = nodes.filter(pc.greater_equal(nodes.column("group"), 0)).select(["group", "op", "in_bytes"])
    if comm.num_rows:
        per = comm.group_by(["group", "op"]).aggregate([("in_bytes", "sum"), ("in_bytes", "count")]).to_pydict()
        info = trace.group_info()
        acc: dict[int, dict[str, Any]] = {}
        for g, op, b, n in zip(per["group"], per["op"], per["in_bytes_sum"], per["in_bytes_count"]):
            gi = info.get(int(g), {"name": "?", "desc": "?", "ranks": []})
            e = acc.setdefault(
                int(g),
                {
                    "group": int(g),
                    "name": gi["name"],
                    "desc": gi["desc"],
                    "size": len(gi["ranks"]),
                    "ops": {},
                    "in_bytes": 0,
                },
            )
            e["ops"][op] = int(n)
            e["in_bytes"] += int(b or 0)
        bytes_by_group = sorted(acc.values(), key=lambda e: (-e["in_bytes"], e["group"]))
        for e in bytes_by_group:
            e["ops"] = dict(sorted(e["ops"].items(), key=lambda kv: (-kv[1], kv[0])))

    its = iteration_times(trace)
    st = steady(its, warmup_of(m))  # a calibrated graph's: those its prediction took
    n_iters = len(np.unique(trace.iterations.column("iteration").to_numpy())) if trace.iterations.num_rows else 0
    peak = m.get("peak_memory_bytes") or {}
    peak = {str(k): int(v) for k, v in peak.items() if v is not None and int(v) >= 0}
    return {
        "world_size": trace.world_size,
        "mode": m.get("mode"),
        "device": m.get("device"),
        "clock": m.get("clock"),
        "command": cmd,
        "format_version": m.get("format_version"),
        "ranks": int(len(trace.ranks())) if nodes.num_rows else 0,
        "nodes": nodes.num_rows,
        "edges": trace.edges.num_rows,
        "edges_by_kind": edges_by_kind,
        "iterations": n_iters,
        "nodes_by_op": nodes_by_op,
        "bytes_by_group": bytes_by_group,
        "iteration_times": its,
        "steady_iterations": [x["iteration"] for x in st],
        "iteration_time_ns": int(np.median([x["max_ns"] for x in st])) if st else None,
        "iteration_time_mean_ns": int(np.median([x["mean_ns"] for x in st])) if st else None,
        "peak_memory_bytes": dict(sorted(peak.items(), key=lambda kv: int(kv[0]))) or None,
    }


# ---------------------------------------------------------------------- formatting
def fmt_bytes(b: float | None) -> str:
    if b is None:
        return "-"
    b = float(b)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(b) < 1024 or unit == "TiB":
            return f"{b:.0f} {unit}" if unit == "B" else f"{b:.2f} {unit}"
        b /= 1024
    return f"{b:.2f} PiB"


def fmt_ns(ns: float | None) -> str:
    if ns is None:
        return "-"
    ns = float(ns)
    if abs(ns) >= 1e9:
        return f"{ns / 1e9:.3f} s"
    if abs(ns) >= 1e6:
        return f"{ns / 1e6:.3f} ms"
    if abs(ns) >= 1e3:
        return f"{ns / 1e3:.1f} µs"
    return f"{ns:.0f} ns"
