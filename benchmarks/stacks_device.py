"""The GPU checks of the stacks and the planning questions, one part per device call (under 10
minutes each), from the repository root on the device machine:

    python3 benchmarks/stacks_device.py PART [--out DIR] [--devices cuda:0,0]

PART:
  megatron     examples/megatron_gpt.py (Megatron-core) on one GPU shared by 2 ranks, per layout
               (TP2, PP2, DP2 with the distributed optimizer, MoE EP2 three ways: plain, its solo
               capture answered with the recording's tensors, a forced skewed routing): the real run
               (`prism record --save-tensors`) and the solo capture, structure and per-rank peak
               memory compared; the real graph emulated with rank 1 real and --check: its losses
               and gradient norms against the real run's, its peak memory
  megatron-scale  solo capture of megatron_gpt.py at 1024 ranks (TP8·PP8, and MoE EP8·PP8) and
               8192 (TP8·PP8) on one GPU: wall time, ranks run, per-rank peak memory beside the
               theoretical weights + optimizer of Megatron-LM's formula (benchmarks/megatron_memory.py)
  torchtitan   examples/torchtitan/train.py (torchtitan's trainer, Llama 3 debugmodel) as megatron, at
               FSDP2 and TP2 (install the carried wheels first: docs/stacks/torchtitan.md)
  moe          gpt3d EP2 with a balanced and a skewed forced routing (--routing): the real run and
               the solo capture, per-rank peak memory to the byte; a memory cap between the two
               peaks (gpt3d --memory-cap-mib) makes the skewed run, and its capture, run out of
               memory at the same rank
  moe-1024     `prism run` of gpt3d PP4·EP8 at 1024 ranks under the skewed routing on one GPU (solo
               capture 16 at a time, time, calibrate, report): the per-rank peak memory spread and
               the report's heat map over pipeline stage x expert-parallel rank

Each part writes OUT/PART.json (and logs); every program keeps NVLink multicast off.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MEGATRON = str(ROOT / "examples" / "megatron_gpt.py")
GPT3D = str(ROOT / "examples" / "gpt3d.py")
ONE_GPU_16 = "cuda:" + ",".join(["0"] * 16)  # 16 solo ranks at a time on one GPU
ENV = {
    **os.environ,
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "PYTHONUNBUFFERED": "1",
    "OMP_NUM_THREADS": "1",
}


def prism_bin() -> str:
    p = Path(sys.executable).with_name("prism")
    return str(p) if p.exists() else "prism"


CAP_MIB = 0  # moe-oom's memory cap when given (--cap-mib)
PROFILED: list[str] = []  # megatron-scale --profile-rank: the program runs under profile_rank.py
RESULT: dict = {}  # this part's figures, written to OUT/PART.json after every case (a timeout keeps them)
SAVE: list[Path] = []


def save() -> None:
    SAVE[0].write_text(json.dumps(RESULT, indent=1) + "\n")


def run(out: Path, name: str, *args: str, timeout: float = 300) -> dict:
    """One prism command; its output in OUT/NAME.log; returns rc, wall time and the log's tail."""
    t0 = time.monotonic()
    with open(out / f"{name}.log", "w") as log:
        try:
            p = subprocess.run([prism_bin(), *args], stdout=log, stderr=subprocess.STDOUT, env=ENV, timeout=timeout)
            rc = p.returncode
        except subprocess.TimeoutExpired:
            rc = 124
    text = (out / f"{name}.log").read_text(errors="replace")
    r = {"rc": rc, "wall_s": round(time.monotonic() - t0, 1), "tail": text[-600:] if rc else ""}
    print(f"{name}: rc {rc}, {r['wall_s']} s", flush=True)
    return r


def manifest(d: Path) -> dict:
    try:
        return json.loads((d / "manifest.json").read_text())
    except OSError:
        return {}


def peaks(d: Path) -> dict[str, int]:
    return {k: int(v) for k, v in (manifest(d).get("peak_memory_bytes") or {}).items()}


