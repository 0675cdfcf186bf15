"""DDP whose last rank prints, each step, how its averaged gradient compares with the gradient of
its own batch alone: ``step S grad/own R R ...`` (one ratio per parameter, <g, own> / <own, own>).

A real run of two ranks prints the share of its own batch in the average (about 0.5); an emulated
sandbox rank whose virtual peer's contribution is generated prints 1.0 (it stands for a group of
members like itself). Anything else (0: no gradient reached the optimizer) means the pruned
all-reduce lost the program's data. On a GPU: NCCL, several buckets, so the emulation's later
steps take its fast paths. ``python ddp_own_grad.py [STEPS] [DTYPE]``"""

import sys

import torch
import torch.distributed as dist
from gpu_or_cpu import join_world
from torch.nn.parallel import DistributedDataParallel as DDP

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 4
dtype = getattr(torch, sys.argv[2]) if len(sys.argv) > 2 else torch.float32
device = join_world()
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8),
).to(device=device, dtype=dtype)  # fmt: skip
ddp = DDP(model, bucket_cap_mb=0.1)  # several buckets a step
g = torch.Generator().manual_seed(100 + rank)
for step in range(steps):
    x = torch.randn(32, 64, generator=g).to(device, dtype)
    y = torch.randn(32, 8, generator=g).to(device, dtype)
    own = torch.autograd.grad(torch.nn.functional.mse_loss(model(x), y), list(model.parameters()))
    model.zero_grad()
    torch.nn.functional.mse_loss(ddp(x), y).backward()
    if rank == dist.get_world_size() - 1:
        ratios = [
            float((p.grad.float() * o.float()).sum() / (o.float() * o.float()).sum())
            for p, o in zip(model.parameters(), own)
        ]
        print(f"step {step} grad/own", " ".join(f"{r:.3f}" for r in ratios), flush=True)
dist.destroy_process_group()
