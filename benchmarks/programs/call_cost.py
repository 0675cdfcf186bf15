"""Host cost of one communication call, back to back, on one rank: the per-call price of the
recording layer, free of any peer's latency (world size 1).

    torchrun --nproc-per-node 1 benchmarks/programs/call_cost.py [--calls 3000] [--numel 256]
    prism record --nproc 1 -- benchmarks/programs/call_cost.py ...      (the same, recorded)

Prints ``CALLCOST {"sync_us": .., "async_us": .., "backend": ..}`` (best of 5 batches); with
``--profile`` also the top functions of a cProfile of one recorded batch (sync) by own time.
NCCL on a GPU when one is visible, else gloo."""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import time

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--numel", type=int, default=256)
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    t = torch.ones(a.numel, device="cuda" if cuda else "cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def run_sync(k: int) -> None:
        for _ in range(k):
            dist.all_reduce(t)

    def run_async(k: int) -> None:
        for _ in range(k):
            dist.all_reduce(t, async_op=True).wait()

    res = {"backend": dist.get_backend(), "calls": a.calls}
    for name, fn in (("sync_us", run_sync), ("async_us", run_async)):
        fn(200)
        best = float("inf")
        for _ in range(5):
            sync()
            t0 = time.perf_counter()
            fn(a.calls)
            sync()
            best = min(best, (time.perf_counter() - t0) / a.calls)
        res[name] = round(best * 1e6, 2)
    print("CALLCOST " + json.dumps(res), flush=True)
    if a.profile:
        pr = cProfile.Profile()
        pr.enable()
        run_sync(a.calls)
        sync()
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(22)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
