"""`prism record` on real 8-rank CPU runs of examples/gpt3d.py: the graphs validate and their
structure is exactly what each layout's schedule prescribes.

The expected counts are derived from the parallel layout, not read back from a run:
- 1F1B with p stages and m micro-batches: a stage sends m activations unless it is the last,
  m gradients unless it is the first, and receives the same; the interleaved schedule with v
  chunks does this per chunk, the ring wrapping from the last stage to the first.
- the distributed optimizer: one reduce-scatter and one all-gather per gradient bucket, on the
  DP group, the all-gather of a bucket as large as its reduce-scatter's input.
- MoE: per layer and micro-batch one all-gather of routing counts on the EP group and four
  all_to_all_single (dispatch and combine, forward and backward), each with its split sizes.
"""

from __future__ import annotations

import collections
import json
import subprocess

import pytest
from conftest import PRISM, gpt3d_sizes

from prismllm.trace import PrismTrace, validate

ITERS = 3
# Tiny sizes: the cost is starting 8 processes on a 2-core machine.
SIZES = gpt3d_sizes(layers=4, iters=ITERS, bucket_mb="0.01")

# Each layout's full gpt3d command line and `prism record` options. The recordings are shared
# through conftest.gpt3d_recording with every test that records the same command: TP2·PP2·DP2
# with test_replay_engine and test_capture_solo_programs (see program()), the MoE layout with
# test_emulate_n8 (its command at N = 8, hence its own sizes, 2 iterations, and the saved
# tensors and parameters that the emulation compares with).
LAYOUTS = {
    "tp2pp2dp2": [*SIZES, "--tp", "2", "--pp", "2", "--global-batch", "8"],
    "pp4": [*SIZES, "--pp", "4", "--global-batch", "8"],  # dp 2, m 4: a steady 1F1B phase on stage 0
    "pp2vpp2dp2_distopt": [*SIZES, "--pp", "2", "--vpp", "2", "--global-batch", "8", "--dist-opt"],
    "tp2ep4_moe": [
        "--tp",
        "2",
        "--ep",
        "4",
        "--num-experts",
        "4",
        "--topk",
        "2",
        "--layers",
        "4",
        "--hidden",
        "32",
        "--heads",
        "4",
        "--vocab",
        "64",
        "--seq",
        "8",
        "--micro-batch",
        "1",
        "--global-batch",
        "8",
        "--iters",
        "2",
        "--bucket-mb",
        "0.002",
    ],
}
RECORD_OPTIONS = {"tp2ep4_moe": {"save_tensors": "all,inputs", "save_params": True}}
ITERATIONS = {name: int(args[args.index("--iters") + 1]) for name, args in LAYOUTS.items()}


def program(name: str) -> list[str]:
    """gpt3d's arguments for layout ``name``."""
    return list(LAYOUTS[name])


def recording(gpt3d_recording, name: str):
    """The shared 8-rank CPU recording of layout ``name`` (conftest.Recording)."""
    return gpt3d_recording(8, program(name), timeout=600, **RECORD_OPTIONS.get(name, {}))


@pytest.fixture(scope="module")
def graphs(gpt3d_recording):
    out = {}
    for name in LAYOUTS:
        rec = recording(gpt3d_recording, name)
        out[name] = (PrismTrace.load(rec.out), rec.log, rec.out)
    return out


class Rank:
    """The communication nodes of one rank, per iteration, with group ranks resolved."""

    def __init__(self, trace: PrismTrace, rank: int):
        nodes = trace.nodes_of(rank).to_pydict()
        group_ranks = dict(
            zip(trace.groups.column("group_id").to_pylist(), map(tuple, trace.groups.column("ranks").to_pylist()))
        )
        self.rows = [
            {k: nodes[k][i] for k in nodes} | {"ranks": group_ranks.get(nodes["group"][i], ())}
            for i in range(len(nodes["op"]))
        ]

    def comm(self, iteration: int, op: str | None = None, ranks: tuple | None = None) -> list[dict]:
        return [
            r
            for r in self.rows
            if r["kind"] == "comm"
            and r["iteration"] == iteration
            and (op is None or r["op"] == op)
            and (ranks is None or r["ranks"] == ranks)
        ]


