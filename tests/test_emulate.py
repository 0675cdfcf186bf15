"""`prism emulate` on CPU, N = 2: one sandbox rank runs examples/gpt3d.py for real, the other
rank is virtual, played by one assistant process from the recorded graph and tensors.

Ground truth is the real 2-rank run of the same program and seed (`prism record
--save-tensors all,inputs`): gpt3d prints its losses on the last rank only, so with sandbox
{1} the emulated losses (and gradient norms) are compared with the real ones; with sandbox {0}
(TP rank 0, which prints nothing) every pruned collective's output on the sandbox is compared
with what rank 0 received in the real run (`--check`). Both must agree to float tolerance
(with k = 1 real member of n = 2 they are in fact bit-exact: a sum of two terms does not
depend on the order). Every child process must be gone when the run ends, however it ends.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest
from conftest import GPT3D, PRISM, gpt3d_sizes
from listeners import is_loopback

from prismllm.emulate import EmulateOptions, emulate
from prismllm.errors import ExitCode, PrismError
from prismllm.specs import parse_ranks

ROOT = Path(__file__).resolve().parents[1]
SIZES = gpt3d_sizes(global_batch=4, iters=3)
LAYOUTS = {"tp2": ["--tp", "2"], "pp2": ["--pp", "2"], "dp2_distopt": ["--dist-opt"]}
RTOL = 1e-5


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, IndexError):
        return False


def assert_all_ended(pids) -> None:
    deadline = time.monotonic() + 5
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if pid_alive(p)]
        time.sleep(0.05)
    assert not alive, f"processes left behind: {alive}"


# an emulation's seconds before it counts as hung: ~15 s alone; a sandbox on a 2-core machine
# shared with three other torch processes had not started its program after 120 s
TIMEOUT = 300


def run_emulation(graph: Path, out: Path, layout: str, sandbox: str, **kw):
    log = out.with_suffix(".json")
    res = emulate(
        EmulateOptions(
            graph=graph,
            sandbox=sandbox,
            out=out,
            script=GPT3D,
            args=[*LAYOUTS[layout], *SIZES, "--json-log", str(log)],
            timeout=TIMEOUT,
            check=True,
            sink=lambda *a: None,
            **kw,
        )
    )
    assert_all_ended(res.launch.pids.values())
    return res, (json.loads(log.read_text()) if log.exists() else None)


def assert_check(res, rank: int, graph: Path, sandbox: tuple = ()) -> None:
    """--check: every output-bearing pruned call of ``rank`` compared, none left unfinished."""
    c = res.checks[rank]
    assert c["compared"] == comm_outputs(graph, rank, pruned_only=True, sandbox=sandbox), c
    assert c["missing"] == 0 and c["unfinished"] == 0 and c["errors"] == 0, c
    assert c["max_rel_diff"] <= RTOL, c


def assert_same_losses(real: list[dict], emu: list[dict]) -> None:
    assert [r["iteration"] for r in emu] == [r["iteration"] for r in real]
    for a, b in zip(real, emu):
        assert b["loss"] == pytest.approx(a["loss"], rel=RTOL), (a, b)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=RTOL), (a, b)


def comm_outputs(graph: Path, rank: int, pruned_only: bool = False, sandbox: tuple = ()) -> int:
    """How many collective calls of ``rank`` have an output (what --check compares: the calls
    on groups with a virtual member; every group of ``rank`` has one at N = 2)."""
    from prismllm.trace import PrismTrace

    t = PrismTrace.load(graph)
    real = set(sandbox or (rank,))
    pruned = {gid for gid, g in t.group_info().items() if not set(g["ranks"]) <= real}
    rows = t.nodes.select(["rank", "kind", "op", "group"]).to_pylist()
    return sum(
        1
        for r in rows
        if r["rank"] == rank and r["kind"] == "comm" and r["op"] != "send" and (not pruned_only or r["group"] in pruned)
    )


def shared_record(gpt3d_recording, layout: str, nproc: int = 2) -> tuple[Path, list[dict]]:
    """(graph, the JSON log's rows) of the real run of ``layout`` saving tensors, from the
    session's shared recordings (conftest.gpt3d_recording): the 2-rank TP2 one is
    test_emulate_faults' too, the 2-rank PP2 one test_emulate_realtime's, the 4-rank one
    test_emulate_assistants'."""
    rec = gpt3d_recording(nproc, [*LAYOUTS[layout], *SIZES], save_tensors="all,inputs")
    return rec.out, rec.log


@pytest.fixture(scope="module")
def tp2(gpt3d_recording):
    return shared_record(gpt3d_recording, "tp2")


def test_a_recording_listens_on_loopback_only(tp2, gpt3d_recording):
    """`prism record`'s processes (the launcher's store, the ranks' gloo pairs), sampled as `ss
    -ltnp` would show them during the run: loopback alone."""
    rec = gpt3d_recording(2, [*LAYOUTS["tp2"], *SIZES], save_tensors="all,inputs")
    assert any("gpt3d.py" in name for _, _, name in rec.listeners), rec.listeners
    assert not [s for s in rec.listeners if not is_loopback(s[0])], sorted(rec.listeners)


def test_parse_ranks():
    assert parse_ranks("1") == (1,)
    assert parse_ranks("3,0-1, 1") == (0, 1, 3)
    for bad in ("", "a", "2-1", "-1"):
        with pytest.raises(ValueError):
            parse_ranks(bad)


def test_tp2_sandbox_last_rank_losses_equal_the_real_run(tp2, tmp_path):
    graph, real = tp2
    res, emu = run_emulation(graph, tmp_path / "emu", "tp2", "1")
    assert res.returncodes == {1: 0} and res.launch.returncodes[-1] == 0  # rank 1 and the assistant
    assert emu is not None, "the sandbox (last rank) writes the loss log"
    assert_same_losses(real, emu)
    assert_check(res, 1, graph)
    info = json.loads((tmp_path / "emu" / "emulate.json").read_text())
    assert info["ok"] and info["world_size"] == 2 and info["sandbox"] == [1]
    assert (tmp_path / "emu" / "ranklogs" / "rank-000001.msgpack").exists()


def test_tp2_sandbox_first_rank_sees_what_it_saw_in_the_real_run(tp2, tmp_path):
    """Rank 0 is the broadcast root of the token ids and prints nothing: check its outputs."""
    graph, _ = tp2
    res, emu = run_emulation(graph, tmp_path / "emu", "tp2", "0")
    assert res.returncodes == {0: 0} and emu is None
    assert comm_outputs(graph, 0) > 100
    assert_check(res, 0, graph)


def test_check_fails_when_an_output_differs_from_the_recording(tp2, tmp_path, capsys, monkeypatch):
    """The sandbox runs the recorded program with other weights (--seed 7; PRISM_PROGRAM_CHECK=off
    lets the other argument through): every sum with the virtual rank's recorded input differs
    from the recording, and --check ends `prism emulate` with exit 1 and one line naming the
    rank, the call and the difference."""
    from prismllm.cli.main import main

    graph, _ = tp2
    monkeypatch.setenv("PRISM_PROGRAM_CHECK", "off")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "emu"
    argv = ["emulate", "--graph", str(graph), "--sandbox", "1", "--out", str(out), "--check", "--timeout", "120"]
    rc = main([*argv, "--", GPT3D, *LAYOUTS["tp2"], *SIZES, "--seed", "7"])
    err = capsys.readouterr().err
    assert rc == ExitCode.FAILED, err
    last = err.strip().splitlines()[-1]
    assert re.fullmatch(
        r"prism emulate: error: --check: sandbox rank 1: \w+ #\d+ on group \S+ \[0, 1\] differs from the "
        r"recording: max abs diff \S+, relative \S+ \(rounding allows \S+\)(; \d+ other call\(s\) differ too)?",
        last,
    ), last
    assert "Traceback" not in err
    info = json.loads((out / "emulate.json").read_text())
    assert info["outcome"] == "check_failed" and not info["ok"] and info["message"] == last.split("error: ", 1)[1]
    assert info["returncodes"] == {"1": 0}  # the program itself ended well


def test_a_difference_beyond_rounding_is_one_and_rounding_is_not():
    """What --check counts as a difference: anything in an exact type, a NaN or infinity that the
    recording does not have, or more than rounding_tolerance on floats."""
    import math

    import torch

    from prismllm.comm.sandbox import difference, rounding_tolerance

    rec = torch.tensor([1.0, -2.0, 4.0])
    assert difference(rec.clone(), rec) == (0.0, 0.0)
    ulp = torch.tensor([1.0, -2.0, 4.0 + 4 * torch.finfo(torch.float32).eps])
    d, r = difference(ulp, rec)
    assert 0 < r <= rounding_tolerance(torch.float32, 2)
    assert difference(torch.tensor([1.0, -2.0, 4.5]), rec)[1] > rounding_tolerance(torch.float32, 2)
    assert difference(torch.tensor([1.0, float("nan"), 4.0]), rec) == (math.inf, math.inf)
    nan = torch.tensor([float("nan"), 1.0])
    assert difference(nan.clone(), nan) == (0.0, 0.0)  # NaN where the recording has one
    assert difference(torch.tensor([1, 2]), torch.tensor([1, 3])) == (math.inf, math.inf)
    assert difference(rec[:2], rec) == (math.inf, math.inf)
    assert rounding_tolerance(torch.int64, 8) == 0.0
    # the bounds test_emulate_n8 accepts: 1e-5 for MoE's DP sums of 4 terms, 1.27e-5 seen of 16 at N = 32
    assert rounding_tolerance(torch.float32, 4) > 1e-5 and rounding_tolerance(torch.float32, 16) > 2 * 1.27e-5


def test_assistant_failure_ends_the_sandbox_with_one_clear_line(tp2, tmp_path, capsys):
    """The virtual rank's inputs are missing: the assistant fails, the launcher ends the
    sandbox rank, `prism emulate` reports the assistant's own error in one line."""
    from prismllm.cli.main import main

    graph, _ = tp2
    partial = tmp_path / "tensors"
    partial.mkdir()
    for f in (graph / "tensors").glob("rank-000001.*"):
        shutil.copy(f, partial / f.name)
    rc = main(
        [
            "emulate",
            "--graph",
            str(graph),
            "--tensors",
            str(partial),
            "--sandbox",
            "1",
            "--out",
            str(tmp_path / "emu"),
            "--timeout",
            "120",
            "--",
            GPT3D,
            *LAYOUTS["tp2"],
            *SIZES,
        ]
    )
    assert rc == ExitCode.FAILED
    err = capsys.readouterr().err
    first = next(ln for ln in err.splitlines() if ln.startswith("prism emulate: error:"))
    assert first.startswith("prism emulate: error: assistant exited with code 1: no recorded input for rank 0 node"), (
        err
    )
    info = json.loads((tmp_path / "emu" / "emulate.json").read_text())
    assert not info["ok"] and info["assistant_returncode"] == 1
    assert info["returncodes"]["1"] != 0  # ended by the launcher


def test_bad_sandbox_is_refused_before_anything_runs(tp2, tmp_path):
    graph, _ = tp2
    for bad, msg in (("2", "ranks must be in 0..1"), ("0-1", "every rank is in the sandbox")):
        with pytest.raises(PrismError, match=msg):
            emulate(EmulateOptions(graph=graph, sandbox=bad, out=tmp_path / bad, script=GPT3D))
    with pytest.raises(PrismError, match="no recorded tensors"):
        emulate(
            EmulateOptions(graph=graph, sandbox="1", out=tmp_path / "t", script=GPT3D, tensors=tmp_path / "nothing")
        )


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["pp2", "dp2_distopt"])
def test_other_layouts_sandbox_last_rank_losses_equal_the_real_run(layout, tmp_path, gpt3d_recording):
    graph, real = shared_record(gpt3d_recording, layout)
    res, emu = run_emulation(graph, tmp_path / "emu1", layout, "1")
    assert_same_losses(real, emu)
    assert_check(res, 1, graph)
    res, _ = run_emulation(graph, tmp_path / "emu0", layout, "0")
    assert_check(res, 0, graph)


