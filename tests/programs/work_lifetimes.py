"""Tensor lifetimes under a backend's Works (GPU): prints ``torch.cuda.memory_allocated()``
at points where ProcessGroupNCCL's rules (current stream for sync ops, stash until wait for
async ones, recordStream for P2P, nothing kept by a batch's Work) decide what is live.
Run under real NCCL and in solo mode: the lines must be equal."""

import os

import torch
import torch.distributed as dist

rank = int(os.environ["RANK"])
torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
dist.init_process_group("nccl")
dev = torch.device("cuda", torch.cuda.current_device())
MB4 = (1 << 20,)  # 4 MiB of float32
peer = 1 - rank
keep = []


def show(label):
    torch.cuda.synchronize()
    print(f"MEM {label} {torch.cuda.memory_allocated()}", flush=True)


def buf():
    return torch.ones(MB4, device=dev)


show("start")
t = buf()
dist.all_reduce(t)  # sync: current stream
del t
show("sync all_reduce, freed")
t = buf()
w = dist.all_reduce(t, async_op=True)
del t
show("async all_reduce, freed before wait")  # stashed: still live
w.wait()
show("async all_reduce, after wait")  # unstashed
keep.append(w)
x, y = buf(), buf()
reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, peer), dist.P2POp(dist.irecv, y, peer)])
for r in reqs:
    r.wait()
del x, y
show("batch_isend_irecv, freed, works alive")  # the batch's Work holds nothing
keep.append(reqs)
x = buf()
w = dist.isend(x, peer) if rank == 0 else dist.irecv(x, peer)
w.wait()
del x
show("unbatched p2p, freed, work alive")  # its Work's outputs hold the tensor
keep.append(w)
out = torch.empty((2 * MB4[0],), device=dev)
inp = buf()
w = dist.all_gather_into_tensor(out, inp, async_op=True)
del inp
w.wait()
show("async all_gather, input freed after wait")
keep.clear()
show("works dropped")
dist.destroy_process_group()
