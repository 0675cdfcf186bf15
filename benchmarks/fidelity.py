"""Fidelity (issue 13): for each gpt3d layout, the real N-rank run and its emulation on fewer
devices, in one invocation; errors of iteration time and peak memory per sandbox rank, beside
three baselines. JSON plus a markdown table (docs/benchmarks.md, "Fidelity").

    python benchmarks/fidelity.py --devices cpu|cuda --worlds 8,16,32 [--cases tp,pp,vpp,dpopt,moe,mixed]
        [--iters K] [--warmup W] [--sandbox auto|last|0,last|RANKS] [--inputs auto|recorded|generated]
        [--json benchmarks/results/fidelity_<machine>.json] [--md PATH] [--keep DIR]

Per case (layout x N), each stage a `prism` command (a child process), in this order:

1. real: `prism record --nproc N` (torchrun's job, traced): each rank's iteration times (its
   iterations table), GPU peak memory per rank (the manifest's `peak_memory_bytes`:
   max_memory_allocated at exit), the program's printed iteration times. Then the same command
   again with `--save-tensors all,inputs`, whose timings are never read (saving copies buffers
   to the host synchronously): its tensor store holds the virtual ranks' inputs (with
   `--inputs recorded`, the default on CPU; always for MoE; on GPU dense layouts take generated
   zeros by default).
2. bare graph: `prism capture --mode solo --world N --layout ...` (dense layouts). MoE routes on
   values: its bare graph is the tensor-saving recording itself (structure and tensors only).
3. `prism time` of the bare graph (every representative real in its own slice) -> timed graph.
4. `prism calibrate TIMED --write-graph` -> the calibrated prediction (every rank).
5. `prism emulate --graph CAL/graph --timing real`: the sandbox ranks run for real, every other
   rank is replayed in real time with the calibrated durations -> the sandbox's measured
   iteration times (its rank logs: `emulate.json` `sandbox_results`) and peak memory.
6. baseline (b): the same emulation with `--timing fast` (virtual ranks as fast as their
   dependencies allow: no inter-slice calibration).
7. baseline (a), a pure model as simulators build one: the bare graph's structure solved by the
   replay engine (`prismllm.replay.engine.Replay`) with each rank's compute spans from a solo
   measurement (the solo capture's own spans; for MoE, which has no solo capture here, the
   timed graph's) and each collective's time from an alpha-beta model fitted in this
   invocation (a 2-rank all-reduce at several sizes, least squares, benchmarks/programs/collective_sizes.py).
8. baseline (c), GPU only: the program for each sandbox rank alone under PyTorch's fake
   process group (benchmarks/programs/fake_pg.py): torch.cuda.max_memory_allocated at exit.

The real run's *timings* never reach the emulation: only its structure (MoE bare graph) and its
tensors (the virtual ranks' inputs) are used. Iteration time everywhere is the median over the
steady iterations (all but the first ``--warmup``) of a rank's own iteration span (the rank
log's / iterations table's start to end; for the replays, the engine's per-rank span); "job"
figures take the maximum over ranks per iteration first. Each case is independent: a failed
stage ends its case (the error is in its row) and the next case starts. JSON and markdown are
rewritten after every case.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from emulate_bootstrap import run  # noqa: E402  (process-group aware runner with a timeout)
from tracing_overhead import machine  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GPT3D = str(ROOT / "examples" / "gpt3d.py")
PRISM = [sys.executable, "-m", "prismllm.cli.main"]
COLLECTIVES = str(ROOT / "benchmarks" / "programs" / "collective_sizes.py")
FAKE_PG = str(ROOT / "benchmarks" / "programs" / "fake_pg.py")
CASES = ("tp", "pp", "vpp", "dpopt", "moe", "mixed")
# model sizes: on a CPU core a few hundred ms an iteration, compute-bound enough that a gloo call's
# latency (about 1 ms on a 2-vCPU VM, with a wide scatter) is not most of it; tens of ms an
# iteration on an H100/H200
SIZES = {
    "cpu": ["--layers", "4", "--hidden", "256", "--heads", "4", "--seq", "128", "--vocab", "512", "--micro-batch", "2"],
    "cuda": [
        "--layers",
        "4",
        "--hidden",
        "1024",
        "--heads",
        "16",
        "--seq",
        "512",
        "--vocab",
        "32000",
        "--micro-batch",
        "2",
    ],
}
PROBE_SIZES = {"cpu": "4KB,256KB,1MB,4MB,16MB", "cuda": "64KB,1MB,16MB,64MB"}
# bytes factor of each collective's alpha-beta time (n: group size; S: the larger of a member's
# input and output bytes, i.e. the full buffer of all-reduce, the gathered output of all-gather,
# the scattered input of reduce-scatter, a member's send or receive volume of all-to-all)
FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "barrier": lambda n: 0.0,
}
P2P_FACTOR = 1.0  # send/recv; broadcast, reduce, gather, scatter (pipelined): S / bandwidth too
ITER_LINE = re.compile(r"iteration (\d+)/(\d+) \| loss ([-\d.eE+na]+) \| iter time ([\d.]+) ms")


# ---------------------------------------------------------------------------------- the cases
@dataclasses.dataclass
class Case:
    name: str  # one of CASES
    world: int
    flags: list[str]  # gpt3d layout flags
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    moe: bool = False
    dist_opt: bool = False
    sp: bool = False

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp)

    @property
    def hint(self) -> str:
        """The capture's --layout (rank placement; DP replicas are captured once)."""
        return f"tp={self.tp},pp={self.pp}" + (f",ep={self.ep}" if self.ep > 1 else "")

    @property
    def title(self) -> str:
        parts = [
            f"TP{self.tp}" if self.tp > 1 else "",
            f"PP{self.pp}" if self.pp > 1 else "",
            f"VPP{self.vpp}" if self.vpp > 1 else "",
            f"DP{self.dp}" if self.dp > 1 else "",
            f"EP{self.ep}" if self.ep > 1 else "",
        ]
        extra = [x for x, on in (("SP", self.sp), ("dist-opt", self.dist_opt)) if on]
        if self.moe:
            extra.append(f"MoE {self.flags[self.flags.index('--num-experts') + 1]} experts")
        if self.pp > 1 and self.vpp == 1:
            extra.append("1F1B")
        return "·".join(p for p in parts if p) + (" " + " ".join(extra) if extra else "")

    def micro_batches(self) -> int:
        """Per DP rank: enough for a steady 1F1B phase (2 x stages), at least 4."""
        return max(4, 2 * self.pp)

    def args(self, sizes: list[str], iters: int, micro_batches: int | None = None) -> list[str]:
        mb = int(sizes[sizes.index("--micro-batch") + 1]) if "--micro-batch" in sizes else 2
        m = micro_batches or self.micro_batches()
        if self.vpp > 1 and m % self.pp:
            m += self.pp - m % self.pp  # the interleaved schedule needs a multiple of the stages
        return [*self.flags, *sizes, "--global-batch", str(mb * self.dp * m), "--iters", str(iters)]


