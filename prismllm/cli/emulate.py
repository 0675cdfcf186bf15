"""`prism emulate`: sandbox ranks run the real program, an assistant replays the others.

    prism emulate --graph GRAPH --sandbox RANKS --out DIR [--devices ...] [--inputs ...] [--tensors STORE]
                  [--timing auto|fast|real] [--assistants K] [--check] [--rdzv-endpoint HOST:PORT [--rdzv-token-file TOKEN]
                  --role all|sandbox|assistant] [--timeout S] [--force] [--tee] [--prefix] [--json]
                  -- SCRIPT ARGS...

Run SCRIPT for real as the sandbox ranks of the N-rank job the graph GRAPH describes (torchrun's
environment for each of them, WORLD_SIZE = N); every other rank is virtual, replayed from the graph
by one assistant process that takes part in every collective with the sandbox, contributing the
virtual ranks' recorded (or generated) inputs; CPU (gloo) or GPU (NCCL).

Exit status 1 (failed) when a sandbox rank crashed or ran out of memory (a reproduced OOM: a
result of the emulation, reported as such), or when --check finds an output that differs from the
recording by more than rounding (one line naming the rank, the call and the difference).
"""

from __future__ import annotations

import argparse
import sys

from prismllm.childenv import TIMINGS
from prismllm.cli import options
from prismllm.cli.program import add_program_args, line_prefix, program_args
from prismllm.cli.progress import Display
from prismllm.emulate.run import EmulateOptions, SandboxOutOfMemory, clock_note, emulate
from prismllm.errors import ExitCode
from prismllm.launch import LaunchInterrupted

SUMMARY = "run a few ranks for real inside the virtual world of a recorded graph"
EXAMPLES = r"""
# ranks 0 and 1023 real, every other rank replayed in real time from the calibrated graph
prism emulate --graph out/cal/graph --sandbox 0,1023 --out out/emu \
    -- gpt3d.py --tp 2 --pp 8 --layers 8 --global-batch 128 --micro-batch 1
# rank 1 real inside a recording with saved tensors, its outputs checked against it
prism emulate --graph out/real --sandbox 1 --out out/emu-check --check -- gpt3d.py --tp 2
"""
RUNS_PROGRAM = True  # its processes import torch: cli.main checks for it before anything starts


def add_arguments(p: argparse.ArgumentParser) -> None:
    options.add(p, "graph", "sandbox", "out", required=("graph", "sandbox", "out"))
    options.add(p, "devices", "tensors", "inputs", "timeout")
    p.add_argument(
        "--check",
        action="store_true",
        help="compare every pruned collective's output on the sandbox with the recorded "
        "run's (needs outputs in the store: --save-tensors all,inputs) and exit 1 when one differs "
        "by more than rounding; summary in DIR/check-rank-R.json",
    )
    p.add_argument(
        "--rdzv-endpoint",
        default=None,
        metavar="HOST:PORT",
        help="multi-host: where every invocation's processes meet (hosted by the one that "
        "runs the sandbox ranks), as torchrun's --rdzv-endpoint",
    )
    p.add_argument(
        "--rdzv-token-file",
        default=None,
        metavar="TOKEN",
        help="with --rdzv-endpoint: a file (mode 600) holding the token every host shares; nothing "
        "is served to a connection before it proves the token (default: $PRISM_RDZV_TOKEN)",
    )
    p.add_argument(
        "--role",
        choices=["all", "sandbox", "assistant"],
        default="all",
        help="the processes this invocation runs (with --rdzv-endpoint): all, the sandbox ranks, or the assistant",
    )
    p.add_argument(
        "--timing",
        choices=["auto", *TIMINGS],
        default="auto",
        help="how the virtual ranks are replayed: real (in real time with the graph's calibrated "
        "durations, the sandbox's real completions fed back), fast (as fast as dependencies "
        "allow, as slice timing does); auto (default): real for a calibrated graph "
        "(`prism calibrate --write-graph`: CAL/graph), else fast",
    )
    p.add_argument(
        "--assistants",
        type=int,
        default=1,
        metavar="K",
        help="assistant processes (on GPU one GPU each, after the sandbox's): each plays the "
        "proxy of a share of the groups that mix sandbox and virtual ranks (default 1)",
    )
    options.add(p, "force", "tee", "no_verify", "json")
    add_program_args(p)


