"""``prism time``: slice timing of a bare graph (the paper's §5.3; docs/commands/time.md).

The ranks to time are split into slices of ``slice_size`` ranks; each slice is one sandbox run
(``prismllm.launch.sandbox``: the slice's ranks run the unmodified program for real, an
assistant replays every other rank of the bare graph "as fast as dependencies allow" and meets
them in every collective). Every rank is real in exactly one slice. Ranks whose graphs are
equal up to renaming (the DP replicas of a solo capture with ``--layout``) are timed once: the
representative's measured graph stands for its replicas, renamed as the capture renamed them.

Slices run ``parallel`` at a time, each its own launch with its own store (on GPU: its own
``slice_size`` sandbox GPUs and one assistant GPU), from a thread of this process. A slice whose
run finished is not run again: an interrupted ``prism time`` resumes.

Output ``OUT``: ``slices/slice-<k>/`` (each sandbox run's output: its ranks' rank logs and
``slice.json``, how it ended), ``slices/slice-<k>.log`` (its processes' output and the
launcher's status lines), and ``graph/``, the *timed graph*: the bare graph's structure with every rank's
compute spans and communication durations as measured in its slice (a PrismTrace, mode
"timed"), the input of ``prism calibrate``.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from prismllm.childenv import head_start_for, native_lane_setting
from prismllm.errors import PrismError, RequirementError
from prismllm.fromfields import FromFields
from prismllm.fsutil import write_file_atomically
from prismllm.launch import LAUNCHER_ID, STATUS_PREFIX, LaunchError, LaunchInterrupted
from prismllm.launch.program import check_program
from prismllm.launch.sandbox import (
    SandboxSpec,
    cuda_count,
    launch_sandbox,
    recorded_inputs,
    sandbox_devices,
    spread_gpus,
)
from prismllm.layout import Layout, replica_plan
from prismllm.outdir import writing
from prismllm.outputs import GRAPH_DIR, LOAD_DIR, RANKLOGS_DIR, SLICE_FILE
from prismllm.specs import DeviceSpec, parse_devices
from prismllm.trace.assemble import assemble_spool
from prismllm.trace.graph import PrismTrace, read_manifest
from prismllm.trace.ranklog import ranklog_path
from prismllm.trace.replicate import assemble_replicated
from prismllm.trace.schema import REPLICAS_KEY

SLICES_DIR = "slices"
STATE_FILE = "time.json"


@dataclasses.dataclass
class TimeOptions(FromFields):
    graph: str | os.PathLike  # the bare graph
    out: str | os.PathLike
    script: str
    args: Sequence[str] = ()
    # auto | cpu | cuda (slice_size sandbox GPUs and one assistant GPU per slice) | cuda:G,... (the GPUs of the
    # slices at a time, slice by slice; a GPU listed twice is shared); see :func:`slice_devices`
    devices: str = "auto"
    slice_size: int = 1  # sandbox ranks per slice
    parallel: int | None = None  # slices at a time; None: as many as the listed (cuda, auto: visible) GPUs hold, else 1
    tensors: str | os.PathLike | None = None  # recorded inputs (default: GRAPH/tensors)
    inputs: str = "auto"  # recorded | generated | auto (recorded where the graph has them)
    every_rank: bool = False  # time DP replicas too instead of their representative
    timeout: float | None = None  # per slice
    force: bool = False
    # CPU: compute spans from a second pass with every rank at once (docs/commands/time.md, "Compute under load")
    compute_under_load: bool = False
    spin: dict[str, float] | None = None  # {label: ms}: the timed ranks spin in spans so labelled (prism whatif --spin)
    verify: bool = True  # check the graph's and the store's checksums (and the store's index) before launching
    # GPU: after each wait of a slice's host for its device, the device sleeps, left out of its timeline, so
    # that the host runs ahead of it: "overhead" (the emulation layer's host time until the next wait: the
    # program's own pace), "iteration" (about one iteration: the device's work alone), "off" (comm.headstart),
    # or "auto": off where the slices run the native lane, else overhead (childenv.head_start_for)
    head_start: str = "auto"


@dataclasses.dataclass
class TimeResult:
    out: Path
    graph: Path  # the timed graph
    slices: list[list[int]]
    timed_ranks: list[int]
    world_size: int
    wall_s: float
    resumed: int  # slices found done from an earlier run
    left_out_ns: dict[str, int] = dataclasses.field(default_factory=dict)  # per timed rank (CPU)


def _replicas(manifest: dict[str, Any], every_rank: bool):
    """The ReplicaPlan of the graph's capture (representatives and renamings), or None when
    every rank is timed."""
    cap = manifest.get("capture") or {}
    if every_rank or not cap.get("dedup") or not manifest.get("layout"):
        return None
    world = int(manifest["world_size"])
    plan = replica_plan(Layout.parse(manifest["layout"], world))  # a manifest's layout reads back
    if cap.get("replica_of") is not None and plan.replica_of.tolist() != list(cap["replica_of"]):
        raise PrismError("the graph's replica map does not follow its layout: time every rank (--every-rank)")
    return plan


def plan_slices(ranks: Sequence[int], slice_size: int) -> list[list[int]]:
    """Consecutive ranks ``slice_size`` at a time (the last slice may be smaller)."""
    if slice_size < 1:
        raise PrismError(f"--slice-size must be at least 1, not {slice_size}")
    ranks = list(ranks)
    return [ranks[i : i + slice_size] for i in range(0, len(ranks), slice_size)]


def _done(slice_out: Path, ranks: list[int]) -> bool:
    f = slice_out / SLICE_FILE
    if not f.is_file():
        return False
    try:
        info = json.loads(f.read_text())
    except (OSError, ValueError):
        return False
    return bool(info.get("ok")) and all(ranklog_path(slice_out / RANKLOGS_DIR, r).is_file() for r in ranks)


def slice_devices(opts: TimeOptions, at_once: int, cuda_on_cpu: bool = False) -> list[DeviceSpec]:
    """The devices of each of ``at_once`` slices run together: ``slice_size`` sandbox GPUs then
    one assistant GPU each (``cuda``: in index order; ``cuda:G,...``: as listed, slice after
    slice; ``auto``: a GPU each when there are enough, else GPU 0 shared, else the CPU; a graph
    captured with ``cuda_on_cpu``: the CPU)."""
    per = opts.slice_size + 1
    dev = sandbox_devices(opts.devices, per * at_once, cuda_on_cpu)
    if dev.kind == "cpu":
        return [dev] * at_once
    if dev.gpus is None:
        have = cuda_count()
        if have < per * at_once:
            raise RequirementError(
                f"{at_once} slice(s) at a time of {opts.slice_size} sandbox GPU(s) and one assistant GPU "
                f"need {per * at_once} GPUs, {have} visible (lower --parallel or --slice-size, or list "
                f"shared ones: --devices cuda:{','.join(['0'] * per)})"
            )
        gpus: tuple[int, ...] = tuple(range(per * at_once))
    else:
        if len(dev.gpus) < per * at_once:
            fewer = f"lower --parallel to {len(dev.gpus) // per}" if len(dev.gpus) >= per else "lower --slice-size"
            raise PrismError(
                f"--devices {dev.text}: a slice is {opts.slice_size} sandbox GPU(s) and one assistant GPU, "
                f"{at_once} slice(s) at a time need {per * at_once}, {len(dev.gpus)} listed: list "
                f"{per * at_once} (a GPU listed twice is shared) or {fewer}"
            )
        gpus = dev.gpus[: per * at_once]  # the first of a longer list (fewer slices than it holds)
    return [DeviceSpec("cuda", gpus[k * per : (k + 1) * per]) for k in range(at_once)]


def check_time_devices(opts: TimeOptions, n_slices: int, cuda_on_cpu: bool = False) -> list[DeviceSpec]:
    """The devices of the slices run together to time ``n_slices`` slices; a PrismError before
    anything runs when the listed ones cannot hold them (``prism run`` asks before its capture,
    which may take minutes)."""
    return slice_devices(opts, min(_parallel(opts, cuda_on_cpu), n_slices), cuda_on_cpu)


def _parallel(opts: TimeOptions, cuda_on_cpu: bool = False) -> int:
    """Slices at a time: --parallel, else one per slice's worth of the listed GPUs (``cuda`` and
    ``auto``: of the visible ones; a graph captured with ``cuda_on_cpu`` runs on the CPU), else 1."""
    if opts.parallel is not None:
        return opts.parallel
    try:
        dev = parse_devices(opts.devices)
    except ValueError:
        return 1  # slice_devices says what is wrong with the list
    return max(1, spread_gpus(dev, cuda_on_cpu) // (opts.slice_size + 1))


def _for_slice(dev: DeviceSpec, slice_size: int, n_ranks: int) -> DeviceSpec:
    """A slice's devices for its ``n_ranks`` ranks: a short last slice leaves the GPUs of the
    ranks it lacks."""
    if dev.gpus is None or n_ranks == slice_size:
        return dev
    return DeviceSpec("cuda", dev.gpus[:n_ranks] + dev.gpus[slice_size:])


def _with_compute_of(trace: PrismTrace, other: PrismTrace) -> PrismTrace:
    """``trace`` with the compute spans' ``duration_ns`` of ``other``, a timed graph of the same
    structure (same ranks, nodes and ops in the same order); communication stays ``trace``'s."""
    a, b = trace.program_order(), other.program_order()
    same = (
        len(a) == len(b)
        and np.array_equal(trace.column("rank")[a], other.column("rank")[b])
        and np.array_equal(trace.column("op")[a], other.column("op")[b])
    )
    if not same:
        raise PrismError(
            "the load pass's timed graph does not have the slices' structure (a program that "
            "takes another path when all ranks run at once?): time without --compute-under-load"
        )
    dur = np.asarray(trace.column("duration_ns"), dtype=np.int64).copy()
    compute = trace.column("kind")[a] == "compute"
    dur[a[compute]] = np.asarray(other.column("duration_ns"), dtype=np.int64)[b[compute]]
    i = trace.nodes.schema.get_field_index("duration_ns")
    nodes = trace.nodes.set_column(i, trace.nodes.schema.field(i), pa.array(dur, type=pa.int64()))
    # every rank's compute its own: the replicas are no longer copies
    manifest = {k: v for k, v in trace.manifest.items() if k != REPLICAS_KEY}
    return dataclasses.replace(trace, manifest=manifest, nodes=nodes)


