"""``--cuda-on-cpu`` (prismllm.devicemap) and NCCL's reduce ops on recorded gloo groups
(prismllm.comm.redops): tests/programs/cuda_named.py, a program that names CUDA and NCCL
everywhere (what Megatron-core and torchtitan do), recorded on CPU processes, then emulated
with rank 1 real and rank 0 virtual: the graph keeps the mapping and premul_sum's factor."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
import torch.distributed as dist
from conftest import PRISM

from prismllm.capture.common import resolve_devices
from prismllm.capture.record import RecordOptions, choose_recorder
from prismllm.childenv import ChildEnv
from prismllm.comm.recorder import redop_name
from prismllm.devicemap import map_backend
from prismllm.errors import PrismError
from prismllm.launch.sandbox import sandbox_devices
from prismllm.trace.schema import split_reduce_op

ROOT = Path(__file__).resolve().parents[1]
PROGRAM = str(ROOT / "tests" / "programs" / "cuda_named.py")

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="maps CUDA onto a CPU-only torch")


def test_backend_strings_map_device_by_device():
    assert map_backend("nccl") == "gloo"
    assert map_backend("gloo") == "gloo"
    assert map_backend("cuda:nccl,cpu:gloo") == "cpu:gloo"
    assert map_backend("cpu:gloo,cuda:nccl") == "cpu:gloo"
    assert map_backend(None) is None


def test_premul_sum_keeps_its_factor_in_the_graph():
    assert redop_name(dist.ReduceOp.PREMUL_SUM(0.25)) == "premul_sum:0.25"
    assert redop_name(dist._make_nccl_premul_sum(torch.tensor(0.5))) == "premul_sum:0.5"
    assert split_reduce_op("premul_sum:0.25") == ("premul_sum", 0.25)
    assert split_reduce_op("avg") == ("avg", None)


def test_premul_factor_without_the_factor_attribute():
    """torch 2.11's ReduceOp has no ``.factor``: the factor is read from its pickled state."""
    from prismllm.comm.recorder import premul_factor

    class ReduceOpOf211:  # what torch 2.11 gives: no .factor, the state (RedOpType, factor)
        def __getstate__(self):
            return (dist.ReduceOp.RedOpType.PREMUL_SUM, 0.75)

    assert premul_factor(ReduceOpOf211()) == 0.75
    assert premul_factor(dist.ReduceOp.PREMUL_SUM(0.25)) == 0.25


def test_a_gpu_is_refused_and_the_python_recorder_taken(tmp_path):
    for devices in ("cuda", "cuda:0,1"):
        with pytest.raises(PrismError, match="--cuda-on-cpu"):
            resolve_devices(devices, 2, cuda_on_cpu=True)
        with pytest.raises(PrismError, match="--cuda-on-cpu"):
            sandbox_devices(devices, 2, cuda_on_cpu=True)
    assert resolve_devices("auto", 2, cuda_on_cpu=True) == ("cpu", "cpu")
    assert sandbox_devices("auto", 2, cuda_on_cpu=True).kind == "cpu"
    opts = RecordOptions(nproc=2, out=tmp_path, script=PROGRAM, cuda_on_cpu=True)
    assert choose_recorder(opts) == "python"  # the native backend has no AVG/PREMUL_SUM step on gloo
    opts.recorder = "native"
    with pytest.raises(PrismError, match="--cuda-on-cpu records through the Python path"):
        choose_recorder(opts)


def test_without_the_mapping_the_program_fails_as_it_would(tmp_path):
    prog = tmp_path / "cuda_program.py"
    prog.write_text('import torch\ntorch.cuda.set_device(0)\nprint(torch.ones(2, device="cuda").is_cuda)\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRISM_")}
    run = [sys.executable, "-m", "prismllm.comm.bootstrap", str(prog)]
    plain = subprocess.run(run, env=env, capture_output=True, text=True, timeout=120)
    assert plain.returncode != 0
    mapped = subprocess.run(
        run, env={**env, **ChildEnv(cuda_on_cpu=True).to_env()}, capture_output=True, text=True, timeout=120
    )
    assert mapped.returncode == 0 and mapped.stdout.strip() == "True", mapped.stderr


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    base = tmp_path_factory.mktemp("devicemap")
    out, seen = base / "rec", base / "seen.json"
    p = subprocess.run(
        [PRISM, "record", "--nproc", "2", "--devices", "cpu", "--cuda-on-cpu", "--out", str(out),
         "--save-tensors", "all,inputs", "--timeout", "240", "--", PROGRAM, str(seen)],
        capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return base, out, json.loads(seen.read_text())


def test_a_cuda_program_runs_on_cpu_processes(recorded):
    _, out, seen = recorded
    assert seen["backend"] == "gloo" and seen["mesh_device_type"] == "cpu" and seen["devices"] == ["cpu"]
    assert seen["current_device"] == 1  # set_device(LOCAL_RANK) kept
    assert seen["is_cuda"] and seen["type"] == "torch.cuda.FloatTensor" and seen["cast"] == "torch.float16"
    assert seen["elapsed_ms_ok"] and seen["max_memory_allocated"] == 0 and seen["memory_stats_peak"] == 0
    assert seen["capability"] == [8, 0] and seen["autocast_dtype"] == "torch.bfloat16"
    assert seen["rng_replayed"] and seen["custom_backward"] == [2.0, 2.0, 2.0]
    # NCCL's semantics on gloo: AVG of 1 and 2; PREMUL_SUM(0.5) of 1 and 2; reduce-scatter AVG
    assert seen["avg"] == [1.5] * 4 and seen["premul"] == [1.5] * 4
    assert seen["rs_avg"] == [3.0, 4.5]  # rank 1's half of ([0,1,2,3] + [0,2,4,6]) / 2
    assert seen["dtensor_sum"] == 28.0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["cuda_on_cpu"] is True and manifest["recorder"] == "python"
    ops = set(pq.read_table(out / "nodes.parquet", columns=["reduce_op"]).column("reduce_op").to_pylist())
    assert {"avg", "premul_sum:0.5", "premul_sum:1.0"} <= ops


def test_emulated_rank_1_equals_the_real_run(recorded):
    """The graph's manifest maps the emulation too (no flag); the proxy multiplies the virtual
    rank's inputs by premul_sum's factor; every pruned output equals the recording's."""
    base, out, real = recorded
    seen = base / "emu-seen.json"
    p = subprocess.run(
        [PRISM, "emulate", "--graph", str(out), "--sandbox", "1", "--out", str(base / "emu"), "--check",
         "--timeout", "240", "--", PROGRAM, str(seen)],
        capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    emu = json.loads(seen.read_text())
    for key in ("losses", "avg", "premul", "rs_avg", "dtensor_sum", "custom_backward"):
        assert emu[key] == real[key], key
    check = json.loads((base / "emu" / "check-rank-1.json").read_text())
    assert check["compared"] > 0 and check["max_abs_diff"] == 0, check
