"""The replay engine (prismllm.replay): hand-computed times on small graphs, consistency and
fidelity on a recorded 8-rank gpt3d graph, external-rank driving, and the deadlock error.

Every expected time in the small graphs is worked out in the test's docstring from the timing
model of docs/internals/replay.md: a collective starts when its last member arrives and lasts the
duration recorded by that last member; async ops let the rank go on after the recorded issue
gap and gate the node at their wait point; coalesced ops complete together.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_record_gpt3d import ITERATIONS, recording

from prismllm.replay import Replay, ReplayError, ReplayGraph
from prismllm.trace import PrismTrace, assemble
from prismllm.trace.ranklog import GroupInfo, RankLog


# ---------------------------------------------------------------------- small graphs
def C(start: int, dur: int, **kw) -> dict:
    """A compute node recorded at [start, start + dur)."""
    return {"op": "compute", "kind": "compute", "start_ns": start, "duration_ns": dur, **kw}


def M(op: str, start: int, dur: int, group: str = "0", **kw) -> dict:
    """A communication node recorded at [start, start + dur)."""
    return {
        "op": op,
        "kind": "comm",
        "group_name": group,
        "start_ns": start,
        "duration_ns": dur,
        "in_bytes": 64,
        "out_bytes": 64,
        "dtype": "float32",
        **kw,
    }


def make_trace(programs: list[list[dict]], groups: list[GroupInfo] | None = None) -> PrismTrace:
    """One iteration (0) per rank holding all of its nodes."""
    world = len(programs)
    groups = groups or [GroupInfo("0", "default_pg", list(range(world)))]
    logs = []
    for rank, nodes in enumerate(programs):
        rows = []
        for i, n in enumerate(nodes):
            n = {"iteration": 0, **n, "rank": rank, "index": i}
            n.update(issue_ns=n["start_ns"], end_ns=n["start_ns"] + n["duration_ns"])
            rows.append(n)
        its = [{"iteration": 0, "start_ns": 0, "end_ns": max(r["end_ns"] for r in rows), "label": ""}]
        logs.append(
            RankLog(rank=rank, world_size=world, device="cpu", clock="host", nodes=rows, groups=groups, iterations=its)
        )
    return assemble(logs, {"mode": "record", "command": ["test"]})


def times(res, rank: int) -> list[tuple[int, int]]:
    s, e = res.node_times(rank)
    return list(zip(s.tolist(), e.tolist()))


def test_all_reduce_with_skewed_arrival():
    """Rank 0 arrives at 100, rank 1 at 150. Rank 0 recorded 70 ns (50 of them waiting for
    rank 1), rank 1, the last to arrive, 20: the transfer. Both end at 150 + 20 = 170."""
    trace = make_trace(
        [
            [C(0, 100), M("all_reduce", 100, 70), C(170, 10)],
            [C(0, 150), M("all_reduce", 150, 20), C(170, 30)],
        ]
    )
    res = Replay(ReplayGraph(trace)).run_to_end()
    assert times(res, 0) == [(0, 100), (100, 170), (170, 180)]
    assert times(res, 1) == [(0, 150), (150, 170), (170, 200)]
    assert res.instance_start_ns.tolist() == [150] and res.instance_end_ns.tolist() == [170]
    assert res.rank_iteration_ns.tolist() == [[180], [200]]
    assert res.iteration_ns.tolist() == [200] and res.predicted_iteration_ns == 200
    # Compute twice as slow on rank 0: rank 0 is now last (arrives at 200); the transfer is
    # still the recorded 20 ns, so rank 1, in since 150, waits until 220.
    slow = Replay(ReplayGraph(trace), compute=lambda g: np.where(g.rank_pos == 0, 2, 1) * g.recorded_compute_ns)
    r2 = slow.run_to_end()
    assert times(r2, 0) == [(0, 200), (200, 220), (220, 240)]
    assert times(r2, 1) == [(0, 150), (150, 220), (220, 250)]
    assert r2.predicted_iteration_ns == 250


def test_async_op_with_a_later_wait():
    """Rank 0 issues an async all_reduce at 100; its call took 5 ns (the next node starts at
    105), so it computes 105-155 and 155-195, then waits at node 4. Rank 1 arrives at 120 (no
    issue gap), computes 120-140 and waits at node 3. The transfer is rank 1's 25 ns: done at
    145. Rank 1's node 3 starts at 145; rank 0's node 4 at 195 (already done)."""
    trace = make_trace(
        [
            [C(0, 100), M("all_reduce", 100, 95, async_op=True, wait_index=4), C(105, 50), C(155, 40), C(195, 10)],
            [C(0, 120), M("all_reduce", 120, 25, async_op=True, wait_index=3), C(120, 20), C(145, 5)],
        ]
    )
    g = ReplayGraph(trace)
    assert g.recorded_issue_ns.tolist() == [0, 5, 0, 0, 0, 0, 0, 0, 0]
    res = Replay(g).run_to_end()
    assert times(res, 0) == [(0, 100), (100, 145), (105, 155), (155, 195), (195, 205)]
    assert times(res, 1) == [(0, 120), (120, 145), (120, 140), (145, 150)]
    assert res.return_ns[1] == 105  # rank 0's host went on after the 5 ns call
    # A slower transfer (100 ns: done at 220) now holds rank 0 at its wait too.
    res = Replay(g, transfer=np.array([100])).run_to_end()
    assert times(res, 0)[4] == (220, 230) and times(res, 1)[3] == (220, 225)


def test_send_recv_pairs_match_in_order():
    """Rank 0 sends at 10, rank 1 posts the recv at 30 and, last to arrive, recorded 7 ns: both
    end at 37. Then rank 1 sends back at 38 and rank 0's recv (posted at 42) records 3: 45."""
    trace = make_trace(
        [
            [C(0, 10), M("send", 10, 27, peer=1), C(37, 5), M("recv", 42, 3, peer=1), C(45, 1)],
            [C(0, 30), M("recv", 30, 7, peer=0), C(37, 1), M("send", 38, 7, peer=0), C(45, 2)],
        ]
    )
    res = Replay(ReplayGraph(trace)).run_to_end()
    assert times(res, 0) == [(0, 10), (10, 37), (37, 42), (42, 45), (45, 46)]
    assert times(res, 1) == [(0, 30), (30, 37), (37, 38), (38, 45), (45, 47)]
    assert res.predicted_iteration_ns == 47


