"""The small communicator of a pruned group: its real members (small ranks 0 .. k-1, in logical
group-rank order) and the proxy (``Pruned``: in the virtual member's place when there is one, else last), made by both sides -- the sandbox rank's backend
(``prismllm.comm.sandbox``) and the assistant (``prismllm.assistant``) -- under one store prefix."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch

PRUNED_PREFIX = "prism/pruned/"  # + group name + "/": where both sides make the small group

_C = torch._C._distributed_c10d


def small_group(
    store: Any, group_name: str, small_rank: int, size: int, timeout: timedelta, backend: str = "gloo"
) -> Any:
    """The small group of a pruned group: real members then the proxy, made by both sides
    under ``prism/pruned/<group name>/``. ``backend``: "gloo" (blocks until every member
    joined) or "nccl" (the communicator is made at its first call; the caller's current CUDA
    device is its device)."""
    st = _C.PrefixStore(f"{PRUNED_PREFIX}{group_name}/", store)
    if backend == "nccl":
        opts = _C.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return _C.ProcessGroupNCCL(st, small_rank, size, opts)
    return _C.ProcessGroupGloo(st, small_rank, size, timeout=timeout)


__all__ = ["PRUNED_PREFIX", "small_group"]
