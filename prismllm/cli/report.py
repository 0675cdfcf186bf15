"""`prism report DIR [--html FILE] [--reference REAL] [--compare OTHER] [--ranks RANKS] [--json]`: the report of
a `prism run` directory, a self-contained HTML page (prismllm.report)."""

from __future__ import annotations

import argparse

from prismllm.cli import options
from prismllm.errors import PrismError
from prismllm.report import write_report
from prismllm.specs import parse_ranks

SUMMARY = "write the HTML report of a `prism run` directory"
EXAMPLES = r"""
# rewrite out/demo/report.html
prism report out/demo
# a real 8-rank run beside the prediction, into a page of its own
prism report out/run8 --reference out/real8 --html run8.html
# two runs side by side (two sweep points, a job before and after a change)
prism report out/tp4 --compare out/tp2 --html tp4-vs-tp2.html
"""
RAW_DESCRIPTION = False  # a docstring in prose, wrapped to the terminal


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="DIR", help="a `prism run` directory (calibrated at least)")
    p.add_argument("--html", default=None, metavar="FILE", help="where to write the page (default DIR/report.html)")
    p.add_argument(
        "--reference",
        default=None,
        metavar="REAL",
        help="a real run of the same job (a `prism record` graph): shown beside the prediction, rank by rank",
    )
    p.add_argument(
        "--compare",
        default=None,
        metavar="OTHER",
        help="another `prism run` directory: its figures beside this run's, with the change from it",
    )
    options.add(p, "ranks", "json")


def run(args: argparse.Namespace) -> int:
    ranks = None
    if args.ranks:
        try:
            ranks = list(parse_ranks(args.ranks))
        except ValueError as e:
            raise PrismError(f"--ranks: {e}") from None
    path = write_report(args.run_dir, args.html, reference=args.reference, ranks=ranks, against=args.compare)
    if args.json:
        options.print_json(
            {
                "run": args.run_dir,
                "report": path.resolve(),
                "reference": args.reference,
                "compare": args.compare,
                "ranks": ranks,
            }
        )
    else:
        print(f"prism report: wrote {path} (open it in a browser: file://{path.resolve()})")
    return 0