@pytest.mark.parametrize("layout", ["pp2", "dp2_distopt"])
def test_the_issue_thread_keeps_every_value_and_the_order(layout, tmp_path, gpt3d_recording, monkeypatch):
    """PRISM_ISSUE_THREAD (here ``all``: the CPU's gloo calls too): the asynchronous pruned
    calls (the pipeline's isend/irecv, the distributed optimizer's) are planned and issued on a
    thread of their own, calls on the program's thread wait for it: the same losses as the real
    run, every output as recorded, and the calls were indeed issued off the program's thread."""
    graph, real = shared_record(gpt3d_recording, layout)
    monkeypatch.setenv("PRISM_ISSUE_THREAD", "all")
    res, emu = run_emulation(graph, tmp_path / "emu", layout, "1")
    assert_same_losses(real, emu)
    assert_check(res, 1, graph)
    info = json.loads((tmp_path / "emu" / "emulate.json").read_text())
    assert info["sandbox_results"]["1"]["emulation_calls_off_thread"] > 0


@pytest.mark.parametrize("layout", ["tp2", "pp2", "dp2_distopt"])
def test_the_native_lane_keeps_every_value(layout, tmp_path, gpt3d_recording, monkeypatch):
    """PRISM_NATIVE_LANE=1: the sandbox records natively and its pruned groups run the native
    lane (prismllm/comm/native/pruned_lane.h): the same losses as the real run, the calls after
    the first of each signature issued from a template with no Python on the way, the others by
    the Python backend; the emulated rank's graph has every call of the recorded one."""
    graph, real = shared_record(gpt3d_recording, layout)
    monkeypatch.setenv("PRISM_NATIVE_LANE", "1")
    out = tmp_path / "emu"
    log = out.with_suffix(".json")
    res = emulate(
        EmulateOptions(
            graph=graph, sandbox="1", out=out, script=GPT3D,
            args=[*LAYOUTS[layout], *SIZES, "--json-log", str(log)], timeout=TIMEOUT, sink=lambda *a: None,
        )
    )  # fmt: skip
    assert_all_ended(res.launch.pids.values())
    assert_same_losses(real, json.loads(log.read_text()))
    lane = json.loads((out / "emulate.json").read_text())["sandbox_results"]["1"]["emulation_native_lane"]
    assert lane["fast"] > 0 and lane["python"] > 0, lane
    assert 0 < lane["fast_issue_ns"] < lane["fast_ns"], lane  # the small calls' part of the lane's time
    from prismllm.trace import PrismTrace
    from prismllm.trace.ranklog import ranklog_path, read_ranklog

    rows = PrismTrace.load(graph).nodes.select(["rank", "kind", "op", "in_bytes", "out_bytes"]).to_pylist()
    recorded = [(r["op"], r["in_bytes"], r["out_bytes"]) for r in rows if r["rank"] == 1 and r["kind"] == "comm"]
    emulated = read_ranklog(ranklog_path(out / "ranklogs", 1)).nodes
    assert [(r["op"], r["in_bytes"], r["out_bytes"]) for r in emulated if r["kind"] == "comm"] == recorded


