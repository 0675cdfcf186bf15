"""SPMD start-up patterns (tests/test_capture_solo_programs.py): a root broadcasts its config to ranks
holding placeholders; every rank gathers rank-dependent values and checks them; an uneven
all_to_all_single takes its split sizes as numpy integers (as Megatron's MoE dispatcher
passes them); a pipeline-style receive buffer is a leaf that requires grad."""

import numpy as np
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, ws = dist.get_rank(), dist.get_world_size()
cfg = [{"vocab": 512, "run": "abc"}] if rank == 0 else [None]
dist.broadcast_object_list(cfg, src=0)
assert cfg[0]["vocab"] == 512, f"rank {rank}: broadcast config {cfg}"
ids = [None] * ws
dist.all_gather_object(ids, rank)
assert sorted(ids) == list(range(ws)), f"rank {rank}: gathered ranks {ids}"
splits = np.array([1 + r for r in range(ws)], dtype=np.int64)  # rank r sends 1 + j rows to j
inp = torch.ones(int(splits.sum()), 2)
out = torch.empty(ws * (1 + rank), 2)
dist.all_to_all_single(out, inp, output_split_sizes=np.full(ws, 1 + rank), input_split_sizes=splits)
buf = torch.empty(3, requires_grad=True)
if rank == 0:
    dist.send(torch.ones(3), 1)
elif rank == 1:
    dist.recv(buf, 0)
print(f"rank {rank}: ok", flush=True)
dist.destroy_process_group()
