"""The clock a GPU rank ran at (prismllm.comm.gpuclock): sampled only once the program has set
CUDA up, summarised over its busy samples, carried from a slice's and an emulation's rank logs
to the timed graph's manifest and emulate.json, and named beside the emulated iteration when it
differs from the slice's. NVML itself is read on GPU machines only; here a reader stands in."""

from __future__ import annotations

import threading
import time

from prismllm.comm.gpuclock import GpuClock
from prismllm.emulate.run import clock_note
from prismllm.trace.ranklog import RankLog


def _wait_for(cond, seconds: float = 5.0) -> None:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < seconds, "timed out"
        time.sleep(0.005)


def test_the_clock_waits_for_cuda_then_summarises_the_busy_samples():
    up = threading.Event()
    made = []
    readings = iter([(99, 1980, 600.0, 40.0), (10, 1980, 120.0, 41.0), (97, 1700, 690.0, 55.0)] * 1000)

    def reader():
        made.append(True)
        return lambda: next(readings)

    clock = GpuClock(reader, interval_s=0.001, ready=up.is_set)
    time.sleep(0.05)
    assert not made and not clock.samples  # the program has not set CUDA up: nothing made, nothing read
    up.set()
    _wait_for(lambda: len(clock.samples) >= 30)
    s = clock.summary()
    busy = [x for x in clock.samples if x[0] >= 50]
    assert s["busy_samples"] == len(busy) and s["samples"] == len(clock.samples) > len(busy)
    assert s["sm_clock_mhz"] in (1700, 1840, 1980) and s["temperature_c_max"] == 55.0
    n = len(clock.samples)
    time.sleep(0.02)
    assert len(clock.samples) == n  # summary() stopped it


def test_no_reader_or_no_busy_sample_gives_no_clock():
    assert GpuClock(lambda: None, interval_s=0.001, ready=lambda: True).summary() == {}
    idle = GpuClock(lambda: lambda: (0, 1980, 80.0, 33.0), interval_s=0.001, ready=lambda: True)
    _wait_for(lambda: len(idle.samples) >= 3)
    assert idle.summary() == {"busy_samples": 0, "samples": len(idle.samples)}  # read, never busy
    never = GpuClock(lambda: None, interval_s=0.001, ready=lambda: False)  # a CPU program
    never.stop()
    assert never.summary() == {}


def test_the_note_names_the_clocks_when_they_differ():
    emu, sl = {"sm_clock_mhz": 1620}, {"sm_clock_mhz": 1680}
    assert clock_note(emu, sl) == "its GPU ran at 1,620 MHz, its slice's at 1,680 MHz (-3.6 %)"
    assert clock_note({"sm_clock_mhz": 1675}, sl) is None  # within 1 %
    assert clock_note({}, sl) is None and clock_note(emu, None) is None


def test_a_rank_log_carries_its_clock_and_an_older_one_loads_without():
    log = RankLog(rank=1, world_size=2, device="H200", clock="cuda", nodes=[], groups=[], iterations=[])
    log.gpu = {"sm_clock_mhz": 1710, "power_w": 690.0}
    assert RankLog.from_dict(log.to_dict()).gpu == log.gpu
    old = log.to_dict()
    del old["gpu"]
    assert RankLog.from_dict(old).gpu == {}
