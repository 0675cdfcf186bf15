"""What the bootstrap benchmark runs on every logical rank: join the world, a global barrier,
one all-reduce of 1 MiB, and print (rank 0) how long each took and its peak memory.

``PRISM_VANILLA_HOSTS=1`` (the "vanilla" baseline: a process per rank, several on one GPU):
each rank tells NCCL it is its own host (``NCCL_HOSTID``), so that NCCL accepts several ranks
per GPU, and takes GPU ``LOCAL_RANK % device_count``."""

import os
import resource
import time

import torch
import torch.distributed as dist

t0 = time.perf_counter()
rank = int(os.environ["RANK"])
cuda = torch.cuda.is_available()
if cuda:
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    if os.environ.get("PRISM_VANILLA_HOSTS") == "1":
        os.environ["NCCL_HOSTID"] = f"prism-vanilla-{rank}"
dist.init_process_group("nccl" if cuda else "gloo")
t1 = time.perf_counter()
dist.barrier()
t2 = time.perf_counter()
x = torch.ones(1 << 18, device="cuda" if cuda else "cpu")  # 1 MiB of float32
dist.all_reduce(x)
if cuda:
    torch.cuda.synchronize()
t3 = time.perf_counter()
if rank == 0:
    mem = torch.cuda.max_memory_reserved() if cuda else 0
    print(
        f"BOOTSTRAP world {dist.get_world_size()} init_s {t1 - t0:.3f} barrier_s {t2 - t1:.3f} "
        f"all_reduce_s {t3 - t2:.3f} sum {x[0].item():.0f} gpu_reserved {mem} "
        f"rss {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}",
        flush=True,
    )
dist.destroy_process_group()
