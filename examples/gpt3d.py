#!/usr/bin/env python3
"""gpt3d: a Megatron-style GPT trained with tensor, pipeline, data and expert parallelism.

One self-contained file, launched unmodified by torchrun:

    python -m torch.distributed.run --nproc-per-node 8 examples/gpt3d.py --tp 2 --pp 2

It is the workload that a distributed-training emulator records and replays, so every byte
that crosses ranks goes through public ``torch.distributed`` calls on process groups that this
program creates itself, in the places Megatron-LM puts them:

* tensor parallel (TP): column/row-parallel linears, vocab-parallel embedding and cross
  entropy; ``--sp`` adds sequence parallelism (all-gather / reduce-scatter on the sequence).
* pipeline parallel (PP): 1F1B, or Megatron's interleaved schedule with ``--vpp`` model chunks
  per stage; point-to-point traffic through ``dist.batch_isend_irecv``.
* data parallel (DP): gradient buckets reduced asynchronously from gradient hooks during the
  backward pass of the last micro-batch; ``--dist-opt`` shards the optimizer (reduce-scatter of
  the gradients, all-gather of the parameters).
* expert parallel (EP): top-k MoE whose experts are spread over an EP group carved out of DP;
  tokens travel with ``dist.all_to_all_single``.
* global gradient-norm clipping (``--clip-grad``, Megatron's default 1.0): one all-reduce of
  the sum of squares on the default group per iteration; 0 turns it off.

Every layout starts from the same weights (each full tensor is drawn from a generator seeded by
the parameter's name, then sliced) and sees the same global batch, so in fp32 the loss curve of
any layout matches the single-process run to float tolerance.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import socket
import sys
import time
import warnings
from collections import deque
from dataclasses import dataclass, field, fields

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

# Newer torch releases deprecate these names in favour of *_single; they are the public API that
# torch 2.11 has, so keep them and keep the logs clean.
warnings.filterwarnings("ignore", message=r".*torch\.distributed\..* is deprecated", category=FutureWarning)


# ----------------------------------------------------------------------------------------------
# Configuration and layout
# ----------------------------------------------------------------------------------------------
def opt(default, help: str, choices: list[str] | None = None):
    """A Config field that is also a command-line flag (--name-with-dashes)."""
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class Config:
    tp: int = opt(1, "tensor-parallel size")
    pp: int = opt(1, "pipeline-parallel size (stages)")
    vpp: int = opt(1, "model chunks per pipeline stage (interleaved schedule when > 1)")
    ep: int = opt(1, "expert-parallel size, carved out of data parallel (must divide dp)")
    num_experts: int = opt(0, "experts per MoE layer; 0 = dense MLP in every layer")
    topk: int = opt(2, "experts per token")
    layers: int = opt(4, "transformer layers")
    hidden: int = opt(64, "hidden size")
    heads: int = opt(4, "attention heads")
    ffn_hidden: int = opt(0, "MLP / expert inner size; 0 = 4 * hidden")
    vocab: int = opt(512, "vocabulary size")
    seq: int = opt(32, "sequence length")
    micro_batch: int = opt(2, "sequences per micro-batch")
    global_batch: int = opt(16, "sequences per iteration, over all DP ranks")
    iters: int = opt(3, "training iterations")
    seed: int = opt(1234, "seed of the weights and of the synthetic data")
    lr: float = opt(1e-3, "AdamW learning rate")
    clip_grad: float = opt(1.0, "global gradient-norm clipping (Megatron's default 1.0); 0 = off")
    recompute: bool = opt(False, "recompute each transformer layer's activations in backward")
    dist_opt: bool = opt(False, "distributed optimizer: reduce-scatter grads, all-gather params")
    sp: bool = opt(False, "sequence parallelism inside the TP group")
    labels: bool = opt(False, "name the attention and mlp compute spans with prismllm.mark (a no-op outside prism)")
    spin: str = opt(
        "",
        "LABEL=MS: each attention or mlp span is first longer by MS ms of device time (prismllm.comm.spin: a GPU timer kernel, or a wait on the CPU): a known slowdown",
    )
    device: str = opt("auto", "auto = cuda if available", ["auto", "cpu", "cuda"])
    dtype: str = opt("auto", "parameter dtype; auto = fp32 on cpu, bf16 on cuda", ["auto", "fp32", "bf16"])
    bucket_mb: float = opt(1.0, "DP gradient bucket size in MB of fp32 gradients")
    memory_cap_mib: int = opt(0, "cap this process's CUDA memory at M MiB (a smaller GPU); 0 = the whole GPU")
    json_log: str | None = opt(None, "last rank writes [{iteration, loss, iter_time_ms, max_mem_bytes, grad_norm}]")
    save_params: str | None = opt(None, "at the end every rank writes its parameters to DIR/rank-<r>.{json,bin}")


def parse_args(argv: list[str] | None = None) -> Config:
    p = argparse.ArgumentParser(prog="gpt3d", description=__doc__.split("\n\n")[0])
    for f in fields(Config):
        flag, meta = "--" + f.name.replace("_", "-"), f.metadata
        if f.type == "bool":
            p.add_argument(flag, action="store_true", help=meta["help"])
        else:
            kind = {"int": int, "float": float}.get(f.type, str)
            p.add_argument(
                flag,
                type=kind,
                default=f.default,
                choices=meta["choices"],
                help=f"{meta['help']} (default: %(default)s)",
            )
    return Config(**vars(p.parse_args(argv)))


def layout_error(cfg: Config, world: int) -> str | None:
    """Everything that would make the layout impossible, checked before any communication."""
    tp, pp, vpp, ep, E = cfg.tp, cfg.pp, cfg.vpp, cfg.ep, cfg.num_experts
    for name in (
        "tp",
        "pp",
        "vpp",
        "ep",
        "layers",
        "hidden",
        "heads",
        "vocab",
        "seq",
        "micro_batch",
        "global_batch",
        "topk",
    ):
        if getattr(cfg, name) < 1:
            return f"--{name.replace('_', '-')} must be >= 1"
    if cfg.iters < 0 or E < 0 or cfg.ffn_hidden < 0 or cfg.clip_grad < 0 or cfg.bucket_mb <= 0:
        return "--iters, --num-experts, --ffn-hidden, --clip-grad must be >= 0 and --bucket-mb > 0"
    if world % (tp * pp):
        return f"--tp {tp} --pp {pp} does not divide world size {world} (need world % (tp*pp) == 0)"
    dp = world // (tp * pp)
    ffn = cfg.ffn_hidden or 4 * cfg.hidden
    if cfg.layers % (pp * vpp):
        return f"--layers {cfg.layers} is not divisible by --pp {pp} * --vpp {vpp} (need layers % (pp*vpp) == 0)"
    if cfg.hidden % cfg.heads:
        return f"--hidden {cfg.hidden} is not divisible by --heads {cfg.heads}"
    if cfg.heads % tp:
        return f"--heads {cfg.heads} is not divisible by --tp {tp} (need heads % tp == 0)"
    if E == 0 and ffn % tp:
        return f"--ffn-hidden {ffn} is not divisible by --tp {tp} (need ffn_hidden % tp == 0)"
    if cfg.vocab % tp:
        return f"--vocab {cfg.vocab} is not divisible by --tp {tp} (need vocab % tp == 0)"
    if cfg.sp and cfg.seq % tp:
        return f"--seq {cfg.seq} is not divisible by --tp {tp} (--sp needs seq % tp == 0)"
    if cfg.global_batch % (cfg.micro_batch * dp):
        return (
            f"--global-batch {cfg.global_batch} is not divisible by --micro-batch {cfg.micro_batch}"
            f" * dp {dp} (need global_batch % (micro_batch*dp) == 0)"
        )
    num_mb = cfg.global_batch // (cfg.micro_batch * dp)
    if ep > 1 and E == 0:
        return f"--ep {ep} requires --num-experts > 0"
    if dp % ep:
        return f"--ep {ep} does not divide dp {dp} (need dp % ep == 0, dp = world/(tp*pp))"
    if E and E % ep:
        return f"--num-experts {E} is not divisible by --ep {ep} (need num_experts % ep == 0)"
    if E and cfg.topk > E:
        return f"--topk {cfg.topk} exceeds --num-experts {E} (need topk <= num_experts)"
    if vpp > 1 and pp == 1:
        return f"--vpp {vpp} requires --pp > 1"
    if cfg.spin:
        label, _, ms = cfg.spin.partition("=")
        try:
            ok = label in ("attention", "mlp") and float(ms) > 0
        except ValueError:
            ok = False
        if not ok:
            return f"--spin {cfg.spin!r}: expected attention=MS or mlp=MS with MS > 0"
    if vpp > 1 and num_mb % pp:
        return (
            f"--vpp {vpp} needs the number of micro-batches ({num_mb}) to be divisible by --pp {pp}"
            " (need num_micro_batches % pp == 0)"
        )
    return None


def fail(msg: str, every_rank: bool = False) -> None:
    """Report a usage error once (rank 0) and leave without a traceback."""
    if every_rank or int(os.environ.get("RANK", "0")) == 0:
        print(f"gpt3d: error: {msg}", file=sys.stderr, flush=True)
    else:
        # torchrun stops the whole job at the first exit: give rank 0 time to print the message.
        time.sleep(1.0)
    sys.exit(2)


@dataclass
class Parallel:
    """This rank's coordinates and the process groups it belongs to.

    Rank order is Megatron's default: tp varies fastest, then dp, then pp,
    i.e. rank = (pp_rank * dp + dp_rank) * tp + tp_rank. The EP group is carved out of DP:
    dp_rank = edp_rank * ep + ep_rank, so EP peers are adjacent DP ranks.
    """

    world: int
    rank: int
    tp: int
    pp: int
    dp: int
    ep: int
    edp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    ep_rank: int
    edp_rank: int
    tp_group: object = None
    dp_group: object = None
    pp_group: object = None
    ep_group: object = None
    edp_group: object = None
    pp_ranks: tuple[int, ...] = ()  # global ranks of my pipeline, stage order
    tp_src: int = 0  # global rank of TP rank 0 in my TP group

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1


def build_parallel(cfg: Config, world: int, rank: int) -> Parallel:
    tp, pp, ep = cfg.tp, cfg.pp, cfg.ep
    dp = world // (tp * pp)
    edp = dp // ep
    tp_rank, dp_rank, pp_rank = rank % tp, (rank // tp) % dp, rank // (tp * dp)
    par = Parallel(
        world, rank, tp, pp, dp, ep, edp, tp_rank, pp_rank, dp_rank, ep_rank=dp_rank % ep, edp_rank=dp_rank // ep
    )

    def g(p: int, d: int, t: int) -> int:
        return (p * dp + d) * tp + t

    # Every rank calls every new_group, in the same order (a collective on the default group).
    def make(ranks: list[int], attr: str) -> None:
        group = dist.new_group(ranks)
        if rank in ranks:
            setattr(par, attr, group)
            if attr == "pp_group":
                par.pp_ranks = tuple(ranks)
            if attr == "tp_group":
                par.tp_src = ranks[0]

    for p in range(pp):
        for t in range(tp):
            make([g(p, d, t) for d in range(dp)], "dp_group")
    for p in range(pp):
        for d in range(dp):
            make([g(p, d, t) for t in range(tp)], "tp_group")
    for d in range(dp):
        for t in range(tp):
            make([g(p, d, t) for p in range(pp)], "pp_group")
    for p in range(pp):
        for t in range(tp):
            for j in range(edp):
                make([g(p, j * ep + e, t) for e in range(ep)], "ep_group")
            for e in range(ep):
                make([g(p, j * ep + e, t) for j in range(edp)], "edp_group")
    return par


# ----------------------------------------------------------------------------------------------
# Tensor-parallel communication regions (autograd functions), as in Megatron's mappings.py.
# Size-1 groups skip the call entirely, like Megatron, so tp=1 records no TP traffic.
# ----------------------------------------------------------------------------------------------
def _all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    x = x.contiguous()
    dist.all_reduce(x, op=op, group=group)
    return x


def _gather_seq(x: torch.Tensor, group, size: int) -> torch.Tensor:
    out = x.new_empty((x.shape[0] * size, *x.shape[1:]))
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


def _scatter_seq(x: torch.Tensor, group, size: int) -> torch.Tensor:
    out = x.new_empty((x.shape[0] // size, *x.shape[1:]))
    dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
    return out


class _CopyToTP(torch.autograd.Function):
    """Identity forward; all-reduce of the input gradient (each rank saw a slice of the output)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce of partial sums in forward; the gradient is already replicated."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromSP(torch.autograd.Function):
    """Sequence-parallel entry to a column-parallel layer: all-gather on the sequence dim."""

    @staticmethod
    def forward(ctx, x, group, size):
        ctx.group, ctx.size = group, size
        return _gather_seq(x, group, size)

    @staticmethod
    def backward(ctx, grad):
        return _scatter_seq(grad, ctx.group, ctx.size), None, None