def make_case(name: str, n: int) -> Case | str:
    """The case's layout at world n, or why n does not allow it."""
    if name == "tp":
        return Case(name, n, ["--tp", "2"], tp=2) if n % 2 == 0 else "TP2 needs an even N"
    if name == "pp":
        pp = 4 if n % 4 == 0 else 2 if n % 2 == 0 else 0
        return Case(name, n, ["--pp", str(pp)], pp=pp) if pp else "PP needs an even N"
    if name == "vpp":
        return Case(name, n, ["--pp", "2", "--vpp", "2"], pp=2, vpp=2) if n % 2 == 0 else "PP2 VPP2 needs an even N"
    if name == "dpopt":
        return Case(name, n, ["--dist-opt"], dist_opt=True) if n >= 2 else "DP needs N >= 2"
    if name == "moe":
        ep = 4 if n % 4 == 0 else 2 if n % 2 == 0 else 0
        if not ep:
            return "EP needs an even N"
        return Case(name, n, ["--num-experts", str(2 * ep), "--topk", "2", "--ep", str(ep)], ep=ep, moe=True)
    if name == "mixed":
        if n % 4:
            return "TP2·PP2 needs N divisible by 4"
        c = Case(name, n, ["--tp", "2", "--pp", "2", "--sp"], tp=2, pp=2, sp=True)
        if c.dp > 1:
            c.flags.append("--dist-opt")
            c.dist_opt = True
        return c
    raise ValueError(f"unknown case {name!r}")


def sandbox_ranks(spec: str, n: int, devices: str, gpus: int, shared: bool = False) -> list[int]:
    """'auto': the first and the last rank (first and last pipeline stage; the last is gpt3d's
    reporting rank) where N >= 4 and the devices allow two sandbox ranks plus an assistant
    (``shared``: every process on one GPU), else the last rank; or a list with 'last' for N-1."""
    if spec == "auto":
        two = n >= 4 and (devices == "cpu" or gpus >= 3 or shared)
        return [0, n - 1] if two else [n - 1]
    out = sorted({n - 1 if s.strip() == "last" else int(s) for s in spec.split(",") if s.strip()})
    bad = [r for r in out if not 0 <= r < n]
    if bad or not out or len(out) >= n:
        raise ValueError(f"--sandbox {spec}: ranks must lie in 0..{n - 1} and leave one virtual")
    return out


# ---------------------------------------------------------------------------------- helpers
def steady_median(values: list[int | float], warmup: int) -> float | None:
    vals = [v for v in values if v is not None and v >= 0]
    vals = vals[warmup:] if len(vals) > warmup else vals
    return float(statistics.median(vals)) if vals else None


def load(graph: Path):
    from prismllm.trace.graph import PrismTrace

    return PrismTrace.load(graph)


def rel(x: float | None, ref: float | None) -> float | None:
    return None if x is None or not ref or ref <= 0 else (x - ref) / ref


def per_rank_iterations(trace) -> dict[int, list[int]]:
    """Each rank's iteration spans (ns, iteration order) from a graph's iterations table."""
    it = trace.iterations.to_pydict()
    rows = sorted(zip(it["rank"], it["iteration"], it["start_ns"], it["end_ns"]))
    out: dict[int, list[int]] = {}
    for r, _, s, e in rows:
        out.setdefault(int(r), []).append(int(e - s) if e >= s >= 0 else -1)
    return out


def per_rank_compute(trace) -> dict[int, list[int]]:
    """Each rank's compute time per iteration (ns), for the iterations of its iterations table
    (as per_rank_iterations; the nodes after the last boundary are no iteration): the sum of its
    compute spans' durations. Beside the iteration time it says whether a difference is the
    compute itself (e.g. processes sharing a machine's caches and memory bandwidth) or the waits."""
    import numpy as np

    rank, it = trace.column("rank").astype(np.int64), trace.column("iteration").astype(np.int64)
    dur = trace.column("duration_ns").astype(np.int64)
    comp = (np.asarray(trace.nodes.column("kind").to_pylist()) == "compute") & (dur >= 0)
    table = trace.iterations.to_pydict()
    out: dict[int, list[int]] = {}
    for r, k in sorted(zip(table["rank"], table["iteration"])):
        out.setdefault(int(r), []).append(int(dur[comp & (rank == r) & (it == k)].sum()))
    return out


def job_iterations(per_rank: dict[int, list[int]]) -> list[int]:
    """Per iteration the maximum over ranks (the job's iteration time)."""
    k = min((len(v) for v in per_rank.values()), default=0)
    return [max(v[i] for v in per_rank.values()) for i in range(k)]


def printed(text: str) -> dict:
    """gpt3d's own lines (its last rank): iteration times (ms) and losses."""
    its = ITER_LINE.findall(text)
    return {"iter_time_ms": [float(m[3]) for m in its], "losses": [m[2] for m in its]}


def loss_gap(losses: list[str], ref: list[str]) -> float | None:
    """The largest relative difference between two runs' printed losses (None: not comparable)."""
    try:
        a, b = [float(x) for x in losses], [float(x) for x in ref]
    except ValueError:  # nan, inf: compared as text above
        return None
    if not a or len(a) != len(b):
        return None
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def git_commit() -> str:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        return head + ("+uncommitted" if dirty else "")
    except OSError:
        return "?"


class StageError(Exception):
    def __init__(self, stage: str, message: str):
        super().__init__(f"{stage}: {message}")
        self.stage = stage


