"""``prism time``: slice timing of a bare graph (the paper's §5.3; docs/time.md).

The ranks to time are split into slices of ``slice_size`` ranks; each slice is one emulation
(``prism emulate``: the slice's ranks run the unmodified program for real as the sandbox, an
assistant replays every other rank of the bare graph "as fast as dependencies allow" and meets
them in every collective). Every rank is real in exactly one slice. Ranks whose graphs are
equal up to renaming (the DP replicas of a solo capture with ``--layout``) are timed once: the
representative's measured graph stands for its replicas, renamed as the capture renamed them.

Slices run ``parallel`` at a time, each an independent ``prism emulate`` process with its own
launcher and store (on GPU: its own ``slice_size`` sandbox GPUs and one assistant GPU). A slice
whose emulation finished is not run again: an interrupted ``prism time`` resumes.

Output ``OUT``: ``slices/slice-<k>/`` (each emulation's output: its ranks' rank logs, logs,
emulate.json), and ``graph/``, the *timed graph*: the bare graph's structure with every rank's
compute spans and communication durations as measured in its slice (a PrismTrace, mode
"timed"), the input of ``prism calibrate``.
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
from typing import Any, Callable, Sequence

import numpy as np
import pyarrow as pa

from prismllm.capture.launcher import STATUS_PREFIX, gpu_ids
from prismllm.capture.record import parse_gpu_list
from prismllm.emulate.fingerprint import check_program
from prismllm.errors import PrismError
from prismllm.trace.graph import PrismTrace

SLICES_DIR = "slices"
GRAPH_DIR = "graph"
LOAD_DIR = "load"  # the compute-under-load pass (its own slices and graph)
STATE_FILE = "time.json"
_EMULATE_ERROR = "prism emulate: error: "  # how a slice's `prism emulate` reports its failure


@dataclasses.dataclass
class TimeOptions:
    graph: str | os.PathLike  # the bare graph
    out: str | os.PathLike
    script: str
    args: Sequence[str] = ()
    devices: str = "cpu"  # "cpu", "cuda" or "cuda:G,..." (one slice's GPUs, shared ones listed twice)
    slice_size: int = 1  # sandbox ranks per slice
    parallel: int = 1  # slices at a time (GPU: at most GPUs // (slice_size + 1))
    tensors: str | os.PathLike | None = None  # recorded inputs (default: GRAPH/tensors)
    inputs: str = "recorded"  # or "generated"
    every_rank: bool = False  # time DP replicas too instead of their representative
    timeout: float | None = None  # per slice
    force: bool = False
    # CPU: compute spans from a second pass with every rank at once (docs/time.md, "Compute under load")
    compute_under_load: bool = False


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


def _manifest(graph: Path) -> dict[str, Any]:
    mf = graph / "manifest.json"
    if not mf.is_file():
        raise PrismError(f"{graph} holds no graph (manifest.json missing)")
    try:
        return json.loads(mf.read_text())
    except (OSError, ValueError) as e:
        raise PrismError(f"cannot read {mf}: {e}") from None


def _replicas(manifest: dict[str, Any], every_rank: bool):
    """The ReplicaPlan of the graph's capture (representatives and renamings), or None when
    every rank is timed."""
    from prismllm.capture.layout import Layout, replica_plan

    cap = manifest.get("capture") or {}
    if every_rank or not cap.get("dedup") or not manifest.get("layout"):
        return None
    world = int(manifest["world_size"])
    spec = {k: v for k, v in manifest["layout"].items() if k in ("tp", "cp", "ep", "pp", "dp", "order")}
    plan = replica_plan(Layout.parse(spec, world))
    if cap.get("replica_of") is not None and plan.replica_of.tolist() != list(cap["replica_of"]):
        raise PrismError("the graph's replica map does not follow its layout: time every rank (--every-rank)")
    return plan


def plan_slices(ranks: Sequence[int], slice_size: int) -> list[list[int]]:
    """Consecutive ranks ``slice_size`` at a time (the last slice may be smaller)."""
    if slice_size < 1:
        raise PrismError(f"--slice-size must be at least 1, not {slice_size}")
    ranks = list(ranks)
    return [ranks[i:i + slice_size] for i in range(0, len(ranks), slice_size)]


def _done(slice_out: Path, ranks: list[int]) -> bool:
    f = slice_out / "emulate.json"
    if not f.is_file():
        return False
    try:
        info = json.loads(f.read_text())
    except (OSError, ValueError):
        return False
    return bool(info.get("ok")) and all((slice_out / "ranklogs" / f"rank-{r:06d}.msgpack").is_file() for r in ranks)


def _slice_devices(opts: TimeOptions, n_ranks: int) -> str:
    """--devices of one slice's emulation: a listed slice (cuda:G,...: --slice-size sandbox GPUs,
    then the assistant's) loses the GPUs of the ranks a short last slice lacks."""
    if not opts.devices.startswith("cuda:"):
        return opts.devices
    gpus = [str(g) for g in parse_gpu_list(opts.devices)]
    if len(gpus) != opts.slice_size + 1:
        raise PrismError(f"--devices {opts.devices}: a slice is {opts.slice_size} sandbox GPU(s) and one "
                         f"assistant GPU, {len(gpus)} listed")
    return "cuda:" + ",".join(gpus[:n_ranks] + gpus[opts.slice_size:])


