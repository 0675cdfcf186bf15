"""Host cost of one communication call, back to back, on one rank: the per-call price of the
recording layer, free of any peer's latency (world size 1).

    torchrun --nproc-per-node 1 benchmarks/programs/call_cost.py [--calls 3000] [--numel 256]
    prism record --nproc 1 --out DIR -- benchmarks/programs/call_cost.py ...   (recorded)

Every ``--step-every`` calls (default 100; 0: never) an optimizer step (SGD over a
one-element parameter) ends an iteration, as in training: recorded, that is where the
recorder resolves the previous iteration's CUDA events and recycles them into its pool, so
the loop measures the steady state rather than an event creation per point. Plain runs take
the same steps.

Prints ``CALLCOST {"sync_us": .., "async_us": .., "backend": .., "step_every": ..}`` (best of
5 batches); recorded through the native backend (``PRISM_NATIVE=1``) also
``NATIVE_SELF {json}``: per loop, the recorder's own host time a call and the real backend's
(``self_time_per_call``); with ``--profile`` also the top functions of a cProfile of one recorded batch
(sync) by own time; with ``--breakdown`` ``BREAKDOWN {json}``: µs per operation of the
recording path's parts in isolation (best of 5 batches of ``--calls``), see ``breakdown``.
NCCL on a GPU when one is visible, else gloo."""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def best_us(batch: Callable[[int], float], n: int, reps: int = 5) -> float:
    """µs per operation: best of ``reps`` calls of ``batch(n)``, which returns the seconds
    its ``n`` operations took (so that it can leave its own set-up out)."""
    batch(min(n, 200))
    return round(min(batch(n) for _ in range(reps)) / n * 1e6, 3)


def loop_us(op: Callable[[], Any], n: int) -> float:
    """µs per call of ``op()`` (best of 5 batches of ``n``)."""

    def batch(k: int) -> float:
        t0 = time.perf_counter()
        for _ in range(k):
            op()
        return time.perf_counter() - t0

    return best_us(batch, n)


class _FakeWork:
    """What Recorder.issued / Recorder.wait read from a RecordingWork, without the C++ Work."""

    def __init__(self) -> None:
        self._inner = None
        self._rows: tuple = ()
        self._state = 0
        self._anysource = False
        self._on_wait = None


