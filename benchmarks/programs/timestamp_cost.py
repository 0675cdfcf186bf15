"""What a device timestamp costs the device: how much later the next kernel on the same stream
starts when the recorder puts a point between two kernels. One GPU, no communication:

    python benchmarks/programs/timestamp_cost.py [--iters 2000] [--json OUT]

Per way of taking a point, ``--iters`` tiny kernels (a one-element add) back to back on the
current stream with a point after each, the device held first (``torch.cuda._sleep``) while the
host enqueues them all, so that the span measures the device's pace, not the host's. The span from
the first kernel to the last, over ``--iters``, less the same without points, is the device's
cost of one point. Ways:

* ``none``: no point (the baseline);
* ``event``: a CUDA event without timing (``enable_timing=False``), what NCCL and PyTorch record
  around every collective;
* ``timing_event``: a CUDA event with timing, what the recorder records at every point
  (``prismllm.comm.recorder``) and NCCL with ``TORCH_NCCL_ENABLE_TIMING=1``;
* ``side_stream``: an event without timing on the stream, a second stream waiting on it and a
  timing event recorded there (the stream itself only records a plain event);
* ``stamp``: a one-thread kernel that writes the GPU's global timer (``%globaltimer``) to memory.

Three rounds, ways interleaved; the median of each way's rounds. Measured on two H200s (lease 32,
a pruned call between two timing events each side): about 3 µs a timing event.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from prismllm.comm.spin import compile_kernel

STAMP = r"""
extern "C" __global__ void prism_stamp(long long* out, int i) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    out[i] = (long long)t;
}
"""
WAYS = ("none", "event", "timing_event", "side_stream", "stamp")


def run(way: str, iters: int, stamp, side: torch.cuda.Stream) -> float:
    """µs a kernel and its point take on the device, back to back."""
    x = torch.zeros(1, device="cuda")
    stamps = torch.zeros(iters, dtype=torch.int64, device="cuda")
    plain = [torch.cuda.Event() for _ in range(iters)]
    timed = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    stream = torch.cuda.current_stream()
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~100 ms: the host enqueues everything meanwhile
    start.record()
    for i in range(iters):
        x.add_(1)
        if way == "event":
            plain[i].record(stream)
        elif way == "timing_event":
            timed[i].record(stream)
        elif way == "side_stream":
            plain[i].record(stream)
            side.wait_event(plain[i])
            timed[i].record(side)
        elif way == "stamp":
            stamp(args=[stamps, i])
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / iters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    dev = torch.cuda.current_device()
    stamp = compile_kernel(STAMP, "prism_stamp", dev, "timestamp_cost.py")
    side = torch.cuda.Stream()
    for way in WAYS:  # once each first: lazy loading, allocator, event creation
        run(way, 50, stamp, side)
    per = {w: [] for w in WAYS}
    for _ in range(a.rounds):
        for way in WAYS:
            per[way].append(run(way, a.iters, stamp, side))
    base = statistics.median(per["none"])
    res = {
        "device": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "iters": a.iters,
        "us_per_kernel": {w: [round(v, 3) for v in per[w]] for w in WAYS},
        "us_per_point": {w: round(statistics.median(per[w]) - base, 3) for w in WAYS if w != "none"},
    }
    print(json.dumps(res, indent=1))
    if a.json:
        a.json.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
