#!/usr/bin/env python3
"""megatron_gpt: a GPT trained with Megatron-core's public API, launched unmodified by torchrun.

    torchrun --nproc-per-node 2 examples/megatron_gpt.py --tp 2
    torchrun --nproc-per-node 4 examples/megatron_gpt.py --tp 2 --pp 2 --dist-opt
    torchrun --nproc-per-node 2 examples/megatron_gpt.py --ep 2 --num-experts 4
    prism record --nproc 4 --devices cpu --cuda-on-cpu --out out/mg -- examples/megatron_gpt.py --tp 2 --pp 2

What it uses, all from ``megatron.core`` (tested with megatron-core 0.16.1):

* ``parallel_state.initialize_model_parallel`` (TP, PP, virtual PP, EP; order tp-cp-ep-dp-pp);
* ``GPTModel`` with the local layer spec (``get_gpt_layer_local_spec``: no Transformer Engine,
  no Apex), weights initialised on the CPU (``use_cpu_initialization``: every layout starts
  from the same full tensors) and moved to the GPU;
* MoE layers (``--num-experts``) with the ``alltoall`` token dispatcher, experts spread over
  ``--ep`` ranks (EP carved out of DP), expert tensor parallelism 1; not with ``--tp > 1``
  (Megatron then requires sequence parallelism, which the local spec's norms do not support);
* ``get_forward_backward_func``: no pipelining, 1F1B (``--pp > 1``) or interleaved
  (``--vpp > 1``);
* Megatron's ``DistributedDataParallel`` and optimizer (``get_megatron_optimizer``: Adam, grad
  clipping 1.0; ``--dist-opt``: the distributed optimizer), ``finalize_model_grads``;
* synthetic data: every sample of the global batch is drawn from a generator seeded by
  (seed, iteration, sample index), so every layout sees the same batch and nothing is
  downloaded.

The last rank prints one line per iteration, as Megatron-LM's training log does, with the loss
(averaged over the global batch) and the gradient norm at full float32 precision so that runs
can be compared digit for digit.

Device: the program is written for CUDA and NCCL, as Megatron-core is (its RNG tracker, schedules
and optimizer name CUDA throughout). On a machine without a GPU run it under prism with
``--cuda-on-cpu`` (``prismllm.devicemap``), which maps those calls to the CPU and NCCL to gloo
(docs/stacks/megatron.md).
"""

from __future__ import annotations

import argparse
import os
import time
import warnings
from datetime import datetime

warnings.filterwarnings("ignore", message=r".*(Apex is not installed|Apex are not installed).*")
warnings.filterwarnings("ignore", message=r".*(CUDA_DEVICE_MAX_CONNECTIONS|full scope is deprecated).*")
warnings.filterwarnings("ignore", category=FutureWarning)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state as mpu  # noqa: E402
from megatron.core.distributed import (  # noqa: E402
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: E402
from megatron.core.transformer.moe import moe_utils  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

# megatron-core 0.16.x without Transformer Engine: the MoE router's gating function tests
# ``te_general_gemm is not None`` but moe_utils defines that name only when TE imports, so every
# MoE forward raises NameError (on a GPU as on the CPU). Define it as "absent".
if not hasattr(moe_utils, "te_general_gemm"):
    moe_utils.te_general_gemm = None


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    p.add_argument("--vpp", type=int, default=1, help="model chunks per stage (interleaved when > 1)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (carved out of DP)")
    p.add_argument("--num-experts", type=int, default=0, help="experts per MoE layer; 0 = dense")
    p.add_argument("--topk", type=int, default=2, help="experts per token")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--dist-opt", action="store_true", help="Megatron's distributed optimizer")
    return p.parse_args(argv)


def initialize(args):
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend="nccl")
    world = dist.get_world_size()
    model_parallel = args.tp * args.pp
    if world % model_parallel:
        raise SystemExit(f"world size {world} is not a multiple of tp*pp = {model_parallel}")
    dp = world // model_parallel
    if dp % args.ep:
        raise SystemExit(f"--ep {args.ep} must divide the data-parallel size {dp}")
    if args.num_experts and args.tp > 1:
        # Megatron-core refuses MoE with TP but without sequence parallelism, and the local
        # spec's torch norms refuse sequence parallelism (it needs Transformer Engine or Apex).
        raise SystemExit("--num-experts with --tp > 1 needs sequence parallelism: Transformer Engine or Apex")
    if args.num_experts and args.num_experts % args.ep:
        raise SystemExit(f"--num-experts {args.num_experts} must be a multiple of --ep {args.ep}")
    if args.global_batch % (args.micro_batch * dp):
        raise SystemExit(f"--global-batch must be a multiple of micro-batch * dp = {args.micro_batch * dp}")
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=args.tp,
        pipeline_model_parallel_size=args.pp,
        virtual_pipeline_model_parallel_size=args.vpp if args.vpp > 1 else None,
        expert_model_parallel_size=args.ep,
        expert_tensor_parallel_size=1,  # experts whole on each rank (MoE biases need it)
    )
    torch.manual_seed(args.seed)
    model_parallel_cuda_manual_seed(args.seed)
    return dp


