"""Switch mode (`prism capture --mode switch`): every rank of the world runs the program, and a
coordinator carries out each collective with the members' real values (issue 38). The graph equals
the recorded real run's, the program's own checks of every collective's values pass, and a program
whose path depends on reduced values takes the real run's path, where solo capture's generated
answers send its ranks different ways. (The 8-rank gpt3d case is in
test_capture_solo_programs.py, beside the solo capture of the same recording.)"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import COLLECTIVES, PRISM

from prismllm.cli.main import main
from prismllm.errors import ExitCode
from prismllm.trace import PrismTrace
from prismllm.trace.compare import compare_traces

ROOT = Path(__file__).resolve().parents[1]
VALUE_PATH = str(ROOT / "tests" / "programs" / "value_path.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def prism(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([PRISM, *argv], capture_output=True, text=True, env=ENV, timeout=timeout)


def capture(
    mode: str, world: int, out: Path, *program: str, parallel: int | None = None
) -> subprocess.CompletedProcess:
    k = ["--parallel", str(parallel or world)] if mode == "solo" or parallel else []
    return prism("capture", "--mode", mode, "--world", str(world), "--devices", "cpu", "--out", str(out),
                 *k, "--timeout", "240", "--", *program)  # fmt: skip


def same_structure(a: Path, b: Path) -> None:
    res = compare_traces(PrismTrace.load(a), PrismTrace.load(b), timing=False)
    assert res.structure_equal, json.dumps(res.first_difference, indent=1, default=str)


def test_every_collective_kind_gets_the_real_values(tmp_path):
    """tests/programs/collectives.py checks each result itself (every reduce op, gathers, scatters,
    all-to-all with splits, send/recv, batched P2P, object collectives, coalescing, sub-groups),
    here with two of its four ranks running at a time: each rank that waits is stopped for another."""
    p = capture("switch", 4, tmp_path / "cap", COLLECTIVES, parallel=2)
    assert p.returncode == 0, p.stderr[-3000:]
    for r in range(4):
        assert f"COLLECTIVES OK {r}" in p.stdout + p.stderr
    cap = PrismTrace.load(tmp_path / "cap").manifest["capture"]
    assert cap["parallel"] == 2 and cap["switches"] > 0, cap
    assert f"stops            {cap['switches']} (waiting ranks stopped for others)" in p.stdout, p.stdout[-2000:]


def test_a_path_set_by_reduced_values_is_the_real_runs(tmp_path):
    """value_path.py skips a step on an infinite norm and stops on a reduced loss. `prism run
    --capture switch` captures the recorded run's graph and saves its values, which the slices'
    and the emulation's virtual ranks replay: the sandbox rank takes the real path too. Solo
    capture's ranks, answered from their own values, part ways."""
    rec = prism("record", "--nproc", "4", "--devices", "cpu", "--out", str(tmp_path / "rec"), "--", VALUE_PATH)
    assert rec.returncode == 0, rec.stderr[-3000:]
    real_path = sorted(ln for ln in rec.stdout.splitlines() if ln.startswith("PATH"))
    assert real_path[0] == "PATH 0 step0 skip1 step2 step3 step4 weights [36.0, 36.0, 36.0, 36.0]"
    run = prism("run", "--capture", "switch", "--world", "4", "--devices", "cpu", "--sandbox", "3",
                "--out", str(tmp_path / "run"), "--", VALUE_PATH)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    logs = tmp_path / "run" / "logs"
    captured = sorted(ln for ln in (logs / "capture.log").read_text().splitlines() if ln.startswith("PATH"))
    assert captured == real_path
    same_structure(tmp_path / "rec", tmp_path / "run" / "bare")
    emulated = [ln for ln in (logs / "emulate.log").read_text().splitlines() if ln.startswith("PATH")]
    assert emulated == [real_path[3]], emulated
    solo = capture("solo", 4, tmp_path / "solo", VALUE_PATH)
    assert solo.returncode != 0
    assert "every member of a group must issue the same collectives in the same order" in solo.stderr, solo.stderr


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--devices", "cuda:0,1", "--parallel", "3"], "give a multiple of 2"),
        (["--rules", __file__], "--rules with --mode switch"),
    ],
)
def test_what_switch_mode_refuses_is_one_line(tmp_path, capsys, extra, needle):
    argv = ["capture", "--mode", "switch", "--world", "2", "--out", str(tmp_path / "o"), *extra, "--", VALUE_PATH]
    if "--devices" not in extra:
        argv[5:5] = ["--devices", "cpu"]
    assert main(argv) == ExitCode.USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


