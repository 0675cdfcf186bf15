"""`prism run`: from a training program to its figures at scale, in one command.

    prism run --world N [--layout tp=..,pp=..] [--devices ...] [--parallel K] [--sandbox RANKS]
              --out DIR [--inputs ...] [--tensors STORE] [--rules FILE] [--timeout S] [--force] [--json]
              -- SCRIPT ARGS...

Shaped like torchrun: the job SCRIPT ARGS at N ranks. Runs `prism capture` (solo, one rank per
replica class with --layout), `prism time` (every captured rank real in its slice), `prism
calibrate`, with --sandbox `prism emulate` (those ranks real, every other one replayed in real
time), and `prism report`, each into its own directory of DIR. Prints the predicted iteration time,
the peak memory and where it is, the pipeline bubble and the critical path's shares, and where the
report is. Run the same command again to resume a run that stopped.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console

from prismllm.cli import options
from prismllm.cli.program import add_program_args, program_args
from prismllm.cli.progress import Display, fmt_seconds
from prismllm.emulate.run import clock_note
from prismllm.launch import LaunchInterrupted, RankOutOfMemory
from prismllm.pipeline.run import RunOptions, run_pipeline
from prismllm.report.html import iterations_text
from prismllm.terminal import Table

SUMMARY = "capture, time, calibrate (and emulate) a job of N ranks, then write its report"
EXAMPLES = r"""
# the whole pipeline at 32 ranks, rank 31 run for real (gpt3d.py: `prism example` writes it)
prism run --world 32 --layout tp=2,pp=2 --sandbox 31 --out out/demo \
    -- gpt3d.py --tp 2 --pp 2 --layers 2 --hidden 32 --heads 4 --seq 16 --vocab 128 \
       --micro-batch 1 --global-batch 32 --iters 3
# 1024 ranks, captured on two GPUs; the same command again resumes where it stopped
prism run --world 1024 --layout tp=2,pp=8 --devices cuda:0,1 --out out/w1024 \
    -- gpt3d.py --tp 2 --pp 8 --layers 8 --global-batch 128 --micro-batch 1
"""
RUNS_PROGRAM = True  # its processes import torch: cli.main checks for it before anything starts


def add_arguments(p: argparse.ArgumentParser) -> None:
    options.add(p, "world", "out", required=("world", "out"))
    options.add(p, *PIPELINE_FLAGS)
    add_program_args(p, prefix=False)


# the flags of a whole pipeline run (prism run; prism sweep, for each point)
PIPELINE_FLAGS = ("capture", "layout", "devices", "cuda_on_cpu", "router_module", "routing", "parallel", "sandbox", "inputs",
                  "tensors", "rules", "head_start", "warmup", "timeout", "force", "json")  # fmt: skip


class UI:
    """The run's progress (pipeline.run.RunUI) on a Display."""

    def __init__(self, display: Display):
        self.display = display

    def stage(self, name: str, total: int | None = None, unit: str = "", done: int = 0) -> None:
        self.display.stage(name, total=total, unit=unit, done=done)

    def update(self, done: int, total: int | None = None, note: str = "") -> None:
        self.display.update(done, total, note)

    def say(self, text: str) -> None:
        self.display.say(text)


def _ms(ns) -> str:
    return "-" if ns is None else f"{ns / 1e6:.2f} ms"


def _mib(b) -> str:
    return f"{b / 2**20:,.1f} MiB"


def render(s: dict, console: Console) -> None:
    """The closing lines: the figures first, then the stages, then where the report is."""
    t = Table(show_header=False, box=None, padding=(0, 1))
    t.add_column(style="bold")
    t.add_column()
    cmd = " ".join(s.get("command") or [])
    t.add_row("job", f"{cmd} at {s['world_size']} ranks")
    its = s.get("steady_iterations") or []
    which = f"iteration {its[0]}" if len(its) == 1 else f"iterations {iterations_text(its)}" if its else "none"
    t.add_row("predicted iteration", f"{_ms(s['predicted_iteration_ns'])}  (calibrated, median of {which}, all ranks)")
    for r, m in sorted((s.get("emulated") or {}).items(), key=lambda kv: int(kv[0])):
        where = s.get("emulated_devices") or "?"
        t.add_row(
            f"emulated, rank {r} real",
            f"{_ms(m['iteration_ns'])}  (on {where}"
            + (", a shared GPU: communication over sockets" if s.get("shared_gpu") else "")
            + ")",
        )
        clocks = clock_note(m.get("gpu"), m.get("slice_gpu"))
        if clocks:  # a GPU at its power limit: its time moves with the clock
            t.add_row("", clocks)
    peak = s.get("peak_memory")
    if peak:
        t.add_row(
            "peak memory",
            f"{_mib(peak['bytes'])} on rank {peak['rank']} ({peak['where']}); least {_mib(peak['min_bytes'])}",
        )
        for r, m in sorted((s.get("emulated") or {}).items(), key=lambda kv: int(kv[0])):
            if m.get("peak_memory_bytes") is not None:
                t.add_row(f"peak memory, rank {r} real", _mib(m["peak_memory_bytes"]))
    else:
        t.add_row("peak memory", f"not measured: {s['peak_memory_reason']}")
    if s.get("pipeline_bubble") is not None:
        t.add_row("pipeline bubble", f"{100 * s['pipeline_bubble']:.1f} % of the iteration (P2P wait)")
    shares = sorted((s.get("critical_path_shares") or {}).items(), key=lambda kv: -kv[1])
    if shares:
        t.add_row("critical path", ", ".join(f"{k} {100 * v:.0f} %" for k, v in shares[:4]))
    console.print(t)
    st = Table(show_header=False, box=None, padding=(0, 1))
    st.add_column(style="dim")
    st.add_column(justify="right", style="dim")
    st.add_column(justify="right", style="dim")  # this process's peak host memory in the stage
    st.add_column(style="dim")
    for x in s.get("stages", []):
        rss = x.get("peak_rss_bytes")
        st.add_row(
            x["name"], fmt_seconds(x["wall_s"]), "" if rss is None else f"host {rss / 2**30:.1f} GiB", x.get("what", "")
        )
    console.print(st)
    console.print(
        f"report: {s['report']}  (open it in a browser: file://{s['report']})", highlight=False, soft_wrap=True
    )


def run(args: argparse.Namespace) -> int:
    display = Display("run")
    opts = RunOptions.from_fields(args, args=program_args(args))
    try:
        s = run_pipeline(opts, UI(display))
    except LaunchInterrupted as e:
        display.stop()
        display.say(f"{e}; run the same command again to go on where it stopped")
        return e.exit_code
    except RankOutOfMemory as e:  # a result (capture or emulate): the job runs out of memory at this scale
        display.stop()
        display.say(str(e))
        return e.exit_code
    finally:
        display.stop()
    if args.json:
        options.print_json(s)
    else:
        s["report"] = str(Path(s["report"]).resolve())
        render(s, Console(file=sys.stdout))
    return 0
