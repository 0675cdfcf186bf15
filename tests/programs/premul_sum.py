"""Two all_reduces with NCCL's PREMUL_SUM, one with a float factor and one with a tensor factor
(FSDP2's gradient reduction uses it). Prints the results; run under prism record on a GPU."""

import os

import torch
import torch.distributed as dist

dist.init_process_group("nccl")
device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
torch.cuda.set_device(device)
t = torch.ones(4, device=device) * (dist.get_rank() + 1)
dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5))
u = torch.ones(4, device=device)
dist.all_reduce(u, op=dist._make_nccl_premul_sum(torch.tensor(0.25, device=device)))
print(f"rank {dist.get_rank()}: {t.tolist()} {u.tolist()}", flush=True)
dist.destroy_process_group()