def compare(out: Path, a: Path, b: Path, name: str) -> str:
    p = subprocess.run([prism_bin(), "compare", str(a), str(b)], capture_output=True, text=True, env=ENV)
    (out / f"{name}.log").write_text(p.stdout + p.stderr)
    m = re.search(r"structure: (.*)", p.stdout)
    return m.group(1).strip() if m else f"compare failed: {p.stderr[-300:]}"


def emulated_peak(d: Path) -> dict:
    try:
        e = json.loads((d / "emulate.json").read_text())
    except OSError:
        return {}
    return {r: m.get("peak_memory_bytes") for r, m in (e.get("sandbox_results") or {}).items()}


# ---------------------------------------------------------------------- parts
MEGATRON_SIZES = ["--layers", "4", "--hidden", "512", "--heads", "8", "--vocab", "8192", "--seq-len", "256",
                  "--micro-batch", "2", "--global-batch", "8", "--iters", "3"]  # fmt: skip
EMULATE_TIMEOUT = os.environ.get("EMULATE_TIMEOUT", "240")
MEGATRON_LAYOUTS = {
    "tp2": ["--tp", "2"],
    "pp2": ["--pp", "2"],
    "dp2-distopt": ["--dist-opt"],
    "ep2": ["--ep", "2", "--num-experts", "4"],
    "ep2-tensors": ["--ep", "2", "--num-experts", "4"],
    "ep2-routed": ["--ep", "2", "--num-experts", "4"],
}
SKEW = {"default": {"br_min": 0.7, "br_max": 2.2, "br_avg": 1.0, "br_std": 0.45, "br_med": 0.9, "br_skew": 1.5}}


def megatron_prism_flags(name: str, out: Path, real: Path) -> tuple[list[str], list[str]]:
    """The prism flags of a case's record and capture: ep2-tensors answers the solo capture's
    collectives with the recording's tensors (the router's real choices); ep2-routed forces a
    skewed routing on Megatron-core's TopKRouter in both."""
    if name == "ep2-tensors":
        return [], ["--tensors", str(real / "tensors")]
    if name == "ep2-routed":
        (out / "skew.json").write_text(json.dumps(SKEW))
        routed = ["--router-module", "TopKRouter:gating", "--routing", str(out / "skew.json")]
        return routed, routed
    return [], []


def losses(log: Path) -> list[list[str]]:
    """``lm loss`` and ``grad norm`` of every iteration examples/megatron_gpt.py's last rank printed."""
    return [list(m) for m in re.findall(r"lm loss: (\S+) \| grad norm: (\S+)", log.read_text(errors="replace"))]


def part_megatron(out: Path, devices: str, cases: list[str]) -> dict:
    """Per layout: the real 2-rank run recorded with its tensors, the solo capture (structure and
    per-rank peak memory against the real run), and the real graph emulated with rank 1 real
    (``--check``: its losses and gradient norms against the real run's, and its peak memory)."""
    res = {}
    for name, flags in MEGATRON_LAYOUTS.items():
        if cases and name not in cases:
            continue
        real = out / f"mg-{name}-real"
        for_record, for_capture = megatron_prism_flags(name, out, real)
        res[name] = stack_case(
            out, f"mg-{name}", [MEGATRON, *flags, *MEGATRON_SIZES], devices, for_record, for_capture,
            lambda side: losses(out / f"mg-{name}-{side}.log"),
        )  # fmt: skip
        res[name]["flags"] = flags
    return res


