"""The pruned calls' scratch arena (prismllm/comm/scratch.py): its bookkeeping, on CPU tensors
standing in for driver segments. The GPU side (memory outside PyTorch's allocator statistics,
stream ordering) is tests/test_emulate_gpu.py::test_device_arena_is_outside_the_allocator."""

from __future__ import annotations

import torch

from prismllm.comm.scratch import SEGMENT_ALIGN, DeviceArena, arena

MiB = 1 << 20


def _arena() -> DeviceArena:
    return DeviceArena(torch.device("cpu"), segment=lambda n: torch.empty(n, dtype=torch.uint8))


def test_segments_are_reused_smallest_fit_first_and_counted_once():
    a = _arena()
    big = a.take(8 * MiB // 4, torch.float32)
    small = a.take(MiB // 4, torch.float32)  # rounded up to one 2 MiB segment
    assert a.reserved_bytes == 8 * MiB + SEGMENT_ALIGN
    assert big.numel() == 2 * MiB and small.numel() == MiB // 4 and small.dtype == torch.float32
    big_ptr, small_ptr = big.data_ptr(), small.data_ptr()
    a.give_back([big])
    a.give_back([small])  # free: [8 MiB, 2 MiB]
    mid = a.take(3 * MiB // 4, torch.bfloat16)  # 1.5 MiB: the 2 MiB segment, second in the free list
    assert mid.data_ptr() == small_ptr and mid.dtype == torch.bfloat16
    again = a.take(MiB, torch.float32)  # 4 MiB: the 8 MiB one
    assert again.data_ptr() == big_ptr
    extra = a.take(1, torch.float64)  # both busy: a new segment
    assert extra.data_ptr() not in (big_ptr, small_ptr)
    assert a.reserved_bytes == 8 * MiB + 2 * SEGMENT_ALIGN


def test_zeros_on_request_on_a_used_segment():
    a = _arena()
    x = a.take(1000, torch.float32)
    x.fill_(5.0)
    a.give_back([x])
    y = a.take(1000, torch.float32, zero=True)
    assert y.data_ptr() == x.data_ptr() and int(torch.count_nonzero(y)) == 0


def test_empty_buffers_and_foreign_ones():
    a = _arena()
    e = a.take(0, torch.float32)
    assert e.numel() == 0 and a.reserved_bytes == 0
    a.give_back([e, torch.ones(3)])  # neither came from a segment: nothing happens
    assert a.take(1, torch.float32) is not None and a.reserved_bytes == SEGMENT_ALIGN


def test_no_arena_for_cpu_devices():
    assert arena(torch.device("cpu")) is None  # CPU buffers come from PyTorch (no device memory)


def test_unread_buffers_are_shared_and_never_handed_out_by_take():
    """Padding no call reads back: one segment for every such buffer (calls in flight share it),
    a view per size, grown by powers of two; ``take`` never hands that segment out."""
    a = _arena()
    p1 = a.unread(1000, torch.float32)
    assert a.unread(1000, torch.float32) is p1 and a.reserved_bytes == SEGMENT_ALIGN
    p2 = a.unread(500, torch.bfloat16)  # fits: the same segment
    assert p2.data_ptr() == p1.data_ptr() and a.reserved_bytes == SEGMENT_ALIGN
    big = a.unread(9 * MiB // 16, torch.float32)  # 2.25 MiB: a 4 MiB segment
    assert a.reserved_bytes == SEGMENT_ALIGN + 4 * MiB and big.numel() == 9 * MiB // 16
    t = a.take(10, torch.float32)
    assert t.data_ptr() not in (p1.data_ptr(), big.data_ptr())