class Runner:
    """Runs a case's stages, timing each, logging its output under WORK/logs."""

    def __init__(self, label: str, work: Path, timeout: float, env: dict[str, str]):
        self.label, self.work, self.timeout, self.env = label, work, timeout, env
        self.walls: dict[str, float] = {}
        (work / "logs").mkdir(parents=True, exist_ok=True)

    def cmd(self, stage: str, cmd: list[str], env: dict[str, str] | None = None) -> str:
        print(f"[{self.label}] {stage} ...", flush=True)
        rc, text, wall = run(cmd, self.timeout, {**self.env, **(env or {})})
        self.walls[stage] = round(wall, 2)
        (self.work / "logs" / f"{stage}.log").write_text(" ".join(map(shlex.quote, cmd)) + "\n\n" + text)
        print(f"[{self.label}] {stage}: {'ok' if rc == 0 else f'exit {rc}'} in {wall:.1f} s", flush=True)
        if rc != 0:
            lines = [ln for ln in text.strip().splitlines() if ln.strip()]
            why = next((ln for ln in reversed(lines) if "error" in ln.lower()), lines[-1] if lines else "")
            raise StageError(stage, f"exit status {rc}: {why.strip()[:400]}")
        return text

    def python(self, stage: str, fn, *args):
        print(f"[{self.label}] {stage} ...", flush=True)
        t0 = time.perf_counter()
        try:
            return fn(*args)
        except StageError:
            raise
        except Exception as e:  # noqa: BLE001 - one failing stage ends the case, reported
            raise StageError(stage, f"{type(e).__name__}: {e}"[:400]) from e
        finally:
            self.walls[stage] = round(time.perf_counter() - t0, 2)
            print(f"[{self.label}] {stage}: {self.walls[stage]:.1f} s", flush=True)


# ---------------------------------------------------------------------------------- alpha-beta
def probe(devices: str, work: Path, timeout: float, env: dict[str, str]) -> dict:
    """Latency and bandwidth of this machine's link: a 2-rank all-reduce (plain torchrun) at two
    sizes, median of 20 calls each; t = alpha + S / bw by least squares (a 2-rank ring all-reduce moves S)."""
    from prismllm.launch import NVLS_OFF_ENV

    sizes = PROBE_SIZES[devices]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        COLLECTIVES,
        "--sizes",
        sizes,
        "--warmup",
        "5",
        "--iters",
        "20",
        "--mem-factor",
        "0",
        "--backend",
        "nccl" if devices == "cuda" else "gloo",
    ]
    penv = {**env, **NVLS_OFF_ENV}
    if devices == "cpu":
        penv["CUDA_VISIBLE_DEVICES"] = ""
    print("[probe] 2-rank all-reduce at " + sizes + " ...", flush=True)
    rc, text, wall = run(cmd, timeout, penv)
    (work / "probe.log").write_text(" ".join(cmd) + "\n\n" + text)
    pts = [json.loads(ln.split(" ", 1)[1]) for ln in text.splitlines() if ln.startswith("COLLECTIVE ")]
    if rc != 0 or len(pts) < 2:
        last = (text.strip().splitlines() or [""])[-1]
        raise StageError("probe", f"exit status {rc}, {len(pts)} sizes measured: {last[:300]}")
    res = {**fit_alpha_beta(pts), "backend": pts[0]["backend"], "wall_s": round(wall, 2), "points": pts}
    alpha, bw = res["alpha_s"], res["bandwidth_Bps"]
    print(f"[probe] alpha {alpha * 1e6:.1f} us, bandwidth {bw / 1e9:.3f} GB/s ({wall:.1f} s)", flush=True)
    return res


def fit_alpha_beta(points: list[dict]) -> dict:
    """alpha (s) and bandwidth (bytes/s): the least-squares line t = alpha + S / bw through every
    size's median (``bytes``, ``median_us`` of collective_sizes.py lines); with two sizes, the
    line through both. A slope that is not positive (noise) gives an infinite bandwidth; a
    negative intercept an alpha of 0."""
    pts = sorted((int(p["bytes"]), float(p["median_us"]) * 1e-6) for p in points)
    n = len(pts)
    ms = sum(x for x, _ in pts) / n
    mt = sum(t for _, t in pts) / n
    var = sum((x - ms) ** 2 for x, _ in pts)
    slope = sum((x - ms) * (t - mt) for x, t in pts) / var if var > 0 else 0.0
    bw = 1.0 / slope if slope > 0 else float("inf")
    return {
        "sizes_bytes": [x for x, _ in pts],
        "median_s": [t for _, t in pts],
        "alpha_s": max(mt - slope * ms if slope > 0 else min(t for _, t in pts), 0.0),
        "bandwidth_Bps": bw,
    }


def alpha_beta_transfer(graph, trace, alpha_s: float, bw: float):
    """Per instance of a ReplayGraph: alpha + factor(op, n) * S / bw, in ns (0 for groups of 1)."""
    import numpy as np

    from prismllm.replay import INST_P2P

    ib = trace.column("in_bytes").astype(np.int64)[graph.row]
    ob = trace.column("out_bytes").astype(np.int64)[graph.row]
    ni = graph.num_instances
    if not ni:
        return np.zeros(0, dtype=np.int64)
    b = np.maximum(ib, ob)[graph.inst_nodes]
    size = np.maximum.reduceat(b, graph.inst_ptr[:-1])
    n = graph.group_size[graph.inst_group]
    ops = [graph.op_names[c] for c in graph.inst_op]
    p2p = graph.inst_kind == INST_P2P
    factor = np.array(
        [P2P_FACTOR if p else FACTORS.get(op, lambda k: P2P_FACTOR)(int(k)) for op, k, p in zip(ops, n, p2p)],
        dtype=float,
    )
    t = alpha_s + factor * size / bw
    t = np.where(p2p | (n > 1), t, 0.0)
    return np.rint(t * 1e9).astype(np.int64)