def coords(rank: int, tp: int, dp: int) -> tuple[int, int, int]:
    """gpt3d's rank order: tp fastest, then dp, then pp."""
    return rank % tp, (rank // tp) % dp, rank // (tp * dp)


def dp_group(rank: int, tp: int, dp: int) -> tuple:
    t, _, p = coords(rank, tp, dp)
    return tuple((p * dp + d) * tp + t for d in range(dp))


def pp_group(rank: int, tp: int, dp: int, pp: int) -> tuple:
    t, d, _ = coords(rank, tp, dp)
    return tuple((s * dp + d) * tp + t for s in range(pp))


def expected_p2p(stage: int, pp: int, m: int, vpp: int = 1) -> dict[str, int]:
    first, last = stage == 0, stage == pp - 1
    return {
        "send": vpp * m - (m if last else 0) + vpp * m - (m if first else 0),
        "recv": vpp * m - (m if first else 0) + vpp * m - (m if last else 0),
    }


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_graph_validates_and_every_iteration_is_found(graphs, name):
    trace, printed, _ = graphs[name]
    iters = ITERATIONS[name]
    validate(trace)
    assert trace.world_size == 8 and trace.manifest["mode"] == "record"
    it = trace.iterations.to_pydict()
    assert sorted(set(it["iteration"])) == list(range(iters))
    assert collections.Counter(it["rank"]) == {r: iters for r in range(8)}
    assert [p["iteration"] for p in printed] == list(range(1, iters + 1))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_async_ops_have_issue_and_wait_points(graphs, name):
    trace, _, _ = graphs[name]
    kind = trace.column("kind")
    async_op = trace.column("async_op") & (kind == "comm")
    index, wait = trace.column("index"), trace.column("wait_index")
    assert async_op.any()
    assert (wait[async_op] > index[async_op]).all()  # waited later, at a recorded point
    assert (trace.column("issue_ns")[kind == "comm"] > 0).all()
    edges = trace.edges.to_pydict()
    assert collections.Counter(edges["kind"])["wait"] == int(async_op.sum())


@pytest.mark.parametrize("name,tp,pp,vpp", [("tp2pp2dp2", 2, 2, 1), ("pp4", 1, 4, 1), ("pp2vpp2dp2_distopt", 1, 2, 2)])
def test_pipeline_p2p_counts_follow_the_schedule(graphs, name, tp, pp, vpp):
    trace, _, _ = graphs[name]
    dp = 8 // (tp * pp)
    m = 8 // dp  # global batch 8, micro-batch 1
    for rank in range(8):
        r = Rank(trace, rank)
        stage = coords(rank, tp, dp)[2]
        group = pp_group(rank, tp, dp, pp)
        for i in range(ITERATIONS[name]):
            counts = {op: len(r.comm(i, op, group)) for op in ("send", "recv")}
            assert counts == expected_p2p(stage, pp, m, vpp), (name, rank, i)
            for row in r.comm(i, "send", group) + r.comm(i, "recv", group):
                assert row["peer"] in group and row["peer"] != rank
                assert row["coalesced"] >= 0  # issued through batch_isend_irecv


def test_distributed_optimizer_one_reduce_scatter_and_all_gather_per_bucket(graphs):
    trace, _, _ = graphs["pp2vpp2dp2_distopt"]
    for rank in range(8):
        r = Rank(trace, rank)
        group = dp_group(rank, 1, 4)
        for i in range(ITERATIONS["pp2vpp2dp2_distopt"]):
            rs, ag = r.comm(i, "reduce_scatter", group), r.comm(i, "all_gather", group)
            assert len(rs) == len(ag) >= 2  # at least one bucket per model chunk; the all-gather
            # runs inside the optimizer step, so in the same iteration as the reduce-scatter
            assert sorted(x["in_bytes"] for x in rs) == sorted(x["out_bytes"] for x in ag)
            assert all(x["async_op"] for x in rs)  # overlapped with backward
            assert not r.comm(i, "all_reduce", group) or rank // 4 == 1  # loss only, last stage
        # Every iteration reduces the same buckets.
        assert [x["in_bytes"] for x in r.comm(0, "reduce_scatter")] == [
            x["in_bytes"] for x in r.comm(1, "reduce_scatter")
        ]


def test_data_parallel_buckets_are_async_all_reduces(graphs):
    trace, _, _ = graphs["tp2pp2dp2"]
    for rank in range(8):
        r = Rank(trace, rank)
        buckets = [x for x in r.comm(0, "all_reduce", dp_group(rank, 2, 2)) if x["async_op"]]
        assert buckets and all(x["reduce_op"] == "sum" for x in buckets)
        again = [x for x in r.comm(1, "all_reduce", dp_group(rank, 2, 2)) if x["async_op"]]
        assert [x["in_bytes"] for x in buckets] == [x["in_bytes"] for x in again]


def test_moe_all_to_all_records_split_sizes(graphs):
    trace, _, _ = graphs["tp2ep4_moe"]
    layers, m, hidden = 4, 8 // 4, 32
    for rank in range(8):
        r = Rank(trace, rank)
        t, d, _ = coords(rank, 2, 4)
        ep = tuple(dd * 2 + t for dd in range(4))  # EP is all of DP here (ep 4 = dp 4)
        for i in range(ITERATIONS["tp2ep4_moe"]):
            a2a = r.comm(i, "all_to_all", ep)
            assert len(a2a) == 4 * layers * m
            for x in a2a:
                assert len(x["in_splits"]) == len(x["out_splits"]) == 4
                row_bytes = hidden * 4  # fp32 rows of the hidden size
                assert sum(x["in_splits"]) * row_bytes == x["in_bytes"]
                assert sum(x["out_splits"]) * row_bytes == x["out_bytes"]
            assert len(r.comm(i, "all_gather", ep)) == layers * m  # routing counts
    # Split sizes agree across the group: what rank i sends to j is what j receives from i.
    validate(trace)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_recorded_iteration_time_agrees_with_the_printed_time(graphs, name):
    """The program prints, from the last rank, the time from the start of an iteration to the end
    of its optimizer step; the graph's iteration spans optimizer step to optimizer step, so it
    holds the printed interval plus the gap before it (the print, host work). On 2 shared cores a
    process descheduled in that gap makes the recorded span longer (CI saw 38.9 ms against
    21.9 ms printed). It can also come out shorter: with the distributed optimizer the step the
    hooks see ends before the parameters' all-gather the printed time includes, and under load one
    iteration's tail differs from the next's (a fresh clone's suite, beside other runs on the 2-core
    machine, saw 152.6 ms recorded against 177.8 ms printed). A graph iteration numbered one off
    would hold the set-up (seconds) or miss the step and fail either bound."""
    trace, printed, _ = graphs[name]
    it = trace.iterations.to_pydict()
    last = trace.world_size - 1
    spans = {
        i: (e - s) / 1e6 for r, i, s, e in zip(it["rank"], it["iteration"], it["start_ns"], it["end_ns"]) if r == last
    }
    for p in printed[1:]:  # iteration 0 of the graph also holds the set-up
        recorded = spans[p["iteration"] - 1]
        printed_ms = p["iter_time_ms"]
        assert 0.75 * printed_ms <= recorded <= 2 * printed_ms + 25.0, (recorded, p)


def test_compare_a_graph_with_itself_and_with_another_layout(graphs):
    a, b = str(graphs["tp2pp2dp2"][2]), str(graphs["pp4"][2])
    same = subprocess.run([PRISM, "compare", a, a, "--json"], capture_output=True, text=True)
    assert same.returncode == 0 and json.loads(same.stdout)["structure"]["equal"] is True
    diff = subprocess.run([PRISM, "compare", a, b, "--json"], capture_output=True, text=True)
    assert diff.returncode == 1
    first = json.loads(diff.stdout)["structure"]["first_difference"]
    assert first is not None and first["rank"] == 0
