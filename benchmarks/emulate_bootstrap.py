"""Emulation bootstrap cost against logical world size: `prism emulate` of a program that
joins an N-rank world, runs a global barrier and one 1 MiB all-reduce
(benchmarks/programs/bootstrap.py), with one sandbox rank and one assistant (on GPU: one
sandbox GPU, one assistant GPU), for N = 64 ... 8192; beside it the vanilla way, a real
process per rank (on GPU several per device, each told by NCCL_HOSTID that it is its own
host), up to where it fails or --vanilla-max.

    python benchmarks/emulate_bootstrap.py [--devices cpu|cuda] [--worlds 64,256,1024,4096,8192]
        [--vanilla-max 64] [--json benchmarks/results/emulate_bootstrap_<machine>.json]

Per N: the bare graph's capture (`prism capture --mode solo --layout tp=1,pp=1`: every rank
alike, one runs), then the emulation (virtual ranks' inputs generated: zeros), with
- the sandbox's own timings (init_process_group, barrier, all-reduce) and peak RSS / GPU
  memory reserved,
- the assistant's peak RSS and (GPU) device memory in use, from its last line,
- the whole `prism emulate` wall time (processes started and ended included).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tracing_overhead import machine

ROOT = Path(__file__).resolve().parents[1]
PROGRAM = str(ROOT / "benchmarks" / "programs" / "bootstrap.py")
PRISM = str(Path(sys.executable).with_name("prism"))
BOOT = re.compile(
    r"BOOTSTRAP world (\d+) init_s ([\d.]+) barrier_s ([\d.]+) all_reduce_s ([\d.]+) "
    r"sum \S+ gpu_reserved (\d+) rss (\d+)"
)
# the assistant's last line (prismllm/assistant/__main__.py)
ASSIST = re.compile(
    r"prism assistant(?: \d+ of \d+)?: replayed (\d+) virtual.* in ([\d.]+) s; peak RSS (\d+) MiB"
    r"(?:, GPU memory reserved (\d+) MiB at peak \(device in use (\d+) MiB\))?"
)


def assistant_fields(text: str) -> dict:
    """The assistant's figures from its last line: wall, peak RSS and (GPU) its tensors' peak
    reservation and the whole device in use."""
    m = ASSIST.search(text)
    if not m:
        return {}
    res = {"assistant_s": float(m[2]), "assistant_rss_bytes": int(m[3]) << 20}
    if m[4] is not None:
        res.update(assistant_gpu_reserved_bytes=int(m[4]) << 20, assistant_gpu_in_use_bytes=int(m[5]) << 20)
    return res


def _end_group(p: subprocess.Popen, grace: float = 10.0) -> None:
    """End the process group of a child started with start_new_session (its own children
    too: torchrun's workers outlive a SIGKILLed torchrun): SIGTERM, SIGKILL after ``grace``."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, None)):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            return
        try:
            p.wait(timeout=wait)
            if sig == signal.SIGTERM:
                os.killpg(p.pid, signal.SIGKILL)  # what is left of the group
            return
        except subprocess.TimeoutExpired:
            continue
        except ProcessLookupError:
            return


def run(cmd: list[str], timeout: float, env: dict | None = None) -> tuple[int, str, float]:
    """Run ``cmd`` (its own process group), output captured; on timeout or interruption its
    whole group is ended. (rc, stdout + stderr, wall s); rc 124 on timeout."""
    t0 = time.perf_counter()
    p = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
        start_new_session=True,
    )
    try:
        out, err = p.communicate(timeout=timeout)
        return p.returncode, out + err, time.perf_counter() - t0
    except subprocess.TimeoutExpired:
        _end_group(p)
        out, err = p.communicate()
        return 124, (out or "") + (err or "") + f"\n(timed out after {timeout:g} s)", time.perf_counter() - t0
    except BaseException:
        _end_group(p)
        raise


def boot_fields(out: str) -> dict:
    m = BOOT.search(out)
    if not m:
        return {}
    return {
        "init_s": float(m[2]),
        "barrier_s": float(m[3]),
        "all_reduce_s": float(m[4]),
        "sandbox_gpu_reserved_bytes": int(m[5]),
        "sandbox_rss_bytes": int(m[6]),
    }


