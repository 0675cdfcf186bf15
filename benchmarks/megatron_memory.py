"""Megatron-LM's theoretical memory of a GPT rank, as its ``theoretical_memory_usage.py`` computes
it (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models"): what a
solo capture's measured per-rank peak memory is set beside.

Weights and optimizer of the most loaded shard (the first pipeline stage, with the embedding):

    P_layers = 2 L h^2 ((1 + g/a) q/h + (F/h) E + 2/h + 1/(L h))   (q = a * head dim, g = a here)
    P_shard  = (P_layers / pp + h V) / tp          (MoE: expert weights spread over ep as well)
    bytes    = P_shard * (w + 4 + O)               w: weight bytes, 4: fp32 main grad,
                                                   O: optimizer (fp32 master if w < 4, Adam m and v),
                                                   divided by dp with the distributed optimizer

Megatron-LM's own figure is 18 bytes a parameter (bf16 weights, fp32 grads, master, m, v);
examples/megatron_gpt.py trains in fp32 (w = 4, no master copy): 16. Activations of one micro-batch
in one layer: s b h (34 + 5 a s / h) bytes for 16-bit activations (no flash attention, no sequence
parallelism, divided by tp for the TP-sharded part as in the paper's eq. 2 leading term).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Model:
    layers: int
    hidden: int
    heads: int
    vocab: int
    ffn: int
    seq: int
    micro_batch: int
    tp: int = 1
    pp: int = 1
    ep: int = 1
    dp: int = 1
    experts: int = 0  # 0: dense
    bytes_weight: int = 2
    dist_opt: bool = False
    untied: bool = True  # megatron_gpt.py: share_embeddings_and_output_weights=False


def parameters_in_layers(m: Model) -> float:
    e = max(m.experts, 1)
    h = m.hidden
    return 2 * m.layers * h * h * (2 + (m.ffn / h) * e + 2 / h + 1 / (m.layers * h))


def parameters_most_loaded_shard(m: Model) -> float:
    layers = parameters_in_layers(m)
    if m.experts:  # expert MLPs are spread over ep, the rest replicated over it
        mlp = 2 * m.layers * m.hidden * m.ffn * m.experts
        layers = layers - mlp + mlp / m.ep
    emb = m.hidden * m.vocab
    shard = (layers / m.pp + emb) / m.tp
    if m.untied and m.pp == 1:
        shard += emb / m.tp
    return shard


def bytes_per_parameter(m: Model) -> float:
    master = 4 if m.bytes_weight < 4 else 0
    optimizer = master + 8
    return m.bytes_weight + 4 + (optimizer / m.dp if m.dist_opt else optimizer)


def weights_and_optimizer_bytes(m: Model) -> int:
    return int(parameters_most_loaded_shard(m) * bytes_per_parameter(m))


def activation_bytes_per_layer(m: Model, bytes_activation: int = 2) -> int:
    """One micro-batch, one layer; the paper's 16-bit count scaled to ``bytes_activation``."""
    s, b, h, a = m.seq, m.micro_batch, m.hidden, m.heads
    return int(s * b * h * (34 + 5 * a * s / h) / m.tp * bytes_activation / 2)


__all__ = [
    "Model",
    "activation_bytes_per_layer",
    "bytes_per_parameter",
    "parameters_in_layers",
    "parameters_most_loaded_shard",
    "weights_and_optimizer_bytes",
]
