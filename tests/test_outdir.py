"""One writer per output directory, a full disk said in one line, and temporary directories that
never outlive a run (prismllm.outdir, the launcher's storage errors and clean-up).

The holders are small Python processes that take a directory's lock the way every command does
(``writing``) and wait; the writers they refuse are real `prism` commands. Two real `prism record`
runs on one directory check the whole path once; a full disk is a small tmpfs where an
unprivileged mount namespace can make one (``unshare -rm``), else a write made to fail in-process.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from prismllm import outdir
from prismllm.childenv import read_error, variable
from prismllm.cli.main import main
from prismllm.errors import ExitCode, OutputBusy, StorageError
from prismllm.launch import LaunchSpec, launch
from prismllm.outdir import lock_path, writing
from prismllm.trace.synth import example_logs

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}

HOLDER = """
import sys, time
from prismllm.outdir import writing
with writing(sys.argv[1]):
    print("held", flush=True)
    time.sleep(60)
"""


@pytest.fixture
def holder(tmp_path):
    """``hold(DIR) -> Popen``: a process that holds DIR's lock until it is ended."""
    script = tmp_path / "holder.py"
    script.write_text(HOLDER)
    procs = []

    def hold(directory: Path) -> subprocess.Popen:
        p = subprocess.Popen([PY, str(script), str(directory)], stdout=subprocess.PIPE, text=True, env=ENV)
        procs.append(p)
        assert p.stdout.readline().strip() == "held"
        return p

    yield hold
    for p in procs:
        p.kill()
        p.wait()


def graph(tmp_path: Path) -> Path:
    """A small timed graph (prismllm.trace.synth), saved."""
    from prismllm.trace.assemble import assemble

    path = tmp_path / "graph"
    assemble(example_logs(), {"mode": "record", "command": ["test"]}).save(path)
    return path


def one_line_error(capsys, command: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"prism {command}: error: "), err
    return err[0]


# ---------------------------------------------------------------------------------------------
# one writer


def test_a_live_writer_refuses_every_other_at_once_even_with_force(tmp_path, holder, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "run.json").write_text(json.dumps({"job": {}, "stages": []}))  # a run --force would replace
    h = holder(out)
    t0 = time.monotonic()
    argv = ["run", "--world", "2", "--devices", "cpu", "--out", str(out), "--", str(ROOT / "examples" / "gpt3d.py")]
    for extra in ([], ["--force"]):
        assert main([*argv[:-2], *extra, *argv[-2:]]) == 2
        line = one_line_error(capsys, "run")
        assert f"{out} is being written by another prism run (pid {h.pid} on " in line
        assert "wait for it to end or choose another --out" in line
    # a directory inside it, or one around it, is another run's too
    assert main(["calibrate", str(graph(tmp_path)), "--out", str(out / "cal")]) == 2
    assert f"{out}, which holds {out / 'cal'}, is being written" in one_line_error(capsys, "calibrate")
    assert main(["calibrate", str(tmp_path / "graph"), "--out", str(tmp_path)]) == 2
    assert f"{out}, inside {tmp_path}, is being written" in one_line_error(capsys, "calibrate")
    assert time.monotonic() - t0 < 30  # refused at once: nothing ran
    assert (out / "run.json").is_file() and not (out / "cal").exists()  # --force deleted nothing
    assert json.loads(lock_path(out).read_text())["pid"] == h.pid


def test_a_lock_whose_holder_died_is_taken_over_silently(tmp_path, holder):
    out = tmp_path / "out"
    h = holder(out)
    h.kill()
    h.wait()
    assert json.loads(lock_path(out).read_text())["pid"] == h.pid  # the file stays, the flock went with it
    with writing(out):
        assert json.loads(lock_path(out).read_text())["pid"] == os.getpid()
    assert not lock_path(out).exists()  # released: nothing left beside the directory


def test_stages_called_inside_a_writer_share_its_lock(tmp_path):
    out = tmp_path / "out"
    with writing(out):
        with writing(out), writing(out / "cal"), writing(out / "time" / "load"):
            assert not lock_path(out / "cal").exists()  # no second lock: the caller's covers them
        assert lock_path(out).exists()
    assert not lock_path(out).exists()


