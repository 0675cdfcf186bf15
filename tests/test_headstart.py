"""The host's head start of GPU slices (prismllm.comm.headstart) on the CPU: the sleeps' arithmetic
on a device timeline, and the waits that trigger a head start (the GPU run: test_headstart_gpu.py)."""

from __future__ import annotations

import types

import torch

from prismllm.comm import headstart
from prismllm.comm.headstart import DeviceHoles


def test_sleeps_are_left_out_of_every_later_device_time():
    holes = DeviceHoles()
    holes.add(100, 150)
    holes.add(400, 500)
    assert [holes.left_out(t) for t in (0, 100, 120, 150, 300, 400, 450, 500, 10_000)] == [
        0,
        0,
        20,
        50,
        50,
        50,
        100,
        150,
        150,
    ]


def test_a_sleep_overlapping_the_previous_one_counts_only_past_it():
    holes = DeviceHoles()
    holes.add(100, 200)
    holes.add(150, 260)  # a second stream's sleep, partly at the same time
    assert holes.left_out(1_000) == 160
    assert holes.left_out(230) == 130


def test_a_head_start_follows_each_wait_of_the_host_for_the_device_and_nothing_else():
    cuda = types.SimpleNamespace(is_cuda=True)
    cpu = types.SimpleNamespace(is_cuda=False)
    waits = {name: w for _, name, w in headstart.SYNC_POINTS}
    assert waits["item"](1.0, cuda) and not waits["item"](1.0, cpu)
    assert waits["to"](cpu, cuda) and not waits["to"](cuda, cuda)
    assert not waits["to"](cpu, cuda, non_blocking=True)
    assert waits["copy_"](cuda, cuda, cpu) and not waits["copy_"](cuda, cuda, cpu, True)
    assert not waits["copy_"](cuda, cuda, cuda)


def test_the_waits_are_wrapped_transparently_and_restored_exactly():
    calls = []
    before = {(o, n): o.__dict__.get(n) for o, n, _ in headstart.SYNC_POINTS}
    undo = headstart.install(lambda: calls.append(1))
    try:
        t = torch.tensor([2.5])
        assert t.item() == 2.5 and float(t) == 2.5 and t.tolist() == [2.5] and bool(t)
        assert torch.equal(t.to(torch.float64), torch.tensor([2.5], dtype=torch.float64))
        assert torch.Tensor.item.__name__ == "item"
        assert calls == []  # CPU tensors: the host waited for nothing
    finally:
        undo()
    assert {(o, n): o.__dict__.get(n) for o, n, _ in headstart.SYNC_POINTS} == before


def test_a_head_start_is_the_layers_time_until_the_next_wait_as_the_last_iteration_spent_it():
    """`overhead`: after the k-th wait of an iteration the device sleeps the emulation layer's host
    time from the k-th wait to the next one in the last iteration (the last wait: to the next
    iteration's first), not the whole iteration's at every wait; where the waits do not repeat,
    the last iteration's whole layer time."""
    from prismllm.comm.recorder import Recorder

    rec = Recorder(0, 2)
    rec.started = True
    rec.layer_ns_at_waits = [10, 10]  # an iteration: two waits, 10 ns of layer time before them
    rec.emulation_host_ns = 90  # 80 more after them, to the boundary
    rec.comm_points = 1
    rec.boundary(explicit=False)
    rec.comm_points = 0
    rec.boundary(explicit=False)  # a step with no call since: the same iteration goes on
    assert rec.layer_ns_at_waits_last == [10, 10] and rec.layer_ns_at_waits == []
    rec.layer_ns_at_boundary = [0, 90]
    rec.layer_ns_at_waits = [95]  # the next iteration's first wait: 5 ns after the boundary
    assert rec._layer_ns_to_next_wait() == 0  # from the first wait to the second: nothing
    rec.layer_ns_at_waits = [95, 95]
    assert rec._layer_ns_to_next_wait() == 85  # from the last wait to the next iteration's first
    rec.layer_ns_at_waits = [95, 95, 180]  # a third wait the last iteration did not have
    assert rec._layer_ns_to_next_wait() == 90
    rec.layer_ns_at_boundary = [0, 90, 90 + 2 * headstart.MAX_NS]
    assert rec._layer_ns_to_next_wait() == headstart.MAX_NS  # bounded
