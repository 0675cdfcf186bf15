"""The assistant's host threads on a GPU: the completer waits for each call's end asleep, not
spinning a host core (``prismllm.assistant.proxy.wait_asleep``). Run on the device machine:
``pytest -m gpu tests/test_assistant_gpu.py``."""

from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_the_completers_wait_leaves_its_core_idle():
    from prismllm.assistant.proxy import wait_asleep
    from prismllm.comm.headstart import sleep_cycles_per_ns

    dev = torch.cuda.current_device()
    rate = sleep_cycles_per_ns(dev)
    stream = torch.cuda.current_stream(dev)
    torch.cuda._sleep(int(300e6 * rate))  # 300 ms of device work ahead of the host
    cpu0, wall0 = time.thread_time(), time.perf_counter()
    wait_asleep(stream)
    cpu, wall = time.thread_time() - cpu0, time.perf_counter() - wall0
    assert wall > 0.2, f"returned after {wall * 1e3:.0f} ms, before the device's 300 ms of work ran"
    # Stream.synchronize spends about the whole wait on the CPU (CUDA's spin)
    assert cpu < 0.2 * wall, f"the wait took {cpu * 1e3:.0f} ms of CPU over {wall * 1e3:.0f} ms"
