"""What NCCL's collectives leave allocated on the device: the caching allocator's allocated bytes
after each of barrier, all_reduce, all_gather_object and broadcast_object_list, then after the
Works are gone. Prints one line per rank; solo capture must print the same numbers."""

import gc
import os
import time

import torch
import torch.distributed as dist

dist.init_process_group("nccl")
device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
torch.cuda.set_device(device)
seen = []


def note(what: str) -> None:
    torch.cuda.synchronize()
    seen.append(f"{what}={torch.cuda.memory_allocated()}")


note("start")
dist.barrier()
note("barrier")
x = torch.ones(3, device=device)
dist.all_reduce(x)
note("all_reduce")
out = [None] * dist.get_world_size()
dist.all_gather_object(out, {"rank": dist.get_rank()})
note("all_gather_object")
objs = [{"config": 1}] if dist.get_rank() == 0 else [None]
dist.broadcast_object_list(objs, src=0)
note("broadcast_object_list")
dist.barrier()
note("barrier2")
gc.collect()
time.sleep(1)
note("later")
print(f"rank {dist.get_rank()}: " + " ".join(seen), flush=True)
dist.destroy_process_group()
