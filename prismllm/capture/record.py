"""``prism record``: run a program like torchrun with the recording backend and write its
execution graph (PrismTrace).

The job runs through the launcher with ``PRISM_MODE=record`` and ``PRISM_SPOOL=<out>/.spool``;
each rank's bootstrap writes ``rank-<rank>.msgpack`` there at exit. The spool is then
assembled into a PrismTrace, validated and saved into the output directory; the spool is
removed after a successful assembly and kept on any failure, for diagnosis.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib
import importlib.metadata
import importlib.util
import os
import platform
import re
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from prismllm import __version__
from prismllm.capture.launcher import (
    DEFAULT_RUNNER,
    LaunchError,
    LaunchResult,
    LaunchSpec,
    LineSink,
    format_ranks,
    launch,
)
from prismllm.errors import PrismError
from prismllm.trace.ranklog import ranklog_path

SPOOL_DIR = ".spool"
LOGS_DIR = "logs"
TENSORS_DIR = "tensors"
MANIFEST_FILE = "manifest.json"


@dataclasses.dataclass
class RecordOptions:
    nproc: int
    out: str | os.PathLike
    script: str
    args: Sequence[str] = ()
    devices: str | None = None  # "cpu" | "cuda" | "cuda:0,1,..." | None: cuda if enough GPUs
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


# ---------------------------------------------------------------------------------------------
# Inputs


def parse_layout(layout: str | dict | None) -> dict[str, int | str] | None:
    """"tp=2,pp=2,schedule=1f1b" -> {"tp": 2, "pp": 2, "schedule": "1f1b"}."""
    if layout is None or isinstance(layout, dict):
        return layout
    out: dict[str, int | str] = {}
    for item in layout.split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key or not value:
            raise PrismError(f"bad --layout {layout!r}: expected key=value[,key=value...], e.g. tp=2,pp=2")
        if key in out:
            raise PrismError(f"bad --layout {layout!r}: {key} given twice")
        try:
            out[key] = int(value)
        except ValueError:
            out[key] = value
    if not out:
        raise PrismError(f"bad --layout {layout!r}: expected key=value[,key=value...]")
    return out


def _cuda_info() -> tuple[bool, int]:
    try:
        import torch
    except ImportError:
        return False, 0
    try:
        if not torch.cuda.is_available():
            return False, 0
        return True, torch.cuda.device_count()
    except Exception:
        return False, 0


def parse_gpu_list(devices: str) -> list[int]:
    """The GPU indices of ``cuda:G,G,...`` (a GPU may be listed twice: shared)."""
    try:
        return [int(x) for x in devices[5:].split(",") if x.strip()]
    except ValueError:
        raise PrismError(f"bad --devices {devices!r}: expected cuda:G,G,... (GPU indices)") from None


def resolve_devices(devices: str | None, nproc: int) -> tuple[str, str | list[int]]:
    """("cpu", "cpu") or ("cuda", [gpu indices, one per rank])."""
    if devices is not None:
        devices = devices.strip().lower()
    if devices in (None, "", "auto"):
        available, count = _cuda_info()
        if available and nproc <= count:
            return "cuda", list(range(nproc))
        return "cpu", "cpu"
    if devices == "cpu":
        return "cpu", "cpu"
    if devices == "cuda" or devices.startswith("cuda:"):
        available, count = _cuda_info()
        if not available:
            raise PrismError("--devices cuda: no CUDA device is available (use --devices cpu)")
        if devices == "cuda":
            gpus = list(range(nproc))
        else:
            gpus = parse_gpu_list(devices)
            if len(gpus) < nproc:
                raise PrismError(f"--devices {devices}: {nproc} ranks need {nproc} GPUs, {len(gpus)} listed")
            gpus = gpus[:nproc]
            if min(gpus) < 0 or max(gpus) >= count:
                raise PrismError(f"--devices {devices}: GPU {max(gpus) if max(gpus) >= count else min(gpus)} "
                                 f"does not exist ({count} visible: 0..{count - 1})")
        if nproc > count and len(set(gpus)) == len(gpus):
            raise PrismError(
                f"--devices cuda: {nproc} ranks need {nproc} GPUs, but {count} "
                f"{'is' if count == 1 else 'are'} visible (one rank per GPU, or list shared ones: "
                f"--devices cuda:0,0,...; or use --devices cpu)"
            )
        return "cuda", gpus
    raise PrismError(f"bad --devices {devices!r}: expected cpu, cuda or cuda:0,1,...")


def check_out_dir(out: Path, force: bool) -> bool:
    """Refuse an existing non-empty directory unless ``force``; with ``force``, accept only a
    directory that holds a prism trace or a kept spool (never an unrelated directory).
    Returns whether the directory must be cleared first. Changes nothing."""
    if out.exists() and not out.is_dir():
        raise PrismError(f"output path {out} exists and is not a directory")
    if not (out.is_dir() and any(out.iterdir())):
        return False
    if not force:
        raise PrismError(f"output directory {out} exists and is not empty (use --force to replace it)")
    if not ((out / MANIFEST_FILE).exists() or (out / SPOOL_DIR).exists()):
        raise PrismError(
            f"output directory {out} is not empty and does not hold a prism trace; "
            f"refusing to delete it even with --force"
        )
    return True


def _tensor_store(opts: RecordOptions, out: Path) -> Path | None:
    """The recorded-tensor store's directory when --save-tensors is given (checked here, so a
    bad selector fails before anything runs)."""
    if opts.save_tensors is None:
        if opts.tensor_store is not None:
            raise PrismError("--tensor-store needs --save-tensors SELECTOR (what to save)")
        return None
    from prismllm.generate.store import Selector

    try:
        Selector(opts.save_tensors, strict=True)
    except ValueError as e:
        raise PrismError(f"bad --save-tensors {opts.save_tensors!r}: {e}") from None
    store = Path(opts.tensor_store) if opts.tensor_store is not None else out / TENSORS_DIR
    if opts.tensor_store is not None and store.exists():
        files = list(store.iterdir())
        if files and not opts.force:
            raise PrismError(f"tensor store {store} is not empty (use --force to replace it)")
        if any(not re.fullmatch(r"rank-\d{6}\.(idx|bin)", f.name) for f in files):
            raise PrismError(f"{store} holds files that are not a tensor store; refusing to replace it")
        shutil.rmtree(store)
    return store


def prepare_out_dir(out: Path, force: bool) -> None:
    if check_out_dir(out, force):
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)


def _check_importable(module: str, what: str) -> None:
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise PrismError(f"{what} ({module}) is not available in this installation")


def _load_trace_api() -> tuple[Callable, Callable]:
    try:
        from prismllm.trace.assemble import assemble_spool
        from prismllm.trace.validate import validate
    except ImportError as e:
        raise PrismError(f"the trace assembler is not available in this installation ({e})") from None
    return assemble_spool, validate


# ---------------------------------------------------------------------------------------------
# Manifest


def collect_versions(device: str) -> dict[str, str]:
    versions = {"python": platform.python_version(), "prismllm": __version__}
    torch = sys.modules.get("torch")
    if torch is not None:
        versions["torch"] = str(torch.__version__)
    else:
        try:
            versions["torch"] = importlib.metadata.version("torch")
        except importlib.metadata.PackageNotFoundError:
            pass
    if device == "cuda" and torch is not None:
        try:
            if torch.version.cuda:
                versions["cuda"] = str(torch.version.cuda)
            nccl = torch.cuda.nccl.version()
            versions["nccl"] = ".".join(str(x) for x in nccl) if isinstance(nccl, tuple) else str(nccl)
        except Exception:
            pass
    return versions


def _program(script: str, args: Sequence[str]) -> dict[str, Any]:
    """What ``prism emulate`` and ``prism time`` check a launch against (the script's name,
    content digest and arguments). Imported here, not at the top: prismllm.emulate imports
    this module."""
    from prismllm.emulate.fingerprint import program_fingerprint

    return program_fingerprint(script, args)


def build_manifest(
    *,
    world_size: int,
    layout: dict | None,
    script: str,
    args: Sequence[str],
    argv: Sequence[str] | None,
    device: str,
    gpus: list[int] | None = None,
    program: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The graph's manifest. ``program`` is the fingerprint of SCRIPT ARGS
    (``prismllm.emulate.fingerprint.program_fingerprint``), best taken before the program ran;
    None: taken now."""
    if program is None:
        program = _program(script, args)
    manifest: dict[str, Any] = {
        "world_size": world_size,
        "layout": layout,
        "command": [script, *args],
        "program": program,
        "argv": list(argv) if argv is not None else None,
        "versions": collect_versions(device),
        "device": device,
        "mode": "record",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "hostname": socket.gethostname(),
    }
    if device == "cuda":
        torch = sys.modules.get("torch")
        try:
            manifest["gpus"] = [torch.cuda.get_device_name(g) for g in (gpus or [])]
        except Exception:
            pass
    return manifest


