"""Pruning latency: all-reduce latency of a pruned collective (one real member, one proxy)
against the real thing, from 16 MB to 8 GB (issue 12).

    python benchmarks/pruning_latency.py --devices cpu|cuda [--sizes 16MB,...,8GB]
        [--sizes-many 16MB,256MB,1GB] [--worlds 2,16,32,64,128] [--vanilla-max N]
        [--warmup 3] [--iters 10] [--real record|torchrun] [--timeout S]
        [--json benchmarks/results/pruning_latency_<machine>.json] [--md PATH]

The workload is benchmarks/programs/allreduce_sizes.py (a plain torch.distributed program):
per size, warm-up all-reduces then ``--iters`` timed ones, each timed on the device (CUDA
events) or by the wall clock (gloo), median/min/mean over the calls, printed by rank 0.

Case A, 2 logical members (``2`` in ``--worlds``): the real 2-rank run (`prism record --nproc
2`, or plain torchrun with ``--real torchrun``; on GPU one GPU per rank) against the
emulation: `prism capture --mode solo --world 2 --layout tp=1,pp=1` (the bare graph, one rank
run) then `prism emulate --sandbox 0 --inputs generated` (one sandbox device, one assistant
device). Per size: real and emulated latency of rank 0, relative error (target: within 1%).

Case B, N logical members (every other entry of ``--worlds``): the emulation as above with
WORLD_SIZE = N (one sandbox rank, every other rank virtual on one assistant) against the
vanilla way, a real process per rank (on GPU several per device, each told by NCCL_HOSTID that
it is its own host: benchmarks/emulate_bootstrap.py's ``vanilla_run``), for N up to
``--vanilla-max`` or the first failure.

Bytes (computed, not read from counters): per case and size, what the sandbox rank's link
carries on the small group (its one real member plus the proxy) -- the pruned call's buffer
is ``compensate.plan_all_reduce``'s slot (the plan the sandbox issues), per link direction
``2k/(k+1)·slot`` with k = 1 under the ring model -- beside what a rank of the logical ring
sends and receives, ``2(n-1)/n·S`` each way (modelled). Latencies are measured.

Each case (a world size, real or emulated or vanilla) runs independently: a failure is
recorded and the others go on; the JSON and markdown are rewritten after every run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "programs"))

from allreduce_sizes import DEFAULT_SIZES, fits, fmt_size, parse_sizes  # noqa: E402
from emulate_bootstrap import run, vanilla_run  # noqa: E402
from tracing_overhead import machine  # noqa: E402

from prismllm.launch import NVLS_OFF_ENV  # noqa: E402
from prismllm.pruning.plans import plan_all_reduce  # noqa: E402

PROGRAM = str(ROOT / "benchmarks" / "programs" / "allreduce_sizes.py")
PRISM = str(Path(sys.executable).with_name("prism"))
LINE = re.compile(r"^ALLREDUCE (\{.*\})\s*$", re.M)
DEFAULT_MANY = {"cuda": "16MB,256MB,1GB", "cpu": "1MB,4MB"}
DTYPE = torch.float32
GIB = 1 << 30


# ---------------------------------------------------------------------- helpers
def parse(text: str, rank: int = 0) -> dict[int, dict]:
    """The program's per-size lines of ``rank``, by bytes."""
    out = {}
    for m in LINE.finditer(text):
        d = json.loads(m[1])
        if d.get("rank") == rank:
            out[d["bytes"]] = d
    return out


def recorded_us(nodes: list[dict] | dict, sizes: list[int], iters: int) -> dict[int, float]:
    """From rank 0's recorded nodes (a ranklog's node dicts, or a graph's columns): per size,
    the median recorded duration of the last ``iters`` all-reduces of that size (the timed
    ones) -- what the recording layer measured and `prism time` would take."""
    if isinstance(nodes, dict):  # columns
        nodes = [dict(zip(nodes, row)) for row in zip(*nodes.values())]
    by: dict[int, list[float]] = {}
    for n in nodes:
        if n["rank"] == 0 and n["kind"] == "comm" and n["op"] == "all_reduce" and n["in_bytes"] in sizes:
            by.setdefault(n["in_bytes"], []).append(n["duration_ns"] / 1e3)
    out = {}
    for b, d in by.items():
        timed = [x for x in d[-iters:] if x >= 0]
        if timed:
            out[b] = round(statistics.median(timed), 2)
    return out


