"""A small GPT-like model trained with PyTorch's own pipeline parallelism
(``torch.distributed.pipelining``: ``PipelineStage`` and ``Schedule1F1B`` or
``ScheduleInterleaved1F1B``), nothing of prismllm in it: what torchtitan's PP is built on.

    torchrun --nproc-per-node 2 tests/programs/pipeline_train.py [--stages-per-rank 2] [--dp 2]

Every rank holds ``--stages-per-rank`` stages (interleaved: rank r holds stages r, r + pp, ...); the stages
find their input shapes at the first step by sending each other shape metadata
(``send_object_list``/``recv_object_list``), as PipelineStage does without ``input_args``. With
``--dp D`` the world is D pipelines side by side (pp = world / D, rank = dp_rank * pp + stage
rank), the gradients averaged over each stage's data-parallel group with one all_reduce a
parameter after the schedule's step. gloo on the CPU, NCCL on GPUs. The last stage's rank of
every pipeline prints its loss an iteration:

    rank 3: iteration 2/3 | loss 4.8520
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B


class Block(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Stage(nn.Module):
    """One pipeline stage: the embedding on the first, the head on the last."""

    def __init__(self, vocab: int, hidden: int, layers: int, first: bool, last: bool):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden) if first else None
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x) if self.head is not None else x


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages-per-rank", type=int, default=1, help="2 or more: interleaved 1F1B")
    ap.add_argument("--dp", type=int, default=1, help="pipelines side by side")
    ap.add_argument("--layers", type=int, default=1, help="blocks a stage holds")
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=128)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8, help="sequences a pipeline trains on an iteration")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--iters", type=int, default=3)
    a = ap.parse_args()

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % a.dp:
        raise SystemExit(f"pipeline_train: --dp {a.dp} does not divide the world of {world}")
    pp = world // a.dp
    dp_rank, pp_rank = divmod(rank, pp)
    # every rank makes every group, in the same order (new_group is collective)
    pp_groups = [dist.new_group(list(range(d * pp, (d + 1) * pp))) for d in range(a.dp)]
    dp_groups = [dist.new_group(list(range(s, world, pp))) for s in range(pp)]
    pp_group, dp_group = pp_groups[dp_rank], dp_groups[pp_rank]

    n = pp * a.stages_per_rank
    stages = []
    for idx in range(pp_rank, n, pp):
        torch.manual_seed(1000 + idx)  # a stage's weights are the same in every pipeline
        module = Stage(a.vocab, a.hidden, a.layers, idx == 0, idx == n - 1).to(device)
        stages.append(PipelineStage(module, idx, n, device, group=pp_group))

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.reshape(-1, a.vocab), target.reshape(-1))

    if a.stages_per_rank == 1:
        schedule = Schedule1F1B(stages[0], a.microbatches, loss_fn=loss_fn)
    else:
        schedule = ScheduleInterleaved1F1B(stages, a.microbatches, loss_fn=loss_fn)
    params = [p for s in stages for p in s.submod.parameters()]
    opt = torch.optim.SGD(params, lr=0.1)
    first, last = pp_rank == 0, pp_rank == (n - 1) % pp
    for it in range(1, a.iters + 1):
        g = torch.Generator().manual_seed(it * 7919 + dp_rank)
        tokens = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=g).to(device)
        losses: list[torch.Tensor] = []
        args = (tokens[:, :-1],) if first else ()
        kwargs = {"target": tokens[:, 1:], "losses": losses} if last else {}
        schedule.step(*args, **kwargs)
        if a.dp > 1:
            for p in params:
                dist.all_reduce(p.grad, group=dp_group)
                p.grad.div_(a.dp)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if last:
            loss = torch.stack(losses).mean().item()
            print(f"rank {rank}: iteration {it}/{a.iters} | loss {loss:.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
