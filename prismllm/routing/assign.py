"""Token-to-expert assignments that realise given tokens per expert, as router logits.

Why logits: the mock router does not replace the program's routing code, it overwrites the
logits the gate produced, so everything after the gate (score function, top-k, capacity,
permutation, the all-to-all split sizes, aux losses) runs as written. The logits must make
every router implementation pick exactly the assigned experts:

- gpt3d (``examples/gpt3d.py``): top-k of the logits, softmax over the k chosen;
- Megatron-core ``TopKRouter`` (``topk_routing_with_score_function``): top-k of the logits then
  softmax (default), softmax then top-k (``moe_router_pre_softmax``), or sigmoid /
  sqrt-softplus then top-k, where an aux-loss-free ``expert_bias`` is added before top-k.

Assigned experts get ``HIGH`` and the others ``LOW``. Top-k of the logits, of their softmax and
of their sigmoid is then exactly the assigned set; the k chosen are tied, so the combine weights
are uniform (1/k). Sigmoid scores of assigned and other experts differ by
``sigmoid(10) - sigmoid(-10)`` ~ 0.9999, so an expert bias spread below that keeps the routing
(Megatron updates it by ``moe_router_bias_update_rate``, 1e-3 per step by default). Both values
are exact in bf16 and fp16. Not covered: group-limited routing (``moe_router_num_groups``), which
may drop assigned experts of a token outside its chosen groups; and options that replace the
logits after the gate (``moe_router_force_load_balancing``, router replay). Capacity-based token
dropping acts on the forced routing as it would on a real one: the counts are pre-drop.

Layout: expert slots are laid out in expert order (expert 0's ``c_0`` slots, then expert 1's,
...) and slot ``i`` goes to token ``i mod T``. There are ``T * k`` slots, so each token gets
exactly ``k``; an expert's slots are consecutive and at most ``T`` (``counts_for`` caps them), so
they fall on distinct tokens, and every token's ``k`` experts are distinct.
"""

from __future__ import annotations

import numpy as np

from prismllm.routing.stats import RoutingError

HIGH = 10.0  # the logit of an assigned expert
LOW = -10.0  # the logit of every other expert


def topk_indices(counts: np.ndarray, tokens: int) -> np.ndarray:
    """``[tokens, k]`` int64 expert indices, ``k = sum(counts) / tokens``: token ``t`` takes
    slots ``t, t + T, ...`` of the expert-ordered slot layout (module docstring)."""
    c = np.asarray(counts, dtype=np.int64)
    total = int(c.sum())
    if tokens <= 0 or total % tokens or c.min(initial=0) < 0 or c.max(initial=0) > tokens:
        raise RoutingError(
            f"tokens per expert {c.tolist()} cannot be dealt to {tokens} tokens (need a multiple of "
            "the tokens in total and at most every token per expert)"
        )
    k = total // tokens
    slots = np.repeat(np.arange(c.size, dtype=np.int64), c)  # slot -> expert
    return np.ascontiguousarray(slots.reshape(k, tokens).T)


def logits_for(counts: np.ndarray, tokens: int, dtype: np.dtype | type = np.float32) -> np.ndarray:
    """``[tokens, experts]`` logits whose top-k per token are the assigned experts."""
    c = np.asarray(counts, dtype=np.int64)
    idx = topk_indices(c, tokens)
    out = np.full((tokens, c.size), LOW, dtype=dtype)
    np.put_along_axis(out, idx, HIGH, axis=1)
    return out
