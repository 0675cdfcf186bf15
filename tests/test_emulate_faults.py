"""Faults in `prism emulate` (CPU, N = 2, gpt3d TP2, sandbox {1}): a sandbox rank that raises,
runs out of memory or is killed ends the emulation with that rank's own error (a reproduced
OOM reported as a result); an assistant that dies ends it with a clear message; no process is
left behind, checked by pid.

The faults are the real program's: the sandbox runs a wrapper (written below) that imports
examples/gpt3d.py unmodified and, on rank FAULT_RANK only, replaces its optimizer step by the
real one followed by the fault -- after the first iteration, so the sandbox and the assistant
are mid-run, in the middle of the recorded collectives. The graph is recorded once from gpt3d
itself. Every `prism emulate` here is a real CLI process; the pids come from OUT/pids.json
(written as soon as every child started) and OUT/emulate.json.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import pytest
from test_emulate import GPT3D, LAYOUTS, PRISM, SIZES, assert_all_ended, pid_alive, shared_record

from prismllm.errors import ExitCode
from prismllm.launch import LaunchSpec, launch

WRAPPER = textwrap.dedent(f"""
    import os
    import sys
    import time

    sys.path.insert(0, {str(Path(GPT3D).parent)!r})
    import gpt3d

    step = gpt3d.MegatronOptimizer.step


    def faulty_step(self):
        step(self)
        if int(os.environ["RANK"]) != int(os.environ["FAULT_RANK"]):
            return
        fault = os.environ["FAULT"]
        if fault == "raise":
            raise RuntimeError("boom")
        if fault == "oom":  # a real allocation failure: more than any address space holds
            import torch
            torch.empty(1 << 60, dtype=torch.uint8)
        if fault == "stall":  # say so, then wait to be killed
            with open(os.environ["FAULT_MARK"], "w") as f:
                f.write(str(os.getpid()))
            time.sleep(600)


    gpt3d.MegatronOptimizer.step = faulty_step
    sys.exit(gpt3d.main())
""")


@pytest.fixture(scope="module")
def setup(tmp_path_factory, gpt3d_recording):
    """(the recorded TP2 graph, the wrapper script). The graph is test_emulate's (shared)."""
    d = tmp_path_factory.mktemp("faults")
    graph, _ = shared_record(gpt3d_recording, "tp2")
    wrapper = d / "faulty_gpt3d.py"
    wrapper.write_text(WRAPPER)
    return graph, wrapper


