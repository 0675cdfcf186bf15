"""``prism emulate``: the sandbox ranks run the unmodified program for real, one assistant
replays every other rank of the bare graph and meets them in every collective.

Processes, all children of one launcher (``prismllm.capture.launcher``: one TCPStore hosted
by the launcher, every child ended when the run ends, however it ends):

* one per sandbox rank r: ``python -m prismllm.comm.bootstrap SCRIPT ARGS`` with torchrun's
  environment for logical rank r of WORLD_SIZE = N (the graph's world size) and
  ``PRISM_MODE=emulate`` (``prismllm.comm.emulate``);
* one assistant: ``python -m prismllm.replay.assistant`` (``prismllm.replay.assistant``).

The sandbox ranks write their rank logs (what ``prism record`` records, for the slice-timing
stage) into ``OUT/ranklogs``, and ``OUT/emulate.json`` says what ran and how it ended.
``OUT/pids.json`` names the processes (launcher, sandbox ranks, assistant) as soon as they
all started, so whoever watches the run can find them while it goes on.

Faults end the run with one line naming who failed and with what (every child is ended):
a sandbox rank's own error (the last exception line of its stderr: its traceback was passed
through above), or its signal; a sandbox rank that ran out of memory is a *result* of the
emulation (:class:`SandboxOutOfMemory`), not a failure of prism; an assistant that exits or
is killed ends the run with its own error or signal and the virtual ranks it played.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from prismllm.capture.launcher import (ExtraProcess, LaunchError, LaunchResult, LaunchSpec, LineSink,
                                      describe_returncode, error_line, format_ranks, gpu_ids, launch)
from prismllm.capture.record import LOGS_DIR, MANIFEST_FILE, TENSORS_DIR, parse_gpu_list
from prismllm.emulate.fingerprint import check_program
from prismllm.errors import PrismError

RANKLOGS_DIR = "ranklogs"
RESULT_FILE = "emulate.json"
PIDS_FILE = "pids.json"
REPLAY_FILE = "replay.json"  # the assistant's replay of the virtual ranks
# After the first failure, how long the other processes may take to exit on their own: a
# sandbox rank that raised closes its sockets before it exits, and the assistant, seeing them
# close, may exit first; with its own exit status kept, the launcher names the cause.
SETTLE_S = 2.0

# what an allocation failure says: torch (CUDA, CPU allocator), Python, numpy, NCCL/cuBLAS
_OUT_OF_MEMORY = re.compile(r"MemoryError|out of memory|can(?:'|no)t allocate memory|not enough memory|"
                            r"_ALLOC_FAILED", re.IGNORECASE)
_PRISM_ERROR = "prism: error: "  # how prismllm.comm.bootstrap reports a PrismError inside the program


class SandboxOutOfMemory(LaunchError):
    """A sandbox rank ran out of memory: the emulation reproduced an OOM of the program at this
    scale. A result (what the run found), not a failure of prism; ``rank`` is the sandbox rank."""

    def __init__(self, message: str, result: LaunchResult, rank: int):
        super().__init__(message, result)
        self.rank = rank


@dataclasses.dataclass
class EmulateOptions:
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
    devices: str = "cpu"  # "cpu" (gloo); "cuda": a GPU per sandbox rank and assistant (NCCL); "cuda:G,...": theirs, in order
    inputs: str = "recorded"  # virtual ranks' inputs: "recorded" (the tensor store) or "generated" (zeros)
    # Multi-host: "HOST:PORT", where the processes of every invocation meet (the store is
    # hosted by the invocation that runs the sandbox ranks), and which processes this
    # invocation runs: "all", "sandbox" (the sandbox ranks) or "assistant".
    rdzv_endpoint: str | None = None
    role: str = "all"
    # How the assistant replays the virtual ranks: "fast" (as fast as dependencies allow: slice
    # timing), "real" (in real time with the graph's durations, the sandbox's real completions
    # fed back: emulation with a calibrated graph), "auto" (real for a calibrated graph, else fast).
    timing: str = "auto"
    # Assistant processes (on GPU: one GPU each, after the sandbox's): each plays the proxy of
    # a share of the pruned groups (every one replays all virtual ranks: the plan is cheap).
    assistants: int = 1


@dataclasses.dataclass
class EmulateResult:
    out: Path
    world_size: int
    sandbox: tuple[int, ...]
    returncodes: dict[int, int | None]  # per sandbox rank
    wall_s: float
    launch: LaunchResult
    checks: dict[int, dict] = dataclasses.field(default_factory=dict)  # --check: per sandbox rank
    timing: str = "fast"
    sandbox_results: dict[int, dict] = dataclasses.field(default_factory=dict)  # per sandbox rank, see _measured
    prediction: dict | None = None  # the calibration's, when the graph is a calibrated one
    communicators: dict | None = None  # communicators created against logical groups (communicators())
    replay: dict | None = None  # the assistant's replay of the virtual ranks (replay.json)
    shared_gpu: bool = False  # a GPU shared by this run's processes (NCCL over sockets)


def _manifest(graph: Path) -> dict[str, Any]:
    """The graph's manifest (no need to load the node tables here), with a valid world_size."""
    mf = graph / MANIFEST_FILE
    if not mf.is_file():
        raise PrismError(f"{graph} holds no graph ({MANIFEST_FILE} missing)")
    try:
        manifest = json.loads(mf.read_text())
    except (OSError, ValueError) as e:
        raise PrismError(f"cannot read {mf}: {e}") from None
    ws = manifest.get("world_size") if isinstance(manifest, dict) else None
    if not isinstance(ws, int) or ws < 1:
        raise PrismError(f"{mf} has no world_size")
    return manifest