def _emulate_cmd(opts: TimeOptions, graph: Path, ranks: list[int], out: Path) -> list[str]:
    cmd = [sys.executable, "-m", "prismllm.cli.main", "emulate", "--graph", str(graph),
           "--sandbox", ",".join(map(str, ranks)), "--out", str(out), "--force", "--devices",
           _slice_devices(opts, len(ranks)), "--inputs", opts.inputs]
    if opts.tensors is not None:
        cmd += ["--tensors", str(opts.tensors)]
    if opts.timeout is not None:
        cmd += ["--timeout", str(opts.timeout)]
    return cmd + ["--", opts.script, *opts.args]


def _gpu_sets(opts: TimeOptions, n: int) -> list[str | None]:
    """CUDA_VISIBLE_DEVICES of each of ``n`` concurrent slices (None on CPU)."""
    if opts.devices != "cuda":
        return [None] * n
    import torch

    per = opts.slice_size + 1
    have = torch.cuda.device_count()
    if have < per * n:
        raise PrismError(f"{n} slice(s) at a time of {opts.slice_size} sandbox GPU(s) and one assistant GPU "
                         f"need {per * n} GPUs, {have} visible (lower --parallel or --slice-size)")
    return [",".join(gpu_ids(list(range(k * per, (k + 1) * per)), os.environ)) for k in range(n)]


def _with_compute_of(trace: PrismTrace, other: PrismTrace) -> PrismTrace:
    """``trace`` with the compute spans' ``duration_ns`` of ``other``, a timed graph of the same
    structure (same ranks, nodes and ops in the same order); communication stays ``trace``'s."""
    a, b = trace.program_order(), other.program_order()
    same = (len(a) == len(b) and np.array_equal(trace.column("rank")[a], other.column("rank")[b])
            and np.array_equal(trace.column("op")[a], other.column("op")[b]))
    if not same:
        raise PrismError("the load pass's timed graph does not have the slices' structure (a program that "
                         "takes another path when all ranks run at once?): time without --compute-under-load")
    dur = np.asarray(trace.column("duration_ns"), dtype=np.int64).copy()
    compute = trace.column("kind")[a] == "compute"
    dur[a[compute]] = np.asarray(other.column("duration_ns"), dtype=np.int64)[b[compute]]
    i = trace.nodes.schema.get_field_index("duration_ns")
    nodes = trace.nodes.set_column(i, trace.nodes.schema.field(i), pa.array(dur, type=pa.int64()))
    return dataclasses.replace(trace, nodes=nodes)


def _slice_dir(out: Path, k: int) -> Path:
    """Slice ``k``'s emulation output."""
    return out / SLICES_DIR / f"slice-{k:05d}"


def _slice_log(out: Path, k: int) -> Path:
    """Slice ``k``'s console."""
    return out / SLICES_DIR / f"slice-{k:05d}.log"


