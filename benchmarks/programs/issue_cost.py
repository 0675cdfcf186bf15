"""The host's cost of issuing an asynchronous collective, as a data-parallel step issues its
gradient buckets: a plain torch.distributed program (no prismllm import), run unmodified by
torchrun and by `prism run`/`prism emulate`, so that the two costs can be set side by side.

    python -m torch.distributed.run --nproc-per-node 2 benchmarks/programs/issue_cost.py \
        [--calls 26] [--numel 8388608] [--iters 20] [--op all_reduce|reduce_scatter|all_gather] [--between-us 0]
        [--dtype float32|bfloat16] [--premul F]

Each iteration: (GPU) the device first sleeps ~``--ahead-ms`` so that the host runs ahead of it,
then the host issues ``--calls`` asynchronous calls of ``--numel`` float32 elements each
(``async_op=True``, as DDP's reducer does; ``--dtype``), timing each issue on the host clock
(``perf_counter``), then waits for all and synchronizes. ``--between-us``: between two calls the
host launches small tensor operations for that long, as DDP's backward launches its kernels between
two buckets: each call then finds the caches and the CPU as a bucket's hook does, not warm from the
call before (a Python layer's cost a call grows several times that way). ``--premul F``: each
all-reduce is NCCL's pre-multiplied sum by F, the kind of call a pruned sum is on the sandbox's
side (NCCL only), to set its host cost beside a plain sum's. The last rank prints one line per
iteration (the suite's format, so `prism` reads it) and, at the end::

    ISSUE {"op": ..., "world": .., "backend": .., "issue_us_median": .., "issue_us_p90": .., "calls": ..}

over the steady iterations (all but the first two). NCCL on GPUs when there is one per rank,
else gloo on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=26)
    ap.add_argument("--numel", type=int, default=8 << 20)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--ahead-ms", type=float, default=20.0)
    ap.add_argument("--op", default="all_reduce", choices=["all_reduce", "reduce_scatter", "all_gather"])
    ap.add_argument("--between-us", type=float, default=0.0)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--premul", type=float, default=None, help="all_reduce as a pre-multiplied sum by F (NCCL)")
    a = ap.parse_args()
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    if a.premul is not None and (not cuda or a.op != "all_reduce"):
        raise SystemExit("issue_cost: --premul is NCCL's pre-multiplied all_reduce: on GPUs, with --op all_reduce")
    red = dist._make_nccl_premul_sum(a.premul) if a.premul is not None else dist.ReduceOp.SUM
    dtype = getattr(torch, a.dtype)
    n = a.numel - a.numel % world
    bufs = [torch.ones(n, device=dev, dtype=dtype) for _ in range(a.calls)]
    out_numel = {"all_reduce": 0, "reduce_scatter": n // world, "all_gather": n * world}[a.op]
    outs = [torch.empty(out_numel, device=dev, dtype=dtype) for _ in range(a.calls)]
    cycles = None
    if cuda:  # the clock rate of torch.cuda._sleep: measured once
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        torch.cuda._sleep(10_000_000)
        e.record()
        e.synchronize()
        cycles = 10_000_000 / s.elapsed_time(e)  # per ms
    scratch = torch.ones(4096, device=dev)

    def host_work() -> None:  # small launches until --between-us passed
        end = time.perf_counter() + a.between_us / 1e6
        while time.perf_counter() < end:
            scratch.mul_(1.0)

    per_iter: list[list[float]] = []
    for it in range(a.iters):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda._sleep(int(cycles * a.ahead_ms))
        t_iter = time.perf_counter()
        works, times = [], []
        for i in range(a.calls):
            if a.between_us:
                host_work()
            t0 = time.perf_counter()
            if a.op == "all_reduce":
                works.append(dist.all_reduce(bufs[i], op=red, async_op=True))
            elif a.op == "reduce_scatter":
                works.append(dist.reduce_scatter_tensor(outs[i], bufs[i], async_op=True))
            else:
                works.append(dist.all_gather_into_tensor(outs[i], bufs[i], async_op=True))
            times.append((time.perf_counter() - t0) * 1e6)
        for w in works:
            w.wait()
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        per_iter.append(times)
        if rank == world - 1:
            ms = (time.perf_counter() - t_iter) * 1e3
            print(f"iteration {it + 1}/{a.iters} | loss 0.0 | iter time {ms:.2f} ms | max mem 0 B", flush=True)
    if rank == world - 1:
        steady = [t for times in per_iter[2:] for t in times]
        q = statistics.quantiles(steady, n=10)
        doc = {
            "op": a.op if a.premul is None else f"all_reduce premul {a.premul:g}",
            "dtype": a.dtype,
            "world": world,
            "backend": "nccl" if cuda else "gloo",
            "numel": n,
            "calls": a.calls,
            "between_us": a.between_us,
            "issue_us_median": round(statistics.median(steady), 2),
            "issue_us_p90": round(q[-1], 2),
        }
        print("ISSUE " + json.dumps(doc), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
