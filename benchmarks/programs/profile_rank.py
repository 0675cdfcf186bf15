"""Run a program under cProfile on one rank: ``python profile_rank.py SCRIPT ARGS...`` behaves as
``python SCRIPT ARGS...``; the rank named by ``PROFILE_RANK`` (torchrun's ``RANK``; default 0)
writes ``PROFILE_OUT/rank<R>.prof`` and ``rank<R>.txt`` (the 40 functions of most cumulative and
of most own time) when the program ends, however it ends. Other ranks run unprofiled. Used by
benchmarks/stacks_device.py --profile-rank to see where a solo rank's time goes."""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import runpy
import sys


def main() -> None:
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    rank = os.environ.get("RANK", "0")
    if rank != os.environ.get("PROFILE_RANK", "0"):
        runpy.run_path(script, run_name="__main__")
        return
    out = os.environ.get("PROFILE_OUT", ".")
    prof = cProfile.Profile()
    prof.enable()
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        prof.disable()
        os.makedirs(out, exist_ok=True)
        prof.dump_stats(os.path.join(out, f"rank{rank}.prof"))
        text = io.StringIO()
        stats = pstats.Stats(prof, stream=text)
        stats.sort_stats("cumulative").print_stats(40)
        stats.sort_stats("tottime").print_stats(40)
        with open(os.path.join(out, f"rank{rank}.txt"), "w") as f:
            f.write(text.getvalue())


if __name__ == "__main__":
    main()
