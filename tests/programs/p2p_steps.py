"""A pipeline's start-up decision in small: rank 0 sends rank 1 a small tensor (how many steps to
run, and a seed), and both ranks run that many all-reduces: rank 0 from its own count, rank 1
from what it received. A receiver given zeros runs none and leaves rank 0's all-reduces without
it; one given what rank 0 really sent (solo capture keeps a small send for its receiver) runs the
real run's path. Then an activation goes 0 -> 1 and its gradient 1 -> 0, as between stages. On a
GPU where one is visible (NCCL), else the CPU (gloo)."""

import torch
import torch.distributed as dist
from gpu_or_cpu import join_world

device = join_world()
rank = dist.get_rank()
plan = torch.tensor([3, 1234], device=device) if rank == 0 else torch.empty(2, dtype=torch.int64, device=device)
if rank == 0:
    dist.send(plan, dst=1)
else:
    dist.recv(plan, src=0)
steps, seed = (int(x) for x in plan)
for _ in range(steps):
    dist.all_reduce(torch.ones(4, device=device))
act = torch.full((4,), 2.5, device=device) if rank == 0 else torch.zeros(4, device=device)
if rank == 0:
    dist.send(act, dst=1)
    grad = torch.zeros(4, device=device)
    dist.recv(grad, src=1)
    print(f"rank 0: {steps} steps, gradient {grad.tolist()}", flush=True)
else:
    dist.recv(act, src=0)
    dist.send(act * 2, dst=0)
    print(f"rank 1: {steps} steps (seed {seed}), activation {act.tolist()}", flush=True)
dist.destroy_process_group()