def test_coalesced_batch_completes_together():
    """batch_isend_irecv on both ranks: pair A (0->1) arrives 10 / 20 and takes rank 1's 5 ns:
    ends 25; pair B (1->0) arrives 12 / 22 and takes rank 1's 40 ns: ends 62. Each rank's batch
    is {A, B}, so every op of it completes at 62: rank 0's wait on its send (node 4) holds
    until 62 although A ended at 25 (node 5 waits for the send, node 6 for the recv)."""
    trace = make_trace(
        [
            [
                C(0, 10),
                M("send", 10, 15, peer=1, coalesced=0, async_op=True, wait_index=5),
                C(10, 2),
                M("recv", 12, 50, peer=1, coalesced=0, async_op=True, wait_index=6),
                C(12, 3),
                C(62, 1),
                C(63, 1),
            ],
            [
                C(0, 20),
                M("recv", 20, 5, peer=0, coalesced=0, async_op=True, wait_index=5),
                C(20, 2),
                M("send", 22, 40, peer=0, coalesced=0, async_op=True, wait_index=6),
                C(22, 3),
                C(62, 1),
                C(63, 1),
            ],
        ]
    )
    g = ReplayGraph(trace)
    assert g.num_batches == 2 and not g.blocking.any()
    res = Replay(g).run_to_end()
    assert sorted(res.instance_end_ns.tolist()) == [25, 62]
    assert times(res, 0) == [(0, 10), (10, 62), (10, 12), (12, 62), (12, 15), (62, 63), (63, 64)]
    assert times(res, 1) == [(0, 20), (20, 62), (20, 22), (22, 62), (22, 25), (62, 63), (63, 64)]