def pure_model(structure: Path, durations: Path, ab: dict, sandbox: list[int], warmup: int) -> dict:
    """Baseline (a): STRUCTURE solved with DURATIONS' compute spans and issue gaps (a graph of
    the same structure: the solo capture or the timed graph) and alpha-beta transfers."""
    import numpy as np

    from prismllm.replay import Replay, ReplayGraph
    from prismllm.replay.durations import check_same_structure, issue_gaps, measured
    from prismllm.trace.graph import PrismTrace

    trace = PrismTrace.load(structure)
    g = ReplayGraph(trace)
    if Path(durations).resolve() == Path(structure).resolve():
        m = measured(trace, g.row)
    else:
        other = PrismTrace.load(durations)
        rows = other.program_order()
        check_same_structure(g, other, rows, (str(structure), str(durations)))
        m = measured(other, rows)
    compute = np.where(g.is_comm, 0, np.maximum(m.duration_ns, 0)).astype(np.int64)
    transfer = alpha_beta_transfer(g, trace, ab["alpha_s"], ab["bandwidth_Bps"])
    res = Replay(g, compute=compute, transfer=transfer, issue=issue_gaps(g, m.start_ns)).run_to_end()
    per = {int(r): [int(x) for x in res.rank_iteration_ns[i]] for i, r in enumerate(g.ranks)}
    return {
        "rank_iteration_ns": {str(r): per[r] for r in sandbox},
        "rank_ns": {str(r): steady_median(per[r], warmup) for r in sandbox},
        "job_ns": steady_median([int(x) for x in res.iteration_ns], warmup),
        "unknown_compute": int((~g.is_comm & (m.duration_ns < 0)).sum()),
        "transfer_total_ms_per_iteration": round(float(transfer.sum()) / 1e6 / max(1, len(g.iterations)), 3),
    }


# ---------------------------------------------------------------------------------- one case
def launch_devices(opts, procs: int) -> str:
    """``--devices`` of a prism launch of ``procs`` processes: cpu, cuda (a GPU each), or with
    --shared-gpu every process on the first visible GPU, each NCCL's own host."""
    if opts.devices == "cuda" and opts.shared_gpu:
        return "cuda:" + ",".join(["0"] * procs)
    return opts.devices