def breakdown(n: int, t: torch.Tensor, cuda: bool, step: Callable[[], Any], every: int
              ) -> dict[str, Any]:  # fmt: skip
    """The parts of a recorded call, each timed alone, in µs per operation:

    * ``point_host_us``: ``Recorder.point()`` on the host clock (its column appends: a point's
      whole cost on CPU); ``point_cuda_us``: with its CUDA event, the pool recycled between
      batches as iteration boundaries do;
    * ``recording_work_us``: a ``RecordingWork`` around a real Work; ``minimal_work_us``: an
      empty ``dist.Work`` subclass (the C++ base's share);
    * ``bookkeeping_sync_us``: the recorder's issue + issued + wait of a sync call (host
      clock, fake Work); ``issue_us``: ``issue()`` alone;
    * CUDA: ``event_record_us`` (one raw record), ``get_stream_us``, ``get_device_us``,
      ``event_create_us`` (a ``torch.cuda.Event`` object; the CUDA event itself is made at
      its first record), ``event_query_us`` and ``event_elapsed_us`` (resolving a point);
    * ``is_completed_us``, ``get_duration_us`` (CUDA) on a real Work;
    * recorded runs: ``loop_recorded_us``, ``loop_inner_us``, ``loop_inner_events_us`` (CUDA),
      see (f) below.

    The recorder parts run on fresh ``Recorder`` objects (configured like the run's own, if
    recorded), so that they stay out of the recorded trace."""
    from prismllm.comm.recorder import ST_PENDING, Recorder, current
    from prismllm.comm.recording import RecordingWork

    rec = current()
    out: dict[str, Any] = {"recorded": rec is not None, "n": n}
    noop = lambda: None  # noqa: E731

    def fresh(dev_timing: bool) -> Recorder:
        r = Recorder(0, 1)
        r.cuda = dev_timing
        if rec is not None:
            r.host_callbacks = rec.host_callbacks
        return r

    # (a) a point: host-only (what point() costs on CPU: the column appends), and with a CUDA
    # event, the event pool recycled between batches as the iteration boundaries do.
    hr = fresh(False)
    out["point_host_us"] = loop_us(hr.point, n)
    if cuda:
        cr = fresh(True)
        cr.point()  # makes the device's anchor

        def points(k: int) -> float:
            cr._resolve(len(cr.p_host), block=True)
            t0 = time.perf_counter()
            for _ in range(k):
                cr.point()
            return time.perf_counter() - t0

        out["point_cuda_us"] = best_us(points, n)

    # (b) the Work wrapper around a real Work.
    w = dist.all_reduce(t, async_op=True)
    w.wait()
    inner = getattr(w, "_inner", w)  # recorded: the real Work inside the RecordingWork
    pg = rec.groups[0] if rec is not None and rec.groups else None
    out["recording_work_us"] = loop_us(lambda: RecordingWork(inner, pg, (0,)), n)

    class _MinimalWork(dist.Work):
        pass

    out["minimal_work_us"] = loop_us(_MinimalWork, n)

    # (c) the recorder's bookkeeping of a sync call, host clock: issue, issued, wait.
    br = fresh(False)
    br.start()
    fw = _FakeWork()
    shape = t.shape

    def sync_call() -> None:
        row = br.issue("all_reduce", "allreduce", "0", 0, -1, 0, "sum", "float32", shape,
                       1024, 1024, (), (), False)  # fmt: skip
        rows = (row,)
        fw._rows = rows
        fw._state = ST_PENDING
        br.issued(fw, rows, True)
        br.wait(fw, noop, ())

    out["bookkeeping_sync_us"] = loop_us(sync_call, n)

    def issue_only(k: int) -> float:
        # issue() alone; issued/wait outside the timed part
        tot = 0.0
        pc = time.perf_counter
        for _ in range(k):
            t0 = pc()
            row = br.issue("all_reduce", "allreduce", "0", 0, -1, 0, "sum", "float32", shape,
                           1024, 1024, (), (), False)  # fmt: skip
            tot += pc() - t0
            fw._rows = (row,)
            fw._state = ST_PENDING
            br.issued(fw, fw._rows, True)
            br.wait(fw, noop, ())
        return tot

    def timer_only(k: int) -> float:  # the timing's own cost in issue_only
        tot = 0.0
        pc = time.perf_counter
        for _ in range(k):
            t0 = pc()
            tot += pc() - t0
        return tot

    out["issue_us"] = round(best_us(issue_only, n) - best_us(timer_only, n), 3)

    # (d) the CUDA entry points a point uses.
    if cuda:
        dev = torch._C._cuda_getDevice()
        ev = torch.cuda.Event(enable_timing=True)
        st = torch.cuda.current_stream()
        rec_ev = torch._C._CudaEventBase.record
        out["event_record_us"] = loop_us(lambda: rec_ev(ev, st), n)
        out["get_stream_us"] = loop_us(lambda: torch._C._cuda_getCurrentStream(dev), n)
        out["get_device_us"] = loop_us(torch._C._cuda_getDevice, n)
        out["event_create_us"] = loop_us(lambda: torch.cuda.Event(enable_timing=True), n)
        torch.cuda.synchronize()
        # what resolving a point costs: its time from the device's anchor (here: ev, earlier)
        ev0 = torch.cuda.Event(enable_timing=True)
        rec_ev(ev0, st)
        torch.cuda.synchronize()
        out["event_query_us"] = loop_us(lambda: torch._C._CudaEventBase.query(ev), n)
        elapsed = torch._C._CudaEventBase.elapsed_time
        out["event_elapsed_us"] = loop_us(lambda: elapsed(ev, ev0), n)

    # (e) what the recorder asks a real Work (NCCL's duration needs TORCH_NCCL_ENABLE_TIMING=1,
    # which prism record sets).
    out["is_completed_us"] = loop_us(inner.is_completed, n)
    if cuda:
        try:
            inner._get_duration()
            out["get_duration_us"] = loop_us(inner._get_duration, n)
        except Exception as e:  # timing not enabled (plain run), or no such method
            out["get_duration_us"] = f"n/a: {type(e).__name__}"

    # (f) recorded: the sync loop again in this process (a step every `every` calls, as in
    # main; these calls enter the trace), then on the real group under the recording one (its
    # backend as recorded, e.g. NCCL with timing on), bare and with the two event records a
    # recorded sync call adds: the recording layer's price without the run-to-run spread
    # between processes.
    if rec is not None and rec.groups:
        inner_pg = rec.groups[0]._inner
        sync = torch.cuda.synchronize if cuda else (lambda: None)

        def timed(call: Callable[[], Any]) -> Callable[[int], float]:
            def batch(k: int) -> float:
                sync()
                t0 = time.perf_counter()
                for i in range(1, k + 1):
                    call()
                    if every > 0 and i % every == 0:
                        step()
                sync()
                return time.perf_counter() - t0

            return batch

        out["loop_recorded_us"] = best_us(timed(lambda: dist.all_reduce(t)), n)
        out["loop_inner_us"] = best_us(timed(lambda: dist.all_reduce(t, group=inner_pg)), n)
        if cuda:
            e1, e2 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            rec_ev = torch._C._CudaEventBase.record
            st = torch.cuda.current_stream()

            def inner_events() -> None:
                rec_ev(e1, st)
                dist.all_reduce(t, group=inner_pg)
                rec_ev(e2, st)

            out["loop_inner_events_us"] = best_us(timed(inner_events), n)
    return out


