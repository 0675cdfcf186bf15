"""prismllm.launch.status: a process's reporter thread answers the launcher's status requests with what
its describers say and every thread's stack, also while the main thread is blocked in C; the
launcher's board reads them back into one line per place."""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from prismllm.launch import LaunchError, LaunchSpec, launch, status as S, status_after_default


def test_a_blocked_main_thread_is_reported_at_the_program_line(tmp_path):
    """The main thread blocks in a C-level lock wait (as a rank does in a collective's wait): a
    Python signal handler would never run, the reporter thread still answers."""
    rep = S.StatusReporter(tmp_path, "rank-000000", poll_s=0.02)
    calls = [0]
    rep.add(lambda: ["waiting on call 7 all_reduce", f"{calls[0]} call(s)"], lambda: calls[0])
    rep.start()
    board = S.StatusBoard(tmp_path, {0: "rank-000000", 1: "rank-000001"})
    answers: dict = {}
    lock = threading.Lock()
    lock.acquire()

    def ask():
        answers.update(board.request([0, 1], wait_s=1.0))
        lock.release()

    threading.Thread(target=ask).start()
    line = sys._getframe().f_lineno + 1
    assert lock.acquire(timeout=20)  # blocked here, in C, until the board has its answers
    st = answers[0]
    assert answers[1] is None  # no process behind that name: no answer
    assert st.said == ["waiting on call 7 all_reduce", "0 call(s)"]
    prog = st.program_frame()
    assert (Path(prog.file).name, prog.line, prog.func) == (
        "test_status.py",
        line,
        "test_a_blocked_main_thread_is_reported_at_the_program_line",
    )
    assert st.summary() == f"at test_status.py:{line} in test_a_blocked_main_thread_is_reported_at_the_program_line"
    # progress: written when it moves, and the board sees the move
    time.sleep(0.1)
    assert board.poll_progress() < 0.05
    calls[0] = 3
    time.sleep(0.3)
    assert (tmp_path / "rank-000000.progress").read_text() == "3"
    assert board.poll_progress() < 0.3


def test_parse_status_picks_the_main_thread_and_the_call_it_is_in():
    torch_dir = os.path.dirname(__import__("torch").__file__)
    text = "\n".join(
        [
            "generation 2",
            "pid 1",
            f"main-thread {0xABC}",
            "say 3 call(s) so far",
            "--- stacks ---",
            "Thread 0x0000000000000def (most recent call first):",
            '  File "/x/other.py", line 1 in elsewhere',
            "",
            "Current thread 0x0000000000000abc (most recent call first):",
            f'  File "{torch_dir}/distributed/distributed_c10d.py", line 10 in all_reduce',
            f'  File "{torch_dir}/distributed/c10d_logger.py", line 20 in wrapper',
            '  File "/site/megatron/core/pipeline.py", line 30 in step',
            '  File "/work/train.py", line 40 in <module>',
        ]
    )
    st = S.parse_status(text)
    assert st.said == ["3 call(s) so far"] and len(st.main_stack) == 4
    assert st.summary() == "at pipeline.py:30 in step, in all_reduce (distributed_c10d.py)"


def test_an_earlier_runs_answers_are_not_taken_for_this_ones(tmp_path):
    (tmp_path / "rank-000000.status").write_text("generation 1\npid 1\nmain-thread 1\n--- stacks ---\n")
    board = S.StatusBoard(tmp_path, {0: "rank-000000"})
    assert board.request([0], wait_s=0.2) == {0: None}


def test_status_after_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv("PRISM_STATUS_AFTER", raising=False)
    assert status_after_default() == 300.0 and LaunchSpec(nproc=1, script="x").status_after == 300.0
    monkeypatch.setenv("PRISM_STATUS_AFTER", "off")
    assert LaunchSpec(nproc=1, script="x").status_after is None
    monkeypatch.setenv("PRISM_STATUS_AFTER", "12.5")
    assert status_after_default() == 12.5
    monkeypatch.setenv("PRISM_STATUS_AFTER", "soon")
    with pytest.raises(LaunchError, match="PRISM_STATUS_AFTER='soon'"):
        status_after_default()


def test_a_run_that_reported_nothing_leaves_no_status_directory(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    script = tmp_path / "s.py"
    script.write_text("import os; assert os.environ['PRISM_STATUS_NAME'] == f\"rank-{int(os.environ['RANK']):06d}\"\n")
    res = launch(LaunchSpec(nproc=2, script=str(script), runner=None, devices="cpu"))
    assert res.ok, res.message
    assert [p.name for p in tmp_path.iterdir()] == ["s.py"]


def test_a_timeout_of_plain_scripts_asks_nothing(tmp_path, monkeypatch):
    """Children that run no reporter (runner=None: the script alone) are not waited for: the
    timeout's message is the plain one, at once, and no status directory stays."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    script = tmp_path / "s.py"
    script.write_text("import time; time.sleep(60)\n")
    t0 = time.monotonic()
    res = launch(LaunchSpec(nproc=2, script=str(script), runner=None, devices="cpu", timeout=1.5, grace_period=1))
    assert time.monotonic() - t0 < 6
    assert res.message == "timed out after 1.5 s; ranks still running: 0-1 (ended by the launcher)"
    assert [p.name for p in tmp_path.iterdir()] == ["s.py"]


def test_a_stopped_process_is_said_stopped_not_asked(tmp_path):
    """A child stopped by a signal (switch mode's coordinator stops a rank that waits) cannot
    answer: the report says it is stopped instead of waiting for an answer that cannot come."""
    board = S.StatusBoard(tmp_path, {0: "rank-000000"})
    (tmp_path / "rank-000000.progress").write_text("0")  # a prism process (it runs a reporter)
    t0 = time.monotonic()
    lines = board.report([0], lambda ids: f"rank {ids[0]}", wait_s=5.0, stopped={0})
    assert time.monotonic() - t0 < 1.0
    assert lines == ["  rank 0: stopped (SIGSTOP: switch mode's turn, or a debugger)"], lines
