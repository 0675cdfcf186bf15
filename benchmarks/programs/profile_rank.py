"""Run a program under a profiler on one rank: ``python profile_rank.py SCRIPT ARGS...`` behaves
as ``python SCRIPT ARGS...``; the rank named by ``PROFILE_RANK`` (torchrun's ``RANK``; default 0;
``all``: every rank, e.g. the one real rank of a slice) writes its profile under ``PROFILE_OUT``
when the program ends, however it ends. Other ranks run unprofiled. ``PROFILE_WITH``:

- ``cprofile`` (default): ``rank<R>.prof`` and ``rank<R>.txt`` (the 40 functions of most
  cumulative and of most own time; the main thread's). Used by benchmarks/stacks_device.py
  --profile-rank to see where a solo rank's time goes.
- ``kineto``: the PyTorch profiler (CUDA kernels, runtime calls, the host's operators),
  ``rank<R>-<PROFILE_TAG>.json.gz`` (a Chrome trace). Used by benchmarks/kernel_timeline.py to
  set a real run's kernel timeline beside a slice's and an emulation's."""

from __future__ import annotations

import io
import os
import runpy
import sys
from collections.abc import Callable


def _cprofile(out: str, rank: str) -> tuple[Callable[[], None], Callable[[], None]]:
    import cProfile
    import pstats

    prof = cProfile.Profile()

    def stop() -> None:
        prof.disable()
        prof.dump_stats(os.path.join(out, f"rank{rank}.prof"))
        text = io.StringIO()
        stats = pstats.Stats(prof, stream=text)
        stats.sort_stats("cumulative").print_stats(40)
        stats.sort_stats("tottime").print_stats(40)
        with open(os.path.join(out, f"rank{rank}.txt"), "w") as f:
            f.write(text.getvalue())

    return prof.enable, stop


def _kineto(out: str, rank: str) -> tuple[Callable[[], None], Callable[[], None]]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])

    def stop() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        prof.stop()
        prof.export_chrome_trace(os.path.join(out, f"rank{rank}-{os.environ.get('PROFILE_TAG', 'run')}.json.gz"))

    return prof.start, stop


PROFILERS = {"cprofile": _cprofile, "kineto": _kineto}


def main() -> None:
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    rank = os.environ.get("RANK", "0")
    if os.environ.get("PROFILE_RANK", "0") not in (rank, "all"):
        runpy.run_path(script, run_name="__main__")
        return
    out = os.environ.get("PROFILE_OUT", ".")
    os.makedirs(out, exist_ok=True)
    start, stop = PROFILERS[os.environ.get("PROFILE_WITH", "cprofile")](out, rank)
    start()
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        stop()


if __name__ == "__main__":
    main()
