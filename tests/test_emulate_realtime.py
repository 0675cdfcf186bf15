"""`prism emulate --timing real`: the assistant replays the virtual ranks in real time with the
graph's durations and feeds the sandbox's real completions back (the emulation stage with a
calibrated graph), and stages the proxy's next call while the current one is in flight.

The check that real timing is real: a copy of a recorded PP2 graph whose virtual rank 0 is
made slow (every compute span 15 ms) must slow the sandbox rank 1 down to about the solved
iteration time of that graph, while fast timing (as fast as dependencies allow) must not;
the numbers the sandbox computes stay the real run's either way.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import GPT3D

from prismllm.emulate import EmulateOptions, emulate
from prismllm.errors import PrismError
from prismllm.outputs import SCHEDULE_FILE
from prismllm.replay import solve
from prismllm.trace.graph import PrismTrace

ROOT = Path(__file__).resolve().parents[1]
ARGS = [
    "--pp",
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
    "3",
]
SLOW_NS = 15_000_000  # each compute span of the slowed virtual rank


@pytest.fixture(scope="module")
def recorded(gpt3d_recording) -> tuple[Path, list[dict]]:
    """The real 2-rank run, saving tensors: test_emulate's PP2 command (the same ARGS), recorded
    once for both (conftest.gpt3d_recording)."""
    rec = gpt3d_recording(2, ARGS, save_tensors="all,inputs")
    return rec.out, rec.log


@pytest.fixture(scope="module")
def slowed(recorded, tmp_path_factory) -> tuple[Path, int]:
    """The recorded graph with rank 0's compute spans set to SLOW_NS, and its solved iteration time."""
    real, _ = recorded
    t = PrismTrace.load(real)
    nodes = t.nodes
    rank = nodes.column("rank").to_numpy()
    compute = np.array([k != "comm" for k in nodes.column("kind").to_pylist()])
    dur = nodes.column("duration_ns").to_numpy().copy()
    dur[(rank == 0) & compute] = SLOW_NS
    i = nodes.schema.get_field_index("duration_ns")
    t.nodes = nodes.set_column(i, nodes.schema.field(i), pa.array(dur, type=nodes.schema.field(i).type))
    out = tmp_path_factory.mktemp("realtime") / "slow"
    t.save(out)
    predicted = solve(PrismTrace.load(out)).result.predicted_iteration_ns
    return out, predicted


def run(graph: Path, tensors: Path, out: Path, timing: str, env: dict | None = None):
    return emulate(
        EmulateOptions(
            graph=graph,
            sandbox="1",
            out=out,
            script=GPT3D,
            args=[*ARGS, "--json-log", str(out.with_suffix(".json"))],
            tensors=tensors,
            timeout=240,
            timing=timing,
            env=env or {},
        )
    )


def losses(out: Path) -> list[float]:
    return [r["loss"] for r in json.loads(out.with_suffix(".json").read_text())]


def test_real_timing_follows_the_graph_durations(recorded, slowed, tmp_path):
    real, real_log = recorded
    graph, predicted = slowed
    assert predicted > 8 * SLOW_NS  # the slowed rank dominates: ~2 x 4 micro-batches of compute
    res = run(graph, real / "tensors", tmp_path / "real", "real")
    assert res.timing == "real"
    med = res.sandbox_results[1]["median_steady_iteration_ns"]
    # the sandbox waits for the slow virtual rank as for a real one (real completions fed back)
    assert 0.85 * predicted < med < 1.5 * predicted, (med, predicted)
    replay = res.replay
    assert replay["timing"] == "real" and replay["staged_ahead"] > 0
    assert 0.85 * predicted < replay["median_steady_iteration_ns"] < 1.5 * predicted
    assert losses(tmp_path / "real") == [r["loss"] for r in real_log]
    # every call with the sandbox was entered by the schedule, and how late is reported: the
    # group's first call at once, every later one when due
    arr = replay["arrivals"]
    assert arr["clock"] == "host" and arr["entered"] == arr["calls"] <= replay["answered"]  # a batch: one entry
    assert arr["at_once"] >= 1 and arr["timed"] == arr["calls"] - arr["at_once"]
    assert abs(arr["late"]["median_ns"]) < 0.1 * predicted  # the host clock enters early by a call's issue cost
    # ... and call by call in schedule.parquet: each entered after the gates it waited behind
    # completed, and completed after it was entered
    sch = pq.read_table(tmp_path / "real" / SCHEDULE_FILE).to_pydict()
    assert len(sch["slot"]) == arr["calls"] and set(sch["rank"]) == {0}
    done = dict(zip(sch["slot"], sch["completed_ns"]))
    for s, gates, entered, completed in zip(sch["slot"], sch["gates"], sch["entered_ns"], sch["completed_ns"]):
        assert all(g < s and done[g] <= entered for g in gates), (s, gates)
        assert completed >= entered
    assert sum(1 for g in sch["gates"] if g) >= arr["timed"] // 2  # the pipeline's calls wait behind the sandbox's

    fast = run(graph, real / "tensors", tmp_path / "fast", "fast")
    assert fast.timing == "fast"
    assert fast.sandbox_results[1]["median_steady_iteration_ns"] < 0.5 * predicted
    assert losses(tmp_path / "fast") == [r["loss"] for r in real_log]


def test_staging_off_gives_the_same_numbers(recorded, tmp_path):
    real, real_log = recorded
    res = run(real, real / "tensors", tmp_path / "nostage", "fast", env={"PRISM_STAGE_AHEAD": "0"})
    assert res.replay["staged_ahead"] == 0 and res.replay["answered"] > 0
    assert losses(tmp_path / "nostage") == [r["loss"] for r in real_log]


def test_real_timing_needs_durations(recorded, tmp_path):
    real, _ = recorded
    bare = tmp_path / "bare"
    t = PrismTrace.load(real)
    t.manifest = {**t.manifest, "mode": "solo"}
    t.save(bare)
    with pytest.raises(PrismError, match="without measured ones: time and calibrate it first"):
        run(bare, real / "tensors", tmp_path / "out", "real")