def test_without_flock_the_pid_in_the_lock_file_decides(tmp_path, holder, monkeypatch):
    """A file system without locks (Lustre without -o flock): a live holder on this host refuses,
    a dead one is stale."""
    out = tmp_path / "out"
    h = holder(out)

    def no_flock(fd, op):
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))

    monkeypatch.setattr(outdir.fcntl, "flock", no_flock)
    with pytest.raises(OutputBusy, match=f"pid {h.pid} on "):
        with writing(out):
            pass
    h.kill()
    h.wait()
    with writing(out):
        assert json.loads(lock_path(out).read_text())["pid"] == os.getpid()


# a program of one all_reduce that ends once the file it is given exists
TINY = """
import os, sys, time
import torch.distributed as dist
dist.init_process_group("gloo")
import torch
t = torch.ones(4)
dist.all_reduce(t)
deadline = time.monotonic() + 60
while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
    time.sleep(0.05)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_two_records_on_one_directory_the_second_refused_the_first_completes(tmp_path):
    script = tmp_path / "tiny.py"
    script.write_text(TINY)
    out = tmp_path / "rec"
    cmd = [PY, "-m", "prismllm.cli.main", "record", "--nproc", "1", "--devices", "cpu", "--out", str(out)]
    go = tmp_path / "go"
    first = subprocess.Popen(
        [*cmd, "--", str(script), str(go)], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + 60
    while not lock_path(out).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    for extra in ([], ["--force"]):
        second = subprocess.run([*cmd, *extra, "--", str(script), str(go)], env=ENV, capture_output=True, text=True)
        assert second.returncode == 2
        assert second.stderr.strip() == (
            f"prism record: error: {out} is being written by another prism run (pid {first.pid} on "
            f"{json.loads(lock_path(out).read_text())['host']}, since "
            f"{json.loads(lock_path(out).read_text())['started']}); wait for it to end or choose another --out"
        )
    go.touch()
    _, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    assert (out / "manifest.json").is_file() and not lock_path(out).exists()


# ---------------------------------------------------------------------------------------------
# an output directory that holds something


def test_calibrate_replaces_an_earlier_calibration_only_with_force_and_nothing_else(tmp_path, capsys):
    g, cal = graph(tmp_path), tmp_path / "cal"
    assert main(["calibrate", str(g), "--out", str(cal)]) == 0
    capsys.readouterr()
    assert main(["calibrate", str(g), "--out", str(cal)]) == ExitCode.USAGE
    assert f"output directory {cal} exists and is not empty (use --force" in one_line_error(capsys, "calibrate")
    assert main(["calibrate", str(g), "--out", str(cal), "--force", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["predicted_iteration_ns"] > 0
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    assert main(["calibrate", str(g), "--out", str(other), "--force"]) == ExitCode.USAGE
    assert "holds no calibration; refusing to delete it even with --force" in one_line_error(capsys, "calibrate")
    assert (other / "notes.txt").read_text() == "mine"


# ---------------------------------------------------------------------------------------------
# a full disk


def test_a_full_disk_in_a_stage_is_one_line_and_keeps_what_was_there(tmp_path, monkeypatch, capsys):
    g = graph(tmp_path)
    before = sorted(p.name for p in g.iterdir())
    cal = tmp_path / "cal"

    def full(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr("prismllm.calibrate.report.pq.write_table", full)
    assert main(["calibrate", str(g), "--out", str(cal), "--write-graph"]) == ExitCode.ENVIRONMENT
    line = one_line_error(capsys, "calibrate")
    assert f"error: {cal}: No space left on device (" in line and " free on its file system); " in line
    assert f"{cal} is left incomplete, earlier outputs are kept: make room" in line
    assert sorted(p.name for p in g.iterdir()) == before  # the input graph, untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["graph"]  # no half calibration, no lock file
    monkeypatch.undo()
    assert main(["calibrate", str(g), "--out", str(cal)]) == 0  # with room: the same command completes


def test_a_child_that_hits_a_full_disk_is_named_with_the_path(tmp_path):
    """The launcher names the rank and the path (its ChildError), not a traceback."""
    script = tmp_path / "save.py"
    script.write_text(f"import errno, os\nraise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), {str(tmp_path)!r})\n")
    with pytest.raises(StorageError) as e:
        launch(LaunchSpec(nproc=1, script=str(script), devices="cpu", passthrough=False))
    assert str(e.value).startswith(f"rank 0: {tmp_path}: No space left on device (")
    assert str(e.value).endswith(" free on its file system)") and "\n" not in str(e.value)


def test_a_rank_log_lost_to_a_full_disk_fails_the_rank_and_says_where(tmp_path, monkeypatch):
    """A program that ended well but whose rank log could not be written exits 3 and tells the
    launcher why, instead of "exited normally but wrote no rank log"."""
    from prismllm.comm import bootstrap, install, recording_work
    from prismllm.trace import ranklog

    err_file = tmp_path / "error.json"
    monkeypatch.setenv(variable("error_file"), str(err_file))
    monkeypatch.setattr(install, "collect", lambda rec: None)
    monkeypatch.setattr(recording_work, "hold_to_the_end", lambda groups: None)

    def full(spool, log):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(ranklog, "write_ranklog", full)
    rec = type("Rec", (), {"groups": [], "finish": lambda self: None})()
    flush = bootstrap._Flusher(rec, str(tmp_path / "spool"))
    flush()
    assert flush.lost
    err = read_error(err_file)
    assert err.kind == "storage" and err.message.startswith(f"{tmp_path / 'spool'}: No space left on device (")


def _can_mount_tmpfs() -> bool:
    if shutil.which("unshare") is None:
        return False
    p = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=4k tmpfs /mnt"], capture_output=True)
    return p.returncode == 0


# a 12 KiB tmpfs: too small for a recording, whatever write fills it (the rank log, a table)
FULL_DISK = """
set -u
mount -t tmpfs -o size=12k tmpfs "$1"
"$2" -m prismllm.cli.main record --nproc 1 --devices cpu --out "$1/rec" -- "$3" "$4" 2>"$1.err"
echo "full rc=$?"
mount -o remount,size=4m "$1"
"$2" -m prismllm.cli.main record --nproc 1 --devices cpu --out "$1/rec" --force -- "$3" "$4" >/dev/null 2>&1
echo "room rc=$?"
echo "left: $(ls -A "$1")"
"""


@pytest.mark.slow
@pytest.mark.skipif(not _can_mount_tmpfs(), reason="no unprivileged mount namespace to make a small tmpfs in")
def test_a_real_full_disk_in_prism_record(tmp_path):
    script = tmp_path / "tiny.py"
    script.write_text(TINY)
    (tmp_path / "small").mkdir()
    p = subprocess.run(
        ["unshare", "-rm", "sh", "-c", FULL_DISK, "sh", str(tmp_path / "small"), PY, str(script), str(script)],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    err = (tmp_path / "small.err").read_text()
    assert p.stdout.splitlines() == ["full rc=4", "room rc=0", "left: rec"], p.stdout + p.stderr + err
    last = err.strip().splitlines()[-1]
    assert last.startswith("prism record: error: ") and "No space left on device" in last, err
    assert f"{tmp_path / 'small' / 'rec'} is left incomplete" in last and "Traceback" not in err


# ---------------------------------------------------------------------------------------------
# temporary directories


SIGTERMED = """
import sys, tempfile, time
from prismllm.outdir import writing
with writing(sys.argv[1]):
    tmp = tempfile.mkdtemp(prefix="prism-test-")
    try:
        print("ready", flush=True)
        time.sleep(60)
    finally:
        __import__("shutil").rmtree(tmp)