def slice_dir(out: Path, k: int) -> Path:
    """Slice ``k``'s emulation output."""
    return out / SLICES_DIR / f"slice-{k:05d}"


def _slice_log(out: Path, k: int) -> Path:
    """Slice ``k``'s console."""
    return out / SLICES_DIR / f"slice-{k:05d}.log"


class _SliceOutput:
    """Where a running slice's output goes (a LineSink): every line to the slice's log, and the
    launcher's own status lines (``prism: ...``, prismllm.launch.status) also to ``say``, so that
    a slice that makes no progress is not a silent one."""

    def __init__(self, k: int, ranks: list[int], log: Path, say: Callable[[str], None] | None):
        self.k, self.ranks, self.say = k, ranks, say
        self.lock = threading.Lock()
        self.f = open(log, "w")

    def __call__(self, rank: int, stream: str, line: str) -> None:
        with self.lock:
            self.f.write(line)
            self.f.flush()
        if rank == LAUNCHER_ID and self.say is not None and line.startswith(STATUS_PREFIX):
            self.say(f"slice {self.k} (ranks {','.join(map(str, self.ranks))}): {line[len(STATUS_PREFIX) :].rstrip()}")

    def close(self) -> None:
        self.f.close()


def _missing_transfers(r: str, d: dict[str, Any]) -> str | None:
    if not d.get("missing"):
        return None
    return (
        f"rank {r}: NCCL's own time of {d['missing']} of {d['missing'] + d.get('read', 0)} asynchronous calls "
        f"was not read (first: {d.get('first_missing')}); those transfers end where the program waited"
    )


