"""A device-bound step whose host stalls once at the start of each iteration (NCCL, one GPU a rank).

Each iteration: the host sleeps ``HOST_STALL_MS`` (default 0), launches ``--matmuls`` bf16
matmuls of ``--n`` x ``--n`` (the device's work, far longer than their launches), all-reduces a
scalar of their result, takes an optimizer step (lr 0: the iteration boundary) and reads the
scalar (the host waits for the device). Run as it is, the device idles through each stall; with
the host a whole iteration ahead it never does. The stall is an environment variable, not an
argument, so that one captured graph serves both (the program check compares arguments).
"""

import argparse
import os
import time

import torch
import torch.distributed as dist

ap = argparse.ArgumentParser()
ap.add_argument("--n", type=int, default=4096)
ap.add_argument("--matmuls", type=int, default=48)
ap.add_argument("--iters", type=int, default=8)
a = ap.parse_args()
stall_s = float(os.environ.get("HOST_STALL_MS", "0")) / 1e3

dist.init_process_group("nccl")
torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
w = torch.nn.Parameter(torch.randn(a.n, a.n, device="cuda", dtype=torch.bfloat16) / a.n**0.5)
w.grad = torch.zeros_like(w)
opt = torch.optim.SGD([w], lr=0.0)
x = torch.randn(a.n, a.n, device="cuda", dtype=torch.bfloat16)
for it in range(1, a.iters + 1):
    time.sleep(stall_s)
    t0 = time.perf_counter()
    y = x
    with torch.no_grad():
        for _ in range(a.matmuls):
            y = torch.tanh(y @ w)
    s = y.float().mean().reshape(1)
    dist.all_reduce(s)
    opt.step()
    value = float(s)
    if dist.get_rank() == dist.get_world_size() - 1:
        print(f"iteration {it}/{a.iters} | value {value:.4f} | {(time.perf_counter() - t0) * 1e3:.2f} ms", flush=True)
dist.destroy_process_group()
