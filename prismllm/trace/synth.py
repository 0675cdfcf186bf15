"""Hand-made rank logs for tests and benchmarks (no torch, no processes).

``example_logs()``: 4 ranks, every kind of event the graph knows (a TP all_reduce, an async DP
all_reduce with a later wait, all_gather, reduce_scatter, an all_to_all with uneven splits, a
send/recv pair, iteration boundaries), with times.

``synthetic_logs(world_size, nodes_per_rank)``: a large 3D-parallel-like program (TP groups of
8, DP groups across them, pipeline send/recv between neighbouring stages) for scale checks.
"""

from __future__ import annotations

from typing import Any

from prismllm.trace.ranklog import GroupInfo, RankLog

STEP_NS = 10_000  # each node of the example lasts 10 µs


def _rows(i: int, j: int) -> int:
    """Rows rank i sends to rank j in the example's all_to_all (uneven on purpose)."""
    return 1 + i + 2 * j


def example_groups(world_size: int = 4) -> list[GroupInfo]:
    half = world_size // 2
    groups = [GroupInfo("0", "default_pg", list(range(world_size)))]
    for t in range(world_size // 2):
        groups.append(GroupInfo(f"tp{t}", f"tp{t}", [2 * t, 2 * t + 1]))
    for d in range(2):
        groups.append(GroupInfo(f"dp{d}", f"dp{d}", [d + 2 * k for k in range(half)]))
    return groups


def example_program(rank: int, world_size: int = 4, iterations: int = 2) -> list[dict[str, Any]]:
    """The node rows of one rank (without times)."""
    tp = f"tp{rank // 2}"
    dp = f"dp{rank % 2}"
    nodes: list[dict[str, Any]] = []

    def add(**kw: Any) -> int:
        kw.setdefault("op", "compute")
        kw["kind"] = "compute" if kw["op"] == "compute" else "comm"
        kw["rank"] = rank
        kw["index"] = len(nodes)
        nodes.append(kw)
        return kw["index"]

    add(iteration=-1, label="setup")
    # pipeline-like pairs: even ranks < half send to rank + half (same tp position)
    half = world_size // 2
    for it in range(iterations):
        add(iteration=it, label="forward")
        add(
            iteration=it,
            op="all_reduce",
            group_name=tp,
            in_bytes=4096,
            out_bytes=4096,
            dtype="float32",
            shape=[32, 32],
            reduce_op="sum",
            api="allreduce",
        )
        add(iteration=it)
        ar = add(
            iteration=it,
            op="all_reduce",
            group_name=dp,
            in_bytes=8192,
            out_bytes=8192,
            dtype="bfloat16",
            shape=[4096],
            reduce_op="avg",
            async_op=True,
            api="allreduce",
        )
        add(iteration=it)
        w = add(iteration=it, label="after-grad-wait")
        nodes[ar]["wait_index"] = w
        add(
            iteration=it,
            op="all_gather",
            group_name="0",
            in_bytes=1024,
            out_bytes=1024 * world_size,
            dtype="float32",
            shape=[256],
            api="all_gather_into_tensor",
        )
        add(
            iteration=it,
            op="reduce_scatter",
            group_name="0",
            in_bytes=1024 * world_size,
            out_bytes=1024,
            dtype="float32",
            shape=[256 * world_size],
            reduce_op="sum",
            api="reduce_scatter_tensor",
        )
        ins = [_rows(rank, j) for j in range(world_size)]
        outs = [_rows(j, rank) for j in range(world_size)]
        add(
            iteration=it,
            op="all_to_all",
            group_name="0",
            in_bytes=sum(ins) * 64,
            out_bytes=sum(outs) * 64,
            dtype="float32",
            shape=[sum(ins), 16],
            in_splits=ins,
            out_splits=outs,
            api="alltoall_base",
        )
        if rank < half:
            add(
                iteration=it,
                op="send",
                group_name="0",
                peer=rank + half,
                in_bytes=2048,
                dtype="float32",
                shape=[512],
                api="send",
            )
        else:
            add(
                iteration=it,
                op="recv",
                group_name="0",
                peer=rank - half,
                out_bytes=2048,
                dtype="float32",
                shape=[512],
                api="recv",
            )
        add(iteration=it, label="optimizer")
    return nodes


def example_logs(
    world_size: int = 4, iterations: int = 2, times: bool = True, t0: int = 1_000_000_000
) -> list[RankLog]:
    """The 4-rank example (world_size must be even). With ``times``, every node lasts
    STEP_NS on every rank (in lockstep) and iterations span their nodes."""
    logs = []
    for rank in range(world_size):
        nodes = example_program(rank, world_size, iterations)
        its: list[dict[str, Any]] = []
        if times:
            for n in nodes:
                start = t0 + n["index"] * STEP_NS
                n.update(issue_ns=start, start_ns=start, end_ns=start + STEP_NS, duration_ns=STEP_NS)
            for it in range(iterations):
                mine = [n for n in nodes if n.get("iteration") == it]
                its.append(
                    {
                        "iteration": it,
                        "start_ns": mine[0]["start_ns"],
                        "end_ns": mine[-1]["end_ns"] + rank * 1000,
                        "label": "",
                    }
                )
        else:
            for it in range(iterations):
                its.append({"iteration": it, "start_ns": -1, "end_ns": -1, "label": ""})
        logs.append(
            RankLog(
                rank=rank,
                world_size=world_size,
                device="cpu",
                clock="host",
                nodes=nodes,
                groups=example_groups(world_size),
                iterations=its,
                peak_memory_bytes=(1 << 30) + rank * 1024,
            )
        )
    return logs


def synthetic_logs(
    world_size: int, nodes_per_rank: int = 500, tp: int = 8, pp: int = 4, iterations: int = 2
) -> list[RankLog]:
    """A large program: per layer step a TP all_reduce, compute, and per iteration a DP
    reduce_scatter/all_gather pair and pipeline send/recv between stages. Lockstep times."""
    tp = min(tp, world_size)
    pp = max(1, min(pp, world_size // tp))
    dp = world_size // (tp * pp)
    assert tp * pp * dp == world_size, "world_size must be divisible by tp * pp"
    groups = [GroupInfo("0", "default_pg", list(range(world_size)))]
    # rank = ((p * dp) + d) * tp + t
    for p in range(pp):
        for d in range(dp):
            base = (p * dp + d) * tp
            groups.append(GroupInfo(f"tp_{p}_{d}", "tp", list(range(base, base + tp))))
    for p in range(pp):
        for t in range(tp):
            groups.append(GroupInfo(f"dp_{p}_{t}", "dp", [(p * dp + d) * tp + t for d in range(dp)]))
    by_name = {g.name: i for i, g in enumerate(groups)}
    per_iter = max(8, nodes_per_rank // iterations)
    layer_steps = max(1, (per_iter - 6) // 2)
    logs = []
    t0 = 1_000_000_000
    for rank in range(world_size):
        t = rank % tp
        d = (rank // tp) % dp
        p = rank // (tp * dp)
        tpg, dpg = f"tp_{p}_{d}", f"dp_{p}_{t}"
        nodes: list[dict[str, Any]] = []
        its = []
        for it in range(iterations):
            first = len(nodes)
            if p > 0:
                nodes.append(
                    {
                        "index": len(nodes),
                        "kind": "comm",
                        "op": "recv",
                        "group_name": "0",
                        "peer": rank - tp * dp,
                        "out_bytes": 1 << 20,
                        "dtype": "bfloat16",
                        "iteration": it,
                    }
                )
            for _ in range(layer_steps):
                nodes.append({"index": len(nodes), "kind": "compute", "op": "compute", "iteration": it})
                nodes.append(
                    {
                        "index": len(nodes),
                        "kind": "comm",
                        "op": "all_reduce",
                        "group_name": tpg,
                        "in_bytes": 1 << 22,
                        "out_bytes": 1 << 22,
                        "dtype": "bfloat16",
                        "reduce_op": "sum",
                        "iteration": it,
                        "shape": [2048, 1024],
                    }
                )
            if p < pp - 1:
                nodes.append(
                    {
                        "index": len(nodes),
                        "kind": "comm",
                        "op": "send",
                        "group_name": "0",
                        "peer": rank + tp * dp,
                        "in_bytes": 1 << 20,
                        "dtype": "bfloat16",
                        "iteration": it,
                    }
                )
            rs = len(nodes)
            nodes.append(
                {
                    "index": rs,
                    "kind": "comm",
                    "op": "reduce_scatter",
                    "group_name": dpg,
                    "in_bytes": dp * 4096,
                    "out_bytes": 4096,
                    "dtype": "float32",
                    "reduce_op": "avg",
                    "async_op": True,
                    "iteration": it,
                }
            )
            nodes.append({"index": len(nodes), "kind": "compute", "op": "compute", "iteration": it})
            nodes.append({"index": len(nodes), "kind": "compute", "op": "compute", "iteration": it})
            nodes[rs]["wait_index"] = len(nodes) - 1
            nodes.append(
                {
                    "index": len(nodes),
                    "kind": "comm",
                    "op": "all_gather",
                    "group_name": dpg,
                    "in_bytes": 4096,
                    "out_bytes": dp * 4096,
                    "dtype": "float32",
                    "iteration": it,
                }
            )
            nodes.append(
                {"index": len(nodes), "kind": "compute", "op": "compute", "iteration": it, "label": "optimizer"}
            )
            for n in nodes[first:]:
                s = t0 + n["index"] * 1000
                n["start_ns"], n["end_ns"], n["duration_ns"] = s, s + 1000, 1000
            its.append(
                {"iteration": it, "start_ns": nodes[first]["start_ns"], "end_ns": nodes[-1]["end_ns"], "label": ""}
            )
        # a rank's backend sees only the groups it is a member of
        mine = [groups[0], groups[by_name[tpg]], groups[by_name[dpg]]]
        logs.append(
            RankLog(
                rank=rank,
                world_size=world_size,
                device="cpu",
                clock="host",
                nodes=nodes,
                groups=mine,
                iterations=its,
                peak_memory_bytes=-1,
            )
        )
    return logs
