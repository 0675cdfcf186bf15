"""The GPU fidelity suite: iteration time and peak memory of real multi-GPU jobs against prismllm's
prediction and its emulated sandbox rank, predicted from two GPUs (issue 36). One command, which
writes its results as each step ends and resumes where it stopped.

    python benchmarks/fidelity_gpu.py [--cases all|NAME,...] [--reals 3] [--work out/fidelity_gpu]
        [--json benchmarks/results/fidelity_gpu.json] [--md PATH] [--deadline S] [--timeout S] [--list]

Per case (a program, a layout, a world size N):

1. **real**: the job with plain torchrun on N GPUs, no prismllm, ``--reals`` times; each run's
   iteration time is the median of the steady iterations (all but the first two) as the program
   prints them, its peak memory what it prints (``torch.cuda.max_memory_allocated``), the host's
   wait for the device at the closing synchronize where the program prints it (a share of the
   iteration: high when the GPU is the bottleneck), and the GPU's busy share (NVML's utilisation,
   sampled every 50 ms over the steady iterations: coarse).
2. **prism**: ``prism run --world N --layout ... --devices cuda:S,A --sandbox R`` (the sandbox on
   GPU S, the one the real runs gave rank R, the assistant on A, the lowest other; two H200s at
   their power limit run one program's kernels at clocks ~10 % apart, so the sandbox's GPU sets the
   prediction; ``--prism-devices`` gives others): the calibrated prediction (``predicted_ms``) and the
   sandbox rank's iteration time as the program itself prints it in the emulation
   (``emulated_ms``); the sandbox rank R is the rank that prints (the last).

3. **record** (``--record``): the real job under ``prism record`` on N GPUs, its graph solved by
   ``prism calibrate`` (``solved_ms``): the solve's own error on a real run's measurements, apart
   from the slices' (``recorded_ms``: the recorded run's iteration as the program prints it).

A prediction is a period (a graph's iteration runs from the end of one optimizer step to the end of
the next: the whole loop), so where every real run printed its period (``| period X ms``: the time
from the previous iteration's start to this one's) the real runs' and the emulated sandbox's periods
are compared (a row's ``basis``); else the iter time, which leaves out what the program does between
its timed steps (the batch's preparation, the line printed).

Errors are (x - real) / real against the mean of the real runs' medians; ``real_spread`` is the
real runs' (max - min) / mean. Raw results go to ``--json`` as ``{"rows": [{"case", "world",
"machine", "real_ms": [...], "predicted_ms", "emulated_ms", "predicted_error", "emulated_error",
"real_spread", ...}]}`` (errors as fractions) and a table to ``--md``.

``--concurrent`` (a four-GPU machine): a case of N = 2 runs its real runs on GPUs 2 and 3 while
prism runs on GPUs 0 and 1 (rows say ``concurrent``): one host, disjoint GPUs.

Resume: a case's finished steps are kept in the JSON (each with the machine lease it ran in,
``PRISM_LEASE``; with it set, a case's steps from another lease, another machine, are set aside
under ``earlier`` and run again, so that every error compares runs of one machine) (a real run at a time; prism run resumes
inside its own directory under ``--work``); ``--deadline S`` starts no step that would not end
within S seconds of the start (each step's estimate: the longest of its kind so far), so a
device call of limited length ends cleanly and the next call goes on.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import sandbox_spans  # noqa: E402
from tracing_overhead import machine  # noqa: E402

from prismllm.childenv import HEAD_START_CHOICES, head_start_for  # noqa: E402

TORCH_PAR = str(ROOT / "benchmarks" / "programs" / "torch_parallel.py")
GPT3D = str(ROOT / "examples" / "gpt3d.py")
MEGATRON = str(ROOT / "examples" / "megatron_gpt.py")
NVLS_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# iterations left out of every median, the real runs' and prism's (prism run --warmup): an H200 that
# runs into its power limit lowers its clock over the first seconds (the suite's DDP job alone: iterations
# 2-9 1.0-2.9 % faster than 11-29), so a median from iteration 3 on sets a slice's cooler GPU against a
# warmer real one
WARMUP = 10
# which machine lease a step ran in (PRISM_LEASE, set by the caller): a resumed suite may compare
# real runs and prism runs from two machines of one kind
LEASE = os.environ.get("PRISM_LEASE")
# sizes that keep an H100 busy (hidden 2048, 8 layers, seq 1024, bf16; batches four times those at
# which FSDP2's, DTensor's and gpt3d's real runs were host-bound, spread 6-28 %), and a host-bound one
TORCH_SIZE = ["--layers", "8", "--hidden", "2048", "--heads", "16", "--seq", "1024", "--iters", "30"]
GPT3D_SIZE = ["--layers", "8", "--hidden", "2048", "--heads", "16", "--seq", "1024", "--vocab", "32000"]
GPT3D_SIZE += ["--micro-batch", "4", "--global-batch", "32", "--iters", "30"]
MEGATRON_SIZE = ["--layers", "8", "--hidden", "2048", "--heads", "16", "--seq-len", "1024", "--vocab", "32000"]
MEGATRON_SIZE += ["--micro-batch", "2", "--global-batch", "16", "--iters", "30"]
SMALL = ["--layers", "4", "--hidden", "256", "--heads", "4", "--seq", "128", "--batch", "2", "--iters", "30"]

# the program's own per-iteration line: (iteration, ms, peak bytes or None, host wait share or None)
ITER_LINES = (
    re.compile(
        r"iteration (\d+)/\d+ \| loss \S+ \| iter time ([\d.]+) ms \| max mem ([\d.]+) (MB|B)"
        r"(?: \| host wait ([\d.]+) %)?(?: \| period ([\d.]+) ms)?"
    ),
    re.compile(
        r"iteration\s+(\d+)/\s*\d+ \| elapsed time per iteration \(ms\): ([\d.]+) \|.*?"
        r"max allocated \(B\): (-?\d+) \|(?: host wait \(%\): ([\d.]+) \|)?"
    ),
)


@dataclasses.dataclass
class Case:
    name: str
    world: int
    program: str
    args: list[str]
    layout: str
    stack: str  # what the program is written on

    @property
    def sandbox(self) -> int:
        return self.world - 1  # the rank that prints

    def command(self) -> list[str]:
        return [self.program, *self.args]

    @property
    def iters(self) -> int:
        return int(self.args[self.args.index("--iters") + 1])


def cases(iters: int | None = None) -> list[Case]:
    """The suite's cases; ``iters``: each program's --iters in place of the case's own."""
    t = lambda mode, *extra: [TORCH_PAR, ["--mode", mode, *extra, *TORCH_SIZE]]  # noqa: E731
    # in the order they run: one of each stack and layout first
    every = [
        Case("ddp-2", 2, *t("ddp", "--batch", "16"), "tp=1,pp=1", "PyTorch DDP"),
        Case("megatron-tp2", 2, MEGATRON, ["--tp", "2", *MEGATRON_SIZE], "tp=2", "Megatron-core"),
        Case("ddp-4", 4, *t("ddp", "--batch", "16"), "tp=1,pp=1", "PyTorch DDP"),
        Case("gpt3d-pp2", 2, GPT3D, ["--pp", "2", *GPT3D_SIZE], "pp=2", "gpt3d (1F1B)"),
        Case("tp2-fsdp2-4", 4, *t("tp_fsdp2", "--tp", "2", "--batch", "32"), "tp=2", "PyTorch DTensor TP x FSDP2"),
        Case("fsdp2-2", 2, *t("fsdp2", "--batch", "16"), "tp=1,pp=1", "PyTorch FSDP2"),
        Case("gpt3d-tp2pp2-4", 4, GPT3D, ["--tp", "2", "--pp", "2", *GPT3D_SIZE], "tp=2,pp=2", "gpt3d"),
        Case("dtensor-tp2", 2, *t("tp", "--batch", "32"), "tp=2", "PyTorch DTensor TP"),
        Case("megatron-pp2", 2, MEGATRON, ["--pp", "2", *MEGATRON_SIZE], "pp=2", "Megatron-core (1F1B)"),
        Case(
            "pipelining-pp2", 2, *t("pp", "--batch", "32", "--microbatches", "8"), "pp=2", "PyTorch pipelining (1F1B)"
        ),
        Case(
            "megatron-dp2-distopt", 2, MEGATRON, ["--dist-opt", *MEGATRON_SIZE], "tp=1,pp=1", "Megatron-core dist-opt"
        ),
        Case("fsdp2-4", 4, *t("fsdp2", "--batch", "16"), "tp=1,pp=1", "PyTorch FSDP2"),
        Case(
            "megatron-tp2pp2-4", 4, MEGATRON, ["--tp", "2", "--pp", "2", *MEGATRON_SIZE], "tp=2,pp=2", "Megatron-core"
        ),
        Case("ddp-2-hostbound", 2, TORCH_PAR, ["--mode", "ddp", *SMALL], "tp=1,pp=1", "PyTorch DDP (host-bound)"),
    ]
    if iters is not None:
        for c in every:
            c.args[c.args.index("--iters") + 1] = str(iters)
    return every


