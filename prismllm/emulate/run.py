"""``prism emulate``: the sandbox ranks run the unmodified program for real, one assistant
replays every other rank of the graph and meets them in every collective (one sandbox run:
``prismllm.launch.sandbox``, which says what processes run and what they write into OUT).

This stage checks the user's options against the graph, runs the sandbox, and writes
``OUT/emulate.json``: what ran and how it ended, each sandbox rank's measured iterations and
peak memory, the calibration's prediction when the graph is a calibrated one, and the
communicators the run created against the graph's logical groups.

Faults end the run with one line naming who failed and with what (every child is ended); a
sandbox rank that ran out of memory is a *result* of the emulation (:class:`SandboxOutOfMemory`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from prismllm.childenv import TIMINGS
from prismllm.errors import PrismError
from prismllm.fromfields import FromFields
from prismllm.launch import LaunchResult, LineSink
from prismllm.launch.gate import load_token
from prismllm.launch.program import check_program
from prismllm.launch.sandbox import (
    PIDS_FILE,
    SandboxOutOfMemory,
    SandboxSpec,
    launch_sandbox,
    pids_by_role,
    recorded_inputs,
    sandbox_devices,
)
from prismllm.outdir import must_replace, writing
from prismllm.outputs import EMULATE_FILE, SUMMARY_FILE
from prismllm.specs import parse_ranks
from prismllm.trace.graph import read_manifest
from prismllm.trace.schema import FILES


@dataclasses.dataclass
class EmulateOptions(FromFields):
    graph: str | os.PathLike  # the bare graph (a PrismTrace directory)
    sandbox: str | Sequence[int]  # ranks that run for real: "0,2-3" or a list
    out: str | os.PathLike
    script: str
    args: Sequence[str] = ()
    tensors: str | os.PathLike | None = None  # recorded tensors with inputs (default GRAPH/tensors)
    timeout: float | None = None
    force: bool = False
    tee: bool = False  # per-process log files in OUT/logs
    line_prefix: str | None = None  # e.g. "[rank{rank}]: "
    sink: LineSink | None = None
    env: dict[str, str | None] = dataclasses.field(default_factory=dict)  # extra child env
    extra_grace: float = 30.0  # how long the assistant may outlive the sandbox ranks
    check: bool = False  # compare the sandbox's pruned-call outputs with the recorded ones
    # "auto" (a GPU each when there are enough, else one shared GPU, else the CPU), "cpu" (gloo), "cuda" (a GPU
    # per sandbox rank and assistant, NCCL), "cuda:G,...": theirs, in order (prismllm.launch.sandbox)
    devices: str = "auto"
    inputs: str = "auto"  # virtual ranks' inputs: "recorded" (the tensor store), "generated" (zeros), "auto"
    # Multi-host: "HOST:PORT", where the processes of every invocation meet (the store is
    # hosted by the invocation that runs the sandbox ranks), and which processes this
    # invocation runs: "all", "sandbox" (the sandbox ranks) or "assistant".
    rdzv_endpoint: str | None = None
    role: str = "all"
    # With rdzv_endpoint: the file holding the hosts' shared token (else $PRISM_RDZV_TOKEN); nothing
    # reaches the store before it is proved (prismllm.launch.gate)
    rdzv_token_file: str | os.PathLike | None = None
    # How the assistant replays the virtual ranks: "fast" (as fast as dependencies allow: slice
    # timing), "real" (in real time with the graph's durations, the sandbox's real completions
    # fed back: emulation with a calibrated graph), "auto" (real for a calibrated graph, else fast).
    timing: str = "auto"
    # Assistant processes (on GPU: one GPU each, after the sandbox's): each plays the proxy of
    # a share of the pruned groups (every one replays all virtual ranks: the plan is cheap).
    assistants: int = 1
    verify: bool = True  # check the graph's and the store's checksums (and the store's index) before launching


@dataclasses.dataclass
class EmulateResult:
    out: Path
    world_size: int
    sandbox: tuple[int, ...]
    returncodes: dict[int, int | None]  # per sandbox rank
    wall_s: float
    launch: LaunchResult
    checks: dict[int, dict] = dataclasses.field(default_factory=dict)  # --check: per sandbox rank
    check_failure: str | None = None  # --check: why it fails (check_failure()), None when it passes
    timing: str = "fast"
    sandbox_results: dict[int, dict] = dataclasses.field(default_factory=dict)  # per sandbox rank, see _measured
    prediction: dict | None = None  # the calibration's, when the graph is a calibrated one
    communicators: dict | None = None  # communicators created against logical groups (communicators())
    replay: dict | None = None  # the assistant's replay of the virtual ranks (replay.json)
    shared_gpu: bool = False  # a GPU shared by this run's processes (NCCL over sockets)


def _timing(opts: EmulateOptions, manifest: dict[str, Any], graph: Path) -> str:
    """The replay timing: "real" needs measured durations (a calibrated, timed or recorded graph)."""
    mode = manifest.get("mode")
    if opts.timing == "auto":
        return "real" if mode == "calibrated" else "fast"
    if opts.timing not in TIMINGS:
        raise PrismError(f"--timing must be auto, {', '.join(TIMINGS)}, not {opts.timing!r}")
    if opts.timing == "real" and mode not in ("calibrated", "timed", "record"):
        raise PrismError(
            f"--timing real replays the graph's durations, and {graph} is a {mode!r} graph "
            f"without measured ones: time and calibrate it first (`prism time`, "
            f"`prism calibrate --write-graph`) and emulate CAL/graph"
        )
    return opts.timing


def communicators(graph: Path, sandbox: Sequence[int]) -> dict[str, int]:
    """The communicators this emulation creates against the graph's logical groups (the
    routing of docs/architecture.md): a group with no sandbox member is never instantiated; one whose
    members are all sandbox ranks is a real communicator of those; any other is one small
    communicator of its sandbox members plus a proxy. Read from the groups table alone."""
    real = set(sandbox)
    ranks = pq.read_table(graph / FILES["groups"][0], columns=["ranks"]).column("ranks").to_pylist()
    out = {
        "logical_groups": len(ranks),
        "not_instantiated": 0,
        "all_real": 0,
        "pruned": 0,
        "largest_logical_group": max((len(m) for m in ranks), default=0),
        "largest_communicator": 0,
    }
    for members in ranks:
        k = sum(1 for r in members if r in real)
        if k == 0:
            out["not_instantiated"] += 1
            continue
        kind = "all_real" if k == len(members) else "pruned"
        out[kind] += 1
        out["largest_communicator"] = max(out["largest_communicator"], k if kind == "all_real" else k + 1)
    out["communicators"] = out["all_real"] + out["pruned"]
    return out


def _calibration(graph: Path) -> dict | None:
    """The calibration's prediction when ``graph`` is CAL/graph of `prism calibrate --write-graph`."""
    f = graph.parent / SUMMARY_FILE
    try:
        s = json.loads(f.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(s, dict) or s.get("format") != "prism-calibration":
        return None
    keys = ("predicted_iteration_ns", "steady_iterations", "world_size", "pipeline_bubble", "busy_fraction")
    return {
        "summary": str(f.resolve()),
        **{k: s.get(k) for k in keys},
        "iterations": [
            {"iteration": it.get("iteration"), "predicted_ns": it.get("predicted_ns")} for it in s.get("iterations", [])
        ],
    }


def _endpoint(opts: EmulateOptions) -> tuple[str, int]:
    """(host, port) of the rendezvous: the given endpoint, or this host and a port the
    launcher picks (port 0) when one invocation runs everything."""
    if opts.role not in ("all", "sandbox", "assistant"):
        raise PrismError(f"--role must be all, sandbox or assistant, not {opts.role!r}")
    if opts.rdzv_endpoint is None:
        if opts.rdzv_token_file is not None:
            raise PrismError("--rdzv-token-file goes with --rdzv-endpoint (a single-host run listens on loopback only)")
        if opts.role != "all":
            raise PrismError(
                f"--role {opts.role} needs --rdzv-endpoint HOST:PORT (where the other "
                f"invocation's processes meet this one's)"
            )
        return "127.0.0.1", 0
    host, sep, port = opts.rdzv_endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise PrismError(f"--rdzv-endpoint {opts.rdzv_endpoint!r}: expected HOST:PORT")
    return host, int(port)


def clock_note(emulated: dict[str, Any] | None, sliced: dict[str, Any] | None, at_least: float = 0.01) -> str | None:
    """A line on the clocks of an emulated rank and of its slice where they differ by at least
    ``at_least`` (a fraction): its time moves with the clock on a compute-bound GPU."""
    e, s = (emulated or {}).get("sm_clock_mhz"), (sliced or {}).get("sm_clock_mhz")
    if not e or not s or abs(e - s) < at_least * s:
        return None
    return f"its GPU ran at {e:,} MHz, its slice's at {s:,} MHz ({(e - s) / s * 100:+.1f} %)"


def check_failure(checks: dict[int, dict]) -> str | None:
    """Why a --check fails, in one line: the first sandbox rank with a pruned call whose output
    differs from the recording by more than rounding, or that could not be compared; None when
    every compared output agrees."""
    for r, c in sorted(checks.items()):
        if c.get("differing"):
            more = f"; {c['differing'] - 1} other call(s) differ too" if c["differing"] > 1 else ""
            return f"sandbox rank {r}: {c['first_difference']}{more}"
        if c.get("errors"):
            return f"sandbox rank {r}: {c['errors']} call(s) could not be compared, first {c['error_calls'][0]}"
    return None


def emulate(opts: EmulateOptions) -> EmulateResult:
    """Run the emulation, as the one writer of ``opts.out`` (``prismllm.outdir``); raise PrismError
    (one clear message) on bad input or a failed run: SandboxOutOfMemory when a sandbox rank ran
    out of memory (a result), else LaunchError."""
    with writing(opts.out):
        return _emulate(opts)


def _emulate(opts: EmulateOptions) -> EmulateResult:
    t0 = time.monotonic()
    if not isinstance(opts.assistants, int) or opts.assistants < 1:
        raise PrismError(f"--assistants must be 1 or more, not {opts.assistants!r}")
    graph = Path(opts.graph)
    manifest = read_manifest(graph, opts.verify)
    world = manifest["world_size"]
    timing = _timing(opts, manifest, graph)
    try:
        if isinstance(opts.sandbox, str):
            sandbox = parse_ranks(opts.sandbox)
        else:
            sandbox = tuple(sorted({int(r) for r in opts.sandbox}))
    except ValueError as e:
        raise PrismError(f"--sandbox: {e}") from None
    bad = [r for r in sandbox if not 0 <= r < world]
    if bad or not sandbox:
        raise PrismError(f"--sandbox {opts.sandbox}: ranks must be in 0..{world - 1} (the graph's world)")
    if len(sandbox) == world:
        raise PrismError("every rank is in the sandbox: nothing to emulate (use `prism record`)")
    cuda_on_cpu = bool(manifest.get("cuda_on_cpu"))  # as the graph was captured
    devices = sandbox_devices(opts.devices, len(sandbox) + opts.assistants, cuda_on_cpu)
    tensors = recorded_inputs(graph, opts.tensors, opts.inputs, opts.verify)
    if opts.check and tensors is None:
        raise PrismError("--check compares with recorded outputs: it needs the recorded tensors (--inputs recorded)")
    rdzv = _endpoint(opts)
    token = load_token(opts.rdzv_token_file) if opts.rdzv_endpoint is not None else None
    if not os.path.isfile(opts.script):
        raise PrismError(f"script not found: {opts.script}")
    check_program(manifest, opts.script, opts.args, world)  # a graph of another program: refuse
    if opts.timeout is not None and opts.timeout <= 0:
        raise PrismError(f"--timeout must be positive, not {opts.timeout:g}")
    out = Path(opts.out)
    if must_replace(out, opts.force, (EMULATE_FILE, PIDS_FILE), "emulation"):  # pids: a run cut off
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)

    run = launch_sandbox(
        SandboxSpec.from_fields(
            opts,
            graph=graph,
            world=world,
            sandbox=sandbox,
            args=list(opts.args),
            out=out,
            devices=devices,
            tensors=tensors,
            timing=timing,
            env=dict(opts.env),
            rdzv=rdzv,
            rdzv_token=token,
        )
    )
    result, failure = run.launch, run.failure
    wall = time.monotonic() - t0
    local = sandbox if opts.role in ("all", "sandbox") else ()
    codes = {r: result.returncodes.get(r) for r in local}
    prediction = _calibration(graph)
    sliced = (manifest.get("timing") or {}).get("gpu") or {}
    for r, m in run.sandbox_results.items():  # beside the emulated rank's GPU clock, its slice's
        m["slice_gpu"] = sliced.get(str(r), {})
    comms = communicators(graph, sandbox)
    checked = check_failure(run.checks) if opts.check and failure is None else None
    if failure is not None:
        outcome, message = "out_of_memory" if isinstance(failure, SandboxOutOfMemory) else "failed", str(failure)
    elif checked is not None:
        outcome, message = "check_failed", f"--check: {checked}"
    else:
        outcome, message = "ok", ""
    record: dict[str, Any] = {
        "graph": str(graph.resolve()),
        "tensors": str(tensors.resolve()) if tensors is not None else None,
        "inputs": "recorded" if tensors is not None else "generated",
        "devices": devices.text,
        "shared_gpu": run.shared_gpu,
        "world_size": world,
        "role": opts.role,
        "rdzv_endpoint": opts.rdzv_endpoint,
        "sandbox": list(sandbox),
        "command": [opts.script, *opts.args],
        "ok": outcome == "ok",
        "outcome": outcome,
        "returncodes": {str(r): c for r, c in codes.items()},
        "assistant_returncode": result.returncodes.get(-1),
        "assistants": opts.assistants,
        "assistant_returncodes": [result.returncodes.get(-(a + 1)) for a in range(opts.assistants)],
        "wall_s": round(wall, 3),
        "message": message,
        "pids": pids_by_role(result.pids),
        "timing": timing,
        "sandbox_results": {str(r): m for r, m in run.sandbox_results.items()},
        "prediction": prediction,
        "replay": run.replay,
        "communicators": comms,
    }
    if opts.check:
        record["checks"] = {str(r): c for r, c in run.checks.items()}
    (out / EMULATE_FILE).write_text(json.dumps(record, indent=1) + "\n")
    if failure is not None:
        raise failure
    return EmulateResult(
        out=out,
        world_size=world,
        sandbox=sandbox,
        returncodes=codes,
        wall_s=wall,
        launch=result,
        checks=run.checks,
        check_failure=checked,
        timing=timing,
        sandbox_results=run.sandbox_results,
        prediction=prediction,
        replay=run.replay,
        communicators=comms,
        shared_gpu=run.shared_gpu,
    )


__all__ = ["EmulateOptions", "EmulateResult", "SandboxOutOfMemory", "check_failure", "emulate"]
