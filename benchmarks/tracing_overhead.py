"""Tracing overhead: gpt3d's iteration time plain vs recorded (`prism record`, through the
native recorder and through the Python path) vs under torch.profiler, all in one invocation,
as ratios.

Each variant runs the same command line; the program's own per-iteration times (its
--json-log) are compared: median over the steady iterations (after --warmup) of all rounds.
Variants are interleaved round by round, in a rotating order, so that drift of the machine
hits all of them alike. For the recorded runs it also checks that the iteration times found
in the graph agree with what the program printed.

    python benchmarks/tracing_overhead.py --nproc 2 --layout tp=2 --layout pp=2 --layout dp=2 \
        --iters 30 --warmup 5 --rounds 2 --json benchmarks/results/overhead.json -- <gpt3d args>
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPT3D = str(ROOT / "examples" / "gpt3d.py")
UNDER_PROFILER = str(ROOT / "benchmarks" / "under_profiler.py")
VARIANTS = ("plain", "native", "python", "profiler")  # native / python: `prism record --recorder`
RECORDED = ("native", "python")


def layout_flags(layout: str) -> list[str]:
    """'tp=2,pp=2' -> ['--tp', '2', '--pp', '2'] (dp is derived by gpt3d from the world)."""
    flags: list[str] = []
    for part in filter(None, layout.split(",")):
        key, value = part.split("=")
        if key != "dp":
            flags += [f"--{key}", value]
    return flags


def command(variant: str, nproc: int, args: list[str], log: str, graph: str) -> list[str]:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    program = [*args, "--json-log", log]
    if variant == "plain":
        return [*torchrun, GPT3D, *program]
    if variant == "profiler":
        return [*torchrun, UNDER_PROFILER, GPT3D, *program]
    prism = str(Path(sys.executable).with_name("prism"))
    return [
        prism,
        "record",
        "--nproc",
        str(nproc),
        "--out",
        graph,
        "--force",
        "--recorder",
        variant,
        "--",
        GPT3D,
        *program,
    ]


def steady(times: list[float], warmup: int) -> list[float]:
    return times[warmup:] if len(times) > warmup else times


def graph_iteration_ms(graph: str) -> list[float]:
    """Per-iteration time from a recorded graph: the slowest rank's iteration span."""
    from prismllm.trace.graph import PrismTrace

    it = PrismTrace.load(graph).iterations.to_pydict()
    spans: dict[int, float] = {}
    for i, s, e in zip(it["iteration"], it["start_ns"], it["end_ns"]):
        spans[i] = max(spans.get(i, 0.0), (e - s) / 1e6)
    return [spans[i] for i in sorted(spans)]


