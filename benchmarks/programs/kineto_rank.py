"""Run a program under the PyTorch profiler (Kineto: CUDA kernels, runtime calls and the host's
operators) on one rank: ``python kineto_rank.py SCRIPT ARGS...`` behaves as ``python SCRIPT
ARGS...``; the rank named by ``PROFILE_RANK`` (torchrun's ``RANK``; default 0; ``all``: every
rank, e.g. the one real rank of a slice) writes
``PROFILE_OUT/rank<R>-<PROFILE_TAG>.json.gz`` (a Chrome trace) when the program ends, however it
ends. Other ranks run unprofiled. Used by benchmarks/kernel_timeline.py to set a real run's kernel
timeline beside a slice's and an emulation's, kernel by kernel."""

from __future__ import annotations

import os
import runpy
import sys

import torch
from torch.profiler import ProfilerActivity, profile


def main() -> None:
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    rank = os.environ.get("RANK", "0")
    if os.environ.get("PROFILE_RANK", "0") not in (rank, "all"):
        runpy.run_path(script, run_name="__main__")
        return
    out = os.environ.get("PROFILE_OUT", ".")
    tag = os.environ.get("PROFILE_TAG", "run")
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    prof.start()
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        prof.stop()
        os.makedirs(out, exist_ok=True)
        prof.export_chrome_trace(os.path.join(out, f"rank{rank}-{tag}.json.gz"))


if __name__ == "__main__":
    main()