def test_blocking_coalesced_batch_blocks_once_at_its_last_op():
    """Two all_reduces of one allreduce_coalesced call, waited at once (sync): the rank blocks
    once, after the second, until both have completed (rank 1 arrives last at 30: 30 + 8)."""
    ar = dict(coalesced=0)
    trace = make_trace(
        [
            [C(0, 10), M("all_reduce", 10, 28, **ar), M("all_reduce", 10, 28, **ar), C(38, 2)],
            [C(0, 30), M("all_reduce", 30, 8, **ar), M("all_reduce", 30, 6, **ar), C(38, 1)],
        ]
    )
    g = ReplayGraph(trace)
    assert g.blocking.tolist() == [False, False, True, False] * 2
    res = Replay(g).run_to_end()
    assert sorted(res.instance_end_ns.tolist()) == [36, 38]
    assert times(res, 0) == [(0, 10), (10, 38), (10, 38), (38, 40)]
    assert times(res, 1) == [(0, 30), (30, 38), (30, 38), (38, 39)]


def test_advance_until_runs_only_what_starts_by_then():
    trace = make_trace(
        [
            [C(0, 100), M("all_reduce", 100, 70), C(170, 10)],
            [C(0, 150), M("all_reduce", 150, 20), C(170, 30)],
        ]
    )
    rep = Replay(ReplayGraph(trace))
    st = rep.advance(until=120)
    assert not st.finished and not st.pending and st.next_ns == 150
    assert rep.start_ns.tolist() == [0, 100, -1, 0, -1, -1]  # rank 1's all_reduce starts at 150
    st = rep.advance(until=st.next_ns)
    assert st.next_ns == 170 and rep.inst_end_ns.tolist() == [170]
    assert rep.advance().finished


def test_external_rank_on_a_small_graph():
    """Rank 1 is external: the all_reduce is pending once rank 0 (the only virtual member) has
    arrived at 100; the driver says it ended at 170; rank 0 goes on from there."""
    trace = make_trace(
        [
            [C(0, 100), M("all_reduce", 100, 70), C(170, 10)],
            [C(0, 150), M("all_reduce", 150, 20), C(170, 30)],
        ]
    )
    g = ReplayGraph(trace, external=[1])
    assert g.ranks.tolist() == [0] and g.external_ranks.tolist() == [1] and g.inst_external.tolist() == [True]
    rep = Replay(g)
    st = rep.advance()
    assert not st.finished and len(st.pending) == 1
    ev = st.pending[0]
    assert (ev.ready_ns, ev.op, ev.virtual_ranks, ev.external_ranks) == (100, "all_reduce", (0,), (1,))
    with pytest.raises(ReplayError, match="before its last virtual member arrived"):
        rep.external_done(ev.instance, 99)
    rep.external_done(ev.instance, 170)
    with pytest.raises(ValueError, match="not pending"):
        rep.external_done(ev.instance, 170)
    assert rep.advance().finished
    assert times(rep.result(), 0) == [(0, 100), (100, 170), (170, 180)]
    with pytest.raises(ReplayError, match="external rank"):
        Replay(g).run_to_end()
    # ranks= picks the virtual ranks the same way
    assert ReplayGraph(trace, ranks=[0]).inst_external.tolist() == [True]


def test_deadlock_names_the_stuck_rank_node_op_and_group():
    """Rank 0 issues an all_reduce that rank 1 never issues."""
    trace = make_trace(
        [
            [C(0, 10), M("all_reduce", 10, 5), C(15, 1)],
            [C(0, 12)],
        ]
    )
    with pytest.raises(ReplayError) as e:
        Replay(ReplayGraph(trace)).run_to_end()
    msg = str(e.value)
    assert "rank 0 node 1 (all_reduce #0, group 0 ('default_pg', ranks 0-1))" in msg
    assert "rank 1 ran to its end (1 nodes) (it never issues it)" in msg
    assert (e.value.rank, e.value.index, e.value.op, e.value.group) == (0, 1, "all_reduce", 0)


