"""`prism whatif CAL --scale SELECTOR:AMOUNT ... [--network FILE] [--out DIR] [--json]`: what a
faster kernel, a slower link or another network would do to the iteration time.

Re-solves the graph CAL was calibrated from with the spans a selector picks scaled
(``op=all_to_all:0.5``), shifted (``label~attention:+1ms``) or replaced (``op=all_reduce,group=dp:=2ms``),
or with the communication a network table covers timed from bandwidth and latency, and prints
the iteration time before and after and how the critical path moved. Memory is unchanged.

Selectors: op=NAME[|NAME] (compute or a communication op), label=TEXT, label~REGEX, group=KIND
(tp, pp, dp, ep, cp or a combination like tp-pp, from the graph's layout; or a group_desc),
size=N (group size; a send/recv pair is 2), rank=RANKS; conditions joined by commas all hold.
Amounts: 0.5 or x0.5 (factor), +2ms / -300us (added), =1.5ms (replaced). Network tables:
`prism docs whatif`.

--graph GRAPH solves GRAPH with its own durations instead of the graph CAL was solved from;
--layout gives the layout group= reads where the graph's manifest has none.

--spin LABEL=DURATION --out DIR -- SCRIPT ARGS measures instead of solving: the program is timed
again (as `prism time`, into DIR/time) with every compute span labelled LABEL longer by DURATION
of device work (a GPU spin kernel, a busy CPU), calibrated (DIR/cal), and the measured iteration
is printed beside CAL's and the re-solve's: what overlap and contention do to the change.
"""

from __future__ import annotations

import argparse
import sys

from rich.console import Console

from prismllm.calibrate.whatif import WhatIfError, load_network, parse_change, render, whatif
from prismllm.cli import options
from prismllm.pipeline.spin import SpinOptions, parse_spin, spin_whatif
from prismllm.report.html import fmt_ns
from prismllm.terminal import Table

SUMMARY = "re-solve a calibration with spans scaled or another network: the new iteration time"
EXAMPLES = r"""
# compute 30 % faster, all-to-all twice as fast: the iteration time before and after
prism whatif out/cal --scale 'op=compute:0.7' --scale 'op=all_to_all:0.5'
# measured instead: every span labelled mlp 2 ms longer, timed again (the program and its
# arguments as CAL's graph was captured; gpt3d.py --labels labels its spans)
prism whatif out/cal --spin mlp=2ms --out out/spin -- gpt3d.py --labels --tp 2 --pp 2
"""
PROGRAM_AFTER_DASHES = True  # `-- SCRIPT ARGS` after CAL and the options (cli.main)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("cal", metavar="CAL", help="a calibration (`prism calibrate --out CAL`, or OUT/cal of `prism run`)")
    p.add_argument(
        "--scale",
        action="append",
        default=[],
        metavar="SELECTOR:AMOUNT",
        help="change the spans SELECTOR picks by AMOUNT (repeatable; applied in order), e.g. 'op=all_to_all:0.5'",
    )
    p.add_argument(
        "--network",
        metavar="FILE",
        default=None,
        help="a TOML table of [[link]] entries (conditions, busbw_gbps, latency_us) that re-times the communication it covers",
    )
    p.add_argument(
        "--spin",
        action="append",
        default=[],
        metavar="LABEL=DURATION",
        help="measure instead of re-solving: time the program again with every span LABEL longer by DURATION "
        "(repeatable; needs --out and -- SCRIPT ARGS)",
    )
    options.add(p, "graph", "layout", "out", "devices", "parallel", "inputs", "tensors", "timeout", "force", "json")
    p.add_argument("--", dest="_program", metavar="SCRIPT ARGS", help="the program, with --spin", default=None)
    p.set_defaults(program=[])


def run(args: argparse.Namespace) -> int:
    program = args.program
    if args.spin:
        return run_spin(args, program)
    if program:
        raise WhatIfError(f"a program ({program[0]}) goes with --spin only; a re-solve needs none")
    changes = [parse_change(s) for s in args.scale]
    network = load_network(args.network) if args.network else []
    result = whatif(args.cal, changes, network, graph=args.graph, layout=args.layout, out=args.out)
    if args.json:
        options.print_json(result)
    else:
        render(result, Console())
    return 0


def run_spin(args: argparse.Namespace, program: list[str]) -> int:
    if args.scale or args.network or args.graph:
        raise WhatIfError("--spin measures its change alone: give it without --scale, --network or --graph")
    if not args.out:
        raise WhatIfError("--spin needs --out DIR (where the timing with the spins and its calibration go)")
    if not program:
        raise WhatIfError("--spin needs the program as it was captured: -- SCRIPT ARGS")
    opts = SpinOptions(
        cal=args.cal,
        spins=dict(parse_spin(s) for s in args.spin),
        script=program[0],
        args=program[1:],
        out=args.out,
        devices=args.devices,
        parallel=args.parallel,
        inputs=args.inputs,
        tensors=args.tensors,
        timeout=args.timeout,
        force=args.force,
    )
    result = spin_whatif(opts, say=lambda line: print(f"prism whatif: {line}", file=sys.stderr))
    if args.json:
        options.print_json(result)
        return 0
    base = result["baseline_iteration_ns"]
    spins = ", ".join(f"{k} +{v:g} ms ({result['spans_per_label'][k]:,} spans)" for k, v in result["spins_ms"].items())
    t = Table(title=f"what-if, measured: {spins}", title_justify="left", show_header=False, box=None)
    t.add_column(style="bold")
    t.add_column(justify="right")
    t.add_column()
    t.add_row("iteration, as calibrated", fmt_ns(base), "")
    for name, key in (("re-solved", "resolve_iteration_ns"), ("measured", "measured_iteration_ns")):
        v = result[key]
        t.add_row(f"iteration, {name}", fmt_ns(v), f"({100 * (v - base) / base:+.2f}%)" if base else "")
    Console().print(t)
    print(f"timing: {result['time']}; calibration: {result['cal']}")
    return 0
