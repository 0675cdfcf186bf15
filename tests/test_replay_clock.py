"""The real-time schedule of the proxy's calls (prismllm.assistant.clock): the host clock's rules
(the first completion pins logical time, each later one sets the drift, a call waits until it
is due) and the arrival report; on a GPU, the device clock's kernels keep the same rules."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from prismllm.assistant.clock import UNSET, DeviceClock, HostClock, Schedule, arrival_report, schedule_table

MS = 1_000_000


def test_host_clock_pins_then_moves_a_call_by_its_gates_only():
    """Call 0 goes at once and pins logical time at its completion; call 1 is due 20 ms later,
    completes ~10 ms late against its planned end; call 2 waits behind call 1 (its gate) and is
    moved by that lateness; call 3 has no gate: it keeps its planned time."""
    sch = Schedule(
        ready_ns=[0, 20 * MS, 40 * MS, 45 * MS],
        planned_end_ns=[5 * MS, 22 * MS, 45 * MS, 50 * MS],
        gate_ptr=[0, 0, 0, 1, 1],
        gate=[1],
    )
    clock = HostClock(sch)
    t0 = time.perf_counter_ns()
    clock.enter(0, first_of_group=True)  # nothing completed yet: at once
    assert time.perf_counter_ns() - t0 < 5 * MS
    clock.completed(0)  # logical 5 ms is now
    origin = clock._origin
    clock.enter(1, first_of_group=False)  # due at logical 20 ms: 15 ms later
    assert time.perf_counter_ns() >= origin + 19 * MS
    time.sleep(0.010)
    clock.completed(1)  # ~10 ms late against its planned end (22 ms)
    late = int(clock.rows[1, 3])
    assert late > 5 * MS
    clock.enter(2, first_of_group=False)
    clock.enter(3, first_of_group=False)
    assert clock.rows[2, 0] == origin + 40 * MS + late
    assert clock.rows[3, 0] == origin + 45 * MS
    rep = clock.arrivals()
    assert rep["clock"] == "host" and rep["calls"] == 4 and rep["at_once"] == 1 and rep["timed"] == 3
    # lateness is the entry against the due time, never early (how much late is the host's: no bound)
    own = clock.rows[1:, 1] - clock.rows[1:, 0]
    assert (own >= 0).all() and rep["late"]["median_ns"] == int(np.median(own))
    assert own[2] >= late - 5 * MS  # call 3 entered after call 2, due 5 ms before call 2's moved time
    assert rep["moved"]["max_ns"] == late and rep["moved"]["min_ns"] == 0


def test_host_clock_moves_a_call_by_a_gate_less_its_offset():
    """Calls 2 and 3 both wait behind call 1, which completes ~10 ms late: call 2 in full, call 3
    with a 4 ms offset (the plan's wait since, which absorbs that much), so 4 ms earlier."""
    sch = Schedule(
        ready_ns=[0, 10 * MS, 30 * MS, 30 * MS],
        planned_end_ns=[2 * MS, 12 * MS, 31 * MS, 31 * MS],
        gate_ptr=[0, 0, 0, 1, 2],
        gate=[1, 1],
        gate_offset_ns=[0, 4 * MS],
    )
    clock = HostClock(sch)
    clock.enter(0, first_of_group=True)
    clock.completed(0)
    clock.enter(1, first_of_group=False)
    time.sleep(0.012)
    clock.completed(1)
    late = int(clock.rows[1, 3])
    assert late > 5 * MS
    clock.enter(2, first_of_group=False)
    clock.enter(3, first_of_group=False)
    assert clock.rows[2, 0] == clock._origin + 30 * MS + late
    assert clock.rows[3, 0] == clock._origin + 30 * MS + late - 4 * MS


def test_host_clock_a_gated_call_waits_for_its_gate():
    sch = Schedule(ready_ns=[0, 0], planned_end_ns=[0, 0], gate_ptr=[0, 0, 1], gate=[0])
    clock = HostClock(sch)
    done = threading.Event()

    def second():
        clock.enter(1, first_of_group=True)  # gated: not at once, though the first of its group
        done.set()

    t = threading.Thread(target=second, daemon=True)
    t.start()
    assert not done.wait(0.05)
    clock.enter(0, first_of_group=True)
    clock.completed(0)
    assert done.wait(5)


def test_host_clock_keeps_the_sandbox_clock_that_leaves_the_emulation_out(tmp_path):
    """A CPU emulation: the sandbox leaves 30 ms of emulation overhead out of its clock between
    two calls (a board it shares with the assistant, prismllm.comm.leftout). The virtual rank's
    second call, gated on the first and due 20 ms after it by the plan, is due 20 ms after on the
    sandbox's clock: 50 ms after on the wall's, with no lateness counted for the overhead; a
    completion that came those 30 ms later on the wall is on time."""
    from prismllm.comm.leftout import LANE, PYTHON, LeftOutBoard

    path = LeftOutBoard.create(tmp_path / "board", 1)
    sandbox, assistant = LeftOutBoard(path), LeftOutBoard(path)  # two processes' maps of one file
    sch = Schedule(
        ready_ns=[0, 20 * MS, 40 * MS],
        planned_end_ns=[0, 20 * MS, 40 * MS],
        gate_ptr=[0, 0, 1, 2],
        gate=[0, 1],
    )
    clock = HostClock(sch, assistant.mean_ns)
    clock.enter(0, first_of_group=True)
    clock.completed(0)
    wall0 = time.perf_counter_ns()
    sandbox.set(0, PYTHON, 20 * MS)  # the Python layer's part and the native lane's add up
    sandbox.set(0, LANE, 10 * MS)
    assert assistant.mean_ns() == 30 * MS
    clock.enter(1, first_of_group=False)
    assert time.perf_counter_ns() - wall0 >= 49 * MS  # 20 ms on the sandbox's clock, 50 on the wall's
    clock.completed(1)
    assert abs(int(clock.rows[1, 3])) < 5 * MS  # on time on the sandbox's clock
    clock.enter(2, first_of_group=False)
    assert clock.rows[2, 0] - clock._origin - 40 * MS == clock.rows[1, 3]  # moved by call 1's lateness alone


def test_schedule_table_puts_each_call_in_logical_time():
    """The clock's log as a table: each call's plan and gates beside its due, entry and completion
    less the origin; a call entered at once has no due time, one never entered no times."""
    origin = 1_000 * MS
    sch = Schedule(ready_ns=[0, 10 * MS, 20 * MS], planned_end_ns=[4 * MS, 12 * MS, 25 * MS],
                   gate_ptr=[0, 0, 1, 2], gate=[0, 1])  # fmt: skip
    rows = np.full((3, 4), UNSET, dtype=np.int64)
    rows[0, 1:3] = [origin - 4 * MS, origin + 0]  # at once; its completion pinned logical 4 ms
    rows[1, :3] = [origin + 7 * MS, origin + 7 * MS + 1_000, origin + 9 * MS]
    calls = {"op": ["all_reduce", "send+recv", "recv"], "rank": [0, 0, 0]}
    t = schedule_table(sch, rows, origin, calls).to_pydict()
    assert t["slot"] == [0, 1, 2] and t["op"] == calls["op"] and t["gates"] == [[], [0], [1]]
    assert t["ready_ns"] == [0, 10 * MS, 20 * MS] and t["planned_end_ns"] == [4 * MS, 12 * MS, 25 * MS]
    assert t["due_ns"] == [None, 7 * MS, None]
    assert t["entered_ns"] == [-4 * MS, 7 * MS + 1_000, None]
    assert t["completed_ns"] == [0, 9 * MS, None]
    # before a completion pinned logical time nothing has a place in it
    assert schedule_table(sch, rows, None, calls).column("entered_ns").null_count == 3


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
def test_device_clock_waits_on_the_device_for_gates_and_time():
    """Four calls on one stream, enqueued at once: the first goes at once and pins logical 0; the
    second is due 50 ms after and planned to end at 80 ms, but ends at once (~50 ms): ~30 ms
    early; the third waits behind it (its gate), planned at 150 ms, so due at ~120 ms; the fourth,
    ungated, keeps its 170 ms. The host only enqueues."""
    dev = torch.device("cuda", 0)
    torch.cuda._sleep(1000)  # its first launch loads it, waiting for an idle device: not in the timed part
    torch.cuda.synchronize()
    sch = Schedule(
        ready_ns=[0, 50 * MS, 150 * MS, 170 * MS],
        planned_end_ns=[0, 80 * MS, 150 * MS, 170 * MS],
        gate_ptr=[0, 0, 0, 1, 1],
        gate=[1],
    )
    clock = DeviceClock(dev, sch)
    t0 = time.perf_counter()
    for slot in range(4):
        clock.enter(slot)
        if slot == 1:
            torch.cuda._sleep(1000)  # the "call": about a microsecond
        clock.completed(slot)
    assert time.perf_counter() - t0 < 0.040  # enqueued, not waited for (the schedule spans 170 ms)
    rep = clock.arrivals()
    rows = clock.rows.cpu().numpy()
    origin = int(clock.state[0].item())
    assert rep["clock"] == "device" and rep["at_once"] == 1 and rep["timed"] == 3
    assert abs(int(rows[1, 1]) - (origin + 50 * MS)) < 100_000  # entered when due (100 µs)
    early = int(rows[1, 3])
    assert -30.5 * MS < early < -29.5 * MS
    assert int(rows[2, 0]) == origin + 150 * MS + early
    assert int(rows[3, 0]) == origin + 170 * MS
    assert rep["late"]["max_ns"] < 100_000
