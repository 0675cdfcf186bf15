"""The flags that several commands take, defined once: a flag means the same in every command
that has it (``tests/test_cli.py`` walks the parsers). A command adds the ones it takes with
:func:`add`; what is particular to a command goes in its description, never in a shared
flag's help."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import textwrap
from typing import Any

from prismllm.childenv import HEAD_START_CHOICES
from prismllm.errors import EXIT_CODES_HELP
from prismllm.trace.graph import PrismTrace
from prismllm.trace.summary import WARMUP
from prismllm.trace.validate import validate


def _positive(value: str) -> float:
    try:
        v = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: expected a number of seconds") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"{value!r}: must be positive")
    return v


def _whole(value: str, least: int = 0) -> int:
    try:
        v = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: expected a whole number") from None
    if v < least:
        raise argparse.ArgumentTypeError(f"{value!r}: must be at least {least}")
    return v


def _count(value: str) -> int:
    return _whole(value, 1)


@dataclasses.dataclass(frozen=True)
class Option:
    flags: tuple[str, ...]
    kwargs: dict[str, Any]


DEVICES_HELP = (
    "where processes run: cpu (processes stand in for devices; gloo), cuda (a GPU per process, in index order), "
    "cuda:G,G,... (these GPUs, in order, as many as a run needs from the front; a GPU listed twice is shared: "
    "right values and memory, not the timing of linked GPUs), or auto (the default): a GPU per process where there are enough, else the GPUs shared by a "
    "capture's or a sandbox run's processes, else cpu"
)

SHARED: dict[str, Option] = {
    "out": Option(("--out",), {"metavar": "DIR", "help": "the directory this command writes"}),
    "force": Option(
        ("--force",),
        {
            "action": "store_true",
            "help": "replace DIR if it holds an earlier output of prism (never another directory, nor one that "
            "another run is writing)",
        },
    ),
    "devices": Option(("--devices",), {"default": "auto", "metavar": "DEVICES", "help": DEVICES_HELP}),
    "save_tensors": Option(
        ("--save-tensors",),
        {
            "default": None,
            "metavar": "SELECTOR",
            "help": "save the outputs of the selected collectives for solo capture and emulation to "
            "replay: all, op names (all_to_all,recv,...), label:<label>, and inputs (their inputs too)",
        },
    ),
    "capture": Option(
        ("--capture",),
        {
            "choices": ("solo", "switch"),
            "default": "solo",
            "help": "how the bare graph is captured: solo (default: each rank alone, generated values, a layout's "
            "replicas once) or switch (every rank, real values, K at a time: `prism capture --mode switch`)",
        },
    ),
    "parallel": Option(
        ("--parallel",),
        {
            "type": _count,
            "default": None,
            "metavar": "K",
            "help": "how many run at a time: ranks (capture) or slices (time); default: one per GPU (listed, or every "
            "visible one with cuda or auto), else 1",
        },
    ),
    "timeout": Option(
        ("--timeout",),
        {
            "type": _positive,
            "default": None,
            "metavar": "S",
            "help": "end a launch that still runs after S seconds (capture: each batch of "
            "ranks; time: each slice), saying where each process stood",
        },
    ),
    "layout": Option(
        ("--layout",),
        {
            "default": None,
            "metavar": "K=V,...",
            "help": "the job's parallel layout, e.g. tp=2,pp=4,ep=2 (sizes tp, cp, ep, pp, "
            "dp; order=tp-cp-ep-dp-pp, fastest first; vpp, sp, schedule are "
            "recorded only)",
        },
    ),
    "world": Option(
        ("--world", "--world-size"),
        {"dest": "world", "type": _count, "metavar": "N", "help": "the logical world size: how many ranks the job has"},
    ),
    "graph": Option(
        ("--graph",),
        {
            "metavar": "GRAPH",
            "help": "the input graph (a directory written by prism record, capture, time, or calibrate --write-graph)",
        },
    ),
    "sandbox": Option(
        ("--sandbox",), {"metavar": "RANKS", "help": "ranks that run the program for real, e.g. 1 or 0,2-3"}
    ),
    "inputs": Option(
        ("--inputs",),
        {
            "choices": ["auto", "recorded", "generated"],
            "default": "auto",
            "help": "the virtual ranks' inputs: recorded (a tensor store), generated (every "
            "virtual rank taken to hold what the real ranks hold: a sum is scaled to the group, "
            "a virtual broadcast root sends what the capture kept of it where it is small, else the "
            "real rank's own copy, other data are zeros), "
            "or auto (the default): recorded where the graph has a store",
        },
    ),
    "tensors": Option(
        ("--tensors",),
        {
            "default": None,
            "metavar": "STORE",
            "help": "a tensor store written by `prism record --save-tensors`: the values "
            "collectives return in solo capture, the virtual ranks' inputs in a "
            "sandbox run (default: the input graph's own store)",
        },
    ),
    "rules": Option(
        ("--rules",),
        {
            "default": None,
            "metavar": "FILE",
            "help": "tensor-generator rules for solo capture (a Python file; `prism docs capture`, section Rules)",
        },
    ),
    "router_module": Option(
        ("--router-module",),
        {
            "default": None,
            "metavar": "SPEC",
            "help": "the MoE router: a class name or a glob on the module's name, then :METHOD that returns the "
            "logits (default forward), e.g. Router or TopKRouter:gating; with --routing its routing is forced, "
            "else (prism record) observed (`prism docs moe-stats`)",
        },
    ),
    "routing": Option(
        ("--routing",),
        {
            "default": None,
            "metavar": "FILE",
            "help": "force this routing on --router-module: balance statistics per MoE layer (a JSON file, "
            "e.g. written by prism moe-stats); kept in the graph, so time and emulate force it too",
        },
    ),
    "cuda_on_cpu": Option(
        ("--cuda-on-cpu",),
        {
            "action": "store_true",
            "help": "run a program that hard-codes CUDA on the CPU: torch.cuda calls, device arguments, streams "
            "and NCCL map to the CPU and gloo (values and structure, not GPU timing or memory); kept in the "
            "graph's manifest, so time, calibrate and emulate replay it the same way (`prism docs concepts`)",
        },
    ),
    "tee": Option(
        ("--tee",), {"action": "store_true", "help": "also write every process's stdout and stderr to DIR/logs"}
    ),
    "json": Option(
        ("--json",),
        {
            "action": "store_true",
            "help": "print the result (its figures and the paths written) as one JSON document on stdout instead "
            "of tables; every other line goes to stderr",
        },
    ),
    "warmup": Option(
        ("--warmup",),
        {
            "type": _whole,
            "default": WARMUP,
            "metavar": "N",
            "help": f"iterations left out of the predicted iteration time, a median over the others (default {WARMUP}: "
            "the first, which holds the set-up); more where the real job takes longer to settle, as a GPU does "
            "that heats up and lowers its clock over its first seconds",
        },
    ),
    "ranks": Option(("--ranks",), {"default": None, "metavar": "RANKS", "help": "only these ranks, e.g. 0-7,12"}),
    "no_validate": Option(
        ("--no-validate",),
        {"action": "store_true", "help": "skip the static check of the input graph (faster at scale)"},
    ),
    "head_start": Option(
        ("--head-start",),
        {
            "choices": HEAD_START_CHOICES,
            "default": "auto",
            "help": "GPU slices: after each wait of the host for its device, the device sleeps (left out of the "
            "timing) for the emulation layer's host time until the host's next wait, as the last iteration "
            "spent it (overhead: the program's own host pace), about one iteration (iteration: the device's work "
            "alone, for a device-bound program on a slower host), or not at all (off); auto (the default): off "
            "where the slices run the native lane (PRISM_NATIVE_LANE; the default on GPUs), else overhead (`prism docs time`)",
        },
    ),
    # dest "verify": a stage's options take it by name (FromFields)
    "no_verify": Option(
        ("--no-verify",),
        {
            "dest": "verify",
            "action": "store_false",
            "help": "skip the checksums of the input graph's and tensor store's files and the check of the "
            "store's index against its data and the graph (a damaged input is then not refused)",
        },
    ),
}


class _ProseHelpFormatter(argparse.HelpFormatter):
    """Wraps a description written in prose to the terminal; the epilog (the examples, the exit
    codes) stays laid out as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text.endswith(EXIT_CODES_HELP):
            return argparse.RawDescriptionHelpFormatter._fill_text(self, text, width, indent)
        return super()._fill_text(text, width, indent)


