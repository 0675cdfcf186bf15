"""`prism whatif CAL --spin LABEL=DURATION -- SCRIPT ARGS`: a what-if measured, not solved.

A re-solve (``prism whatif --scale``) adds to a span's calibrated duration; it cannot see what
longer work does to the rest of the iteration on the device (overlap with communication kernels,
contention between streams, a host-bound program whose device idles inside the span). This
times the program again, each timed rank spinning DURATION at the start of every compute span
named LABEL (``prismllm.comm.spin``), calibrates that timing, and sets three iteration times side
by side: CAL's, the re-solve's for the same change, and the measured one.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from prismllm.calibrate import calibrate
from prismllm.calibrate.whatif import WhatIfError, calibration_source, duration_ns, parse_change, whatif
from prismllm.outdir import writing
from prismllm.outputs import CAL_DIR
from prismllm.time import TimeOptions, time_slices


@dataclasses.dataclass
class SpinOptions:
    cal: str | os.PathLike  # the calibration to compare with (prism calibrate --out)
    spins: dict[str, float]  # label -> ms
    script: str
    args: Sequence[str]
    out: str | os.PathLike  # OUT/time (the spinning slices), OUT/cal (their calibration)
    devices: str = "auto"
    parallel: int | None = None
    inputs: str = "auto"
    tensors: str | None = None
    timeout: float | None = None
    force: bool = False


def parse_spin(text: str) -> tuple[str, float]:
    """``LABEL=DURATION`` (``mlp=2ms``) as (label, ms)."""
    label, sep, amount = text.rpartition("=")
    where = f"--spin {text!r}"
    if not sep or not label:
        raise WhatIfError(f"{where}: expected LABEL=DURATION, e.g. mlp=2ms")
    ms = duration_ns(amount, where) / 1e6
    if ms <= 0:
        raise WhatIfError(f"{where}: the spin must be longer than 0")
    return label, ms


def spin_whatif(opts: SpinOptions, say: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Time CAL's graph again with the spins, calibrate, and compare (see the module docstring), as
    the one writer of OUT (``prismllm.outdir``)."""
    with writing(opts.out):
        if not opts.spins:
            raise WhatIfError("nothing to spin: give --spin LABEL=DURATION")
        cal = Path(opts.cal)
        src = calibration_source(cal)
        out = Path(opts.out)
        resolve = whatif(cal, [parse_change(f"op=compute,label={label}:+{ms:g}ms") for label, ms in opts.spins.items()])
        unlabelled = [label for label, a in zip(opts.spins, resolve["applied"]) if not a["compute_spans"]]
        if unlabelled:
            raise WhatIfError(
                f"no compute span of {src['graph']} is labelled {', '.join(map(repr, unlabelled))}: label it in the "
                "program (prismllm.mark / prismllm.span) and capture again"
            )
        timed = time_slices(
            TimeOptions.from_fields(
                opts, graph=src["graph"], out=out / "time", args=list(opts.args), spin=dict(opts.spins)
            ),
            say=say,
        )
        # this what-if's own, redone on a resume; its medians leave out what the baseline's did
        measured = calibrate(timed.graph, out / CAL_DIR, force=True, warmup=src["warmup"])
        base = resolve["baseline_iteration_ns"]
        m = measured["predicted_iteration_ns"]
        return {
            "spins_ms": dict(opts.spins),
            "baseline_iteration_ns": base,
            "resolve_iteration_ns": resolve["whatif_iteration_ns"],
            "measured_iteration_ns": m,
            "resolve_change_ns": resolve["whatif_iteration_ns"] - base,
            "measured_change_ns": m - base,
            "spans_per_label": {label: a["compute_spans"] for label, a in zip(opts.spins, resolve["applied"])},
            "time": str(out / "time"),
            "cal": str(out / CAL_DIR),
        }


__all__ = ["SpinOptions", "parse_spin", "spin_whatif"]