def build_config(args) -> TransformerConfig:
    moe = {}
    if args.num_experts:
        moe = dict(
            num_moe_experts=args.num_experts,
            moe_router_topk=args.topk,
            moe_token_dispatcher_type="alltoall",
            moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=1e-2,
            moe_grouped_gemm=False,
            moe_ffn_hidden_size=4 * args.hidden,
        )
    return TransformerConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        ffn_hidden_size=4 * args.hidden,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=args.tp,
        pipeline_model_parallel_size=args.pp,
        virtual_pipeline_model_parallel_size=args.vpp if args.vpp > 1 else None,
        expert_model_parallel_size=args.ep,
        expert_tensor_parallel_size=1,
        sequence_parallel=False,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
        init_method_std=0.02,
        # As Megatron-LM sets them: the interleaved schedule overlaps its P2P (isend/irecv,
        # the two directions on two groups when PP = 2); batched P2P otherwise. Batched P2P
        # in the interleaved schedule puts a send to and a receive from the previous and the
        # next stage in one batch_isend_irecv; with PP = 2 both are one peer, and the two
        # same-shaped transfers pair in posting order, the wrong way round (silently wrong
        # gradients, on NCCL as on gloo).
        overlap_p2p_comm=args.vpp > 1,
        batch_p2p_comm=args.vpp == 1,
        **moe,
    )


def build_model(args, config):
    spec = get_gpt_layer_local_spec(num_experts=args.num_experts or None, moe_grouped_gemm=False)
    chunks = []
    for vp in range(args.vpp):
        vp_stage = vp if args.vpp > 1 else None
        m = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=args.vocab,
            max_sequence_length=args.seq_len,
            pre_process=mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            share_embeddings_and_output_weights=False,
            position_embedding_type="learned_absolute",
            vp_stage=vp_stage,
        )
        m.cuda(torch.cuda.current_device())
        chunks.append(m)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=args.dist_opt,
    )
    return [
        DistributedDataParallel(config=config, ddp_config=ddp_config, module=m, disable_bucketing=i > 0)
        for i, m in enumerate(chunks)
    ]


