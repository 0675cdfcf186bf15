"""``prism sweep``: the pipeline for every point of a grid of configurations, and one table of
iteration time and peak memory per point, out-of-memory points marked at the rank that ran out.

A grid key ``K`` with values ``V1,V2`` varies one thing. Where the job's text (the program's
arguments, ``--layout``, ``--sandbox``) holds ``{K}``, the value is put there; a key used nowhere
is the program flag ``--K V`` (``on``/``off``: the bare flag, or nothing). ``world`` sets the
world size. So ``--grid micro-batch=1,2 -- train.py`` runs ``train.py --micro-batch 1`` and
``train.py --micro-batch 2``, and ``--layout tp={tp},pp=2 --grid tp=1,2 -- train.py --tp {tp}``
keeps the layout and the program in step. Values are separated by commas, or by ``|`` when a
value holds a comma.

    OUT/sweep.json       the grid and, per point, its settings, status and figures
    OUT/sweep.html       the table, each point linking its own report
    OUT/points/NNN-.../  one ``prism run`` directory per point

Points run one after the other, each a ``prism run`` (:mod:`prismllm.pipeline.run`), so a sweep
that stopped goes on where it stopped when run again: finished points are read back, the
interrupted one resumes inside its stages. Points whose capture is the same job (they differ
only in what comes after capture: ``sandbox``, ``inputs``) capture once.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from prismllm.errors import PrismError, StorageError
from prismllm.fromfields import FromFields
from prismllm.fsutil import read_json, write_file_atomically
from prismllm.launch import LaunchError, LaunchInterrupted, RankOutOfMemory
from prismllm.outdir import writing
from prismllm.outputs import BARE_DIR, CAL_DIR, GRAPH_DIR
from prismllm.pipeline.run import RunOptions, RunUI, run_pipeline
from prismllm.report.sweep import write_sweep_report
from prismllm.trace.schema import MANIFEST_FILE
from prismllm.trace.summary import WARMUP

SWEEP_FILE = "sweep.json"
SWEEP_REPORT = "sweep.html"
POINTS_DIR = "points"
_SPECIAL = ("world",)  # grid keys that are prism's, not the program's


@dataclasses.dataclass
class SweepOptions(FromFields):
    out: str | os.PathLike
    script: str
    grid: Sequence[tuple[str, Sequence[str]]]  # (key, values), in the order given
    world: int | None = None  # None: a ``world`` grid key gives it
    args: Sequence[str] = ()  # may hold {key} placeholders
    layout: str | None = None  # may hold {key} placeholders
    sandbox: str | None = None  # may hold {key} placeholders
    memory_only: bool = False  # capture only: peak memory per rank, no iteration time
    capture: str = "solo"  # the capture's mode (prism capture --mode)
    devices: str = "auto"
    cuda_on_cpu: bool = False
    router_module: str | None = None
    routing: str | None = None  # may hold {key} placeholders
    parallel: int | None = None
    inputs: str = "auto"
    tensors: str | None = None
    rules: str | None = None
    head_start: str = "auto"
    warmup: int = WARMUP
    timeout: float | None = None
    force: bool = False


def parse_grid(text: str) -> tuple[str, list[str]]:
    """``KEY=V1,V2`` (or ``KEY=V1|V2`` when a value holds a comma) -> (KEY, [V1, V2])."""
    key, sep, values = text.partition("=")
    key = key.strip()
    if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]*", key):
        raise PrismError(f"--grid {text!r}: expected KEY=V1,V2,... (e.g. micro-batch=1,2,4)")
    vals = [v.strip() for v in values.split("|" if "|" in values else ",")]
    if not vals or any(not v for v in vals):
        raise PrismError(f"--grid {text!r}: an empty value; expected KEY=V1,V2,...")
    if len(set(vals)) != len(vals):
        raise PrismError(f"--grid {text!r}: a value is listed twice")
    return key, vals


@dataclasses.dataclass
class Point:
    number: int
    values: dict[str, str]  # grid key -> value
    run: RunOptions

    @property
    def name(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.values.items())


def _fill(text: str, values: dict[str, str], used: set[str]) -> str:
    def sub(m: re.Match) -> str:
        used.add(m.group(1))
        return values[m.group(1)]

    return re.sub(r"\{(" + "|".join(re.escape(k) for k in values) + r")\}", sub, text) if values else text


def plan_points(opts: SweepOptions) -> list[Point]:
    """Every point of the grid (the product, the first key varying slowest) as a run."""
    keys = [k for k, _ in opts.grid]
    if len(set(keys)) != len(keys):
        raise PrismError(f"--grid: key {next(k for k in keys if keys.count(k) > 1)!r} is given twice")
    if not keys:
        raise PrismError("nothing to sweep: give --grid KEY=V1,V2 at least once")
    if opts.world is None and "world" not in keys:
        raise PrismError("give --world N, or a grid over it: --grid world=64,128")
    out = Path(opts.out)
    points = []
    for n, combo in enumerate(itertools.product(*(vals for _, vals in opts.grid))):
        values = dict(zip(keys, combo))
        used: set[str] = set()
        args = [_fill(a, values, used) for a in opts.args]
        layout = _fill(opts.layout, values, used) if opts.layout else None
        sandbox = _fill(opts.sandbox, values, used) if opts.sandbox else None
        routing = _fill(opts.routing, values, used) if opts.routing else None
        world = opts.world
        for k, v in values.items():
            if k == "world":
                try:
                    world = int(v)
                except ValueError:
                    raise PrismError(f"--grid world={v!r}: not a whole number") from None
            elif k not in used:
                args += [f"--{k}"] if v == "on" else [] if v == "off" else [f"--{k}", v]
        slug = re.sub(r"[^A-Za-z0-9=.,_-]+", "_", ",".join(f"{k}={v}" for k, v in values.items()))[:80]
        run = RunOptions.from_fields(
            opts,
            world=int(world),
            out=out / POINTS_DIR / f"{n:03d}-{slug}",
            args=args,
            layout=layout,
            routing=routing,
            sandbox=sandbox,
            stop_after="capture" if opts.memory_only else None,
        )
        points.append(Point(n, values, run))
    return points


def _at(peak: dict[str, Any]) -> str | None:
    """ "rank 5, pp 0 · ep 5", or "rank 0" where the layout adds nothing (no layout: DP only)."""
    if peak.get("rank") is None:
        return None
    r, where = f"rank {peak['rank']}", peak.get("where")
    return r if not where or where == r else f"{r}, {where}"


def _row(point: Point, status: str, summary: dict[str, Any] | None, error: str | None, oom_rank: int | None) -> dict:
    s = summary or {}
    peak = s.get("peak_memory") or {}
    emulated = sorted((s.get("emulated") or {}).items(), key=lambda kv: int(kv[0]))
    return {
        "point": point.number,
        "values": point.values,
        "dir": str(Path(point.run.out)),
        "status": status,  # ok | out_of_memory | failed
        "oom_rank": oom_rank,
        "error": error,
        "world": point.run.world,
        "layout": point.run.layout,
        "args": list(point.run.args),
        "predicted_iteration_ns": s.get("predicted_iteration_ns"),
        "emulated_rank": int(emulated[0][0]) if emulated else None,
        "emulated_iteration_ns": emulated[0][1].get("iteration_ns") if emulated else None,
        "peak_memory_bytes": peak.get("bytes"),
        "peak_memory_rank": peak.get("rank"),
        "peak_memory_where": peak.get("where"),
        "peak_memory_at": _at(peak),
        "least_memory_bytes": peak.get("min_bytes"),
        "pipeline_bubble": s.get("pipeline_bubble"),
        "device": s.get("device"),
        "report": s.get("report"),
    }


def run_sweep(
    opts: SweepOptions,
    ui: RunUI | None = None,
    on_point: Callable[[Point, int], None] | None = None,
) -> dict[str, Any]:
    """Run every point (``on_point(point, total)`` before each), as the one writer of OUT
    (``prismllm.outdir``); returns OUT/sweep.json's content. A point that runs out of memory or
    fails is a row of the table, not the end of the sweep; a signal or a full disk is."""
    with writing(opts.out):
        return _run_sweep(opts, ui, on_point)


def _run_sweep(opts: SweepOptions, ui: RunUI | None, on_point: Callable[[Point, int], None] | None) -> dict[str, Any]:
    points = plan_points(opts)
    out = Path(opts.out)
    if out.exists() and not out.is_dir():
        raise PrismError(f"output path {out} exists and is not a directory")
    state_file = out / SWEEP_FILE
    old = read_json(state_file)
    if out.is_dir() and any(out.iterdir()) and not (isinstance(old, dict) and old.get("format") == "prism-sweep"):
        raise PrismError(f"output directory {out} is not empty and holds no `prism sweep`; choose another --out")
    grid = [[k, list(v)] for k, v in opts.grid]
    if isinstance(old, dict) and old.get("grid") not in (None, grid) and not opts.force:
        raise PrismError(f"{out} holds a sweep of another grid; run that command to resume it, or use --force")
    out.mkdir(parents=True, exist_ok=True)
    state: dict[str, Any] = {
        "format": "prism-sweep",
        "format_version": 1,
        "grid": grid,
        "memory_only": opts.memory_only,
        "script": opts.script,
        "points": [],
    }
    done: dict[tuple[str, str], Path] = {}  # (stage, its job) -> a point dir that holds it
    t0 = time.monotonic()
    for p in points:
        if on_point is not None:
            on_point(p, len(points))
        keys = {
            "capture": json.dumps(p.run.capture_job(), sort_keys=True),
            "calibrate": json.dumps(p.run.time_job(), sort_keys=True),
        }
        for stage in ("calibrate", "capture"):  # the most that another point did already
            if (stage, keys[stage]) in done:
                p.run.reuse_from, p.run.reuse_through = done[(stage, keys[stage])], stage
                break
        status, summary, error, oom_rank = "ok", None, None, None
        try:
            summary = run_pipeline(p.run, ui)
        except RankOutOfMemory as e:  # a rank of the capture or the emulation's sandbox ran out
            status, error, oom_rank = "out_of_memory", str(e), e.rank
        except LaunchError as e:
            status, error = "failed", str(e)
        except (LaunchInterrupted, StorageError):  # a signal, or a full disk every later point would hit too
            raise
        except PrismError as e:
            status, error = "failed", str(e)
        for stage, sub in (("capture", Path(BARE_DIR)), ("calibrate", Path(CAL_DIR) / GRAPH_DIR)):
            if (Path(p.run.out) / sub / MANIFEST_FILE).is_file():
                done.setdefault((stage, keys[stage]), Path(p.run.out))
        state["points"].append(_row(p, status, summary, error, oom_rank))
        _write(out, state)
    state["wall_s"] = round(time.monotonic() - t0, 2)
    state["report"] = str(write_sweep_report(state, out / SWEEP_REPORT))
    _write(out, state)
    return state


def _write(out: Path, state: dict[str, Any]) -> None:
    write_file_atomically(out / SWEEP_FILE, json.dumps(state, indent=1) + "\n")


__all__ = [
    "POINTS_DIR",
    "SWEEP_FILE",
    "SWEEP_REPORT",
    "Point",
    "SweepOptions",
    "parse_grid",
    "plan_points",
    "run_sweep",
]