class _StatusRelay:
    """Passes on the status report lines (``prism: ...``, prismllm.status) that the running
    slices' launchers write to their logs, checked once a second."""

    def __init__(self, say: Callable[[str], None] | None):
        self.say = say
        self.offsets: dict[int, int] = {}
        self.next_check = 0.0

    def poll(self, logs: list[tuple[int, list[int], Path]]) -> None:
        if self.say is None or time.monotonic() < self.next_check:
            return
        self.next_check = time.monotonic() + 1.0
        for k, ranks, path in logs:
            try:
                with open(path, "rb") as f:
                    f.seek(self.offsets.get(k, 0))
                    data = f.read()
            except OSError:
                continue
            end = data.rfind(b"\n") + 1  # whole lines only
            self.offsets[k] = self.offsets.get(k, 0) + end
            for line in data[:end].decode(errors="replace").splitlines():
                if line.startswith(STATUS_PREFIX):
                    self.say(f"slice {k} (ranks {','.join(map(str, ranks))}): {line[len(STATUS_PREFIX):]}")


def _failure_lines(log: str) -> str:
    """How a slice's emulation ended, from its log: its error and, after a timeout, the report
    of where each process stood (on lines of their own); else its last lines."""
    lines = log.strip().splitlines()
    err = next((i for i in range(len(lines) - 1, -1, -1) if lines[i].startswith(_EMULATE_ERROR)), None)
    if err is None:
        return " | ".join(lines[-6:])
    return "\n".join([lines[err][len(_EMULATE_ERROR):], *lines[err + 1:]])


