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
    ran = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ran[0].record(stream)
    torch.cuda._sleep(int(300e6 * rate))  # ~300 ms of device work ahead of the host
    ran[1].record(stream)
    cpu0, wall0 = time.thread_time(), time.perf_counter()
    wait_asleep(stream)
    cpu, wall = time.thread_time() - cpu0, time.perf_counter() - wall0
    # the device's own time of the work, not the 300 ms asked: the clock it runs at may not be the
    # one sleep_cycles_per_ns measured (an idle GPU raises its clock under load)
    device_s = ran[0].elapsed_time(ran[1]) / 1e3
    assert device_s > 0.05, f"the device ran its sleep in {device_s * 1e3:.1f} ms: too short to measure a wait"
    assert wall > 0.9 * device_s, f"returned after {wall * 1e3:.0f} ms, before the device's {device_s * 1e3:.0f} ms ran"
    # Stream.synchronize spends about the whole wait on the CPU (CUDA's spin)
    assert cpu < 0.2 * wall, f"the wait took {cpu * 1e3:.0f} ms of CPU over {wall * 1e3:.0f} ms"
