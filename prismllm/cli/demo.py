"""`prism demo [--world N] [--out DIR] [--force] [--devices cpu|cuda]`: the whole pipeline
(capture -> time -> calibrate -> emulate) on the embedded default job, with a short table."""

from __future__ import annotations

import argparse

from prismllm.demo import DemoOptions, run_demo


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "demo",
        help="run the whole pipeline on the embedded default job and print its figures",
        description=(
            "Capture a 32-rank job of examples/gpt3d.py (TP2 x PP2 x DP8, a tiny model) in solo mode, "
            "time every representative rank in its own slice, calibrate the timed graph, then emulate "
            "with the last rank real and the others replayed in real time; print the predicted and "
            "measured figures. CPU by default; with two GPUs or more, time and emulate use them."
        ),
    )
    p.add_argument("--world", type=int, default=32, metavar="N", help="logical world size (default 32)")
    p.add_argument("--out", default="out/demo", metavar="DIR", help="output directory (default out/demo)")
    p.add_argument("--devices", choices=["cpu", "cuda"], default=None,
                   help="where time and emulate run (default: cuda with two GPUs or more, else cpu)")
    p.add_argument("--force", action="store_true", help="replace DIR if it holds an earlier demo")
    p.set_defaults(run=run)
    return p


def _ms(ns) -> str:
    return "-" if ns is None else f"{ns / 1e6:.2f} ms"


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    console = Console(stderr=True)
    opts = DemoOptions(out=args.out, world=args.world, force=args.force, devices=args.devices)
    f = run_demo(opts, stage=lambda s: console.rule(f"[bold]prism demo: {s}"))
    t = Table(title=f"prism demo: gpt3d, {f['world']} ranks ({f['layout']}, DP{f['world'] // 4}) on {f['devices']}")
    t.add_column("figure")
    t.add_column("value", justify="right")
    t.add_row("predicted iteration (calibrated, all ranks)", _ms(f["predicted_iteration_ns"]))
    t.add_row(f"emulated iteration, rank {f['sandbox_rank']} real (median steady)", _ms(f["emulated_iteration_ns"]))
    t.add_row("virtual ranks' iteration as replayed", _ms(f["virtual_ranks_iteration_ns"]))
    pred, emu = f["predicted_iteration_ns"], f["emulated_iteration_ns"]
    if pred and emu:
        t.add_row("emulated vs predicted", f"{(emu - pred) / pred * 100:+.1f} %")
    if f["pipeline_bubble"] is not None:
        t.add_row("pipeline bubble (P2P wait / iteration)", f"{f['pipeline_bubble'] * 100:.1f} %")
    if f["busy_fraction_mean"] is not None:
        t.add_row("busy fraction (mean over ranks)", f"{f['busy_fraction_mean'] * 100:.1f} %")
    for kind, ns in sorted((f["critical_path_by_kind_ns"] or {}).items(), key=lambda kv: -kv[1])[:3]:
        t.add_row(f"critical path: {kind}", _ms(ns))
    mem = f["peak_memory_bytes"]
    t.add_row("peak memory of the real rank", f"{mem / 2**20:.1f} MiB" if mem >= 0 else "n/a (CPU)")
    for k, v in f["stage_wall_s"].items():
        t.add_row(f"wall time: {k}", f"{v:.1f} s")
    t.add_row("wall time: whole pipeline", f"{f['total_wall_s']:.1f} s")
    Console().print(t)
    console.print(f"prism demo: figures in {args.out}/demo.json; stage outputs in {args.out}/")
    return 0