def _host_behind(r: str, h: dict[str, int]) -> str | None:
    if not h.get("host_behind"):
        return None
    return (
        f"rank {r}: its device caught up with its host at {h['host_behind']} of {h['points']} points despite "
        f"the head start: its spans there hold the sandbox host's pace (host-bound)"
    )


# what a GPU slice reports per timed rank (kept in the timed graph's manifest), and the line prism time
# says where it matters
_GPU_NOTES = {"transfer_durations": _missing_transfers, "head_start": _host_behind}


def _run_slice(
    opts: TimeOptions,
    graph: Path,
    tensors: Path | None,
    world: int,
    k: int,
    ranks: list[int],
    out: Path,
    devices: DeviceSpec,
    say: Callable[[str], None] | None,
    handle_signals: bool,
    cancel: threading.Event | None,
) -> dict[str, Any]:
    """One slice's sandbox run; writes and returns its record (SLICE_FILE); PrismError if it failed."""
    so = slice_dir(out, k)
    if so.exists():
        shutil.rmtree(so)
    so.mkdir(parents=True)
    devices = _for_slice(devices, opts.slice_size, len(ranks))
    sink = _SliceOutput(k, ranks, _slice_log(out, k), say)
    try:
        run = launch_sandbox(
            SandboxSpec(
                graph=graph,
                world=world,
                sandbox=tuple(ranks),
                script=opts.script,
                args=list(opts.args),
                out=so,
                devices=devices,
                tensors=tensors,
                timing="fast",
                timeout=opts.timeout,
                sink=sink,
                handle_signals=handle_signals,
                cancel=cancel,
                spin=opts.spin,
                head_start=opts.head_start if opts.head_start != "off" and devices.kind == "cuda" else None,
                transfer_durations=True,  # the timed graph's transfers: NCCL's own time of each
            )
        )
    finally:
        sink.close()
    record = {
        "ok": run.failure is None,
        "ranks": ranks,
        "devices": devices.text,
        "wall_s": round(run.wall_s, 3),
        "message": "" if run.failure is None else str(run.failure),
        "sandbox_results": {str(r): m for r, m in run.sandbox_results.items()},
    }
    (so / SLICE_FILE).write_text(json.dumps(record, indent=1) + "\n")
    if run.failure is not None:
        raise LaunchError(
            f"slice {k} (ranks {','.join(map(str, ranks))}) failed: {run.failure}; its output: {_slice_log(out, k)}",
            run.failure.result,
        )
    return record


