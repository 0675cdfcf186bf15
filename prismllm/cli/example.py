"""`prism example [NAME] [PATH] [--overwrite]`: write an example training program to try prism on.

gpt3d (the default, and the program the documentation's examples run) is a Megatron-style GPT in
one file: tensor parallelism with sequence parallelism, pipeline parallelism (1F1B and
interleaved), data parallelism with a distributed optimizer, MoE with expert parallelism, all
through public torch.distributed calls, so torchrun launches it unmodified. Its flags set the
layout and the model's size (`python gpt3d.py --help`). PATH is where it goes (default: NAME.py
here; a directory: NAME.py in it); a file already there is kept unless --overwrite. Then the
command that runs it through the whole pipeline at 32 ranks is printed (the repository's
`make demo`)."""

from __future__ import annotations

import argparse
import shlex
from importlib import resources
from pathlib import Path

from prismllm.errors import PrismError, RequirementError
from prismllm.fsutil import write_file_atomically

SUMMARY = "write an example training program (gpt3d, a Megatron-style GPT) and say how to run it"
RAW_DESCRIPTION = False  # a docstring in prose, wrapped to the terminal
EXAMPLES = """
# write gpt3d.py here, and print the command that runs it at 32 ranks
prism example
# write it elsewhere, replacing an earlier copy
prism example gpt3d work/gpt3d.py --overwrite
"""

# What `prism example` can write: programs of the repository's examples folder, shipped in the
# package (prismllm/examples links to that folder; pyproject's package-data names the files).
PROGRAMS = ("gpt3d",)

# The repository's `make demo` (the Makefile's demo target with its DEMO_ARGS, tests/test_cli_docs.py
# holds them equal) with the program where `prism example` wrote it: 32 ranks of a tiny model,
# about 90 s on two CPU cores.
DEMO = (
    "prism run --world 32 --layout tp=2,pp=2 --sandbox 31 --out out/demo -- {program} --tp 2 --pp 2 --layers 2 "
    "--hidden 32 --heads 4 --seq 16 --vocab 128 --micro-batch 1 --global-batch 32 --iters 3"
)
TORCHRUN = "torchrun --nproc-per-node 8 {program} --tp 2 --pp 2"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", nargs="?", default=PROGRAMS[0], choices=PROGRAMS, metavar="NAME", help="the program: gpt3d")
    p.add_argument("path", nargs="?", metavar="PATH", help="where to write it (default: NAME.py here)")
    p.add_argument("--overwrite", action="store_true", help="replace a file already at PATH")


def run(args: argparse.Namespace) -> int:
    source = resources.files("prismllm").joinpath("examples", f"{args.name}.py")
    if not source.is_file():
        raise RequirementError(f"this installation of prismllm lacks its example {args.name}: reinstall it")
    target = Path(args.path or f"{args.name}.py")
    if target.is_dir():
        target = target / f"{args.name}.py"
    if target.exists() and not args.overwrite:
        raise PrismError(f"{target} exists: --overwrite replaces it")
    write_file_atomically(target, source.read_text(encoding="utf-8"))
    program = shlex.quote(str(target))
    print(f"wrote {target}: a Megatron-style GPT (TP, PP, DP, MoE with EP) that torchrun launches unmodified")
    print("its iteration time, memory and timelines at 32 ranks (TP2 x PP2 x DP8), rank 31 run for real:")
    print(f"  {DEMO.format(program=program)}")
    print("out/demo/report.html then shows them. The program alone, on 8 processes:")
    print(f"  {TORCHRUN.format(program=program)}")
    print("More: `prism run --help`, `prism docs getting-started`.")
    return 0