def test_deadlock_of_two_blocking_recvs():
    """Both ranks post a blocking recv from the other first: each waits for a send that comes
    after the other's recv."""
    trace = make_trace(
        [
            [C(0, 10), M("recv", 10, 5, peer=1), M("send", 15, 5, peer=1)],
            [C(0, 20), M("recv", 20, 5, peer=0), M("send", 25, 5, peer=0)],
        ]
    )
    with pytest.raises(ReplayError) as e:
        Replay(ReplayGraph(trace)).run_to_end()
    msg = str(e.value)
    assert msg.startswith("replay deadlock: rank 0 node 1 (recv #0, from rank 1, group 0")
    assert "rank 1 is blocked in rank 1 node 1 (recv #0, from rank 0" in msg
    assert "(its part is node 2)" in msg


# ---------------------------------------------------------------------- recorded gpt3d
# the TP2·PP2·DP2 recording of test_record_gpt3d (shared: conftest.gpt3d_recording), 3 iterations
ITERS = ITERATIONS["tp2pp2dp2"]
assert ITERS == 3  # iteration 0 holds the set-up; the prediction is the median of the steady ones


@pytest.fixture(scope="module")
def gpt3d(gpt3d_recording):
    """An 8-rank CPU recording of gpt3d (tp 2, pp 2, dp 2) and its full replay."""
    trace = PrismTrace.load(recording(gpt3d_recording, "tp2pp2dp2").out)
    graph = ReplayGraph(trace)
    return trace, graph, Replay(graph).run_to_end()


def test_recorded_replay_is_consistent(gpt3d):
    trace, g, res = gpt3d
    assert g.num_batches > 0 and g.async_op.any() and (g.inst_kind == 1).any()
    s, e, ret = res.start_ns, res.end_ns, res.return_ns
    assert (s >= 0).all() and (e >= s).all()
    # compute lasts its recorded duration
    comp = ~g.is_comm
    assert np.array_equal(e[comp] - s[comp], g.recorded_compute_ns[comp])
    # no node starts before its predecessor on the rank let the host go on
    same = g.rank_pos[1:] == g.rank_pos[:-1]
    assert (s[1:][same] >= ret[:-1][same]).all()
    # a wait point starts after the ops waited on there completed
    dst = np.repeat(np.arange(g.num_nodes), np.diff(g.wait_ptr))
    assert len(dst) and (s[dst] >= e[g.wait_src]).all()
    # an instance starts with its last member and ends after its transfer, for every member
    # at once (coalesced ops: when their batch completes, no earlier)
    member_inst = g.inst_of[g.inst_nodes]
    assert np.array_equal(res.instance_start_ns, np.maximum.reduceat(s[g.inst_nodes], g.inst_ptr[:-1]))
    assert np.array_equal(res.instance_end_ns, res.instance_start_ns + g.recorded_transfer_ns)
    solo = g.batch_of[g.inst_nodes] < 0
    assert np.array_equal(e[g.inst_nodes][solo], res.instance_end_ns[member_inst][solo])
    assert (e[g.inst_nodes][~solo] >= res.instance_end_ns[member_inst][~solo]).all()
    b = g.batch_of[g.batch_nodes]
    assert np.array_equal(e[g.batch_nodes], np.maximum.reduceat(e[g.batch_nodes], g.batch_ptr[:-1])[b])
    # an iteration lasts at least the compute of its nodes on that rank
    it_pos = np.searchsorted(g.iterations, g.iteration)
    sel = comp & np.isin(g.iteration, g.iterations)
    comp_sum = np.zeros(res.rank_iteration_ns.shape)
    np.add.at(comp_sum, (g.rank_pos[sel], it_pos[sel]), g.recorded_compute_ns[sel])
    assert (res.rank_iteration_ns >= comp_sum).all()
    # with no compute, transfer or issue time, nothing takes time
    zero = Replay(g, compute="zero", transfer="zero", issue="zero").run_to_end()
    assert not zero.end_ns.any() and zero.predicted_iteration_ns == 0 and not zero.rank_iteration_ns.any()


