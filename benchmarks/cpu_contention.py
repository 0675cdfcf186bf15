"""How much a rank's compute slows when the host's other cores are busy, and whether load
processes standing in for the absent ranks reproduce it: the one-slice compute gap of CPU
fidelity (docs/benchmarks.md, "Fidelity").

    python benchmarks/cpu_contention.py [--cases tp,vpp] [--world 8] [--rounds 3] [--json OUT]

Per case and round, modes interleaved (so a drift of the host hits all alike), each a
``prism record`` of gpt3d at the fidelity sizes, per-rank work equal in every mode (the global
batch follows DP, so each rank runs the same micro-batches):

- ``world``: the real N-rank job (N = --world), every rank computing beside the others;
- ``pair``: the same layout with DP 1 (the case at N / DP ranks), nothing else on the host;
- ``pair+<kind>``: that, beside N - N/DP load processes computing all along (``--kinds``:
  ``matmul``, 256 x 256 float32 matmuls on one thread, what the ranks compute most; ``spin``, a
  Python loop, a busy core without its vector units).

Per run: the sandbox-sized job's compute per iteration (sum of the compute spans), median over
the steady iterations and over its ranks. The question: which load brings ``pair`` to ``world``?
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from fidelity import GPT3D, PRISM, SIZES, load, make_case, ms, per_rank_compute, per_rank_iterations, steady_median  # noqa: E402
from tracing_overhead import machine  # noqa: E402

KINDS = ("matmul", "spin")
# one load process: computes until killed (OMP_NUM_THREADS=1, as the ranks)
LOAD = {
    "matmul": "import torch; torch.set_num_threads(1); a = torch.randn(256, 256); c = torch.empty(256, 256)\n"
    "while True: torch.mm(a, a, out=c)",
    "spin": "while True:\n    x = 0\n    for i in range(20000): x += i",
}


class Load:
    """``n`` load processes of one kind, killed on ``stop`` (and by the kernel if this dies)."""

    def __init__(self, n: int, kind: str):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
        self.procs = [
            subprocess.Popen([sys.executable, "-c", LOAD[kind]], env=env, start_new_session=False) for _ in range(n)
        ]

    def stop(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait()


def one_run(nproc: int, args: list[str], out: Path, timeout: float) -> dict:
    """`prism record` of one job: median compute and iteration (ms) over steady iterations and ranks."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"}
    p = subprocess.run(
        [*PRISM, "record", "--nproc", str(nproc), "--devices", "cpu", "--out", str(out), "--force", "--", GPT3D, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if p.returncode:
        raise SystemExit(f"cpu_contention: prism record failed ({p.returncode}):\n{(p.stdout + p.stderr)[-2000:]}")
    trace = load(out)
    comp, its = per_rank_compute(trace), per_rank_iterations(trace)
    steady = lambda v: ms(steady_median(v, 1))  # noqa: E731  (the first iteration warms up)
    return {
        "compute_ms": statistics.median(steady(v) for v in comp.values()),
        "iteration_ms": statistics.median(steady(v) for v in its.values()),
        "compute_ms_per_rank": {str(r): round(steady(v), 3) for r, v in comp.items()},
    }


def measure(
    name: str,
    world: int,
    rounds: int,
    kinds: list[str],
    iters: int,
    timeout: float,
    work: Path,
    done: callable,
    into: list,
) -> None:
    full = make_case(name, world)
    if isinstance(full, str):
        raise SystemExit(f"cpu_contention: {name} at N={world}: {full}")
    small = world // full.dp
    pair = make_case(name, small)
    if isinstance(pair, str) or pair.dp != 1:
        raise SystemExit(f"cpu_contention: {name} at N={small} is not the DP-1 layout of N={world}")
    workers = world - small
    modes = ["world", "pair", *[f"pair+{k}" for k in kinds]]
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    out = {
        "case": name,
        "world": world,
        "title": full.title,
        "pair": pair.title,
        "workers": workers,
        "runs": runs,
        "modes": {},
    }
    into.append(out)  # saved after every run (``done``)
    for i in range(rounds):
        order = modes[i % len(modes) :] + modes[: i % len(modes)]
        for mode in order:
            t0 = time.time()
            if mode == "world":
                r = one_run(world, full.args(SIZES["cpu"], iters), work / f"{name}-{mode}", timeout)
            else:
                hl = Load(workers, mode.split("+")[1]) if "+" in mode else None
                try:
                    if hl is not None:
                        time.sleep(3.0)  # the load processes import torch before the job starts
                    r = one_run(small, pair.args(SIZES["cpu"], iters), work / f"{name}-{mode}", timeout)
                finally:
                    if hl is not None:
                        hl.stop()
            runs[mode].append(r)
            print(
                f"{name} round {i + 1}/{rounds} {mode:12s} compute {r['compute_ms']:8.2f} ms  iteration "
                f"{r['iteration_ms']:8.2f} ms  ({time.time() - t0:.0f} s)",
                flush=True,
            )
            done()
    ref = statistics.median(r["compute_ms"] for r in runs["world"]) if runs["world"] else None
    for mode, v in runs.items():
        if not v:
            continue
        med = statistics.median(r["compute_ms"] for r in v)
        out["modes"][mode] = {
            "compute_ms": med,
            "iteration_ms": statistics.median(r["iteration_ms"] for r in v),
            "compute_vs_world": (med / ref - 1) if ref else None,
        }
        print(f"{name} {mode:12s} compute median {med:8.2f} ms ({100 * (med / ref - 1):+.1f} % vs world)", flush=True)
    done()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="tp", help="comma list of benchmarks/fidelity.py's cases")
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"load kinds to try ({', '.join(KINDS)})")
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.world > (os.cpu_count() or 1):
        ap.error(f"--world {a.world} exceeds this host's {os.cpu_count()} cores (the real job would be oversubscribed)")
    doc = {
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "rounds": a.rounds,
        "iters": a.iters,
        "cases": [],
    }

    def save() -> None:
        if a.json:
            Path(a.json).write_text(json.dumps(doc, indent=2))

    with tempfile.TemporaryDirectory() as tmp:
        for c in a.cases.split(","):
            measure(c, a.world, a.rounds, a.kinds.split(","), a.iters, a.timeout, Path(tmp), save, doc["cases"])


if __name__ == "__main__":
    main()