"""


def test_sigterm_ends_a_writer_through_its_clean_up(tmp_path):
    script = tmp_path / "writer.py"
    script.write_text(SIGTERMED)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    p = subprocess.Popen(
        [PY, str(script), str(tmp_path / "out")], env={**ENV, "TMPDIR": str(tmp)}, stdout=subprocess.PIPE, text=True
    )
    assert p.stdout.readline().strip() == "ready"
    assert list(tmp.iterdir()) and lock_path(tmp_path / "out").exists()
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) == 128 + signal.SIGTERM
    assert list(tmp.iterdir()) == [] and not lock_path(tmp_path / "out").exists()


def test_a_launcher_killed_with_sigkill_leaves_no_temporary_directory(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    rank = tmp_path / "rank.py"
    rank.write_text("import time; print('up', flush=True); time.sleep(60)\n")
    driver = tmp_path / "driver.py"
    driver.write_text(
        textwrap.dedent(f"""
        from prismllm.launch import LaunchSpec, launch
        launch(LaunchSpec(nproc=2, script={str(rank)!r}, runner=None, devices="cpu"))
        """)
    )
    p = subprocess.Popen([PY, str(driver)], env={**ENV, "TMPDIR": str(tmp)}, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "up"
    assert {d.name.rsplit("-", 1)[0] for d in tmp.iterdir()} == {"prism-launch", "prism-status"}
    p.kill()
    p.wait()
    deadline = time.monotonic() + 15  # the launcher's watchdog ends the ranks, then removes them
    while list(tmp.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert list(tmp.iterdir()) == []
