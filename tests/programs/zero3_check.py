"""A ZeRO stage-3 style start-up agreement check: every rank partitions the same parameters, then
gathers each rank's counts and refuses to go on where a peer disagrees (as a partitioning library
checks its peers before it trusts its partition), then trains a few steps."""

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
params = list(model.parameters())
numels = [p.numel() for p in params]
total = sum(numels)
# each rank's partition of every parameter (padded to a multiple of the world size)
shard = [(n + world - 1) // world for n in numels]
# the checks: the parameter count (a tensor), the list of shard sizes (an object), a float checksum
counts = [torch.zeros(2, dtype=torch.int64) for _ in range(world)]
dist.all_gather(counts, torch.tensor([len(params), total], dtype=torch.int64))
for r, c in enumerate(counts):
    if c.tolist() != [len(params), total]:
        raise RuntimeError(f"Detected a disagreement on list length between rank{rank} and rank{r}: {c.tolist()}")
lists = [None] * world
dist.all_gather_object(lists, shard)
if any(other != shard for other in lists):
    raise RuntimeError(f"rank {rank}: shard sizes differ across ranks: {lists}")
norms = torch.zeros(world)
dist.all_gather_into_tensor(norms, torch.tensor([float(sum(p.detach().abs().sum() for p in params))]))
if not torch.allclose(norms, norms[rank].expand(world)):
    raise RuntimeError(f"rank {rank}: parameters differ across ranks: {norms.tolist()}")
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(3):
    x = torch.randn(8, 16)
    loss = model(x).square().mean()
    loss.backward()
    for p in params:
        dist.all_reduce(p.grad)
        p.grad /= world
    opt.step()
    opt.zero_grad()
    if rank == 0:
        print(f"step {step} loss {loss.item():.4f}")
dist.destroy_process_group()
