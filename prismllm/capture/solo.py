"""``prism capture --mode solo``: the bare graph of an N-rank job from a few ranks run alone.

Each rank runs by itself (mode ``solo``: the solo backend answers every collective from
the tensor generator or a tensor store, no peer is needed) and writes its RankLog to
``<out>/.spool``, exactly as ``prism record`` does. With a ``--layout`` only one representative
per replica class runs (``prismllm.layout``: one per (tp, cp, ep, pp) coordinate, the
DP / expert-DP replicas are renamed copies); without one every rank runs. Ranks run G at a
time through the launcher (``ranks=[...]``, ``world_size=N``), one process per rank (one GPU
each on CUDA).

Resume: ``<out>/.spool/capture.json`` holds the run's fingerprint (world, layout, command,
script digest, rules, tensor store, device kind, runner) and the ranks finished so far. A
rank counts as finished only when its process exited 0 and its log is in the spool (a failed
rank's log, which the bootstrap still writes at exit, is kept for diagnosis but not counted).
Re-running the same command skips the finished ranks; a different command on the same
directory is refused (``--force`` starts over). After a successful assembly the graph is saved
into ``<out>`` and the spool is removed.
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
from prismllm.capture import common
from prismllm.capture.common import (
    SPOOL_DIR,
    build_manifest,
    check_importable,
    check_save_tensors,
    keep_messages,
    program_of,
    resolve_devices,
    save_into,
    trace_counts,
)
from prismllm.childenv import ChildEnv
from prismllm.errors import PrismError
from prismllm.fromfields import FromFields
from prismllm.fsutil import sha256_file
from prismllm.launch import (
    DEFAULT_RUNNER,
    LaunchError,
    LaunchResult,
    LaunchSpec,
    LineSink,
    RankOutOfMemory,
    error_line,
    launch,
    says_out_of_memory,
)
from prismllm.launch.sandbox import spread_gpus
from prismllm.layout import DIMS, Layout, ReplicaPlan, replica_plan
from prismllm.outdir import writing
from prismllm.outputs import LOGS_DIR
from prismllm.routing.contract import child_fields, manifest_entry
from prismllm.specs import format_ranks, parse_devices
from prismllm.trace.alltoall import reconcile_all_to_all
from prismllm.trace.ranklog import ranklog_path
from prismllm.trace.replicate import UnreplicableGroup, assemble_replicated
from prismllm.trace.schema import MANIFEST_FILE, TENSORS_DIR
from prismllm.trace.validate import validate

CAPTURE_MODES = ("solo", "switch")  # each rank alone, generated answers; every rank at once, real values
STATE_FILE = "capture.json"
STATE_VERSION = 1

# (done, total, ranks run so far in this invocation, seconds since the first launch)
ProgressFn = Callable[[int, int, int, float], None]


@dataclasses.dataclass
class CaptureOptions(FromFields):
    world: int
    out: str | os.PathLike
    script: str
    args: Sequence[str] = ()
    devices: str = "auto"  # auto | cpu | cuda | cuda:G,G,... (prismllm.specs.DeviceSpec)
    cuda_on_cpu: bool = False  # map the program's CUDA calls to the CPU (prismllm.devicemap)
    router_module: str | None = None  # the MoE router whose logits ``routing`` forces (prismllm.routing)
    routing: str | os.PathLike | None = None  # a routing file
    parallel: int | None = None  # ranks at a time; None: one per listed (cuda, auto: visible) GPU, else 1
    layout: str | dict | None = None
    rules: str | os.PathLike | None = None  # a generator rules file (ChildEnv.rules)
    tensors: str | os.PathLike | None = None  # a recorded-tensor store (ChildEnv.tensor_store)
    force: bool = False
    timeout: float | None = None  # per batch of G ranks
    tee: bool = False
    line_prefix: str | None = None
    argv: Sequence[str] | None = None
    sink: LineSink | None = None
    runner: str = DEFAULT_RUNNER
    env: dict[str, str | None] = dataclasses.field(default_factory=dict)
    mode: str = "solo"
    verify: bool = True  # check the tensor store's checksums and index before any rank runs
    save_tensors: str | None = None  # switch mode: save the selected calls' values into OUT/tensors


@dataclasses.dataclass
class CapturePlan:
    """What a capture will do (``plan_capture``): for the CLI's first lines."""

    world: int
    layout: Layout | None
    replicas: ReplicaPlan
    device: str
    devices: str | list[int]
    parallel: int  # G
    pending: list[int]  # representatives still to run
    resumed: list[int]  # representatives finished by an earlier run of the same command
    resuming: bool


