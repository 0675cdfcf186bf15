"""Pruning latency: every collective kind and send/recv, pruned (one real member, one proxy)
against the real thing at the same logical world size, 64 KB to 8 GB.

    python benchmarks/pruning_latency.py --devices cpu|cuda [--worlds 2,4] [--ops all_reduce,...]
        [--sizes 64KB,1MB,16MB,256MB,1GB,8GB] [--rounds 2] [--warmup 3] [--iters 10] [--ahead MS]
        [--vanilla N,...] [--timeout S] [--json benchmarks/results/pruning_latency_<machine>.json] [--md PATH]

The workload is benchmarks/programs/collective_sizes.py (a plain torch.distributed program): per
op and size, warm-up calls then ``--iters`` timed ones, each timed on rank 0's device (CUDA
events; with ``--ahead`` (default 50 ms on GPU) the device sleeps while the host enqueues every
timed call, so that the events measure the collective's device latency back to back, not the
host's cost of issuing one) or by the wall clock (gloo).

For each N of ``--worlds``, in one invocation, ``--rounds`` times, alternating which goes first:

* **real**: plain torchrun with N ranks, one GPU each (on CPU N processes);
* **emulated**: `prism capture --mode solo --world N --layout tp=N` once, then `prism emulate
  --sandbox 0 --inputs generated` on two devices: rank 0 real on the first, one assistant on the
  second playing ranks 1..N-1 through one proxy (for N > 2 the logical N-member collective runs on
  a small communicator of 2, padded to the logical ring's bytes where the plan can:
  docs/internals/pruning.md).

Per (N, op, size): rank 0's median over every timed call of every round, its relative error
(emulated - real) / real, and whether it is within 2 % or inside the range the real calls
themselves spread over (``within``). Bytes on the sandbox rank's link (the plan's, computed) and
the logical ring's are beside each row. ``--vanilla N,...`` adds, for each N, the vanilla way
(a real process per rank, several on a device, NCCL_HOSTID) against the emulation.

Each run is independent: a failure is recorded and the others go on; the JSON and the markdown
are rewritten after every run, and ``--merge`` keeps an earlier file's rows for the worlds not
run now.
"""

from __future__ import annotations

import argparse
import json
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

from collective_sizes import ALL_OPS, OPS, fmt_size, parse_sizes  # noqa: E402
from emulate_bootstrap import run, vanilla_run  # noqa: E402
from tracing_overhead import machine  # noqa: E402

import prismllm.pruning as C  # noqa: E402
from prismllm.launch import NVLS_OFF_ENV  # noqa: E402

PROGRAM = str(ROOT / "benchmarks" / "programs" / "collective_sizes.py")
PRISM = [sys.executable, "-m", "prismllm.cli.main"]
LINE = re.compile(r"^COLLECTIVE (\{.*\})\s*$", re.M)
DEFAULT_SIZES = {"cuda": "64KB,1MB,16MB,256MB,1GB,8GB", "cpu": "64KB,1MB,4MB"}
DTYPE = torch.float32
TOLERANCE = 0.02


# ---------------------------------------------------------------------- helpers
def parse(text: str, rank: int = 0) -> dict[tuple[str, int], dict]:
    """The program's lines of ``rank``, by (op, bytes)."""
    out = {}
    for m in LINE.finditer(text):
        d = json.loads(m[1])
        if d.get("rank") == rank:
            out[(d["op"], d["bytes"])] = d
    return out


def pool(rounds: list[dict | None]) -> dict | None:
    """One (op, size)'s lines from several rounds as one: statistics over every timed call, and
    each round's median."""
    got = [d for d in rounds if d]
    if not got:
        return None
    times = [t for d in got for t in d["times_us"]]
    return {
        "median_us": round(statistics.median(times), 2),
        "min_us": min(times),
        "max_us": max(times),
        "mean_us": round(statistics.fmean(times), 2),
        "loop_us": round(statistics.fmean(d["loop_us"] for d in got), 2),
        "round_medians_us": [d["median_us"] for d in got],
        "times_us": times,
    }