class _ScatterToSP(torch.autograd.Function):
    """Sequence-parallel exit of a row-parallel layer: reduce-scatter on the sequence dim."""

    @staticmethod
    def forward(ctx, x, group, size):
        ctx.group, ctx.size = group, size
        return _scatter_seq(x, group, size)

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad, ctx.group, ctx.size), None, None


class TPRegion:
    """Entry/exit of the tensor-parallel region, choosing plain TP or sequence parallel."""

    def __init__(self, par: Parallel, sp: bool):
        self.group, self.size, self.rank, self.sp = par.tp_group, par.tp, par.tp_rank, sp

    def enter(self, x: torch.Tensor) -> torch.Tensor:  # before a column-parallel linear
        if self.size == 1:
            return x
        return _GatherFromSP.apply(x, self.group, self.size) if self.sp else _CopyToTP.apply(x, self.group)

    def exit(self, x: torch.Tensor) -> torch.Tensor:  # after a row-parallel linear
        if self.size == 1:
            return x
        return _ScatterToSP.apply(x, self.group, self.size) if self.sp else _ReduceFromTP.apply(x, self.group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross entropy over logits split on the vocabulary (Megatron's vocab_parallel_cross_entropy):
    three all-reduces (max, target logit, sum of exps) instead of gathering the logits."""

    @staticmethod
    def forward(ctx, logits, target, group, size, vocab_start):
        logits_max = logits.max(dim=-1)[0]
        if size > 1:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        logits = logits - logits_max.unsqueeze(-1)
        outside = (target < vocab_start) | (target >= vocab_start + logits.size(-1))
        local_target = (target - vocab_start).masked_fill(outside, 0)
        target_logit = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = logits.exp()
        sum_exp = exp.sum(dim=-1)
        if size > 1:
            dist.all_reduce(target_logit, group=group)
            dist.all_reduce(sum_exp, group=group)
        loss = sum_exp.log() - target_logit
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, outside, local_target)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, outside, local_target = ctx.saved_tensors
        grad = softmax  # d loss / d logits = softmax - onehot(target); modified in place, used once
        grad.scatter_add_(-1, local_target.unsqueeze(-1), (outside.to(grad.dtype) - 1.0).unsqueeze(-1))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad, None, None, None, None


# ----------------------------------------------------------------------------------------------
# Deterministic, layout-independent initialisation
# ----------------------------------------------------------------------------------------------
def stable_seed(*parts) -> int:
    digest = hashlib.sha256("/".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class Builder:
    """Creates this rank's parameters: the full tensor is drawn on CPU from a generator seeded by
    (seed, global parameter name), then the shard this rank owns is sliced out. Any layout thus
    starts from the same global weights."""

    def __init__(self, cfg: Config, par: Parallel, device: torch.device, dtype: torch.dtype):
        self.cfg, self.par, self.device, self.dtype = cfg, par, device, dtype
        self.tpr = TPRegion(par, cfg.sp)
        self.named = lambda label: contextlib.nullcontext()
        if cfg.labels:
            import prismllm  # only when asked: the example runs without prismllm otherwise

            self.named = prismllm.span
        self.spins = {}
        if cfg.spin:
            from prismllm.comm.spin import Spinner  # only when asked, as for --labels

            label, _, ms = cfg.spin.partition("=")
            spin = Spinner()
            self.spins = {label: lambda: spin(float(ms))}

    def span(self, label: str, compute, x: torch.Tensor) -> torch.Tensor:
        """``compute(x)`` as the span ``label``: named (--labels) and, with --spin LABEL=MS,
        longer by MS ms of spinning first (a known slowdown that `prism whatif` can be checked
        against)."""
        with self.named(label):
            spin = self.spins.get(label)
            if spin is not None:
                spin()
            return compute(x)

    def draw(self, name: str, shape: tuple[int, ...], std: float) -> torch.Tensor:
        g = torch.Generator().manual_seed(stable_seed(self.cfg.seed, name))
        return torch.randn(shape, generator=g) * std

    def normal(self, name: str, shape: tuple[int, ...], std: float, shard=None, **flags) -> nn.Parameter:
        w = self.draw(name, shape, std)
        if shard is None:
            return self._param(w, **flags)
        return self._param(shard(w), tp_sharded=True, **flags)

    def const(self, shape: tuple[int, ...], value: float, **flags) -> nn.Parameter:
        return self._param(torch.full(shape, value), **flags)

    def _param(
        self, w: torch.Tensor, sp_grad: bool = False, expert: bool = False, tp_sharded: bool = False
    ) -> nn.Parameter:
        p = nn.Parameter(w.to(self.device, self.dtype).contiguous())
        p.tp_duplicate = self.par.tp > 1 and not tp_sharded  # same tensor on every TP rank
        # sp_grad: replicated over TP but, under sequence parallelism, each TP rank only sees its
        # slice of the tokens, so the gradient must be summed over TP (Megatron's layernorm grads).
        p.sp_grad = sp_grad and self.cfg.sp and self.par.tp > 1
        p.expert = expert  # reduced over the expert-data-parallel group instead of DP
        return p

    def rows(self, n: int):
        """Shard along dim 0 (column-parallel weight, vocab-parallel embedding)."""
        r, t = self.par.tp_rank, self.par.tp
        return lambda w: w[r * n // t : (r + 1) * n // t]

    def cols(self, n: int):
        """Shard along dim 1 (row-parallel weight)."""
        r, t = self.par.tp_rank, self.par.tp
        return lambda w: w[:, r * n // t : (r + 1) * n // t]


# ----------------------------------------------------------------------------------------------
# Model. Activations are [sequence, batch, hidden] as in Megatron, so that sequence parallelism
# shards dim 0 and the collectives work on contiguous slices.
# ----------------------------------------------------------------------------------------------
class LayerNorm(nn.Module):
    def __init__(self, b: Builder, hidden: int):
        super().__init__()
        self.weight = b.const((hidden,), 1.0, sp_grad=True)
        self.bias = b.const((hidden,), 0.0, sp_grad=True)

    def forward(self, x):
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias)


class Attention(nn.Module):
    def __init__(self, b: Builder, name: str):
        super().__init__()
        cfg, tp, r = b.cfg, b.par.tp, b.par.tp_rank
        H, nh = cfg.hidden, cfg.heads
        self.local_heads, self.head_dim, self.tpr, self.b = nh // tp, H // nh, b.tpr, b
        nl = self.local_heads

        def qkv_shard(w):  # full [3*H, H] = [3, heads, head_dim, H]; keep my heads of q, k and v
            return w.view(3, nh, H // nh, H)[:, r * nl : (r + 1) * nl].reshape(3 * nl * (H // nh), H)

        self.qkv = b.normal(f"{name}.qkv.weight", (3 * H, H), 0.02, qkv_shard)  # column-parallel
        out_std = 0.02 / (2 * cfg.layers) ** 0.5  # Megatron scaled init
        self.proj = b.normal(f"{name}.proj.weight", (H, H), out_std, b.cols(H))  # row-parallel

    def forward(self, x):
        return self.tpr.exit(self.b.span("attention", self.local, self.tpr.enter(x)))

    def local(self, x):  # between the tensor-parallel entry and exit
        qkv = F.linear(x, self.qkv)  # [s, b, 3 * local_heads * hd]
        s, bsz = qkv.shape[:2]
        q, k, v = qkv.view(s, bsz, 3, self.local_heads, self.head_dim).permute(2, 1, 3, 0, 4).unbind(0)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, heads, s, hd]
        o = o.permute(2, 0, 1, 3).reshape(s, bsz, self.local_heads * self.head_dim)
        return F.linear(o, self.proj)


class MLP(nn.Module):
    def __init__(self, b: Builder, name: str):
        super().__init__()
        H, Fh, L = b.cfg.hidden, b.cfg.ffn_hidden or 4 * b.cfg.hidden, b.cfg.layers
        self.tpr, self.b = b.tpr, b
        self.fc1 = b.normal(f"{name}.fc1.weight", (Fh, H), 0.02, b.rows(Fh))  # column-parallel
        self.fc2 = b.normal(f"{name}.fc2.weight", (H, Fh), 0.02 / (2 * L) ** 0.5, b.cols(Fh))  # row-parallel

    def forward(self, x):
        return self.tpr.exit(self.b.span("mlp", self.local, self.tpr.enter(x)))

    def local(self, x):  # between the tensor-parallel entry and exit
        return F.linear(F.gelu(F.linear(x, self.fc1)), self.fc2)


class _AllToAll(torch.autograd.Function):
    """Uneven all-to-all; its backward is the same exchange with the splits swapped."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        out = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return out, None, None, None


class Router(nn.Module):
    """The MoE gate: fp32 logits [tokens, experts]. A module of its own, with Megatron's
    attribute names (``topk``, global ``layer_number``), so that tools find it by type or name
    (prism's mock router: ``--router-module Router``)."""

    def __init__(self, b: Builder, name: str, layer_number: int):
        super().__init__()
        self.topk, self.layer_number = b.cfg.topk, layer_number
        self.weight = b.normal(f"{name}.weight", (b.cfg.num_experts, b.cfg.hidden), 0.02, sp_grad=True)

    def forward(self, tokens):
        return F.linear(tokens.float(), self.weight.float())  # router in fp32


class MoE(nn.Module):
    """Top-k softmax router, no token dropping, experts spread over the EP group.

    TP choice (keep it simple and correct): experts are not tensor-parallel. Without --sp every TP
    rank holds the same tokens, routes them identically and computes them, so the MoE layer needs
    no TP traffic. With --sp each TP rank routes its own sequence slice through its own EP group;
    router and expert grads are then partial over TP and flagged sp_grad (summed over TP).
    """

    def __init__(self, b: Builder, name: str, layer_number: int):
        super().__init__()
        cfg, par = b.cfg, b.par
        H, Fh, L = cfg.hidden, cfg.ffn_hidden or 4 * cfg.hidden, cfg.layers
        self.E, self.K, self.ep, self.ep_rank, self.group = cfg.num_experts, cfg.topk, par.ep, par.ep_rank, par.ep_group
        self.local = self.E // self.ep
        first = self.ep_rank * self.local
        self.router = Router(b, f"{name}.router", layer_number)  # drawn as the bare weight was
        mine = range(first, first + self.local)  # only this EP rank's experts are drawn
        w1 = [b.draw(f"{name}.experts.{e}.fc1.weight", (Fh, H), 0.02) for e in mine]
        w2 = [b.draw(f"{name}.experts.{e}.fc2.weight", (H, Fh), 0.02 / (2 * L) ** 0.5) for e in mine]
        self.w1 = b._param(torch.stack(w1), sp_grad=True, expert=True)  # [local experts, F, H]
        self.w2 = b._param(torch.stack(w2), sp_grad=True, expert=True)  # [local experts, H, F]

    def forward(self, x):
        s, bsz, H = x.shape
        tokens = x.reshape(-1, H)
        T, K = tokens.shape[0], self.K
        logits = self.router(tokens)
        top_logits, top_idx = logits.topk(K, dim=-1)
        weights = top_logits.softmax(dim=-1).to(x.dtype)  # [T, K]
        # Permute token copies so that they are grouped by expert (stable sort: deterministic).
        flat_idx = top_idx.reshape(-1)
        order = torch.argsort(flat_idx, stable=True)
        permuted = tokens.unsqueeze(1).expand(T, K, H).reshape(T * K, H).index_select(0, order)
        counts = torch.bincount(flat_idx, minlength=self.E)  # tokens per expert
        expert_in, expert_counts, undo = self.dispatch(permuted, counts)
        outs, offset = [], 0
        for e, n in enumerate(expert_counts):  # zero-row slices still
            xe = expert_in[offset : offset + n]  # join the graph, so every
            outs.append(F.linear(F.gelu(F.linear(xe, self.w1[e])), self.w2[e]))  # expert gets a grad
            offset += n
        combined = undo(torch.cat(outs))
        unpermuted = combined.index_select(0, torch.argsort(order))  # back to (token, k) order
        out = (unpermuted.view(T, K, H) * weights.unsqueeze(-1)).sum(dim=1)
        return out.view(s, bsz, H)

    def dispatch(self, permuted: torch.Tensor, counts: torch.Tensor):
        """Send every token copy to the EP rank owning its expert. Returns the tokens this rank's
        experts must process (grouped by local expert), their counts, and the inverse function."""
        if self.ep == 1:
            return permuted, counts.tolist(), lambda y: y
        all_counts = counts.new_empty(self.ep * self.E)
        dist.all_gather_into_tensor(all_counts, counts, group=self.group)  # every rank knows all counts
        c = all_counts.view(self.ep, self.E).tolist()  # c[src][expert]
        L, me = self.local, self.ep_rank
        in_splits = [sum(c[me][j * L : (j + 1) * L]) for j in range(self.ep)]
        out_splits = [sum(c[j][me * L : (me + 1) * L]) for j in range(self.ep)]
        received = _AllToAll.apply(permuted, out_splits, in_splits, self.group)  # source-major
        # Regroup the received [source][local expert] blocks into [local expert][source] order:
        # idx[i] = start of i's block in the received tensor + i's offset inside its block.
        n = torch.tensor([row[me * L : (me + 1) * L] for row in c], dtype=torch.long)  # [ep, L]
        src_starts = (n.reshape(-1).cumsum(0) - n.reshape(-1)).view(self.ep, L)
        sizes, starts = n.t().reshape(-1), src_starts.t().reshape(-1)  # expert-major
        dst_starts = sizes.cumsum(0) - sizes
        idx = torch.repeat_interleave(starts - dst_starts, sizes) + torch.arange(int(sizes.sum()))
        idx = idx.to(permuted.device)
        expert_counts = n.sum(dim=0).tolist()

        def undo(y: torch.Tensor) -> torch.Tensor:
            source_major = y.index_select(0, torch.argsort(idx))
            return _AllToAll.apply(source_major, in_splits, out_splits, self.group)  # combine

        return received.index_select(0, idx), expert_counts, undo


class TransformerLayer(nn.Module):
    def __init__(self, b: Builder, index: int):
        super().__init__()
        name, H = f"layers.{index}", b.cfg.hidden
        self.ln1, self.ln2 = LayerNorm(b, H), LayerNorm(b, H)
        self.attn = Attention(b, f"{name}.attn")
        self.mlp = MoE(b, f"{name}.mlp", index + 1) if b.cfg.num_experts else MLP(b, f"{name}.mlp")

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Embedding(nn.Module):
    """Vocab-parallel word embedding + learned positions (first virtual stage only)."""

    def __init__(self, b: Builder):
        super().__init__()
        cfg, par = b.cfg, b.par
        self.tpr, self.vocab_start, self.vocab_local = b.tpr, par.tp_rank * cfg.vocab // par.tp, cfg.vocab // par.tp
        self.word = b.normal("embedding.word.weight", (cfg.vocab, cfg.hidden), 0.02, b.rows(cfg.vocab))
        self.position = b.normal("embedding.position.weight", (cfg.seq, cfg.hidden), 0.02, sp_grad=True)

    def forward(self, tokens):  # tokens [b, s] -> [s(/tp), b, H]
        ids = tokens.t()
        if self.tpr.size == 1:
            return F.embedding(ids, self.word) + self.position.unsqueeze(1)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_start + self.vocab_local)
        emb = F.embedding((ids - self.vocab_start).masked_fill(outside, 0), self.word)
        emb = emb.masked_fill(outside.unsqueeze(-1), 0.0)  # other ranks own these rows
        emb = self.tpr.exit(emb)  # all-reduce (or reduce-scatter with SP)
        pos = self.position
        if self.tpr.sp:
            n = pos.shape[0] // self.tpr.size
            pos = pos[self.tpr.rank * n : (self.tpr.rank + 1) * n]
        return emb + pos.unsqueeze(1)


class Head(nn.Module):
    """Final norm, column-parallel output layer (untied from the embedding) and vocab-parallel loss."""

    def __init__(self, b: Builder):
        super().__init__()
        cfg, par = b.cfg, b.par
        self.tpr, self.vocab_start = b.tpr, par.tp_rank * cfg.vocab // par.tp
        self.norm = LayerNorm(b, cfg.hidden)
        self.output = b.normal("output.weight", (cfg.vocab, cfg.hidden), 0.02, b.rows(cfg.vocab))

    def forward(self, x, labels):  # -> mean token loss
        logits = F.linear(self.tpr.enter(self.norm(x)), self.output).float()
        loss = _VocabParallelCrossEntropy.apply(
            logits, labels.t().contiguous(), self.tpr.group, self.tpr.size, self.vocab_start
        )
        return loss.mean()


class ModelChunk(nn.Module):
    """The layers of one virtual pipeline stage. Virtual stage v = chunk * pp + pp_rank holds
    layers [v*n, (v+1)*n) with n = layers / (pp*vpp) (Megatron's interleaved assignment)."""

    def __init__(self, b: Builder, vstage: int):
        super().__init__()
        cfg = b.cfg
        n, total = cfg.layers // (cfg.pp * cfg.vpp), cfg.pp * cfg.vpp
        self.recompute = cfg.recompute
        self.embedding = Embedding(b) if vstage == 0 else None
        self.layers = nn.ModuleList(TransformerLayer(b, i) for i in range(vstage * n, (vstage + 1) * n))
        self.head = Head(b) if vstage == total - 1 else None

    def forward(self, x, tokens, labels):
        if self.embedding is not None:
            x = self.embedding(tokens)
        for layer in self.layers:
            # Full activation recomputation per layer; collectives inside are replayed in backward.
            x = checkpoint(layer, x, use_reentrant=False) if self.recompute else layer(x)
        return self.head(x, labels) if self.head is not None else x


# ----------------------------------------------------------------------------------------------
# Data parallel: gradient buckets, reduced from gradient hooks (Megatron DDP with overlap)
# ----------------------------------------------------------------------------------------------
class Bucket:
    """A run of parameters sharing one flat fp32 gradient buffer and one flat parameter buffer.
    Parameters become views into the buffers, so the distributed optimizer can all-gather
    straight into them. Buffers are padded to a multiple of the reducing group's size."""

    def __init__(self, params: list[nn.Parameter], group, size: int, rank: int, tp_rank: int, device, dtype):
        self.params, self.group, self.size, self.rank = params, group, size, rank
        numel = sum(p.numel() for p in params)
        padded = -(-numel // size) * size
        self.grad_data = torch.zeros(padded, dtype=torch.float32, device=device)
        self.param_data = torch.zeros(padded, dtype=dtype, device=device)
        offset = 0
        self.norm_ranges: list[list[int]] = []  # flat ranges this rank counts in the grad norm
        for p in params:
            n = p.numel()
            if not p.tp_duplicate or tp_rank == 0:
                if self.norm_ranges and self.norm_ranges[-1][1] == offset:
                    self.norm_ranges[-1][1] = offset + n
                else:
                    self.norm_ranges.append([offset, offset + n])
            self.param_data[offset : offset + n].copy_(p.detach().reshape(-1))
            p.data = self.param_data[offset : offset + n].view_as(p)
            p.main_grad = self.grad_data[offset : offset + n].view_as(p)
            offset += n
        shard = padded // size
        self.shard = slice(rank * shard, (rank + 1) * shard)
        self.ready = 0  # parameters whose last-micro-batch gradient has arrived
        self.launched = False
        self.work = None
        self.shard_grad = None


class GradSync:
    """Gradient buckets of one model chunk (Megatron keeps one DDP wrapper per chunk).

    Gradients accumulate into fp32 main_grad on every micro-batch; reduction is only enabled for
    the backward pass of the last micro-batch, where each bucket is launched asynchronously as
    soon as its last parameter's gradient arrives."""

    def __init__(self, cfg: Config, par: Parallel, chunk: ModelChunk, device, dtype):
        self.dist_opt, self.dp = cfg.dist_opt, par.dp
        self.sync_enabled = False
        self.buckets: list[Bucket] = []
        self.bucket_of: dict[int, Bucket] = {}
        limit = max(1, int(cfg.bucket_mb * 1e6 / 4))
        params = list(reversed(list(chunk.parameters())))  # backward visits them roughly in reverse
        for expert, group, size, rank in (
            (False, par.dp_group, par.dp, par.dp_rank),
            (True, par.edp_group, par.edp, par.edp_rank),
        ):
            run, n = [], 0
            for p in (q for q in params if q.expert == expert):
                run.append(p)
                n += p.numel()
                if n >= limit:
                    self.buckets.append(Bucket(run, group, size, rank, par.tp_rank, device, dtype))
                    run, n = [], 0
            if run:
                self.buckets.append(Bucket(run, group, size, rank, par.tp_rank, device, dtype))
        for b in self.buckets:
            for p in b.params:
                self.bucket_of[id(p)] = b
                p.register_post_accumulate_grad_hook(self._on_grad)

    def _on_grad(self, p: nn.Parameter) -> None:
        p.main_grad.add_(p.grad)
        p.grad = None
        if self.sync_enabled:
            b = self.bucket_of[id(p)]
            b.ready += 1
            if b.ready == len(b.params) and not b.launched:
                self._launch(b)

    def _launch(self, b: Bucket) -> None:
        # Average over the full DP world: for experts, an expert's gradient already sums the tokens
        # of its whole EP group, so summing over expert-DP and dividing by dp is the global mean.
        b.grad_data.mul_(1.0 / self.dp)
        if b.size == 1:
            b.work = None
        elif self.dist_opt:
            b.shard_grad = torch.empty_like(b.grad_data[b.shard])
            b.work = dist.reduce_scatter_tensor(b.shard_grad, b.grad_data, group=b.group, async_op=True)
        else:
            b.work = dist.all_reduce(b.grad_data, group=b.group, async_op=True)
        b.launched = True

    def finish(self) -> None:
        for b in self.buckets:
            if not b.launched:  # a parameter without gradient this iteration: launch anyway
                self._launch(b)
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
                if self.dist_opt:
                    b.grad_data[b.shard].copy_(b.shard_grad)
            b.work, b.shard_grad, b.ready, b.launched = None, None, 0, False
        self.sync_enabled = False

    def zero(self) -> None:
        for b in self.buckets:
            b.grad_data.zero_()

    def owned_sq_norm(self) -> torch.Tensor:
        """Sum of squares of the reduced gradient elements this rank owns, so that the sum over
        all ranks counts every element of the model once: TP duplicates only on TP rank 0, DP
        replicas only on the first rank of the reducing group, or each rank's own shard with
        --dist-opt."""
        total = torch.zeros((), dtype=torch.float32, device=self.buckets[0].grad_data.device)
        for b in self.buckets:
            if self.dist_opt:
                lo, hi = b.shard.start, b.shard.stop
            else:
                lo, hi = 0, (b.grad_data.numel() if b.rank == 0 else 0)
            for start, end in b.norm_ranges:
                a, z = max(start, lo), min(end, hi)
                if a < z:
                    total += b.grad_data[a:z].square().sum()
        return total


class MegatronOptimizer(torch.optim.Optimizer):
    """fp32 master weights updated by one torch.optim.AdamW (step() once per iteration).

    A torch.optim.Optimizer itself, so that its whole step (AdamW's update, then the parameter
    all-gather of --dist-opt) runs inside one optimizer step, as Megatron's DistributedOptimizer
    .step() does; tools that find iterations with a global optimizer-step hook see the step end
    after the all-gather.

    Without --dist-opt the masters are the parameters themselves (fp32) or fp32 copies (bf16).
    With --dist-opt every rank owns one shard of each bucket's flat buffer: the reduce-scattered
    gradient shard feeds AdamW, and the updated shards are all-gathered back into the parameters.
    Expert buckets use the same scheme over the expert-data-parallel group."""

    def __init__(self, cfg: Config, syncs: list[GradSync], dtype: torch.dtype):
        self.dist_opt, self.dtype, self.syncs = cfg.dist_opt, dtype, syncs
        self.masters, self.grads, self.copies = [], [], []
        for b in (b for s in syncs for b in s.buckets):
            if cfg.dist_opt:
                self.masters.append(nn.Parameter(b.param_data[b.shard].float().clone()))
                self.grads.append(b.grad_data[b.shard])
            else:
                for p in b.params:
                    master = p if p.dtype == torch.float32 else nn.Parameter(p.detach().float().clone())
                    if master is not p:
                        self.copies.append((p, master))
                    self.masters.append(master)
                    self.grads.append(p.main_grad)
        # Uniform weight decay keeps sharded and unsharded updates elementwise identical.
        self.opt = torch.optim.AdamW(self.masters, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
        super().__init__(self.masters, {})

    def step(self, closure=None) -> None:
        for m, g in zip(self.masters, self.grads):
            m.grad = g
        self.opt.step()
        for m in self.masters:
            m.grad = None
        with torch.no_grad():
            if self.dist_opt:
                works = []
                buckets = [b for s in self.syncs for b in s.buckets]
                for b, m in zip(buckets, self.masters):
                    shard = m.detach().to(self.dtype)
                    if b.size == 1:
                        b.param_data.copy_(shard)
                    else:
                        works.append(dist.all_gather_into_tensor(b.param_data, shard, group=b.group, async_op=True))
                for w in works:
                    w.wait()
            else:
                for p, m in self.copies:
                    p.copy_(m)


def clip_grad_norm(syncs: list[GradSync], max_norm: float) -> float:
    """Megatron's global gradient-norm clipping: one all-reduce of the owned sums of squares over
    all ranks (every element counted once), then scale the gradients if the norm is too large."""
    sq = sum(s.owned_sq_norm() for s in syncs)
    if dist.get_world_size() > 1:
        dist.all_reduce(sq, group=dist.group.WORLD)
    norm = float(sq.sqrt())
    coeff = max_norm / (norm + 1e-6)
    if coeff < 1.0:
        for b in (b for s in syncs for b in s.buckets):
            b.grad_data.mul_(coeff)
    return norm


def allreduce_sp_grads(syncs: list[GradSync], par: Parallel) -> None:
    """Sum over TP the grads of TP-replicated params that only saw a sequence slice (--sp), in
    one coalesced all-reduce after the DP reduction (Megatron's _allreduce_layernorm_grads)."""
    grads = [p.main_grad for s in syncs for b in s.buckets for p in b.params if p.sp_grad]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=par.tp_group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


# ----------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------
class SyntheticData:
    """Deterministic token streams. Sample i of the global batch of iteration t is drawn from a
    generator seeded by (seed, t, i); DP rank d's micro-batch m holds samples
    (d*M + m)*micro_batch ..., so every layout trains on the same global batch. Sequences are
    noisy arithmetic progressions mod vocab, so the loss has something to learn."""

    def __init__(self, cfg: Config, par: Parallel, num_mb: int, device):
        self.cfg, self.par, self.num_mb, self.device = cfg, par, num_mb, device

    def _sample(self, iteration: int, index: int) -> torch.Tensor:
        V, S = self.cfg.vocab, self.cfg.seq
        g = torch.Generator().manual_seed(stable_seed(self.cfg.seed, "data", iteration, index))
        start = int(torch.randint(0, V, (1,), generator=g))
        stride = int(torch.randint(1, 17, (1,), generator=g))
        seq = (start + stride * torch.arange(S + 1)) % V
        noise = torch.rand(S + 1, generator=g) < 0.1
        return torch.where(noise, torch.randint(0, V, (S + 1,), generator=g), seq)

    def get(self, iteration: int, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Megatron style: TP rank 0 builds the micro-batch and broadcasts it in its TP group."""
        cfg, par = self.cfg, self.par
        pack = torch.empty((2, cfg.micro_batch, cfg.seq), dtype=torch.int64, device=self.device)
        if par.tp_rank == 0:
            first = (par.dp_rank * self.num_mb + mb) * cfg.micro_batch
            x = torch.stack([self._sample(iteration, first + j) for j in range(cfg.micro_batch)])
            pack[0].copy_(x[:, :-1])
            pack[1].copy_(x[:, 1:])
        if par.tp > 1:
            dist.broadcast(pack, src=par.tp_src, group=par.tp_group)
        return pack[0], pack[1]


# ----------------------------------------------------------------------------------------------
# Pipeline schedules (Megatron's forward_backward_{no_pipelining, pipelining_without_interleaving,
# pipelining_with_interleaving}). Shapes are static: [seq(/tp), micro_batch, hidden].
# ----------------------------------------------------------------------------------------------
class Pipeline:
    """Runs one iteration's micro-batches through this rank's model chunks.

    pp == 1: forward+backward per micro-batch. vpp == 1: 1F1B: stage p runs pp-p-1 warmup
    forwards, then alternates one forward and one backward, then drains the remaining backwards.
    vpp > 1: Megatron's interleaved 1F1B, where micro-batches travel in groups of pp through
    chunk 0 of every stage, then chunk 1, ... (the last stage sends to the first: a ring).
    Every exchange is one blocking dist.batch_isend_irecv with the neighbour stages, combining
    sends and receives exactly as Megatron's p2p_communication does, so no rank ever waits on a
    message its peer has not posted yet in its own program order."""

    def __init__(
        self,
        cfg: Config,
        par: Parallel,
        chunks: list[ModelChunk],
        syncs: list[GradSync],
        data: SyntheticData,
        num_mb: int,
        device,
        dtype,
    ):
        self.cfg, self.par, self.chunks, self.syncs, self.data = cfg, par, chunks, syncs, data
        self.M, self.device, self.dtype = num_mb, device, dtype
        seq = cfg.seq // par.tp if cfg.sp else cfg.seq
        self.shape = (seq, cfg.micro_batch, cfg.hidden)
        self.next = par.pp_ranks[(par.pp_rank + 1) % par.pp]  # wraps around: interleaving needs it
        self.prev = par.pp_ranks[(par.pp_rank - 1) % par.pp]

    # -- point to point ------------------------------------------------------------------------
    def comm(self, send_next=None, send_prev=None, recv_prev=False, recv_next=False):
        """One batched exchange with the neighbour stages; returns (from_prev, from_next).

        Ops are listed activations first (send_next, recv_prev), then gradients (send_prev,
        recv_next). P2P messages between a pair of ranks match in posting order, and with pp == 2
        'next' and 'prev' are the same rank, so both sides must agree on this order."""
        ops, from_prev, from_next = [], None, None
        group = self.par.pp_group
        if send_next is not None:
            ops.append(dist.P2POp(dist.isend, send_next.contiguous(), self.next, group))
        if recv_prev:
            from_prev = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            ops.append(dist.P2POp(dist.irecv, from_prev, self.prev, group))
        if send_prev is not None:
            ops.append(dist.P2POp(dist.isend, send_prev.contiguous(), self.prev, group))
        if recv_next:
            from_next = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            ops.append(dist.P2POp(dist.irecv, from_next, self.next, group))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        if from_prev is not None:
            from_prev.requires_grad_()
        return from_prev, from_next

    # -- one micro-batch on one chunk ----------------------------------------------------------
    def forward(self, c: int, mb: int, x):
        chunk, tokens, labels = self.chunks[c], None, None
        if chunk.embedding is not None or chunk.head is not None:
            tokens, labels = self.data.get(self.iteration, mb)
        out = chunk(x, tokens, labels)
        if chunk.head is not None:
            self.losses.append(out.detach())
            out = out / self.M  # mean over micro-batches
        return out

    def backward(self, c: int, mb: int, x, y, dy):
        if mb == self.M - 1:
            self.syncs[c].sync_enabled = True  # DP reduction overlaps the last backward only
        torch.autograd.backward(y, grad_tensors=dy)
        return x.grad if x is not None else None

    def run(self, iteration: int) -> list[torch.Tensor]:
        self.iteration, self.losses = iteration, []
        if self.par.pp == 1:
            for mb in range(self.M):
                self.backward(0, mb, None, self.forward(0, mb, None), None)
        elif self.cfg.vpp == 1:
            self.one_f_one_b()
        else:
            self.interleaved()
        return self.losses

    # -- 1F1B --------------------------------------------------------------------------------
    def one_f_one_b(self) -> None:
        par, M = self.par, self.M
        first, last = par.first_stage, par.last_stage
        warmup = min(par.pp - par.pp_rank - 1, M)
        remaining = M - warmup
        inputs, outputs = deque(), deque()

        def recv_forward():
            return None if first else self.comm(recv_prev=True)[0]

        for i in range(warmup):
            x = recv_forward()
            y = self.forward(0, i, x)
            if not last:
                self.comm(send_next=y)
            inputs.append(x)
            outputs.append(y)
        x = recv_forward() if remaining else None
        for i in range(remaining):
            y = self.forward(0, warmup + i, x)
            dy = None if last else self.comm(send_next=y, recv_next=True)[1]
            inputs.append(x)
            outputs.append(y)
            dx = self.backward(0, i, inputs.popleft(), outputs.popleft(), dy)
            if i == remaining - 1:
                if not first:
                    self.comm(send_prev=dx)
            else:
                x = None if first else self.comm(send_prev=dx, recv_prev=True)[0]
        for i in range(warmup):  # cooldown
            dy = None if last else self.comm(recv_next=True)[1]
            dx = self.backward(0, remaining + i, inputs.popleft(), outputs.popleft(), dy)
            if not first:
                self.comm(send_prev=dx)

    # -- interleaved 1F1B (virtual pipeline) ---------------------------------------------------
    def interleaved(self) -> None:
        """Megatron's forward_backward_pipelining_with_interleaving (without p2p overlap): the
        k-th forward of a stage is micro-batch mb_of(k) on chunk chunk_of(k); which neighbours
        must send or receive at each step follows Megatron's recv_prev / recv_next rules."""
        par, M, pp, vpp = self.par, self.M, self.par.pp, self.cfg.vpp
        first, last = par.first_stage, par.last_stage
        total = M * vpp
        if M == pp:  # Megatron: with one group of micro-batches, run all forwards first
            warmup, all_warmup = total, True
        else:
            warmup, all_warmup = min((pp - par.pp_rank - 1) * 2 + (vpp - 1) * pp, total), False
        remaining = total - warmup
        inputs = [[] for _ in range(vpp)]
        outputs = [[] for _ in range(vpp)]
        out_grads = [[] for _ in range(vpp)]

        def chunk_of(k: int, forward: bool) -> int:  # k-th forward/backward of this stage
            c = (k % (pp * vpp)) // pp
            return c if forward else vpp - 1 - c

        def mb_of(k: int) -> int:
            return (k // (pp * vpp)) * pp + k % pp

        def first_virtual(c):
            return first and c == 0

        def last_virtual(c):
            return last and c == vpp - 1

        def forward_k(k: int):
            c = chunk_of(k, True)
            if first_virtual(c) and len(inputs[c]) == len(outputs[c]):
                inputs[c].append(None)
            y = self.forward(c, mb_of(k), inputs[c][-1])
            outputs[c].append(y)
            return y

        def backward_k(k: int):
            c = chunk_of(k, False)
            if last_virtual(c) and not out_grads[c]:
                out_grads[c].append(None)
            return self.backward(c, mb_of(k), inputs[c].pop(0), outputs[c].pop(0), out_grads[c].pop(0))

        if not first:
            inputs[0].append(self.comm(recv_prev=True)[0])
        for k in range(warmup):
            y = forward_k(k)
            next_c = chunk_of(k + 1, True)
            recv_prev = not (first and next_c == 0) and k != total - 1
            if last_virtual(chunk_of(k, True)):
                y = None  # the loss is not sent anywhere
            if k == warmup - 1 and not all_warmup:
                recv_next = not last
                x, dy = self.comm(send_next=y, recv_prev=recv_prev, recv_next=recv_next)
                if recv_next:
                    out_grads[vpp - 1].append(dy)
            else:
                x, _ = self.comm(send_next=y, recv_prev=recv_prev)
            if recv_prev:
                inputs[next_c].append(x)
        for k in range(remaining):  # steady state: one forward, one backward
            fk, bk = k + warmup, k
            y = forward_k(fk)
            dx = backward_k(bk)
            if last_virtual(chunk_of(fk, True)):
                y = None
            if first_virtual(chunk_of(bk, False)):
                dx = None
            recv_prev = True
            if first:
                next_fc = chunk_of(fk - (pp - 1), True)
                if next_fc == vpp - 1:
                    recv_prev = False
                next_fc += 1
            else:
                next_fc = chunk_of(fk + 1, True)
            recv_next = True
            if last:
                next_bc = chunk_of(bk - (pp - 1), False)
                if next_bc == 0:
                    recv_next = False
                next_bc -= 1
            else:
                next_bc = chunk_of(bk + 1, False)
            if k == remaining - 1:
                recv_prev = False
            x, dy = self.comm(send_next=y, send_prev=dx, recv_prev=recv_prev, recv_next=recv_next)
            if recv_prev:
                inputs[next_fc].append(x)
            if recv_next:
                out_grads[next_bc].append(dy)
        if all_warmup:
            out_grads[vpp - 1].append(None if last else self.comm(recv_next=True)[1])
        for k in range(remaining, total):  # cooldown
            dx = backward_k(k)
            if first_virtual(chunk_of(k, False)):
                dx = None
            next_bc = chunk_of(k + 1, False)
            recv_next = not (last and next_bc == vpp - 1) and k != total - 1
            _, dy = self.comm(send_prev=dx, recv_next=recv_next)
            if recv_next:
                out_grads[next_bc].append(dy)


# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------
def _single_process_env() -> None:
    """Allow `python gpt3d.py` without torchrun: a world of one on a free local port."""
    if "RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def save_params(directory: str, rank: int, chunks: list[nn.Module]) -> None:
    """This rank's parameters, to compare runs: ``rank-<r>.json`` (name, dtype, shape, offset
    of each) and ``rank-<r>.bin`` (their raw bytes, back to back)."""
    os.makedirs(directory, exist_ok=True)
    index, off = [], 0
    with open(os.path.join(directory, f"rank-{rank}.bin"), "wb") as f:
        for c, chunk in enumerate(chunks):
            for name, p in chunk.named_parameters():
                raw = p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                f.write(raw)
                index.append(
                    {
                        "name": f"{c}.{name}",
                        "dtype": str(p.dtype).removeprefix("torch."),
                        "shape": list(p.shape),
                        "offset": off,
                        "nbytes": len(raw),
                    }
                )
                off += len(raw)
    with open(os.path.join(directory, f"rank-{rank}.json"), "w") as f:
        json.dump(index, f, indent=1)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if cfg.device == "auto":
        cfg.device = "cuda" if torch.cuda.is_available() else "cpu"
    if cfg.device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda but no GPU is available")
    if cfg.dtype == "auto":
        cfg.dtype = "bf16" if cfg.device == "cuda" else "fp32"
    err = layout_error(cfg, world)
    if err:
        fail(err)
    _single_process_env()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if cfg.device == "cuda":
        if local_rank >= torch.cuda.device_count():
            fail(f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} GPUs are visible", every_rank=True)
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        if cfg.memory_cap_mib:
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, cfg.memory_cap_mib * 2**20 / total), device)
    else:
        device = torch.device("cpu")
    dtype = torch.bfloat16 if cfg.dtype == "bf16" else torch.float32
    dist.init_process_group("nccl" if cfg.device == "cuda" else "gloo")
    torch.manual_seed(cfg.seed)

    par = build_parallel(cfg, world, rank)
    num_mb = cfg.global_batch // (cfg.micro_batch * par.dp)
    builder = Builder(cfg, par, device, dtype)
    chunks = [ModelChunk(builder, c * cfg.pp + par.pp_rank) for c in range(cfg.vpp)]
    syncs = [GradSync(cfg, par, chunk, device, dtype) for chunk in chunks]
    optimizer = MegatronOptimizer(cfg, syncs, dtype)
    pipeline = Pipeline(cfg, par, chunks, syncs, SyntheticData(cfg, par, num_mb, device), num_mb, device, dtype)

    reporter = rank == world - 1  # last rank, on the last pipeline stage
    cuda = device.type == "cuda"
    if reporter:
        print(
            f"gpt3d: world {world} | tp {par.tp} pp {par.pp} vpp {cfg.vpp} dp {par.dp} ep {par.ep}"
            f" | layers {cfg.layers} hidden {cfg.hidden} heads {cfg.heads}"
            f" ffn {cfg.ffn_hidden or 4 * cfg.hidden} vocab {cfg.vocab} seq {cfg.seq}"
            f" | experts {cfg.num_experts} topk {cfg.topk if cfg.num_experts else 0}"
            f" | micro-batch {cfg.micro_batch} global-batch {cfg.global_batch} micro-batches {num_mb}"
            f" | sp {int(cfg.sp)} recompute {int(cfg.recompute)} dist-opt {int(cfg.dist_opt)}"
            f" clip-grad {cfg.clip_grad:g}"
            f" | {device.type} {cfg.dtype}",
            flush=True,
        )
    log = []
    last_start = None  # the period: a whole turn of the loop, with what the iter time leaves out (the line printed)
    for it in range(1, cfg.iters + 1):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        period = "" if last_start is None else f" | period {(t0 - last_start) * 1e3:.2f} ms"
        last_start = t0
        losses = pipeline.run(it)
        if par.last_stage:  # inside the timed step, as Megatron averages losses over DP in its step
            loss = torch.stack(losses).mean().float()
            if par.dp > 1:
                dist.all_reduce(loss, group=par.dp_group)
                loss /= par.dp
        for s in syncs:
            s.finish()
        allreduce_sp_grads(syncs, par)
        grad_norm = clip_grad_norm(syncs, cfg.clip_grad) if cfg.clip_grad > 0 else None
        optimizer.step()
        for s in syncs:
            s.zero()
        t1 = time.perf_counter()
        if cuda:
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        ms = (t2 - t0) * 1e3
        if reporter:
            value = float(loss)
            mem = torch.cuda.max_memory_allocated() if cuda else None
            mem_s = f"{mem / 1e6:.2f} MB" if cuda else "n/a"
            print(
                f"iteration {it}/{cfg.iters} | loss {value:.6f} | iter time {ms:.2f} ms | max mem {mem_s}"
                f" | host wait {(t2 - t1) / (t2 - t0) * 100:.1f} %{period}",
                flush=True,
            )
            log.append(
                {"iteration": it, "loss": value, "iter_time_ms": ms, "max_mem_bytes": mem, "grad_norm": grad_norm}
            )
    if reporter and cfg.json_log:
        with open(cfg.json_log, "w") as f:
            json.dump(log, f, indent=1)
    if cfg.save_params:
        save_params(cfg.save_params, rank, chunks)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