def run_case(case: Case, opts, ab: dict | None, base: Path) -> dict:
    n, dev = case.world, opts.devices
    label = f"{case.name} N={n}"
    work = base / f"{case.name}-n{n}"
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    sizes = shlex.split(opts.model_args) if opts.model_args else SIZES[dev]
    args = case.args(sizes, opts.iters, opts.micro_batches)
    sandbox = sandbox_ranks(opts.sandbox, n, dev, opts.gpus, opts.shared_gpu)
    sb = ",".join(map(str, sandbox))
    # MoE routes on the values: always the recorded ones. Dense: "auto" records them on the CPU
    # (the sandbox then computes the real run's numbers: its losses are checked) and generates
    # zeros on GPUs (fine for dense timing; spares a tensor-saving run of GBs and device time)
    inputs = (
        "recorded"
        if case.moe
        else opts.inputs
        if opts.inputs != "auto"
        else ("generated" if dev == "cuda" else "recorded")
    )
    res: dict[str, Any] = {
        "case": case.name,
        "world": n,
        "layout": case.title,
        "devices": dev,
        "sandbox": sandbox,
        "gpt3d_args": args,
        "bare_graph": "real recording saving tensors (MoE routes on values: its structure and tensors)"
        if case.moe
        else f"solo capture (--layout {case.hint})",
        "inputs": inputs,
        "error": None,
        "failed_stage": None,
        "stage_wall_s": {},
        "noise": bool(opts.noise),
        "repeats": opts.repeats,
    }
    R = Runner(label, work, opts.timeout, opts.env)
    res["stage_wall_s"] = R.walls
    prog = ["--", GPT3D, *args]
    real, saved, bare = work / "real", work / "real-tensors", work / "bare"
    timed, cal = work / "time", work / "cal"

    def real_run(stage: str, out: Path) -> tuple[dict, str]:
        """`prism record` of the program into ``out``: the sandbox ranks' iteration and compute
        times and the job's (medians of the steady iterations), and the command's output."""
        text = R.cmd(
            stage, [*PRISM, "record", "--nproc", str(n), "--devices", launch_devices(opts, n), "--out", str(out), *prog]
        )
        trace = load(out)
        per, comp = per_rank_iterations(trace), per_rank_compute(trace)
        job = job_iterations(per)
        return {
            "rank_iteration_ns": {str(r): per.get(r, []) for r in sandbox},
            "rank_ns": {str(r): steady_median(per.get(r, []), opts.warmup) for r in sandbox},
            "rank_compute_ns": {str(r): steady_median(comp.get(r, []), opts.warmup) for r in sandbox},
            "job_iteration_ns": job,
            "job_ns": steady_median(job, opts.warmup),
        }, text

    try:
        # 1. the real run: the reference (timing and memory), recorded without saving tensors
        # (saving copies every selected buffer to the host synchronously: not a timing run)
        timing, text = real_run("record", real)
        peaks = json.loads((real / "manifest.json").read_text()).get("peak_memory_bytes") or {}
        pr = printed(text)
        res["real"] = {
            **timing,
            "printed_iter_time_ms": pr["iter_time_ms"],
            "printed_ms": steady_median(pr["iter_time_ms"], opts.warmup),
            "peak_memory_bytes": {str(r): int(peaks.get(str(r), -1)) for r in sandbox},
        }
        # ... and the same command again saving every collective's inputs and outputs: the
        # virtual ranks' inputs (and MoE's bare graph); its timings are never read
        losses_ref = pr["losses"]
        if inputs == "recorded":
            text = R.cmd(
                "record_tensors",
                [
                    *PRISM,
                    "record",
                    "--nproc",
                    str(n),
                    "--devices",
                    launch_devices(opts, n),
                    "--out",
                    str(saved),
                    "--save-tensors",
                    "all,inputs",
                    *prog,
                ],
            )
            losses_ref = printed(text)["losses"]
        tensors = saved / "tensors"
        # 2. the bare graph
        if case.moe:
            graph_b = saved
        else:
            cap_dev = str(min(n, opts.gpus)) if dev == "cuda" else str(min(n, max(2, (os.cpu_count() or 2) // 2), 8))
            R.cmd(
                "capture",
                [
                    *PRISM,
                    "capture",
                    "--mode",
                    "solo",
                    "--world",
                    str(n),
                    "--devices",
                    dev,
                    "--parallel",
                    cap_dev,
                    "--layout",
                    case.hint,
                    "--out",
                    str(bare),
                    *prog,
                ],
            )
            graph_b = bare
        # 3. slice timing, 4. calibration
        tcmd = (
            [
                *PRISM,
                "time",
                "--graph",
                str(graph_b),
                "--out",
                str(timed),
                "--devices",
                launch_devices(opts, 2),
                "--inputs",
                inputs,
                "--parallel",
                str(opts.time_parallel),
            ]
            + (["--every-rank"] if opts.time_every_rank else [])
            + (["--compute-under-load"] if opts.compute_under_load else [])
        )
        if inputs == "recorded":
            tcmd += ["--tensors", str(tensors)]
        R.cmd("time", [*tcmd, *prog])
        text = R.cmd(
            "calibrate",
            [*PRISM, "calibrate", str(timed / "graph"), "--out", str(cal), "--write-graph", "--force", "--json"],
        )
        summary = json.loads((cal / "summary.json").read_text())
        cal_rank = per_rank_iterations(load(cal / "graph"))
        cal_job = [it.get("predicted_ns") for it in summary.get("iterations", [])]
        res["calibrated"] = {
            "rank_ns": {str(r): steady_median(cal_rank.get(r, []), opts.warmup) for r in sandbox},
            "job_ns": steady_median(cal_job, opts.warmup),
            "job_iteration_ns": cal_job,
            "timed_graph_job_ns": summary.get("recorded_iteration_ns"),
            "summary_predicted_iteration_ns": summary.get("predicted_iteration_ns"),
        }

        # 5. emulation (real-time replay), 6. baseline (b): fast replay
        def emulate(stage: str, timing: str, out: Path) -> dict:
            cmd = [
                *PRISM,
                "emulate",
                "--graph",
                str(cal / "graph"),
                "--sandbox",
                sb,
                "--out",
                str(out),
                "--devices",
                launch_devices(opts, len(sandbox) + 1),
                "--timing",
                timing,
                "--inputs",
                inputs,
            ]
            if inputs == "recorded":
                cmd += ["--tensors", str(tensors)]
            text = R.cmd(stage, [*cmd, *prog])
            emu = json.loads((out / "emulate.json").read_text())
            sr = emu.get("sandbox_results") or {}
            pr_e = printed(text)
            d = {
                "timing": emu.get("timing"),
                "rank_iteration_ns": {str(r): (sr.get(str(r)) or {}).get("iteration_ns", []) for r in sandbox},
                "peak_memory_bytes": {
                    # -1: not measured (null in emulate.json), as in the real run's column
                    str(r): -1 if (b := (sr.get(str(r)) or {}).get("peak_memory_bytes")) is None else int(b)
                    for r in sandbox
                },
                "rank_compute_ns": {
                    # null on a GPU (the emulation times its iterations on the device, not its spans)
                    str(r): steady_median((sr.get(str(r)) or {}).get("compute_ns") or [], opts.warmup)
                    for r in sandbox
                },
                "virtual_ranks_ns": (emu.get("replay") or {}).get("median_steady_iteration_ns"),
                "printed_iter_time_ms": pr_e["iter_time_ms"],
            }
            d["rank_ns"] = {r: steady_median(v, opts.warmup) for r, v in d["rank_iteration_ns"].items()}
            if n - 1 in sandbox and inputs == "recorded":  # the reporting rank against the run it replays
                d["losses_equal_recorded"] = bool(pr_e["losses"]) and pr_e["losses"] == losses_ref
                # where the sum's order differs (a pruned DP group of more than two), how far apart
                d["losses_max_rel_diff"] = loss_gap(pr_e["losses"], losses_ref)
            return d

        res["emulated"] = emulate("emulate", "real", work / "emu")
        res["baseline_b"] = emulate("emulate_fast", "fast", work / "emu-fast")
        # 7. baseline (a): the pure model
        if ab is None and not opts.shared_gpu:
            raise StageError("pure_model", "no alpha-beta fit (the probe failed)")
        if ab is not None:  # --shared-gpu: no link to fit, no time to compare with
            src = (timed / "graph") if case.moe else bare
            res["baseline_a"] = R.python("pure_model", pure_model, graph_b, src, ab, sandbox, opts.warmup)
            res["baseline_a"]["compute_from"] = "timed graph (slices)" if case.moe else "solo capture"
            res["baseline_a"]["alpha_beta"] = {k: ab.get(k) for k in ("alpha_s", "bandwidth_Bps", "backend")}
        # 8. baseline (c): fake process group (GPU memory only)
        if dev == "cuda":
            fake = {}
            for r in sandbox:
                try:
                    text = R.cmd(
                        f"fake_pg_rank{r}",
                        [sys.executable, FAKE_PG, "--rank", str(r), "--world", str(n), "--", GPT3D, *args],
                        env={"CUDA_VISIBLE_DEVICES": opts.first_gpu},
                    )
                except StageError as e:
                    text = str(e)
                line = next((ln for ln in text.splitlines() if ln.startswith("FAKEPG ")), None)
                fake[str(r)] = (
                    json.loads(line.split(" ", 1)[1]) if line else {"error": text[-300:], "peak_memory_bytes": -1}
                )
            R.walls["fake_pg"] = round(sum(v for k, v in R.walls.items() if k.startswith("fake_pg_rank")), 2)
            res["baseline_c"] = {"per_rank": fake}
        else:
            res["baseline_c"] = {"per_rank": {}, "note": "n/a on CPU (no device memory)"}
        # --repeats: the real run and the emulation again, alternating, so that both medians
        # are taken over runs spread across the same minutes (the host's drift hits both)
        real_fields, emu_fields = ("rank_ns", "job_ns", "rank_compute_ns"), ("rank_ns", "rank_compute_ns")
        res["real"]["runs"] = [{f: res["real"][f] for f in real_fields}]
        res["emulated"]["runs"] = [{f: res["emulated"][f] for f in emu_fields}]
        for k in range(2, opts.repeats + 1):
            timing, _ = real_run(f"record_{k}", work / f"real-{k}")
            res["real"]["runs"].append({f: timing[f] for f in real_fields})
            timing = emulate(f"emulate_{k}", "real", work / f"emu-{k}")
            res["emulated"]["runs"].append({f: timing[f] for f in emu_fields})
            shutil.rmtree(work / f"real-{k}", ignore_errors=True)
            shutil.rmtree(work / f"emu-{k}", ignore_errors=True)
        # the noise floor: the real run once more, last
        if opts.noise:
            res["real_again"], _ = real_run("record_again", work / "real-again")
    except StageError as e:
        res["error"], res["failed_stage"] = str(e), e.stage
        print(f"[{label}] FAILED at {e}", flush=True)
    except Exception as e:  # noqa: BLE001 - a harness bug in one case must not end the others
        res["error"], res["failed_stage"] = f"harness: {type(e).__name__}: {e}", "harness"
        print(f"[{label}] FAILED (harness): {e!r}", flush=True)
    if not opts.keep:  # tensor stores of GPU runs take GBs: one case at a time on disk
        shutil.rmtree(work, ignore_errors=True)
    res["rows"] = rows(res)
    res["total_wall_s"] = round(sum(v for k, v in R.walls.items() if not k.startswith("fake_pg_rank")), 2)
    return res


def _mem(d: dict | None, r: str) -> int | None:
    v = (d or {}).get("peak_memory_bytes", {}).get(r) if d else None
    return v if isinstance(v, int) else None


def rows(res: dict) -> list[dict]:
    """One row per sandbox rank: the table's columns (None: not measured because a stage failed;
    "n/a": not applicable, e.g. device memory on CPU)."""
    out = []
    cpu = res["devices"] == "cpu"
    for r in (str(x) for x in res["sandbox"]):
        real = res.get("real") or {}
        get = lambda key, sub="rank_ns": ((res.get(key) or {}).get(sub) or {}).get(r)  # noqa: E731
        real_runs, emu_runs = runs_of(res, "real", r), runs_of(res, "emulated", r)

        def of_runs(key: str, field: str = "rank_ns") -> float | None:
            """One run: its own figure; --repeats K: the median of the K runs."""
            each = runs_of(res, key, r, field)
            return statistics.median(each) if each else get(key, field)

        ref, emu = of_runs("real"), of_runs("emulated")
        comp = {key: of_runs(key, "rank_compute_ns") for key in ("real", "emulated")}
        jobs = [x["job_ns"] for x in real.get("runs") or [] if x.get("job_ns") is not None]
        ref_job = statistics.median(jobs) if jobs else real.get("job_ns")
        fast, pred, pure = get("baseline_b"), get("calibrated"), get("baseline_a")
        pred_job = (res.get("calibrated") or {}).get("job_ns")
        pure_job = (res.get("baseline_a") or {}).get("job_ns")
        row = {
            "case": res["case"],
            "world": res["world"],
            "layout": res["layout"],
            "devices": res["devices"],
            "sandbox_rank": int(r),
            "bare_graph": "record" if res["case"] == "moe" else "solo",
            "real_ms": ms(ref),
            "emulated_ms": ms(emu),
            "emulated_err": rel(emu, ref),
            "predicted_ms": ms(pred),
            "predicted_err": rel(pred, ref),
            "real_job_ms": ms(ref_job),
            "predicted_job_ms": ms(pred_job),
            "predicted_job_err": rel(pred_job, ref_job),
            "baseline_a_ms": ms(pure),
            "baseline_a_err": rel(pure, ref),
            "baseline_a_job_ms": ms(pure_job),
            "baseline_a_job_err": rel(pure_job, ref_job),
            "baseline_b_ms": ms(fast),
            "baseline_b_err": rel(fast, ref),
            "real_compute_ms": ms(comp["real"]),
            "emulated_compute_ms": ms(comp["emulated"]),
            "emulated_compute_err": rel(comp["emulated"], comp["real"]),
        }
        if len(real_runs) > 1 or len(emu_runs) > 1:
            row.update(
                real_runs_ms=[ms(x) for x in real_runs],
                emulated_runs_ms=[ms(x) for x in emu_runs],
                real_spread=spread(real_runs),
                emulated_spread=spread(emu_runs),
            )
        if "real_again" in res or res.get("noise"):
            again = get("real_again")
            row.update(real_again_ms=ms(again), real_again_err=rel(again, ref))
        if cpu:
            row.update(
                peak_real="n/a",
                peak_emulated="n/a",
                peak_emulated_diff="n/a",
                peak_emulated_rel="n/a",
                peak_fake_pg="n/a",
                peak_fake_pg_diff="n/a",
                peak_fake_pg_rel="n/a",
            )
        else:
            pr, pe = _mem(res.get("real"), r), _mem(res.get("emulated"), r)
            fk = ((res.get("baseline_c") or {}).get("per_rank") or {}).get(r) or {}
            pf = (
                fk.get("peak_memory_bytes")
                if isinstance(fk.get("peak_memory_bytes"), int) and fk.get("peak_memory_bytes", -1) >= 0
                else None
            )
            diff = lambda x: None if x is None or pr is None else x - pr  # noqa: E731
            row.update(
                peak_real=pr,
                peak_emulated=pe,
                peak_emulated_diff=diff(pe),
                peak_emulated_rel=rel(pe, pr),
                peak_fake_pg=pf
                if pf is not None
                else (("failed: " + str(fk.get("error"))[:120]) if fk.get("error") else None),
                peak_fake_pg_diff=diff(pf),
                peak_fake_pg_rel=rel(pf, pr),
            )
        row["error"] = res.get("error")
        out.append(row)
    return out


def runs_of(res: dict, key: str, r: str, field: str = "rank_ns") -> list[float]:
    """Rank ``r``'s ``field`` (iteration or compute time) in each run of ``key`` (real / emulated)
    that measured it."""
    return [
        x for x in (((run.get(field) or {}).get(r)) for run in (res.get(key) or {}).get("runs") or []) if x is not None
    ]


def spread(values: list[float]) -> float | None:
    """(max - min) / median: how far apart repeated runs of one command landed."""
    return (max(values) - min(values)) / statistics.median(values) if len(values) > 1 else None


def ms(ns: float | None) -> float | None:
    return None if ns is None else round(ns / 1e6, 3)


# ---------------------------------------------------------------------------------- output
def _f(x, fmt="{:.2f}") -> str:
    return "–" if x is None else x if isinstance(x, str) else fmt.format(x)


def _pct(x) -> str:
    return "–" if x is None else x if isinstance(x, str) else f"{x * 100:+.1f}%"


def _bytes(x) -> str:
    return "–" if x is None else x if isinstance(x, str) else f"{x:,}"


def _diff(d, r) -> str:
    if d is None or isinstance(d, str):
        return _bytes(d)
    return f"{d:+,}" + (f" ({r * 100:+.2f}%)" if isinstance(r, float) else "")


def fake_cell(row: dict) -> str:
    """Fake PG's difference from the real peak, or why there is none (its failure)."""
    if row["peak_fake_pg_diff"] is None and isinstance(row["peak_fake_pg"], str):
        return row["peak_fake_pg"].replace("|", "/")
    return _diff(row["peak_fake_pg_diff"], row["peak_fake_pg_rel"])


def markdown(result: dict) -> str:
    m = result["machine"]
    ab = result.get("alpha_beta") or {}
    noise = any(c.get("noise") for c in result["cases"])
    reps = max((c.get("repeats", 1) for c in result["cases"]), default=1)
    runs = lambda row, k: (  # noqa: E731
        ", ".join(_f(x, "{:.1f}") for x in row.get(k + "_runs_ms") or []) + f" ({_pct(row.get(k + '_spread'))})"
    )
    lines = [
        f"Machine: {m.get('gpu') or 'CPU'}{' ×' + str(m['gpus']) if m.get('gpus') else ''}, {m.get('cpus')} cores, "
        f"torch {m.get('torch')}, {result['date']}, commit {result['commit']}; devices {result['devices']}; "
        f"{result['iters']} iterations, steady = all but the first {result['warmup']}",
        *(
            [
                "**One GPU shared by every process (--shared-gpu)**: NCCL talks through sockets, so the time "
                "columns are no fidelity figures; the memory columns are."
            ]
            if result.get("shared_gpu")
            else []
        ),
        f"Alpha-beta fit (2-rank all-reduce, {ab.get('backend', '?')}): alpha "
        f"{_f(ab.get('alpha_s') and ab['alpha_s'] * 1e6, '{:.1f}')} µs, bandwidth "
        f"{_f(ab.get('bandwidth_Bps') and ab['bandwidth_Bps'] / 1e9, '{:.3f}')} GB/s"
        if ab
        else "Alpha-beta fit: none (--shared-gpu), no baseline (a)"
        if result.get("shared_gpu")
        else "Alpha-beta fit: failed (no baseline (a))",
        "",
        "Per sandbox rank (iteration time: median of the steady iterations of that rank; errors against the real run"
        + (
            f"; real and emulated: the median of {reps} runs each, alternating, their spread in the last columns):"
            if reps > 1
            else "):"
        ),
        "",
        "| case | N | layout | sandbox rank | real ms | emulated ms (err) | calibrated prediction ms (err) "
        "| (a) pure model ms (err) | (b) fast replay ms (err) | peak mem real (bytes) | emulated (diff) "
        "| (c) fake PG (diff) | compute ms real → emulated (diff) |"
        + (" real again ms (noise) |" if noise else "")
        + (" real runs ms (spread) | emulated runs ms (spread) |" if reps > 1 else ""),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
        + ("---|" if noise else "")
        + ("---|---|" if reps > 1 else ""),
    ]
    for c in result["cases"]:
        for row in c["rows"]:
            if row["real_ms"] is None and c.get("error"):
                lines.append(
                    f"| {c['case']} | {c['world']} | {c['layout']} | {row['sandbox_rank']} | failed: "
                    f"{c['error'][:160]} | | | | | | | | |" + (" |" if noise else "") + (" | |" if reps > 1 else "")
                )
                continue
            cell = lambda k: f"{_f(row.get(k + '_ms'))} ({_pct(row.get(k + '_err'))})"  # noqa: E731
            lines.append(
                f"| {c['case']} | {c['world']} | {c['layout']} | {row['sandbox_rank']} | {_f(row['real_ms'])} "
                f"| {cell('emulated')} | {cell('predicted')} | {cell('baseline_a')} | {cell('baseline_b')} "
                f"| {_bytes(row['peak_real'])} | {_diff(row['peak_emulated_diff'], row['peak_emulated_rel'])} "
                f"| {fake_cell(row)} | {_f(row.get('real_compute_ms'))} → {_f(row.get('emulated_compute_ms'))} "
                f"({_pct(row.get('emulated_compute_err'))}) |"
                + (f" {cell('real_again')} |" if noise else "")
                + (f" {runs(row, 'real')} | {runs(row, 'emulated')} |" if reps > 1 else "")
            )
    lines += [
        "",
        "Whole job (iteration time: per iteration the slowest rank, median of the steady ones):",
        "",
        "| case | N | layout | real ms | calibrated prediction ms (err) | (a) pure model ms (err) "
        "| (a) compute from | bare graph | stage wall s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in result["cases"]:
        r0 = c["rows"][0] if c["rows"] else {}
        walls = ", ".join(f"{k} {v:.0f}" for k, v in c["stage_wall_s"].items() if not k.startswith("fake_pg_rank"))
        lines.append(
            f"| {c['case']} | {c['world']} | {c['layout']} | {_f(r0.get('real_job_ms'))} "
            f"| {_f(r0.get('predicted_job_ms'))} ({_pct(r0.get('predicted_job_err'))}) "
            f"| {_f(r0.get('baseline_a_job_ms'))} ({_pct(r0.get('baseline_a_job_err'))}) "
            f"| {(c.get('baseline_a') or {}).get('compute_from', '–')} | {'record' if c['case'] == 'moe' else 'solo'} "
            f"| {walls} |"
        )
    failed = [c for c in result["cases"] if c.get("error")]
    if failed:
        lines += ["", "Failed cases (columns after the failed stage are empty):", ""]
        lines += [f"- {c['case']} N={c['world']}: {c['error']}" for c in failed]
    if result.get("skipped"):
        lines += [
            "",
            "Not run (the world size does not allow the layout): "
            + "; ".join(f"{s['case']} N={s['world']}: {s['why']}" for s in result["skipped"]),
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--worlds", default="8,16,32", help="comma list of N")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma list of {', '.join(CASES)}")
    ap.add_argument("--iters", type=int, default=None, help="training iterations (default 10)")
    ap.add_argument("--warmup", type=int, default=1, help="leading iterations left out of every median")
    ap.add_argument("--sandbox", default="auto", help="auto, last, or ranks such as 0,last")
    ap.add_argument(
        "--inputs",
        choices=["auto", "recorded", "generated"],
        default="auto",
        help="virtual ranks' inputs in time and emulate: recorded (a tensor-saving run of the real "
        "command), generated (zeros), auto (recorded on cpu, generated on cuda); MoE: always recorded",
    )
    ap.add_argument("--model-args", default=None, help="gpt3d size flags replacing the defaults for --devices")
    ap.add_argument(
        "--micro-batches",
        type=int,
        default=None,
        help="micro-batches per DP rank and iteration (default max(4, 2 x pipeline stages))",
    )
    ap.add_argument("--time-parallel", type=int, default=1, help="`prism time --parallel` (slices at a time)")
    ap.add_argument("--time-every-rank", action="store_true", help="`prism time --every-rank` (DP replicas timed too)")
    ap.add_argument("--compute-under-load", action="store_true", help="`prism time --compute-under-load` (CPU)")
    ap.add_argument(
        "--noise",
        action="store_true",
        help="record the real run once more at the end of each case: its difference from the first "
        "is the noise floor of the errors",
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        metavar="K",
        help="run the real job and the emulation K times each, alternating, and compare their "
        "medians (each run's figure and the spread are kept): for hosts whose runs drift",
    )
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per stage")
    ap.add_argument(
        "--alpha-beta",
        default=None,
        metavar="ALPHA_S,BW_BPS",
        help="skip the probe: latency (s) and bandwidth (bytes/s) of the pure model",
    )
    ap.add_argument("--json", default=None)
    ap.add_argument("--md", default=None, help="markdown table (default: the JSON path with .md)")
    ap.add_argument(
        "--merge",
        action="store_true",
        help="add to the cases of an existing --json (a case and N run again replace theirs): split a "
        "long suite over several invocations",
    )
    ap.add_argument(
        "--shared-gpu",
        action="store_true",
        help="cuda: every process (real ranks, sandbox, assistant) on the first visible GPU, each NCCL's "
        "own host: for the memory columns on a one-GPU machine (times then go through sockets)",
    )
    ap.add_argument("--keep", default=None, help="keep every stage's output (graphs, logs) in this directory")
    a = ap.parse_args(argv)
    a.iters = a.iters or 10
    if a.iters <= a.warmup:
        ap.error("--iters must exceed --warmup")
    if a.repeats < 1:
        ap.error("--repeats must be at least 1")
    names = [c.strip() for c in a.cases.split(",") if c.strip()]
    bad = [c for c in names if c not in CASES]
    if bad:
        ap.error(f"unknown case(s) {', '.join(bad)}; cases: {', '.join(CASES)}")
    worlds = [int(w) for w in a.worlds.split(",") if w.strip()]
    a.env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONUNBUFFERED": "1"}
    a.gpus, a.first_gpu = 0, "0"
    if a.devices == "cuda":
        import torch

        a.gpus = torch.cuda.device_count()
        vis = os.environ.get("CUDA_VISIBLE_DEVICES")
        a.first_gpu = vis.split(",")[0] if vis else "0"
        if a.gpus < 1:
            ap.error("--devices cuda: no GPU visible")
        if a.gpus < 2 and not a.shared_gpu:
            ap.error("--devices cuda needs 2 GPUs or more (a sandbox GPU and an assistant GPU), or --shared-gpu")
    else:
        if a.shared_gpu:
            ap.error("--shared-gpu is for --devices cuda")
        a.env["CUDA_VISIBLE_DEVICES"] = ""
    plan, skipped = [], []
    for n in worlds:
        for name in names:
            c = make_case(name, n)
            if isinstance(c, str):
                skipped.append({"case": name, "world": n, "why": c})
            elif a.devices == "cuda" and n > a.gpus and not a.shared_gpu:
                skipped.append({"case": name, "world": n, "why": f"the real run needs {n} GPUs, {a.gpus} visible"})
            else:
                plan.append(c)
    json_path = Path(a.json or ROOT / "benchmarks" / "results" / f"fidelity_{a.devices}.json")
    md_path = Path(a.md) if a.md else json_path.with_suffix(".md")
    result = {
        "benchmark": "fidelity",
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
        "commit": git_commit(),
        "devices": a.devices,
        "iters": a.iters,
        "warmup": a.warmup,
        "sandbox": a.sandbox,
        "inputs": a.inputs,
        "noise": a.noise,
        "repeats": a.repeats,
        "shared_gpu": a.shared_gpu,
        "model_args": shlex.split(a.model_args) if a.model_args else SIZES[a.devices],
        "argv": sys.argv[1:] if argv is None else argv,
        "alpha_beta": None,
        "cases": [],
        "skipped": skipped,
    }

    earlier: list[dict] = []
    if a.merge and json_path.is_file():
        old = json.loads(json_path.read_text())
        if old.get("devices") != a.devices:
            ap.error(f"--merge: {json_path} holds --devices {old.get('devices')} results")
        redo = {(c.name, c.world) for c in plan}
        earlier = [c for c in old.get("cases", []) if (c["case"], c["world"]) not in redo]
        result["invocations"] = [
            *old.get("invocations", [{k: old.get(k) for k in ("date", "commit", "argv", "alpha_beta")}]),
            {k: result[k] for k in ("date", "commit", "argv")},
        ]

    def write() -> None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=1) + "\n")
        md_path.parent.mkdir(parents=True, exist_ok=True)
        md_path.write_text(markdown(result))

    base = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="prism-fidelity-"))
    base.mkdir(parents=True, exist_ok=True)
    try:
        if a.shared_gpu and not a.alpha_beta:
            print("[probe] skipped (--shared-gpu: one GPU, no link to fit); no baseline (a)", flush=True)
        elif a.alpha_beta:
            al, bw = (float(x) for x in a.alpha_beta.split(","))
            result["alpha_beta"] = {"alpha_s": al, "bandwidth_Bps": bw, "backend": "given (--alpha-beta)"}
        else:
            t0 = time.perf_counter()
            try:
                result["alpha_beta"] = probe(a.devices, base, a.timeout, a.env)
            except StageError as e:
                print(f"[probe] FAILED: {e}; baseline (a) will be missing", flush=True)
                result["alpha_beta_error"] = str(e)
            result["probe_wall_s"] = round(time.perf_counter() - t0, 2)
        write()
        result["cases"] = list(earlier)
        for c in plan:
            result["cases"].append(run_case(c, a, result["alpha_beta"], base))
            result["cases"].sort(key=lambda x: (x["world"], CASES.index(x["case"])))
            write()
    finally:
        if not a.keep:
            shutil.rmtree(base, ignore_errors=True)
    print(markdown(result))
    print(f"wrote {json_path} and {md_path}")
    return 0 if all(not c.get("error") for c in result["cases"]) else 1


if __name__ == "__main__":
    sys.exit(main())
