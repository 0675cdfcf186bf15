"""What the capture commands (``prism record``, ``prism capture``) share: where a run's rank logs
are spooled, the output directory's checks, the device choice, and the graph's manifest."""

from __future__ import annotations

import datetime
import importlib
import importlib.metadata
import importlib.util
import os
import platform
import shutil
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
import pyarrow.parquet as pq

from prismllm import __version__
from prismllm.errors import PrismError, RequirementError
from prismllm.launch.program import program_fingerprint
from prismllm.outdir import must_replace
from prismllm.specs import cuda_on_cpu_devices, parse_devices
from prismllm.trace.schema import FILES, MANIFEST_FILE, OBJECTS_DIR

SPOOL_DIR = ".spool"


def cuda_info() -> tuple[bool, int]:
    try:
        # torch only to count GPUs: a CPU run's launcher process never loads it
        import torch
    except ImportError:
        return False, 0
    try:
        if not torch.cuda.is_available():
            return False, 0
        return True, torch.cuda.device_count()
    except Exception:
        return False, 0


def resolve_devices(devices: str | None, nproc: int, cuda_on_cpu: bool = False) -> tuple[str, str | list[int]]:
    """("cpu", "cpu") or ("cuda", [gpu indices, one per rank]); with ``cuda_on_cpu`` always the
    CPU (a GPU list is refused)."""
    if cuda_on_cpu:
        try:
            cuda_on_cpu_devices(devices)
        except ValueError as e:
            raise PrismError(str(e)) from None
        return "cpu", "cpu"
    if devices is not None:
        devices = devices.strip().lower()
        try:
            parse_devices(devices)
        except ValueError as e:
            raise PrismError(str(e)) from None
    if devices in (None, "", "auto"):
        available, count = cuda_info()
        if available and nproc <= count:
            return "cuda", list(range(nproc))
        return "cpu", "cpu"
    if devices == "cpu":
        return "cpu", "cpu"
    if devices == "cuda" or devices.startswith("cuda:"):
        available, count = cuda_info()
        if not available:
            raise RequirementError("--devices cuda: no CUDA device is available (use --devices cpu)")
        if devices == "cuda":
            gpus = list(range(nproc))
        else:
            gpus = list(parse_devices(devices).gpus)
            if len(gpus) < nproc:
                raise PrismError(f"--devices {devices}: {nproc} ranks need {nproc} GPUs, {len(gpus)} listed")
            gpus = gpus[:nproc]
            if min(gpus) < 0 or max(gpus) >= count:
                raise RequirementError(
                    f"--devices {devices}: GPU {max(gpus) if max(gpus) >= count else min(gpus)} "
                    f"does not exist ({count} visible: 0..{count - 1})"
                )
        if nproc > count and len(set(gpus)) == len(gpus):
            raise RequirementError(
                f"--devices cuda: {nproc} ranks need {nproc} GPUs, but {count} "
                f"{'is' if count == 1 else 'are'} visible (one rank per GPU, or list shared ones: "
                f"--devices cuda:0,0,...; or use --devices cpu)"
            )
        return "cuda", gpus
    raise PrismError(f"bad --devices {devices!r}: expected cpu, cuda or cuda:0,1,...")


def check_out_dir(out: Path, force: bool) -> bool:
    """Whether ``out`` must be cleared first (``outdir.must_replace``): with ``force``, only a
    directory that holds a prism trace or a kept spool. Changes nothing."""
    return must_replace(out, force, (MANIFEST_FILE, SPOOL_DIR), "prism trace")


def prepare_out_dir(out: Path, force: bool) -> None:
    if check_out_dir(out, force):
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)


def check_save_tensors(selector: str) -> None:
    """A bad --save-tensors SELECTOR, refused in one line before anything runs."""
    from prismllm.generate.store import Selector  # imports torch: only for a run that saves tensors

    try:
        Selector(selector, strict=True)
    except ValueError as e:
        raise PrismError(f"bad --save-tensors {selector!r}: {e}") from None


def check_importable(module: str, what: str) -> None:
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise PrismError(f"{what} ({module}) is not available in this installation")


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


def program_of(script: str, args: Sequence[str]) -> dict[str, Any]:
    """What ``prism emulate`` and ``prism time`` check a launch against (the script's name,
    content digest and arguments)."""
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
    cuda_on_cpu: bool = False,
    routing: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The graph's manifest. ``program`` is the fingerprint of SCRIPT ARGS
    (``prismllm.launch.program.program_fingerprint``), best taken before the program ran;
    None: taken now. ``cuda_on_cpu``: the program's CUDA calls ran on the CPU, which every
    later launch of the program from this graph repeats (``prismllm.devicemap``); ``routing``:
    the MoE routing the program ran with, likewise (``prismllm.routing.contract``)."""
    if program is None:
        program = program_of(script, args)
    manifest: dict[str, Any] = {
        "world_size": world_size,
        "layout": layout,
        "command": [script, *args],
        "program": program,
        "argv": list(argv) if argv is not None else None,
        "versions": collect_versions(device),
        "device": device,
        "cuda_on_cpu": cuda_on_cpu,
        "routing": routing,
        "mode": "record",
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "hostname": socket.gethostname(),
    }
    if device == "cuda":
        torch = sys.modules.get("torch")
        try:
            manifest["gpus"] = [torch.cuda.get_device_name(g) for g in (gpus or [])]
        except Exception:
            pass
    return manifest


def trace_counts(out: Path, trace: Any) -> tuple[int | None, int | None]:
    """(iterations, nodes) of a saved trace, read from its Parquet files."""
    iterations = nodes = None
    try:
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


def keep_messages(spool: Path, out: Path) -> None:
    """The object lists the ranks sent each other (``send_object_list``: pipeline stages' shapes;
    the spool's ``objects/p2p-*``), the small tensors roots broadcast (``objects/broadcast-*``:
    token ids, flags) and the small tensors ranks sent each other (``objects/sent-*``) go with
    the graph: in emulation without recorded tensors they are what a virtual sender or root
    sends a sandbox rank (prismllm.comm.solo_objects)."""
    objects = spool / OBJECTS_DIR
    messages = sorted([*objects.glob("p2p-*.obj"), *objects.glob("broadcast-*.tensor"), *objects.glob("sent-*.tensor")])
    if messages:
        (out / OBJECTS_DIR).mkdir(exist_ok=True)
        for m in messages:
            shutil.copyfile(m, out / OBJECTS_DIR / m.name)


def save_into(trace: Any, out: Path) -> None:
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
