"""What one hand-off between two host threads costs on this machine: the emulation layer's hot path
hands each asynchronous pruned call from the thread that made it (DDP: autograd's device thread) to
the issue thread, whereas the real backend's call stays on its thread. ``python handoff_cost.py``
prints one JSON line:

- ``pingpong_us``: a round trip between two Python threads through two ``threading.Event``s
  (two hand-offs: each side sleeps until the other wakes it), median and p90 over ROUNDS;
- ``submit_us``: a job handed to a waiting worker through a ``threading.Condition`` (as
  ``IssueThread.submit``) until the worker has run it, median and p90;
- ``hook_us`` (CUDA only): the extra time a backward of a chain of small ops takes, per op, when
  each op's gradient passes a Python hook (autograd's device thread takes the GIL for it), alone
  and with a second Python thread running short jobs beside it (as the issue thread does).

Run it as is and under ``taskset -c K`` (every thread on one CPU): on a VM, waking a thread that
sleeps on another virtual CPU may cost far more than a switch on one CPU."""

from __future__ import annotations

import json
import statistics
import threading
import time

ROUNDS = 2000


def _stats(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {"median": round(statistics.median(xs), 1), "p90": round(xs[int(len(xs) * 0.9)], 1)}


def pingpong() -> dict[str, float]:
    ping, pong = threading.Event(), threading.Event()
    stop = False

    def other() -> None:
        while True:
            ping.wait()
            ping.clear()
            if stop:
                return
            pong.set()

    t = threading.Thread(target=other, daemon=True)
    t.start()
    out = []
    for _ in range(ROUNDS):
        t0 = time.perf_counter_ns()
        ping.set()
        pong.wait()
        pong.clear()
        out.append((time.perf_counter_ns() - t0) / 1e3)
    stop = True
    ping.set()
    t.join()
    return _stats(out[100:])


def submit() -> dict[str, float]:
    cv = threading.Condition()
    jobs: list = []

    def worker() -> None:
        while True:
            with cv:
                while not jobs:
                    cv.wait()
                job = jobs.pop()
            if job is None:
                return
            job()

    t = threading.Thread(target=worker, daemon=True)
    t.start()
    out = []
    for _ in range(ROUNDS):
        done = threading.Event()
        t0 = time.perf_counter_ns()
        with cv:
            jobs.append(done.set)
            cv.notify_all()
        done.wait()
        out.append((time.perf_counter_ns() - t0) / 1e3)
        time.sleep(0.0002)  # the worker back asleep, as between two buckets
    with cv:
        jobs.append(None)
        cv.notify_all()
    t.join()
    return _stats(out[100:])


def hooks() -> dict[str, float] | None:
    import torch

    if not torch.cuda.is_available():
        return None
    ops = 64
    x = torch.randn(256, device="cuda", requires_grad=True)

    def backward(hooked: bool) -> float:
        y = x
        for _ in range(ops):
            y = y * 1.0001
            if hooked:
                y.register_hook(lambda g: g)
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        y.sum().backward()
        torch.cuda.synchronize()
        return (time.perf_counter_ns() - t0) / 1e3

    def per_op(n: int = 200) -> float:
        plain = statistics.median(backward(False) for _ in range(n))
        hooked = statistics.median(backward(True) for _ in range(n))
        return round((hooked - plain) / ops, 2)

    for _ in range(20):
        backward(True)
    alone = per_op()
    busy = True

    def beside() -> None:  # short Python jobs, as the issue thread's, with short sleeps between
        while busy:
            sum(range(2000))
            time.sleep(0.0001)

    t = threading.Thread(target=beside, daemon=True)
    t.start()
    with_thread = per_op()
    busy = False
    t.join()
    return {"alone": alone, "with_thread": with_thread}


def main() -> None:
    import os

    print(
        json.dumps(
            {
                "cpus": sorted(os.sched_getaffinity(0)),
                "pingpong_us": pingpong(),
                "submit_us": submit(),
                "hook_us": hooks(),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