def same_job(a: list[str], b: list[str]) -> bool:
    """Whether two case commands run one job: the same program (by its name: the checkout's path
    differs between machines) with the same arguments."""
    return len(a) == len(b) > 0 and Path(a[0]).name == Path(b[0]).name and a[1:] == b[1:]


# ---------------------------------------------------------------------- parsing
def iterations(text: str) -> list[dict]:
    """The program's per-iteration lines: {iteration, ms, peak_bytes, host_wait, period_ms}; a line's
    period (where the program prints one) is the previous iteration's whole turn of the loop."""
    out = []
    for line in text.splitlines():
        for rx in ITER_LINES:
            m = rx.search(line)
            if not m:
                continue
            g = m.groups()
            period = None
            if rx is ITER_LINES[0]:
                peak = float(g[2]) * (1e6 if g[3] == "MB" else 1)
                wait, period = g[4], g[5]
            else:
                peak, wait = float(g[2]), g[3]
            out.append(
                {
                    "iteration": int(g[0]),
                    "ms": float(g[1]),
                    "peak_bytes": int(peak),
                    "host_wait": float(wait) / 100 if wait else None,
                    "period_ms": float(period) if period else None,
                }
            )
            break
    return out


def steady(its: list[dict], warmup: int = WARMUP) -> dict:
    """Median iteration time, period and host wait over the steady iterations (those after the first
    ``warmup``), the peak of the last."""
    st = [x for x in its if x["iteration"] > warmup] or its
    waits = [x["host_wait"] for x in st if x["host_wait"] is not None]
    # a line's period is its previous iteration's: the steady iterations' are on the lines after them
    periods = [x["period_ms"] for x in its if x["iteration"] > warmup + 1 and x.get("period_ms")]
    return {
        "period_ms": round(statistics.median(periods), 3) if periods else None,
        "ms": round(statistics.median(x["ms"] for x in st), 3),
        "iterations": len(its),
        "peak_bytes": its[-1]["peak_bytes"],
        "host_wait": round(statistics.median(waits), 4) if waits else None,
        "first_steady": st[0]["iteration"],
    }