@pytest.mark.slow
def test_n4_two_sandbox_ranks(tmp_path, gpt3d_recording):
    """TP2 x DP2 at N = 4 with two sandbox processes: {2, 3} holds a whole TP group (a real
    gloo group of the two) and the reporting rank; {1, 2} splits both TP groups and both DP
    groups (k = 1 of 2) and the default group (k = 2 of 4)."""
    graph, real = shared_record(gpt3d_recording, "tp2", nproc=4)
    res, emu = run_emulation(graph, tmp_path / "emu23", "tp2", "2,3")
    assert res.returncodes == {2: 0, 3: 0}
    assert_same_losses(real, emu)
    for r in (2, 3):
        assert_check(res, r, graph, sandbox=(2, 3))
    res, _ = run_emulation(graph, tmp_path / "emu12", "tp2", "1,2")
    for r in (1, 2):
        assert_check(res, r, graph, sandbox=(1, 2))


def test_two_invocations_meet_at_one_endpoint(tp2, tmp_path):
    """Multi-host, on one machine: one `prism emulate --role sandbox` (it hosts the store, behind
    a gate at the endpoint) and one `--role assistant` (started first: it waits for the store), as
    two hosts would run them, sharing a token; the emulated losses equal the real run's. A client
    without the token that reaches the endpoint meanwhile is closed unserved and reported; without
    a token the run is refused before anything starts."""
    import socket

    graph, real = tp2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "emu.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PRISM_RDZV_TOKEN", None)
    common = ["--graph", str(graph), "--sandbox", "1", "--rdzv-endpoint", f"127.0.0.1:{port}", "--timeout", "60"]
    program = ["--", GPT3D, *LAYOUTS["tp2"], *SIZES, "--json-log", str(log)]  # the same command on every host
    p = subprocess.run(
        [PRISM, "emulate", *common, "--role", "sandbox", "--out", str(tmp_path / "x"), *program],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert p.returncode == ExitCode.USAGE and "needs a shared token" in p.stderr, p.stderr
    token = tmp_path / "token"
    token.write_text("0123456789abcdef0123456789abcdef\n")
    token.chmod(0o600)
    common += ["--rdzv-token-file", str(token)]
    assistant = subprocess.Popen(
        [PRISM, "emulate", *common, "--role", "assistant", "--out", str(tmp_path / "a"), *program],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        time.sleep(1.0)  # the assistant first: its store client waits for the server
        sandbox = subprocess.Popen(
            [PRISM, "emulate", *common, "--role", "sandbox", "--out", str(tmp_path / "s"), *program],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        deadline = time.monotonic() + 60
        while True:  # a stranger at the endpoint, as torch's store client would talk: nothing comes back
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                    s.sendall(b"\x00\x01\x02\x03\x04")
                    assert s.recv(1) == b""
                break
            except ConnectionRefusedError:
                assert time.monotonic() < deadline, "the endpoint never listened"
                time.sleep(0.1)
        s_out, s_err = sandbox.communicate(timeout=200)
        a_out, a_err = assistant.communicate(timeout=60)
    finally:
        for proc in (assistant, sandbox):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert sandbox.returncode == 0, s_err[-3000:]
    assert assistant.returncode == 0, a_err[-3000:]
    assert "replayed 1 virtual rank" in a_out + a_err
    assert re.search(
        r"^prism: refused a connection to the rendezvous store from 127\.0\.0\.1:\d+: .*no token", s_err, re.M
    )
    assert_same_losses(real, json.loads(log.read_text()))
    for d in ("a", "s"):
        assert_all_ended(
            [p for p in json.loads((tmp_path / d / "emulate.json").read_text())["pids"].values() if isinstance(p, int)]
        )


def test_gpu_lists_of_sandbox_and_assistants(monkeypatch):
    """--devices cuda gives each process its own GPU; cuda:G,... lists them (sandbox ranks, then
    assistants), a GPU listed twice being shared; a list that does not fit is refused."""
    import torch

    from prismllm.launch.sandbox import gpus_of
    from prismllm.specs import parse_devices
    from prismllm.time.slices import TimeOptions, _for_slice, slice_devices

    def _gpus(devices: str, n_sandbox: int, n_assistants: int):
        return gpus_of(parse_devices(devices), n_sandbox, n_assistants)

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert _gpus("cpu", 1, 1) == ([], [])
    assert _gpus("cuda:0,0", 1, 1) == ([0], [0])
    with pytest.raises(PrismError, match=r"need 2 GPU\(s\), 1 visible .*cuda:0,0"):
        _gpus("cuda", 1, 1)
    with pytest.raises(PrismError, match="1 GPU\\(s\\) listed for 1 sandbox rank\\(s\\) and 1 assistant"):
        _gpus("cuda:0", 1, 1)
    with pytest.raises(PrismError, match="GPU 1 does not exist"):
        _gpus("cuda:0,1", 1, 1)
    # a longer list is a pool: prism run hands capture, time and emulate the same --devices
    assert _gpus("cuda:0,0,0,0", 1, 1) == ([0], [0])
    (a, b) = slice_devices(TimeOptions(graph="g", out="o", script="s", args=[], devices="cuda:0,0,0,0,0"), 2)
    assert a.text == b.text == "cuda:0,0"
    (one,) = slice_devices(TimeOptions(graph="g", out="o", script="s", args=[], devices="cuda:0,0,0,0"), 1)
    assert one.text == "cuda:0,0"
    # prism time: a listed slice of 2 sandbox GPUs and the assistant's; a short last slice
    opts = TimeOptions(graph="g", out="o", script="s", args=[], devices="cuda:0,1,0", slice_size=2)
    (dev,) = slice_devices(opts, 1)
    assert dev.text == "cuda:0,1,0" and _for_slice(dev, 2, 1).text == "cuda:0,0"
    with pytest.raises(PrismError, match="a slice is 2 sandbox GPU"):
        slice_devices(TimeOptions(graph="g", out="o", script="s", args=[], devices="cuda:0,0", slice_size=2), 1)
    # auto: a GPU each when there are enough, else the one GPU shared
    assert [d.text for d in slice_devices(dataclasses.replace(opts, devices="auto", slice_size=1), 1)] == ["cuda:0,0"]


@pytest.mark.slow
def test_solo_captured_graph_with_the_recorded_runs_tensors(tmp_path, gpt3d_recording):
    """The pipeline's pairing: the graph from a solo capture (DP replicas captured once, their
    groups named after the representative's, e.g. ``3@1``) with the tensors of a real recording
    (groups named as torch names them). TP2·DP2 at N = 4, sandbox {3}: the virtual ranks 0-2
    include a replica (2), whose inputs must still be found; the losses are the real run's."""
    real_graph, real = shared_record(gpt3d_recording, "tp2", nproc=4)
    bare = tmp_path / "bare"
    proc = subprocess.run(
        [
            PRISM,
            "capture",
            "--mode",
            "solo",
            "--world",
            "4",
            "--devices",
            "cpu",
            "--parallel",
            "2",
            "--layout",
            "tp=2",
            "--out",
            str(bare),
            "--",
            GPT3D,
            *LAYOUTS["tp2"],
            *SIZES,
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res, emu = run_emulation(bare, tmp_path / "emu", "tp2", "3", tensors=real_graph / "tensors")
    assert_same_losses(real, emu)
    assert res.checks[3]["compared"] > 0 and res.checks[3]["missing"] == 0, res.checks[3]


def test_a_pruned_works_duration_is_its_small_calls_device_time():
    """On NCCL the recorder reads an async call's transfer from ``Work._get_duration`` (NCCL's
    own events); a pruned call answers with its small calls' (one after the other on one stream:
    their sum), so that a GPU slice measures pruned transfers as a recording measures real ones.
    A small Work without timing raises, as NCCL's does, and the recorder then reads none."""
    from prismllm.comm.sandbox import PrunedWork

    class Small:
        def __init__(self, ms):
            self.ms = ms

        def _get_duration(self):
            if self.ms is None:
                raise RuntimeError("TORCH_NCCL_ENABLE_TIMING is not set")
            return self.ms

    assert PrunedWork([Small(0.25), Small(0.5)], [], [])._get_duration() == 0.75
    with pytest.raises(RuntimeError):
        PrunedWork([Small(None)], [], [])._get_duration()


def test_the_issue_thread_holds_no_call_once_it_is_issued():
    """The issue thread's job for a call holds the program's tensors (the call's plan is made
    there); once the call is issued nothing of it may stay on the thread, or a tensor the program
    dropped lives on until the next call and the sandbox's peak memory is no longer the real
    run's (a GPU run's gradient shard: +64,000 B)."""
    import weakref

    import torch

    from prismllm.comm.sandbox import IssueThread, PrunedWork

    issue = IssueThread()
    tensor = torch.ones(16)
    gone = weakref.ref(tensor)
    work = PrunedWork((), (), [], (), issued=False)
    issue.submit(work, lambda t=tensor: ((), (), ()))
    del tensor
    issue.drain()
    work.wait()
    deadline = time.monotonic() + 5
    while gone() is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert gone() is None, "the issue thread still holds the call's tensor after issuing it"


def test_the_issue_thread_sets_a_stream_only_when_it_changes(monkeypatch):
    """The issue thread runs nothing but the jobs, so the group's stream stays current on it
    between calls: a run of calls on one group sets it once (entering and leaving a device and a
    stream context around every call cost ~60 µs of an H100 host's time a call, on autograd's
    heels in DDP's backward), and a call on another group's stream sets that one."""
    import torch

    from prismllm.comm.sandbox import IssueThread, PrunedWork

    seen = []
    monkeypatch.setattr(torch.cuda, "set_stream", lambda s: seen.append((s, threading.current_thread().name)))
    issue = IssueThread()
    a, b = object(), object()
    for stream in (a, a, a, b, b, a):
        issue.submit(PrunedWork((), (), [], (), issued=False), lambda s=stream: (issue.use_stream(s), ((), (), ()))[1])
    issue.drain()
    assert [s for s, _ in seen] == [a, b, a], seen
    assert {name for _, name in seen} == {"prism-issue"}, "set on the issue thread, never the program's"


def test_the_dp_replicas_copies_move_with_the_generic_world(tmp_path, gpt3d_recording):
    """Pure DP at N = 4 from a solo capture (one rank run, three copies), sandbox {3}: the
    assistant replays rank 3's world's virtual ranks (none) and the generic one's (rank 0), and
    leaves ranks 1 and 2 out, copies of rank 0 that move with it (prismllm.replay.mirror); the
    pruned all-reduces still take every virtual member's recorded input: the losses are the
    real run's."""
    rec = gpt3d_recording(4, [*SIZES], save_tensors="all,inputs")
    bare = tmp_path / "bare"
    argv = ["capture", "--mode", "solo", "--world", "4", "--devices", "cpu", "--layout", "tp=1", "--out", str(bare)]
    proc = subprocess.run([PRISM, *argv, "--", GPT3D, *SIZES], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = tmp_path / "emu.json"
    res = emulate(
        EmulateOptions(graph=bare, sandbox="3", out=tmp_path / "emu", script=GPT3D, tensors=rec.out / "tensors",
                       args=[*SIZES, "--json-log", str(log)], timeout=TIMEOUT, check=True, sink=lambda *a: None)
    )  # fmt: skip
    assert_all_ended(res.launch.pids.values())
    replay = json.loads((tmp_path / "emu" / "replay.json").read_text())
    assert (replay["virtual_ranks"], replay["replayed_ranks"]) == (3, 1), replay
    assert_same_losses(rec.log, json.loads(log.read_text()))
    assert res.checks[3]["compared"] > 0 and res.checks[3]["missing"] == 0, res.checks[3]
