"""The known slowdown of `prism whatif --spin` and `gpt3d.py --spin` (prismllm.comm.spin): a
spin lasts the time asked for, on the CPU (a wait) and on a GPU (a global-timer kernel)."""

from __future__ import annotations

import time

import pytest
import torch

from prismllm.comm.spin import Spinner, parse_spins, wait_cpu


def test_parse_spins():
    assert parse_spins('{"mlp": 25, "attention": "1.5"}') == {"mlp": 25.0, "attention": 1.5}


def test_cpu_wait_lasts_the_time_asked():
    for ns in (0, 200_000, 20_000_000):
        wall = time.perf_counter_ns()
        wait_cpu(ns)
        wall = time.perf_counter_ns() - wall
        # never early; late only by one turn of the loop (a wide bound: a loaded machine may
        # give the core to another thread at the last yield)
        assert ns <= wall < ns + 50_000_000, f"asked {ns} ns, waited {wall} ns"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_spin_lasts_the_time_asked_on_the_device():
    """After the GPU has been kept busy (the clock a cycle count would depend on has changed),
    each spin, timed by CUDA events on a stream kept busy up to it (so that the events bracket
    the kernel alone, not the host's launch), lasts the time asked within 1 %."""
    torch.zeros(1, device="cuda")  # CUDA initialised: the spinner spins on the GPU
    spin = Spinner()
    spin(1.0)  # compiles the kernel (NVRTC, ~0.25 s on the host)
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):
        a = a @ a
        a /= a.norm()
    for ms in (0.5, 2.0, 10.0):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(2_000_000)  # ~1 ms of the stream ahead of the events and the spin
        start.record()
        spin(ms)
        end.record()
        end.synchronize()
        got = start.elapsed_time(end)
        assert ms <= got * 1.001 and got < ms * 1.01, f"asked {ms} ms, the kernel ran {got:.4f} ms"