def emulated(n: int, devices: str, work: Path) -> dict:
    graph, out = work / f"graph{n}", work / f"emu{n}"
    rc, text, t_cap = run(
        [
            PRISM,
            "capture",
            "--mode",
            "solo",
            "--world",
            str(n),
            "--parallel",
            "2",
            "--layout",
            "tp=1,pp=1",
            "--out",
            str(graph),
            "--force",
            "--",
            PROGRAM,
        ],
        1800,
    )
    res: dict = {"world": n, "capture_wall_s": round(t_cap, 2)}
    if rc:
        res["error"] = "capture: " + text[-1500:]
        return res
    rc, text, t_emu = run(
        [
            PRISM,
            "emulate",
            "--graph",
            str(graph),
            "--sandbox",
            "0",
            "--devices",
            devices,
            "--inputs",
            "generated",
            "--out",
            str(out),
            "--force",
            "--",
            PROGRAM,
        ],
        1800,
    )
    res["emulate_wall_s"] = round(t_emu, 2)
    if rc:
        res["error"] = "emulate: " + text[-1500:]
        return res
    res.update(boot_fields(text))
    res.update(assistant_fields(text))
    return res


def vanilla_run(
    n: int, devices: str, program: str = PROGRAM, args: tuple | list = (), timeout: float = 1800
) -> tuple[int, str, float]:
    """The vanilla way: a real process per rank (`torch.distributed.run`); on GPU several per
    device, each told by NCCL_HOSTID that it is its own host (the program does that when
    PRISM_VANILLA_HOSTS=1), NVLink multicast off in every child. (rc, output, wall s)."""
    from prismllm.launch import NVLS_OFF_ENV

    env = {"PRISM_VANILLA_HOSTS": "1", "OMP_NUM_THREADS": "1", **NVLS_OFF_ENV}
    if devices == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n), program, *args],
        timeout,
        env,
    )


def vanilla(n: int, devices: str) -> dict:
    rc, text, wall = vanilla_run(n, devices)
    res = {"world": n, "wall_s": round(wall, 2), "ok": rc == 0}
    if rc:
        res["error"] = text[-800:]
    res.update(boot_fields(text))
    return res


def markdown(r: dict) -> str:
    m = r["machine"]
    lines = [
        f"Machine: {m.get('gpu') or 'CPU'} ×{m.get('gpus') or ''} {m.get('cpus')} cores, torch "
        f"{m.get('torch')}; devices {r['devices']}",
        "",
        "| N | init (s) | barrier (s) | all-reduce (s) | sandbox RSS (MiB) | sandbox GPU reserved (MiB) "
        "| assistant RSS (MiB) | assistant GPU reserved (MiB) | GPU in use (MiB) | prism emulate wall (s) "
        "| capture wall (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in r["emulated"]:
        if "error" in c:
            lines.append(f"| {c['world']} | failed: {c['error'][:80]!r} |")
            continue
        mib = lambda k: f"{c[k] / 2**20:.0f}" if k in c else "–"  # noqa: E731
        lines.append(
            f"| {c['world']} | {c.get('init_s', '–')} | {c.get('barrier_s', '–')} | "
            f"{c.get('all_reduce_s', '–')} | {mib('sandbox_rss_bytes')} | {mib('sandbox_gpu_reserved_bytes')} | "
            f"{mib('assistant_rss_bytes')} | {mib('assistant_gpu_reserved_bytes')} | {mib('assistant_gpu_in_use_bytes')} | "
            f"{c['emulate_wall_s']} | "
            f"{c['capture_wall_s']} |"
        )
    if r["vanilla"]:
        lines += [
            "",
            "Vanilla (a process per rank):",
            "",
            "| N | ok | init (s) | barrier (s) | all-reduce (s) | wall (s) |",
            "|---|---|---|---|---|---|",
        ]
        for c in r["vanilla"]:
            lines.append(
                f"| {c['world']} | {c['ok']} | {c.get('init_s', '–')} | {c.get('barrier_s', '–')} | "
                f"{c.get('all_reduce_s', '–')} | {c['wall_s']} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--worlds", default="64,256,1024,4096,8192")
    ap.add_argument("--vanilla", default="16,64", help="world sizes for the vanilla way (stops at the first failure)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    res = {
        "benchmark": "emulate_bootstrap",
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
        "devices": a.devices,
        "emulated": [],
        "vanilla": [],
    }
    with tempfile.TemporaryDirectory(prefix="prism-boot-") as tmp:
        for n in [int(x) for x in a.worlds.split(",") if x]:
            c = emulated(n, a.devices, Path(tmp))
            print(json.dumps(c), flush=True)
            res["emulated"].append(c)
    for n in [int(x) for x in a.vanilla.split(",") if x]:
        c = vanilla(n, a.devices)
        print(json.dumps(c), flush=True)
        res["vanilla"].append(c)
        if not c["ok"]:
            break
    path = Path(a.json or ROOT / "benchmarks" / "results" / f"emulate_bootstrap_{a.devices}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1) + "\n")
    path.with_suffix(".md").write_text(markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
