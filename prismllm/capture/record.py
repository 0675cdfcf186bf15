"""``prism record``: run a program like torchrun with the recording backend and write its
execution graph (PrismTrace).

The job runs through the launcher in mode ``record`` with its spool in ``<out>/.spool``
(``prismllm.childenv.ChildEnv``); each rank's bootstrap writes ``rank-<rank>.msgpack`` there at
exit. The spool is then assembled into a PrismTrace, validated and saved into the output directory; the spool is
removed after a successful assembly and kept on any failure, for diagnosis.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from prismllm.capture.common import (
    SPOOL_DIR,
    build_manifest,
    check_importable,
    check_out_dir,
    check_save_tensors,
    keep_messages,
    prepare_out_dir,
    program_of,
    resolve_devices,
    save_into,
    trace_counts,
)
from prismllm.childenv import ChildEnv
from prismllm.errors import PrismError, RequirementError
from prismllm.fromfields import FromFields
from prismllm.launch import (
    DEFAULT_RUNNER,
    LaunchError,
    LaunchResult,
    LaunchSpec,
    LineSink,
    launch,
)
from prismllm.outdir import writing
from prismllm.outputs import LOGS_DIR
from prismllm.routing.contract import OBSERVE_DIR, child_fields, manifest_entry
from prismllm.specs import format_ranks, parse_layout
from prismllm.trace.assemble import assemble_spool
from prismllm.trace.ranklog import ranklog_path
from prismllm.trace.schema import TENSORS_DIR
from prismllm.trace.validate import validate


@dataclasses.dataclass
class RecordOptions(FromFields):
    nproc: int
    out: str | os.PathLike
    script: str
    args: Sequence[str] = ()
    devices: str | None = None  # "cpu" | "cuda" | "cuda:0,1,..." | None: cuda if enough GPUs
    cuda_on_cpu: bool = False  # map the program's CUDA calls to the CPU (prismllm.devicemap)
    router_module: str | None = None  # the MoE router to force (with routing) or observe (prismllm.routing)
    routing: str | os.PathLike | None = None  # a routing file: force it; None: observe into OUT/moe
    layout: str | dict | None = None  # "tp=2,pp=2,dp=2" or a dict
    timeout: float | None = None
    force: bool = False
    tee: bool = False  # per-rank log files in <out>/logs
    line_prefix: str | None = None  # e.g. "[rank{rank}]: "
    argv: Sequence[str] | None = None  # prism's own command line, for the manifest
    sink: LineSink | None = None  # where the program's output lines go (default: stdout/stderr)
    runner: str = DEFAULT_RUNNER
    env: dict[str, str | None] = dataclasses.field(default_factory=dict)  # extra child env
    save_tensors: str | None = None  # selector of collectives whose outputs are saved
    tensor_store: str | os.PathLike | None = None  # where (default: <out>/tensors)
    recorder: str = "auto"  # "native" | "python" | "auto": native, the Python path if it cannot be built


@dataclasses.dataclass
class RecordResult:
    out: Path
    manifest: dict[str, Any]
    trace: Any
    launch: LaunchResult
    wall_s: float
    world_size: int
    iterations: int | None
    nodes: int | None
    device: str
    tensor_store: Path | None = None  # where --save-tensors wrote


# ---------------------------------------------------------------------------------------------
# Inputs


def _tensor_store(opts: RecordOptions, out: Path) -> Path | None:
    """The recorded-tensor store's directory when --save-tensors is given (checked here, so a
    bad selector fails before anything runs)."""
    if opts.save_tensors is None:
        if opts.tensor_store is not None:
            raise PrismError("--tensor-store needs --save-tensors SELECTOR (what to save)")
        return None
    check_save_tensors(opts.save_tensors)
    # the tensor store's module imports torch: only when tensors are saved
    from prismllm.generate.store import MANIFEST_FILE as STORE_MANIFEST, RANK_FILE

    store = Path(opts.tensor_store) if opts.tensor_store is not None else out / TENSORS_DIR
    if opts.tensor_store is not None and store.exists():
        files = list(store.iterdir())
        if files and not opts.force:
            raise PrismError(f"tensor store {store} is not empty (use --force to replace it)")
        if any(not (RANK_FILE.fullmatch(f.name) or f.name == STORE_MANIFEST) for f in files):
            raise PrismError(f"{store} holds files that are not a tensor store; refusing to replace it")
        shutil.rmtree(store)
    return store


# ---------------------------------------------------------------------------------------------
# Manifest


# ---------------------------------------------------------------------------------------------
# Record

RECORDERS = ("auto", "native", "python")


def choose_recorder(opts: RecordOptions) -> str:
    """ "native" or "python": which recording path the ranks take. The native backend is built
    here, once, before any rank starts (the ranks then only load it). With ``auto`` a build that
    fails says so on stderr and the ranks record through the Python path; the manifest's
    ``recorder`` names the path taken either way, since the two differ in per-call cost."""
    if opts.recorder not in RECORDERS:
        raise PrismError(f"bad --recorder {opts.recorder!r}: expected one of {', '.join(RECORDERS)}")
    if opts.save_tensors:  # the Python path's hooks copy the saved outputs
        if opts.recorder == "native":
            raise PrismError("--save-tensors records through the Python path: drop --recorder native")
        return "python"
    if opts.recorder == "python":
        return "python"
    if opts.cuda_on_cpu:
        # the program's NCCL reduce ops (AVG, PREMUL_SUM) run on gloo as SUM plus a local step,
        # which only the Python path has (prismllm.comm.redops); the native backend would hand
        # them to gloo, which refuses them
        if opts.recorder == "native":
            raise PrismError(
                "--cuda-on-cpu records through the Python path (NCCL's AVG and PREMUL_SUM on gloo): "
                "drop --recorder native"
            )
        return "python"
    # loads (and may first build) a C++ extension: only for the native recorder
    from prismllm.comm import native

    if native.needs_build():
        print(
            "prism record: building the native recorder (once per torch version, ~30 s)…", file=sys.stderr, flush=True
        )
    try:
        native.load()
    except RuntimeError as e:
        reason = str(e).removeprefix("prism: ")
        if opts.recorder == "native":
            raise RequirementError(reason) from None
        print(
            f"prism record: WARNING: {reason}\n"
            "prism record: WARNING: recording through the Python path instead, which costs more "
            "host time a call (`prism docs record`); the manifest says recorder=python",
            file=sys.stderr,
            flush=True,
        )
        return "python"
    return "native"


def record(opts: RecordOptions, *, on_start: Callable[[str, int], None] | None = None) -> RecordResult:
    """Run ``opts.script`` on ``opts.nproc`` ranks with the recording backend and save the trace,
    as the one writer of OUT and of the tensor store (``prismllm.outdir``).

    Raises PrismError (one clear message) on bad input, a failed rank, or a trace that cannot
    be assembled or validated. ``on_start(device, nproc)`` is called just before the launch.
    """
    with writing(opts.out), writing(opts.tensor_store):
        return _record(opts, on_start)


def _record(opts: RecordOptions, on_start: Callable[[str, int], None] | None) -> RecordResult:
    t0 = time.monotonic()
    if opts.nproc < 1:
        raise PrismError(f"--nproc must be at least 1, not {opts.nproc}")
    script = opts.script
    if not os.path.exists(script):
        raise PrismError(f"script not found: {script}")
    if not os.path.isfile(script):
        raise PrismError(f"script is not a file: {script}")
    if opts.timeout is not None and opts.timeout <= 0:
        raise PrismError(f"--timeout must be positive, not {opts.timeout:g}")
    try:
        layout = parse_layout(opts.layout)
    except ValueError as e:
        raise PrismError(str(e)) from None
    out = Path(opts.out)
    routing = manifest_entry(opts.router_module, opts.routing, observed=True)
    check_out_dir(out, opts.force)
    store = _tensor_store(opts, out)
    device, devices = resolve_devices(opts.devices, opts.nproc, opts.cuda_on_cpu)
    if opts.runner == DEFAULT_RUNNER:
        check_importable(DEFAULT_RUNNER, "the recording bootstrap")

    prepare_out_dir(out, opts.force)
    spool = out / SPOOL_DIR
    spool.mkdir()

    recorder = choose_recorder(opts)
    child = ChildEnv(
        mode="record",
        native=recorder == "native",
        cuda_on_cpu=opts.cuda_on_cpu or None,
        **child_fields(routing, observe_dir=str((out / OBSERVE_DIR).resolve())),
        spool=str(spool.resolve()),
        save_tensors=opts.save_tensors if store is not None else None,
        tensor_store=str(store.resolve()) if store is not None else None,
    )
    env: dict[str, str | None] = child.to_env()
    if device == "cuda":
        env["TORCH_NCCL_ENABLE_TIMING"] = "1"  # NCCL's own device-side start/end events
    env.update(opts.env)
    spec = LaunchSpec.from_fields(
        opts,
        script=script,
        args=list(opts.args),
        env=env,
        devices=devices,
        log_dir=out / LOGS_DIR if opts.tee else None,
    )
    program = program_of(script, opts.args)  # before the run: files it writes are not its inputs
    if on_start is not None:
        on_start(device, opts.nproc)
    result = launch(spec)
    if not result.ok:
        message = result.message
        if any(spool.iterdir()):
            message += f"\n  spool kept for diagnosis: {spool}"
        raise LaunchError(message, result)
    if store is not None and store.is_dir():
        # imports torch, as _tensor_store did: only when tensors are saved
        from prismllm.generate.store import seal_store

        seal_store(store)  # the ranks that wrote it have exited: it is complete

    missing = [r for r in range(opts.nproc) if not ranklog_path(spool, r).exists()]
    if missing:
        raise PrismError(
            f"rank(s) {format_ranks(missing)} exited normally but wrote no rank log to {spool} "
            f"(was the program run through the recording bootstrap?)"
        )
    manifest = build_manifest(
        world_size=opts.nproc,
        layout=layout,
        script=script,
        args=opts.args,
        argv=opts.argv,
        device=device,
        gpus=devices if isinstance(devices, list) else None,
        program=program,
        cuda_on_cpu=opts.cuda_on_cpu,
        routing=routing,
    )
    manifest["recorder"] = recorder
    trace = assemble_spool(spool, manifest)
    problems = validate(trace)
    if isinstance(problems, (list, tuple)):  # validate raises on errors; a list holds warnings
        for p in problems:
            print(f"prism record: warning: {p}", file=sys.stderr)
    save_into(trace, out)
    keep_messages(spool, out)
    shutil.rmtree(spool, ignore_errors=True)
    iterations, nodes = trace_counts(out, trace)
    return RecordResult(
        out=out,
        manifest=manifest,
        trace=trace,
        launch=result,
        wall_s=time.monotonic() - t0,
        world_size=opts.nproc,
        iterations=iterations,
        nodes=nodes,
        device=device,
        tensor_store=store,
    )
