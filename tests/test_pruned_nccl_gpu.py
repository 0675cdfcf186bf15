"""A pruned all_reduce on NCCL as the sandbox and the proxy issue it (two GPUs, one process
each): padded to the logical group's bytes in one NCCL group (``allreduce_coalesced``), a
pre-multiplied sum with each side's factor, the padding in the arena's shared unread buffer.
The program's tensor must come back as the logical result the sandbox is shown (generated
virtual inputs: the real member's sum scaled to the group), however many calls are in flight,
the sandbox's asynchronous, the proxy's synchronous (on its current stream)."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from prismllm import pruning as C
from prismllm.comm import scratch
from prismllm.pruning.generated import GeneratedBuffers, generated_proxy_call
from prismllm.pruning.groups import small_group

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"),
]

N, SHAPE, CALLS = 4, (1000, 37), 6
_TORCH = tuple(
    int(x) for x in torch.__version__.split(".")[:2]
)  # 37,000 floats a call: padded to the 4-member ring's bytes


def _sandbox(pg, p: C.Plan, dev: torch.device) -> tuple:
    """CALLS calls in flight, then their results: (each tensor's mean, the arena's bytes)."""
    ts = [torch.full(SHAPE, float(k + 1), device=dev, dtype=p.dtype) for k in range(CALLS)]
    sc = [C.sandbox_call(p, 0, tensor=t, scratch=scratch.arena, like_me=True, coalesce=True, premul=True) for t in ts]
    works = [C.issue(pg, c) for c in sc]
    assert all(len(w) == 1 for w in works), "one Work a padded call (one NCCL group)"
    for c, w in zip(sc, works):
        w[0].wait()
        c.finish()
    torch.cuda.synchronize()
    return [float(t.mean()) for t in ts], scratch.arena(dev).reserved_bytes


def _proxy(pg, p: C.Plan, dev: torch.device) -> tuple:
    """Generated inputs, contributed with factor 0, each call synchronous on the current stream as
    the assistant issues it on a GPU (no Work from torch 2.8 on: the stream orders the calls)."""
    bufs = GeneratedBuffers(dev)
    for _ in range(CALLS):
        call = generated_proxy_call(p, bufs, coalesce=True, premul=True)
        works = C.issue(pg, call, sync=True)
        if _TORCH >= (2, 8):
            assert works == [], f"a synchronous NCCL call answered with {works}"
        for w in works:
            w.wait()
        call.finish()
    torch.cuda.synchronize()
    return None, 0


def _member(small_rank: int, port: int, q, dtype: torch.dtype) -> None:
    os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    dev = torch.device("cuda", small_rank)
    torch.cuda.set_device(dev)
    store = dist.TCPStore("127.0.0.1", port, 2, small_rank == 0, timeout=timedelta(seconds=60))
    pg = small_group(store, "g", small_rank, 2, timedelta(seconds=60), backend="nccl")
    p = C.plan_all_reduce(N, (0,), SHAPE, "sum", dtype=dtype)
    try:
        q.put((small_rank, *(_sandbox if small_rank == 0 else _proxy)(pg, p, dev)))
    except BaseException as e:  # noqa: BLE001 - reported by the test, not by a queue that stays empty
        q.put((small_rank, f"error: {e!r}", 0))
        raise
    finally:
        pg.shutdown()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_padded_premultiplied_all_reduce_on_nccl(dtype):
    """bf16: ProcessGroupNCCL of torch 2.11 reads a bf16 factor's low half (pruning.calls.nccl_premul_scalar):
    the sandbox's tensors came back all zeros."""
    assert C.plan_all_reduce(N, (0,), SHAPE, "sum", dtype=dtype).pad > 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_member, args=(r, port, q, dtype)) for r in range(2)]
    for pr in procs:
        pr.start()
    got = {who: (vals, reserved) for who, vals, reserved in (q.get(timeout=120) for _ in procs)}
    for pr in procs:
        pr.join(60)
    assert not [v for v, _ in got.values() if isinstance(v, str)], got
    assert all(pr.exitcode == 0 for pr in procs)
    vals, reserved = got[0]
    # like_me: the group as if each of the N members held the sandbox's tensor
    assert vals == [float(N * (k + 1)) for k in range(CALLS)]
    # every call's padding shares one unread segment (no buffer a call)
    assert reserved <= 2 << 20
