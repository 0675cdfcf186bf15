"""`prism capture`: the bare graph of an N-rank job, from a few ranks run alone.

    prism capture --world N --out DIR [--mode solo|switch] [--layout tp=..,pp=..,ep=..,cp=..,order=tp-cp-ep-dp-pp]
                  [--devices ...] [--parallel K] [--rules FILE] [--tensors STORE] [--save-tensors SELECTOR]
                  [--timeout S] [--force] [--tee] [--prefix] [--json] -- SCRIPT ARGS...

Run SCRIPT as ranks of a world of N, each rank alone (solo mode: collectives are answered by the
tensor generator or a tensor store), K ranks at a time (--parallel), and write the N-rank execution
graph (PrismTrace) to DIR. With --layout only one rank per class of replicas runs (one per (tp, cp,
ep, pp) coordinate); the DP replicas are renamed copies. An interrupted or failed capture resumes
when the same command is run again.

Switch mode (--mode switch) runs every rank, each collective carried out by a coordinator with the
members' real values; --save-tensors writes them (DIR/tensors) for time and emulate to replay. On
the CPU every rank runs at once; on GPUs one rank holds each GPU at a time (--parallel K: K/G), a
waiting rank's device state moved to the host by the CUDA driver's checkpoint API.
"""

from __future__ import annotations

import argparse

from prismllm.capture.solo import CAPTURE_MODES, CaptureOptions, CapturePlan, CaptureResult, capture
from prismllm.cli import options
from prismllm.cli.program import add_program_args, graph_program_fields
from prismllm.cli.progress import Display, count, key_values
from prismllm.launch import LaunchInterrupted, RankOutOfMemory

SUMMARY = "capture the execution graph of an N-rank job from a few ranks run alone"
EXAMPLES = r"""
# the bare graph of 1024 ranks: one rank per replica class run alone, 2 at a time
prism capture --world 1024 --layout tp=2,pp=8 --parallel 2 --out out/bare \
    -- gpt3d.py --tp 2 --pp 8 --layers 8 --global-batch 128 --micro-batch 1
# every rank of 16 with the real values, taking turns on two GPUs (a waiting rank's state moved out)
prism capture --mode switch --world 16 --devices cuda:0,1 --out out/switch \
    -- gpt3d.py --tp 2 --pp 2 --layers 8 --global-batch 16 --micro-batch 1
# on two GPUs, one rank each: peak memory per rank, exact
prism capture --world 1024 --layout tp=2,pp=8 --devices cuda:0,1 --out out/bare-gpu \
    -- gpt3d.py --tp 2 --pp 8 --layers 8 --global-batch 128 --micro-batch 1
"""
RUNS_PROGRAM = True  # its processes import torch: cli.main checks for it before anything starts


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--mode",
        default="solo",
        choices=CAPTURE_MODES,
        help="solo (default): each rank alone, its collectives answered with generated values (a layout's "
        "replicas run once); switch: every rank of the world runs, each collective carried out with the "
        "members' real values by a coordinator (CPU, all ranks at once)",
    )
    options.add(p, "world", "out", required=("world", "out"))
    options.add(
        p,
        "layout",
        "devices",
        "cuda_on_cpu",
        "router_module",
        "routing",
        "parallel",
        "rules",
        "tensors",
        "save_tensors",
        "timeout",
        "force",
        "tee",
        "no_verify",
        "json",
    )
    add_program_args(p)


class _CaptureProgress:
    """The plan's lines, then ranks done / total with the ETA (``cli.progress``)."""

    def __init__(self, display: Display):
        self.display = display

    def plan(self, plan: CapturePlan) -> None:
        rp = plan.replicas
        self.display.say(f"world {plan.world}, {plan.parallel} at a time on {plan.device}")
        self.display.say(rp.describe())
        if plan.resuming:
            self.display.say(f"resuming: {len(plan.resumed)} rank(s) already captured, {len(plan.pending)} to run")
        self.display.stage("capture", total=len(rp.representatives), unit="ranks", done=len(plan.resumed))

    def update(self, done: int, total: int, ran: int, elapsed: float) -> None:
        self.display.update(done, total)


def _summary(res: CaptureResult) -> None:
    reps = len(res.representatives)
    run = f"{res.ranks_run} run now" + (f", {res.ranks_resumed} from an earlier run" if res.ranks_resumed else "")
    t = res.timings
    key_values(
        [
            ("ranks", f"{res.world_size} ({res.device})"),
            ("representatives", f"{reps} ({run})" if res.dedup else f"all {reps}, no dedup ({run})"),
            ("iterations", count(res.iterations)),
            ("nodes", count(res.nodes)),
            ("output", str(res.out)),
            *_switches(res.manifest.get("capture") or {}),
            (
                "wall time",
                f"{res.wall_s:.1f} s (run {t['run_s']:.1f} s, assemble {t['assemble_s']:.1f} s, "
                f"validate {t['validate_s']:.1f} s, save {t['save_s']:.1f} s)",
            ),
        ],
        "captured",
    )


def _switches(cap: dict) -> list[tuple[str, str]]:
    """Switch mode's stops of waiting ranks and, on GPUs, what moving their device state cost."""
    if cap.get("switches") is None:
        return []
    rows = [("stops", f"{cap['switches']} (waiting ranks stopped for others)")]
    swaps = cap.get("swaps")
    if swaps and swaps.get("out"):
        size = f", {swaps['bytes_out'] / swaps['out'] / 2**30:.2f} GiB" if swaps.get("bytes_out") is not None else ""
        back = f", back {swaps['back_s'] / swaps['back']:.2f} s" if swaps.get("back") else ""
        rows.append(
            ("swaps", f"{swaps['out']} out of the GPUs, each out {swaps['out_s'] / swaps['out']:.2f} s{back}{size}")
        )
    return rows


def run(args: argparse.Namespace) -> int:
    display = Display("capture", json=args.json)
    progress = _CaptureProgress(display)
    opts = CaptureOptions.from_fields(args, **graph_program_fields(args, "capture", display.sink))
    try:
        res = capture(opts, on_plan=progress.plan, on_progress=progress.update)
    except LaunchInterrupted as e:
        display.say(f"{e}; re-run the same command to resume")
        return e.exit_code
    except RankOutOfMemory as e:  # a result of the capture: the program needs more than the device
        display.stop()
        display.say(str(e))
        return e.exit_code
    finally:
        display.stop()
    if args.json:
        options.print_json(options.result_fields(res, omit=("manifest", "trace")))
    else:
        _summary(res)
    return 0
