"""What the pruning-latency benchmark runs on every logical rank: all-reduce latency per size.

A plain torch.distributed program (no prismllm import), run unmodified by torchrun, by
`prism record`, by `prism capture` and by `prism emulate`:

    python -m torch.distributed.run --nproc-per-node 2 benchmarks/programs/allreduce_sizes.py \
        [--sizes 16MB,64MB,256MB,1GB,4GB,8GB] [--warmup 3] [--iters 10] [--backend auto|nccl|gloo]

init_process_group (NCCL when CUDA is available, else gloo; ``--backend`` overrides), then for
each size: a barrier, ``--warmup`` untimed all-reduces (SUM, in place, float32 by default),
then ``--iters`` timed ones. On GPU each call is timed on the device (a CUDA event before and
after it on the current stream, which waits for the collective: the span includes waiting
for late peers); on CPU by the wall clock around the (synchronous) gloo call. The reporting
ranks (``--report-ranks``, default 0) print one line per size::

    ALLREDUCE {"rank": 0, "world": 2, "backend": "nccl", "bytes": 16777216, "median_us": ..., ...}

``median_us``/``min_us``/``mean_us``/``max_us`` over the timed calls, ``times_us`` each of
them; ``loop_us``: the timed loop's span divided by ``--iters`` (first call's start to last
call's end: back-to-back throughput).

Memory: a size is skipped (``ALLREDUCE_SKIP {...}`` on the reporting ranks) unless
``bytes * --mem-factor + --reserve-gb`` fits in the device's share of memory (total device
memory, or host memory on CPU, over the processes that share it: ceil(LOCAL_WORLD_SIZE /
devices)). The rule reads no free-memory figure, so every rank decides alike without
communicating. ``--mem-factor 0`` turns the check off (the benchmark driver filters sizes
itself and passes 0).

``PRISM_VANILLA_HOSTS=1`` (the "vanilla" baseline: a process per rank, several on one GPU):
each rank tells NCCL it is its own host (``NCCL_HOSTID``), so that NCCL accepts several ranks
per GPU, and takes GPU ``LOCAL_RANK % device_count`` (as benchmarks/programs/bootstrap.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import time

import torch
import torch.distributed as dist

UNITS = {"": 1, "B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30}
DEFAULT_SIZES = {"cuda": "16MB,64MB,256MB,1GB,4GB,8GB", "cpu": "1MB,4MB,16MB"}


def parse_size(text: str) -> int:
    """'16MB' -> 16 MiB in bytes (KB/MB/GB are binary, as in the benchmark's tables)."""
    m = re.fullmatch(r"\s*([\d.]+)\s*([A-Za-z]*)\s*", text)
    if not m or m[2].upper() not in UNITS:
        raise ValueError(f"bad size {text!r} (e.g. 16MB, 1GB, 4096)")
    return int(float(m[1]) * UNITS[m[2].upper()])


def parse_sizes(text: str) -> list[int]:
    return [parse_size(s) for s in text.split(",") if s.strip()]


def fmt_size(n: int) -> str:
    for unit, div in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return f"{n}B"


def fits(nbytes: int, device_bytes: int, procs_per_device: int, mem_factor: float, reserve_bytes: int) -> bool:
    """Whether ``nbytes * mem_factor + reserve`` fits in one process's share of a device."""
    if mem_factor <= 0:
        return True
    return nbytes * mem_factor + reserve_bytes <= device_bytes / max(1, procs_per_device)


def device_bytes(cuda: bool) -> int:
    if cuda:
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def main() -> None:
    ap = argparse.ArgumentParser(description="all-reduce latency per size")
    ap.add_argument("--sizes", default=None, help="comma list, e.g. 16MB,1GB (default: by device)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--backend", choices=["auto", "nccl", "gloo"], default="auto")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--report-ranks", default="0", help="comma list of ranks that print, or 'all'")
    ap.add_argument(
        "--mem-factor",
        type=float,
        default=3.0,
        help="device memory a size needs, in multiples of its bytes (0: no check)",
    )
    ap.add_argument(
        "--reserve-gb",
        type=float,
        default=1.0,
        help="per-process memory kept for the runtime (context, communicator buffers)",
    )
    a = ap.parse_args()
    if a.iters < 1 or a.warmup < 0:
        ap.error("--iters must be >= 1 and --warmup >= 0")

    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    cuda = torch.cuda.is_available() if a.backend == "auto" else a.backend == "nccl"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        if os.environ.get("PRISM_VANILLA_HOSTS") == "1":
            os.environ["NCCL_HOSTID"] = f"prism-vanilla-{rank}"
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = getattr(torch, a.dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    report = a.report_ranks == "all" or rank in {int(r) for r in a.report_ranks.split(",") if r}
    sizes = parse_sizes(a.sizes or DEFAULT_SIZES["cuda" if cuda else "cpu"])
    ndev = torch.cuda.device_count() if cuda else 1
    ppd = math.ceil(int(os.environ.get("LOCAL_WORLD_SIZE", "1")) / ndev)
    total = device_bytes(cuda)
    base = {"rank": rank, "world": world, "backend": "nccl" if cuda else "gloo", "dtype": a.dtype}

    for nbytes in sizes:
        numel = nbytes // itemsize
        if not fits(nbytes, total, ppd, a.mem_factor, int(a.reserve_gb * (1 << 30))):
            if report:
                print(
                    "ALLREDUCE_SKIP "
                    + json.dumps(
                        {
                            **base,
                            "bytes": nbytes,
                            "size": fmt_size(nbytes),
                            "device_bytes": total,
                            "procs_per_device": ppd,
                            "mem_factor": a.mem_factor,
                        }
                    ),
                    flush=True,
                )
            continue
        x = torch.zeros(numel, dtype=dtype, device=device)  # zeros: in-place sums stay finite
        dist.barrier()
        for _ in range(a.warmup):
            dist.all_reduce(x)
        times_us: list[float] = []
        if cuda:
            starts = [torch.cuda.Event(enable_timing=True) for _ in range(a.iters)]
            ends = [torch.cuda.Event(enable_timing=True) for _ in range(a.iters)]
            for i in range(a.iters):
                starts[i].record()
                dist.all_reduce(x)
                ends[i].record()
            torch.cuda.synchronize()
            times_us = [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]
            loop_us = starts[0].elapsed_time(ends[-1]) * 1e3 / a.iters
        else:
            t_loop = time.perf_counter()
            for _ in range(a.iters):
                t0 = time.perf_counter()
                dist.all_reduce(x)
                times_us.append((time.perf_counter() - t0) * 1e6)
            loop_us = (time.perf_counter() - t_loop) * 1e6 / a.iters
        if report:
            print(
                "ALLREDUCE "
                + json.dumps(
                    {
                        **base,
                        "bytes": nbytes,
                        "size": fmt_size(nbytes),
                        "iters": a.iters,
                        "warmup": a.warmup,
                        "median_us": round(statistics.median(times_us), 2),
                        "min_us": round(min(times_us), 2),
                        "mean_us": round(statistics.fmean(times_us), 2),
                        "max_us": round(max(times_us), 2),
                        "loop_us": round(loop_us, 2),
                        "times_us": [round(t, 2) for t in times_us],
                    }
                ),
                flush=True,
            )
        del x
        if cuda:
            torch.cuda.empty_cache()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