@dataclasses.dataclass
class CaptureResult:
    out: Path
    manifest: dict[str, Any]
    trace: Any
    wall_s: float
    world_size: int
    representatives: list[int]
    ranks_run: int  # by this invocation
    ranks_resumed: int  # finished by an earlier invocation, reused
    iterations: int | None
    nodes: int | None
    device: str
    dedup: bool
    timings: dict[str, float]


# ---------------------------------------------------------------------------------------------
# Fingerprint and state


def _path_digest(path: str | os.PathLike | None) -> dict[str, str] | None:
    """A file's path and content digest; a directory (tensor store): its path only."""
    if path is None:
        return None
    p = Path(path).resolve()
    d = {"path": str(p)}
    if p.is_file():
        d["sha256"] = sha256_file(p)
    return d


def fingerprint(opts: CaptureOptions, layout: Layout | None, device: str) -> dict[str, Any]:
    return {
        "mode": opts.mode,
        "world": int(opts.world),
        "layout": layout.canonical() if layout is not None else None,
        "command": [str(Path(opts.script).resolve()), *map(str, opts.args)],
        "script_sha256": sha256_file(opts.script),
        "rules": _path_digest(opts.rules),
        "tensors": _path_digest(opts.tensors),
        "device": device,
        "cuda_on_cpu": opts.cuda_on_cpu,
        "router_module": opts.router_module,
        "routing": _path_digest(opts.routing),
        "runner": opts.runner,
        "save_tensors": opts.save_tensors,
        "prismllm": __version__,
    }


def _read_state(spool: Path) -> dict[str, Any] | None:
    path = spool / STATE_FILE
    if not path.exists():
        return None
    try:
        with open(path) as f:
            state = json.load(f)
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise ValueError("unknown version")
        return state
    except (OSError, ValueError) as e:
        raise PrismError(f"{path} is unreadable ({e}); use --force to start the capture over") from None