# ---------------------------------------------------------------------- running
class Sampler:
    """NVML's utilisation, SM clock and power of one GPU every 50 ms, with the time of each sample.
    An H200 that reaches its power limit lowers its clock, and two of them do not lower it alike
    (lease 57: the pipeline's last stage at 1,680-1,720 MHz on one GPU of a machine and at
    1,840-1,910 MHz on the other at the same 685-690 W): a row's clocks show what its figures
    were measured at."""

    def __init__(self, gpu: int):
        self.samples: list[tuple[float, int, int, float]] = []  # (time, utilisation %, SM MHz, W)
        self._stop = threading.Event()
        try:
            import pynvml

            pynvml.nvmlInit()
            self._h = pynvml.nvmlDeviceGetHandleByIndex(gpu)
            self._nvml = pynvml
        except Exception:  # noqa: BLE001 - no NVML: no busy share, no clocks
            self._nvml = None
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        nv = self._nvml
        while nv is not None and not self._stop.wait(0.05):
            try:
                util = nv.nvmlDeviceGetUtilizationRates(self._h).gpu
                clock = nv.nvmlDeviceGetClockInfo(self._h, nv.NVML_CLOCK_SM)
                power = nv.nvmlDeviceGetPowerUsage(self._h) / 1000
            except Exception:  # noqa: BLE001
                return
            self.samples.append((time.monotonic(), util, clock, power))

    def stop(self) -> None:
        self._stop.set()
        self._t.join(1)

    def share(self, t0: float, t1: float) -> float | None:
        """The mean utilisation between ``t0`` and ``t1`` (monotonic), as a fraction."""
        self.stop()
        got = [u for t, u, _, _ in self.samples if t0 <= t <= t1]
        return round(statistics.fmean(got) / 100, 3) if got else None

    def clocks(self, t0: float, t1: float) -> dict | None:
        """The median SM clock (MHz) and power (W) of the busy samples (utilisation >= 50 %) between
        ``t0`` and ``t1``."""
        self.stop()
        busy = [(c, w) for t, u, c, w in self.samples if t0 <= t <= t1 and u >= 50]
        if not busy:
            return None
        return {
            "sm_clock_mhz": statistics.median(c for c, _ in busy),
            "power_w": round(statistics.median(w for _, w in busy)),
        }

    def bursts(self, gap_s: float = 1.0, least_s: float = 0.5) -> list[dict]:
        """The stretches the GPU was busy (utilisation >= 50 %, pauses under ``gap_s``), at least
        ``least_s`` long, in order, each with its length and :meth:`clocks`: in a prism run on GPUs
        the capture, each slice and, last, the emulation."""
        self.stop()
        spans: list[list[float]] = []
        for t, u, _, _ in self.samples:
            if u < 50:
                continue
            if spans and t - spans[-1][1] < gap_s:
                spans[-1][1] = t
            else:
                spans.append([t, t])
        return [{"s": round(b - a, 1), **(self.clocks(a, b) or {})} for a, b in spans if b - a >= least_s]


def run_streamed(cmd: list[str], env: dict, timeout: float, log: Path) -> tuple[int, str, dict[int, float]]:
    """Run ``cmd`` in its own session, its output to ``log``; (rc, output, time each program
    iteration line was seen)."""
    seen: dict[int, float] = {}
    lines: list[str] = []
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n\n")
        p = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **env},
            start_new_session=True,
        )  # fmt: skip
        timer = threading.Timer(timeout, lambda: os.killpg(p.pid, 9))
        timer.start()
        try:
            for line in p.stdout:
                f.write(line)
                lines.append(line)
                for it in iterations(line):
                    seen[it["iteration"]] = time.monotonic()
            rc = p.wait()
        finally:
            timer.cancel()
            if p.poll() is None:
                os.killpg(p.pid, 9)
    return rc, "".join(lines), seen