def pool(rounds: list[dict | None]) -> dict | None:
    """One size's lines from several rounds as one: statistics over every timed call of every
    round, the recorded durations' median over rounds, and each round's median."""
    got = [d for d in rounds if d]
    if not got:
        return None
    if len(got) == 1 and len(rounds) == 1:
        return got[0]
    times = [t for d in got for t in d["times_us"]]
    out = {
        **got[0],
        "median_us": round(statistics.median(times), 2),
        "min_us": min(times),
        "mean_us": round(statistics.fmean(times), 2),
        "max_us": max(times),
        "times_us": times,
        "loop_us": round(statistics.fmean(d["loop_us"] for d in got), 2),
        "round_medians_us": [d["median_us"] for d in got],
        "rounds": len(got),
    }
    rec = [d["recorded_us"] for d in got if "recorded_us" in d]
    if rec:
        out["recorded_us"] = round(statistics.median(rec), 2)
    else:
        out.pop("recorded_us", None)
    return out


def link_bytes(n: int, nbytes: int) -> dict:
    """Bytes on the sandbox rank's link for one all-reduce of ``nbytes`` in a logical group of
    ``n`` with one real member (rank 0) -- the plan's small call -- and in the logical ring."""
    item = torch.empty((), dtype=DTYPE).element_size()
    p = plan_all_reduce(n, [0], (nbytes // item,), "sum", dtype=DTYPE)
    lb = p.bytes[0]
    return {
        "small_group": p.group.size,
        "slot_bytes": p.slot * item,
        "pad_bytes": p.pad * item,
        "scratch_bytes": p.scratch[0],
        "small_send": lb.send,
        "small_recv": lb.recv,
        "logical_send": lb.logical_send,
        "logical_recv": lb.logical_recv,
        "ratio": round(lb.ratio, 6),
    }


def commit() -> str:
    """HEAD of the checkout, '+dirty' if prismllm/ has changes (the assistant's code matters here)."""
    try:
        head = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--", "prismllm"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def device_info(devices: str) -> tuple[int, int]:
    """(bytes of one device, number of devices): GPU memory and count, or host memory and 1."""
    if devices == "cuda":
        return torch.cuda.get_device_properties(0).total_memory, torch.cuda.device_count()
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), 1


class Bench:
    def __init__(self, a: argparse.Namespace, work: Path, worlds: list[int], old: dict | None = None):
        self.a, self.work, self.worlds, self.old = a, work, worlds, old
        self.dev_bytes, self.ndev = device_info(a.devices)
        self.reserve = int(a.reserve_gb * GIB)
        self.res: dict = {
            "benchmark": "pruning_latency",
            "machine": machine(),
            "date": time.strftime("%Y-%m-%d"),
            "devices": a.devices,
            "dtype": str(DTYPE).replace("torch.", ""),
            "warmup": a.warmup,
            "iters": a.iters,
            "real": a.real,
            "rounds": a.rounds,
            "commit": commit(),
            "stage_ahead": os.environ.get("PRISM_STAGE_AHEAD", "default"),
            "measured": "latency: per call, on rank 0's device (CUDA events around each all_reduce "
            "on the current stream) or wall clock (gloo); median/min/mean over --iters calls; "
            "'recorded': the recording layer's duration of the same calls in the run's graph "
            "(NCCL's own events on GPU), median",
            "computed": "bytes: small_* from compensate.plan_all_reduce (the pruned call's buffer, "
            "ring on k+1 = 2 members: 2k/(k+1)*slot each way), logical_* = 2(n-1)/n*S each "
            "way (the logical ring); no link counter is read",
            "two": [],
            "many": [],
            "runs": [],
            "skipped": [],
        }

    # -- memory: decided here, for every variant alike (the program's own check is off) --
    def feasible(self, sizes: list[int], variant: str, n: int) -> list[int]:
        ok = []
        for s in sizes:
            if variant == "emulated":
                lb = link_bytes(n, s)
                # sandbox: tensor + padded scratch; assistant: the proxy's slot, staged twice
                need, ppd = max(s + lb["scratch_bytes"], 2 * lb["slot_bytes"]), (1 if self.a.devices == "cuda" else 2)
            elif variant == "vanilla":
                need, ppd = s, math.ceil(n / self.ndev) if self.a.devices == "cuda" else n
            else:  # real
                need, ppd = s, (1 if self.a.devices == "cuda" else n)
            if fits(need, self.dev_bytes, ppd, 1.0, self.reserve):
                ok.append(s)
            else:
                note = {
                    "variant": variant,
                    "world": n,
                    "bytes": s,
                    "size": fmt_size(s),
                    "needs_bytes": need,
                    "procs_per_device": ppd,
                    "device_bytes": self.dev_bytes,
                }
                self.res["skipped"].append(note)
                print(
                    f"  skip {variant} N={n} {fmt_size(s)}: needs {need / GIB:.1f} GiB of a "
                    f"{self.dev_bytes / GIB:.0f} GiB device shared by {ppd}",
                    flush=True,
                )
        return ok

    def prog_args(self, sizes: list[int]) -> list[str]:
        return [
            "--sizes",
            ",".join(fmt_size(s) for s in sizes),
            "--warmup",
            str(self.a.warmup),
            "--iters",
            str(self.a.iters),
            "--mem-factor",
            "0",
            "--backend",
            "nccl" if self.a.devices == "cuda" else "gloo",
        ]

    def _run(self, label: str, world: int, cmd: list[str], env: dict | None = None) -> tuple[int, str, float]:
        print(f"  {label} ...", flush=True)
        return self._note(label, world, *run(cmd, self.a.timeout + 60, env))

    def _note(self, label: str, world: int, rc: int, text: str, wall: float) -> tuple[int, str, float]:
        print(f"  {label}: exit {rc}, {wall:.1f} s", flush=True)
        rec = {"run": label, "world": world, "rc": rc, "wall_s": round(wall, 2)}
        if rc:
            rec["error"] = text[-2000:]
            print("    " + "\n    ".join(text.strip().splitlines()[-6:]), flush=True)
        self.res["runs"].append(rec)
        return rc, text, wall

    # -- the three ways of running N ranks --
    def real(self, sizes: list[int], label: str = "") -> dict[int, dict]:
        args = self.prog_args(sizes)
        if self.a.real == "record":
            cmd = [
                PRISM,
                "record",
                "--nproc",
                "2",
                "--devices",
                self.a.devices,
                "--out",
                str(self.work / "real2"),
                "--force",
                "--timeout",
                str(self.a.timeout),
                "--",
                PROGRAM,
                *args,
            ]
            env = None
        else:
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                "2",
                PROGRAM,
                *args,
            ]
            env = {"OMP_NUM_THREADS": "1", **NVLS_OFF_ENV}
            if self.a.devices == "cpu":
                env["CUDA_VISIBLE_DEVICES"] = ""
        rc, text, _ = self._run(f"real N=2 ({self.a.real}){label}", 2, cmd, env)
        got = parse(text)
        if self.a.real == "record" and rc == 0:
            try:
                from prismllm.trace.graph import PrismTrace

                cols = (
                    PrismTrace.load(self.work / "real2")
                    .nodes.select(["rank", "kind", "op", "in_bytes", "duration_ns"])
                    .to_pydict()
                )
                for b, us in recorded_us(cols, sizes, self.a.iters).items():
                    if b in got:
                        got[b]["recorded_us"] = us
            except Exception as e:  # noqa: BLE001 -- the latency stands without it
                print(f"    (no recorded durations: {e})", flush=True)
        return got

    def capture(self, n: int, sizes: list[int]) -> Path | None:
        graph = self.work / f"graph{n}"
        rc, _, _ = self._run(
            f"capture N={n}",
            n,
            [
                PRISM,
                "capture",
                "--mode",
                "solo",
                "--world",
                str(n),
                "--devices",
                self.a.devices,
                "--parallel",
                "1",
                "--layout",
                "tp=1,pp=1",
                "--out",
                str(graph),
                "--force",
                "--timeout",
                str(self.a.timeout),
                "--",
                PROGRAM,
                *self.prog_args(sizes),
            ],
        )
        return None if rc else graph

    def emulate(self, n: int, graph: Path, sizes: list[int], label: str = "") -> dict[int, dict]:
        out = self.work / f"emu{n}"
        rc, text, _ = self._run(
            f"emulate N={n}{label}",
            n,
            [
                PRISM,
                "emulate",
                "--graph",
                str(graph),
                "--sandbox",
                "0",
                "--devices",
                self.a.devices,
                "--inputs",
                "generated",
                "--out",
                str(out),
                "--force",
                "--timeout",
                str(self.a.timeout),
                "--",
                PROGRAM,
                *self.prog_args(sizes),
            ],
        )
        m = re.search(r"prism assistant: .*", text)
        if m:
            self.res["runs"][-1]["assistant"] = m[0]
        got = parse(text)
        log = out / "ranklogs" / "rank-000000.msgpack"
        if log.exists():
            try:
                from prismllm.trace.ranklog import read_ranklog

                for b, us in recorded_us(read_ranklog(log).nodes, sizes, self.a.iters).items():
                    if b in got:
                        got[b]["recorded_us"] = us
            except Exception as e:  # noqa: BLE001
                print(f"    (no recorded durations: {e})", flush=True)
        return got

    def emulated(self, n: int, sizes: list[int]) -> dict[int, dict]:
        graph = self.capture(n, sizes)
        return self.emulate(n, graph, sizes) if graph else {}

    def vanilla(self, n: int, sizes: list[int]) -> tuple[dict[int, dict], bool]:
        label = f"vanilla N={n}"
        print(f"  {label} ...", flush=True)
        rc, text, _ = self._note(
            label, n, *vanilla_run(n, self.a.devices, PROGRAM, self.prog_args(sizes), self.a.timeout)
        )
        return parse(text), rc == 0

    # -- cases --
    def case_two(self, sizes: list[int]) -> None:
        print(
            f"case A: 2 logical members, sizes {','.join(map(fmt_size, sizes))}, {self.a.rounds} round(s)", flush=True
        )
        rs = self.feasible(sizes, "real", 2)
        es = self.feasible(sizes, "emulated", 2)
        graph = self.capture(2, es) if es else None
        real: list[dict] = []
        emu: list[dict] = []
        for r in range(self.a.rounds):  # interleaved, alternating which goes first
            tag = f", round {r + 1}" if self.a.rounds > 1 else ""
            for which in ("real", "emulated") if r % 2 == 0 else ("emulated", "real"):
                if which == "real" and rs:
                    real.append(self.real(rs, tag))
                elif which == "emulated" and graph:
                    emu.append(self.emulate(2, graph, es, tag))
                self.save()
        for s in sizes:
            r, e = pool([x.get(s) for x in real]), pool([x.get(s) for x in emu])
            row = {"world": 2, "bytes": s, "size": fmt_size(s), "real": r, "emulated": e, "link": link_bytes(2, s)}
            if r and e:
                row["rel_err_median"] = (e["median_us"] - r["median_us"]) / r["median_us"]
                row["rel_err_min"] = (e["min_us"] - r["min_us"]) / r["min_us"]
            self.res["two"].append(row)
        self.save()

    def case_many(self, worlds: list[int], sizes: list[int]) -> None:
        vanilla_ok = True
        for n in worlds:
            print(f"case B: N={n}, sizes {','.join(map(fmt_size, sizes))}", flush=True)
            es = self.feasible(sizes, "emulated", n)
            emu = self.emulated(n, es) if es else {}
            van: dict[int, dict] = {}
            vanilla_run_here = vanilla_ok and n <= self.a.vanilla_max
            if vanilla_run_here:
                vs = self.feasible(sizes, "vanilla", n)
                if vs:
                    van, vanilla_ok = self.vanilla(n, vs)
            for s in sizes:
                e, v = emu.get(s), van.get(s)
                row = {
                    "world": n,
                    "bytes": s,
                    "size": fmt_size(s),
                    "emulated": e,
                    "vanilla": v,
                    "vanilla_run": vanilla_run_here,
                    "link": link_bytes(n, s),
                }
                if e and v:
                    row["emulated_over_vanilla"] = e["median_us"] / v["median_us"]
                self.res["many"].append(row)
            self.save()

    def merged(self) -> dict:
        """This invocation's results, plus (--merge) an earlier file's for the other worlds."""
        if not self.old:
            return self.res
        keep = lambda rows: [x for x in rows if x.get("world") not in self.worlds]  # noqa: E731
        out = dict(self.res)
        for key in ("two", "many", "runs", "skipped"):
            out[key] = keep(self.old.get(key, [])) + self.res[key]
        for key in ("two", "many"):
            out[key].sort(key=lambda x: (x["world"], x["bytes"]))
        out["merged_dates"] = sorted({*self.old.get("merged_dates", [self.old.get("date")]), self.res["date"]})
        return out

    def save(self) -> None:
        res = self.merged()
        self.a.json.parent.mkdir(parents=True, exist_ok=True)
        self.a.json.write_text(json.dumps(res, indent=1) + "\n")
        self.a.md.write_text(markdown(res))