def epilog(examples: str = "") -> str:
    """What a ``--help`` ends with: ``examples`` (command lines, each under a ``#`` line that says
    what it does, laid out as written) under an ``examples:`` heading, then the exit codes."""
    if not examples:
        return EXIT_CODES_HELP
    return "examples:\n" + textwrap.indent(textwrap.dedent(examples).strip("\n"), "  ") + "\n\n" + EXIT_CODES_HELP


def command(
    subparsers: argparse._SubParsersAction,
    name: str,
    summary: str,
    description: str,
    raw: bool = False,
    examples: str = "",
) -> argparse.ArgumentParser:
    """A command's parser: ``summary`` in ``prism --help``, ``description`` in its own ``--help``
    (``raw``: kept as written, for descriptions laid out by hand), then its ``examples`` and the
    exit codes that every command shares (:func:`epilog`)."""
    formatter = argparse.RawDescriptionHelpFormatter if raw else _ProseHelpFormatter
    # no abbreviations: a flag that is gone (capture's old --device) must not quietly mean another
    return subparsers.add_parser(
        name,
        help=summary,
        description=description,
        epilog=epilog(examples),
        formatter_class=formatter,
        allow_abbrev=False,
    )


def add(p: argparse.ArgumentParser, *names: str, required: tuple[str, ...] = ()) -> None:
    """Add the shared flags ``names`` to ``p``; those in ``required`` must be given."""
    for name in names:
        opt = SHARED[name]
        p.add_argument(*opt.flags, **opt.kwargs, **({"required": True} if name in required else {}))