class Suite:
    def __init__(self, a: argparse.Namespace):
        self.a = a
        self.t0 = time.monotonic()
        # a step's expected seconds where its case has none of its own: until a step of the kind
        # ran, then the longest seen
        self.estimate = {"real": 60.0, "prism": 240.0, "record": 90.0}
        self._seen: dict[str, float] = {}
        self.doc = json.loads(a.json.read_text()) if a.json.exists() else {"rows": []}
        self.doc.setdefault("rows", [])
        self.doc["machine"] = machine()
        self.lock = threading.RLock()  # the real runs of a case may run beside its prism run (--concurrent)

    def row(self, c: Case) -> dict:
        for r in self.doc["rows"]:
            if r["case"] == c.name:
                if not same_job(r.get("command") or [], c.command()):  # resized: its runs measured another job
                    self._set_aside(r, lambda step: False)
                    r["command"] = c.command()
                elif LEASE is not None:
                    self._set_aside(r, lambda step: step.get("lease") == LEASE)
                return r
        r = {
            "case": c.name,
            "world": c.world,
            "stack": c.stack,
            "layout": c.layout,
            "command": c.command(),
            "machine": None,
            "real_ms": [],
            "real_runs": [],
        }
        self.doc["rows"].append(r)
        return r

    @staticmethod
    def _set_aside(r: dict, keeps: Any) -> None:
        """Move a case's steps that ``keeps`` refuses to ``earlier``, to be run again: with
        PRISM_LEASE set, those of another machine (a case compares runs of one lease only); all
        of them when the case's command changed."""
        keep = [x for x in r["real_runs"] if keeps(x)]
        old = [x for x in r["real_runs"] if not keeps(x)]
        for step in ("prism", "record"):
            p = r.get(step)
            if p is not None and not keeps(p):
                old.append({step: p})
                del r[step]
        if old:
            r.setdefault("earlier", []).extend(old)
            r["real_runs"] = keep
            r["real_ms"] = [x["ms"] for x in keep if "ms" in x]
            if not keep and not any(step in r for step in ("prism", "record")):
                r["machine"] = None  # every step runs again: on this machine, which may be of another kind

    def _observed(self, kind: str, seconds: float) -> None:
        self._seen[kind] = max(self._seen.get(kind, 0.0), seconds)
        self.estimate[kind] = self._seen[kind]

    def _expected(self, kind: str, r: dict) -> float:
        """Seconds a step of ``kind`` takes for this case: its own last one (any lease: a Megatron
        case's prism run takes four times a DDP case's), else the suite's estimate."""
        if kind == "real":
            own = [x for x in [*r["real_runs"], *r.get("earlier", [])] if "gpus" in x]
        else:
            own = [x[kind] for x in r.get("earlier", []) if kind in x] + ([r[kind]] if kind in r else [])
        walls = [x["wall_s"] for x in own if x.get("rc") == 0 and x.get("wall_s")]
        return walls[-1] + 10 if walls else self.estimate[kind]

    def time_left(self, kind: str, c: Case, r: dict) -> bool:
        """Whether a step of ``kind`` of case ``c`` ends before the deadline; if not, the case waits
        for the next call (a later, shorter case may still fit)."""
        if self.a.deadline is None:
            return True
        left = self.a.deadline - (time.monotonic() - self.t0)
        need = self._expected(kind, r)
        if left < need:
            print(
                f"[{c.name}] left for the next call: {left:.0f} s left, its {kind} step takes ~{need:.0f} s", flush=True
            )
            return False
        return True

    def save(self) -> None:
        with self.lock:
            for r in self.doc["rows"]:  # every row's figures from its steps (a step may have been set aside)
                finish(r)
            for path in (self.a.json, self.a.md):
                path.parent.mkdir(parents=True, exist_ok=True)
            self.a.json.write_text(json.dumps(self.doc, indent=1) + "\n")
            self.a.md.write_text(markdown(self.doc))

    def real(self, c: Case, r: dict, k: int, first_gpu: int = 0) -> None:
        gpus = ",".join(str(first_gpu + i) for i in range(c.world))
        env = {**NVLS_OFF, "CUDA_VISIBLE_DEVICES": gpus, "OMP_NUM_THREADS": "4"}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(c.world)]
        log = self.work(c) / f"real{k}.log"
        print(f"[{c.name}] real run {k + 1} ...", flush=True)
        sampler = Sampler(first_gpu + c.sandbox)
        t0 = time.monotonic()
        rc, text, seen = run_streamed([*cmd, *c.command()], env, self.a.timeout, log)
        wall = time.monotonic() - t0
        its = iterations(text)
        run = {"rc": rc, "wall_s": round(wall, 1), "log": str(log), "gpus": gpus, "lease": LEASE}
        if rc == 0 and its:
            run.update(steady(its, self.a.warmup))
            lo, hi = seen.get(self.a.warmup), seen.get(max(seen, default=0))
            lo, hi = (lo, hi) if lo and hi and hi > lo else (0.0, -1.0)  # no window: none
            run["busy_share"] = sampler.share(lo, hi)
            run["gpu"] = sampler.clocks(lo, hi)  # the sandbox rank's GPU over the steady iterations
        else:
            sampler.stop()
            run["error"] = text[-1500:]
        with self.lock:
            if "ms" in run:
                r["real_ms"].append(run["ms"])
            r["real_runs"].append(run)
        self._observed("real", wall + 5)
        print(f"[{c.name}] real run {k + 1}: exit {rc}, {run.get('ms', '-')} ms, {wall:.0f} s", flush=True)

    def devices(self, c: Case, concurrent: bool) -> str:
        """prism run's --devices for case ``c``: ``--prism-devices`` as given, or (auto) the sandbox on the GPU
        the real runs gave the sandbox rank and the assistant on the lowest other one -- two GPUs at their power
        limit run one program's kernels at clocks ~10 % apart (lease 57), and the sandbox's GPU sets the
        prediction; beside real runs on other GPUs (``--concurrent``), GPUs 0 and 1."""
        if self.a.prism_devices != "auto":
            return self.a.prism_devices
        gpus = self.doc["machine"].get("gpus") or 2
        sandbox = c.sandbox if not concurrent and c.sandbox < gpus else 0
        other = 1 if sandbox == 0 else 0
        return f"cuda:{sandbox},{other}"

    def prism(self, c: Case, r: dict, concurrent: bool = False) -> None:
        out = self.work(c) / "prism"
        devices = self.devices(c, concurrent)
        cmd = [sys.executable, "-m", "prismllm.cli.main", "run", "--world", str(c.world), "--layout", c.layout]
        # --force: a run of this lease starts over (a machine held across calls keeps the last one's outputs,
        # which prism run would resume from)
        cmd += ["--devices", devices, "--sandbox", str(c.sandbox), "--out", str(out), "--json", "--force"]
        cmd += ["--head-start", self.a.head_start, "--warmup", str(self.a.warmup), "--timeout", str(self.a.timeout)]
        cmd += ["--", *c.command()]
        print(f"[{c.name}] prism run ...", flush=True)
        t0 = time.monotonic()
        env = {**NVLS_OFF, **({"PRISM_ISSUE_THREAD": "0"} if self.a.no_issue_thread else {})}
        if self.a.python_path:
            env["PRISM_NATIVE_LANE"] = "0"
        if self.a.device_points:
            env["PRISM_DEVICE_POINTS"] = "1"
        sampler = Sampler(int(devices.split(":")[1].split(",")[0]))
        rc, text, _ = run_streamed(cmd, env, self.a.timeout * 3, self.work(c) / "prism.log")
        wall = time.monotonic() - t0
        bursts = sampler.bursts()
        self._observed("prism", wall + 10)
        p: dict[str, Any] = {
            "rc": rc,
            "wall_s": round(wall, 1),
            "lease": LEASE,
            "issue_thread": not self.a.no_issue_thread,
            "native_lane": not self.a.python_path,
            "head_start": head_start_for(self.a.head_start, native_lane=not self.a.python_path) or "off",
            "devices": devices,
            # the sandbox GPU's busy stretches (capture, the slices, the emulation last) with their clocks
            "gpu_bursts": bursts,
            "warmup": self.a.warmup,  # prism run --warmup: its prediction's and emulation's medians
            "device_points": self.a.device_points,  # the emulated sandbox's spans timed on the device
            "host": self.doc["machine"].get("host"),  # the machine itself: leases of one kind differ by it
        }
        if rc != 0:
            p["error"] = text[-2000:]
            with self.lock:
                r["prism"] = p
            print(f"[{c.name}] prism run failed (exit {rc}) after {wall:.0f} s", flush=True)
            return
        summary = json.loads((out / "run.json").read_text())["summary"]
        p["predicted_ms"] = round(summary["predicted_iteration_ns"] / 1e6, 3)
        p["stages"] = {s["name"]: s["wall_s"] for s in summary.get("stages", [])}
        emu_log = (out / "logs" / "emulate.log").read_text(errors="replace")
        its = iterations(emu_log)
        if its:
            st = steady(its, self.a.warmup)
            p["emulated_ms"], p["emulated_period_ms"], p["emulated_peak_bytes"], p["emulated_host_wait"] = (
                st["ms"],
                st["period_ms"],
                st["peak_bytes"],
                st["host_wait"],
            )
        emu = json.loads((out / "emulate" / "emulate.json").read_text())
        res = (emu.get("sandbox_results") or {}).get(str(c.sandbox)) or {}
        p["emulated_recorded_ms"] = round((res.get("median_steady_iteration_ns") or 0) / 1e6, 3) or None
        p["emulated_peak_memory_bytes"] = res.get("peak_memory_bytes")
        p["emulated_gpu"], p["slice_gpu"] = res.get("gpu"), res.get("slice_gpu")  # prism's own (comm.gpuclock)
        p["arrivals"] = (emu.get("replay") or {}).get("arrivals")
        # the emulation layer's host time by part ([calls, wall ns, CPU ns]), emulated and in the slices
        p["emulated_host_parts"] = res.get("emulation_host_parts")
        timed = json.loads((out / "time" / "graph" / "manifest.json").read_text()).get("timing") or {}
        p["slice_host_parts"] = timed.get("emulation_host_parts")  # by timed rank
        p["slice_native_lane"] = timed.get("emulation_native_lane")  # by timed rank: the slices ran the lane
        bare = json.loads((out / "bare" / "manifest.json").read_text())
        peaks = bare.get("peak_memory_bytes") or {}
        p["captured_peak_bytes"] = peaks.get(str(c.sandbox))
        p["captured_peak_max_bytes"] = max((int(v) for v in peaks.values()), default=None)
        with self.lock:
            r["prism"] = p
        print(
            f"[{c.name}] prism run: predicted {p['predicted_ms']} ms, emulated {p.get('emulated_ms')} ms, {wall:.0f} s",
            flush=True,
        )

    def spans(self, c: Case) -> dict:
        """benchmarks/sandbox_spans.py of the case's prism run (with its recording where there is one):
        the sandbox rank's iteration and compute per source, and the schedule's drift."""
        d = self.work(c)
        args = [str(d / "prism"), "--json", str(d / "spans.json")]
        if (d / "record" / "manifest.json").is_file():
            args += ["--record", str(d / "record")]
        try:
            with open(d / "spans.log", "w") as log, contextlib.redirect_stdout(log):
                sandbox_spans.main(args)
        except (OSError, ValueError, KeyError) as e:
            return {"error": str(e)}
        doc = json.loads((d / "spans.json").read_text())
        for s in doc["sources"].values():
            s.pop("span_ms")  # per span: in spans.json, not the row
        return doc

    def record(self, c: Case, r: dict) -> None:
        """The real job recorded (``prism record`` on N GPUs) and its own graph solved (``prism
        calibrate``): the solve's error on a real run's measurements, apart from the slices'."""
        d = self.work(c)
        gpus = "cuda:" + ",".join(str(i) for i in range(c.world))
        cmd = [sys.executable, "-m", "prismllm.cli.main", "record", "--nproc", str(c.world), "--devices", gpus]
        cmd += ["--out", str(d / "record"), "--force", "--timeout", str(self.a.timeout), "--", *c.command()]
        print(f"[{c.name}] recorded run ...", flush=True)
        t0 = time.monotonic()
        rc, text, _ = run_streamed(cmd, {**NVLS_OFF, "OMP_NUM_THREADS": "4"}, self.a.timeout * 2, d / "record.log")
        rec: dict[str, Any] = {"rc": rc, "lease": LEASE}
        its = iterations(text)
        if rc == 0 and its:
            st = steady(its, self.a.warmup)
            rec["recorded_ms"], rec["recorded_period_ms"] = st["ms"], st["period_ms"]
            cal = [sys.executable, "-m", "prismllm.cli.main", "calibrate", str(d / "record"), "--force", "--out"]
            crc, _, _ = run_streamed([*cal, str(d / "record-cal")], {}, 300, d / "record-cal.log")
            if crc == 0:
                summary = json.loads((d / "record-cal" / "summary.json").read_text())
                rec["solved_ms"] = round(summary["predicted_iteration_ns"] / 1e6, 3)
        else:
            rec["error"] = text[-1500:]
        rec["wall_s"] = round(time.monotonic() - t0, 1)
        self._observed("record", rec["wall_s"] + 5)
        with self.lock:
            r["record"] = rec
        print(f"[{c.name}] recorded run: {rec.get('recorded_ms')} ms, solved {rec.get('solved_ms')} ms", flush=True)

    def work(self, c: Case) -> Path:
        d = self.a.work / c.name
        d.mkdir(parents=True, exist_ok=True)
        return d

    def reals(self, c: Case, r: dict, first_gpu: int = 0) -> None:
        while len(r["real_runs"]) < self.a.reals:
            if not self.time_left("real", c, r):
                return
            self.real(c, r, len(r["real_runs"]), first_gpu)
            self.save()

    def case(self, c: Case) -> None:
        r = self.row(c)
        r["machine"] = r["machine"] or f"{self.doc['machine'].get('gpu')} x{self.doc['machine'].get('gpus')}"
        spare = (self.doc["machine"].get("gpus") or 0) - 2  # GPUs the prism run leaves free
        if self.a.concurrent and c.world <= spare and "prism" not in r and len(r["real_runs"]) < self.a.reals:
            # the real runs on GPUs 2.. while prism runs on 0, 1: disjoint GPUs, one host
            if not self.time_left("prism", c, r):
                return
            t = threading.Thread(target=self.reals, args=(c, r, 2), daemon=True)
            t.start()
            self.prism(c, r, concurrent=True)
            t.join()
            r["concurrent"] = True
        else:
            self.reals(c, r)
            if "prism" not in r:
                if not self.time_left("prism", c, r):
                    return
                self.prism(c, r)
        if self.a.record and "record" not in r and self.time_left("record", c, r):
            self.record(c, r)
        p = r.get("prism") or {}
        if self.a.device_points and p.get("rc") == 0 and "spans" not in p:
            # the sandbox's spans beside its slice's, and the real run's where it was recorded
            p["spans"] = self.spans(c)
        self.save()