# ---------------------------------------------------------------------------------------------
# Record

RECORDERS = ("auto", "native", "python")


def choose_recorder(opts: RecordOptions) -> str:
    """"native" or "python": which recording path the ranks take. The native backend is built
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
    from prismllm.comm import native

    if native.needs_build():
        print("prism record: building the native recorder (once per torch version, ~30 s)…",
              file=sys.stderr, flush=True)
    try:
        native.load()
    except RuntimeError as e:
        reason = str(e).removeprefix("prism: ")
        if opts.recorder == "native":
            raise PrismError(reason) from None
        print(f"prism record: WARNING: {reason}\n"
              "prism record: WARNING: recording through the Python path instead, which costs more "
              "host time a call (docs/prismtrace.md); the manifest says recorder=python",
              file=sys.stderr, flush=True)
        return "python"
    return "native"


def _trace_counts(out: Path, trace: Any) -> tuple[int | None, int | None]:
    """(iterations, nodes) of a saved trace, read from its Parquet files."""
    iterations = nodes = None
    try:
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        from prismllm.trace.schema import FILES

        nodes_file = out / FILES["nodes"][0]
        if nodes_file.exists():
            nodes = pq.ParquetFile(nodes_file).metadata.num_rows
        it_file = out / FILES["iterations"][0]
        if it_file.exists():
            col = pq.read_table(it_file, columns=["iteration"]).column("iteration")
            iterations = len(pc.unique(pc.filter(col, pc.greater_equal(col, 0))))
    except Exception:
        pass
    return iterations, nodes


def _save_into(trace: Any, out: Path) -> None:
    """Save the graph into ``out``, which already holds the spool (and logs/ with --tee).
    ``PrismTrace.save`` writes a whole directory (and replaces one that holds a graph), so save
    into a fresh sibling directory and move its files in."""
    staging = out.parent / f".{out.name}.prism-save-{os.getpid()}"
    if staging.exists():
        shutil.rmtree(staging)
    try:
        trace.save(staging)
        for entry in sorted(staging.iterdir(), key=lambda p: p.name == MANIFEST_FILE):
            os.replace(entry, out / entry.name)  # the manifest last: a graph is complete once it is there
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def record(opts: RecordOptions, *, on_start: Callable[[str, int], None] | None = None) -> RecordResult:
    """Run ``opts.script`` on ``opts.nproc`` ranks with the recording backend and save the trace.

    Raises PrismError (one clear message) on bad input, a failed rank, or a trace that cannot
    be assembled or validated. ``on_start(device, nproc)`` is called just before the launch.
    """
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
    layout = parse_layout(opts.layout)
    out = Path(opts.out)
    check_out_dir(out, opts.force)
    store = _tensor_store(opts, out)
    device, devices = resolve_devices(opts.devices, opts.nproc)
    if opts.runner == DEFAULT_RUNNER:
        _check_importable(DEFAULT_RUNNER, "the recording bootstrap")
    assemble_spool, validate = _load_trace_api()

    prepare_out_dir(out, opts.force)
    spool = out / SPOOL_DIR
    spool.mkdir()

    recorder = choose_recorder(opts)
    env: dict[str, str | None] = {
        "PRISM_MODE": "record",
        "PRISM_NATIVE": "1" if recorder == "native" else "0",
        "PRISM_SPOOL": str(spool.resolve()),
        "PRISM_DEVICE": device,
    }
    if device == "cuda":
        env["TORCH_NCCL_ENABLE_TIMING"] = "1"  # NCCL's own device-side start/end events
    if store is not None:
        env["PRISM_SAVE_TENSORS"] = opts.save_tensors
        env["PRISM_TENSOR_STORE"] = str(store.resolve())
    env.update(opts.env)
    spec = LaunchSpec(
        nproc=opts.nproc,
        script=script,
        args=list(opts.args),
        env=env,
        devices=devices,
        runner=opts.runner,
        timeout=opts.timeout,
        log_dir=out / LOGS_DIR if opts.tee else None,
        line_prefix=opts.line_prefix,
        sink=opts.sink,
    )
    program = _program(script, opts.args)  # before the run: files it writes are not its inputs
    if on_start is not None:
        on_start(device, opts.nproc)
    result = launch(spec)
    if not result.ok:
        message = result.message
        if any(spool.iterdir()):
            message += f"\n  spool kept for diagnosis: {spool}"
        raise LaunchError(message, result)

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
    )
    manifest["recorder"] = recorder
    trace = assemble_spool(spool, manifest)
    problems = validate(trace)
    if isinstance(problems, (list, tuple)):  # validate raises on errors; a list holds warnings
        for p in problems:
            print(f"prism record: warning: {p}", file=sys.stderr)
    _save_into(trace, out)
    shutil.rmtree(spool, ignore_errors=True)
    iterations, nodes = _trace_counts(out, trace)
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
    )
