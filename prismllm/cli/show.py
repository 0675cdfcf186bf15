"""`prism show DIR [--json]`: what a graph holds — world, ops, bytes per group, iteration
times, peak memory. The graph is loaded and validated first; a bad graph is one error line.
The JSON keys are documented in :mod:`prismllm.trace.summary`."""

from __future__ import annotations

import argparse

from rich.console import Console

from prismllm.cli import options
from prismllm.terminal import Table
from prismllm.trace.graph import ranks_text
from prismllm.trace.summary import fmt_bytes, fmt_ns, summarize

SUMMARY = "summarise a recorded graph"
EXAMPLES = r"""
# what a graph holds: world, ops, bytes per group, iteration times, peak memory
prism show out/tp2pp2
# the same as JSON
prism show out/demo/cal/graph --json
"""
RAW_DESCRIPTION = False  # a docstring in prose, wrapped to the terminal
MAX_ROWS = 20


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("graph", metavar="DIR", help="graph directory")
    options.add(p, "json", "no_verify")


def run(args: argparse.Namespace) -> int:
    trace = options.load_graph(args.graph, verify=args.verify)
    s = {"path": str(args.graph), **summarize(trace)}
    if args.json:
        options.print_json(s)
        return 0
    texts = {gid: ranks_text(g["ranks"]) for gid, g in trace.group_info().items()}
    render(s, Console(), texts)
    return 0


def render(s: dict, console: Console, rank_text: dict[int, str] | None = None) -> None:
    rank_text = rank_text or {}
    head = Table(title=f"PrismTrace {s['path']}", show_header=False, title_justify="left")
    head.add_column(style="bold")
    head.add_column()
    dev = s["device"] if not isinstance(s["device"], list) else ", ".join(s["device"])
    for k, v in (
        ("world size", s["world_size"]),
        ("mode", s["mode"] or "-"),
        ("device", dev or "-"),
        ("command", s["command"] or "-"),
        ("ranks", s["ranks"]),
        ("nodes / edges", f"{s['nodes']} / {s['edges']}"),
        ("iterations", s["iterations"]),
        ("iteration time", _iter_line(s)),
    ):
        head.add_row(k, str(v))
    console.print(head)

    ops = Table(title="nodes by op", title_justify="left")
    ops.add_column("op")
    ops.add_column("nodes", justify="right")
    for op, n in s["nodes_by_op"].items():
        ops.add_row(op, str(n))
    console.print(ops)

    if s["bytes_by_group"]:
        g = Table(title="bytes by group (sum of in_bytes over all ranks)", title_justify="left")
        for col, j in (("group", "right"), ("desc", "left"), ("ranks", "left"), ("ops", "left"), ("in_bytes", "right")):
            g.add_column(col, justify=j)
        for e in s["bytes_by_group"][:MAX_ROWS]:
            ops_txt = ", ".join(f"{op}×{n}" for op, n in e["ops"].items())
            g.add_row(
                str(e["group"]), e["desc"], rank_text.get(e["group"], str(e["size"])), ops_txt, fmt_bytes(e["in_bytes"])
            )
        more = len(s["bytes_by_group"]) - MAX_ROWS
        if more > 0:
            g.caption = f"... {more} more groups (--json lists all)"
        console.print(g)

    if s["iteration_times"]:
        t = Table(title="iteration time (end - start over ranks)", title_justify="left")
        for col in ("iteration", "ranks", "mean", "max", ""):
            t.add_column(col, justify="right" if col else "left")
        steady = set(s["steady_iterations"])
        for it in s["iteration_times"][: 2 * MAX_ROWS]:
            t.add_row(
                str(it["iteration"]),
                str(it["ranks"]),
                fmt_ns(it["mean_ns"]),
                fmt_ns(it["max_ns"]),
                "" if it["iteration"] in steady else "warm-up",
            )
        console.print(t)

    peak = s["peak_memory_bytes"]
    if peak:
        t = Table(title="peak memory per rank", title_justify="left")
        t.add_column("rank", justify="right")
        t.add_column("peak", justify="right")
        items = sorted(peak.items(), key=lambda kv: -kv[1])
        if len(items) > MAX_ROWS:
            vals = [v for _, v in items]
            t.caption = (
                f"{len(items)} ranks: max {fmt_bytes(vals[0])}, min {fmt_bytes(vals[-1])}, "
                f"mean {fmt_bytes(sum(vals) / len(vals))}; the {MAX_ROWS} highest shown"
            )
            items = items[:MAX_ROWS]
        else:
            items = sorted(items, key=lambda kv: int(kv[0]))
        for r, v in items:
            t.add_row(r, fmt_bytes(v))
        console.print(t)


def _iter_line(s: dict) -> str:
    if s["iteration_time_ns"] is None:
        return "- (no times in this graph)"
    n = len(s["steady_iterations"])
    return (
        f"{fmt_ns(s['iteration_time_ns'])} (median over {n} steady iteration{'s' if n != 1 else ''} "
        f"of the slowest rank; mean over ranks {fmt_ns(s['iteration_time_mean_ns'])})"
    )