# a row's figures, made by finish() from its steps
DERIVED = (
    "real_mean_ms", "real_spread", "real_host_wait", "busy_share", "real_peak_bytes", "predicted_ms",
    "predicted_error", "emulated_ms", "emulated_error", "recorded_ms", "recorded_error", "solved_ms", "solved_error",
    "captured_peak_bytes", "emulated_peak_bytes", "captured_peak_equal", "emulated_peak_equal", "basis",
    "real_basis_ms", "emulated_iter_time_error", "emulated_vs_predicted", "sm_clock_mhz",
)  # fmt: skip


def finish(r: dict) -> None:
    """The row's figures from its steps. The prediction is a period (from one iteration boundary of
    the graph to the next: the whole loop), so it is compared with the real runs' periods where the
    program prints them (``basis``), as Megatron-LM and torchtitan log a step; else with the iter time."""
    p = r.get("prism") or {}
    for key in DERIVED:  # from this lease's steps only: none of a step set aside stays
        r.pop(key, None)
    runs = [x for x in r["real_runs"] if "ms" in x]
    if not runs:
        return
    period = all(x.get("period_ms") for x in runs)
    r["basis"] = "period" if period else "iter time"
    real = r["real_basis_ms"] = [x["period_ms"] if period else x["ms"] for x in runs]
    mean = statistics.fmean(real)
    r["real_mean_ms"] = round(mean, 3)
    r["real_spread"] = round((max(real) - min(real)) / mean, 5)
    waits = [x["host_wait"] for x in r["real_runs"] if x.get("host_wait") is not None]
    r["real_host_wait"] = round(statistics.fmean(waits), 4) if waits else None
    busy = [x["busy_share"] for x in r["real_runs"] if x.get("busy_share") is not None]
    r["busy_share"] = round(statistics.fmean(busy), 3) if busy else None
    peaks = sorted({x["peak_bytes"] for x in r["real_runs"] if x.get("peak_bytes")})
    r["real_peak_bytes"] = peaks
    error = lambda v, of=mean: round((v - of) / of, 5) if v else None  # noqa: E731
    rec = r.get("record") or {}
    for key, v in (
        ("predicted", p.get("predicted_ms")),
        ("emulated", p.get("emulated_period_ms" if period else "emulated_ms")),
        ("recorded", rec.get("recorded_period_ms" if period else "recorded_ms")),
        ("solved", rec.get("solved_ms")),
    ):
        r[f"{key}_ms"], r[f"{key}_error"] = v, error(v)
    if r["predicted_ms"] and r["emulated_ms"]:  # the acceptance's other bar: the emulation keeps to its prediction
        r["emulated_vs_predicted"] = round(r["emulated_ms"] / r["predicted_ms"] - 1, 5)
    if period:  # the emulated sandbox's iter time against the real runs': the program's own measure, like for like
        r["emulated_iter_time_error"] = error(p.get("emulated_ms"), statistics.fmean(x["ms"] for x in runs))
    # the sandbox rank's GPU clock: in the real runs (median of theirs), in its slice and in the emulation, as
    # prism read them (emulate.json), else the prism run's last two busy stretches of the sandbox's GPU (the
    # slices run in rank order, the sandbox rank the last)
    real_clocks = [x["gpu"]["sm_clock_mhz"] for x in runs if (x.get("gpu") or {}).get("sm_clock_mhz")]
    bursts = [b for b in p.get("gpu_bursts") or [] if "sm_clock_mhz" in b]
    r["sm_clock_mhz"] = {
        "real": statistics.median(real_clocks) if real_clocks else None,
        "slice": (p.get("slice_gpu") or {}).get("sm_clock_mhz")
        or (bursts[-2]["sm_clock_mhz"] if len(bursts) >= 3 else None),
        "emulated": (p.get("emulated_gpu") or {}).get("sm_clock_mhz")
        or (bursts[-1]["sm_clock_mhz"] if len(bursts) >= 3 else None),
    }
    r["captured_peak_bytes"] = p.get("captured_peak_bytes")
    r["emulated_peak_bytes"] = p.get("emulated_peak_memory_bytes")
    tol = 10_000 if "gpt3d" in r["stack"] else 0  # gpt3d prints MB to two decimals: equal to that precision
    for key in ("captured_peak_bytes", "emulated_peak_bytes"):
        v = r.get(key)
        r[key.replace("_bytes", "_equal")] = None if v is None or not peaks else any(abs(v - pk) <= tol for pk in peaks)


