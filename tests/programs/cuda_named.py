"""A program written for CUDA and NCCL, every device named outright, for ``--cuda-on-cpu``
(tests/test_devicemap.py): what Megatron-core does (``is_cuda``/``type()`` checks, the CUDA RNG
state and its generators, ``_lazy_call``, ``device=current_device()`` in a custom Function's
backward and in a gradient hook, streams and ``record_stream``) and what torchtitan does (an
NCCL group bound to ``device_id``, a "cuda" DeviceMesh with a DTensor, FSDP2 with a gradient
divide factor, whose reduce-scatter is a PREMUL_SUM, NCCL's AVG, memory statistics, autocast,
``barrier(device_ids=[current_device()])``).

``python cuda_named.py OUT_JSON``: the last rank writes what it saw to OUT_JSON.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_tensor

local = int(os.environ.get("LOCAL_RANK", "0"))
assert torch.cuda.is_available() and torch.cuda.device_count() > local
torch.cuda.set_device(local)
dev = torch.device("cuda", torch.cuda.current_device())
dist.init_process_group("nccl", device_id=dev)
rank, world = dist.get_rank(), dist.get_world_size()
seen = {"backend": dist.get_backend(), "current_device": torch.cuda.current_device()}

# tensors made on "cuda" every way
a = torch.ones(4, device="cuda")
b = torch.zeros(2, 2).cuda()
c = torch.arange(3).to(dev, non_blocking=True)
d = torch.empty(3, device=torch.cuda.current_device())
with torch.device("cuda"):
    e = torch.randn(2)
seen["devices"] = sorted({str(t.device) for t in (a, b, c, d, e)})
seen["is_cuda"] = all(t.is_cuda for t in (a, b, c, d, e))
seen["type"] = a.type()
seen["cast"] = str(a.type("torch.cuda.HalfTensor").dtype)

# streams, events, memory statistics, autocast
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
start.record()
s = torch.cuda.Stream()
with torch.cuda.stream(s):
    s.wait_stream(torch.cuda.current_stream())
    f = a * 2
f.record_stream(s)
end.record()
torch.cuda.synchronize()
seen["elapsed_ms_ok"] = start.elapsed_time(end) >= 0
seen["max_memory_allocated"] = torch.cuda.max_memory_allocated()
seen["memory_stats_peak"] = torch.cuda.memory_stats()["active_bytes.all.peak"]
seen["capability"] = list(torch.cuda.get_device_capability())
with torch.autocast("cuda", dtype=torch.bfloat16):
    seen["autocast_dtype"] = str((torch.ones(2, 2, device="cuda") @ torch.ones(2, 2, device="cuda")).dtype)

# the CUDA RNG is the CPU generator: forking it keeps its meaning
torch.cuda.manual_seed(3)
state = torch.cuda.get_rng_state()
r1 = torch.rand(2, device="cuda")
torch.cuda._lazy_call(lambda: torch.cuda.default_generators[torch.cuda.current_device()].set_state(state))
seen["rng_replayed"] = torch.equal(r1, torch.rand(2, device="cuda"))


class Double(torch.autograd.Function):  # its backward runs in the autograd engine
    @staticmethod
    def forward(ctx, t):
        return t * 2

    @staticmethod
    def backward(ctx, g):
        return torch.ones(g.shape, device=torch.cuda.current_device()) * 2


w = torch.ones(3, requires_grad=True, device="cuda")
w.register_hook(lambda g: g + torch.zeros(g.shape, device="cuda"))
Double.apply(w).sum().backward()
seen["custom_backward"] = w.grad.tolist()

# NCCL's reduce ops, which gloo lacks
x = torch.full((4,), float(rank + 1), device="cuda")
dist.all_reduce(x, op=dist.ReduceOp.AVG)
y = torch.full((4,), float(rank + 1), device="cuda")
dist.all_reduce(y, op=dist.ReduceOp.PREMUL_SUM(0.5))
out = torch.empty(2, device="cuda")
dist.reduce_scatter_tensor(out, torch.arange(4, dtype=torch.float32, device="cuda") * (rank + 1), op=dist.ReduceOp.AVG)
seen["avg"], seen["premul"], seen["rs_avg"] = x.tolist(), y.tolist(), out.tolist()
dist.barrier(device_ids=[torch.cuda.current_device()])

# a "cuda" DeviceMesh, a DTensor, FSDP2 dividing by 1.0 (PREMUL_SUM reduce-scatter)
mesh = init_device_mesh("cuda", (world,))
seen["mesh_device_type"] = mesh.device_type
dt = distribute_tensor(torch.arange(8, dtype=torch.float32, device="cuda"), mesh, [Shard(0)])
seen["dtensor_sum"] = float(dt.full_tensor().sum())
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).cuda()
fully_shard(model, mesh=mesh)
model.set_gradient_divide_factor(1.0)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
losses = []
g = torch.Generator().manual_seed(100 + rank)
for _ in range(2):
    loss = model(torch.randn(4, 8, generator=g).cuda()).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    t = loss.detach().clone()
    dist.all_reduce(t)
    losses.append(t.item())
seen["losses"] = losses
dist.destroy_process_group()
if rank == world - 1:
    with open(sys.argv[1], "w") as fh:
        json.dump(seen, fh)
print("CUDA-NAMED OK", rank, flush=True)
