"""What a rank's GPU did, iteration by iteration, from a Kineto Chrome trace
(benchmarks/programs/profile_rank.py with PROFILE_WITH=kineto): set a real run's kernel timeline beside a slice's and an
emulation's of the same rank to see whether a span grew because its kernels ran slower (e.g.
sharing the GPU with a collective kernel that waits for a late peer) or because the device sat
idle waiting for its host.

    python benchmarks/kernel_timeline.py TRACE.json.gz [TRACE ...] [--json OUT] [--skip 2]

Iterations are cut at the host's device-wide synchronizations (``cudaDeviceSynchronize``, which
the suite's programs call at each iteration's start and end; an interval of fewer than
``--min-kernels`` kernels, the host's data loading between them, is no iteration). Per iteration and trace: the span
from the first kernel to the last, the device's busy time (union of all kernels), compute
kernels' own time (every kernel but NCCL's) and busy union, NCCL kernels' time, the time compute
kernels ran while an NCCL kernel was resident (overlap), the compute stream's idle gaps: the median over the steady iterations (all but the first
``--skip``). And the host's time in each autograd function that issued a collective (a DDP
bucket's hook): the calls' host cost, which the device waits for where it runs out of work."""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import statistics
from pathlib import Path


def load(path: Path) -> list[dict]:
    op = gzip.open if path.suffix == ".gz" else open
    with op(path, "rt") as f:
        return json.load(f)["traceEvents"]


def merged(iv: list[tuple[float, float]]) -> list[list[float]]:
    """The intervals' union as disjoint intervals, in order."""
    out: list[list[float]] = []
    for s, e in sorted(iv):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def union(iv: list[tuple[float, float]]) -> float:
    """Time covered by the intervals."""
    return sum(e - s for s, e in merged(iv))


def overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Time covered by both interval sets."""
    A, B = merged(a), merged(b)
    i = j = 0
    tot = 0.0
    while i < len(A) and j < len(B):
        s, e = max(A[i][0], B[j][0]), min(A[i][1], B[j][1])
        if e > s:
            tot += e - s
        if A[i][1] < B[j][1]:
            i += 1
        else:
            j += 1
    return tot


def iterations(events: list[dict]) -> list[dict]:
    syncs = sorted(
        e["ts"] + e.get("dur", 0) for e in events if e.get("ph") == "X" and e.get("name") == "cudaDeviceSynchronize"
    )
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    out = []
    for lo, hi in zip(syncs, syncs[1:]):
        ks = [k for k in kernels if lo <= k["ts"] < hi]
        if not ks:
            continue
        nccl = [(k["ts"], k["ts"] + k["dur"]) for k in ks if "nccl" in k["name"].lower()]
        comp = [
            (k["ts"], k["ts"] + k["dur"]) for k in ks if "nccl" not in k["name"].lower() and "prism" not in k["name"]
        ]
        streams: dict = {}
        for k in ks:
            if "nccl" not in k["name"].lower():
                streams.setdefault(k.get("args", {}).get("stream"), []).append((k["ts"], k["ts"] + k["dur"]))
        main = max(streams.values(), key=len) if streams else []
        ordered = sorted(main)
        # the main stream's idle gaps, each with where it starts
        idle = [(a[1], b[0] - a[1]) for a, b in zip(ordered, ordered[1:]) if b[0] > a[1]]
        gaps = [g for _, g in idle]
        t0, t1 = min(k["ts"] for k in ks), max(k["ts"] + k["dur"] for k in ks)
        gemm = sum(k["dur"] for k in ks if "gemm" in k["name"].lower() or "cutlass" in k["name"].lower())
        # the tail: what the device ran after the iteration's last NCCL kernel (a DDP job's
        # optimizer step), whose span a slice measured longer than the real run's
        nccl_end = max((e for _, e in nccl), default=t0)
        tail = [k for k in ks if k["ts"] >= nccl_end and "nccl" not in k["name"].lower()]
        tail_gaps = [g for start, g in idle if start >= nccl_end]
        out.append(
            {
                "span_ms": (t1 - t0) / 1e3,
                "busy_ms": union([(k["ts"], k["ts"] + k["dur"]) for k in ks]) / 1e3,
                "compute_kernels_ms": sum(e - s for s, e in comp) / 1e3,
                "compute_busy_ms": union(comp) / 1e3,
                "gemm_ms": gemm / 1e3,
                "nccl_kernels_ms": sum(e - s for s, e in nccl) / 1e3,
                "compute_under_nccl_ms": overlap(comp, nccl) / 1e3,
                "main_stream_idle_ms": sum(gaps) / 1e3,
                "main_stream_gaps_over_50us": sum(1 for g in gaps if g > 50),
                "kernels": len(ks),
                "tail_ms": (t1 - nccl_end) / 1e3,
                "tail_kernels": len(tail),
                "tail_kernels_ms": sum(k["dur"] for k in tail) / 1e3,
                "tail_main_stream_idle_ms": sum(tail_gaps) / 1e3,
                "tail_by_name": by_name(tail),
                "by_name": by_name(ks),
            }
        )
    return out


def by_name(kernels: list[dict]) -> dict[str, float]:
    """Kernels' own time in ms by name (its first 150 characters: a multi-tensor kernel's functor
    included)."""
    out: dict[str, float] = {}
    for k in kernels:
        name = k["name"][:150]
        out[name] = out.get(name, 0.0) + k["dur"] / 1e3
    return out


def issuing_hooks(events: list[dict]) -> list[float]:
    """Host µs of each autograd function during which a collective was issued (a data-parallel
    bucket's hook: DDP's reducer issues its all-reduce from the AccumulateGrad that fills it)."""
    comms = sorted(e["ts"] for e in events if e.get("ph") == "X" and e.get("name") == "record_param_comms")
    fns = [
        e
        for e in events
        if e.get("ph") == "X"
        and e.get("cat") == "cpu_op"
        and e["name"].startswith("autograd::engine::evaluate_function")
    ]
    out = []
    for f in fns:
        i = bisect.bisect_left(comms, f["ts"])
        if i < len(comms) and comms[i] < f["ts"] + f["dur"]:
            out.append(f["dur"])
    return out


def summary(path: Path, skip: int, min_kernels: int) -> dict:
    events = load(path)
    its = [x for x in iterations(events) if x["kernels"] >= min_kernels]
    st = its[skip:] or its
    keys = [k for k in st[0] if k not in ("tail_by_name", "by_name")] if st else []
    hooks = issuing_hooks(events)

    def top(field: str, n: int) -> dict[str, float]:  # the median ms of each name, the n largest
        names = {name for x in st for name in x[field]}
        med = {name: round(statistics.median(x[field].get(name, 0.0) for x in st), 3) for name in names}
        return dict(sorted(med.items(), key=lambda kv: -kv[1])[:n])

    return {
        "trace": path.name,
        "iterations": len(its),
        **{k: round(statistics.median(x[k] for x in st), 3) for k in keys},
        "tail_top": top("tail_by_name", 12),
        "kernels_top": top("by_name", 30),
        "issuing_hooks": len(hooks),
        "issuing_hook_us_median": round(statistics.median(hooks), 1) if hooks else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+", type=Path)
    ap.add_argument("--skip", type=int, default=2)
    ap.add_argument("--min-kernels", type=int, default=50, help="intervals with fewer kernels are no iteration")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    rows = [summary(p, a.skip, a.min_kernels) for p in a.traces]
    for r in rows:
        print(json.dumps(r))
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