def stack_case(out: Path, name: str, prog: list[str], devices: str, for_record: list[str], for_capture: list[str],
               losses_of: Callable[[str], list], dump: Callable[[str], list[str]] = lambda side: []) -> dict:  # fmt: skip
    """One layout of a stack: the real 2-rank run recorded with its tensors, the solo capture
    (structure, per-rank peak memory), the real graph emulated with rank 1 real and ``--check``
    (its losses, from ``losses_of("record")`` and ``losses_of("emulate")``, and its peak memory).
    ``dump(side)``: the program's arguments naming that run's own output folder."""
    real, solo, emu = out / f"{name}-real", out / f"{name}-solo", out / f"{name}-emu"
    r: dict = {"prism_flags": [for_record, for_capture]}
    r["record"] = run(out, f"{name}-record", "record", "--nproc", "2", "--devices", devices, "--out", str(real),
                      "--save-tensors", "all,inputs", *for_record, "--force", "--timeout", "240", "--", *prog,
                      *dump("record"))  # fmt: skip
    r["capture"] = run(out, f"{name}-capture", "capture", "--world", "2", "--devices", devices, "--parallel", "2",
                       "--out", str(solo), *for_capture, "--force", "--timeout", "240", "--", *prog,
                       *dump("capture"))  # fmt: skip
    r["structure"] = compare(out, real, solo, f"{name}-compare")
    r["peak_real"], r["peak_solo"] = peaks(real), peaks(solo)
    r["peak_equal"] = bool(r["peak_real"]) and r["peak_real"] == r["peak_solo"]
    r["emulate"] = run(out, f"{name}-emulate", "emulate", "--graph", str(real), "--sandbox", "1", "--devices",
                       devices, "--check", "--out", str(emu), "--force", "--timeout", EMULATE_TIMEOUT, "--", *prog,
                       *dump("emulate"))  # fmt: skip
    r["peak_emulated"] = emulated_peak(emu)
    r["losses_real"], r["losses_emulated"] = losses_of("record"), losses_of("emulate")
    r["losses_equal"] = bool(r["losses_real"]) and r["losses_real"] == r["losses_emulated"]
    m = re.search(r"max abs diff [^\n]*", (out / f"{name}-emulate.log").read_text(errors="replace"))
    r["check"] = m.group(0) if m else None
    RESULT[name] = r
    save()
    print(json.dumps({k: v for k, v in r.items() if k not in ("record", "capture", "emulate")}), flush=True)
    return r


TORCHTITAN = str(ROOT / "examples" / "torchtitan" / "train.py")
TORCHTITAN_LAYOUTS = {
    "fsdp2": ["--parallelism.data-parallel-shard-degree", "2"],
    "tp2": ["--parallelism.tensor-parallel-degree", "2"],
}


def part_torchtitan(out: Path, devices: str, cases: list[str]) -> dict:
    """torchtitan's own trainer (examples/torchtitan/train.py, Llama 3 debugmodel, local assets)
    per layout, as part megatron: structure, peak memory, and rank 1's full-precision losses and
    gradient norms (TensorBoard, examples/torchtitan/losses.py) emulated against the real run's."""
    assets = out / "tt-assets"
    subprocess.run([sys.executable, str(ROOT / "examples" / "torchtitan" / "make_assets.py"), str(assets)], check=True,
                   env=ENV, stdout=subprocess.DEVNULL)  # fmt: skip
    base = [TORCHTITAN, "--module", "prism_configs", "--config", "llama3_debugmodel_cpu", "--hf-assets-path",
            str(assets / "tokenizer"), "--dataloader.dataset-path", str(assets / "c4_test")]  # fmt: skip

    def tt_losses(name: str, side: str) -> list:
        p = subprocess.run([sys.executable, str(ROOT / "examples" / "torchtitan" / "losses.py"),
                            str(out / f"tt-{name}-{side}-dump"), "1"], capture_output=True, text=True, env=ENV)  # fmt: skip
        return p.stdout.split()

    res = {}
    for name, flags in TORCHTITAN_LAYOUTS.items():
        if cases and name not in cases:
            continue
        res[name] = stack_case(
            out, f"tt-{name}", [*base, *flags], devices, [], [],
            lambda side, name=name: tt_losses(name, side),
            lambda side, name=name: ["--dump-folder", str(out / f"tt-{name}-{side}-dump")],
        )  # fmt: skip
    return res


