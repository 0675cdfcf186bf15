"""A GPT trained with PyTorch's own parallelism, nothing of prismllm in it: the programs of the GPU
fidelity suite written on torch.distributed's public APIs (benchmarks/fidelity_gpu.py).

    torchrun --nproc-per-node 2 benchmarks/programs/torch_parallel.py --mode ddp
    torchrun --nproc-per-node 4 benchmarks/programs/torch_parallel.py --mode tp_fsdp2 --tp 2

``--mode``:

    ddp        DistributedDataParallel over every rank (25 MB buckets, all-reduce in backward)
    fsdp2      fully_shard (FSDP2) of every block and the root over every rank
    tp         DTensor tensor parallelism over every rank: attention's q/k/v and the MLP's first
               layer column-wise, their output layers row-wise (parallelize_module)
    tp_fsdp2   a 2-D device mesh (dp, tp): the tp layout inside, fully_shard over dp
    pp         torch.distributed.pipelining over every rank (what torchtitan's PP is built on): rank r
               holds blocks r*layers/world .. (r+1)*layers/world - 1 as one PipelineStage (the first
               the embedding, the last the final norm and the head), Schedule1F1B over
               ``--microbatches`` micro-batches of the batch

The model: token embedding, ``--layers`` pre-norm blocks (causal attention through
scaled_dot_product_attention, a 4x MLP), a final norm and an LM head, in ``--dtype`` (bf16 by
default), AdamW. Synthetic data: token ids from a generator seeded by (seed, iteration, dp rank).
Each iteration: forward, backward, optimizer step, between two ``torch.cuda.synchronize()``
(the program's own iteration time, as training loops time it). Without a GPU it runs on the CPU
with gloo (max mem then prints 0), which the CPU tests use. Rank ``--report-rank`` (default
the last) prints one line an iteration:

    iteration 3/10 | loss 10.4 | iter time 51.23 ms | max mem 3456789012 B | host wait 41.2 % | period 51.9 ms

``host wait``: the share of the iteration the host spent waiting for the device at the closing
synchronize (high: the host runs ahead of a busy device; near 0: the host is the bottleneck).
``period`` (from the second iteration on): the time from the previous iteration's start to this
one's, a whole turn of the loop: the iter time and what it leaves out (the batch's preparation, the
line printed), as frameworks that log a step's time between two log points measure it.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

MODES = ("ddp", "fsdp2", "tp", "tp_fsdp2", "pp")


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.q, self.k, self.v = (nn.Linear(hidden, hidden, bias=False) for _ in range(3))
        self.o = nn.Linear(hidden, hidden, bias=False)
        self.fc1 = nn.Linear(hidden, 4 * hidden, bias=False)
        self.fc2 = nn.Linear(4 * hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.norm1(x)
        # heads from the projection's width: a tensor-parallel rank holds heads / tp of them
        q, k, v = (p(h).view(b, s, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, -1))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class GPT(nn.Module):
    """The whole model, or (``stage``: (index, count), ``--mode pp``) one pipeline stage's part of it:
    its share of the blocks, the embedding on the first stage, the final norm and the head on the
    last. Every stage draws the whole model's parameters from the seed, so each block holds the
    values it holds in the whole model."""

    def __init__(self, vocab: int, hidden: int, heads: int, layers: int, stage: tuple[int, int] = (0, 1)):
        super().__init__()
        index, count = stage
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        if count > 1:
            lo, hi = index * layers // count, (index + 1) * layers // count
            self.blocks = nn.ModuleList(list(self.blocks)[lo:hi])
            if index > 0:
                self.embed = None
            if index < count - 1:
                self.norm = self.head = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x)) if self.head is not None else x


def tensor_parallel(model: GPT, mesh) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "o": RowwiseParallel()}
    plan.update({"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    for b in model.blocks:
        parallelize_module(b, mesh, plan)


def build(a: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> tuple[nn.Module, int, int]:
    """The model as ``--mode`` parallelizes it, and this rank's (data-parallel rank, size)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(a.seed)
    stage = (rank, world) if a.mode == "pp" else (0, 1)
    model = GPT(a.vocab, a.hidden, a.heads, a.layers, stage).to(device=device, dtype=dtype)
    if a.mode == "pp":
        return model, 0, 1  # one pipeline: every stage trains on the same batch
    if a.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None), rank, world
    if a.mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for b in model.blocks:
            fully_shard(b)
        return fully_shard(model), rank, world
    from torch.distributed.device_mesh import init_device_mesh

    if a.mode == "tp":
        tensor_parallel(model, init_device_mesh(device.type, (world,)))
        return model, 0, 1
    from torch.distributed.fsdp import fully_shard

    dp = world // a.tp
    mesh = init_device_mesh(device.type, (dp, a.tp), mesh_dim_names=("dp", "tp"))
    tensor_parallel(model, mesh["tp"])
    for b in model.blocks:
        fully_shard(b, mesh=mesh["dp"])
    return fully_shard(model, mesh=mesh["dp"]), mesh["dp"].get_local_rank(), dp


