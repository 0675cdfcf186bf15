"""What the pruning-latency benchmark runs on every logical rank: the latency of each collective
kind and of send/recv, per size. A plain torch.distributed program (no prismllm import), run
unmodified by torchrun, by `prism record`, by `prism capture` and by `prism emulate`:

    python -m torch.distributed.run --nproc-per-node 2 benchmarks/programs/collective_sizes.py \
        [--ops all_reduce,all_gather,...] [--sizes 64KB,1MB,16MB,256MB,1GB,8GB] [--warmup 3] [--iters 10]
        [--ahead MS] [--backend auto|nccl|gloo]

``--ops`` (default all_reduce), each on the default group, ``S`` the size's bytes:

    all_reduce        SUM, in place on S
    all_gather        all_gather_into_tensor: S out, S / world in
    reduce_scatter    reduce_scatter_tensor (SUM): S in, S / world out
    all_to_all        all_to_all_single, even splits: S in, S out
    broadcast         S from rank 0
    send_recv         rank 2i sends S to rank 2i+1 (an odd last rank idles)
    all_gather_coalesced, reduce_scatter_coalesced
                      two of the above (S/2 each) in one ``_coalescing_manager`` batch, as FSDP2
                      and Megatron-core's distributed optimizer issue them (gloo, which has no
                      coalescing: one after the other)
    all_reduce_premul NCCL's pre-multiplied sum by 1.0, in place on S: what a pruned sum costs
                      against a plain one (a sandbox with generated inputs issues its sums so);
                      NCCL only, not in the default sweep

Per op and size: a barrier, ``--warmup`` untimed calls, then ``--iters`` timed ones. On GPU each
call is timed on the device (a CUDA event before and after it on the current stream, which waits
for the collective: the span includes waiting for late peers). With ``--ahead MS`` (GPU) the
device first sleeps about MS ms while the host enqueues every timed call, so that the events
measure the device's latency of back-to-back calls, not the host's cost of issuing one (a
training step's host runs ahead of its device the same way; without it a small call's time is
its Python issue cost). On CPU by the wall clock around the (synchronous) gloo call. The
reporting ranks (``--report-ranks``, default 0) print one line per op and size::

    COLLECTIVE {"op": "all_reduce", "rank": 0, "world": 2, "backend": "nccl", "bytes": 16777216, "median_us": ...}

``median_us``/``min_us``/``mean_us``/``max_us`` over the timed calls, ``times_us`` each of them;
``loop_us``: the timed loop's span over ``--iters`` (back-to-back throughput).

Memory: an (op, size) is skipped (``COLLECTIVE_SKIP {...}``) unless ``bytes * --mem-factor +
--reserve-gb`` fits in the device's share of memory (total device memory, or host memory on
CPU, over the processes that share it). The rule reads no free-memory figure, so every rank
decides alike without communicating; ``--mem-factor 0`` turns it off (the benchmark driver
filters sizes itself).

``PRISM_VANILLA_HOSTS=1`` (the "vanilla" baseline: a process per rank, several on one GPU): each
rank tells NCCL it is its own host (``NCCL_HOSTID``) and takes GPU ``LOCAL_RANK % device_count``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

UNITS = {"": 1, "B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30}
DEFAULT_SIZES = {"cuda": "16MB,64MB,256MB,1GB,4GB,8GB", "cpu": "1MB,4MB,16MB"}
OPS = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "broadcast",
    "send_recv",
    "all_gather_coalesced",
    "reduce_scatter_coalesced",
)
EXTRA_OPS = ("all_reduce_premul",)  # asked by name only
ALL_OPS = OPS + EXTRA_OPS
SLEEP_CYCLES_PER_MS = 2_000_000  # torch.cuda._sleep spins SM cycles: ~2 GHz on an H100 / H200


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


def make_op(op: str, nbytes: int, world: int, rank: int, device, dtype) -> Callable[[], None] | None:
    """The call of ``op`` at ``nbytes`` on this rank, its buffers made once (zeros: in-place sums
    stay finite); None where this rank takes no part (send_recv's odd last rank)."""
    item = torch.empty((), dtype=dtype).element_size()
    numel = nbytes // item
    part = numel // world * world  # a multiple of world: even chunks

    def zeros(n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=dtype, device=device)

    if op == "all_reduce":
        x = zeros(numel)
        return lambda: dist.all_reduce(x)
    if op == "all_reduce_premul":
        if device.type != "cuda":
            raise ValueError("all_reduce_premul: NCCL only (gloo has no pre-multiplied sum)")
        x, premul = zeros(numel), dist._make_nccl_premul_sum(1.0)
        return lambda: dist.all_reduce(x, op=premul)
    if op == "all_gather":
        out, inp = zeros(part), zeros(part // world)
        return lambda: dist.all_gather_into_tensor(out, inp)
    if op == "reduce_scatter":
        inp, out = zeros(part), zeros(part // world)
        return lambda: dist.reduce_scatter_tensor(out, inp)
    if op == "all_to_all":
        inp, out = zeros(part), zeros(part)
        return lambda: dist.all_to_all_single(out, inp)
    if op == "broadcast":
        x = zeros(numel)
        return lambda: dist.broadcast(x, src=0)
    if op == "send_recv":
        if rank == world - 1 and world % 2:
            return None
        x = zeros(numel)
        peer = rank + 1 if rank % 2 == 0 else rank - 1
        return (lambda: dist.send(x, peer)) if rank % 2 == 0 else (lambda: dist.recv(x, peer))
    if op in ("all_gather_coalesced", "reduce_scatter_coalesced"):
        half = part // 2 // world * world
        big, small = [zeros(half), zeros(half)], [zeros(half // world), zeros(half // world)]
        gather = op == "all_gather_coalesced"

        def batch() -> None:
            # gloo has no coalescing: its two calls go one after the other
            scope = dist._coalescing_manager(device=device) if device.type == "cuda" else contextlib.nullcontext()
            with scope:
                for b, s in zip(big, small):
                    if gather:
                        dist.all_gather_into_tensor(b, s)
                    else:
                        dist.reduce_scatter_tensor(s, b)

        return batch
    raise ValueError(f"unknown op {op!r} (one of {', '.join(ALL_OPS)})")


def time_calls(call: Callable[[], None], iters: int, cuda: bool, ahead_ms: float) -> tuple[list[float], float]:
    """Per-call times (µs) and the loop's span over ``iters`` (µs)."""
    if not cuda:
        times = []
        t_loop = time.perf_counter()
        for _ in range(iters):
            t0 = time.perf_counter()
            call()
            times.append((time.perf_counter() - t0) * 1e6)
        return times, (time.perf_counter() - t_loop) * 1e6 / iters
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    if ahead_ms > 0:  # the device waits while the host enqueues every timed call
        torch.cuda._sleep(int(ahead_ms * SLEEP_CYCLES_PER_MS))
    for i in range(iters):
        starts[i].record()
        call()
        ends[i].record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)], starts[0].elapsed_time(ends[-1]) * 1e3 / iters


def main() -> None:
    ap = argparse.ArgumentParser(description="collective latency per op and size")
    ap.add_argument("--ops", default="all_reduce", help=f"comma list of: {', '.join(ALL_OPS)}")
    ap.add_argument("--sizes", default=None, help="comma list, e.g. 64KB,16MB,1GB (default: by device)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--ahead", type=float, default=0.0, help="GPU: ms the device sleeps while the host enqueues")
    ap.add_argument("--backend", choices=["auto", "nccl", "gloo"], default="auto")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--report-ranks", default="0", help="comma list of ranks that print, or 'all'")
    ap.add_argument(
        "--mem-factor", type=float, default=3.0, help="device memory a size needs, in its bytes (0: no check)"
    )
    ap.add_argument("--reserve-gb", type=float, default=1.0, help="per-process memory kept for the runtime")
    a = ap.parse_args()
    if a.iters < 1 or a.warmup < 0:
        ap.error("--iters must be >= 1 and --warmup >= 0")
    ops = [o for o in a.ops.split(",") if o]
    bad = [o for o in ops if o not in ALL_OPS]
    if bad:
        ap.error(f"--ops: unknown {', '.join(bad)} (one of {', '.join(ALL_OPS)})")

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
    report = a.report_ranks == "all" or rank in {int(r) for r in a.report_ranks.split(",") if r}
    sizes = parse_sizes(a.sizes or DEFAULT_SIZES["cuda" if cuda else "cpu"])
    ndev = torch.cuda.device_count() if cuda else 1
    ppd = math.ceil(int(os.environ.get("LOCAL_WORLD_SIZE", "1")) / ndev)
    total = device_bytes(cuda)
    base = {"rank": rank, "world": world, "backend": "nccl" if cuda else "gloo", "dtype": a.dtype}

    for op in ops:
        for nbytes in sizes:
            head = {"op": op, **base, "bytes": nbytes, "size": fmt_size(nbytes)}
            if not fits(nbytes, total, ppd, a.mem_factor, int(a.reserve_gb * (1 << 30))):
                if report:
                    skip = {**head, "device_bytes": total, "procs_per_device": ppd, "mem_factor": a.mem_factor}
                    print("COLLECTIVE_SKIP " + json.dumps(skip), flush=True)
                continue
            call = make_op(op, nbytes, world, rank, device, dtype)
            dist.barrier()
            if call is not None:
                for _ in range(a.warmup):
                    call()
                times_us, loop_us = time_calls(call, a.iters, cuda, a.ahead)
                if report:
                    line = {
                        **head,
                        "iters": a.iters,
                        "warmup": a.warmup,
                        "ahead_ms": a.ahead,
                        "median_us": round(statistics.median(times_us), 2),
                        "min_us": round(min(times_us), 2),
                        "mean_us": round(statistics.fmean(times_us), 2),
                        "max_us": round(max(times_us), 2),
                        "loop_us": round(loop_us, 2),
                        "times_us": [round(t, 2) for t in times_us],
                    }
                    print("COLLECTIVE " + json.dumps(line), flush=True)
            del call
            if cuda:
                torch.cuda.synchronize()
                with contextlib.suppress(Exception):
                    torch.cuda.empty_cache()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