def part_megatron_scale(out: Path, devices: str, only: list[str]) -> dict:
    from benchmarks.megatron_memory import Model, activation_bytes_per_layer, weights_and_optimizer_bytes

    sizes = ["--layers", "16", "--hidden", "1024", "--heads", "16", "--vocab", "32768", "--seq-len", "512",
             "--micro-batch", "1", "--global-batch", "{gb}", "--iters", "2"]  # fmt: skip
    cases = [
        ("dense1024", 1024, "tp=8,pp=8", ["--tp", "8", "--pp", "8"], 0, 1),
        ("moe1024", 1024, "pp=8,ep=8", ["--pp", "8", "--ep", "8", "--num-experts", "16"], 16, 8),
        ("dense8192", 8192, "tp=8,pp=8", ["--tp", "8", "--pp", "8"], 0, 1),
    ]
    res = {}
    for name, world, layout, flags, experts, ep in cases:
        if only and name not in only:
            continue
        tp = 8 if "tp=8" in layout else 1
        dp = world // (tp * 8)
        gb = str(dp * 8)  # 8 micro-batches per replica
        prog = [*PROFILED, MEGATRON, *flags, *[gb if s == "{gb}" else s for s in sizes]]
        d = out / f"scale-{name}"
        r = {"world": world, "layout": layout}
        r["capture"] = run(out, f"scale-{name}", "capture", "--world", str(world), "--layout", layout, "--devices",
                           ONE_GPU_16, "--parallel", "16", "--out", str(d), "--force", "--timeout", "400", "--", *prog,
                           timeout=420)  # fmt: skip
        m = manifest(d)
        cap = m.get("capture") or {}
        p = {int(k): v for k, v in (m.get("peak_memory_bytes") or {}).items() if v >= 0}
        r["ranks_run"] = cap.get("ranks_run")
        r["capture_wall_s"] = cap.get("wall_s")
        if p:
            r["peak_max"] = max(p.values())
            r["peak_max_rank"] = max(p, key=p.get)
            r["peak_min"] = min(p.values())
            r["peak_min_rank"] = min(p, key=p.get)
        model = Model(layers=16, hidden=1024, heads=16, vocab=32768, ffn=4096, experts=experts, seq=512,
                      micro_batch=1, tp=tp, pp=8, ep=ep, dp=dp, bytes_weight=4, dist_opt=False)  # fmt: skip
        r["formula_weights_optimizer_most_loaded"] = weights_and_optimizer_bytes(model)
        # 1F1B: the first stage holds pp micro-batches in flight, each through its layers/pp layers
        r["formula_activations_first_stage_1f1b"] = activation_bytes_per_layer(model, 4) * model.layers
        r["formula_total_first_stage"] = (
            r["formula_weights_optimizer_most_loaded"] + r["formula_activations_first_stage_1f1b"]
        )
        res[name] = r
        RESULT[name] = r
        save()
        print(json.dumps(r), flush=True)
    return res


def part_moe(out: Path, devices: str, cases: list[str]) -> dict:
    skew = out / "skew.json"
    skew.write_text(json.dumps(SKEW))
    bal = out / "balanced.json"
    bal.write_text(json.dumps({"default": "balanced"}))
    prog = [GPT3D, "--ep", "2", "--num-experts", "8", "--topk", "2", "--layers", "4", "--hidden", "1024", "--heads",
            "16", "--seq", "2048", "--micro-batch", "4", "--global-batch", "16", "--iters", "2"]  # fmt: skip
    res: dict = {}
    for name, routing in (("balanced", bal), ("skewed", skew)):
        force = ["--router-module", "Router", "--routing", str(routing)]
        r = {}
        r["record"] = run(out, f"moe-{name}-record", "record", "--nproc", "2", "--devices", devices, *force, "--out",
                          str(out / f"moe-{name}-real"), "--force", "--", *prog)  # fmt: skip
        r["capture"] = run(out, f"moe-{name}-capture", "capture", "--world", "2", "--devices", devices, "--parallel",
                           "2", *force, "--out", str(out / f"moe-{name}-solo"), "--force", "--", *prog)  # fmt: skip
        r["structure"] = compare(out, out / f"moe-{name}-real", out / f"moe-{name}-solo", f"moe-{name}-compare")
        r["peak_real"] = peaks(out / f"moe-{name}-real")
        r["peak_solo"] = peaks(out / f"moe-{name}-solo")
        r["peak_equal"] = bool(r["peak_real"]) and r["peak_real"] == r["peak_solo"]
        res[name] = r
        RESULT[name] = r
        save()
        print(json.dumps({k: v for k, v in r.items() if k not in ("record", "capture")}), flush=True)
    # a cap between the balanced and the skewed peak: only the skewed run runs out
    b, s = res["balanced"]["peak_real"], res["skewed"]["peak_real"]
    if b and s and max(s.values()) > max(b.values()):
        cap_mib = (max(b.values()) + max(s.values())) // 2 // 2**20
        capped = [*prog, "--memory-cap-mib", str(cap_mib)]
        oom: dict = {"cap_mib": cap_mib}
        for name, routing in (("balanced", bal), ("skewed", skew)):
            force = ["--router-module", "Router", "--routing", str(routing)]
            oom[f"{name}_record"] = run(out, f"oom-{name}-record", "record", "--nproc", "2", "--devices", devices,
                                        *force, "--out", str(out / f"oom-{name}-real"), "--force", "--", *capped)  # fmt: skip
            oom[f"{name}_capture"] = run(out, f"oom-{name}-capture", "capture", "--world", "2", "--devices", devices,
                                         "--parallel", "2", *force, "--out", str(out / f"oom-{name}-solo"), "--force",
                                         "--", *capped)  # fmt: skip
        res["oom"] = RESULT["oom"] = oom
        save()
        print(json.dumps({k: (v["rc"], v["tail"][-300:]) if isinstance(v, dict) else v for k, v in oom.items()}),
              flush=True)  # fmt: skip
    return res


