"""FSDP2 (``fully_shard``) on CPU with gloo, through ``init_device_mesh("cpu", ...)``.

``python fsdp2_train.py [STEPS]``: each layer is its own FSDP unit, then the root; each
step all-gathers parameters (forward, and again in backward: reshard_after_forward) and
reduce-scatters gradients.
"""

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 2

dist.init_process_group("gloo")
rank = dist.get_rank()
mesh = init_device_mesh("cpu", (dist.get_world_size(),))

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
for layer in (model[0], model[2]):
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
opt = torch.optim.SGD(model.parameters(), lr=0.05)

g = torch.Generator().manual_seed(100 + rank)
for _ in range(steps):
    x = torch.randn(4, 16, generator=g)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()

dist.destroy_process_group()
print("FSDP2 OK", rank)