def link_bytes(op: str, n: int, nbytes: int) -> dict:
    """Bytes on the sandbox rank's (logical rank 0's) link for one call of ``op`` at ``nbytes`` in
    a logical group of ``n`` with one real member -- the plan's small call -- and in the logical
    ring (chain, or point-to-point) algorithm: {small_send, small_recv, logical_send, logical_recv}."""
    item = DTYPE.itemsize
    numel = nbytes // item
    part = numel // n * n
    coalesced = op.endswith("_coalesced")
    base = op.removesuffix("_coalesced")
    if coalesced:
        part = part // 2 // n * n
    if base == "all_reduce":
        p = C.plan_all_reduce(n, [0], (numel,), "sum", dtype=DTYPE)
    elif base == "all_gather":
        p = C.plan_all_gather(n, [0], (part // n,), dtype=DTYPE)
    elif base == "reduce_scatter":
        p = C.plan_reduce_scatter(n, [0], (part // n,), "sum", dtype=DTYPE)
    elif base == "all_to_all":
        p = C.plan_all_to_all(n, [0], numel=part, dtype=DTYPE)
    elif base == "broadcast":
        p = C.plan_broadcast(n, [0], (numel,), 0, dtype=DTYPE)
    else:  # send_recv: rank 0 sends to 1
        p = C.plan_send(n, [0], 0, 1, (numel,), dtype=DTYPE)
    lb = p.bytes[0]
    k = 2 if coalesced else 1
    return {
        "small_send": k * lb.send,
        "small_recv": k * lb.recv,
        "logical_send": k * lb.logical_send,
        "logical_recv": k * lb.logical_recv,
    }


def commit() -> str:
    """HEAD of the checkout, '+dirty' if prismllm/ has changes (the assistant's code matters here)."""
    try:
        git = ["git", "-C", str(ROOT)]
        head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run([*git, "status", "--porcelain", "--", "prismllm"], capture_output=True, text=True)
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


class Bench:
    def __init__(self, a: argparse.Namespace, work: Path, old: dict | None = None):
        self.a, self.work, self.old = a, work, old
        self.res: dict = {
            "benchmark": "pruning_latency",
            "machine": machine(),
            "date": time.strftime("%Y-%m-%d"),
            "devices": a.devices,
            "dtype": str(DTYPE).replace("torch.", ""),
            "warmup": a.warmup,
            "iters": a.iters,
            "ahead_ms": a.ahead,
            "rounds": a.rounds,
            # the emulated sandbox's path: the native lane (auto: on GPUs) or Python (docs/internals/pruning.md)
            "native_lane": os.environ.get("PRISM_NATIVE_LANE", "auto"),
            "commit": commit(),
            "measured": "latency of rank 0's calls: CUDA events around each call on the current stream"
            + (f", the host {a.ahead:g} ms ahead of the device (every timed call enqueued first)" if a.ahead else "")
            + " (GPU), wall clock (gloo); the median over every timed call of every round",
            "computed": "bytes: small_* from the pruning plan rank 0's small call follows (one real member and "
            "the proxy), logical_* a rank of the logical ring / chain / point-to-point algorithm; no link counter",
            "rows": [],
            "vanilla": [],
            "runs": [],
        }

    def prog_args(self, ops: list[str], sizes: list[int]) -> list[str]:
        return [
            "--ops",
            ",".join(ops),
            "--sizes",
            ",".join(fmt_size(s) for s in sizes),
            "--warmup",
            str(self.a.warmup),
            "--iters",
            str(self.a.iters),
            "--ahead",
            str(self.a.ahead),
            "--mem-factor",
            "0",
            "--backend",
            "nccl" if self.a.devices == "cuda" else "gloo",
        ]

    def _run(self, label: str, world: int, cmd: list[str], env: dict | None = None) -> tuple[int, str]:
        print(f"  {label} ...", flush=True)
        rc, text, wall = run(cmd, self.a.timeout + 60, env)
        print(f"  {label}: exit {rc}, {wall:.1f} s", flush=True)
        rec = {"run": label, "world": world, "rc": rc, "wall_s": round(wall, 2)}
        if rc:
            rec["error"] = text[-2000:]
            print("    " + "\n    ".join(text.strip().splitlines()[-6:]), flush=True)
        m = re.search(r"prism assistant: .*", text)
        if m:
            rec["assistant"] = m[0]
        self.res["runs"].append(rec)
        return rc, text

    def real(self, n: int, args: list[str], tag: str) -> dict:
        env = {"OMP_NUM_THREADS": "1", **NVLS_OFF_ENV}
        if self.a.devices == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n), PROGRAM]
        return parse(self._run(f"real N={n}{tag}", n, [*cmd, *args], env)[1])

    def capture(self, n: int, args: list[str]) -> Path | None:
        graph = self.work / f"graph{n}"
        cmd = [*PRISM, "capture", "--mode", "solo", "--world", str(n), "--devices", self.a.devices]
        # every rank captured (a tp layout has no replicas): send_recv's ranks differ
        cmd += ["--parallel", "1", "--layout", f"tp={n}", "--out", str(graph), "--force"]
        rc, _ = self._run(f"capture N={n}", n, [*cmd, "--timeout", str(self.a.timeout), "--", PROGRAM, *args])
        return None if rc else graph

    def emulate(self, n: int, graph: Path, args: list[str], tag: str) -> dict:
        devices = "cuda:0,1" if self.a.devices == "cuda" else "cpu"
        cmd = [*PRISM, "emulate", "--graph", str(graph), "--sandbox", "0", "--devices", devices]
        out = self.work / f"emu{n}"
        cmd += ["--inputs", "generated", "--out", str(out), "--force"]
        text = self._run(f"emulate N={n}{tag}", n, [*cmd, "--timeout", str(self.a.timeout), "--", PROGRAM, *args])[1]
        self._emulation_summary(out / "emulate.json")
        return parse(text)

    def _emulation_summary(self, path: Path) -> None:
        """Beside the run's record: how late the proxy entered its calls against the replay's schedule
        (``replay.arrivals``) and the sandbox's calls through the native lane and through Python."""
        if not path.is_file():
            return
        doc = json.loads(path.read_text())
        sandbox = (doc.get("sandbox_results") or {}).get("0") or {}
        self.res["runs"][-1]["arrivals"] = (doc.get("replay") or {}).get("arrivals")
        self.res["runs"][-1]["native_lane"] = sandbox.get("emulation_native_lane")

    def world(self, n: int, ops: list[str], sizes: list[int]) -> None:
        print(f"N={n}: {len(ops)} op(s), sizes {','.join(map(fmt_size, sizes))}, {self.a.rounds} round(s)", flush=True)
        args = self.prog_args(ops, sizes)
        graph = self.capture(n, args)
        real: list[dict] = []
        emu: list[dict] = []
        for r in range(self.a.rounds):  # interleaved, alternating which goes first
            tag = f", round {r + 1}" if self.a.rounds > 1 else ""
            for which in ("real", "emulated") if r % 2 == 0 else ("emulated", "real"):
                if which == "real":
                    real.append(self.real(n, args, tag))
                elif graph is not None:
                    emu.append(self.emulate(n, graph, args, tag))
        for op in ops:
            for s in sizes:
                r, e = pool([x.get((op, s)) for x in real]), pool([x.get((op, s)) for x in emu])
                row = {"world": n, "op": op, "bytes": s, "size": fmt_size(s), "real": r, "emulated": e}
                row["link"] = link_bytes(op, n, s)
                if r and e:
                    err = (e["median_us"] - r["median_us"]) / r["median_us"]
                    row["rel_err"] = round(err, 5)
                    row["within"] = abs(err) <= TOLERANCE or r["min_us"] <= e["median_us"] <= r["max_us"]
                self.res["rows"].append(row)
        self.save()

    def vanilla(self, n: int, ops: list[str], sizes: list[int]) -> None:
        args = self.prog_args(ops, sizes)
        graph = self.capture(n, args)
        emu = self.emulate(n, graph, args, "") if graph else {}
        print(f"  vanilla N={n} ...", flush=True)
        rc, text, wall = vanilla_run(n, self.a.devices, PROGRAM, args, self.a.timeout)
        self.res["runs"].append({"run": f"vanilla N={n}", "world": n, "rc": rc, "wall_s": round(wall, 2)})
        van = parse(text)
        for op in ops:
            for s in sizes:
                e, v = pool([emu.get((op, s))]), pool([van.get((op, s))])
                row = {"world": n, "op": op, "bytes": s, "size": fmt_size(s), "emulated": e, "vanilla": v}
                if e and v:
                    row["emulated_over_vanilla"] = round(e["median_us"] / v["median_us"], 4)
                self.res["vanilla"].append(row)
        self.save()

    def merged(self) -> dict:
        """This invocation's rows, plus (--merge) an earlier file's for the worlds not run now."""
        if not self.old:
            return self.res
        now = {x["world"] for x in self.res["rows"]} | {x["world"] for x in self.res["vanilla"]}
        out = dict(self.res)
        for key in ("rows", "vanilla", "runs"):
            out[key] = [x for x in self.old.get(key, []) if x.get("world") not in now] + self.res[key]
        return out

    def save(self) -> None:
        res = self.merged()
        self.a.json.parent.mkdir(parents=True, exist_ok=True)
        self.a.json.write_text(json.dumps(res, indent=1) + "\n")
        self.a.md.write_text(markdown(res))


# ---------------------------------------------------------------------- report
def _us(d: dict | None, key: str = "median_us") -> str:
    return f"{d[key]:,.1f}" if d and key in d else "–"


def markdown(r: dict) -> str:
    m = r["machine"]
    dev = f"{m.get('gpu')} ×{m.get('gpus')}" if m.get("gpu") else "CPU"
    lines = [
        f"Machine: {dev}, {m.get('cpus')} cores, torch {m.get('torch')}; devices {r['devices']}; {r['date']}; "
        f"{r['dtype']}, {r['warmup']} warm-up + {r['iters']} timed calls per op and size, {r['rounds']} round(s); "
        f"commit {r.get('commit')}",
        "",
        f"Measured: {r['measured']}. Computed: {r['computed']}.",
        "",
    ]
    rows = [x for x in r["rows"] if x.get("real") or x.get("emulated")]
    if rows:
        ok = [x for x in rows if "within" in x]
        lines += [
            f"Real N-rank run (plain torchrun) against the emulation (rank 0 real, an assistant for the rest, two "
            f"devices): {sum(x['within'] for x in ok)} of {len(ok)} within {TOLERANCE:.0%} or the real calls' range.",
            "",
            "| N | op | size | real µs (median) | real range | emulated µs | error | within | "
            "sandbox link MiB out / in (small group) | logical MiB out / in |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for x in rows:
            lb = x["link"]
            err = f"{x['rel_err'] * 100:+.2f}%" if "rel_err" in x else "–"
            rng = f"{_us(x['real'], 'min_us')}–{_us(x['real'], 'max_us')}" if x.get("real") else "–"
            lines.append(
                f"| {x['world']} | {x['op']} | {x['size']} | {_us(x['real'])} | {rng} | {_us(x['emulated'])} | {err} | "
                f"{'yes' if x.get('within') else 'no' if 'within' in x else '–'} | "
                f"{lb['small_send'] / 2**20:,.2f} / {lb['small_recv'] / 2**20:,.2f} | "
                f"{lb['logical_send'] / 2**20:,.2f} / {lb['logical_recv'] / 2**20:,.2f} |"
            )
        lines.append("")
    if r["vanilla"]:
        lines += [
            "The vanilla way (a real process per rank, several a device) against the emulation:",
            "",
            "| N | op | size | emulated µs | vanilla µs | emulated / vanilla |",
            "|---|---|---|---|---|---|",
        ]
        for x in r["vanilla"]:
            ratio = f"{x['emulated_over_vanilla']:.3f}" if "emulated_over_vanilla" in x else "–"
            lines.append(
                f"| {x['world']} | {x['op']} | {x['size']} | {_us(x['emulated'])} | {_us(x['vanilla'])} | {ratio} |"
            )
        lines.append("")
    lines += ["Runs:", "", "| run | exit | wall (s) |", "|---|---|---|"]
    lines += [f"| {x['run']} | {x['rc']} | {x['wall_s']} |" for x in r["runs"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--worlds", default="2,4", help="logical world sizes run for real and emulated")
    ap.add_argument("--ops", default=",".join(OPS), help=f"comma list of: {', '.join(ALL_OPS)}")
    ap.add_argument("--sizes", default=None, help="default: 64KB,...,8GB on cuda; 64KB,1MB,4MB on cpu")
    ap.add_argument("--vanilla", default="", help="world sizes run the vanilla way against the emulation")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--ahead", type=float, default=None, help="ms the device sleeps first (GPU; default 50)")
    ap.add_argument("--rounds", type=int, default=2, help="real and emulated runs per world, interleaved")
    ap.add_argument("--timeout", type=int, default=600, help="seconds for each run")
    ap.add_argument("--merge", action="store_true", help="keep the --json file's rows for the worlds not run now")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--md", type=Path, default=None)
    a = ap.parse_args(argv)
    sizes = parse_sizes(a.sizes or DEFAULT_SIZES[a.devices])
    ops = [o for o in a.ops.split(",") if o]
    if bad := [o for o in ops if o not in ALL_OPS]:
        ap.error(f"--ops: unknown {', '.join(bad)}")
    worlds = [int(x) for x in a.worlds.split(",") if x]
    vanilla = [int(x) for x in a.vanilla.split(",") if x]
    if any(n < 2 for n in worlds + vanilla):
        ap.error("every world size must be >= 2")
    if a.rounds < 1 or a.iters < 1 or a.warmup < 0:
        ap.error("--rounds and --iters must be >= 1, --warmup >= 0")
    a.ahead = (50.0 if a.devices == "cuda" else 0.0) if a.ahead is None else a.ahead
    if a.devices == "cuda" and torch.cuda.device_count() < max([2, *worlds]):
        ap.error(f"--devices cuda --worlds {a.worlds}: a real run of N ranks needs N GPUs (and the emulation 2)")
    a.json = a.json or ROOT / "benchmarks" / "results" / f"pruning_latency_{a.devices}.json"
    a.md = a.md or a.json.with_suffix(".md")
    old = json.loads(a.json.read_text()) if a.merge and a.json.exists() else None
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="prism-prune-") as tmp:
        b = Bench(a, Path(tmp), old)
        for n in worlds:
            b.world(n, ops, sizes)
        for n in vanilla:
            b.vanilla(n, ops, sizes)
        b.res["wall_s"] = round(time.perf_counter() - t0, 1)
        b.save()
    print(markdown(b.merged()))
    print(f"wrote {a.json} and {a.md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
