"""Per-call cost of a small all_reduce, back to back: run once plainly and once under
``PRISM_MODE=record`` and compare. ``python bench_allreduce.py [CALLS] [NUMEL] [nccl]``
(gloo on CPU by default; "nccl": one GPU per rank). Rank 0 prints
``per_call_us sync=<best batch> async=<best batch>``."""

import os
import sys
import time

import torch
import torch.distributed as dist

calls = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
numel = int(sys.argv[2]) if len(sys.argv) > 2 else 256
nccl = len(sys.argv) > 3 and sys.argv[3] == "nccl"
if nccl:
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl")
    t = torch.ones(numel, device="cuda")
else:
    dist.init_process_group("gloo")
    t = torch.ones(numel)
sync = torch.cuda.synchronize if nccl else (lambda: None)


def run_sync(k):
    for _ in range(k):
        dist.all_reduce(t)


def run_async(k):
    for _ in range(k):
        dist.all_reduce(t, async_op=True).wait()


res = {}
for name, fn in (("sync", run_sync), ("async", run_async)):
    fn(100)
    best = float("inf")
    for _ in range(7):
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        fn(calls)
        sync()
        best = min(best, (time.perf_counter() - t0) / calls)
    res[name] = best * 1e6
if dist.get_rank() == 0:
    print("per_call_us " + " ".join(f"{k}={v:.1f}" for k, v in res.items()), flush=True)
dist.destroy_process_group()