def _ms(ns: int | None) -> str:
    return "-" if ns is None or ns < 0 else f"{ns / 1e6:.3f} ms"


def _print_figures(res) -> None:
    """Per sandbox rank: measured iteration times and peak memory; beside them the
    calibration's prediction for all ranks and the virtual ranks' replayed times."""
    pred = (res.prediction or {}).get("predicted_iteration_ns")
    for r, m in sorted(res.sandbox_results.items()):
        its = ", ".join(_ms(t) for t in m["iteration_ns"])
        mem = m["peak_memory_bytes"]
        med = m["median_steady_iteration_ns"]
        line = (
            f"prism emulate: sandbox rank {r}: iterations [{its}]; median steady {_ms(med)}"
            + (f"; peak memory {mem:,} B" if mem is not None else "")
            + (
                f" (+ {m['emulation_scratch_bytes']:,} B of pruned-call scratch outside it)"
                if m.get("emulation_scratch_bytes")
                else ""
            )
        )
        if pred and med:
            line += f"; calibrated prediction {_ms(pred)} ({(med - pred) / pred * 100:+.2f} %)"
            clocks = clock_note(m.get("gpu"), m.get("slice_gpu"))
            if clocks:  # a GPU at its power limit: the time moves with the clock
                line += f" -- {clocks}"
        if m.get("emulation_overhead_left_out_ns"):  # CPU: the pruned calls' own host time
            line += f"; left out of its clock: {_ms(m['emulation_overhead_left_out_ns'])} of emulation overhead"
        print(line, file=sys.stderr)
    c = res.communicators
    if c:
        print(
            f"prism emulate: communicators: {c['communicators']} for {c['logical_groups']} logical group(s) "
            f"({c['all_real']} of sandbox ranks only, {c['pruned']} pruned to sandbox ranks + a proxy, "
            f"{c['not_instantiated']} never instantiated); largest {c['largest_communicator']} member(s) "
            f"against a largest logical group of {c['largest_logical_group']}",
            file=sys.stderr,
        )
    rep = res.replay or {}
    if rep.get("median_steady_iteration_ns") is not None:
        print(
            f"prism emulate: virtual ranks ({rep['virtual_ranks']}, {res.timing} timing): median steady "
            f"iteration {_ms(rep['median_steady_iteration_ns'])}",
            file=sys.stderr,
        )


def run(args: argparse.Namespace) -> int:
    opts = EmulateOptions.from_fields(
        args,
        args=program_args(args),
        line_prefix=line_prefix(args),
        sink=Display("emulate", json=True).sink if args.json else None,  # stdout: the JSON alone
    )
    try:
        res = emulate(opts)
    except LaunchInterrupted as e:
        print(f"prism emulate: {e}", file=sys.stderr)
        return e.exit_code
    except SandboxOutOfMemory as e:  # a result of the emulation, not an error of prism
        print(f"prism emulate: {e}", file=sys.stderr)
        return e.exit_code
    for r, rc in res.returncodes.items():
        print(f"prism emulate: sandbox rank {r} of {res.world_size}: exit status {rc}", file=sys.stderr)
        c = res.checks.get(r)
        if c is not None:
            print(
                f"prism emulate: sandbox rank {r}: {c['compared']} collective output(s) compared with the "
                f"recording, max abs diff {c['max_abs_diff']:.3g}, max rel diff {c['max_rel_diff']:.3g}"
                + (f" ({c['worst']})" if c["max_rel_diff"] > 0 else "")
                + (f"; {c['missing']} not in the store" if c["missing"] else "")
                + (f"; {c['unfinished']} never finished" if c.get("unfinished") else "")
                + (f"; {c['errors']} could not be compared" if c.get("errors") else "")
                + (f"; {c['differing']} differ by more than rounding" if c.get("differing") else ""),
                file=sys.stderr,
            )
    _print_figures(res)
    if res.shared_gpu:
        print(
            "prism emulate: a GPU was shared by sandbox ranks and assistants (NCCL over sockets): values "
            "and memory are the program's, iteration times are not those of linked GPUs",
            file=sys.stderr,
        )
    print(f"prism emulate: done in {res.wall_s:.1f} s; output in {res.out}", file=sys.stderr)
    if args.json:
        options.print_json(options.result_fields(res, omit=("launch",)))
    if res.check_failure is not None:
        print(f"prism emulate: error: --check: {res.check_failure}", file=sys.stderr)
        return ExitCode.FAILED
    return 0
