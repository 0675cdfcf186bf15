"""A program's group start-up at scale, on every logical rank: join the world, create the TP
groups of 8 consecutive ranks (world / 8 `new_group` calls, each rank in one) and the 8 DP groups
across them, as Megatron-style programs do for every group of the world, then one all-reduce; print
how long the groups took.

    prism capture --mode solo --world 131072 --layout tp=8 --devices cpu --out OUT -- \\
        benchmarks/programs/group_startup.py
"""

import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
world, rank = dist.get_world_size(), dist.get_rank()
t0 = time.perf_counter()
for start in range(0, world, 8):
    dist.new_group(list(range(start, start + 8)))
t1 = time.perf_counter()
for t in range(8):
    dist.new_group(list(range(t, world, 8)))
t2 = time.perf_counter()
dist.all_reduce(torch.ones(4))
print(
    f"GROUPS rank {rank} world {world}: {world // 8} tp groups {t1 - t0:.2f} s, 8 dp groups {t2 - t1:.2f} s", flush=True
)
