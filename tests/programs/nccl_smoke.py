"""GPU (NCCL) counterpart of collectives.py: the APIs NCCL supports, DDP and FSDP2 steps.

``python nccl_smoke.py [--device-id]``: one GPU per rank (LOCAL_RANK). With --device-id the
default group is created with ``device_id=`` (eager NCCL init, later groups split from it,
``dist.split_group`` available). Checks every value itself and prints "NCCL OK <rank>".
Iterations: 0 = collectives (ended by an optimizer step), then one per DDP step, then one per
FSDP2 step.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.distributed_c10d import _coalescing_manager

local = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local)
dev = torch.device("cuda", local)
if "--device-id" in sys.argv:
    dist.init_process_group("nccl", device_id=dev)
else:
    dist.init_process_group("nccl")
rank, n = dist.get_rank(), dist.get_world_size()
assert dist.get_backend() == "nccl"


def close(a, b):
    torch.testing.assert_close(a, b)


def full(shape, v, **kw):
    return torch.full(shape, float(v), device=dev, **kw)


tot = n * (n + 1) / 2
t = full((1024,), rank + 1)  # 4 KB
dist.all_reduce(t)
close(t, full((1024,), tot))

t = full((1 << 20,), rank + 1)
w = dist.all_reduce(t, async_op=True)
y = torch.randn(2048, 2048, device=dev) @ torch.randn(2048, 2048, device=dev)  # compute overlap
w.wait()
close(t, full((1 << 20,), tot))

out = torch.empty(n * 8, device=dev)
dist.all_gather_into_tensor(out, full((8,), rank))
close(out, torch.arange(n, device=dev, dtype=torch.float32).repeat_interleave(8))

out = torch.empty(4, device=dev)
dist.reduce_scatter_tensor(out, torch.arange(4.0 * n, device=dev) + rank)
close(out, n * torch.arange(4.0 * rank, 4.0 * rank + 4, device=dev) + tot - n)

in_sp = [rank + j + 1 for j in range(n)]
out_sp = [j + rank + 1 for j in range(n)]
inp = torch.cat([full((in_sp[j], 2), 10 * rank + j) for j in range(n)])
out = torch.empty(sum(out_sp), 2, device=dev)
dist.all_to_all_single(out, inp, out_sp, in_sp)
close(out, torch.cat([full((out_sp[j], 2), 10 * j + rank) for j in range(n)]))

t = full((5,), rank)
dist.broadcast(t, src=n - 1)
close(t, full((5,), n - 1))

nxt, prv = (rank + 1) % n, (rank - 1) % n
rbuf = torch.empty(3, device=dev)
reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, full((3,), rank), nxt), dist.P2POp(dist.irecv, rbuf, prv)])
for q in reqs:
    q.wait()
close(rbuf, full((3,), prv))
if n == 2:
    rbuf = torch.empty(3, device=dev)
    if rank == 0:
        dist.send(full((3,), 7), 1)
    else:
        dist.recv(rbuf, 0)
        close(rbuf, full((3,), 7))

objs = [None] * n
dist.all_gather_object(objs, {"rank": rank})
assert objs == [{"rank": j} for j in range(n)]

y = funcol.all_reduce(full((16,), 1), "sum", dist.group.WORLD)
close(funcol.wait_tensor(y), full((16,), n))

a, b = full((2,), 1), full((3,), 1)
with _coalescing_manager(dist.group.WORLD, dev):
    dist.all_reduce(a)
    dist.all_reduce(b)
close(a, full((2,), n))

sub = dist.new_group(list(range(n)))
t = full((4,), 1)
dist.all_reduce(t, group=sub)
close(t, full((4,), n))
if dist.distributed_c10d._get_default_group().bound_device_id is not None:
    sp = dist.split_group(split_ranks=[list(range(n))])
    t = full((4,), 1)
    dist.all_reduce(t, group=sp)
    close(t, full((4,), n))
dist.barrier()

lin = torch.nn.Linear(4, 4, device=dev)
opt = torch.optim.SGD(lin.parameters(), lr=0.1)
lin(full((2, 4), 1)).sum().backward()
opt.step()  # end of iteration 0

# DDP
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))
ddp = DDP(model.to(dev), device_ids=[local], bucket_cap_mb=1)
opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
for _ in range(3):
    loss = ddp(torch.randn(64, 256, device=dev)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()

# FSDP2
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

mesh = init_device_mesh("cuda", (n,))
model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))
model.to(dev)
for layer in (model[0], model[2]):
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for _ in range(2):
    loss = model(torch.randn(64, 256, device=dev)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()

torch.cuda.synchronize()
dist.destroy_process_group()
print("NCCL OK", rank)
