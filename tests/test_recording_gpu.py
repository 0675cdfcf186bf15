"""The recording backend on GPUs (NCCL, device-side timing). Run on the device machine:
``pytest -m gpu tests/test_recording_gpu.py`` (torch 2.11 there; most tests need 2 GPUs)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from test_recording import PROGRAMS, Launch, check_structure, comm  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")

ENV = {"TORCH_NCCL_ENABLE_TIMING": "1"}


def _summary(log):
    lines = []
    for nd in log.nodes:
        if nd["kind"] == "compute":
            continue
        lines.append(
            f"{nd['index']:4d} it{nd['iteration']} {nd['op']:14s} {nd['api']:28s} "
            f"g={nd['group_name']} seq={nd['seq']} peer={nd['peer']} in={nd['in_bytes']} "
            f"coal={nd['coalesced']} async={nd['async_op']} wait={nd['wait_index']} "
            f"start={nd['start_ns'] % 10**9 / 1e3:.1f}us dur={nd['duration_ns'] / 1e3:.1f}us"
        )
    return "\n".join(lines)


@pytest.fixture(scope="module", params=["plain-init", "device-id"])
def smoke(request, tmp_path_factory):
    n = torch.cuda.device_count()
    tmp = tmp_path_factory.mktemp(request.param)
    args = ["--device-id"] if request.param == "device-id" else []
    launch = Launch(PROGRAMS / "nccl_smoke.py", n, tmp / "spool", args, env=ENV)
    launch.wait(timeout=150)
    return launch


@two_gpus
def test_nccl_smoke_records(smoke):
    res = smoke.ok()
    logs = smoke.logs()
    print("\n" + _summary(logs[0]))
    for r, log in enumerate(logs):
        assert f"NCCL OK {r}" in res[r][1]
        check_structure(log, cuda=True)
        # iteration 0 (collectives), 3 DDP steps, 2 FSDP2 steps
        assert len(log.iterations) == 6
        cs = comm(log)
        assert all(c["start_ns"] >= 0 and c["end_ns"] >= c["start_ns"] for c in cs)
        # NCCL's own durations (TORCH_NCCL_ENABLE_TIMING=1) for the device-side ops
        timed = [c for c in cs if c["op"] != "barrier" and c["dtype"] != "uint8"]
        assert sum(c["duration_ns"] > 0 for c in timed) >= 0.9 * len(timed)
        # the async 4 MB all_reduce overlapped a matmul: the compute span between its issue
        # and its wait is real device time
        ar = cs[1]
        assert ar["async_op"] and ar["in_bytes"] == 4 << 20
        mm = log.nodes[ar["index"] + 1]
        assert mm["kind"] == "compute" and mm["duration_ns"] > 0
        # batch_isend_irecv went through NCCL's coalescing: one batch id, waited on
        p2p = [c for c in cs if c["op"] in ("send", "recv") and c["coalesced"] >= 0]
        assert len(p2p) == 2 and p2p[0]["coalesced"] == p2p[1]["coalesced"]
        assert all(c["async_op"] and c["wait_index"] > c["index"] for c in p2p)
        ddp = [c for c in cs if 1 <= c["iteration"] <= 3 and c["op"] == "all_reduce"]
        assert {c["iteration"] for c in ddp} == {1, 2, 3}
        fs = [c for c in cs if c["iteration"] >= 4]
        assert {c["op"] for c in fs} >= {"all_gather", "reduce_scatter"}
        # a synchronous collective (torch 2.11's NCCL runs it on the program's stream and
        # returns no Work): the compute span after it starts where it ended, not at its issue
        nodes = log.nodes
        for a, b in zip(nodes, nodes[1:]):
            if a["kind"] == "comm" and not a["async_op"] and a["coalesced"] < 0 and b["kind"] == "compute":
                assert b["start_ns"] >= a["end_ns"] >= 0, (a, b)


@two_gpus
def test_iterations_device_times(smoke):
    for log in smoke.logs():
        its = log.iterations
        for it in its:
            assert 0 < it["start_ns"] < it["end_ns"]
        # steady DDP/FSDP2 iterations take milliseconds, not seconds
        assert all(it["end_ns"] - it["start_ns"] < 5e9 for it in its[2:])


@two_gpus
def test_solo_work_lifetimes_match_nccl(tmp_path):
    """What a Work keeps alive (and for how long) is ProcessGroupNCCL's in solo mode too:
    memory_allocated at each point of tests/programs/work_lifetimes.py equals the real run's
    (rank 0 and rank 1; real: 2 GPUs under NCCL, solo: each rank alone)."""
    from test_solo_backend import solo

    prog = PROGRAMS / "work_lifetimes.py"
    real = Launch(prog, 2, tmp_path / "real")
    res = real.wait(timeout=150)
    for r in (0, 1):
        assert res[r][0] == 0, res[r][1][-3000:]
        want = [ln for ln in res[r][1].splitlines() if ln.startswith("MEM ")]
        p = solo(prog, 2, r, [], tmp_path / f"solo{r}", env={"CUDA_VISIBLE_DEVICES": str(r)})
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
        got = [ln for ln in p.stdout.splitlines() if ln.startswith("MEM ")]
        assert len(want) == 8 and got == want, (want, got)


@pytest.mark.parametrize("native", ["1", "0"])
def test_premul_sum_keeps_its_factor(tmp_path, native):
    """NCCL's PREMUL_SUM is recorded with its factor, a float's and a device tensor's, by both
    recorders: the emulation replays the call with it. Two ranks share GPU 0."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import pyarrow.parquet as pq

    prism = str(Path(sys.executable).with_name("prism"))
    env = {**os.environ, "PRISM_NATIVE": native}
    p = subprocess.run([prism, "record", "--nproc", "2", "--devices", "cuda:0,0", "--out", str(tmp_path / "g"),
                        "--", str(PROGRAMS / "premul_sum.py")], capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "rank 0: [1.5, 1.5, 1.5, 1.5] [0.5, 0.5, 0.5, 0.5]" in p.stdout
    ops = [x for x in pq.read_table(tmp_path / "g" / "nodes.parquet").column("reduce_op").to_pylist() if x]
    assert ops == ["premul_sum:0.5", "premul_sum:0.25"] * 2


def test_nccl_leaves_the_same_memory_in_solo_capture(tmp_path):
    """What NCCL's calls leave allocated (its barrier's one-element tensor, kept by the group) is
    held by solo capture too: the allocated bytes after every call are the real run's."""
    import subprocess
    import sys
    from pathlib import Path

    prism = str(Path(sys.executable).with_name("prism"))
    program = str(PROGRAMS / "nccl_memory.py")
    lines = {}
    for name, argv in (("real", ["record", "--nproc", "2"]), ("solo", ["capture", "--world", "2", "--parallel", "2"])):
        p = subprocess.run([prism, *argv, "--devices", "cuda:0,0", "--out", str(tmp_path / name), "--", program],
                           capture_output=True, text=True, timeout=300)  # fmt: skip
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
        lines[name] = sorted(ln for ln in p.stdout.splitlines() if ln.startswith("rank "))
    assert len(lines["real"]) == 2 and "barrier=512" in lines["real"][0]
    assert lines["solo"] == lines["real"]