def test_a_solo_capture_cannot_save_values_it_invents(tmp_path, capsys):
    argv = ["capture", "--world", "2", "--devices", "cpu", "--out", str(tmp_path / "o"), "--save-tensors", "all"]
    assert main([*argv, "--", VALUE_PATH]) == ExitCode.USAGE
    assert "--save-tensors needs --mode switch" in capsys.readouterr().err


@pytest.mark.parametrize("parallel", [None, 2])
def test_ranks_that_part_ways_are_found_deadlocked(tmp_path, parallel):
    """A rank that skips a collective its peers make, and ends: the others wait for it forever. The
    coordinator finds every rank left waiting on a call no one else will make, ends them, and says
    which calls it held, in from whom, waiting for whom (every rank at once, or two at a time)."""
    prog = tmp_path / "parting.py"
    prog.write_text(
        "import torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "t = torch.ones(2)\n"
        "if dist.get_rank() != 1:\n"
        "    dist.all_reduce(t)\n"
        "dist.all_reduce(t)\n"
    )
    k = ["--parallel", str(parallel)] if parallel else []
    t0 = time.monotonic()
    p = prism("capture", "--mode", "switch", "--world", "3", "--devices", "cpu", *k, "--out", str(tmp_path / "o"),
              "--timeout", "120", "--", str(prog))  # fmt: skip
    assert p.returncode != 0
    assert time.monotonic() - t0 < 100  # found, not timed out
    assert "the ranks are deadlocked" in p.stderr, p.stderr
    assert "all_reduce #1 on group" in p.stderr and "in from rank(s) 0,2, waiting for 1" in p.stderr, p.stderr


def test_a_waiting_rank_whose_peer_can_come_in_stays_so_a_group_shares_the_slots():
    """Two slots; TP pairs {0, 1} and {2, 3} started split: ranks 0 and 2 run and each waits on an
    all-reduce with its peer, which is ready to come in. The paper's rule alone stops both and
    brings in 1 and 3, and the pairs take turns on one slot each, a stop at every all-reduce; here
    one of them stays and the other makes room, so that its peer joins it. A waiting rank whose
    peer runs is not stopped at all (its answer comes without a switch); none whose peer is not
    ready stays."""
    from prismllm.capture.coordinator import Coordinator, _Instance, _Part, _Rank

    c = Coordinator(4, slots=2)
    try:
        with c._lock:  # as the scheduler calls it; its own looks wait (these ranks have no process)
            state = {0: "running", 1: "ready", 2: "running", 3: "ready"}
            c._ranks = {k: _Rank(pid=-1, state=v, calls={0}) for k, v in state.items()}

            def waits(rank: int, peer: int, seq: int) -> None:
                granks = tuple(sorted((rank, peer)))
                c._instances[(f"tp{granks[0]}", seq)] = _Instance(
                    "all_reduce", granks, {granks.index(rank): _Part(rank, None, {})}
                )

            waits(0, 1, 5)
            waits(2, 3, 5)
            assert c._to_stop({0, 2}) == [2]  # 2 makes room for 1, which joins 0
            c._ranks[1].state = "running"  # 1 runs: 0's answer comes without a switch
            assert c._to_stop({0, 2}) == [2]
            c._ranks[1].state = c._ranks[3].state = "waiting"  # no peer can come in: both go
            assert sorted(c._to_stop({0, 2})) == [0, 2]
    finally:
        with c._lock:
            for r in c._ranks.values():
                r.state = "done"
        c.close()


def test_a_pid_that_is_not_a_process_is_never_signalled():
    """os.kill(-1, sig) signals every process the user may signal, os.kill(0, sig) the caller's
    group: the coordinator's signals go to one rank's process or nowhere."""
    from prismllm.capture.gpuswap import send_signal

    for pid in (-1, 0):
        with pytest.raises(ValueError, match="not a rank's process id"):
            send_signal(pid, signal.SIGCONT)


def test_host_memory_about_to_run_out_ends_the_capture_in_one_line(tmp_path, monkeypatch):
    """The coordinator watches the host's available memory: under a twentieth of the host (or 1 GiB)
    it ends the ranks and says so, before the kernel's OOM killer would pick one of them."""
    from prismllm.capture import coordinator
    from prismllm.capture.solo import CaptureOptions, capture
    from prismllm.errors import PrismError

    monkeypatch.setattr(coordinator, "_meminfo", lambda: (100 << 20, 24 << 30))
    monkeypatch.setattr(coordinator, "MEMORY_EVERY", 1)
    opts = CaptureOptions(world=2, out=tmp_path / "o", script=VALUE_PATH, mode="switch", devices="cpu",
                          timeout=120, env={"OMP_NUM_THREADS": "1"})  # fmt: skip
    with pytest.raises(PrismError, match=r"switch-mode capture: host memory is about to run out \(0\.10 of 24\.0 GiB"):
        capture(opts)


