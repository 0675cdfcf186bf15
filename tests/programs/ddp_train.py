"""A small model under DistributedDataParallel (gloo, CPU), a few optimizer steps.

``python ddp_train.py OUT_DIR [STEPS]``: rank 0 saves the final parameters to
``OUT_DIR/ddp_params.pt`` so a recorded run can be compared with a plain one.
Buckets are kept small (bucket_cap_mb) so each step all-reduces several buckets.
"""

import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

out_dir = sys.argv[1]
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 3

dist.init_process_group("gloo")
rank = dist.get_rank()

torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
    torch.nn.Linear(64, 8),
)  # fmt: skip
ddp = DDP(model, bucket_cap_mb=0.01)  # ~2.6k floats a bucket: several buckets
opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)

g = torch.Generator().manual_seed(100 + rank)
for _ in range(steps):
    x = torch.randn(16, 32, generator=g)
    y = torch.randn(16, 8, generator=g)
    loss = torch.nn.functional.mse_loss(ddp(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()

if rank == 0:
    os.makedirs(out_dir, exist_ok=True)
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()},
               os.path.join(out_dir, "ddp_params.pt"))  # fmt: skip
dist.destroy_process_group()
print("DDP OK", rank)
