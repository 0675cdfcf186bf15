"""`prism time` on CPU: a solo-captured bare graph of gpt3d (N = 4, TP2·DP2: two
representatives, each standing for a DP replica) timed a slice at a time; the timed graph has
the bare graph's structure on all four ranks, measured durations, and a second run resumes
without running any slice again."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from conftest import GPT3D, PRISM

from prismllm.errors import ExitCode
from prismllm.trace.compare import compare_traces
from prismllm.trace.graph import PrismTrace
from prismllm.trace.ranklog import read_ranklog
from prismllm.trace.schema import REPLICAS_KEY

ROOT = Path(__file__).resolve().parents[1]
ARGS = [
    "--tp",
    "2",
    "--layers",
    "2",
    "--hidden",
    "32",
    "--heads",
    "4",
    "--seq",
    "16",
    "--vocab",
    "128",
    "--micro-batch",
    "1",
    "--global-batch",
    "4",
    "--iters",
    "2",
]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def prism(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([PRISM, *args], capture_output=True, text=True, env=ENV, timeout=timeout)


@pytest.fixture(scope="module")
def bare(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("time") / "bare"
    p = prism(
        "capture",
        "--mode",
        "solo",
        "--world",
        "4",
        "--parallel",
        "2",
        "--layout",
        "tp=2",
        "--out",
        str(out),
        "--",
        GPT3D,
        *ARGS,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    return out


def test_time_slices_every_representative_once_and_resumes(bare, tmp_path):
    out = tmp_path / "timed"
    cmd = [
        "time",
        "--graph",
        str(bare),
        "--out",
        str(out),
        "--inputs",
        "generated",
        "--parallel",
        "2",
        "--",
        GPT3D,
        *ARGS,
    ]
    p = prism(*cmd)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "2 of 4 rank(s) timed in 2 slice(s)" in p.stderr, p.stderr
    state = json.loads((out / "time.json").read_text())
    assert state["slices"] == [[0], [1]]  # the representatives (dp coordinate 0)
    timed, ref = PrismTrace.load(out / "graph"), PrismTrace.load(bare)
    assert timed.world_size == 4 and timed.manifest["mode"] == "timed"
    # which slice measured each rank: replicas 2 and 3 take their representatives' (0 and 1)
    assert timed.manifest["timing"]["slice_of_rank"] == [0, 1, 0, 1]
    # the replicas are their representatives' copies, timings included (prismllm.replay.mirror)
    assert timed.manifest[REPLICAS_KEY] == ref.manifest[REPLICAS_KEY] == {"representatives": 2, "copies": 2}
    # every call of a timed rank is pruned (its TP and DP peers are virtual): the emulation
    # layer's own host time on them is left out of its clock, and said how much
    left_out = timed.manifest["timing"]["emulation_overhead_left_out_ns"]
    assert set(left_out) == {"0", "1"} and all(v > 0 for v in left_out.values()), left_out
    # ... and counted on any device (on gloo all of it is left out: the two agree)
    assert timed.manifest["timing"]["emulation_host_ns"] == left_out
    # ... and by part, over the steady iterations: the call checked against the graph, its plan,
    # its Work, its post step; each part's CPU time within its wall time
    parts = timed.manifest["timing"]["emulation_host_parts"]
    assert set(parts) == {"0", "1"}, parts
    for r, by_part in parts.items():
        assert {"check", "plan", "work", "finish"} <= set(by_part), by_part
        assert all(calls > 0 and 0 < cpu <= wall * 1.1 + 50_000 for calls, wall, cpu in by_part.values()), by_part
        assert sum(wall for _, wall, _ in by_part.values()) < left_out[r]  # the first iteration is not in it
    assert compare_traces(ref, timed, timing=False).structure_equal
    d = timed.nodes.select(["kind", "duration_ns"]).to_pylist()
    assert sum(n["kind"] == "compute" and n["duration_ns"] > 0 for n in d) > 20
    again = prism(cmd[0], "--json", *cmd[1:])  # nothing left to run: the slices are reused
    assert again.returncode == 0 and "(2 done before)" in again.stderr, again.stderr
    res = json.loads(again.stdout)  # --json: stdout is the result alone
    assert res["graph"] == str(out / "graph") and res["timed_ranks"] == [0, 1] and res["resumed"] == 2
    assert res["slices"] == [[0], [1]] and res["world_size"] == 4 and set(res["left_out_ns"]) == {"0", "1"}


def test_slices_on_the_native_lane_leave_its_host_time_out(bare, tmp_path):
    """PRISM_NATIVE_LANE=1 on the CPU: the slices record natively and their pruned groups run the
    native lane. Where the host clock is the device clock, the lane's own host time (its checks and
    templates, the Python backend's parts of the calls it hands over) is left out of the rank's
    clock, as the Python path leaves out its own; the timed graph says how much, and how many
    calls took a template and how many went to Python, per timed rank."""
    out = tmp_path / "timed"
    cmd = [PRISM, "time", "--graph", str(bare), "--out", str(out), "--inputs", "generated", "--parallel", "2",
           "--", GPT3D, *ARGS]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, env={**ENV, "PRISM_NATIVE_LANE": "1"}, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    timing = PrismTrace.load(out / "graph").manifest["timing"]
    lane = timing["emulation_native_lane"]
    assert set(lane) == {"0", "1"} and all(v["python"] > 0 for v in lane.values()), lane
    left_out = timing["emulation_overhead_left_out_ns"]
    assert set(left_out) == {"0", "1"} and all(v > 0 for v in left_out.values()), left_out


def test_time_refuses_bad_input(bare, tmp_path):
    p = prism("time", "--graph", str(tmp_path / "nothing"), "--out", str(tmp_path / "o"), "--", GPT3D)
    assert p.returncode == ExitCode.BAD_INPUT and p.stderr.startswith("prism time: error: graph ")
    assert "Traceback" not in p.stderr
    p = prism("time", "--graph", str(bare), "--out", str(tmp_path / "o"), "--slice-size", "4", "--", GPT3D, *ARGS)
    assert p.returncode == 2 and "must leave some of the 4 ranks virtual" in p.stderr, p.stderr
    # the API checks what the command line's choices check (a head start it does not know would
    # otherwise reach the slices, on a GPU only)
    from prismllm.errors import PrismError
    from prismllm.time.slices import TimeOptions, time_slices

    opts = TimeOptions(graph=bare, out=tmp_path / "api", script=GPT3D, args=ARGS, head_start="always")
    with pytest.raises(PrismError, match="--head-start 'always': expected one of auto, overhead, iteration, off"):
        time_slices(opts)


def test_left_out_host_time_is_not_on_the_rank_clock():
    """Recorder.exclude: host time the emulation layer spent on a call is taken off every later
    point of the rank's host clock (CPU timing), so an interval around it does not count it."""
    from prismllm.comm.recorder import Recorder

    rec = Recorder(0, 1)
    a = rec.point()
    rec.exclude(3_000_000_000)
    b = rec.point()
    assert rec.p_ns[b] - rec.p_ns[a] < -2_900_000_000  # 3 s taken off, a few us passed
    assert rec.excluded_ns == 3_000_000_000


