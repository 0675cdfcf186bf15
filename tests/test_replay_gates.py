"""The gates of a real-time replay (prismllm.replay.gates): which of the sandbox's completions each
call of the virtual ranks with the sandbox waits behind. Hand-made graphs of the three shapes
that matter: data-parallel buckets (asynchronous, waited at the end of the backward), tensor
parallelism (blocking, back to back) and a pipeline (send/recv with the sandbox's stage)."""

from __future__ import annotations

import numpy as np
from test_replay_engine import C, M, make_trace

from prismllm.replay import Replay, ReplayGraph
from prismllm.replay.gates import external_gates, planned_idle


def gates_of(trace, sandbox, idle=None, offsets=False):
    """{(op, seq): [(op, seq) of each gate]} (with ``offsets``: [((op, seq), offset ns)])."""
    g = ReplayGraph(trace, external=sandbox)
    ptr, gates, offs = external_gates(g, None if idle is None else np.asarray(idle, dtype=np.int64))
    out = {}
    for j in range(g.num_instances):
        if g.inst_external[j]:
            got = [
                ((g.op_names[g.inst_op[i]], int(g.inst_seq[i])), int(o))
                for i, o in zip(gates[ptr[j] : ptr[j + 1]], offs[ptr[j] : ptr[j + 1]])
            ]
            out[(g.op_names[g.inst_op[j]], int(g.inst_seq[j]))] = sorted(got if offsets else (k for k, _ in got))
    return out


def test_async_buckets_wait_only_at_their_wait_point():
    """Two iterations of two async buckets each, waited on together before the next forward: a
    bucket of iteration 1 waits behind both buckets of iteration 0, not behind the bucket just
    issued before it (the virtual replica goes on computing while that one is in flight)."""
    rank = [
        C(0, 10),
        M("all_reduce", 10, 5, async_op=True, wait_index=5),  # seq 0
        C(15, 10),
        M("all_reduce", 25, 5, async_op=True, wait_index=5),  # seq 1
        C(30, 1),
        C(31, 10),  # waits for seq 0, 1
        M("all_reduce", 41, 5, async_op=True, wait_index=10),  # seq 2
        C(46, 10),
        M("all_reduce", 56, 5, async_op=True, wait_index=10),  # seq 3
        C(61, 1),
        C(62, 1),
    ]
    got = gates_of(make_trace([rank, list(rank)]), sandbox=[0])
    assert got[("all_reduce", 0)] == [] and got[("all_reduce", 1)] == []
    assert got[("all_reduce", 2)] == [("all_reduce", 0), ("all_reduce", 1)]
    assert got[("all_reduce", 3)] == [("all_reduce", 0), ("all_reduce", 1)]


def test_an_older_gate_counts_less_the_waits_since():
    """A blocking call long before (a pipeline's shape exchange in iteration 0) still gates the calls
    after later waits, but less what the virtual rank waited since, by the plan: 7 ms at the wait
    for seq 1, 3 ms more at the wait for seq 2. Its lateness moves a call only past that slack
    (as a plain gate it was a floor: a virtual stage never followed a sandbox ahead of its pace);
    the latest wait's gates count in full."""
    rank = [
        C(0, 10),
        M("all_reduce", 10, 5),  # 1: seq 0, blocking
        C(15, 10),
        M("all_reduce", 25, 5, async_op=True, wait_index=5),  # 3: seq 1
        C(30, 1),
        C(31, 10),  # 5: waits for seq 1
        M("all_reduce", 41, 5, async_op=True, wait_index=8),  # 6: seq 2
        C(46, 10),
        C(56, 1),  # 8: waits for seq 2
        M("all_reduce", 57, 5, async_op=True, wait_index=10),  # 9: seq 3
        C(62, 1),  # 10: waits for seq 3
    ]
    trace = make_trace([rank, list(rank)])
    ms = 1_000_000
    idle = np.cumsum([0, 0, 0, 0, 0, 7 * ms, 0, 0, 3 * ms, 0, 0])  # the virtual rank 1's plan
    got = gates_of(trace, sandbox=[0], idle=idle, offsets=True)
    seq = lambda k: ("all_reduce", k)  # noqa: E731
    assert got[seq(1)] == [(seq(0), 0)]
    assert got[seq(2)] == [(seq(0), 7 * ms), (seq(1), 0)]
    assert got[seq(3)] == [(seq(0), 10 * ms), (seq(2), 0)]
    # without a plan both count in full (offsets 0)
    assert gates_of(trace, sandbox=[0])[seq(3)] == [seq(0), seq(2)]


def test_planned_idle_counts_gaps_and_waits_inside_blocking_calls():
    """Rank 1 reaches the blocking all-reduce 10 units before rank 0: it waits inside the call, less
    the call's transfer; its next compute starts at once (no gap)."""
    r0 = [C(0, 30), M("all_reduce", 30, 5), C(35, 5)]
    r1 = [C(0, 20), M("all_reduce", 20, 15), C(35, 5)]
    g = ReplayGraph(make_trace([r0, r1]))
    transfer = np.full(g.num_instances, 5, dtype=np.int64)
    res = Replay(g, compute="graph", transfer=transfer, issue="zero").run_to_end()
    s = planned_idle(res, transfer)
    a, b = g.off[1], g.off[2]  # rank 1's positions
    assert list(np.diff(np.r_[0, s[a:b]])) == [0, 10, 0], s[a:b]


def test_blocking_calls_wait_behind_the_one_before():
    rank = [C(0, 10), M("all_reduce", 10, 5), C(15, 10), M("all_reduce", 25, 5), C(30, 10), M("all_reduce", 40, 5)]
    got = gates_of(make_trace([rank, list(rank)]), sandbox=[1])
    assert got == {
        ("all_reduce", 0): [],
        ("all_reduce", 1): [("all_reduce", 0)],
        ("all_reduce", 2): [("all_reduce", 1)],
    }


def test_a_virtual_stage_waits_behind_its_last_receive_from_the_sandbox():
    """Stage 0 (virtual) sends two micro-batches to stage 1 (the sandbox) and receives their
    gradients: its second send goes once its first receive completed, not before."""
    s0 = [
        C(0, 10),
        M("send", 10, 5, peer=1),
        C(15, 10),
        M("recv", 25, 5, peer=1),
        C(30, 10),
        M("send", 40, 5, peer=1),
        M("recv", 45, 5, peer=1),
    ]
    s1 = [
        M("recv", 10, 5, peer=0),
        C(15, 10),
        M("send", 25, 5, peer=0),
        M("recv", 40, 5, peer=0),
        C(45, 1),
        M("send", 46, 5, peer=0),
    ]
    got = gates_of(make_trace([s0, s1]), sandbox=[1])
    sends = sorted(v for k, v in got.items() if k[0] == "send")
    recvs = sorted(v for k, v in got.items() if k[0] == "recv")
    assert len(got) == 4
    # the first send waits behind nothing; the first receive behind the first send (blocking);
    # the second send behind the first receive; the second receive behind the second send
    assert [] in sends and [] not in recvs
    assert all(len(v) == 1 for k, v in got.items() if v)
