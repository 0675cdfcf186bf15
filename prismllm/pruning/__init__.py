"""Pruned collectives: what the sandbox and the proxy issue so that real
members of a partly virtual group get the logical group's result.

A collective on a logical group of ``n`` members, of which only ``k`` (1 <= k < n) are real
(run the program on a sandbox device), runs for real on a *small communicator*: the real
members, in logical group-rank order, as small ranks ``0 .. k-1``, plus one *proxy*
process (an assistant) as small rank ``k``. The proxy knows what every virtual member would
contribute (recorded tensors) and sends data so that every real member's output equals what
the full logical group would produce. Real members keep calling the same
``torch.distributed`` API; the sandbox backend rewrites the call it issues on the small
communicator (reduce op, layout, padding, local pre/post steps). NCCL and gloo are used as
they are: the pruning is in the data, not in the library (the paper patches NCCL's
ring and tree; we do not).

Three layers, each usable alone (docs/internals/pruning.md has the long form and the byte tables),
plus the small communicator both sides make (``groups.py``):

1. ``plans.py``: ``plan_<op>(...)`` / :func:`plan` -- pure: from the logical group (``n``, the real
   members' logical group ranks), the op and its arguments, a :class:`Plan`: the op, reduce
   op, root, layout (slot size, padding, splits, point-to-point messages) on the small
   communicator, one-line descriptions of the sandbox's pre/post steps and of the proxy's
   contribution, the bytes each real member moves on the small communicator against a rank
   of the logical group's ring algorithm (:class:`LinkBytes`), and sandbox scratch memory.
2. ``calls.py``: :func:`sandbox_call` / :func:`proxy_call` -- pure tensor work, no communication: build
   the buffers of the small-communicator call (:class:`SmallCall`) from the program's
   tensors (sandbox) or from the virtual members' inputs indexed by logical group rank
   (proxy); ``SmallCall.finish()`` does the sandbox's post step (copy back, reorder,
   divide for AVG).
3. ``executor.py``: :func:`issue` / :func:`run` -- a reference executor on any ``ProcessGroup`` object
   (``pg.allreduce``, ``pg._reduce_scatter_base``, ...): what the tests use with gloo.

Byte accounting: ``LinkBytes.send/recv`` is what a real member moves on its link when the
small communicator runs the ring (or chain, or point-to-point) algorithm -- what the sandbox
*measures*; ``logical_send/logical_recv`` is what a rank at the same logical position moves
in the logical group's ring algorithm -- what the model says the target would see. With
``match_bytes=True`` (the default) all-reduce and reduce-scatter pad the small call so that
the two agree (to an element); see each plan for the rest.
"""

from prismllm.pruning.calls import SmallCall, nccl_premul_scalar, premul_factors, proxy_call, sandbox_call
from prismllm.pruning.executor import issue, issue_batch, lane_template, reference, run
from prismllm.pruning.generated import GeneratedBuffers, generated_proxy_call, identity
from prismllm.pruning.groups import PRUNED_PREFIX, small_group
from prismllm.pruning.plans import (
    REDUCE_OPS,
    LinkBytes,
    Message,
    P2POp,
    Plan,
    Pruned,
    PruningError,
    describe,
    plan,
    plan_all_gather,
    plan_all_reduce,
    plan_all_to_all,
    plan_barrier,
    plan_broadcast,
    plan_gather,
    plan_once,
    plan_p2p,
    plan_recv,
    plan_reduce,
    plan_reduce_scatter,
    plan_scatter,
    plan_send,
    splits_matrix,
)

__all__ = [
    "PruningError",
    "GeneratedBuffers",
    "LinkBytes",
    "Message",
    "P2POp",
    "PRUNED_PREFIX",
    "Plan",
    "Pruned",
    "REDUCE_OPS",
    "SmallCall",
    "describe",
    "generated_proxy_call",
    "identity",
    "issue",
    "issue_batch",
    "lane_template",
    "nccl_premul_scalar",
    "plan",
    "plan_all_gather",
    "plan_all_reduce",
    "plan_all_to_all",
    "plan_barrier",
    "plan_broadcast",
    "plan_gather",
    "plan_once",
    "plan_p2p",
    "plan_recv",
    "plan_reduce",
    "plan_reduce_scatter",
    "plan_scatter",
    "plan_send",
    "premul_factors",
    "proxy_call",
    "reference",
    "run",
    "sandbox_call",
    "small_group",
    "splits_matrix",
]