def part_moe_1024(out: Path, devices: str, cases: list[str]) -> dict:
    """1024 logical ranks (PP4·EP8, 16 experts) under the skewed routing: `prism run` (solo capture
    16 at a time on one GPU, time, calibrate, report): the per-rank peak memory spread, and the
    report's heat map of it over pipeline stage x expert-parallel rank."""
    skew = out / "skew.json"
    skew.write_text(json.dumps(SKEW))
    big = [GPT3D, "--pp", "4", "--ep", "8", "--num-experts", "16", "--topk", "2", "--layers", "8", "--hidden", "1024",
           "--heads", "16", "--seq", "2048", "--micro-batch", "2", "--global-batch", "2048", "--iters", "2"]  # fmt: skip
    d = out / "moe1024-run"
    # 16 at a time: a capture rank takes one device entry, a time slice two (sandbox, assistant)
    r = run(out, "moe1024-run", "run", "--world", "1024", "--layout", "pp=4,ep=8", "--devices", ONE_GPU_16 + ",0" * 16,
            "--parallel", "16", "--router-module", "Router", "--routing", str(skew), "--out", str(d), "--force",
            "--", *big, timeout=540)  # fmt: skip
    res: dict = {"run": r, "ranks_run": (manifest(d / "bare").get("capture") or {}).get("ranks_run")}
    p = {int(k): v for k, v in peaks(d / "bare").items() if v >= 0}
    if p:
        hi, lo = max(p.values()), min(p.values())
        res.update(
            # the lowest rank holding it, as the report names it (replicas share their peak)
            peak_max=hi, peak_max_rank=min(r for r, v in p.items() if v == hi),
            peak_min=lo, peak_min_rank=min(r for r, v in p.items() if v == lo),
            spread=(hi - lo) / lo,
        )  # fmt: skip
    summary = d / "cal" / "summary.json"
    if summary.is_file():
        res["predicted_iteration_ns"] = json.loads(summary.read_text()).get("predicted_iteration_ns")
    print(json.dumps({k: v for k, v in res.items() if k != "run"}), flush=True)
    return res


def _oom_rank(log: Path) -> int | None:
    m = re.search(r"rank (\d+) (?:ran out of memory|.*OutOfMemoryError)", log.read_text(errors="replace"))
    return int(m.group(1)) if m else None


