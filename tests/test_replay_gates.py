"""The gates of a real-time replay (prismllm.replay.gates): which of the sandbox's completions each
call of the virtual ranks with the sandbox waits behind. Hand-made graphs of the three shapes
that matter: data-parallel buckets (asynchronous, waited at the end of the backward), tensor
parallelism (blocking, back to back) and a pipeline (send/recv with the sandbox's stage)."""

from __future__ import annotations

from test_replay_engine import C, M, make_trace

from prismllm.replay import ReplayGraph
from prismllm.replay.gates import external_gates


def gates_of(trace, sandbox):
    g = ReplayGraph(trace, external=sandbox)
    ptr, gates = external_gates(g)
    out = {}
    for j in range(g.num_instances):
        if g.inst_external[j]:
            out[(g.op_names[g.inst_op[j]], int(g.inst_seq[j]))] = sorted(
                (g.op_names[g.inst_op[i]], int(g.inst_seq[i])) for i in gates[ptr[j] : ptr[j + 1]]
            )
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