def start(
    setup, out: Path, fault: str, mark: Path | None = None, timeout: int = 120, env: dict | None = None
) -> subprocess.Popen:
    graph, wrapper = setup
    # the wrapper is a deliberate variant of the graph's program: past the start-up check
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "FAULT": fault,
        "FAULT_RANK": "1",
        "FAULT_MARK": str(mark or ""),
        "PRISM_PROGRAM_CHECK": "off",
        **(env or {}),
    }
    return subprocess.Popen(
        [
            PRISM,
            "emulate",
            "--graph",
            str(graph),
            "--sandbox",
            "1",
            "--out",
            str(out),
            "--timeout",
            str(timeout),
            "--",
            str(wrapper),
            *LAYOUTS["tp2"],
            *SIZES,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def verdict(err: str, prefix: str = "prism emulate: error: ") -> str:
    """The one line of `prism emulate` saying how the run ended; no traceback of prism's own
    (the sandbox program's traceback, passed through with its [rank1]: prefix, is expected)."""
    lines = [ln for ln in err.splitlines() if ln.startswith("prism emulate:")]
    assert len(lines) == 1, err
    assert lines[0].startswith(prefix), err
    for ln in err.splitlines():
        assert not (ln.startswith("Traceback") or re.search(r'File ".*[/\\]prismllm[/\\]', ln)), err
    return lines[0][len(prefix) :]


def all_pids(out: Path) -> list[int]:
    """Every process `prism emulate` named: the CLI process (launcher), sandbox, assistant."""
    info = json.loads((out / "pids.json").read_text())
    assert info["assistant"] and list(info["sandbox"]) == ["1"], info
    return [info["launcher"], info["assistant"], *info["sandbox"].values()]


def descendants(pid: int) -> list[int]:
    """``pid``'s live descendants (children run in their own sessions, but keep their parent)."""
    parent = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    parent[int(name)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        found += kids
        todo += kids
    return [p for p in found if pid_alive(p)]


def run_to_end(setup, out: Path, fault: str, **kw) -> tuple[int, str]:
    proc = start(setup, out, fault, **kw)
    try:
        _, err = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, err


def kill_mid_run(setup, tmp_path: Path, who: str) -> tuple[int, str, float, Path]:
    """Start an emulation whose sandbox rank stalls after its first iteration, SIGKILL ``who``
    ("sandbox" or "assistant") there; return (exit status, stderr, seconds from the kill to
    the end, OUT), having checked that every process of the run is gone."""
    out, mark = tmp_path / "emu", tmp_path / "stalled"
    proc = start(setup, out, "stall", mark)
    try:
        deadline = time.monotonic() + 120
        while not (mark.exists() and (out / "pids.json").exists()):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail("the sandbox rank never stalled:\n" + proc.communicate()[1][-3000:])
            time.sleep(0.1)
        info = json.loads((out / "pids.json").read_text())
        assert int(mark.read_text()) == info["sandbox"]["1"]  # the stalled process is the sandbox rank
        family = descendants(proc.pid)  # sandbox, assistant, the launcher's watchdog
        target = info["sandbox"]["1"] if who == "sandbox" else info["assistant"]
        assert target in family and pid_alive(target)
        os.kill(target, signal.SIGKILL)
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert_all_ended(family + all_pids(out))
    return proc.returncode, err, took, out


CASCADE = textwrap.dedent("""
    import os, sys, time
    mark = os.environ["MARK"]
    if os.environ["RANK"] == "0":  # the cause: reports its error, then takes a while to exit
        print("RuntimeError: boom", file=sys.stderr, flush=True)
        open(mark, "w").close()
        time.sleep(0.5)
        sys.exit(1)
    while not os.path.exists(mark):  # the consequence: its peer went away, it exits at once
        time.sleep(0.01)
    print("RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:1234", file=sys.stderr, flush=True)
    sys.exit(1)
""")


def test_launcher_names_the_cause_of_a_cascade_not_the_first_exit(tmp_path):
    """What a sandbox rank that raises does to the assistant, in miniature: the rank that lost
    its peer exits first; with ``settle`` the cause keeps its own exit status and is named."""
    script = tmp_path / "cascade.py"
    script.write_text(CASCADE)
    res = launch(
        LaunchSpec(
            nproc=2,
            script=str(script),
            runner=None,
            env={"MARK": str(tmp_path / "mark")},
            settle=2.0,
            sink=lambda *a: None,
        )
    )
    assert not res.ok and res.failure.rank == 0 and res.returncodes == {0: 1, 1: 1}, res.message
    assert res.message.startswith("rank 0 exited with code 1: RuntimeError: boom"), res.message
    assert_all_ended(res.pids.values())


def test_sandbox_rank_that_raises_ends_the_run_with_its_own_error(setup, tmp_path):
    out = tmp_path / "emu"
    rc, err = run_to_end(setup, out, "raise")
    assert rc == ExitCode.FAILED, err  # as torchrun exits for a failed worker
    assert verdict(err) == "sandbox rank 1 exited with code 1: RuntimeError: boom"
    assert "[rank1]: RuntimeError: boom" in err  # the program's own traceback, passed through
    info = json.loads((out / "emulate.json").read_text())
    assert info["outcome"] == "failed" and info["returncodes"] == {"1": 1}, info  # its own status
    assert info["pids"]["sandbox"] == json.loads((out / "pids.json").read_text())["sandbox"]
    assert_all_ended(all_pids(out))


def test_sandbox_rank_out_of_memory_is_reported_as_a_result(setup, tmp_path):
    out = tmp_path / "emu"
    rc, err = run_to_end(setup, out, "oom")
    assert rc == ExitCode.FAILED, err  # a reproduced OOM: what the emulation found, on a line of its own
    line = verdict(err, "prism emulate: ")
    assert line.startswith(
        "sandbox rank 1 ran out of memory, reproduced by the emulation (a result, not "
        "a failure of prism): RuntimeError: "
    ), line
    assert "can't allocate memory" in line, line
    info = json.loads((out / "emulate.json").read_text())
    assert info["outcome"] == "out_of_memory" and info["returncodes"] == {"1": 1}, info
    assert_all_ended(all_pids(out))


def test_sandbox_rank_killed_mid_run(setup, tmp_path):
    rc, err, took, out = kill_mid_run(setup, tmp_path, "sandbox")
    assert rc == ExitCode.FAILED and took < 15, (took, err)
    assert verdict(err).startswith("sandbox rank 1 was killed by SIGKILL (9)"), err
    info = json.loads((out / "emulate.json").read_text())
    assert info["returncodes"] == {"1": -9}, info


def test_assistant_killed_mid_run(setup, tmp_path):
    rc, err, took, out = kill_mid_run(setup, tmp_path, "assistant")
    assert rc == ExitCode.FAILED and took < 15, (took, err)
    assert verdict(err) == (
        "assistant was killed by SIGKILL (9) (out of memory?): the virtual rank(s) 0 "
        "it played are gone, so sandbox rank(s) 1 were ended"
    ), err
    info = json.loads((out / "emulate.json").read_text())
    assert info["assistant_returncode"] == -9 and info["returncodes"]["1"] != 0, info


def test_program_that_deviates_from_its_graph_is_one_clear_error(setup, tmp_path):
    """The graph was recorded with --hidden 32; the sandbox runs --hidden 64: its first
    activation all-reduce is twice the size the graph (and the assistant) expect. One line
    naming the rank, the call and the fix, before anything is issued; nothing left behind."""
    graph, _ = setup
    args = list(SIZES)
    args[args.index("--hidden") + 1] = "64"
    out = tmp_path / "deviates"
    cmd = [
        PRISM,
        "emulate",
        "--graph",
        str(graph),
        "--sandbox",
        "1",
        "--out",
        str(out),
        "--timeout",
        "120",
        "--",
        GPT3D,
        *LAYOUTS["tp2"],
        *args,
    ]
    # refused at the start: the launched arguments are not the graph's (the fingerprint)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=150, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == ExitCode.USAGE
    line = verdict(p.stderr)
    assert "with --hidden 32 but you launched --hidden 64" in line and "PRISM_PROGRAM_CHECK=off" in line, line
    assert not (out / "pids.json").exists()  # nothing was started
    # past the start-up check, the program deviates at its first differing call
    p = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=150,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PRISM_PROGRAM_CHECK": "off"},
    )
    assert p.returncode != 0
    line = verdict(p.stderr)
    assert "rank 1 deviates from its graph at all_reduce" in line, line
    assert "capture the graph again" in line and "deviates" in line, line
    assert_all_ended(all_pids(out))


def test_a_call_beyond_the_graph_on_the_native_lane_is_one_clear_error(setup, tmp_path):
    """The native lane checks each call against the graph before issuing it from a template:
    one iteration more than the graph has, whose calls all have templates by then, stops at the
    first call past the graph's last with the graph check's line, not in a mismatched small call."""
    graph, _ = setup
    args = list(SIZES)
    args[args.index("--iters") + 1] = str(int(args[args.index("--iters") + 1]) + 1)
    line = lane_failure(graph, tmp_path / "beyond", args, PRISM_PROGRAM_CHECK="off")
    assert "rank 1 deviates from its graph at " in line and "has no more collectives" in line, line


def test_a_native_lane_that_cannot_be_built_says_how_to_do_without(setup, tmp_path):
    """PRISM_NATIVE_LANE=1 where the native backend cannot be built (here: a cache directory that
    cannot be made): the emulation stops with one line naming the way out, before it starts any
    process (the launcher builds it once for its ranks)."""
    graph, _ = setup
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    out = tmp_path / "nolane"
    line = lane_failure(graph, out, SIZES, started=False, PRISM_NATIVE_CACHE=str(blocker / "x"))
    assert "could not be built" in line and "PRISM_NATIVE_LANE=0 emulates through the Python path" in line, line
    assert not (out / "pids.json").exists(), "a process started before the build failed"


def lane_failure(graph: Path, out: Path, args: list[str], started: bool = True, **env: str) -> str:
    """`prism emulate` of the TP2 program with PRISM_NATIVE_LANE=1 and ``env``, which must fail: its
    one line, every process it ``started`` gone."""
    cmd = [PRISM, "emulate", "--graph", str(graph), "--sandbox", "1", "--out", str(out), "--timeout", "120",
           "--", GPT3D, *LAYOUTS["tp2"], *args]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PRISM_NATIVE_LANE": "1", **env}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=150, env=env)
    assert p.returncode != 0
    line = verdict(p.stderr)
    if started:
        assert_all_ended(all_pids(out))
    return line


def test_a_stalled_run_says_where_each_process_stood(setup, tmp_path):
    """The sandbox rank stops after its first iteration (it sleeps in its optimizer step), so the
    assistant waits for it forever: the timeout ends the run, and the message says where each
    process stood: the sandbox rank at the program's line, the assistant waiting for a call with
    the sandbox (prismllm.launch.status). Before that, with no progress for PRISM_STATUS_AFTER seconds,
    the launcher printed the same report while the run went on."""
    # the timeout leaves room for a slow start (on a loaded 2-core machine the stall came 13 s in)
    rc, err = run_to_end(
        setup, tmp_path / "emu", "stall", mark=tmp_path / "stalled", timeout=30, env={"PRISM_STATUS_AFTER": "5"}
    )
    assert rc != 0
    line = verdict(err)
    assert line.startswith("timed out after 30 s"), err
    early = re.search(r"^prism: no communication for (\d+) s; where each process stands:$", err, re.M)
    assert early and 5 <= int(early.group(1)) < 30 and early.start() < err.index("prism emulate: error"), err
    assert re.search(r"^prism:   rank 1: at faulty_gpt3d\.py:\d+ in faulty_step$", err, re.M), err
    report = err[err.index("where each process stood:") :]
    # time.sleep is C: the program's line is the innermost frame
    assert re.search(r"^  rank 1: at faulty_gpt3d\.py:\d+ in faulty_step$", report, re.M), err
    assert re.search(r"^    \d+ call\(s\) so far, in iteration 0$", report, re.M), err
    assert re.search(r"^  assistant: at proxy\.py:\d+ in run$", report, re.M), err
    assert re.search(r"waiting [\d.]+ s for rank 0 node \d+ \(\w+ #\d+, group .*\) with the sandbox", report), err
    stacks = Path(re.search(r"every thread's stack, per process: (\S+)[/\\]\*\.status", report).group(1))
    assert (stacks / "rank-000001.status").read_text().count("faulty_step") == 1


def test_a_stuck_slice_of_prism_time_is_not_silent(setup, tmp_path):
    """`prism time` runs each slice in its own launch: the status report of a slice that makes no
    progress reaches the user as it is written, prefixed with the slice, and the slice's timeout
    fails `prism time` with the launcher's message and the report of where each process stood,
    line by line. Slice 0 (rank 0 real) runs through; slice 1 (rank 1 real) stalls."""
    graph, wrapper = setup
    # the timeout leaves room for a report after the stall: on a loaded 2-core machine the slice's
    # set-up alone went 5 s without a call (a first report, from the set-up) and the stall came 10 s in
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "FAULT": "stall",
        "FAULT_RANK": "1",
        "FAULT_MARK": str(tmp_path / "stalled"),
        "PRISM_PROGRAM_CHECK": "off",
        "PRISM_STATUS_AFTER": "5",
    }
    p = subprocess.run(
        [
            PRISM,
            "time",
            "--graph",
            str(graph),
            "--out",
            str(tmp_path / "timed"),
            "--timeout",
            "30",
            "--",
            str(wrapper),
            *LAYOUTS["tp2"],
            *SIZES,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=200,
    )
    err = p.stderr
    assert p.returncode == ExitCode.FAILED, err
    assert re.search(
        r"^prism time: slice 1 \(ranks 1\): no communication for \d+ s; where each process stands:$", err, re.M
    ), err
    assert re.search(
        r"^prism time: slice 1 \(ranks 1\):   rank 1: at faulty_gpt3d\.py:\d+ in faulty_step$", err, re.M
    ), err
    line = next(ln for ln in err.splitlines() if ln.startswith("prism time: error:"))
    assert line.startswith("prism time: error: slice 1 (ranks 1) failed: timed out after 30 s"), err
    report = err[err.index("where each process stood:") :]
    assert re.search(r"^  rank 1: at faulty_gpt3d\.py:\d+ in faulty_step$", report, re.M), err
    info = json.loads((tmp_path / "timed" / "slices" / "slice-00001" / "slice.json").read_text())
    assert not info["ok"] and info["message"].startswith("timed out after 30 s")


def test_a_call_emulation_cannot_run_is_one_clear_error(tmp_path):
    """A receive from any source (``dist.recv`` without ``src``) records and runs for real, but
    emulation cannot replay it (the sender must be known in advance): one line naming the rank,
    the call, the group and the fix; no traceback, nothing left behind."""
    program = str(Path(__file__).resolve().parent / "programs" / "recv_anysource.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    rec = tmp_path / "rec"
    p = subprocess.run([PRISM, "record", "--nproc", "2", "--devices", "cpu", "--out", str(rec), "--", program],
                       capture_output=True, text=True, timeout=150, env=env)  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    out = tmp_path / "emu"
    p = subprocess.run([PRISM, "emulate", "--graph", str(rec), "--sandbox", "1", "--devices", "cpu", "--out", str(out),
                        "--timeout", "120", "--", program], capture_output=True, text=True, timeout=150, env=env)  # fmt: skip
    assert p.returncode != 0
    line = verdict(p.stderr)
    assert line.startswith("sandbox rank 1: recv from any source (src=None) on group 0 (ranks 0-1) is not supported"), (
        line
    )
    assert "dist.recv(tensor, src=...)" in line, line
    assert "Traceback" not in p.stderr, p.stderr
    assert_all_ended(all_pids(out))
