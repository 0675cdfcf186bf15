"""torchtitan configs for small CPU runs under prism (``--module prism_configs --config NAME``).

torchtitan's ``llama3_debugmodel`` as it is, except what a CPU process cannot do or what would
make the run large:
* inner attention ``ScaledDotProductAttention`` (causal, no per-document mask): the
  debugmodel's FlexAttention has no backward on CPU ("FlexAttention does not support backward
  on CPU"), varlen needs CUDA flash attention, and ``attn_backend="sdpa"`` is refused for
  language models by ``get_attention_config``, so the layers' configs are edited here (the
  trainer then passes no attention masks: its maskless SDPA path);
* ``training.disable_cuda_graphs`` (CUDA graphs cannot be mapped to a CPU);
* ``parallelism.spmd_backend = "partial_dtensor"`` (the default ``spmd_types`` needs a torch whose
  ``fully_shard`` turns spmd_types annotations into DTensors; torch 2.13.0's does not: "When
  dp_mesh_dims is provided, all parameters must be DTensors on the full SPMD mesh", and torch
  2.11.0's takes no ``dp_mesh_dims`` at all: ``torch_compat.py``);
* the local assets made by ``make_assets.py`` (tokenizer, c4_test-like data; its default
  directory, out/torchtitan/assets, or the one ``--hf-assets-path`` and
  ``--dataloader.dataset-path`` name), seq_len 128,
  local batch 2, 4 steps, fixed seed, no checkpoint, no validation; TensorBoard scalars for
  every rank (full-precision losses, read by ``losses.py``).
Every field can still be overridden on the command line (``--training.steps 2`` ...).

The module is found because the training script's folder is first on ``sys.path`` (torchrun and
``prism`` both run ``examples/torchtitan/train.py``).
"""

from __future__ import annotations

import os

from make_assets import DEFAULT_DIR
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.llama3.config_registry import llama3_debugmodel


def llama3_debugmodel_cpu():
    config = llama3_debugmodel()
    for layer in config.model_spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config.hf_assets_path = os.path.normpath(os.path.join(DEFAULT_DIR, "tokenizer"))
    config.dataloader.dataset_path = os.path.normpath(os.path.join(DEFAULT_DIR, "c4_test"))
    config.training.seq_len = 128
    config.training.local_batch_size = 2
    config.training.steps = 4
    config.training.disable_cuda_graphs = True
    config.lr_scheduler.warmup_steps = 1
    config.parallelism.spmd_backend = "partial_dtensor"
    config.checkpoint.enable = False
    config.validator.enable = False
    config.debug.seed = 42
    config.metrics.log_freq = 1
    # full-precision loss / grad_norm per rank in DUMP/tb (examples/torchtitan/losses.py)
    config.metrics.enable_tensorboard = True
    config.metrics.save_for_all_ranks = True
    return config
