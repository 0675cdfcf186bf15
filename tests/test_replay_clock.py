"""The real-time schedule of the proxy's calls (prismllm.assistant.clock): the host clock's rules
(the first completion pins logical time, each later one sets the drift, a call waits until it
is due) and the arrival report; on a GPU, the device clock's kernels keep the same rules."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from prismllm.assistant.clock import UNSET, DeviceClock, HostClock, arrival_report

MS = 1_000_000


def test_host_clock_pins_then_moves_by_the_completions():
    ready = np.array([0, 20 * MS, 40 * MS], dtype=np.int64)
    clock = HostClock(3, ready)
    t0 = time.perf_counter_ns()
    clock.enter(0, first_of_group=True)  # nothing completed yet: at once
    assert time.perf_counter_ns() - t0 < 5 * MS
    clock.completed(0, end_ns=5 * MS)  # logical 5 ms is now
    origin = clock._origin
    clock.enter(1, first_of_group=False)  # due at logical 20 ms: 15 ms later
    entered = time.perf_counter_ns()
    assert entered >= origin + 20 * MS - 1 * MS
    time.sleep(0.010)
    clock.completed(1, end_ns=22 * MS)  # ~10 ms late against its planned end: the drift moves call 2
    clock.enter(2, first_of_group=False)
    rows = clock._log.rows
    assert rows[2, 0] - (origin + 40 * MS) == rows[1, 3] > 5 * MS
    rep = clock.arrivals()
    assert rep["clock"] == "host" and rep["calls"] == 3 and rep["at_once"] == 1 and rep["timed"] == 2
    assert 0 <= rep["late"]["median_ns"] < 5 * MS
    assert rep["moved"]["max_ns"] > 5 * MS  # the sandbox moved the schedule by its late completion


def test_host_clock_later_calls_wait_for_the_first_completion():
    clock = HostClock(2, np.array([0, 0], dtype=np.int64))
    done = threading.Event()

    def second():
        clock.enter(1, first_of_group=False)
        done.set()

    t = threading.Thread(target=second, daemon=True)
    t.start()
    assert not done.wait(0.05)  # not a group's first call: waits for the origin
    clock.completed(0, end_ns=0)
    assert done.wait(5)


def test_arrival_report_separates_own_lateness_from_the_sandbox_shift():
    origin = 1_000 * MS
    ready = np.array([0, 10 * MS, 20 * MS, 30 * MS], dtype=np.int64)
    rows = np.full((4, 4), UNSET, dtype=np.int64)
    rows[0, 1] = origin  # at once
    rows[1, :2] = [origin + 10 * MS, origin + 10 * MS + 2_000]  # on time, 2 µs late
    rows[2, :2] = [origin + 23 * MS, origin + 23 * MS + 50_000]  # moved 3 ms by the sandbox, 50 µs late
    # call 3 never entered
    rep = arrival_report(rows, ready, origin)
    assert (rep["calls"], rep["entered"], rep["at_once"], rep["timed"]) == (4, 3, 1, 2)
    assert rep["late"]["max_ns"] == 50_000 and rep["late"]["min_ns"] == 2_000
    assert rep["late_over_10us"] == 1 and rep["late_over_100us"] == 0
    assert rep["moved"]["max_ns"] == 3 * MS and rep["moved"]["min_ns"] == 0
    assert rep["behind"]["max_ns"] == 3 * MS + 50_000


@pytest.mark.gpu
def test_device_clock_waits_on_the_device_and_moves_by_completions():
    """Three calls on one stream, enqueued at once: the first goes at once and pins logical 0;
    the second is due 50 ms after and planned to end at 80 ms, but ends at once (~50 ms): a drift
    of about -30 ms, so the third, planned at 150 ms, is due at ~120 ms. The host only enqueues."""
    dev = torch.device("cuda", 0)
    torch.cuda._sleep(1000)  # its first launch loads it, waiting for an idle device: not in the timed part
    torch.cuda.synchronize()
    clock = DeviceClock(dev, 3, np.array([0, 50 * MS, 150 * MS], dtype=np.int64))
    t0 = time.perf_counter()
    clock.enter(0)
    clock.completed(0, end_ns=0)
    clock.enter(1)
    torch.cuda._sleep(1000)  # the "call": about a microsecond
    clock.completed(1, end_ns=80 * MS)
    clock.enter(2)
    clock.completed(2, end_ns=150 * MS)
    assert time.perf_counter() - t0 < 0.040  # enqueued, not waited for (the schedule spans 120 ms)
    rep = clock.arrivals()
    rows = clock.rows.cpu().numpy()
    origin = int(clock.state[0].item())
    assert rep["clock"] == "device" and rep["at_once"] == 1 and rep["timed"] == 2
    assert abs(int(rows[1, 1]) - (origin + 50 * MS)) < 100_000  # entered when due (100 µs)
    drift = int(rows[1, 3])
    assert -30.5 * MS < drift < -29.5 * MS
    assert abs(int(rows[2, 0]) - (origin + 150 * MS + drift)) < 1_000
    assert rows[2, 1] - rows[2, 0] < 100_000 and rep["late"]["max_ns"] < 100_000
