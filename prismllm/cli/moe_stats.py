"""`prism moe-stats GRAPH [--write FILE] [--json]`: the routing skew of a recorded MoE run, as the
balance statistics production jobs log, and as a routing file that replays it at any scale.

GRAPH is a recording made with `prism record --router-module SPEC` and no --routing: the mock
router observed every gating call (GRAPH/moe/). Printed per router (and over all of them):
br_min, br_max, br_avg, br_std, br_med, br_skew of the tokens per expert over the average, each
the mean over the calls. --write FILE writes them as a routing file: `prism capture --routing FILE
--router-module SPEC` then forces that skew on every rank of a job of any size.
`prism docs moe-stats` has the long form.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console

from prismllm.cli import options
from prismllm.fsutil import write_file_atomically
from prismllm.routing import measure
from prismllm.routing.contract import OBSERVE_DIR
from prismllm.routing.stats import FIELDS, RoutingError
from prismllm.terminal import Table

SUMMARY = "the routing skew of a recorded MoE run: balance statistics, and a routing file to replay it"
EXAMPLES = r"""
# the routing skew of a real 4-rank MoE run, written as a routing file
prism record --nproc 4 --router-module Router --out out/moe4 -- gpt3d.py --ep 4 --num-experts 8
prism moe-stats out/moe4 --write skew.json
# that skew forced on every rank of a 1024-rank capture
prism capture --world 1024 --layout pp=4,ep=8 --router-module Router --routing skew.json \
    --out out/moe1024 -- gpt3d.py --pp 4 --ep 8 --num-experts 8 --global-batch 1024
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("graph", metavar="GRAPH", help="a recording made with --router-module (and no --routing)")
    p.add_argument("--write", metavar="FILE", default=None, help="write the statistics as a routing file")
    options.add(p, "json")


def run(args: argparse.Namespace) -> int:
    d = Path(args.graph) / OBSERVE_DIR
    if not d.is_dir():
        raise RoutingError(
            f"{args.graph} holds no observed routing ({OBSERVE_DIR}/): record it with "
            "`prism record --router-module SPEC` (and no --routing)"
        )
    routing = measure(d)
    if args.write:
        write_file_atomically(args.write, json.dumps(routing, indent=1) + "\n")
    if args.json:
        options.print_json(routing)
        return 0
    t = Table(title=f"routing of {args.graph}: {routing['note']}", title_justify="left")
    t.add_column("router (routing-file pattern)")
    for f in FIELDS:
        t.add_column(f, justify="right")
    for name, s in [("all routers (default)", routing["default"]), *routing["modules"].items()]:
        t.add_row(name, *(f"{s[f]:.3f}" for f in FIELDS))
    console = Console()
    console.print(t)
    if args.write:
        console.print(f"written: {args.write}", highlight=False)
    return 0
