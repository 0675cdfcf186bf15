"""`prism compare A B [--json] [--timing-only | --structure-only]`: compare two graphs.

Structure: per rank, the communication events in program order (op, group by its ranks,
bytes, dtype, reduce op, peer, splits, seq, tag, async, shape, iteration, label, coalesced
batch, wait point), where the compute spans lie, the iterations table's rows and labels, the
groups (by ranks and description), each graph's edges against what its nodes imply, and the
edge counts by kind; prints "equal", or "different" with the first difference and one line per
kind of difference found. The manifest keys that describe the job (layout, command, program,
device, mode, peak memory) are listed when they differ, for information. Timing: the steady
iteration time of each graph (median over all iterations but the first, of the slowest rank),
the relative error (B - A) / A overall and per rank, compute time per rank.

Exit status 0 when the structure is equal (or not compared: --timing-only; manifest
differences other than the world size do not count), 1 when it differs. With --json one object
is printed: {"structure": {"equal", "first_difference", "differences"} | null, "manifest":
[{"key", "a", "b", "message"}] | null, "timing": {"iteration_time_a_ns", "iteration_time_b_ns",
"rel_error", "per_rank", "iterations", "compute_ns", "host_bound_differs"} | null}; see
prismllm.trace.compare for the fields.
"""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.markup import escape

from prismllm.cli import options
from prismllm.errors import ExitCode
from prismllm.terminal import Table
from prismllm.trace.compare import compare_traces
from prismllm.trace.summary import fmt_ns

SUMMARY = "compare two graphs (structure and timing)"
EXAMPLES = r"""
# does the solo capture do what the real run did? (exit 1 when it does not)
prism compare out/real8 out/solo8 --structure-only
# how far is a calibrated prediction from a recording of the same job?
prism compare out/real8 out/cal8/graph --json
"""
WORST = 10


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("a", metavar="A", help="reference graph directory")
    p.add_argument("b", metavar="B", help="graph directory to judge against A")
    options.add(p, "json", "no_verify")
    only = p.add_mutually_exclusive_group()
    only.add_argument("--timing-only", action="store_true", help="compare timing only (exit 0)")
    only.add_argument("--structure-only", action="store_true", help="compare structure only")


def run(args: argparse.Namespace) -> int:
    a, b = options.load_graph(args.a, verify=args.verify), options.load_graph(args.b, verify=args.verify)
    res = compare_traces(a, b, structure=not args.timing_only, timing=not args.structure_only)
    if args.json:
        options.print_json(res.to_dict())
    else:
        render(res, Console(), args.a, args.b)
    return ExitCode.FAILED if res.structure_equal is False else 0


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.2f}%"


def render(res, console: Console, path_a: str, path_b: str) -> None:
    console.print(f"A: {path_a}\nB: {path_b}")
    if res.structure_equal is not None:
        if res.structure_equal:
            console.print("structure: [green]equal[/green]")
        else:
            first = escape(res.first_difference["message"])
            console.print(f"structure: [red]different[/red]: {first}", highlight=False, soft_wrap=True)
            for d in res.differences:
                if not d["informational"]:
                    console.print(f"  {d['message']}", highlight=False, markup=False, soft_wrap=True)
    if res.manifest:
        console.print("manifest:")
        for m in res.manifest:
            console.print(f"  {m['message']}", highlight=False, markup=False, soft_wrap=True)
    if not res.timing_checked:
        return
    t = Table(title="timing", title_justify="left", show_header=False)
    t.add_column(style="bold")
    t.add_column(justify="right")
    t.add_row("steady iteration time A", fmt_ns(res.iteration_time_a_ns))
    t.add_row("steady iteration time B", fmt_ns(res.iteration_time_b_ns))
    t.add_row("relative error (B-A)/A", _pct(res.rel_error))
    nt = res.node_times
    if nt is not None:
        big = nt.get("largest")
        where = (
            f"; largest: rank {big['rank']} node {big['index']} {big['column']} {big['a']} -> {big['b']}" if big else ""
        )
        t.add_row("nodes whose own times differ", f"{nt['differ']:,} of {nt['of']:,}{where}")
    errs = [(r, e) for r, e in res.per_rank.items() if e is not None]
    if errs:
        absmax = max(errs, key=lambda x: abs(x[1]))
        t.add_row("per rank: mean |error|", f"{100 * sum(abs(e) for _, e in errs) / len(errs):.2f}%")
        t.add_row("per rank: worst", f"rank {absmax[0]}: {_pct(absmax[1])}")
    console.print(t)
    if res.iterations:
        it = Table(title="per iteration (slowest rank)", title_justify="left")
        for col in ("iteration", "A", "B", "(B-A)/A"):
            it.add_column(col, justify="right")
        for x in res.iterations[:40]:
            it.add_row(str(x["iteration"]), fmt_ns(x["a_ns"]), fmt_ns(x["b_ns"]), _pct(x["rel_error"]))
        console.print(it)
    leads = any(c.get("host_lead_a_ns") is not None or c.get("host_lead_b_ns") is not None
                for c in res.compute_ns.values())  # fmt: skip
    if errs and len(errs) > 1:
        w = Table(title=f"ranks with the largest iteration-time error (of {len(errs)})", title_justify="left")
        for col in ("rank", "(B-A)/A", "compute A", "compute B") + (("host lead A", "host lead B") if leads else ()):
            w.add_column(col, justify="right")
        for r, e in sorted(errs, key=lambda x: -abs(x[1]))[:WORST]:
            c = res.compute_ns.get(r, {})
            lead = (fmt_ns(c.get("host_lead_a_ns")), fmt_ns(c.get("host_lead_b_ns"))) if leads else ()
            w.add_row(str(r), _pct(e), fmt_ns(c.get("a_ns")), fmt_ns(c.get("b_ns")), *lead)
        console.print(w)
    if res.host_bound_differs:
        r = res.host_bound_differs[0]
        c = res.compute_ns[r]
        more = len(res.host_bound_differs) - 1
        console.print(
            f"[yellow]host-bound in one graph only[/yellow]: rank {r}"
            + (f" and {more} more" if more else "")
            + f": its host issued each call {fmt_ns(c['host_lead_a_ns'])} (A) and {fmt_ns(c['host_lead_b_ns'])} (B)"
            " before the device reached it. Where that lead is under a millisecond the device waited for the"
            " host, and the rank's compute spans measure the host's pace (Python and launches), not its kernels:"
            " the compute difference is the host's, not the kernels' (`prism docs compare`).",
            highlight=False,
        )
