"""Megatron's data path in small: in each pair of ranks, the first builds a batch of token ids and
broadcasts it to the second (a ``torch.empty`` receive buffer), every iteration; each rank says
whether it holds what the root built. Without a tensor store, the second rank of a pair whose
root is virtual (prism time's slices, emulation) or ran apart (solo capture) receives what the
capture kept of the root's broadcast. On a GPU where one is visible (NCCL), else the CPU (gloo)."""

import torch
import torch.distributed as dist
from gpu_or_cpu import join_world

device = join_world()
rank, world = dist.get_rank(), dist.get_world_size()
pairs = [dist.new_group([2 * k, 2 * k + 1]) for k in range(world // 2)]
root = rank - rank % 2
for it in range(3):
    built = torch.arange(8, dtype=torch.int64, device=device) * 7 + 100 * it + 1000 * (rank // 2) + 1
    ids = built.clone() if rank == root else torch.empty(8, dtype=torch.int64, device=device)
    dist.broadcast(ids, src=root, group=pairs[rank // 2])
    step = torch.ones(1, device=device)
    dist.all_reduce(step)
    print(f"rank {rank}: iteration {it}: ids {'as built' if torch.equal(ids, built) else 'not as built'}", flush=True)
dist.destroy_process_group()