class SyntheticData:
    """Micro-batches of this DP rank: sample ``g`` of iteration ``it`` is an arithmetic token
    sequence (start, stride drawn from a generator seeded by (seed, it, g)), learnable."""

    def __init__(self, args, dp: int, dp_rank: int):
        self.args, self.dp, self.dp_rank = args, dp, dp_rank
        self.mask = torch.triu(torch.ones(args.seq_len, args.seq_len, dtype=torch.bool), 1)

    def micro_batches(self, it: int):
        a = self.args
        per_rank = a.global_batch // self.dp
        first = self.dp_rank * per_rank
        for mb in range(per_rank // a.micro_batch):
            rows = []
            for i in range(a.micro_batch):
                g = torch.Generator().manual_seed(a.seed * 1_000_003 + it * 10_007 + first + mb * a.micro_batch + i)
                start, stride = torch.randint(0, a.vocab, (2,), generator=g).tolist()
                rows.append((start + (stride | 1) * torch.arange(a.seq_len + 1)) % a.vocab)
            seq = torch.stack(rows)
            yield {
                "tokens": seq[:, :-1].contiguous().cuda(),
                "labels": seq[:, 1:].contiguous().cuda(),
                "position_ids": torch.arange(a.seq_len).unsqueeze(0).expand(a.micro_batch, -1).contiguous().cuda(),
                "attention_mask": self.mask.view(1, 1, a.seq_len, a.seq_len).cuda(),
            }


def loss_func(output_tensor):
    losses = output_tensor.float().view(-1)
    loss = losses.sum()
    num_tokens = torch.tensor(losses.numel(), dtype=torch.int, device=losses.device)
    report = torch.cat([loss.detach().view(1), num_tokens.float().view(1)])
    return loss, num_tokens, {"lm loss": report}


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    out = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
    return out, loss_func


def main(argv=None):
    args = parse_args(argv)
    dp = initialize(args)
    config = build_config(args)
    model = build_model(args, config)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=args.lr, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.95,
            clip_grad=1.0, use_distributed_optimizer=args.dist_opt, params_dtype=torch.float32,
        ),
        model,
    )  # fmt: skip
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    forward_backward = get_forward_backward_func()
    data = SyntheticData(args, dp, mpu.get_data_parallel_rank())
    num_micro = args.global_batch // (args.micro_batch * dp)
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == world - 1:
        print(f"megatron_gpt: world {world} tp {args.tp} pp {args.pp} vpp {args.vpp} dp {dp} ep {args.ep} "
              f"experts {args.num_experts} dist-opt {args.dist_opt}; {num_micro} micro-batches of "
              f"{args.micro_batch} per iteration", flush=True)  # fmt: skip

    for it in range(1, args.iters + 1):
        t0 = time.time()
        for m in model:
            m.zero_grad_buffer()
        optimizer.zero_grad()
        iters = [data.micro_batches(it) for _ in model]
        losses = forward_backward(
            forward_step_func=forward_step,
            data_iterator=iters if len(model) > 1 else iters[0],
            model=model if len(model) > 1 else model[0],
            num_microbatches=num_micro,
            seq_length=args.seq_len,
            micro_batch_size=args.micro_batch,
            decoder_seq_length=args.seq_len,
            forward_only=False,
        )
        ok, grad_norm, _ = optimizer.step()
        report = None
        if mpu.is_pipeline_last_stage(ignore_virtual=True):
            total = torch.stack([x["lm loss"] for x in losses]).sum(0)
            dist.all_reduce(total, group=mpu.get_data_parallel_group(with_context_parallel=True))
            report = (total[0] / total[1]).item()
        t1 = time.time()
        torch.cuda.synchronize()
        t2 = time.time()
        elapsed = (t2 - t0) * 1000.0
        if rank == world - 1:
            gn = float("nan") if grad_norm is None else float(grad_norm)
            peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else -1
            print(f" [{datetime.now().strftime('%Y-%m-%d %H:%M:%S')}] iteration {it:8d}/{args.iters:8d} | "
                  f"elapsed time per iteration (ms): {elapsed:.1f} | lm loss: {report:.9E} | "
                  f"grad norm: {gn:.9E} | skipped: {int(not ok)} | max allocated (B): {peak} | "
                  f"host wait (%): {(t2 - t1) / (t2 - t0) * 100:.1f} |",
                  flush=True)  # fmt: skip
    mpu.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
