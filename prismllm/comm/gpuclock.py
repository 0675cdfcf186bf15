"""The clock a GPU rank ran at: NVML's SM clock, power draw and temperature of the rank's GPU,
sampled on a daemon thread while the program runs (a slice of `prism time`, an emulation).

A GPU at its power limit lowers its SM clock, and not by the same amount from run to run: one
H200 ran a pipeline's last stage at 1,710 MHz in a real two-GPU job and at 1,850-1,860 MHz in its
slice and its emulation, all at 681-692 W (nvidia-h200-x2, lease 58). A rank's
iteration moves with that clock, so each rank log carries the clock it was measured at
(:meth:`GpuClock.summary`), the timed graph's manifest its slice's (``timing.gpu``) and
emulate.json the emulated sandbox's beside it: a gap between a prediction and its emulation, or
a real run, that follows the clock says so.

Nothing is sampled on the CPU, without NVML (``pynvml``, which torch.cuda's own readings use) or
before the program initialized CUDA (the thread waits for it, never initializing it itself).
"""

from __future__ import annotations

import os
import statistics
import threading
from collections.abc import Callable
from typing import Any

import torch

Reading = tuple[int, int, float, float]  # utilisation %, SM clock MHz, power W, temperature C
BUSY = 50  # a sample counts where the GPU was busy at least this share (%) of NVML's last window


def nvml_reader() -> Callable[[], Reading] | None:
    """NVML's reading of this process's GPU (the one CUDA_VISIBLE_DEVICES gives a prism rank, else
    LOCAL_RANK's, as torchrun places ranks), or None where NVML cannot read it. Called once the
    program has initialized CUDA."""
    device = 0 if torch.cuda.device_count() == 1 else int(os.environ.get("LOCAL_RANK", "0"))

    def read() -> Reading:
        return (
            int(torch.cuda.utilization(device)),
            int(torch.cuda.clock_rate(device)),
            torch.cuda.power_draw(device) / 1000,
            float(torch.cuda.temperature(device)),
        )

    try:
        read()
    except Exception:  # noqa: BLE001 - no pynvml, or a GPU NVML does not know: no clock
        return None
    return read


class GpuClock:
    """Samples every ``interval_s``, from when ``ready()`` first holds until :meth:`stop`, what the
    reader that ``reader()`` then makes reads (None: nothing to read)."""

    def __init__(
        self,
        reader: Callable[[], Callable[[], Reading] | None] = nvml_reader,
        interval_s: float = 0.2,
        ready: Callable[[], bool] = torch.cuda.is_initialized,
    ):
        self.samples: list[Reading] = []
        self._reader, self._interval, self._ready = reader, interval_s, ready
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="prism-gpu-clock", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._ready():  # the program's own CUDA set-up first: this thread never starts it
            if self._stop.wait(self._interval):
                return
        read = self._reader()
        while read is not None and not self._stop.wait(self._interval):
            try:
                self.samples.append(read())
            except Exception:  # noqa: BLE001 - NVML went away (the process ends): keep what was read
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=max(1.0, 5 * self._interval))

    def summary(self) -> dict[str, Any]:
        """Over the samples at which the GPU was busy: the median SM clock (MHz) and power (W), the
        highest temperature (C), and how many samples there were (only that without a busy one;
        empty without any)."""
        self.stop()
        busy = [s for s in self.samples if s[0] >= BUSY]
        if not busy:
            return {"busy_samples": 0, "samples": len(self.samples)} if self.samples else {}
        return {
            "sm_clock_mhz": int(statistics.median(s[1] for s in busy)),
            "power_w": round(statistics.median(s[2] for s in busy), 1),
            "temperature_c_max": max(s[3] for s in busy),
            "busy_samples": len(busy),
            "samples": len(self.samples),
        }


__all__ = ["GpuClock", "nvml_reader"]