def test_compute_under_load_takes_compute_from_every_rank_at_once(bare, tmp_path):
    """--compute-under-load (CPU): a second pass runs every rank at once, each in its own slice;
    the timed graph keeps the first pass's communication and takes that pass's compute spans."""
    import numpy as np

    out = tmp_path / "timed"
    p = prism(
        "time",
        "--graph",
        str(bare),
        "--out",
        str(out),
        "--inputs",
        "generated",
        "--compute-under-load",
        "--",
        GPT3D,
        *ARGS,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    load_state = json.loads((out / "load" / "time.json").read_text())
    assert load_state["slices"] == [[0], [1], [2], [3]]  # every rank, replicas too
    timed, load = PrismTrace.load(out / "graph"), PrismTrace.load(out / "load" / "graph")
    assert timed.manifest["timing"]["compute_from"].startswith("load pass")
    assert REPLICAS_KEY not in timed.manifest  # every rank's compute its own: no copies

    def rank0(t):
        o = np.lexsort((t.column("index"), t.column("rank")))
        o = o[t.column("rank")[o] == 0]
        return t.column("kind")[o], t.column("duration_ns")[o]

    kind, dur = rank0(timed)
    _, load_dur = rank0(load)
    compute = kind == "compute"
    assert np.array_equal(dur[compute], load_dur[compute])
    # communication is the first pass's: rank 0's own slice, as its rank log recorded it
    log = read_ranklog(out / "slices" / "slice-00000" / "ranklogs" / "rank-000000.msgpack")
    first = np.array([n["duration_ns"] for n in sorted(log.nodes, key=lambda n: n["index"])])
    assert np.array_equal(dur[~compute], first[~compute]) and not np.array_equal(first[compute], dur[compute])
    p = prism(
        "time",
        "--graph",
        str(bare),
        "--out",
        str(tmp_path / "g"),
        "--devices",
        "cuda",
        "--compute-under-load",
        "--",
        GPT3D,
        *ARGS,
    )
    assert p.returncode == 2 and "--compute-under-load is for CPU timing" in p.stderr, p.stderr


def test_time_devices_that_cannot_hold_the_slices_are_refused_up_front():
    """`prism run` asks the time stage, before its capture runs, whether the listed devices hold
    its slices (seen: a 1024-rank run listed 16 shared GPUs with --parallel 16, captured for 30 s,
    then the time stage refused them). The message says both ways out."""
    import dataclasses

    from prismllm.errors import PrismError
    from prismllm.time import TimeOptions, check_time_devices

    opts = TimeOptions(graph="g", out="o", script="s", args=[], devices="cuda:0,0,0", parallel=2)
    with pytest.raises(PrismError, match=r"need 4, 3 listed: list 4 .* or lower --parallel to 1"):
        check_time_devices(opts, 32)
    assert len(check_time_devices(opts, 1)) == 1  # one slice: one sandbox and one assistant GPU
    assert len(check_time_devices(dataclasses.replace(opts, parallel=None), 32)) == 1  # as many as fit