def canonical_argv(p: argparse.ArgumentParser, args: argparse.Namespace, command: str) -> list[str]:
    """``prism COMMAND`` with every flag that differs from its default, then ``-- SCRIPT ARGS``:
    the command line a graph's manifest keeps."""
    argv = ["prism", command]
    for a in p._actions:
        if not a.option_strings or a.dest in ("help", "script", "script_args"):
            continue
        v = getattr(args, a.dest, None)
        if v is None or v == a.default:
            continue
        flag = next((f for f in a.option_strings if f.startswith("--")), a.option_strings[0])
        if isinstance(a, argparse._StoreTrueAction | argparse._StoreFalseAction):
            argv.append(flag)
        else:
            argv += [flag, f"{v:g}" if isinstance(v, float) else str(v)]
    return argv + ["--", args.script, *args.script_args]


def print_json(obj: Any) -> None:
    """``--json``: one JSON document on stdout (paths as strings)."""
    json.dump(obj, sys.stdout, default=_path_text)
    sys.stdout.write("\n")


def _path_text(obj: Any) -> str:
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


def result_fields(result: Any, omit: tuple[str, ...] = ()) -> dict[str, Any]:
    """A stage's result (a dataclass) for ``--json``: its fields but ``omit`` (what only lives in
    memory: the graph, the launch)."""
    return {f.name: getattr(result, f.name) for f in dataclasses.fields(result) if f.name not in omit}


def load_graph(path: str, check: bool = True, verify: bool = True) -> PrismTrace:
    """A graph given on the command line, its files' checksums verified unless ``verify`` is False,
    validated unless ``check`` is False (TraceError: one line)."""
    trace = PrismTrace.load(path, verify)
    if check:
        validate(trace)
    return trace


__all__ = [
    "DEVICES_HELP",
    "SHARED",
    "add",
    "canonical_argv",
    "command",
    "epilog",
    "load_graph",
    "print_json",
    "result_fields",
]
