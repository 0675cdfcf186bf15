"""Run a training script under torch.profiler (CPU + CUDA activities), unmodified.

Usage (as torchrun's script): under_profiler.py SCRIPT ARGS...
Used by tracing_overhead.py as the baseline that PrismTrace recording is compared with.
"""

import runpy
import sys

import torch
from torch.profiler import ProfilerActivity, profile


def main() -> None:
    script, *args = sys.argv[1:]
    sys.argv = [script, *args]
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities):
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