def _write_state(spool: Path, state: dict[str, Any]) -> None:
    path = spool / STATE_FILE
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        json.dump(state, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def _fingerprint_diff(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    out = []
    for k in sorted(set(old) | set(new)):
        if old.get(k) != new.get(k):
            a, b = json.dumps(old.get(k)), json.dumps(new.get(k))
            if k == "command" or len(a) + len(b) > 160:
                out.append(k)
            else:
                out.append(f"{k} {a} -> {b}")
    return out


# ---------------------------------------------------------------------------------------------
# Planning


def _parallel_and_devices(opts: CaptureOptions) -> tuple[int, str, str | list[int]]:
    """(G ranks at a time, device kind, launcher devices: "cpu" or G GPU indices). A GPU list
    runs one rank per listed GPU (a GPU listed twice runs two of them); ``cuda`` and ``auto``
    one per visible GPU (``auto``: the CPU, one rank at a time, where none is; the visible GPUs
    shared where ``--parallel`` asks for more ranks at a time than there are GPUs)."""
    try:
        dev = parse_devices(opts.devices)
    except ValueError as e:
        raise PrismError(str(e)) from None
    g = opts.parallel if opts.parallel is not None else max(1, spread_gpus(dev, opts.cuda_on_cpu))
    if g < 1:
        raise PrismError(f"--parallel must be at least 1, not {g}")
    if opts.cuda_on_cpu:
        return g, *resolve_devices(dev.text, g, cuda_on_cpu=True)
    if dev.gpus is not None and len(dev.gpus) < g:
        raise PrismError(
            f"--devices {dev.text} lists {len(dev.gpus)} GPU(s) for --parallel {g}: one rank runs on "
            f"each listed GPU (list a GPU twice to run two ranks on it)"
        )
    if dev.kind == "auto":
        available, count = common.cuda_info()
        if available and g > count:
            # more ranks at a time than GPUs: they share them, as auto's slices and emulation do
            # (not the CPU: a program that picks its dtype by device, gpt3d's bf16 on CUDA, would
            # have a graph its GPU slices deviate from in `prism run`)
            return g, "cuda", [i % count for i in range(g)]
    device, devices = resolve_devices(dev.text, g)  # the first G of a longer list
    return g, device, devices


def plan_capture(opts: CaptureOptions) -> tuple[CapturePlan, dict[str, Any], dict[str, Any] | None]:
    """Check the inputs and work out what to run. Returns (plan, fingerprint, saved state or
    None). Raises PrismError with one clear message."""
    if opts.mode not in CAPTURE_MODES:
        raise PrismError(f"--mode must be one of {', '.join(CAPTURE_MODES)}, not {opts.mode!r}")
    if opts.mode == "switch":
        _check_switch(opts)
    elif opts.save_tensors is not None:
        raise PrismError("--save-tensors needs --mode switch: a solo rank's values are generated, not a run's")
    if not isinstance(opts.world, int) or opts.world < 1:
        raise PrismError(f"--world must be at least 1, not {opts.world}")
    if not os.path.exists(opts.script):
        raise PrismError(f"script not found: {opts.script}")
    if not os.path.isfile(opts.script):
        raise PrismError(f"script is not a file: {opts.script}")
    for flag, path in (("--rules", opts.rules), ("--tensors", opts.tensors), ("--routing", opts.routing)):
        if path is not None and not os.path.exists(path):
            raise PrismError(f"{flag} {path}: no such file or directory")
    if opts.router_module is not None and opts.routing is None:
        raise PrismError(
            "--router-module in a capture forces a routing: give --routing FILE too (`prism moe-stats` "
            "writes one from a recording made with --router-module)"
        )
    manifest_entry(opts.router_module, opts.routing)  # a bad routing file: refused before anything runs
    if opts.tensors is not None and opts.verify:
        # the store's module imports torch: only for a capture that replays a store
        from prismllm.generate.store import verify_store

        verify_store(opts.tensors)  # damaged or incomplete: refused before any rank runs
    if opts.timeout is not None and opts.timeout <= 0:
        raise PrismError(f"--timeout must be positive, not {opts.timeout:g}")
    layout = Layout.parse(opts.layout, opts.world)
    # switch mode runs every rank: a replica's values are its own
    plan = replica_plan(layout if opts.mode == "solo" else None, opts.world)
    if layout is not None and layout.ep > 1 and layout.edp > 1 and opts.tensors is not None:
        # Recorded values make each expert-DP replica route its own tokens: renaming a
        # representative would copy the wrong split sizes (measured: N=16 TP2·DP8·EP4).
        plan = dataclasses.replace(
            replica_plan(None, opts.world),
            why_all=("--tensors with expert parallelism: each rank replays its own recorded routing"),
        )
    # switch mode: every rank is started, K of them (--parallel) run at a time
    g, device, devices = _parallel_and_devices(opts) if opts.mode == "solo" else _switch_devices(opts)
    fp = fingerprint(opts, layout, device)

    out = Path(opts.out)
    state = None
    resuming = False
    if out.exists() and not out.is_dir():
        raise PrismError(f"output {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        spool = out / SPOOL_DIR
        holds_prism = (out / MANIFEST_FILE).exists() or spool.exists()
        if opts.force:
            if not holds_prism:
                raise PrismError(
                    f"output directory {out} is not empty and does not hold a prism trace; "
                    f"refusing to delete it even with --force"
                )
        elif (out / MANIFEST_FILE).exists():
            raise PrismError(f"output directory {out} already holds a graph (use --force to replace it)")
        elif (spool / STATE_FILE).exists():
            state = _read_state(spool)
            diff = _fingerprint_diff(state.get("fingerprint", {}), fp)
            if diff:
                raise PrismError(
                    f"{out} holds an unfinished capture of another command (differs in: "
                    f"{'; '.join(diff)}); re-run that command to resume it, or use --force to start over"
                )
            resuming = True
        else:
            raise PrismError(f"output directory {out} exists and is not empty (use --force to replace it)")

    done = set()
    if state is not None:
        done = {int(r) for r in state.get("done", []) if ranklog_path(out / SPOOL_DIR, int(r)).exists()}
    reps = plan.representatives
    if opts.mode == "switch" and not done >= set(reps):
        done = set()  # switch-mode ranks run together: a part of them cannot be run again alone
    pending = [r for r in reps if r not in done]
    resumed = [r for r in reps if r in done]
    return (
        CapturePlan(opts.world, layout, plan, device, devices, g, pending, resumed, resuming),
        fp,
        state,
    )


def _switch_devices(opts: CaptureOptions) -> tuple[int, str, str | list[int]]:
    """Switch mode's (K ranks at a time, device kind, the GPUs the ranks share: rank r on the
    (r mod G)-th). On the CPU every rank runs at once unless told; on G GPUs one rank holds each
    GPU at a time unless told (--parallel K: K/G each)."""
    try:
        dev = parse_devices(opts.devices)
    except ValueError as e:
        raise PrismError(str(e)) from None
    n = spread_gpus(dev, opts.cuda_on_cpu)
    if n == 0:
        k = opts.parallel or opts.world
        if k < 1:
            raise PrismError(f"--parallel must be at least 1, not {k}")
        return k, "cpu", "cpu"
    listed = list(dev.gpus) if dev.gpus is not None else list(range(n))
    gpus = sorted(set(listed), key=listed.index)
    k = opts.parallel if opts.parallel is not None else len(listed)  # a GPU listed twice: two ranks on it
    if k < len(gpus) or k % len(gpus):
        raise PrismError(
            f"--parallel {k} with --mode switch on {len(gpus)} GPU(s): the ranks at a time are shared out "
            f"evenly among the GPUs, so give a multiple of {len(gpus)}"
        )
    device, _ = resolve_devices(dev.text if dev.gpus is not None else "cuda", n)  # the GPUs exist
    return k, device, gpus


def rank_gpus(gpus: Sequence[int], ranks: Sequence[int]) -> list[int]:
    """Each switch-mode rank's GPU: rank r on the (r mod G)-th listed GPU."""
    return [gpus[r % len(gpus)] for r in ranks]


def _check_switch(opts: CaptureOptions) -> None:
    """What switch mode does not do, refused in one line each."""
    for flag, value in (("--rules", opts.rules), ("--tensors", opts.tensors), ("--routing", opts.routing)):
        if value is not None:
            raise PrismError(f"{flag} with --mode switch: switch mode answers every call with the real values")
    if opts.save_tensors is not None:
        check_save_tensors(opts.save_tensors)


def _held_calls(coordinator: Any, result: LaunchResult) -> None:
    """A failed switch-mode run's message says what the coordinator held: why it ended the ranks (a
    deadlock, host memory; in place of the launcher's account of the ranks it ended), else the
    calls still waiting."""
    # a rank that failed by itself (an exit status of its own, not the coordinator's SIGKILL) is
    # the cause: the others were left waiting for it, which the coordinator may have taken for a deadlock
    failed_alone = any((rc or 0) > 0 for rc in result.returncodes.values())
    if coordinator.ended and not failed_alone:
        head, lines = coordinator.ended[0], coordinator.ended[1:]
        result.message = f"switch-mode capture: {head}" + ("; the calls held:" if lines else "")
    else:
        lines = coordinator.ended[1:] if coordinator.ended else coordinator.waiting()
        if lines:
            result.message += "\n  calls the coordinator still held:"
    shown = lines[:8] + ([f"... and {len(lines) - 8} more"] if len(lines) > 8 else [])
    if shown:
        result.message += "\n    " + "\n    ".join(shown)


# ---------------------------------------------------------------------------------------------
# Capture


# After a rank of a batch fails, how long the others may run on: solo ranks run apart, so one that
# runs out of memory earlier in the program may do so later in time (_failure names it); a rank
# waiting on the failed one's part of an object collective ends at this bound.
FAILURE_SETTLE_S = 10.0


def _layout_disagrees(layout: Layout, e: UnreplicableGroup) -> PrismError:
    """The line for a program whose own groups do not follow --layout: a rank the layout takes
    for a replica would miss the collectives of one of the program's groups."""
    sizes = ", ".join(f"{k}={v}" for k, v in layout.to_dict().items() if k in DIMS and v > 1)
    return PrismError(
        f"--layout and the program disagree: the layout makes {sizes} of {layout.world} ranks, but the "
        f"program made a group of {len(e.members)} ranks ({format_ranks(e.members)}) across "
        f"{' and '.join(layout.spanned(e.members))} of the layout, which has no such group; give --layout the "
        f"program's own parallel sizes"
    )


def _failure(result: LaunchResult, spool: Path, done: int, total: int) -> LaunchError:
    """A failed batch: a rank that ran out of memory is a result (RankOutOfMemory: the program
    needs more than the device at this scale), anything else a LaunchError; both say how to resume.
    Solo ranks run apart, so the first to fail in time need not be the first in the program: of the
    ranks that ran out, the one with the fewest communication calls made is named (where a real
    run, whose ranks keep step at every collective, runs out first), the others after it."""
    resume = f"\n  spool kept in {spool} ({done} of {total} ranks finished); re-run the same command to resume"
    oom = {r: _out_of_memory(result, r) for r in result.ranks if (result.returncodes.get(r) or 0) > 0}
    oom = {r: v for r, v in oom.items() if v is not None}
    if oom:
        first, *others = sorted(oom, key=lambda r: (oom[r][1] is None, oom[r][1] or 0, r))
        line, calls = oom[first]
        where = f" after {calls} communication call(s)" if calls is not None else ""
        also = "; ".join(f"rank {r}" + (f" after {oom[r][1]} call(s)" if oom[r][1] is not None else "") for r in others)
        return RankOutOfMemory(
            f"rank {first} ran out of memory in its solo run{where} (a result: the program needs more at this "
            f"scale than the device holds): {line}" + (f"\n  also out of memory: {also}" if also else "") + resume,
            result,
            first,
        )
    return LaunchError(f"{result.message}{resume}", result)


def _out_of_memory(result: LaunchResult, rank: int) -> tuple[str, int | None] | None:
    """(the error line, the calls the rank had made) when ``rank`` ran out of memory, else None."""
    err = result.errors.get(rank)
    tail = result.stderr_tail.get(rank, []) or result.stdout_tail.get(rank, [])
    if err is not None and err.kind == "out_of_memory":
        return error_line(tail)[0] if tail else err.message, err.calls
    if says_out_of_memory(tail):
        return error_line(tail)[0], None
    return None


def capture(
    opts: CaptureOptions,
    *,
    on_plan: Callable[[CapturePlan], None] | None = None,
    on_progress: ProgressFn | None = None,
) -> CaptureResult:
    """Run the representatives (G at a time, skipping those an earlier run of the same
    command finished), assemble the N-rank graph and save it into ``opts.out``.

    Raises PrismError (one clear message) on bad input, a failed rank (named, spool kept:
    re-run to resume), or a graph that cannot be assembled or validated. The one writer of
    ``opts.out`` while it runs (``prismllm.outdir``)."""
    with writing(opts.out):
        return _capture(opts, on_plan, on_progress)


def _capture(
    opts: CaptureOptions, on_plan: Callable[[CapturePlan], None] | None, on_progress: ProgressFn | None
) -> CaptureResult:
    t0 = time.monotonic()
    plan, fp, state = plan_capture(opts)
    if opts.runner == DEFAULT_RUNNER:
        check_importable(DEFAULT_RUNNER, "the capture bootstrap")

    out = Path(opts.out)
    spool = out / SPOOL_DIR
    if not plan.resuming:
        if opts.force and out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True, exist_ok=True)
        spool.mkdir(exist_ok=True)
        state = {"version": STATE_VERSION, "fingerprint": fp, "done": [], "run_s": 0.0, "runs": 0}
    assert state is not None
    # the program's fingerprint before any rank ran (files it writes are not its inputs); a
    # resumed capture keeps the first run's
    if not isinstance(state.get("program"), dict):
        state["program"] = program_of(opts.script, opts.args)
    state["runs"] = int(state.get("runs", 0)) + 1
    state["done"] = sorted(plan.resumed)
    _write_state(spool, state)
    if on_plan is not None:
        on_plan(plan)

    routing = manifest_entry(opts.router_module, opts.routing)
    child = ChildEnv(
        mode=opts.mode,
        spool=str(spool.resolve()),
        cuda_on_cpu=opts.cuda_on_cpu or None,
        **child_fields(routing),
        rules=str(Path(opts.rules).resolve()) if opts.rules is not None else None,
        tensor_store=str(Path(opts.tensors).resolve()) if opts.tensors is not None else None,
    )

    total = len(plan.replicas.representatives)
    done = set(plan.resumed)
    ran = 0
    t_run = time.monotonic()
    if on_progress is not None:
        on_progress(len(done), total, 0, 0.0)
    pending = list(plan.pending)
    coordinator, store = None, out / TENSORS_DIR
    if opts.save_tensors is not None:
        shutil.rmtree(store, ignore_errors=True)  # switch mode runs every rank again: its values anew
        child = dataclasses.replace(child, save_tensors=opts.save_tensors, tensor_store=str(store.resolve()))
    if opts.mode == "switch" and pending:
        # torch once a capture runs: the CLI's parsing and its refusals of bad input never load it
        from prismllm.capture.coordinator import Coordinator

        on_gpus = isinstance(plan.devices, list)
        coordinator = Coordinator(
            plan.world, slots=plan.parallel, gpus=rank_gpus(plan.devices, range(plan.world)) if on_gpus else None
        )
    if coordinator is not None:
        child = dataclasses.replace(child, switch_address=coordinator.address, switch_token=coordinator.token)
    step = len(pending) if opts.mode == "switch" else plan.parallel
    for i in range(0, len(pending), step):
        batch = pending[i : i + step]
        spec = LaunchSpec.from_fields(
            opts,
            nproc=len(batch),
            ranks=batch,
            world_size=plan.world,
            args=list(opts.args),
            # the ranks that run together wait for each other's parts of object collectives
            # (prismllm.comm.solo_objects)
            env={**dataclasses.replace(child, solo_batch=tuple(batch)).to_env(), **opts.env},
            devices=(
                plan.devices
                if plan.devices == "cpu"
                else rank_gpus(plan.devices, batch)
                if opts.mode == "switch"
                else list(plan.devices)[: len(batch)]
            ),
            log_dir=out / LOGS_DIR if opts.tee else None,
            settle=FAILURE_SETTLE_S,
        )
        t_batch = time.monotonic()
        try:
            result = launch(spec)
        finally:
            state["run_s"] = float(state.get("run_s", 0.0)) + (time.monotonic() - t_batch)
            if coordinator is not None:
                coordinator.close()
        if coordinator is not None and (coordinator.ended or not result.ok):
            result.ok = False  # ended by the coordinator, whatever the ranks' exits
            _held_calls(coordinator, result)
        finished = [r for r in batch if result.returncodes.get(r) == 0 and ranklog_path(spool, r).exists()]
        done.update(finished)
        ran += len(finished)
        state["done"] = sorted(done)
        _write_state(spool, state)
        if not result.ok:
            raise _failure(result, spool, len(done), total)
        silent = [r for r in batch if r not in finished]
        if silent:
            raise PrismError(
                f"rank(s) {format_ranks(silent)} exited normally but wrote no rank log to {spool} "
                f"(was the program run through the capture bootstrap, in mode {opts.mode}?)"
            )
        if on_progress is not None:
            on_progress(len(done), total, ran, time.monotonic() - t_run)
    run_wall = time.monotonic() - t_run
    if opts.save_tensors is not None:
        from prismllm.generate.store import seal_store  # imports torch: only for a capture that saves

        seal_store(store)  # the ranks that wrote it have exited: it is complete

    t_asm = time.monotonic()
    layout = plan.layout
    manifest = build_manifest(
        world_size=plan.world,
        layout=layout.to_dict() if layout is not None else None,
        script=opts.script,
        args=opts.args,
        argv=opts.argv,
        device=plan.device,
        gpus=plan.devices if isinstance(plan.devices, list) else None,
        program=state["program"],
        cuda_on_cpu=opts.cuda_on_cpu,
        routing=routing,
    )
    manifest["mode"] = opts.mode
    reps = plan.replicas.representatives
    cap: dict[str, Any] = {
        "mode": opts.mode,
        "dedup": plan.replicas.dedup,
        "representatives": reps,
        "ranks_run": ran,
        "ranks_resumed": len(plan.resumed),
        "parallel": plan.parallel,
        # switch mode: how often a waiting rank was stopped for another (prismllm.capture.coordinator)
        "switches": coordinator.switches if coordinator is not None else None,
        # switch mode on GPUs: the device state moved out and back (prismllm.capture.gpuswap)
        "swaps": coordinator.swaps() if coordinator is not None else None,
        "runs": state["runs"],
        "run_wall_s": round(run_wall, 3),
        "run_wall_s_all_runs": round(float(state["run_s"]), 3),
        "rules": str(Path(opts.rules).resolve()) if opts.rules is not None else None,
        "tensors": str(Path(opts.tensors).resolve()) if opts.tensors is not None else None,
        "fingerprint": fp,
    }
    if plan.replicas.dedup:
        cap["replica_of"] = plan.replicas.replica_of.tolist()
        cap["renaming"] = "shift of the edp coordinate (prismllm.layout)"
    manifest["capture"] = cap
    try:
        trace = assemble_replicated(
            spool,
            manifest,
            replica_of=plan.replicas.replica_of,
            map_of=plan.replicas.map_of,
            rename=plan.replicas.rename,
        )
    except UnreplicableGroup as e:  # only a layout makes replicas
        raise _layout_disagrees(layout, e) from None
    reconciled = reconcile_all_to_all(trace)
    cap["all_to_all_reconciled"] = reconciled
    t_val = time.monotonic()
    validate(trace)
    t_save = time.monotonic()
    cap["assemble_s"] = round(t_val - t_asm, 3)
    cap["validate_s"] = round(t_save - t_val, 3)
    cap["wall_s"] = round(t_save - t0, 3)  # up to the save
    trace.manifest["capture"] = cap
    save_into(trace, out)
    keep_messages(spool, out)
    shutil.rmtree(spool, ignore_errors=True)
    t_end = time.monotonic()
    iterations, nodes = trace_counts(out, trace)
    return CaptureResult(
        out=out,
        manifest=trace.manifest,
        trace=trace,
        wall_s=t_end - t0,
        world_size=plan.world,
        representatives=reps,
        ranks_run=ran,
        ranks_resumed=len(plan.resumed),
        iterations=iterations,
        nodes=nodes,
        device=plan.device,
        dedup=plan.replicas.dedup,
        timings={
            "run_s": run_wall,
            "assemble_s": t_val - t_asm,
            "validate_s": t_save - t_val,
            "save_s": t_end - t_save,
        },
    )