def param_groups(model: nn.Module) -> list[dict]:
    """The parameters in two groups, DTensors and plain tensors: with tensor parallelism alone
    (``--mode tp``) only the blocks' linear layers are DTensors, and AdamW's multi-tensor step
    refuses a group that mixes the two (torch 2.11: "got mixed torch.Tensor and DTensor")."""
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    groups = [[p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)]]
    return [{"params": g} for g in groups if g]


def pipeline(a: argparse.Namespace, model: nn.Module, device: torch.device) -> Callable[[torch.Tensor], Any]:
    """``--mode pp``: this rank's stage under Schedule1F1B; a function of the iteration's tokens that
    runs the schedule's step and gives the mean loss of the micro-batches (the last stage) or None."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    world, rank = dist.get_world_size(), dist.get_rank()
    if a.batch % a.microbatches:
        raise SystemExit(f"torch_parallel: --microbatches {a.microbatches} does not divide --batch {a.batch}")
    # no input_args: the stages find their shapes at the first step (shape metadata sent between them)
    stage = PipelineStage(model, rank, world, device)

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().view(-1, a.vocab), target.reshape(-1))

    schedule = Schedule1F1B(stage, a.microbatches, loss_fn=loss_fn)

    def step(tokens: torch.Tensor) -> torch.Tensor | None:
        if rank == 0:
            schedule.step(tokens[:, :-1].contiguous())  # the stages check strides against the first micro-batch
            return None
        if rank < world - 1:
            schedule.step()
            return None
        losses: list[torch.Tensor] = []
        schedule.step(target=tokens[:, 1:].contiguous(), losses=losses)
        return torch.stack(losses).mean().detach()

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=MODES, default="ddp")
    ap.add_argument("--tp", type=int, default=2, help="tp_fsdp2: the tensor-parallel size")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, default=4, help="sequences a data-parallel rank trains on an iteration")
    ap.add_argument("--microbatches", type=int, default=4, help="pp: micro-batches an iteration (they divide --batch)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--report-rank", type=int, default=-1, help="the rank that prints (default: the last)")
    a = ap.parse_args()

    # a GPU where one is visible (the suite), else the CPU with gloo (its tests)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    world, rank = dist.get_world_size(), dist.get_rank()
    if a.mode == "tp_fsdp2" and world % a.tp:
        raise SystemExit(f"torch_parallel: --tp {a.tp} does not divide the world of {world}")
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    model, dp_rank, dp = build(a, device, dtype)
    opt = torch.optim.AdamW(param_groups(model), lr=1e-4)
    pp_step = pipeline(a, model, device) if a.mode == "pp" else None
    reporter = rank == (a.report_rank % world)
    if reporter:
        print(
            f"torch_parallel: {a.mode} world {world} dp {dp} | layers {a.layers} hidden {a.hidden} heads {a.heads} "
            f"seq {a.seq} vocab {a.vocab} batch {a.batch} | {a.dtype}",
            flush=True,
        )
    last_start = None
    for it in range(1, a.iters + 1):
        g = torch.Generator(device="cpu").manual_seed(a.seed * 1_000_003 + it * 1009 + dp_rank)
        tokens = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=g).to(device)
        sync()
        t0 = time.perf_counter()
        period = "" if last_start is None else f" | period {(t0 - last_start) * 1e3:.2f} ms"
        last_start = t0
        if pp_step is not None:
            loss = pp_step(tokens)
        else:
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.float().view(-1, a.vocab), tokens[:, 1:].reshape(-1))
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t1 = time.perf_counter()
        sync()
        t2 = time.perf_counter()
        if reporter:
            ms = (t2 - t0) * 1e3
            mem = torch.cuda.max_memory_allocated() if cuda else 0
            value = float(loss) if loss is not None else float("nan")
            if not math.isfinite(value):
                value = float("nan")
            print(
                f"iteration {it}/{a.iters} | loss {value:.4f} | iter time {ms:.2f} ms | max mem {mem} B"
                f" | host wait {(t2 - t1) / (t2 - t0) * 100:.1f} %{period}",
                flush=True,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
