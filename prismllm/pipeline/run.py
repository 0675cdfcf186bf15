"""``prism run``: from a program to an answer in one command -- capture, time, calibrate, and with
``sandbox`` emulate, then the report -- each stage reading the files the one before wrote.

    OUT/run.json      the job (command, world, layout, ...) and each stage's wall time
    OUT/bare/         the bare graph (prism capture, solo)
    OUT/time/         slice timing; OUT/time/graph the timed graph (prism time)
    OUT/cal/          the calibration; OUT/cal/graph the calibrated graph (prism calibrate)
    OUT/emulate/      the emulation with the sandbox ranks real (prism emulate)
    OUT/logs/         the program's output in each stage (time: OUT/time/slices/*.log)
    OUT/report.html   the report (prism report)

Resume: a run that stopped (Ctrl-C, a failure, a lost machine) goes on where it stopped when the
same command is run again: a stage whose output is complete is not run again, capture and time
resume inside their own stage. Another command on the same OUT is refused unless ``force``; another
run while this one goes on, even with ``force`` (``prismllm.outdir``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from prismllm import __version__
from prismllm.calibrate import calibrate
from prismllm.capture.solo import CaptureOptions, CapturePlan, capture
from prismllm.childenv import head_start_for, native_lane_setting
from prismllm.emulate import EmulateOptions, emulate
from prismllm.errors import PrismError
from prismllm.fromfields import FromFields
from prismllm.fsutil import read_json, write_file_atomically
from prismllm.hostmem import peak_rss_bytes, reset_peak_rss
from prismllm.launch import LineSink
from prismllm.launch.sandbox import ON_THE_CPU, sandbox_devices
from prismllm.layout import Layout
from prismllm.outdir import writing
from prismllm.outputs import (
    BARE_DIR,
    CAL_DIR,
    EMULATE_DIR,
    EMULATE_FILE,
    GRAPH_DIR,
    LOGS_DIR,
    REPORT_FILE,
    RUN_FILE,
    SLICE_FILE,
    SUMMARY_FILE,
    TIME_DIR,
)
from prismllm.report import write_report
from prismllm.report.data import coords_text
from prismllm.time import TimeOptions, check_time_devices, plan_slices, slice_dir, time_slices
from prismllm.trace.schema import MANIFEST_FILE, TENSORS_DIR
from prismllm.trace.summary import WARMUP

STAGES = ("capture", "time", "calibrate", "emulate", "report")
# capture and time resume inside their own directories; the run's ``force`` starts OUT over as a
# whole (_prepare), and is not theirs
_STAGE_FORCE = False


@dataclasses.dataclass
class RunOptions(FromFields):
    world: int
    out: str | os.PathLike
    script: str
    args: Sequence[str] = ()
    layout: str | None = None
    capture: str = "solo"  # the capture's mode: solo | switch (prism capture --mode)
    devices: str = "auto"
    cuda_on_cpu: bool = False  # capture maps the program's CUDA calls to the CPU; later stages follow its graph
    router_module: str | None = None  # the MoE router whose logits ``routing`` forces; later stages follow the graph
    routing: str | None = None  # a routing file (prismllm.routing)
    parallel: int | None = None  # capture: ranks at a time; time: slices at a time
    sandbox: str | None = None  # emulate with these ranks real; None: stop after calibrate
    inputs: str = "auto"
    tensors: str | None = None
    rules: str | None = None
    timeout: float | None = None
    force: bool = False
    head_start: str = "auto"  # GPU slices: the host's head start (TimeOptions.head_start)
    warmup: int = WARMUP  # iterations left out of the prediction (prism calibrate --warmup)
    stop_after: str | None = None  # "capture": peak memory only (no time, calibrate, emulate or report)
    # a run directory whose stages up to ``reuse_through`` ("capture" or "calibrate") are this
    # run's: the same capture_job (and for "calibrate" the same time_job)
    reuse_from: Path | None = None
    reuse_through: str = "capture"

    def capture_job(self) -> dict[str, Any]:
        """What decides the bare graph: two runs with the same capture job share their capture."""
        return {
            "command": [str(Path(self.script).resolve()), *map(str, self.args)],
            "capture": self.capture,
            "world": self.world,
            "layout": self.layout,
            "devices": self.devices,
            "cuda_on_cpu": self.cuda_on_cpu,
            "router_module": self.router_module,
            "routing": str(Path(self.routing).resolve()) if self.routing else None,
            "tensors": self.tensors,
            "rules": self.rules,
        }

    def time_job(self) -> dict[str, Any]:
        """What decides the timed graph and the calibration, beyond the capture: the slices' lane
        and head start as they run (``auto`` follows PRISM_NATIVE_LANE for the devices)."""
        lane = native_lane_setting(on_gpu=sandbox_devices(self.devices, 2, self.cuda_on_cpu).kind == "cuda")
        head_start = head_start_for(self.head_start, lane) or "off"
        return {**self.capture_job(), "inputs": self.inputs, "parallel": self.parallel, "head_start": head_start,
                "native_lane": lane}  # fmt: skip


class RunUI:
    """What the run tells its user: a new stage (``total`` units, ``done`` of them already), a
    stage's progress, prism's own lines, and where the program's output goes (a LineSink or None:
    the stage's log). The CLI's display implements it; the default says nothing."""

    def stage(self, name: str, total: int | None = None, unit: str = "", done: int = 0) -> None: ...

    def update(self, done: int, total: int | None = None, note: str = "") -> None: ...

    def say(self, text: str) -> None: ...


def _job(opts: RunOptions) -> dict[str, Any]:
    """What makes two invocations the same run (a resume) or not."""
    return {
        **opts.time_job(),
        "sandbox": opts.sandbox,
        "stop_after": opts.stop_after,
        "prismllm": __version__,
    }


def _prepare(opts: RunOptions, out: Path) -> dict[str, Any]:
    """OUT for this run: new, resumed (the same job), or started over (``force``, only a run's)."""
    job = _job(opts)
    state_file = out / RUN_FILE
    if out.exists() and not out.is_dir():
        raise PrismError(f"output path {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        old = None
        try:
            old = json.loads(state_file.read_text())
        except (OSError, ValueError):
            pass
        if not isinstance(old, dict) or "job" not in old:
            raise PrismError(
                f"output directory {out} is not empty and holds no `prism run`; choose another --out "
                f"(it is never deleted, even with --force)"
            )
        if old["job"] == job and not opts.force:
            return old  # resume
        if not opts.force:
            diff = sorted(k for k in set(job) | set(old["job"]) if job.get(k) != old["job"].get(k))
            raise PrismError(
                f"{out} holds a `prism run` of another job (differs in: {', '.join(diff)}); run that "
                f"command to resume it, or use --force to start over"
            )
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    state = {"job": job, "stages": []}
    _write_state(out, state)
    return state


def _write_state(out: Path, state: dict[str, Any]) -> None:
    write_file_atomically(out / RUN_FILE, json.dumps(state, indent=1) + "\n")


def _log_sink(path: Path) -> tuple[LineSink, Callable[[], None]]:
    f = open(path, "a")

    def sink(rank: int, stream: str, line: str) -> None:
        f.write(line)
        f.flush()

    return sink, f.close


def run_pipeline(opts: RunOptions, ui: RunUI | None = None) -> dict[str, Any]:
    """Run every stage not done yet, as the one writer of OUT, the stages' directories inside it
    included (``prismllm.outdir``); returns the summary (also in OUT/run.json)."""
    with writing(opts.out):
        return _run_pipeline(opts, ui or RunUI())


def _run_pipeline(opts: RunOptions, ui: RunUI) -> dict[str, Any]:
    if opts.stop_after not in (None, "capture"):
        raise PrismError(f"stop_after {opts.stop_after!r}: only 'capture' (or None: every stage)")
    if not os.path.isfile(opts.script):
        raise PrismError(f"script not found: {opts.script}")
    Layout.parse(opts.layout, opts.world)  # a layout that does not fit the world: refused before anything runs
    out = Path(opts.out)
    state = _prepare(opts, out)
    (out / LOGS_DIR).mkdir(exist_ok=True)
    walls = {s["name"]: s for s in state.get("stages", [])}

    def done_stage(name: str, t0: float, what: str) -> None:
        walls[name] = {"name": name, "wall_s": round(time.monotonic() - t0, 2), "what": what}
        if measured:  # this process's own peak in the stage (its ranks, slices, assistants are others)
            walls[name]["peak_rss_bytes"] = peak_rss_bytes()
            reset_peak_rss()
        state["stages"] = [walls[n] for n in STAGES if n in walls]
        _write_state(out, state)

    measured = reset_peak_rss()  # False where the kernel offers no way to start again

    # ---- capture
    bare = out / BARE_DIR

    def time_options() -> TimeOptions:
        return TimeOptions.from_fields(opts, graph=bare, out=out / TIME_DIR, args=list(opts.args), force=_STAGE_FORCE)

    if opts.reuse_from is not None:
        _adopt(Path(opts.reuse_from), out, opts.reuse_through, done_stage)
    if not (bare / MANIFEST_FILE).is_file():
        t0 = time.monotonic()
        sink, close = _log_sink(out / LOGS_DIR / "capture.log")
        plan: list[CapturePlan] = []

        def on_plan(p: CapturePlan) -> None:
            plan.append(p)
            if opts.stop_after is None:  # the time stage's devices, before the capture's minutes
                t = time_options()
                check_time_devices(t, len(plan_slices(p.replicas.representatives, t.slice_size)), opts.cuda_on_cpu)
            ui.say(f"capture: {p.replicas.describe()}; {p.parallel} at a time on {p.device}")
            ui.stage("capture", total=len(p.replicas.representatives), unit="ranks", done=len(p.resumed))

        try:
            res = capture(
                CaptureOptions.from_fields(
                    opts,
                    out=bare,
                    args=list(opts.args),
                    force=_STAGE_FORCE,
                    sink=sink,
                    mode=opts.capture,
                    # switch: the real values, for the slices' and the emulation's virtual ranks to replay
                    save_tensors="all,inputs" if opts.capture == "switch" else None,
                ),
                on_plan=on_plan,
                on_progress=lambda d, t, r, e: ui.update(d, t),
            )
        finally:
            close()
        how = "run alone" if opts.capture == "solo" else "run together with real values"
        done_stage("capture", t0, f"{len(res.representatives)} of {res.world_size} ranks {how} on {res.device}")
        del res  # its assembled graph (GBs at 100,000 ranks): the next stages read the saved one
    if opts.stop_after == "capture":
        result = _summary(out, state, None, None)
        state["summary"] = result
        _write_state(out, state)
        return result

    # ---- time
    timed = out / TIME_DIR / GRAPH_DIR
    if not (timed / MANIFEST_FILE).is_file() or "time" not in walls:
        t0 = time.monotonic()
        ui.stage("time", unit="slices")
        res_t = time_slices(
            time_options(),
            lambda d, t, ranks, s: ui.update(d, t),
            say=lambda line: ui.say(f"time: {line}"),
        )
        done_stage(
            "time",
            t0,
            f"{len(res_t.timed_ranks)} ranks timed in {len(res_t.slices)} slice(s) on {_devices_of(out / TIME_DIR)}",
        )

    # ---- calibrate
    cal = out / CAL_DIR
    # another --warmup on a resume: the calibration and what follows it redone, the capture and slices kept
    warmup_was = (read_json(cal / SUMMARY_FILE) or {}).get("warmup", WARMUP)
    if not (cal / GRAPH_DIR / MANIFEST_FILE).is_file() or "calibrate" not in walls or warmup_was != opts.warmup:
        walls.pop("emulate", None)
        t0 = time.monotonic()
        ui.stage("calibrate")
        summary = calibrate(timed, cal, write_graph=True, force=True, warmup=opts.warmup)  # the run's own, redone
        done_stage("calibrate", t0, f"{summary['nodes']:,} nodes solved")
    summary = json.loads((cal / SUMMARY_FILE).read_text())

    # ---- emulate
    emu = None
    if opts.sandbox is not None:
        ef = out / EMULATE_DIR / EMULATE_FILE
        prev = read_json(ef)
        if not (prev and prev.get("ok")) or "emulate" not in walls:
            t0 = time.monotonic()
            ui.stage("emulate")
            sink, close = _log_sink(out / LOGS_DIR / "emulate.log")
            try:
                # the calibrated graph holds no store: the virtual ranks replay the capture's (switch
                # mode's real values), as the slices did, unless the run was given one
                own = bare / TENSORS_DIR
                tensors = opts.tensors if opts.tensors is not None or not own.is_dir() else str(own)
                emulate(
                    EmulateOptions.from_fields(
                        opts,
                        graph=cal / GRAPH_DIR,
                        out=out / EMULATE_DIR,
                        args=list(opts.args),
                        force=True,
                        sink=sink,
                        tensors=tensors,
                    )
                )
            finally:
                close()
            sb = read_json(ef) or {}
            done_stage(
                "emulate",
                t0,
                f"rank(s) {','.join(map(str, sb.get('sandbox', [])))} real on "
                f"{sb.get('devices')}, {opts.world - len(sb.get('sandbox', []))} virtual",
            )
        emu = read_json(ef)

    # ---- report
    t0 = time.monotonic()
    ui.stage("report")
    report = write_report(out, out / REPORT_FILE)
    done_stage("report", t0, str(report))
    result = _summary(out, state, summary, emu)
    state["summary"] = result
    _write_state(out, state)
    return result


def _adopt(src: Path, out: Path, through: str, done_stage: Callable[[str, float, str], None]) -> None:
    """Take the stages up to ``through`` from the run in ``src`` (hard links: no second copy on
    disk), where this run has not done them itself."""
    stages = {
        "capture": ((BARE_DIR, BARE_DIR),),
        "calibrate": ((BARE_DIR, BARE_DIR), (TIME_DIR, GRAPH_DIR), (CAL_DIR, GRAPH_DIR)),
    }
    if through not in stages:
        raise PrismError(f"reuse_through {through!r}: expected capture or calibrate")
    names = {BARE_DIR: "capture", TIME_DIR: "time", CAL_DIR: "calibrate"}
    for d, graph in stages[through]:
        mine, theirs = out / d, src / d
        complete = (theirs / MANIFEST_FILE if d == BARE_DIR else theirs / graph / MANIFEST_FILE).is_file()
        done = (mine / MANIFEST_FILE if d == BARE_DIR else mine / graph / MANIFEST_FILE).is_file()
        if done or not complete:
            return
        t0 = time.monotonic()
        shutil.rmtree(mine, ignore_errors=True)  # a stage of its own that stopped half-way
        shutil.copytree(theirs, mine, copy_function=os.link)
        done_stage(names[d], t0, f"the same as {src}")


def _devices_of(time_dir: Path) -> str:
    s = read_json(slice_dir(time_dir, 0) / SLICE_FILE) or {}
    return str(s.get("devices", "?"))


def _no_peak_memory(device: str | None) -> str:
    """Why a capture measured no peak memory."""
    return ON_THE_CPU if device == "cpu" else "no captured rank measured it"


def _summary(out: Path, state: dict[str, Any], s: dict[str, Any] | None, emu: dict[str, Any] | None) -> dict[str, Any]:
    """The figures a user reads first (``prism run``'s closing lines); ``s``: the calibration's
    summary, None after a capture alone."""
    bare = read_json(out / BARE_DIR / MANIFEST_FILE) or {}
    world = int(bare["world_size"]) if s is None else int(s["world_size"])
    s = s or {}
    layout = Layout.parse(bare.get("layout"), world) if bare.get("layout") else None
    peaks = {int(r): int(b) for r, b in (bare.get("peak_memory_bytes") or {}).items() if int(b) >= 0}
    peak = None
    if peaks:
        r = max(peaks, key=lambda k: peaks[k])
        peak = {"rank": r, "bytes": peaks[r], "where": coords_text(layout, r), "min_bytes": min(peaks.values())}
    cp = s.get("critical_path") or {}
    total = max(int(cp.get("total_ns") or 0), 1)
    shares = {k: v / total for k, v in (cp.get("by_kind") or {}).items()}
    emulated = None
    if emu:
        emulated = {
            r: {"iteration_ns": m.get("median_steady_iteration_ns")}
            | {k: m[k] for k in ("peak_memory_bytes", "peak_memory_reason", "gpu", "slice_gpu") if k in m}
            for r, m in (emu.get("sandbox_results") or {}).items()
        }
    return {
        "world_size": world,
        "command": bare.get("command"),
        "device": bare.get("device"),
        "predicted_iteration_ns": s.get("predicted_iteration_ns"),
        "steady_iterations": s.get("steady_iterations"),
        "pipeline_bubble": (s.get("pipeline_bubble") or {}).get("fraction"),
        "critical_path_shares": shares,
        "peak_memory": peak,
        "peak_memory_reason": None if peak else _no_peak_memory(bare.get("device")),
        "emulated": emulated,
        "emulated_devices": (emu or {}).get("devices"),
        "shared_gpu": (emu or {}).get("shared_gpu"),
        "stages": state.get("stages", []),
        "report": str(out / REPORT_FILE) if (out / REPORT_FILE).is_file() else None,
    }


__all__ = ["RunOptions", "RunUI", "run_pipeline"]