# ---------------------------------------------------------------------- report
def _pct(x: float | None) -> str:
    return "–" if x is None else f"{x * 100:+.1f} %"


def leases(r: dict) -> str:
    """Which machine leases the real runs and the prism run came from (PRISM_LEASE)."""
    real = ",".join(sorted({str(x.get("lease")) for x in r.get("real_runs", []) if x.get("lease")}))
    p = (r.get("prism") or {}).get("lease")
    return f"{real or '–'} / {p or '–'}"


def clocks(r: dict) -> str:
    """The sandbox rank's GPU clock in the real runs, its last slice and its emulation (MHz)."""
    c = r.get("sm_clock_mhz") or {}
    return " / ".join("–" if c.get(k) is None else f"{c[k]:.0f}" for k in ("real", "slice", "emulated"))


def markdown(doc: dict) -> str:
    m = doc.get("machine") or {}
    lines = [
        f"Machine: {m.get('gpu')} ×{m.get('gpus')}, {m.get('cpus')} cores, torch {m.get('torch')}. Real: plain "
        "torchrun on N GPUs; prism: `prism run` on two GPUs (sandbox, assistant). SM MHz: the median SM clock "
        "of the sandbox rank's GPU while busy (NVML). Medians of the steady iterations "
        "as the program prints them: the period (one iteration's start to the next's) where it prints one (`p`), "
        "else its iter time; errors against the mean of the real runs.",
        "",
        "| case | N | stack | layout | iterations (left out) | real ms (runs) | real spread | host wait | GPU busy | predicted | "
        "error | emulated | error | emulated vs predicted | real recording solved | error | peak memory | SM MHz (real / "
        "slice / emulated) | machine | leases (real / prism) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    done = []
    for r in doc.get("rows", []):
        runs = ", ".join(f"{x:.2f}" for x in r.get("real_basis_ms", []))
        runs += " p" if runs and r.get("basis") == "period" else ""
        peak = "–"
        if r.get("captured_peak_equal") is not None or r.get("emulated_peak_equal") is not None:
            peak = "equal" if r.get("captured_peak_equal") and r.get("emulated_peak_equal") else "differs"
        hw, busy = r.get("real_host_wait"), r.get("busy_share")
        first = (r.get("real_runs") or [{}])[0]
        its = f"{first['iterations']} ({first['first_steady'] - 1})" if "first_steady" in first else "–"
        lines.append(
            f"| {r['case']} | {r['world']} | {r['stack']} | {r['layout']} | {its} | {runs or '–'} | "
            f"{_pct(r.get('real_spread')).lstrip('+')} | {'–' if hw is None else f'{hw * 100:.0f} %'} | "
            f"{'–' if busy is None else f'{busy * 100:.0f} %'} | "
            f"{r.get('predicted_ms') or '–'} | {_pct(r.get('predicted_error'))} | {r.get('emulated_ms') or '–'} | "
            f"{_pct(r.get('emulated_error'))} | {_pct(r.get('emulated_vs_predicted'))} | "
            f"{r.get('solved_ms') or '–'} | {_pct(r.get('solved_error'))} | "
            f"{peak} | {clocks(r)} | {r.get('machine') or '–'} | {leases(r)} |"
        )
        if r.get("predicted_error") is not None and r.get("emulated_error") is not None:
            done.append(r)
    quiet = [r for r in done if (r.get("real_spread") or 0) < 0.01]
    for kind in sorted({r.get("machine") or "?" for r in quiet}):  # one machine kind's figures apart from another's
        of_kind = [r for r in quiet if (r.get("machine") or "?") == kind]
        for key in ("predicted", "emulated"):
            errs = [abs(r[f"{key}_error"]) for r in of_kind]
            lines.append("")
            lines.append(
                f"{kind}, {key}: average |error| {statistics.fmean(errs) * 100:.2f} %, worst {max(errs) * 100:.2f} % "
                f"over the {len(of_kind)} case(s) whose real runs spread under 1 %."
            )
    for kind in sorted({r.get("machine") or "?" for r in done}):
        gaps = [abs(r["emulated_vs_predicted"]) for r in done if (r.get("machine") or "?") == kind]
        lines.append("")
        lines.append(
            f"{kind}: the emulated sandbox within 1 % of its prediction in {sum(g <= 0.01 for g in gaps)} of "
            f"{len(gaps)} case(s), the largest gap {max(gaps) * 100:.2f} %."
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="all", help="comma list of case names, or all")
    ap.add_argument("--reals", type=int, default=3, help="real runs of each case")
    ap.add_argument("--work", type=Path, default=ROOT / "out" / "fidelity_gpu")
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "fidelity_gpu.json")
    ap.add_argument("--md", type=Path, default=None)
    ap.add_argument("--deadline", type=float, default=None, help="seconds: start no step that would end later")
    ap.add_argument("--timeout", type=float, default=300, help="seconds for a real run (prism run: 3x)")
    ap.add_argument(
        "--concurrent",
        action="store_true",
        help="run the real runs of a case that fits on the GPUs past the first two while prism runs on those",
    )
    ap.add_argument(
        "--record",
        action="store_true",
        help="also record the real job (prism record on N GPUs) and solve its own graph: the solve's error apart "
        "from the slices' (recorded_ms, solved_ms)",
    )
    ap.add_argument(
        "--no-issue-thread",
        action="store_true",
        help="prism runs with PRISM_ISSUE_THREAD=0 (the sandbox's async pruned calls issued on the program's thread, "
        "not the issue thread's); rows say so (prism.issue_thread)",
    )
    ap.add_argument(
        "--python-path",
        action="store_true",
        help="prism runs with PRISM_NATIVE_LANE=0 (the emulated sandbox's and the slices' pruned calls through the "
        "Python path, not the native lane, the default on GPUs); rows say which (prism.native_lane)",
    )
    ap.add_argument(
        "--device-points",
        action="store_true",
        help="prism runs with PRISM_DEVICE_POINTS=1 (the emulated sandbox's spans timed on the device) and each row "
        "gets benchmarks/sandbox_spans.py's figures (prism.spans; its per-span medians in WORK/CASE/spans.json); "
        "with --record the real run's spans too",
    )
    ap.add_argument(
        "--head-start",
        choices=HEAD_START_CHOICES,
        default="auto",
        help="prism run's --head-start (the slices' host head start); rows say which ran (prism.head_start)",
    )
    ap.add_argument(
        "--prism-devices",
        default="auto",
        help="prism run's --devices (the first the sandbox's GPU, the second the assistant's); auto: the sandbox on "
        "the GPU the real runs gave the sandbox rank, the assistant on the lowest other (with --concurrent: cuda:0,1); "
        "rows say which (prism.devices) and each GPU's clock (real_runs[].gpu, prism.gpu_bursts)",
    )
    ap.add_argument(
        "--iters",
        type=int,
        default=None,
        help="each program's --iters (default: the case's own, 30): more, with --warmup, to compare a GPU past "
        "the first seconds' clock changes",
    )
    ap.add_argument(
        "--warmup",
        type=int,
        default=WARMUP,
        help=f"iterations left out of every median, the real runs' and prism run's (--warmup; default {WARMUP})",
    )
    ap.add_argument("--list", action="store_true", help="print the cases and exit")
    a = ap.parse_args(argv)
    a.md = a.md or a.json.with_suffix(".md")
    every = cases(a.iters)
    short = [c.name for c in every if c.iters <= a.warmup]
    if short:
        ap.error(f"--warmup {a.warmup} leaves no steady iteration of {', '.join(short)}: give more --iters")
    if a.list:
        for c in every:
            print(f"{c.name:22s} N={c.world} {c.layout:10s} {c.stack}: {' '.join(c.command())}")
        return 0
    names = [c.name for c in every] if a.cases == "all" else [x for x in a.cases.split(",") if x]
    unknown = sorted(set(names) - {c.name for c in every})
    if unknown:
        ap.error(f"unknown case(s) {', '.join(unknown)}; --list shows them")
    suite = Suite(a)
    for c in every:
        if c.name in names:
            suite.case(c)
    suite.save()
    print(markdown(suite.doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
