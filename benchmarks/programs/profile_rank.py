"""Run a program under a profiler on one rank: ``python profile_rank.py SCRIPT ARGS...`` behaves
as ``python SCRIPT ARGS...``; the rank named by ``PROFILE_RANK`` (torchrun's ``RANK``; default 0;
``all``: every rank, e.g. the one real rank of a slice) writes its profile under ``PROFILE_OUT``
when the program ends, however it ends. Other ranks run unprofiled. ``PROFILE_WITH``:

- ``cprofile`` (default): ``rank<R>.prof`` and ``rank<R>.txt`` (the 40 functions of most
  cumulative and of most own time; the main thread's). Used by benchmarks/stacks_device.py
  --profile-rank to see where a solo rank's time goes.
- ``kineto``: the PyTorch profiler (CUDA kernels, runtime calls, the host's operators),
  ``rank<R>-<PROFILE_TAG>.json.gz`` (a Chrome trace). Used by benchmarks/kernel_timeline.py to
  set a real run's kernel timeline beside a slice's and an emulation's.
- ``threads``: nothing during the run; at its end, from /proc, each of the process's threads:
  its name, CPU time, voluntary context switches (it waited) and involuntary ones (it was
  preempted: it could have run and had no core), the CPU it ran on last, and the CPUs the process
  may use: ``rank<R>-<PROFILE_TAG>-threads.json``. Whether a slice's host threads are slower than
  the real run's because they get less CPU."""

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


def _thread_rows() -> list[dict]:
    tick = os.sysconf("SC_CLK_TCK")
    rows = []
    for tid in sorted(os.listdir("/proc/self/task"), key=int):
        base = f"/proc/self/task/{tid}"
        try:
            with open(f"{base}/comm") as f:
                name = f.read().strip()
            with open(f"{base}/stat") as f:
                stat = f.read()
            with open(f"{base}/status") as f:
                status = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:  # the thread ended meanwhile
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # from field 3 (state) on: utime is field 14
        rows.append(
            {
                "tid": int(tid),
                "name": name,
                "cpu_s": (int(fields[11]) + int(fields[12])) / tick,
                "voluntary_switches": int(status["voluntary_ctxt_switches"]),
                "involuntary_switches": int(status["nonvoluntary_ctxt_switches"]),
                "last_cpu": int(fields[36]),
            }
        )
    return rows


def _threads(out: str, rank: str) -> tuple[Callable[[], None], Callable[[], None]]:
    import json

    def stop() -> None:
        doc = {"rank": rank, "usable_cpus": sorted(os.sched_getaffinity(0)), "threads": _thread_rows()}
        with open(os.path.join(out, f"rank{rank}-{os.environ.get('PROFILE_TAG', 'run')}-threads.json"), "w") as f:
            json.dump(doc, f, indent=1)

    return (lambda: None), stop


PROFILERS = {"cprofile": _cprofile, "kineto": _kineto, "threads": _threads}


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
