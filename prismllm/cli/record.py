"""`prism record`: run a training program like torchrun and record its execution graph.

    prism record --nproc N --out DIR [--devices ...] [--layout tp=2,pp=2] [--save-tensors SELECTOR
                 [--tensor-store DIR]] [--recorder auto|native|python] [--timeout S] [--force] [--tee]
                 [--prefix] [--json] -- SCRIPT ARGS...

Run SCRIPT on N rank processes, as torchrun would (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT,
...), with its process groups recorded, and write the execution graph (PrismTrace) to DIR. If any
rank fails, the others are ended and the first failure is reported. --devices auto records on the
GPUs when there is one per rank.
"""

from __future__ import annotations

import argparse

from prismllm.capture.record import RECORDERS, RecordOptions, RecordResult, record
from prismllm.childenv import user_setting
from prismllm.cli import options
from prismllm.cli.program import add_program_args, graph_program_fields
from prismllm.cli.progress import Display, count, key_values
from prismllm.launch import LaunchInterrupted

SUMMARY = "run a program like torchrun and record its execution graph"
EXAMPLES = r"""
# 8 processes, as torchrun would start them (gpt3d.py: `prism example` writes it)
prism record --nproc 8 --out out/tp2pp2 -- gpt3d.py --tp 2 --pp 2 --iters 4
# every collective's outputs and inputs saved: the input of `prism emulate --check`
prism record --nproc 2 --devices cpu --out out/real --save-tensors all,inputs -- gpt3d.py --tp 2
"""
RUNS_PROGRAM = True  # its processes import torch: cli.main checks for it before anything starts


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--nproc",
        "--nproc-per-node",
        "--nproc_per_node",
        dest="nproc",
        type=int,
        required=True,
        metavar="N",
        help="number of rank processes",
    )
    options.add(p, "out", required=("out",))
    options.add(p, "devices", "cuda_on_cpu", "layout", "router_module", "routing", "save_tensors")
    p.add_argument(
        "--tensor-store", default=None, metavar="DIR", help="where --save-tensors writes (default: DIR/tensors)"
    )
    p.add_argument(
        "--recorder",
        choices=RECORDERS,
        default={"0": "python", "1": "native"}.get(user_setting("PRISM_NATIVE"), "auto"),
        help="native: the C++ recording backend (built once per torch version; the least "
        "host time a call); python: the Python path; auto (default; PRISM_NATIVE=1/0 "
        "picks native/python): native, or the Python path with a warning if it cannot "
        "be built. --save-tensors always records through the Python path",
    )
    options.add(p, "timeout", "force", "tee", "json")
    add_program_args(p)


def _summary(res: RecordResult) -> None:
    key_values(
        [
            ("ranks", f"{res.world_size} ({res.device})"),
            ("iterations", count(res.iterations)),
            ("nodes", count(res.nodes)),
            ("recorder", res.manifest.get("recorder", "?")),
            ("output", str(res.out)),
            ("wall time", f"{res.wall_s:.1f} s"),
        ],
        "recorded",
    )


def run(args: argparse.Namespace) -> int:
    display = Display("record", json=args.json)
    opts = RecordOptions.from_fields(args, **graph_program_fields(args, "record", display.sink))
    try:
        res = record(
            opts, on_start=lambda device, n: display.say(f"recording {n} rank{'s' if n != 1 else ''} on {device}…")
        )
    except LaunchInterrupted as e:
        display.say(str(e))
        return e.exit_code
    if args.json:
        options.print_json(
            options.result_fields(res, omit=("manifest", "trace", "launch"))
            | {"recorder": res.manifest.get("recorder")}
        )
    else:
        _summary(res)
    return 0
