"""A sandbox run: some ranks of a graph run the unmodified program for real, assistants replay
every other rank and meet them in every collective. ``prism emulate`` is one sandbox run;
``prism time`` is one per slice.

Processes, all children of one launcher (``prismllm.launch.launcher``: one TCPStore hosted by
the launcher, every child ended when the run ends, however it ends):

* one per sandbox rank r: ``python -m prismllm.comm.bootstrap SCRIPT ARGS`` with torchrun's
  environment for logical rank r of WORLD_SIZE = N (the graph's world size) and mode
  ``emulate`` (``prismllm.comm.sandbox``);
* one per assistant: ``python -m prismllm.assistant``.

Into ``spec.out`` the sandbox ranks write their rank logs (``ranklogs/``, what ``prism record``
records), the first assistant its replay of the virtual ranks (``replay.json``), with ``check``
each sandbox rank its comparison with the recorded outputs (``check-rank-<r>.json``), and, as soon
as every process started, ``pids.json`` names them (launcher, sandbox ranks, assistants), so
that whoever watches the run can find them while it goes on.

A failed run is classified (:func:`classify_failure`): a sandbox rank's own error (the last
exception line of its output: its traceback was passed through), an error prism stopped the
program with (the rank's ChildError), a signal, an out-of-memory (:class:`SandboxOutOfMemory`:
a *result* of the emulation, not a failure of prism), or an assistant that exited or was killed
(the virtual ranks it played are gone).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from prismllm.childenv import ChildEnv, native_lane_setting
from prismllm.comm.leftout import LeftOutBoard
from prismllm.errors import InputError, PrismError, RequirementError
from prismllm.fromfields import FromFields
from prismllm.launch.environment import gpu_ids
from prismllm.launch.launcher import launch
from prismllm.launch.messages import describe_returncode, error_line, says_out_of_memory
from prismllm.launch.spec import (
    ExtraProcess,
    LaunchError,
    LaunchResult,
    LaunchSpec,
    LineSink,
    RankOutOfMemory,
)
from prismllm.outputs import LEFT_OUT_FILE, LOGS_DIR, RANKLOGS_DIR, REPLAY_FILE
from prismllm.routing.contract import child_fields
from prismllm.specs import DeviceSpec, cuda_on_cpu_devices, format_ranks, parse_devices
from prismllm.trace.graph import PrismTrace, read_manifest
from prismllm.trace.ranklog import ranklog_path, read_ranklog
from prismllm.trace.schema import TENSORS_DIR
from prismllm.trace.summary import WARMUP, steady as steady_of, warmup_of

PIDS_FILE = "pids.json"
ASSISTANT_MODULE = "prismllm.assistant"
# After the first failure, how long the other processes may take to exit on their own: a
# sandbox rank that raised closes its sockets before it exits, and the assistant, seeing them
# close, may exit first; with its own exit status kept, the launcher names the cause.
SETTLE_S = 2.0


class SandboxOutOfMemory(RankOutOfMemory):
    """A sandbox rank ran out of memory: the emulation reproduced an OOM of the program at this
    scale. A result (what the run found), not a failure of prism; ``rank`` is the sandbox rank."""


@dataclasses.dataclass
class SandboxSpec(FromFields):
    graph: Path  # the graph the virtual ranks are replayed from
    world: int  # its world size
    sandbox: tuple[int, ...]  # the ranks that run for real
    script: str
    args: Sequence[str]
    out: Path  # an existing directory (see the module docstring)
    devices: DeviceSpec  # cpu, cuda (a GPU each, sandbox ranks first) or cuda:G,... (theirs, in order)
    tensors: Path | None = None  # the virtual ranks' recorded inputs (:func:`recorded_inputs`); None: zeros
    timing: str = "fast"  # how the assistants replay: "fast" (slice timing) or "real" (calibrated durations)
    assistants: int = 1  # each plays the proxy of a share of the pruned groups
    check: bool = False  # compare the sandbox's pruned-call outputs with the recorded ones
    timeout: float | None = None
    tee: bool = False  # per-process log files in OUT/logs
    line_prefix: str | None = None
    sink: LineSink | None = None
    env: dict[str, str | None] = dataclasses.field(default_factory=dict)  # extra child environment
    extra_grace: float = 30.0  # how long the assistants may outlive the sandbox ranks
    # Multi-host: where every invocation's processes meet, (host, port); None: this host, a port
    # the launcher picks. ``role``: which processes this invocation runs ("all", "sandbox",
    # "assistant"); the store is hosted by the invocation that runs the sandbox ranks.
    rdzv: tuple[str, int] | None = None
    role: str = "all"
    rdzv_token: bytes | None = dataclasses.field(default=None, repr=False)  # required with rdzv (launch.gate)
    handle_signals: bool = True  # the launcher's signal handlers (main thread only)
    cancel: threading.Event | None = None  # set by another thread to end the run (LaunchInterrupted)
    spin: dict[str, float] | None = None  # {label: ms}: the sandbox ranks spin in spans so labelled (comm.spin)
    head_start: str | None = None  # GPU slices: the host's head start, overhead | iteration (comm.headstart)
    transfer_durations: bool = False  # NCCL's time of each async call, read (ChildEnv.transfer_durations)


@dataclasses.dataclass
class SandboxRun:
    launch: LaunchResult
    sandbox_results: dict[int, dict]  # per sandbox rank run here (:func:`measured`)
    replay: dict | None  # the first assistant's replay.json
    checks: dict[int, dict]  # with ``check``: per sandbox rank
    shared_gpu: bool  # a GPU shared by this run's processes (NCCL over sockets)
    failure: LaunchError | None  # None: every process ended well
    wall_s: float


def launch_sandbox(spec: SandboxSpec) -> SandboxRun:
    """Run the sandbox ranks and assistants of ``spec`` to the end. Bad input raises
    PrismError; a failed run is returned (``failure``), for the caller to record and raise."""
    t0 = time.monotonic()
    if spec.role not in ("all", "sandbox", "assistant"):
        raise PrismError(f"--role must be all, sandbox or assistant, not {spec.role!r}")
    run_sandbox, run_assistant = spec.role in ("all", "sandbox"), spec.role in ("all", "assistant")
    sandbox_gpus, assistant_gpus = gpus_of(
        spec.devices, len(spec.sandbox) if run_sandbox else 0, spec.assistants if run_assistant else 0
    )
    shared = len(set(sandbox_gpus + assistant_gpus)) < len(sandbox_gpus + assistant_gpus)
    cuda = spec.devices.kind == "cuda"
    out = spec.out
    ranklogs = out / RANKLOGS_DIR
    ranklogs.mkdir(parents=True, exist_ok=True)
    graph = str(spec.graph.resolve())
    tensors = str(spec.tensors.resolve()) if spec.tensors is not None else None
    # what the capture fixed, the sandbox ranks run the same way; the stage verified the graph
    manifest = read_manifest(spec.graph, verify=False)
    check = tensors if spec.check else None
    # the native lane: not with the output check (its comparisons are Python's) nor with a head
    # start (prism time's GPU slices: the Python recorder gives it)
    lane = native_lane_setting(on_gpu=cuda) and not check and not spec.head_start
    if lane and run_sandbox:
        # built here, once, before any rank starts (the ranks load it): a build that fails is one
        # message before anything runs, not one from each rank; none where no rank runs the lane
        from prismllm.comm import native

        native.load(without="PRISM_NATIVE_LANE=0 emulates through the Python path")
    # a CPU emulation with real timing, sandbox and assistant in this invocation: the virtual ranks
    # keep the sandbox's clock, which leaves the emulation layer's host time out (comm.leftout)
    board = None
    if not cuda and spec.timing == "real" and spec.role == "all":
        board = str(LeftOutBoard.create(out / LEFT_OUT_FILE, len(spec.sandbox)).resolve())
    rank_env = ChildEnv(
        mode="emulate",
        sandbox=spec.sandbox,
        graph=graph,
        cuda_on_cpu=bool(manifest.get("cuda_on_cpu")) or None,  # the program's CUDA calls on the CPU
        **child_fields(manifest.get("routing")),  # the graph's routing, forced again
        inputs="recorded" if tensors else "generated",
        spool=str(ranklogs.resolve()),
        check_tensors=check,
        check_out=str(out.resolve()) if spec.check else None,
        spin=json.dumps(spec.spin) if spec.spin else None,
        head_start=spec.head_start,
        native_lane_on=lane,  # explicit either way: nothing inherited decides it
        transfer_durations=spec.transfer_durations or None,
        left_out_board=board,
    ).to_env()
    env: dict[str, str | None] = {
        **rank_env,
        # what torchrun gives each of the N ranks of the real job (nproc > 1): the sandbox
        # runs the recorded ranks' numerics, not a multi-threaded variant of them
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        **nccl_timing_env(cuda, spec.transfer_durations),
        **spec.env,
    }
    assistants = []
    for a in range(spec.assistants if run_assistant else 0):
        child = ChildEnv(
            sandbox=spec.sandbox,
            graph=graph,
            inputs="recorded" if tensors else "generated",
            tensor_store=tensors,
            replay_timing=spec.timing,
            emulate_backend="nccl" if cuda else "gloo",
            assistants=spec.assistants,
            assistant_index=a,
            # every assistant replays the same plan: the first one writes it
            replay_out=str((out / REPLAY_FILE).resolve()) if a == 0 else None,
            left_out_board=board,
        )
        gpu = {"CUDA_VISIBLE_DEVICES": gpu_ids([assistant_gpus[a]], os.environ)[0]} if cuda else {}
        assistants.append(
            ExtraProcess(
                "assistant" if spec.assistants == 1 else f"assistant {a}",
                [sys.executable, "-m", ASSISTANT_MODULE],
                env={**child.to_env(), **gpu},
            )
        )

    def publish(pids: dict[int, int]) -> None:
        tmp = out / f".{PIDS_FILE}.tmp"
        try:
            tmp.write_text(json.dumps(pids_by_role(pids), indent=1) + "\n")
            os.replace(tmp, out / PIDS_FILE)  # whoever polls for it never reads half a file
        except OSError as e:
            raise PrismError(f"cannot write {out / PIDS_FILE}: {e}") from None

    host, port = spec.rdzv if spec.rdzv is not None else ("127.0.0.1", 0)
    local = list(spec.sandbox) if run_sandbox else []
    result = launch(
        LaunchSpec.from_fields(
            spec,
            nproc=len(local),
            args=list(spec.args),
            env=env,
            devices=sandbox_gpus if cuda else "cpu",
            own_hosts=shared,
            ranks=local,
            world_size=spec.world,
            log_dir=out / LOGS_DIR if spec.tee else None,
            extra=assistants,
            on_start=publish,
            settle=SETTLE_S,
            master_addr=host,
            rdzv_token=spec.rdzv_token,
            store_port=port if run_sandbox else 0,
            master_port=None if run_sandbox else port,
        )
    )
    checks = {}
    for r in spec.sandbox:
        f = out / f"check-rank-{r}.json"
        if spec.check and f.exists():
            checks[r] = json.loads(f.read_text())
    try:
        replay = json.loads((out / REPLAY_FILE).read_text())
    except (OSError, ValueError):
        replay = None
    return SandboxRun(
        launch=result,
        sandbox_results=measured(ranklogs, local, warmup_of(manifest)),
        replay=replay,
        checks=checks,
        shared_gpu=shared,
        failure=None if result.ok else classify_failure(result, spec),
        wall_s=time.monotonic() - t0,
    )


def nccl_timing_env(cuda: bool, transfer_durations: bool) -> dict[str, str]:
    """NCCL's own device-side start and end events of every call (``TORCH_NCCL_ENABLE_TIMING``),
    only where the sandbox ranks read a pruned call's transfer time (prism time's GPU slices:
    ``PrunedWork._get_duration``, as a recording measures a real call). Each is a timing event
    on the device, which the real job does not record: on two H200s a pruned 64 KB all-reduce
    took 5.8 µs more with them (23.7 against 17.9 µs; real 9.7), a real one 5.9 µs more
    (15.5 against 9.6 µs)."""
    return {"TORCH_NCCL_ENABLE_TIMING": "1"} if cuda and transfer_durations else {}


def recorded_inputs(graph: Path, tensors: str | os.PathLike | None, inputs: str, verify: bool = True) -> Path | None:
    """The tensor store the assistants read the virtual ranks' inputs from (default: the graph's
    own), or None with generated inputs (zeros); ``auto``: recorded where there is a store,
    else generated. PrismError when recorded inputs are asked for and cannot be had. With
    ``verify``, the store is checked before any process reads it (``generate.store.verify_store``:
    its checksums, every index entry, every saved call against the graph's)."""
    if inputs not in ("auto", "recorded", "generated"):
        raise PrismError(f"--inputs must be auto, recorded or generated, not {inputs!r}")
    if inputs == "generated":
        return None
    store = Path(tensors) if tensors is not None else graph / TENSORS_DIR
    has = store.is_dir() and any(store.glob("rank-*.idx"))
    if inputs == "auto" and not has and tensors is None:
        return None
    if not has:
        raise InputError(
            f"no recorded tensors in {store}: the assistant needs the virtual ranks' inputs "
            f"(`prism record --save-tensors all,inputs`; --tensors DIR; or --inputs generated)"
        )
    if verify:
        # the store's module imports torch, which a sandbox run's launcher needs only here
        from prismllm.generate.store import verify_store

        verify_store(store, PrismTrace.load(graph, verify=False), str(graph))  # the stage verified the graph
    return store


def sandbox_devices(text: str, processes: int, cuda_on_cpu: bool = False) -> DeviceSpec:
    """``--devices`` of a sandbox run of ``processes`` processes (sandbox ranks and assistants):
    cpu, cuda or cuda:G,G,... as given; ``auto``: a GPU each when enough are visible, else the one
    GPU shared by all of them (right values and memory, not the timing of linked GPUs), else the
    CPU. A graph recorded with ``cuda_on_cpu`` runs on the CPU (a GPU is refused)."""
    try:
        dev = cuda_on_cpu_devices(text) if cuda_on_cpu else parse_devices(text)
    except ValueError as e:
        raise PrismError(str(e)) from None
    if dev.kind != "auto":
        return dev
    have = cuda_count()
    if have >= processes:
        return DeviceSpec("cuda")
    if have >= 1:
        return DeviceSpec("cuda", (0,) * processes)
    return DeviceSpec("cpu")


def cuda_count() -> int:
    """The GPUs this process sees (0 without CUDA)."""
    # torch only to count GPUs: a CPU run's launcher process never loads it
    import torch

    return torch.cuda.device_count()


def spread_gpus(devices: DeviceSpec, cuda_on_cpu: bool = False) -> int:
    """The GPUs a stage spreads its processes over when not told how many run at a time
    (``--parallel``): those listed, else with ``cuda`` or ``auto`` every visible one (a rank's
    CUDA and NCCL start-up is seconds: one at a time made a 32-rank demo on four H100s 3.5 times a
    2-core VM's); none on the CPU or for a graph captured with ``cuda_on_cpu``."""
    if devices.gpus is not None:
        return len(devices.gpus)
    return cuda_count() if devices.kind in ("auto", "cuda") and not cuda_on_cpu else 0


def gpus_of(devices: DeviceSpec, n_sandbox: int, n_assistants: int) -> tuple[list[int], list[int]]:
    """GPU indices of a run's sandbox ranks and assistants: ``cuda`` gives each its own GPU in
    that order (sandbox ranks first); ``cuda:G,G,...`` lists them in that order, a GPU named twice
    being shared (its processes each NCCL's own host), the first of a longer list taken."""
    if devices.kind == "cpu":
        return [], []
    if devices.kind != "cuda":
        raise PrismError(f"--devices must be cpu, cuda or cuda:G,G,..., not {devices.text!r}")
    have = cuda_count()
    need = n_sandbox + n_assistants
    if devices.gpus is None:
        if have < need:
            raise RequirementError(
                f"--devices cuda: this invocation's {need} process(es) (sandbox ranks and "
                f"assistants) need {need} GPU(s), {have} visible (list shared ones: "
                f"--devices cuda:{','.join(['0'] * need)})"
            )
        gpus = list(range(need))
    else:
        gpus = list(devices.gpus)
        if len(gpus) < need:
            raise PrismError(
                f"--devices {devices.text}: {len(gpus)} GPU(s) listed for {n_sandbox} sandbox "
                f"rank(s) and {n_assistants} assistant(s) (one each, in that order)"
            )
        bad = [g for g in gpus if not 0 <= g < have]
        if bad:
            raise RequirementError(f"--devices {devices.text}: GPU {bad[0]} does not exist ({have} visible)")
        gpus = gpus[:need]  # a longer list is a pool (prism run hands every stage the same one)
    return gpus[:n_sandbox], gpus[n_sandbox:]


def measured(ranklogs: Path, sandbox: Sequence[int], warmup: int = WARMUP) -> dict[int, dict]:
    """Per sandbox rank, from its rank log: each iteration's time (its own begin to end) and
    the time its compute spans took in it, the median over the steady ones (all but the first
    ``warmup``: trace.summary.steady) and the peak device memory (torch.cuda.max_memory_allocated;
    None, with ``peak_memory_reason``, where there is none to measure)."""
    out = {}
    for r in sandbox:
        path = ranklog_path(ranklogs, r)
        if not path.is_file():
            continue
        log = read_ranklog(path)
        its = sorted(
            (it for it in log.iterations if it.get("end_ns", -1) >= it.get("start_ns", -1) >= 0),
            key=lambda it: it["iteration"],
        )
        times = [int(it["end_ns"] - it["start_ns"]) for it in its]
        steady = steady_of(times, warmup)
        med = int(statistics.median(steady)) if steady else None
        compute: dict[int, int] = {}
        for nd in log.nodes:
            if nd.get("kind") == "compute" and nd.get("duration_ns", -1) >= 0:
                compute[nd["iteration"]] = compute.get(nd["iteration"], 0) + int(nd["duration_ns"])
        # on a GPU an emulation times only its iteration boundaries on the device: a compute span
        # between two of its host points is the host's pace, not the device's
        spans_timed = log.clock != "cuda-iterations"
        out[r] = {
            "iterations": [int(it["iteration"]) for it in its],
            "iteration_ns": times,
            "compute_ns": [compute.get(int(it["iteration"]), 0) for it in its] if spans_timed else None,
            "median_steady_iteration_ns": med,
            **_peak_memory(log.peak_memory_bytes, log.device),
            "emulation_overhead_left_out_ns": int(log.excluded_ns),
            "emulation_host_ns": int(log.emulation_host_ns),
            "emulation_scratch_bytes": int(log.scratch_bytes),
            "emulation_calls_off_thread": int(log.calls_off_thread),
            "emulation_host_parts": log.emulation_host_parts,
            "emulation_native_lane": log.native_lane,
            "transfer_durations": log.transfer_durations,
            "head_start": log.head_start,
            "gpu": log.gpu,
        }
    return out


# why a rank that ran on the CPU has no peak memory
ON_THE_CPU = "the run was on the CPU, which has no device memory (run on a GPU for it)"


def _peak_memory(peak_bytes: int, device: str) -> dict[str, Any]:
    """A rank's peak device memory (its log's -1: not measured), with why where there is none."""
    if peak_bytes >= 0:
        return {"peak_memory_bytes": int(peak_bytes)}
    why = ON_THE_CPU if device == "cpu" else "the rank never initialized CUDA"
    return {"peak_memory_bytes": None, "peak_memory_reason": why}


def pids_by_role(pids: dict[int, int]) -> dict[str, Any]:
    """The run's processes by role (launcher ids: ranks >= 0, assistant a: -(a + 1))."""
    return {
        "launcher": os.getpid(),
        "sandbox": {str(r): p for r, p in sorted(pids.items()) if r >= 0},
        "assistant": pids.get(-1),
        "assistants": [p for r, p in sorted(pids.items(), reverse=True) if r < 0],
    }


def classify_failure(result: LaunchResult, spec: SandboxSpec) -> LaunchError:
    """One line for a failed run, naming who failed and with what. A sandbox rank's error is
    the program's own (its traceback was passed through) or prism's (its ChildError); one that
    ran out of memory is a reproduced OOM (SandboxOutOfMemory); an assistant's death ends the
    virtual ranks it played."""
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
        who = result.names.get(f.rank, "assistant")
        if rc < 0:
            virtual = format_ranks(sorted(set(range(spec.world)) - set(spec.sandbox)))
            ended = [r for r in result.ended_by_launcher if r >= 0]
            msg = f"{who} {how}: the virtual rank(s) {virtual} it played are gone" + (
                f", so sandbox rank(s) {format_ranks(ended)} were ended" if ended else ""
            )
        else:
            reported = f.error.message if f.error is not None else error
            msg = f"{who} {how}: {reported}" if reported else f"{who} {how}"
        return LaunchError(msg + logs, result)
    who = f"sandbox rank {f.rank}"
    if rc > 0 and says_out_of_memory(lines):
        return SandboxOutOfMemory(
            f"{who} ran out of memory, reproduced by the emulation (a result, not a failure of prism): {error}{logs}",
            result,
            f.rank,
        )
    if rc > 0 and f.error is not None:  # prism stopped the program: its message names the call
        message = f.error.message.removeprefix(f"rank {f.rank}: ")  # the rank, said once
        return LaunchError(f"{who}: {message}{logs}", result)
    return LaunchError((f"{who} {how}: {error}" if error else f"{who} {how}") + logs, result)


__all__ = [
    "ON_THE_CPU",
    "SandboxOutOfMemory",
    "SandboxRun",
    "SandboxSpec",
    "classify_failure",
    "gpus_of",
    "launch_sandbox",
    "measured",
    "nccl_timing_env",
    "pids_by_role",
    "recorded_inputs",
    "sandbox_devices",
    "spread_gpus",
]