# ---------------------------------------------------------------------- report
def _us(d: dict | None, key: str = "median_us") -> str:
    return f"{d[key]:,.1f}" if d and key in d else "–"


def _mb(b: int) -> str:
    return f"{b / 2**20:,.2f}"


def _gbs(nbytes: int, d: dict | None) -> str:
    return f"{nbytes / (d['median_us'] * 1e-6) / 1e9:,.2f}" if d and d["median_us"] > 0 else "–"


def markdown(r: dict) -> str:
    m = r["machine"]
    dev = f"{m.get('gpu')} ×{m.get('gpus')}" if m.get("gpu") else "CPU"
    lines = [
        f"Machine: {dev}, {m.get('cpus')} cores, torch {m.get('torch')}; devices {r['devices']}; "
        f"{r['date']}; {r['dtype']}, {r['warmup']} warm-up + {r['iters']} timed calls per size; "
        f"real run: {r['real']}; case A rounds: {r.get('rounds', 1)}; commit {r.get('commit')}, "
        f"PRISM_STAGE_AHEAD {r.get('stage_ahead')}",
        "",
        f"Measured: {r['measured']}.",
        "",
        f"Computed: {r['computed']}.",
        "",
    ]
    if r["two"]:
        lines += [
            "Case A, 2 logical members (rank 0; µs per call, median of the timed calls; "
            "rel. error = (emulated - real) / real):",
            "",
            "| size | real (µs) | emulated (µs) | rel. error | real min | emulated min "
            "| real, recorded (µs) | emulated, recorded (µs) "
            "| sandbox link MiB each way (small group of 2, computed) | logical ring MiB each way (computed) "
            "| real link GB/s | emulated link GB/s |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for c in r["two"]:
            lb = c["link"]
            err = f"{c['rel_err_median'] * 100:+.2f}%" if "rel_err_median" in c else "–"
            lines.append(
                f"| {c['size']} | {_us(c['real'])} | {_us(c['emulated'])} | {err} | "
                f"{_us(c['real'], 'min_us')} | {_us(c['emulated'], 'min_us')} | "
                f"{_us(c['real'], 'recorded_us')} | {_us(c['emulated'], 'recorded_us')} | {_mb(lb['small_send'])} | "
                f"{_mb(lb['logical_send'])} | {_gbs(lb['logical_send'], c['real'])} | "
                f"{_gbs(lb['small_send'], c['emulated'])} |"
            )
        lines.append("")
    if r["many"]:
        lines += [
            "Case B, N logical members, one sandbox rank (rank 0) and one assistant, against the "
            "vanilla way (a process per rank):",
            "",
            "| N | size | emulated (µs) | vanilla (µs) | emulated / vanilla | emulated min | vanilla min "
            "| emulated, recorded (µs) "
            "| sandbox link MiB each way (small group of 2, computed) | logical ring MiB each way (computed) "
            "| pad MiB | sandbox scratch MiB | emulated link GB/s |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for c in r["many"]:
            lb = c["link"]
            ratio = (
                f"{c['emulated_over_vanilla']:.3f}"
                if "emulated_over_vanilla" in c
                else ("–" if c["vanilla_run"] else "not run")
            )
            lines.append(
                f"| {c['world']} | {c['size']} | {_us(c['emulated'])} | {_us(c['vanilla'])} | {ratio} | "
                f"{_us(c['emulated'], 'min_us')} | {_us(c['vanilla'], 'min_us')} | "
                f"{_us(c['emulated'], 'recorded_us')} | {_mb(lb['small_send'])} | "
                f"{_mb(lb['logical_send'])} | {_mb(lb['pad_bytes'])} | {_mb(lb['scratch_bytes'])} | "
                f"{_gbs(lb['small_send'], c['emulated'])} |"
            )
        lines.append("")
    if r["runs"]:
        lines += [
            "Runs (whole command, processes started and ended included):",
            "",
            "| run | exit | wall (s) |",
            "|---|---|---|",
        ]
        lines += [f"| {x['run']} | {x['rc']} | {x['wall_s']} |" for x in r["runs"]]
        lines.append("")
    if r["skipped"]:
        lines += [
            "Skipped (memory): " + "; ".join(f"{s['variant']} N={s['world']} {s['size']}" for s in r["skipped"]),
            "",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--sizes", default=None, help="case A sizes (default: 16MB,...,8GB on cuda; 1MB,4MB,16MB on cpu)")
    ap.add_argument(
        "--sizes-many",
        default=None,
        help="case B sizes (default: --sizes if given, else 16MB,256MB,1GB on cuda; 1MB,4MB on cpu)",
    )
    ap.add_argument("--worlds", default="2,16,32,64,128", help="2: case A; every other N: case B")
    ap.add_argument("--vanilla-max", type=int, default=64, help="largest N run the vanilla way (0: none)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="case A: real and emulated runs this many times each, interleaved (alternating "
        "which goes first); statistics over every timed call of every round",
    )
    ap.add_argument(
        "--real",
        choices=["record", "torchrun"],
        default="record",
        help="case A's real run: `prism record --nproc 2` (default; the recording layer the "
        "emulated sandbox also runs under) or plain torchrun",
    )
    ap.add_argument("--timeout", type=int, default=600, help="seconds for each run")
    ap.add_argument(
        "--reserve-gb",
        type=float,
        default=1.0,
        help="memory per process kept for the runtime when deciding which sizes fit",
    )
    ap.add_argument(
        "--merge",
        action="store_true",
        help="keep the --json file's results for the worlds not run now (split a long "
        "benchmark over several invocations; same devices, machine and settings)",
    )
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--md", type=Path, default=None)
    a = ap.parse_args(argv)
    sizes = parse_sizes(a.sizes or DEFAULT_SIZES[a.devices])
    many = parse_sizes(a.sizes_many or a.sizes or DEFAULT_MANY[a.devices])
    worlds = [int(x) for x in a.worlds.split(",") if x]
    if a.rounds < 1 or a.iters < 1 or a.warmup < 0:
        ap.error("--rounds and --iters must be >= 1, --warmup >= 0")
    if any(n < 2 for n in worlds):
        ap.error("--worlds: every N must be >= 2")
    a.json = a.json or ROOT / "benchmarks" / "results" / f"pruning_latency_{a.devices}.json"
    a.md = a.md or a.json.with_suffix(".md")
    if a.devices == "cuda" and torch.cuda.device_count() < 2:
        ap.error("--devices cuda needs 2 GPUs (a sandbox GPU and an assistant GPU; the real run one per rank)")
    old = None
    if a.merge and a.json.exists():
        old = json.loads(a.json.read_text())
        now = {"devices": a.devices, "warmup": a.warmup, "iters": a.iters, "gpu": machine().get("gpu")}
        was = {
            "devices": old.get("devices"),
            "warmup": old.get("warmup"),
            "iters": old.get("iters"),
            "gpu": old.get("machine", {}).get("gpu"),
        }
        if now != was:
            ap.error(f"--merge: {a.json} was run with {was}, this run is {now}")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="prism-prune-") as tmp:
        b = Bench(a, Path(tmp), worlds, old)
        if 2 in worlds:
            b.case_two(sizes)
        rest = [n for n in worlds if n != 2]
        if rest:
            b.case_many(rest, many)
        b.res["wall_s"] = round(time.perf_counter() - t0, 1)
        b.save()
    print(markdown(b.merged()))
    print(f"wrote {a.json} and {a.md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