def _run_parallel(
    opts: TimeOptions,
    graph: Path,
    tensors: Path | None,
    world: int,
    todo: list[tuple[int, list[int]]],
    out: Path,
    devices: list[DeviceSpec],
    say: Callable[[str], None] | None,
    progress: Callable[[int, int, list[int], float], None] | None,
    done: int,
    total: int,
) -> int:
    """Run the slices of ``todo``, one thread per device set (``len(devices)`` at a time); the first
    failure, or an interrupt, ends the others' runs (``cancel``) before it is raised."""
    cancel = threading.Event()
    free = list(devices)
    pending = list(todo)
    running: dict[concurrent.futures.Future, tuple[list[int], float, DeviceSpec]] = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(devices), thread_name_prefix="prism-slice") as pool:
        try:
            while pending or running:
                while pending and free:
                    (k, s), g = pending.pop(0), free.pop(0)
                    fut = pool.submit(_run_slice, opts, graph, tensors, world, k, s, out, g, say, False, cancel)
                    running[fut] = (s, time.monotonic(), g)
                finished, _ = concurrent.futures.wait(
                    running, timeout=0.5, return_when=concurrent.futures.FIRST_COMPLETED
                )
                for fut in finished:
                    s, t1, g = running.pop(fut)
                    free.append(g)
                    fut.result()  # a failed slice: its PrismError
                    done += 1
                    if progress is not None:
                        progress(done, total, s, time.monotonic() - t1)
        except BaseException:
            cancel.set()  # the other slices' launches end their processes
            for fut in running:
                try:
                    fut.result()
                except (PrismError, LaunchInterrupted):
                    pass
            raise
    return done


def time_slices(
    opts: TimeOptions,
    progress: Callable[[int, int, list[int], float], None] | None = None,
    say: Callable[[str], None] | None = None,
) -> TimeResult:
    """Run every slice not done yet, then assemble the timed graph. ``progress(done, total,
    ranks, seconds)`` is called after each slice; ``say(line)`` with each status report line a
    running slice's launcher writes (a slice that makes no progress: ``prismllm.launch.status``),
    so that a stuck slice is not a silent one. The one writer of ``opts.out`` while it runs
    (``prismllm.outdir``)."""
    with writing(opts.out):
        return _time_slices(opts, progress, say)


