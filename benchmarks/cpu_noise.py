"""How much a real CPU run of gpt3d moves between invocations, with and without pinning each
rank to its own core: the reference spread that CPU fidelity figures carry.

    python benchmarks/cpu_noise.py [--nproc 8] [--runs 5] [--cases tp,pp] [--json OUT]

Runs the same job ``--runs`` times in each mode, the modes interleaved (free, pinned, free, ...)
so that a drift of the host hits both alike. *free*: as torchrun starts it (OMP_NUM_THREADS=1,
the kernel places the processes); *pinned*: rank r on core r (``taskset``). Per run: the last
rank's iteration time, median of the steady iterations (all but the first). Prints per mode
the runs' medians, their spread ((max - min) / median) and coefficient of variation."""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from fidelity import SIZES, make_case  # noqa: E402
from tracing_overhead import machine  # noqa: E402

ITER_RE = re.compile(r"^iteration (\d+)/\d+ \| loss \S+ \| iter time ([\d.]+) ms")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_run(nproc: int, args: list[str], pinned: bool, timeout: float) -> float:
    """The last rank's median steady iteration time (ms) of one run."""
    port = free_port()
    procs = []
    for r in range(nproc):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(r),
            "LOCAL_RANK": str(r),
            "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc),
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "CUDA_VISIBLE_DEVICES": "",
        }  # fmt: skip  (a CPU run, also on a GPU host)
        cmd = [sys.executable, str(ROOT / "examples" / "gpt3d.py"), *args]
        if pinned:
            cmd = ["taskset", "-c", str(r), *cmd]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = []
    try:
        deadline = time.time() + timeout
        for r, p in enumerate(procs):
            try:
                out, _ = p.communicate(timeout=max(deadline - time.time(), 1))
            except subprocess.TimeoutExpired:
                raise SystemExit(
                    f"cpu_noise: rank {r} did not finish within {timeout:.0f} s "
                    f"({' '.join(cmd)}); raise --timeout if the job is just slow"
                ) from None
            outs.append(out)
            if p.returncode:
                raise SystemExit(f"cpu_noise: a rank failed (exit {p.returncode}):\n{out[-2000:]}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    times = [float(m.group(2)) for line in outs[-1].splitlines() if (m := ITER_RE.match(line))]
    if len(times) < 2:
        raise SystemExit(f"cpu_noise: no iteration lines from the last rank:\n{outs[-1][-2000:]}")
    return statistics.median(times[1:])


def measure(name: str, nproc: int, runs: int, iters: int, timeout: float) -> dict:
    case = make_case(name, nproc)
    if isinstance(case, str):
        raise SystemExit(f"cpu_noise: {name}: {case}")
    args = case.args(SIZES["cpu"], iters)
    modes: dict[str, list[float]] = {"free": [], "pinned": []}
    for i in range(runs):
        for mode, v in modes.items():
            t0 = time.time()
            v.append(one_run(nproc, args, mode == "pinned", timeout))
            print(f"{name} run {i + 1}/{runs} {mode:6s} {v[-1]:8.2f} ms  ({time.time() - t0:.0f} s)", flush=True)
    out = {"case": name, "title": case.title, "nproc": nproc, "args": args, "modes": {}}
    for mode, v in modes.items():
        med = statistics.median(v)
        cv = statistics.stdev(v) / statistics.mean(v) if len(v) > 1 else 0.0
        out["modes"][mode] = {"runs_ms": v, "median_ms": med, "spread": (max(v) - min(v)) / med, "cv": cv}
        print(
            f"{name} {mode:6s} median {med:.2f} ms, spread {100 * (max(v) - min(v)) / med:.1f} %, cv {100 * cv:.1f} %",
            flush=True,
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=8)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--cases", default="tp", help="comma list of benchmarks/fidelity.py's cases")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.nproc > (os.cpu_count() or 1):
        ap.error(f"--nproc {a.nproc} exceeds this host's {os.cpu_count()} cores (pinning needs one core a rank)")
    cases = [measure(c, a.nproc, a.runs, a.iters, a.timeout) for c in a.cases.split(",")]
    if a.json:
        Path(a.json).write_text(
            json.dumps(
                {
                    "machine": machine(),
                    "date": time.strftime("%Y-%m-%d %H:%M"),
                    "runs": a.runs,
                    "iters": a.iters,
                    "cases": cases,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