def native_module() -> Any:
    """The native recording backend's module when this run is recorded through it, else None."""
    try:
        from prismllm.comm.install import current
    except ImportError:
        return None
    rec = current()
    return getattr(rec, "native", None) if rec is not None else None


def self_time_per_call(s0: dict, s1: dict) -> dict:
    """µs per call between two ``native.self_time()`` snapshots: the recorder's own host time
    (``self_us``: in the call and its wait, boundaries spread over the calls) and the real
    backend's (``inner_call_us``, ``inner_wait_us``)."""
    d = {k: s1[k] - s0[k] for k in s1}
    n = max(d["calls"], 1)
    return {
        "calls": d["calls"],
        "self_us": round((d["call_ns"] + d["wait_ns"] + d["boundary_ns"]) / n / 1e3, 3),
        "self_call_us": round(d["call_ns"] / n / 1e3, 3),
        "self_wait_us": round(d["wait_ns"] / n / 1e3, 3),
        "self_boundary_us": round(d["boundary_ns"] / n / 1e3, 3),
        "inner_call_us": round(d["inner_call_ns"] / n / 1e3, 3),
        "inner_wait_us": round(d["inner_wait_ns"] / max(d["waits"], 1) / 1e3, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--numel", type=int, default=256)
    ap.add_argument("--step-every", type=int, default=100)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--breakdown", action="store_true")
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    dev = "cuda" if cuda else "cpu"
    t = torch.ones(a.numel, device=dev)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    param = torch.zeros(1, device=dev, requires_grad=True)
    param.grad = torch.zeros(1, device=dev)
    opt = torch.optim.SGD([param], lr=0.1)
    every = a.step_every
    left = [every]  # calls until the next step

    def run(k: int, async_op: bool) -> None:
        # k calls, a step after every `every`-th call, counted across batches
        while k > 0:
            m = min(k, left[0]) if every > 0 else k
            if async_op:
                for _ in range(m):
                    dist.all_reduce(t, async_op=True).wait()
            else:
                for _ in range(m):
                    dist.all_reduce(t)
            k -= m
            if every > 0:
                left[0] -= m
                if left[0] == 0:
                    opt.step()
                    left[0] = every

    def run_sync(k: int) -> None:
        run(k, False)

    def run_async(k: int) -> None:
        run(k, True)

    res = {"backend": dist.get_backend(), "calls": a.calls, "step_every": every}
    nat = native_module()
    own: dict[str, Any] = {}
    for name, fn in (("sync_us", run_sync), ("async_us", run_async)):
        s0 = nat.self_time() if nat is not None else None
        fn(200)
        best = float("inf")
        for _ in range(5):
            sync()
            t0 = time.perf_counter()
            fn(a.calls)
            sync()
            best = min(best, (time.perf_counter() - t0) / a.calls)
        res[name] = round(best * 1e6, 2)
        if s0 is not None:
            own[name.replace("_us", "")] = self_time_per_call(s0, nat.self_time())
    print("CALLCOST " + json.dumps(res), flush=True)
    if own:
        print("NATIVE_SELF " + json.dumps(own), flush=True)
    if a.profile:
        pr = cProfile.Profile()
        pr.enable()
        run_sync(a.calls)
        sync()
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(22)
    if a.breakdown:
        res = breakdown(a.calls, t, cuda, opt.step, every)
        print("BREAKDOWN " + json.dumps(res), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