def machine() -> dict:
    info = {"host": platform.node(), "python": platform.python_version(), "cpus": os.cpu_count()}
    # what tells two machines of one kind apart when a host-bound figure moves between them
    info["usable_cpus"] = len(os.sched_getaffinity(0))
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        models = [ln.split(":", 1)[1].strip() for ln in cpuinfo.splitlines() if ln.startswith("model name")]
        mhz = sorted(float(ln.split(":", 1)[1]) for ln in cpuinfo.splitlines() if ln.startswith("cpu MHz"))
        info["cpu_model"] = models[0] if models else None
        info["cpu_mhz_median"] = round(mhz[len(mhz) // 2]) if mhz else None
    except OSError:
        pass
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
            info["gpus"] = torch.cuda.device_count()
    except ImportError:
        pass
    return info


def run_layout(
    layout: str, nproc: int, extra: list[str], rounds: int, warmup: int, workdir: Path, keep_graphs: Path | None
) -> dict:
    args = layout_flags(layout) + extra
    samples: dict[str, list[float]] = {v: [] for v in VARIANTS}
    agreement: list[float] = []
    for r in range(rounds):
        order = VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]
        for variant in order:
            log = str(workdir / f"{variant}-{r}.json")
            graph = str(workdir / f"graph-{variant}-{r}")
            cmd = command(variant, nproc, args, log, graph)
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                sys.exit(f"{layout} {variant} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
            printed = [row["iter_time_ms"] for row in json.loads(Path(log).read_text())]
            samples[variant] += steady(printed, warmup)
            print(
                f"  {layout:>12} {variant:>9} round {r}: median "
                f"{statistics.median(steady(printed, warmup)):.2f} ms "
                f"({time.perf_counter() - t0:.0f} s)",
                flush=True,
            )
            if variant in RECORDED:
                # Iteration i of the graph spans optimizer step i-1 to step i; the program's
                # printed time i covers the same work (iteration 0 also holds set-up).
                recorded = graph_iteration_ms(graph)
                for p, g in zip(steady(printed, warmup), steady(recorded, warmup)):
                    agreement.append(abs(g - p) / p)
                if keep_graphs is not None and r == rounds - 1:
                    keep_graphs.mkdir(parents=True, exist_ok=True)
                    shutil.move(graph, keep_graphs / f"{layout.replace(',', '_').replace('=', '')}-{variant}")
                else:
                    shutil.rmtree(graph, ignore_errors=True)
    medians = {v: statistics.median(s) for v, s in samples.items()}
    return {
        "layout": layout,
        "nproc": nproc,
        "args": args,
        "steady_iterations_per_variant": {v: len(s) for v, s in samples.items()},
        "median_iter_ms": medians,
        "native_over_plain": medians["native"] / medians["plain"],
        "python_over_plain": medians["python"] / medians["plain"],
        "profiler_over_plain": medians["profiler"] / medians["plain"],
        "graph_vs_printed_rel_error_max": max(agreement) if agreement else None,
        "graph_vs_printed_rel_error_mean": statistics.mean(agreement) if agreement else None,
    }


def markdown(result: dict) -> str:
    lines = [
        f"Machine: {result['machine'].get('gpu', 'CPU')} ×{result['machine'].get('gpus', 0)}, "
        f"torch {result['machine'].get('torch')}, {result['date']}",
        "",
        "| layout | plain ms | recorded native ms | recorded Python ms | profiler ms | native/plain "
        "| Python/plain | profiler/plain | graph vs printed (max rel. err.) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["layouts"]:
        m = row["median_iter_ms"]
        agree = row["graph_vs_printed_rel_error_max"]
        lines.append(
            f"| {row['layout']} | {m['plain']:.2f} | {m['native']:.2f} | {m['python']:.2f} | {m['profiler']:.2f} "
            f"| {row['native_over_plain']:.4f} | {row['python_over_plain']:.4f} | {row['profiler_over_plain']:.4f} "
            f"| {'n/a' if agree is None else f'{agree:.2%}'} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument(
        "--layout", action="append", required=True, help="e.g. tp=2 or pp=2,vpp=2; repeat for several layouts"
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--json", help="write the result here")
    parser.add_argument("--md", help="write the markdown table here")
    parser.add_argument(
        "--keep-graphs", type=Path, help="keep the last recorded graph of each layout in this directory"
    )
    parser.add_argument(
        "gpt3d_args", nargs=argparse.REMAINDER, help="after --: arguments for examples/gpt3d.py (sizes, --iters)"
    )
    opts = parser.parse_args()
    extra = [a for a in opts.gpt3d_args if a != "--"]
    result = {
        "benchmark": "tracing_overhead",
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
        "warmup": opts.warmup,
        "rounds": opts.rounds,
        "layouts": [],
    }
    with tempfile.TemporaryDirectory(prefix="prism-overhead-") as tmp:
        for layout in opts.layout:
            result["layouts"].append(
                run_layout(layout, opts.nproc, extra, opts.rounds, opts.warmup, Path(tmp), opts.keep_graphs)
            )
            # Written after every layout, so a run cut short keeps what it measured.
            table = markdown(result)
            if opts.json:
                Path(opts.json).write_text(json.dumps(result, indent=2) + "\n")
            if opts.md:
                Path(opts.md).write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