def time_slices(opts: TimeOptions, progress: Callable[[int, int, list[int], float], None] | None = None,
                say: Callable[[str], None] | None = None) -> TimeResult:
    """Run every slice not done yet, then assemble the timed graph. ``progress(done, total,
    ranks, seconds)`` is called after each slice; ``say(line)`` with each status report line a
    running slice's launcher writes to its log (a slice that makes no progress:
    ``prismllm.status``), so that a stuck slice is not a silent one."""
    from prismllm.trace.assemble import assemble_replicated, assemble_spool

    t0 = time.monotonic()
    graph = Path(opts.graph)
    manifest = _manifest(graph)
    world = int(manifest["world_size"])
    if opts.parallel < 1:
        raise PrismError(f"--parallel must be at least 1, not {opts.parallel}")
    if opts.devices.startswith("cuda:"):
        _slice_devices(opts, opts.slice_size)  # the list fits a slice
        if opts.parallel > 1:
            raise PrismError(f"--devices {opts.devices} names the GPUs of one slice: --parallel must be 1")
    if not os.path.isfile(opts.script):
        raise PrismError(f"script not found: {opts.script}")
    check_program(manifest, opts.script, opts.args, world)  # the graph's program, or refuse
    if opts.compute_under_load and opts.devices != "cpu":
        raise PrismError("--compute-under-load is for CPU timing (ranks sharing one host's cores); on GPUs each "
                         "rank has its own device and one slice at a time measures what it gets")
    reps = _replicas(manifest, opts.every_rank)
    ranks = reps.representatives if reps is not None else list(range(world))
    if opts.slice_size >= world:
        raise PrismError(f"--slice-size {opts.slice_size}: a slice must leave some of the {world} ranks virtual")
    slices = plan_slices(ranks, opts.slice_size)
    out = Path(opts.out)
    state = {"graph": str(graph.resolve()), "command": [opts.script, *opts.args], "slice_size": opts.slice_size,
             "devices": opts.devices, "inputs": opts.inputs, "slices": slices}
    sf = out / STATE_FILE
    if sf.is_file():
        old = json.loads(sf.read_text())
        if {k: old.get(k) for k in state} != state and not opts.force:
            raise PrismError(f"{out} holds slice timing of another graph, command or slicing "
                             f"(use --force to start over)")
        if opts.force and {k: old.get(k) for k in state} != state:
            shutil.rmtree(out)
    elif out.exists() and any(out.iterdir()):
        if not opts.force:
            raise PrismError(f"output directory {out} exists and is not empty (use --force to replace it)")
        shutil.rmtree(out)
    (out / SLICES_DIR).mkdir(parents=True, exist_ok=True)
    sf.write_text(json.dumps(state, indent=1) + "\n")

    todo = [(k, s) for k, s in enumerate(slices) if not _done(_slice_dir(out, k), s)]
    resumed = len(slices) - len(todo)
    done = resumed
    gpus = _gpu_sets(opts, min(opts.parallel, max(1, len(todo))))
    running: list[tuple[subprocess.Popen, int, list[int], float, str | None, Path]] = []
    free = list(gpus)
    relay = _StatusRelay(say)
    try:
        while todo or running:
            while todo and free:
                k, s = todo.pop(0)
                dev = free.pop(0)
                so = _slice_dir(out, k)
                env = dict(os.environ)
                if dev is not None:
                    env["CUDA_VISIBLE_DEVICES"] = dev
                log = open(_slice_log(out, k), "w")
                p = subprocess.Popen(_emulate_cmd(opts, graph, s, so), stdout=log, stderr=subprocess.STDOUT,
                                     env=env, start_new_session=True)
                log.close()
                running.append((p, k, s, time.monotonic(), dev, so))
            time.sleep(0.1)
            relay.poll([(k, s, _slice_log(out, k)) for _, k, s, *_ in running])
            for item in [r for r in running if r[0].poll() is not None]:
                p, k, s, t1, dev, so = item
                running.remove(item)
                free.append(dev)
                if p.returncode != 0 or not _done(so, s):
                    raise PrismError(f"slice {k} (ranks {s}) failed (exit status {p.returncode}): "
                                     + _failure_lines(_slice_log(out, k).read_text()))
                done += 1
                if progress is not None:
                    progress(done, len(slices), s, time.monotonic() - t1)
    finally:
        for p, *_ in running:  # an error or an interrupt: end the other slices' emulations
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()

    load = None
    if opts.compute_under_load:  # every rank real at once, each in its own slice: the host's load
        # (at most one slice a core: a real run of more ranks than cores is oversubscribed anyway,
        # and 2N processes of a large N would not fit in memory)
        at_once = max(1, min(world, os.cpu_count() or 1))
        load = time_slices(dataclasses.replace(opts, out=out / LOAD_DIR, every_rank=True, parallel=at_once,
                                               compute_under_load=False, force=False), progress)
    spool = out / "spool"
    if spool.exists():
        shutil.rmtree(spool)
    spool.mkdir()
    left_out = {}  # per timed rank: the emulation layer's host time left out of its clock
    for k, s in enumerate(slices):
        for r in s:
            name = f"rank-{r:06d}.msgpack"
            shutil.copyfile(_slice_dir(out, k) / "ranklogs" / name, spool / name)
        sl = json.loads((_slice_dir(out, k) / "emulate.json").read_text())
        for r, m in sl.get("sandbox_results", {}).items():
            left_out[r] = int(m.get("emulation_overhead_left_out_ns", 0))
    # the bare graph's manifest, its program fingerprint and command included (what
    # `prism emulate` checks a launch of the timed or calibrated graph against)
    tm = {k: v for k, v in manifest.items() if k not in ("peak_memory_bytes", "capture")}
    # which slice measured each rank (a replica: its representative's): calibration takes an
    # instance's transfer per slice, the members measured together sharing one measurement
    slice_of = [-1] * world
    for k, s in enumerate(slices):
        for r in s:
            slice_of[r] = k
    if reps is not None:
        slice_of = [slice_of[int(rep)] for rep in reps.replica_of.tolist()]
    tm.update(mode="timed", timing={"bare_graph": str(graph.resolve()), "slice_size": opts.slice_size,
                                   "slices": len(slices), "timed_ranks": len(ranks), "devices": opts.devices,
                                   "inputs": opts.inputs, "slice_of_rank": slice_of,
                                   "emulation_overhead_left_out_ns": left_out,
                                   "compute_from": "load pass: every rank at once (DIR/load)" if load else
                                   "the slices"})
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
    return TimeResult(out=out, graph=gdir, slices=slices, timed_ranks=list(ranks), world_size=world,
                      wall_s=time.monotonic() - t0, resumed=resumed, left_out_ns=left_out)


__all__ = ["TimeOptions", "TimeResult", "plan_slices", "time_slices"]