def part_moe_oom(out: Path, devices: str, cases: list[str]) -> dict:
    """EP4 with one expert a rank and a large expert MLP, so that skew moves gigabytes: the rank
    that hosts a hot expert holds its tokens' activations. A cap between the balanced and the
    skewed peak: the skewed run runs out of memory, the balanced one does not, real and solo alike."""
    skew = out / "skew4.json"
    skew.write_text(json.dumps({"default": {"br_min": 0.5, "br_max": 2.2, "br_avg": 1.0, "br_std": 0.75,
                                            "br_med": 0.65, "br_skew": 1.1}}))  # fmt: skip
    bal = out / "balanced.json"
    bal.write_text(json.dumps({"default": "balanced"}))
    dev4 = "cuda:0,0,0,0"
    prog = [GPT3D, "--ep", "4", "--num-experts", "4", "--topk", "1", "--layers", "2", "--hidden", "1024", "--heads",
            "16", "--ffn-hidden", "16384", "--seq", "2048", "--micro-batch", "8", "--global-batch", "32", "--iters",
            "2"]  # fmt: skip
    res: dict = {}
    if CAP_MIB:  # the cap is known from an earlier run of this part: the capped runs only
        return _moe_oom_capped(out, res, prog, CAP_MIB, skew, bal)
    for name, routing in (("balanced", bal), ("skewed", skew)):
        d = out / f"ep4-{name}-real"
        res[name] = {"record": run(out, f"ep4-{name}-record", "record", "--nproc", "4", "--devices", dev4,
                                   "--router-module", "Router", "--routing", str(routing), "--out", str(d), "--force",
                                   "--", *prog), "peak_real": peaks(d)}  # fmt: skip
        RESULT[name] = res[name]
        save()
    b, s_ = res["balanced"]["peak_real"], res["skewed"]["peak_real"]
    if not (b and s_):
        return res
    return _moe_oom_capped(out, res, prog, (max(b.values()) + max(s_.values())) // 2 // 2**20, skew, bal)


def _moe_oom_capped(out: Path, res: dict, prog: list[str], cap: int, skew: Path, bal: Path) -> dict:
    dev4 = "cuda:0,0,0,0"
    res["cap_mib"] = RESULT["cap_mib"] = cap
    for name, routing in (("skewed", skew), ("balanced", bal)):
        force = ["--router-module", "Router", "--routing", str(routing)]
        capped = [*prog, "--memory-cap-mib", str(cap)]
        r = {}
        r["record"] = run(out, f"cap-{name}-record", "record", "--nproc", "4", "--devices", dev4, *force, "--out",
                          str(out / f"cap-{name}-real"), "--force", "--", *capped)  # fmt: skip
        r["capture"] = run(out, f"cap-{name}-capture", "capture", "--world", "4", "--devices", dev4, "--parallel",
                           "4", *force, "--out", str(out / f"cap-{name}-solo"), "--force", "--", *capped)  # fmt: skip
        r["record_oom_rank"] = _oom_rank(out / f"cap-{name}-record.log")
        r["capture_oom_rank"] = _oom_rank(out / f"cap-{name}-capture.log")
        r["peak_real"], r["peak_solo"] = peaks(out / f"cap-{name}-real"), peaks(out / f"cap-{name}-solo")
        res[f"capped_{name}"] = RESULT[f"capped_{name}"] = r
        save()
        print(json.dumps({k: (v.get("rc", v) if isinstance(v, dict) else v) for k, v in r.items()}), flush=True)
    return res


PARTS = {
    "megatron": part_megatron,
    "torchtitan": part_torchtitan,
    "megatron-scale": part_megatron_scale,
    "moe": part_moe,
    "moe-oom": part_moe_oom,
    "moe-1024": part_moe_1024,
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("part", choices=sorted(PARTS))
    ap.add_argument("--out", default=os.environ.get("OUT", "out/device"))
    ap.add_argument("--devices", default="cuda:0,0")
    ap.add_argument("--cases", default="", help="comma-separated cases of the part (default: all)")
    ap.add_argument("--cap-mib", type=int, default=0, help="moe-oom: the memory cap, skipping the uncapped runs")
    ap.add_argument("--profile-rank", type=int, default=None,
                    help="megatron-scale: profile this rank's program (OUT/profile/rankR.txt)")  # fmt: skip
    a = ap.parse_args()
    global CAP_MIB
    CAP_MIB = a.cap_mib
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.profile_rank is not None:
        PROFILED.append(str(ROOT / "benchmarks" / "programs" / "profile_rank.py"))
        ENV.update(PROFILE_RANK=str(a.profile_rank), PROFILE_OUT=str((out / "profile").resolve()))
    SAVE.append(out / f"{a.part}.json")
    RESULT.update(PARTS[a.part](out, a.devices, [c for c in a.cases.split(",") if c]))
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
