"""`prism emulate --assistants K`: the pruned groups are shared out among K assistant
processes (each replays the same plan of every virtual rank and plays the proxy of its own
groups). gpt3d TP2·DP2 at N = 4 with the last rank (which prints the losses) in the sandbox
and two assistants: the losses equal the real 4-rank run's, both assistants played groups,
and every process ended.
"""

from __future__ import annotations

import json
import re

import pytest
from test_emulate import GPT3D, LAYOUTS, SIZES

from prismllm.emulate import EmulateOptions, emulate
from prismllm.errors import PrismError

# test_emulate's TP2 program at N = 4: its real recording is shared (conftest.gpt3d_recording)
ARGS = [*LAYOUTS["tp2"], *SIZES]


def test_two_assistants_share_the_groups(tmp_path, capfd, gpt3d_recording):
    rec = gpt3d_recording(4, ARGS, save_tensors="all,inputs")
    real = rec.out
    real_loss = [r["loss"] for r in rec.log]

    out = tmp_path / "emu"
    res = emulate(
        EmulateOptions(
            graph=real,
            sandbox="3",
            out=out,
            script=GPT3D,
            args=[*ARGS, "--json-log", str(tmp_path / "emu.json")],
            timeout=240,
            assistants=2,
        )
    )
    emu_loss = [r["loss"] for r in json.loads((tmp_path / "emu.json").read_text())]
    assert emu_loss == pytest.approx(real_loss, rel=1e-5)
    info = json.loads((out / "emulate.json").read_text())
    assert info["assistants"] == 2 and info["assistant_returncodes"] == [0, 0]
    assert len(info["pids"]["assistants"]) == 2
    text = capfd.readouterr().out
    played = {int(m[1]): int(m[2]) for m in re.finditer(r"prism assistant (\d) of 2: replayed .* on (\d+) group", text)}
    assert sorted(played) == [0, 1] and all(n >= 1 for n in played.values()), text[-2000:]
    assert res.replay["answered"] > 0

    with pytest.raises(PrismError, match="--assistants must be 1 or more"):
        emulate(EmulateOptions(graph=real, sandbox="3", out=tmp_path / "bad", script=GPT3D, args=ARGS, assistants=0))


def test_the_proxy_launches_in_the_sandbox_ranks_order(gpt3d_recording):
    """On NCCL the proxy must launch its calls on the small communicators in the order the
    sandbox ranks make them (a TP2-PP2 slice on one GPU hung with the proxy ahead on the TP
    group while the sandbox waited in a pipeline recv). The order is each sandbox rank's program
    order, merged over the sandbox ranks; checked here on the recorded TP2-PP2 graph at N = 4."""
    from prismllm.assistant.proxy import Assistant, _merge_orders
    from prismllm.trace.graph import PrismTrace

    rec = gpt3d_recording(4, ["--tp", "2", "--pp", "2", *SIZES], save_tensors="all,inputs")
    trace = PrismTrace.load(rec.out)
    for sandbox in [(0,), (1, 2), (0, 3)]:
        a = Assistant(trace, sandbox, None, connect=lambda: None, backend="gloo")
        order = a._sandbox_order()
        mine = {i for grp in a.groups.values() for i in grp.upcoming}
        assert set(order) == mine and sorted(order.values()) == list(range(len(mine)))
        # every sandbox rank's calls come in its program order
        g = a.graph
        for r in sandbox:
            rows = trace.program_order()
            comm = rows[(trace.column("rank")[rows] == r) & (trace.column("kind")[rows] == "comm")]
            places = []
            for row in comm.tolist():
                for i, k in order.items():
                    nodes = g.inst_nodes[g.inst_ptr[i] : g.inst_ptr[i + 1]]
                    if _touches(trace, g, nodes, row):
                        places.append(k)
                        break
            assert places == sorted(places), (sandbox, r)
    assert _merge_orders([[1, 2, 3], [2, 4], [1, 4]]) == [1, 2, 3, 4]
    assert _merge_orders([[1, 2], [2, 1]]) is None


def _touches(trace, g, nodes, row) -> bool:
    """Whether the sandbox node at trace row ``row`` belongs to the instance of virtual ``nodes``
    (same group and seq for a collective; the matched partner for a send/recv)."""
    op = trace.column("op")[row]
    vrows = g.row[nodes]
    if op in ("send", "recv"):
        peer = int(trace.column("peer")[row])
        return any(
            trace.column("op")[v] != op
            and int(trace.column("rank")[v]) == peer
            and int(trace.column("peer")[v]) == int(trace.column("rank")[row])
            and trace.column("group")[v] == trace.column("group")[row]
            and _nth(trace, v) == _nth(trace, row)
            for v in vrows.tolist()
        )
    return any(
        trace.column("group")[v] == trace.column("group")[row] and trace.column("seq")[v] == trace.column("seq")[row]
        for v in vrows.tolist()
    )


def _nth(trace, row) -> int:
    """The ordinal of a send (recv) among its rank's sends (recvs) to (from) that peer on that group."""
    r, op, peer, grp, idx = (trace.column(c)[row] for c in ("rank", "op", "peer", "group", "index"))
    m = (
        (trace.column("rank") == r)
        & (trace.column("op") == op)
        & (trace.column("peer") == peer)
        & (trace.column("group") == grp)
        & (trace.column("index") < idx)
    )
    return int(m.sum())


def test_each_worker_serves_its_calls_in_the_launch_order(gpt3d_recording):
    """With the sandbox's launch order (NCCL), each group's worker must also be handed its calls
    in that order: handed by peer, a middle pipeline stage's P2P group queued every send to the
    previous stage before the receives from the next, and the worker waited for the turn of a
    call its own queue held behind it (every middle-stage slice of a 1024-rank PP4·EP8 run on
    one GPU hung). Checked on the PP4 recording at N = 8 with a middle stage's rank real."""
    from test_record_gpt3d import recording

    from prismllm.assistant.proxy import Assistant
    from prismllm.trace.graph import PrismTrace

    trace = PrismTrace.load(recording(gpt3d_recording, "pp4").out)
    a = Assistant(trace, (2,), None, connect=lambda: None, backend="gloo", sandbox_order=True)
    turn = a._turn
    queued: dict[int, list[int]] = {}
    for jobs in a.schedule():
        queued.setdefault(jobs[0].event.group, []).append(min(turn[j.event.instance] for j in jobs))
    p2p = [gid for gid, grp in a.groups.items() if len(grp.ranks) == 4]  # the pipeline group
    assert p2p and all(len(queued[gid]) > 4 for gid in p2p)
    for gid, turns in queued.items():
        assert turns == sorted(turns), (a.trace.group_label(gid), turns[:12])
        assert [turn[i] for i in a.groups[gid].upcoming] == sorted(turn[i] for i in a.groups[gid].upcoming)