def _timing(opts: EmulateOptions, manifest: dict[str, Any], graph: Path) -> str:
    """The replay timing: "real" needs measured durations (a calibrated, timed or recorded graph)."""
    mode = manifest.get("mode")
    if opts.timing == "auto":
        return "real" if mode == "calibrated" else "fast"
    if opts.timing not in ("fast", "real"):
        raise PrismError(f"--timing must be auto, fast or real, not {opts.timing!r}")
    if opts.timing == "real" and mode not in ("calibrated", "timed", "record"):
        raise PrismError(f"--timing real replays the graph's durations, and {graph} is a {mode!r} graph "
                         f"without measured ones: time and calibrate it first (`prism time`, "
                         f"`prism calibrate --write-graph`) and emulate CAL/graph")
    return opts.timing


def communicators(graph: Path, sandbox: Sequence[int]) -> dict[str, int]:
    """The communicators this emulation creates against the graph's logical groups (the
    routing of docs/emulate.md): a group with no sandbox member is never instantiated; one whose
    members are all sandbox ranks is a real communicator of those; any other is one small
    communicator of its sandbox members plus a proxy. Read from the groups table alone."""
    import pyarrow.parquet as pq

    from prismllm.trace.schema import FILES

    real = set(sandbox)
    ranks = pq.read_table(graph / FILES["groups"][0], columns=["ranks"]).column("ranks").to_pylist()
    out = {"logical_groups": len(ranks), "not_instantiated": 0, "all_real": 0, "pruned": 0,
           "largest_logical_group": max((len(m) for m in ranks), default=0), "largest_communicator": 0}
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
    f = graph.parent / "summary.json"
    try:
        s = json.loads(f.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(s, dict) or s.get("format") != "prism-calibration":
        return None
    keys = ("predicted_iteration_ns", "steady_iterations", "world_size", "pipeline_bubble", "busy_fraction")
    return {"summary": str(f.resolve()), **{k: s.get(k) for k in keys},
            "iterations": [{"iteration": it.get("iteration"), "predicted_ns": it.get("predicted_ns")}
                           for it in s.get("iterations", [])]}


def _measured(ranklogs: Path, sandbox: Sequence[int]) -> dict[int, dict]:
    """Per sandbox rank, from its rank log: each iteration's time (its own begin to end) and
    the time its compute spans took in it, the median over the steady ones (all but the first
    when there are two or more) and the peak device memory (torch.cuda.max_memory_allocated;
    -1 on CPU)."""
    from prismllm.trace.ranklog import ranklog_path, read_ranklog

    out = {}
    for r in sandbox:
        path = ranklog_path(ranklogs, r)
        if not path.is_file():
            continue
        log = read_ranklog(path)
        its = sorted((it for it in log.iterations if it.get("end_ns", -1) >= it.get("start_ns", -1) >= 0),
                     key=lambda it: it["iteration"])
        times = [int(it["end_ns"] - it["start_ns"]) for it in its]
        steady = times[1:] if len(times) >= 2 else times
        med = int(statistics.median(steady)) if steady else None
        compute: dict[int, int] = {}
        for nd in log.nodes:
            if nd.get("kind") == "compute" and nd.get("duration_ns", -1) >= 0:
                compute[nd["iteration"]] = compute.get(nd["iteration"], 0) + int(nd["duration_ns"])
        out[r] = {"iterations": [int(it["iteration"]) for it in its], "iteration_ns": times,
                  "compute_ns": [compute.get(int(it["iteration"]), 0) for it in its],
                  "median_steady_iteration_ns": med, "peak_memory_bytes": int(log.peak_memory_bytes),
                  "emulation_overhead_left_out_ns": int(log.excluded_ns),
                  "emulation_scratch_bytes": int(log.scratch_bytes)}
    return out


def _endpoint(opts: EmulateOptions) -> tuple[str, int]:
    """(host, port) of the rendezvous: the given endpoint, or this host and a port the
    launcher picks (port 0) when one invocation runs everything."""
    if opts.role not in ("all", "sandbox", "assistant"):
        raise PrismError(f"--role must be all, sandbox or assistant, not {opts.role!r}")
    if opts.rdzv_endpoint is None:
        if opts.role != "all":
            raise PrismError(f"--role {opts.role} needs --rdzv-endpoint HOST:PORT (where the other "
                             f"invocation's processes meet this one's)")
        return "127.0.0.1", 0
    host, sep, port = opts.rdzv_endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise PrismError(f"--rdzv-endpoint {opts.rdzv_endpoint!r}: expected HOST:PORT")
    return host, int(port)


def emulate(opts: EmulateOptions) -> EmulateResult:
    """Run the emulation; raise PrismError (one clear message) on bad input or a failed run:
    SandboxOutOfMemory when a sandbox rank ran out of memory (a result), else LaunchError."""
    from prismllm.comm.emulate import parse_ranks

    t0 = time.monotonic()
    if not isinstance(opts.assistants, int) or opts.assistants < 1:
        raise PrismError(f"--assistants must be 1 or more, not {opts.assistants!r}")
    graph = Path(opts.graph)
    manifest = _manifest(graph)
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
    if opts.inputs not in ("recorded", "generated"):
        raise PrismError(f"--inputs must be recorded or generated, not {opts.inputs!r}")
    kind = "cuda" if opts.devices == "cuda" or opts.devices.startswith("cuda:") else opts.devices
    if kind not in ("cpu", "cuda"):
        raise PrismError(f"--devices must be cpu, cuda or cuda:G,G,..., not {opts.devices!r}")
    tensors = Path(opts.tensors) if opts.tensors is not None else graph / TENSORS_DIR
    if opts.inputs == "recorded" and (not tensors.is_dir() or not any(tensors.glob("rank-*.idx"))):
        raise PrismError(f"no recorded tensors in {tensors}: the assistant needs the virtual ranks' inputs "
                         f"(`prism record --save-tensors all,inputs`; --tensors DIR; or --inputs generated)")
    if opts.check and opts.inputs != "recorded":
        raise PrismError("--check compares with recorded outputs: it needs --inputs recorded")
    host, port = _endpoint(opts)
    run_sandbox, run_assistant = opts.role in ("all", "sandbox"), opts.role in ("all", "assistant")
    sandbox_gpus, assistant_gpus = _gpus(opts.devices, len(sandbox) if run_sandbox else 0,
                                         opts.assistants if run_assistant else 0)
    shared = len(set(sandbox_gpus + assistant_gpus)) < len(sandbox_gpus + assistant_gpus)
    gpu_envs = ([{"CUDA_VISIBLE_DEVICES": gpu_ids([g], os.environ)[0]} for g in assistant_gpus]
                if kind == "cuda" else [{} for _ in range(opts.assistants)])
    if not os.path.isfile(opts.script):
        raise PrismError(f"script not found: {opts.script}")
    check_program(manifest, opts.script, opts.args, world)  # a graph of another program: refuse
    if opts.timeout is not None and opts.timeout <= 0:
        raise PrismError(f"--timeout must be positive, not {opts.timeout:g}")
    out = Path(opts.out)
    if out.exists() and not out.is_dir():
        raise PrismError(f"output path {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        if not opts.force:
            raise PrismError(f"output directory {out} exists and is not empty (use --force to replace it)")
        if not (out / RESULT_FILE).exists() and not (out / PIDS_FILE).exists():  # pids: a run cut off
            raise PrismError(f"output directory {out} is not empty and holds no emulation; "
                             f"refusing to delete it even with --force")
        import shutil

        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    ranklogs = out / RANKLOGS_DIR
    ranklogs.mkdir()

    common = {"PRISM_SANDBOX": ",".join(map(str, sandbox)), "PRISM_GRAPH": str(graph.resolve())}
    env: dict[str, str | None] = {
        **common,
        "PRISM_MODE": "emulate",
        "PRISM_SPOOL": str(ranklogs.resolve()),
        "PRISM_DEVICE": kind,
        # what torchrun gives each of the N ranks of the real job (nproc > 1): the sandbox
        # runs the recorded ranks' numerics, not a multi-threaded variant of them
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }
    if opts.check:
        env["PRISM_CHECK_TENSORS"] = str(tensors.resolve())
        env["PRISM_CHECK_OUT"] = str(out.resolve())
    env.update(opts.env)
    aenv = {**common, "PRISM_INPUTS": opts.inputs, "PRISM_REPLAY_TIMING": timing,
            "PRISM_EMULATE_BACKEND": "nccl" if kind == "cuda" else "gloo",
            "PRISM_ASSISTANTS": str(opts.assistants)}
    if opts.inputs == "recorded":
        aenv["PRISM_TENSOR_STORE"] = str(tensors.resolve())
    assistants = [ExtraProcess("assistant" if opts.assistants == 1 else f"assistant {a}",
                               [sys.executable, "-m", "prismllm.replay.assistant"],
                               env={**aenv, **gpu_envs[a], "PRISM_ASSISTANT_INDEX": str(a),
                                    # every assistant replays the same plan: the first one writes it
                                    **({"PRISM_REPLAY_OUT": str((out / REPLAY_FILE).resolve())} if a == 0 else {})})
                  for a in range(opts.assistants)]

    def publish(pids: dict[int, int]) -> None:
        tmp = out / f".{PIDS_FILE}.tmp"
        try:
            tmp.write_text(json.dumps(_pids(pids), indent=1) + "\n")
            os.replace(tmp, out / PIDS_FILE)  # whoever polls for it never reads half a file
        except OSError as e:
            raise PrismError(f"cannot write {out / PIDS_FILE}: {e}") from None

    local = list(sandbox) if run_sandbox else []
    spec = LaunchSpec(
        nproc=len(local), script=opts.script, args=list(opts.args), env=env,
        devices="cpu" if kind == "cpu" else sandbox_gpus, own_hosts=shared,
        ranks=local, world_size=world, timeout=opts.timeout,
        log_dir=out / LOGS_DIR if opts.tee else None, line_prefix=opts.line_prefix, sink=opts.sink,
        extra=assistants if run_assistant else [], extra_grace=opts.extra_grace, on_start=publish,
        settle=SETTLE_S, master_addr=host, store_port=port if run_sandbox else 0,
        master_port=None if run_sandbox else port,
    )
    result = launch(spec)
    wall = time.monotonic() - t0
    codes = {r: result.returncodes.get(r) for r in local}
    checks = {}
    for r in sandbox:
        f = out / f"check-rank-{r}.json"
        if opts.check and f.exists():
            checks[r] = json.loads(f.read_text())
    failure = None if result.ok else _failure(result, sandbox, world)
    measured = _measured(ranklogs, local)
    prediction = _calibration(graph)
    comms = communicators(graph, sandbox)
    try:
        replay = json.loads((out / REPLAY_FILE).read_text())
    except (OSError, ValueError):
        replay = None
    record: dict[str, Any] = {
        "graph": str(graph.resolve()), "tensors": str(tensors.resolve()) if opts.inputs == "recorded" else None,
        "inputs": opts.inputs, "devices": opts.devices, "shared_gpu": shared, "world_size": world,
        "role": opts.role,
        "rdzv_endpoint": opts.rdzv_endpoint,
        "sandbox": list(sandbox), "command": [opts.script, *opts.args], "ok": result.ok,
        "outcome": ("ok" if failure is None else
                    "out_of_memory" if isinstance(failure, SandboxOutOfMemory) else "failed"),
        "returncodes": {str(r): c for r, c in codes.items()},
        "assistant_returncode": result.returncodes.get(-1), "assistants": opts.assistants,
        "assistant_returncodes": [result.returncodes.get(-(a + 1)) for a in range(opts.assistants)],
        "wall_s": round(wall, 3),
        "message": "" if failure is None else str(failure), "pids": _pids(result.pids), "timing": timing,
        "sandbox_results": {str(r): m for r, m in measured.items()}, "prediction": prediction, "replay": replay,
        "communicators": comms,
    }
    if opts.check:
        record["checks"] = {str(r): c for r, c in checks.items()}
    (out / RESULT_FILE).write_text(json.dumps(record, indent=1) + "\n")
    if failure is not None:
        raise failure
    return EmulateResult(out=out, world_size=world, sandbox=sandbox, returncodes=codes, wall_s=wall,
                         launch=result, checks=checks, timing=timing, sandbox_results=measured,
                         prediction=prediction, replay=replay, communicators=comms, shared_gpu=shared)


def _gpus(devices: str, n_sandbox: int, n_assistants: int) -> tuple[list[int], list[int]]:
    """GPU indices of this invocation's sandbox ranks and assistants: ``cuda`` gives each its
    own GPU in that order (sandbox ranks first); ``cuda:G,G,...`` lists them in that order, a
    GPU named twice being shared (its processes each NCCL's own host: ``own_host_env``)."""
    if devices == "cpu":
        return [], []
    import torch

    have = torch.cuda.device_count()
    need = n_sandbox + n_assistants
    if devices == "cuda":
        if have < need:
            raise PrismError(f"--devices cuda: this invocation's {need} process(es) (sandbox ranks and "
                             f"assistants) need {need} GPU(s), {have} visible (list shared ones: "
                             f"--devices cuda:{','.join(['0'] * need)})")
        gpus = list(range(need))
    else:
        gpus = parse_gpu_list(devices)
        if len(gpus) != need:
            raise PrismError(f"--devices {devices}: {len(gpus)} GPU(s) listed for {n_sandbox} sandbox rank(s) "
                             f"and {n_assistants} assistant(s) (one each, in that order)")
        bad = [g for g in gpus if not 0 <= g < have]
        if bad:
            raise PrismError(f"--devices {devices}: GPU {bad[0]} does not exist ({have} visible)")
    return gpus[:n_sandbox], gpus[n_sandbox:]


def _pids(pids: dict[int, int]) -> dict[str, Any]:
    """The run's processes by role (launcher ids: ranks >= 0, assistant a: -(a + 1))."""
    return {"launcher": os.getpid(), "sandbox": {str(r): p for r, p in sorted(pids.items()) if r >= 0},
            "assistant": pids.get(-1), "assistants": [p for r, p in sorted(pids.items(), reverse=True) if r < 0]}


def _failure(result: LaunchResult, sandbox: tuple[int, ...], world: int) -> LaunchError:
    """One line for a failed run, naming who failed and with what. A sandbox rank's error is
    the program's own (its traceback was passed through); one that ran out of memory is a
    reproduced OOM (SandboxOutOfMemory); the assistant's death ends the virtual ranks it played."""
    f = result.failure
    logs = f"; per-process logs in {result.log_dir}" if result.log_dir is not None else ""
    if f is None or f.rank is None or f.returncode is None:  # timeout, or the assistant lingering
        return LaunchError(result.message, result)
    rc = f.returncode
    stderr = result.stderr_tail.get(f.rank, [])
    # a killed process's last output says nothing about the kill; an exit may report on stdout
    error, lines = error_line(stderr if stderr or rc < 0 else result.stdout_tail.get(f.rank, []))
    how = describe_returncode(rc)
    if f.rank < 0:
        virtual = format_ranks(sorted(set(range(world)) - set(sandbox)))
        who = result.names.get(f.rank, "assistant")
        ended = [r for r in result.ended_by_launcher if r >= 0]
        if rc < 0:
            msg = (f"{who} {how}: the virtual rank(s) {virtual} it played are gone"
                   + (f", so sandbox rank(s) {format_ranks(ended)} were ended" if ended else ""))
        else:
            msg = f"{who} {how}: {error}" if error else f"{who} {how}"
        return LaunchError(msg + logs, result)
    who = f"sandbox rank {f.rank}"
    if rc > 0 and any(_OUT_OF_MEMORY.search(ln) for ln in lines):
        return SandboxOutOfMemory(f"{who} ran out of memory, reproduced by the emulation (a result, not a "
                                  f"failure of prism): {error}{logs}", result, f.rank)
    if rc > 0 and error.startswith(_PRISM_ERROR):  # prism stopped the program: its message names the call
        return LaunchError(f"{who}: {error[len(_PRISM_ERROR):]}{logs}", result)
    return LaunchError((f"{who} {how}: {error}" if error else f"{who} {how}") + logs, result)


__all__ = ["EmulateOptions", "EmulateResult", "SandboxOutOfMemory", "emulate"]