def test_recorded_iteration_times_are_predicted(gpt3d):
    """Replayed with the recorded compute, issue and (last-arrival) transfer durations, the
    iteration times come back within a loose bound: 8 processes on 2 shared cores are noisy
    (the measured error is printed; docs/internals/replay.md quotes it)."""
    trace, g, res = gpt3d
    rec = g.recorded_iteration_ns
    assert rec.shape == (8, ITERS) and (rec > 0).all()
    rec_max = rec.max(axis=0)
    err = (res.iteration_ns - rec_max) / rec_max
    rec_pred = float(np.median(rec_max[1:]))
    pred_err = (res.predicted_iteration_ns - rec_pred) / rec_pred
    print(
        f"\nper-iteration error (max over ranks): {np.round(err, 4).tolist()}; "
        f"predicted {res.predicted_iteration_ns / 1e6:.2f} ms vs recorded {rec_pred / 1e6:.2f} ms "
        f"({pred_err:+.2%})"
    )
    # the noise is one-sided: a descheduled process notices a completion late, which the
    # recording counts and the replay does not (docs/internals/replay.md), so a loaded iteration replays
    # short (seen: -34 %; on the CI machine both steady iterations at -12 %), never much long;
    # the sharp checks are iteration 0 (seconds of set-up, below) and the 20 % long bound
    assert np.abs(err[1:]).min() < 0.2
    assert (err[1:] < 0.2).all() and (err[1:] > -0.5).all()
    assert -0.35 < pred_err < 0.2
    # iteration 0 holds set-up (seconds of it): the replay must hold it too
    assert abs(err[0]) < 0.1
    # ignoring the transfers must predict less: they are part of the recorded time
    no_xfer = Replay(g, transfer="zero").run_to_end()
    assert no_xfer.predicted_iteration_ns < res.predicted_iteration_ns


def _drive_with_external(trace, external, full_graph, full, step=None):
    """Replay with ``external`` ranks not simulated, answering each pending instance with the
    end time the full replay gave it; with ``step``, advance in logical-time slices."""
    g = ReplayGraph(trace, external=external)
    rep = Replay(g)
    until = 0 if step else None
    answered = 0
    while True:
        st = rep.advance(until)
        if st.finished:
            break
        for ev in st.pending:
            assert set(ev.external_ranks) & set(external) and ev.ready_ns <= (until if step else ev.ready_ns)
            p = ev.nodes[0]
            fp = full_graph.position(g.rank_of(p), g.index[p])
            rep.external_done(ev.instance, int(full.instance_end_ns[full_graph.inst_of[fp]]))
            answered += 1
        if step and not st.pending:
            until = st.next_ns if st.next_ns is not None else until + step
    return g, rep.result(), answered


@pytest.mark.parametrize("external,step", [([3], None), ([3], 2_000_000), ([0, 5], None)])
def test_external_ranks_driven_from_outside_equal_the_full_replay(gpt3d, external, step):
    trace, full_g, full = gpt3d
    g, res, answered = _drive_with_external(trace, external, full_g, full, step)
    assert answered == int(g.inst_external.sum()) > 0
    fp = full_g.position(g.ranks[g.rank_pos], g.index)
    assert np.array_equal(res.start_ns, full.start_ns[fp])
    assert np.array_equal(res.end_ns, full.end_ns[fp])
    rows = np.searchsorted(full_g.ranks, g.ranks)
    assert np.array_equal(res.rank_iteration_ns, full.rank_iteration_ns[rows])


def test_rows_of_a_table_are_its_take():
    """ReplayGraph's row selection: slices where the rows run in a few ascending blocks (every rank
    but a sandbox rank's), a take otherwise, the same table either way."""
    import pyarrow as pa

    from prismllm.replay.graph import _rows_of

    t = pa.table({"a": np.arange(1000, dtype=np.int64), "b": [str(i) for i in range(1000)]})
    cases = [
        np.r_[0:300, 400:1000],  # every rank but one block
        np.r_[0:10, 20:30, 990:1000],  # a few blocks
        np.arange(0, 1000, 2),  # many runs: a take
        np.array([5, 3, 9]),  # not ascending: a take
        np.arange(1000),
        np.zeros(0, dtype=np.int64),
    ]
    for rows in cases:
        got = _rows_of(t, rows, max_runs=8)
        assert got.equals(t.take(pa.array(rows, type=pa.int64()))), rows
    assert _rows_of(t, np.r_[0:300, 400:1000]).column("a").num_chunks == 2  # slices, no copy
