"""``prism demo``: the whole pipeline on the embedded default job, with a short table.

    capture (solo, one rank per replica class) -> time (slices) -> calibrate -> emulate

The default is a 32-rank job of ``examples/gpt3d.py`` (TP2 x PP2 x DP8, a tiny model) on this
machine's CPU; with two GPUs or more, time and emulate run on them (one sandbox GPU, one
assistant GPU). Each stage is the ``prism`` command a user would type, run as a child process
(its progress shown as it goes); the figures are read from the files the stages write, and
``OUT/demo.json`` keeps them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from prismllm.errors import PrismError

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "gpt3d.py"
# a model that runs in seconds on two CPU cores, with every kind of parallelism of the layout
DEFAULT_ARGS = ["--tp", "2", "--pp", "2", "--layers", "2", "--hidden", "32", "--heads", "4", "--seq", "16",
                "--vocab", "128", "--micro-batch", "1", "--iters", "3"]  # + --global-batch max(32, N): 4+ micro-batches
DEFAULT_LAYOUT = "tp=2,pp=2"
RESULT_FILE = "demo.json"


@dataclasses.dataclass
class DemoOptions:
    out: str | os.PathLike = "out/demo"
    world: int = 32
    force: bool = False
    devices: str | None = None  # "cpu" or "cuda"; None: cuda with two GPUs or more
    script: str = str(EXAMPLE)
    args: list[str] | None = None  # None: DEFAULT_ARGS with a global batch for the world
    layout: str = DEFAULT_LAYOUT


def _devices(opts: DemoOptions) -> str:
    if opts.devices is not None:
        return opts.devices
    try:
        import torch

        return "cuda" if torch.cuda.device_count() >= 2 else "cpu"
    except Exception:  # noqa: BLE001 - no usable CUDA: the CPU
        return "cpu"


def _prism(*args: str, log: Path) -> tuple[float, str]:
    """Run one ``prism`` stage; its output goes to the terminal (stderr) and to ``log``."""
    cmd = [sys.executable, "-m", "prismllm.cli.main", *args]
    t0 = time.monotonic()
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
        assert p.stdout is not None
        out = []
        for line in p.stdout:  # the stage's own output and progress, as it goes
            f.write(line)
            out.append(line)
            sys.stderr.write(line)
        rc = p.wait()
    if rc != 0:
        tail = "".join(out[-5:]).strip()
        raise PrismError(f"`prism {args[0]}` failed (exit status {rc}; full output in {log}): {tail}")
    return time.monotonic() - t0, "".join(out)


def run_demo(opts: DemoOptions, stage: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Run the pipeline; returns (and writes to OUT/demo.json) the figures."""
    if opts.world < 4 or opts.world % 4:
        raise PrismError(f"--world {opts.world}: the demo's layout (TP2 x PP2) needs a multiple of 4 ranks")
    out = Path(opts.out)
    if out.exists() and any(out.iterdir()):
        if not opts.force:
            raise PrismError(f"{out} exists and is not empty (use --force to replace it)")
        if not (out / RESULT_FILE).exists() and not (out / "logs").is_dir():
            raise PrismError(f"{out} is not empty and holds no demo; refusing to delete it even with --force")
        shutil.rmtree(out)
    logs = out / "logs"
    logs.mkdir(parents=True)
    dev = _devices(opts)
    args = opts.args if opts.args is not None else [*DEFAULT_ARGS, "--global-batch", str(max(32, opts.world))]
    prog = ["--", opts.script, *args]
    sandbox = str(opts.world - 1)  # gpt3d's reporting rank (the last pipeline stage)
    walls: dict[str, float] = {}

    stage(f"capture: {opts.world} ranks, solo, one per replica class ({opts.layout})")
    walls["capture"], _ = _prism("capture", "--mode", "solo", "--world", str(opts.world), "--devices", "2",
                                 "--device", "cpu", "--layout", opts.layout, "--out", str(out / "bare"), *prog,
                                 log=logs / "capture.log")
    stage(f"time: every representative real in its own slice ({dev})")
    walls["time"], _ = _prism("time", "--graph", str(out / "bare"), "--out", str(out / "time"), "--devices", dev,
                              "--inputs", "generated", *prog, log=logs / "time.log")
    stage("calibrate: solve the timed graph")
    walls["calibrate"], text = _prism("calibrate", str(out / "time" / "graph"), "--out", str(out / "cal"),
                                      "--write-graph", "--json", log=logs / "calibrate.log")
    cal = json.loads((out / "cal" / "summary.json").read_text())
    stage(f"emulate: rank {sandbox} real, {opts.world - 1} virtual ranks replayed in real time")
    walls["emulate"], _ = _prism("emulate", "--graph", str(out / "cal" / "graph"), "--sandbox", sandbox,
                                 "--devices", dev, "--inputs", "generated", "--out", str(out / "emulate"), *prog,
                                 log=logs / "emulate.log")
    emu = json.loads((out / "emulate" / "emulate.json").read_text())
    measured = emu["sandbox_results"].get(sandbox, {})
    crit = cal.get("critical_path") or {}
    figures = {
        "world": opts.world, "devices": dev, "layout": opts.layout, "command": [opts.script, *args],
        "stage_wall_s": {k: round(v, 2) for k, v in walls.items()}, "total_wall_s": round(sum(walls.values()), 2),
        "predicted_iteration_ns": cal.get("predicted_iteration_ns"),
        "pipeline_bubble": (cal.get("pipeline_bubble") or {}).get("fraction"),
        "busy_fraction_mean": (cal.get("busy_fraction") or {}).get("mean"),
        "critical_path_by_kind_ns": crit.get("by_kind"),
        "sandbox_rank": int(sandbox), "emulated_iteration_ns": measured.get("median_steady_iteration_ns"),
        "emulated_iterations_ns": measured.get("iteration_ns"),
        "peak_memory_bytes": measured.get("peak_memory_bytes", -1),
        "virtual_ranks_iteration_ns": (emu.get("replay") or {}).get("median_steady_iteration_ns"),
    }
    (out / RESULT_FILE).write_text(json.dumps(figures, indent=1) + "\n")
    return figures


__all__ = ["DemoOptions", "run_demo"]