def _time_slices(
    opts: TimeOptions,
    progress: Callable[[int, int, list[int], float], None] | None,
    say: Callable[[str], None] | None,
) -> TimeResult:
    t0 = time.monotonic()
    graph = Path(opts.graph)
    manifest = read_manifest(graph, opts.verify)
    world = int(manifest["world_size"])
    if opts.parallel is not None and opts.parallel < 1:
        raise PrismError(f"--parallel must be at least 1, not {opts.parallel}")
    if not os.path.isfile(opts.script):
        raise PrismError(f"script not found: {opts.script}")
    check_program(manifest, opts.script, opts.args, world)  # the graph's program, or refuse
    cuda_on_cpu = bool(manifest.get("cuda_on_cpu"))  # as the graph was captured
    if opts.compute_under_load and sandbox_devices(opts.devices, opts.slice_size + 1, cuda_on_cpu).kind != "cpu":
        raise PrismError(
            "--compute-under-load is for CPU timing (ranks sharing one host's cores); on GPUs each "
            "rank has its own device and one slice at a time measures what it gets"
        )
    reps = _replicas(manifest, opts.every_rank)
    ranks = reps.representatives if reps is not None else list(range(world))
    if opts.slice_size >= world:
        raise PrismError(f"--slice-size {opts.slice_size}: a slice must leave some of the {world} ranks virtual")
    slices = plan_slices(ranks, opts.slice_size)
    tensors = recorded_inputs(graph, opts.tensors, opts.inputs, opts.verify)  # the virtual ranks' inputs, if recorded
    devices = check_time_devices(opts, len(slices), cuda_on_cpu)
    # "auto" settled once, before any launch (a bad choice or PRISM_NATIVE_LANE fails here)
    lane = native_lane_setting(on_gpu=devices[0].kind == "cuda")
    opts = dataclasses.replace(opts, head_start=head_start_for(opts.head_start, lane) or "off")
    out = Path(opts.out)
    state = {
        "graph": str(graph.resolve()),
        "command": [opts.script, *opts.args],
        "slice_size": opts.slice_size,
        "devices": opts.devices,
        "inputs": "recorded" if tensors is not None else "generated",
        "slices": slices,
    }
    if opts.spin:  # a what-if's timing (prism whatif --spin) is another job
        state["spin"] = opts.spin
    sf = out / STATE_FILE
    if sf.is_file():
        old = json.loads(sf.read_text())
        if {k: old.get(k) for k in state} != state and not opts.force:
            raise PrismError(
                f"{out} holds slice timing of another graph, command or slicing (use --force to start over)"
            )
        if opts.force and {k: old.get(k) for k in state} != state:
            shutil.rmtree(out)
    elif out.exists() and any(out.iterdir()):
        if not opts.force:
            raise PrismError(f"output directory {out} exists and is not empty (use --force to replace it)")
        shutil.rmtree(out)
    (out / SLICES_DIR).mkdir(parents=True, exist_ok=True)
    write_file_atomically(sf, json.dumps(state, indent=1) + "\n")  # read back unguarded by a resume

    todo = [(k, s) for k, s in enumerate(slices) if not _done(slice_dir(out, k), s)]
    resumed = len(slices) - len(todo)
    done = resumed
    if todo:
        if len(devices) == 1 or len(todo) == 1:  # in this thread: the launcher's own signal handling
            for k, s in todo:
                t1 = time.monotonic()
                _run_slice(opts, graph, tensors, world, k, s, out, devices[0], say, True, None)
                done += 1
                if progress is not None:
                    progress(done, len(slices), s, time.monotonic() - t1)
        else:
            done = _run_parallel(opts, graph, tensors, world, todo, out, devices, say, progress, done, len(slices))

    load = None
    if opts.compute_under_load:  # every rank real at once, each in its own slice: the host's load
        # (at most one slice a core: a real run of more ranks than cores is oversubscribed anyway,
        # and 2N processes of a large N would not fit in memory)
        at_once = max(1, min(world, os.cpu_count() or 1))
        load = time_slices(
            dataclasses.replace(
                opts, out=out / LOAD_DIR, every_rank=True, parallel=at_once, compute_under_load=False, force=False
            ),
            progress,
        )
    spool = out / "spool"
    if spool.exists():
        shutil.rmtree(spool)
    spool.mkdir()
    left_out = {}  # per timed rank: the emulation layer's host time left out of its clock
    emulation_host = {}  # per timed rank: that layer's host time on any device (GPU: not left out)
    host_parts = {}  # per timed rank: that time by part, over the steady iterations (Recorder.emulation_host_parts)
    transfer_durations = {}  # per timed rank on GPU: calls timed by NCCL's own events, and not
    head_starts = {}  # per timed rank on GPU: the host's head starts (comm.headstart)
    native_lane = {}  # per timed rank with PRISM_NATIVE_LANE=1: its calls from a template and through Python
    gpu = {}  # per timed rank on GPU: the clock its GPU ran at (comm.gpuclock)
    for k, s in enumerate(slices):
        for r in s:
            name = f"rank-{r:06d}.msgpack"
            shutil.copyfile(slice_dir(out, k) / RANKLOGS_DIR / name, spool / name)
        sl = json.loads((slice_dir(out, k) / SLICE_FILE).read_text())
        for r, m in sl.get("sandbox_results", {}).items():
            left_out[r] = int(m.get("emulation_overhead_left_out_ns", 0))
            emulation_host[r] = int(m.get("emulation_host_ns", 0))
            for key, kept in (
                ("emulation_host_parts", host_parts),
                ("emulation_native_lane", native_lane),
                ("gpu", gpu),
            ):
                if m.get(key):
                    kept[r] = m[key]
            for key, kept in (("transfer_durations", transfer_durations), ("head_start", head_starts)):
                if m.get(key):
                    kept[r] = m[key]
                    line = _GPU_NOTES[key](r, m[key])
                    if line and say is not None:
                        say(line)
    # the bare graph's manifest, its program fingerprint and command included (what
    # `prism emulate` checks a launch of the timed or calibrated graph against)
    tm = {k: v for k, v in manifest.items() if k not in ("peak_memory_bytes", "capture", REPLICAS_KEY)}
    # which slice measured each rank (a replica: its representative's): calibration takes an
    # instance's transfer per slice, the members measured together sharing one measurement
    slice_of = [-1] * world
    for k, s in enumerate(slices):
        for r in s:
            slice_of[r] = k
    if reps is not None:
        slice_of = [slice_of[int(rep)] for rep in reps.replica_of.tolist()]
    tm.update(
        mode="timed",
        timing={
            "bare_graph": str(graph.resolve()),
            "slice_size": opts.slice_size,
            "slices": len(slices),
            "timed_ranks": len(ranks),
            "devices": opts.devices,
            "inputs": state["inputs"],
            "slice_of_rank": slice_of,
            "emulation_overhead_left_out_ns": left_out,
            "emulation_host_ns": emulation_host,
            "emulation_host_parts": host_parts,
            "emulation_native_lane": native_lane,
            "gpu": gpu,
            "transfer_durations": transfer_durations,
            "head_start": head_starts,
            "compute_from": "load pass: every rank at once (DIR/load)" if load else "the slices",
        },
    )
    if reps is not None:
        trace = assemble_replicated(spool, tm, replica_of=reps.replica_of, map_of=reps.map_of, rename=reps.rename)
    else:
        trace = assemble_spool(spool, tm)
    if load is not None:
        trace = _with_compute_of(trace, PrismTrace.load(load.graph))
    gdir = out / GRAPH_DIR
    if gdir.exists():
        shutil.rmtree(gdir)
    trace.save(gdir)
    shutil.rmtree(spool)
    return TimeResult(
        out=out,
        graph=gdir,
        slices=slices,
        timed_ranks=list(ranks),
        world_size=world,
        wall_s=time.monotonic() - t0,
        resumed=resumed,
        left_out_ns=left_out,
    )


__all__ = ["TimeOptions", "TimeResult", "plan_slices", "slice_dir", "time_slices"]