def test_a_swap_the_driver_refuses_ends_the_capture_in_one_line(tmp_path, monkeypatch):
    """On GPUs a rank that waits is swapped out by the driver's checkpoint API; where the driver
    refuses (here a stand-in for it refuses the second checkpoint, the ranks running on the CPU
    as if on GPU 0), the capture ends every rank and says which GPU, rank and call."""
    from prismllm.capture import coordinator
    from prismllm.capture.gpuswap import SwapError, send_signal
    from prismllm.capture.solo import CaptureOptions, capture
    from prismllm.errors import PrismError

    class RefusingDriver:
        def __init__(self) -> None:
            self.outs = 0

        def out(self, pid: int, rank: int, gpu: int) -> None:
            self.outs += 1
            if self.outs == 2:
                raise SwapError(f"the CUDA driver refused checkpoint of rank {rank}: CUDA_ERROR_NOT_SUPPORTED (801)")
            send_signal(pid, signal.SIGSTOP)

        def back(self, pid: int, rank: int) -> None:
            send_signal(pid, signal.SIGCONT)

        def summary(self) -> dict:
            return {"out": self.outs}

    class OnGpu0(coordinator.Coordinator):
        def __init__(self, world: int, slots: int | None = None, gpus: list[int] | None = None) -> None:
            super().__init__(world, slots, gpus=[0] * world)

    monkeypatch.setattr(coordinator, "GpuSwap", RefusingDriver)
    monkeypatch.setattr(coordinator, "Coordinator", OnGpu0)
    opts = CaptureOptions(world=2, out=tmp_path / "o", script=VALUE_PATH, mode="switch", devices="cpu", parallel=1,
                          timeout=120, env={"OMP_NUM_THREADS": "1"})  # fmt: skip
    with pytest.raises(PrismError) as e:
        capture(opts)
    first = str(e.value).splitlines()[0]
    assert re.match(
        r"switch-mode capture: GPU 0: the CUDA driver refused checkpoint of rank [01]: CUDA_ERROR", first
    ), str(e.value)
    assert (tmp_path / "o" / ".spool").is_dir()  # kept, for the ranks' logs


def test_torch_pipelining_with_data_parallel_two_ranks_at_a_time(tmp_path, recorded_graph):
    """torch.distributed.pipelining (interleaved 1F1B, two pipelines side by side): its stages send
    each other their shapes as objects and their activations into receive buffers that require
    grad; switch mode, two of four ranks at a time, captures the real run's graph."""
    from test_capture_solo_programs import PIPELINE_TRAIN, assert_equals_the_real_runs_structure

    program = [PIPELINE_TRAIN, "--stages-per-rank", "2", "--dp", "2"]
    p = capture("switch", 4, tmp_path / "cap", *program, parallel=2)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "rank 3: iteration 3/3 | loss" in p.stdout + p.stderr
    # the real run: test_capture_solo_programs' too (the same command)
    assert_equals_the_real_runs_structure(tmp_path / "cap", recorded_graph(4, ["--", *program]))


def test_a_rank_that_crashes_is_named_with_the_calls_left_waiting(tmp_path):
    """A rank that raises between two collectives: the capture names it and its error (not a
    deadlock: the others wait on it because it crashed), with the calls the coordinator held."""
    prog = tmp_path / "dies.py"
    prog.write_text(
        "import torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "t = torch.ones(2)\n"
        "dist.all_reduce(t)\n"
        "if dist.get_rank() == 1:\n"
        "    raise RuntimeError('rank 1 gives up')\n"
        "dist.all_reduce(t)\n"
    )
    p = prism("capture", "--mode", "switch", "--world", "3", "--parallel", "2", "--devices", "cpu",
              "--out", str(tmp_path / "o"), "--timeout", "120", "--", str(prog))  # fmt: skip
    assert p.returncode != 0
    assert "prism capture: error: rank 1 exited with code 1: RuntimeError: rank 1 gives up" in p.stderr, p.stderr
    assert "in from rank(s) 0,2, waiting for 1" in p.stderr and "deadlocked" not in p.stderr, p.stderr
