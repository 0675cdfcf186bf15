"""Solo mode (PRISM_MODE=solo): one rank of a world of N runs alone on the GeneratedBackend;
its recorded graph must equal the same rank's graph from a real recorded run.

Costly part: the real 8-rank record runs (8 Python processes on a small machine). Sizes are
tiny and every fixture is module-scoped; two of the four gpt3d layouts are the session's shared
recordings of test_emulate_n8's commands (conftest.gpt3d_recording), read from their graphs.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import GPT3D, gpt3d_sizes

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from prismllm.launch import LaunchSpec, launch  # noqa: E402
from prismllm.trace import PrismTrace  # noqa: E402
from prismllm.trace.assemble import assemble_spool  # noqa: E402
from prismllm.trace.ranklog import ranklog_path, read_ranklog  # noqa: E402
from prismllm.trace.schema import TENSORS_DIR  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_gloo_available(), reason="needs gloo")

ROOT = Path(__file__).resolve().parents[1]
COLL = ROOT / "tests" / "programs" / "collectives.py"
TINY = gpt3d_sizes(layers=4, seq=8, vocab=64, global_batch=8, iters=2, bucket_mb="0.002")
# gpt3d's arguments per layout. The dense TP2·PP2·DP2 and the MoE ones are test_emulate_n8's
# commands at N = 8 (the layout first, then TINY; no gradient clipping in the dense one: its
# all-reduce on the default group is in the two others), so their real runs are the session's
# shared recordings (conftest.gpt3d_recording), which save tensors: they record through the
# Python path like the runs made here, and the MoE one holds the routing counts an exact replay
# needs. Each saves 8 Python processes.
LAYOUTS = {
    "tp2pp2dp2": ["--tp", "2", "--pp", "2", "--clip-grad", "0", *TINY],
    "pp4": [*TINY, "--pp", "4"],
    "pp2vpp2dp2_distopt": [*TINY, "--pp", "2", "--vpp", "2", "--dist-opt"],
    "tp2dp4_moe_ep4": ["--tp", "2", "--ep", "4", "--num-experts", "4", "--topk", "2", *TINY],
}
SHARED = ("tp2pp2dp2", "tp2dp4_moe_ep4")
SOLO_RANK = 5  # TP rank 1 (receives the token broadcast), not on the first stage
KEYS = ("kind", "op", "api", "seq", "peer", "tag", "reduce_op", "dtype", "shape", "in_bytes",
        "out_bytes", "in_splits", "out_splits", "coalesced", "async_op", "wait_index",
        "iteration", "label")  # fmt: skip


def rows(log, skip=()):
    """Node rows without times, the group named by its global ranks."""
    g = {x.name: tuple(x.ranks) for x in log.groups}
    return [(g.get(n["group_name"], ()),) + tuple(None if k in skip and n["op"] == "all_to_all"
                                                  else n[k] for k in KEYS)
            for n in log.nodes]  # fmt: skip


def graph_log(trace, rank):
    """What ``rank``'s rank log held, read back from a recorded graph (a PrismTrace): assembly
    keeps each rank's rows (test_assembly_keeps_each_ranks_rows) and torch's group names, which
    count the groups in order of creation, so the rank's groups are those with it as a member,
    ordered by name."""
    info = trace.group_info()
    nodes = [{**n, "group_name": info[n["group"]]["name"] if n["group"] >= 0 else ""}
             for n in trace.nodes_of(rank).to_pylist()]  # fmt: skip
    groups = sorted((SimpleNamespace(name=g["name"], ranks=g["ranks"]) for g in info.values() if rank in g["ranks"]),
                    key=lambda g: int(g.name))  # fmt: skip
    return SimpleNamespace(nodes=nodes, groups=groups)


def record(script, nproc, args, spool, env=None):
    # the Python recording path, like the solo run: the rows' ``api`` names the method the
    # backend was entered by, a C++ Backend method under native recording (`_allgather_base`)
    env = {"PRISM_MODE": "record", "PRISM_SPOOL": str(spool), "PYTHONWARNINGS": "ignore",
           "PRISM_NATIVE": "0", **(env or {})}  # fmt: skip
    res = launch(LaunchSpec(nproc=nproc, script=str(script), args=list(args), env=env,
                            passthrough=False, timeout=240))  # fmt: skip
    assert res.ok, res.message


def solo(script, world, rank, args, spool, env=None, timeout=240):
    e = {k: v for k, v in os.environ.items() if not k.startswith(("PRISM_", "TORCHELASTIC"))}
    e.update(PRISM_MODE="solo", RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0",
             LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="9",  # nothing listens
             PRISM_SPOOL=str(spool), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
             CUDA_VISIBLE_DEVICES="")  # fmt: skip
    e.update(env or {})
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "prismllm.comm.bootstrap", str(script), *args],
                       env=e, capture_output=True, text=True, timeout=timeout)  # fmt: skip
    p.wall = time.monotonic() - t0
    return p


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("solo")


# ---- collectives program ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def coll_record(tmp):
    store = tmp / "coll-store"
    record(COLL, 4, [], tmp / "coll-rec", env={"PRISM_SAVE_TENSORS": "all", "PRISM_TENSOR_STORE": str(store)})
    return tmp / "coll-rec", store


def _unchecked_collectives(tmp) -> Path:
    """collectives.py without its value checks (defaults give other values)."""
    src = COLL.read_text()
    src = src.replace("    assert torch.allclose(a, b), (a, b)", "    pass")
    src = re.sub(r"^assert (objs|lst) == .*$", "pass", src, flags=re.M)
    p = tmp / "collectives_unchecked.py"
    p.write_text(src)
    return p


@pytest.mark.parametrize("rank", [1, 2])
def test_collectives_solo_defaults_match_real_run(tmp, coll_record, rank):
    spool = tmp / f"coll-solo-{rank}"
    p = solo(_unchecked_collectives(tmp), 4, rank, [], spool)
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"COLLECTIVES OK {rank}" in p.stdout
    real = read_ranklog(ranklog_path(coll_record[0], rank))
    mine = read_ranklog(ranklog_path(spool, rank))
    # The broadcast_object_list payload on a non-source rank replicates the local objects
    # ([None, None] here), so its byte count differs from the source's ["hello", 42]:
    # compare everything else exactly, and that one row's shape only.
    a, b = rows(real), rows(mine)
    assert len(a) == len(b)
    diffs = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    for i in diffs:
        n = real.nodes[i]
        assert n["op"] == "broadcast" and n["dtype"] == "uint8", (a[i], b[i])
    assert len(diffs) <= 1
    assert [x.ranks for x in real.groups] == [x.ranks for x in mine.groups]


def test_collectives_solo_store_replay_is_exact(tmp, coll_record):
    rec, store = coll_record
    spool = tmp / "coll-solo-store"
    p = solo(COLL, 4, 3, [], spool, env={"PRISM_TENSOR_STORE": str(store)})
    # Replayed values are the real ones: the program's own value checks pass.
    assert p.returncode == 0, p.stderr[-3000:]
    assert "COLLECTIVES OK 3" in p.stdout
    assert rows(read_ranklog(ranklog_path(rec, 3))) == rows(read_ranklog(ranklog_path(spool, 3)))


# ---- gpt3d ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpt_records(tmp, gpt3d_recording):
    """name -> (the real run's rank log of SOLO_RANK, or its graph's view of it; its tensor
    store; gpt3d's arguments for the solo run: the real run's, output paths aside)."""
    out = {}
    for name, args in LAYOUTS.items():
        if name in SHARED:
            rec = gpt3d_recording(8, args, save_tensors="all,inputs", save_params=True)
            trace = PrismTrace.load(rec.out)
            assert trace.manifest["recorder"] == "python"  # the rows' ``api``: see record()
            outputs = ["--json-log", str(tmp / f"{name}-solo.json"), "--save-params", str(tmp / f"{name}-params")]
            out[name] = (graph_log(trace, SOLO_RANK), rec.out / TENSORS_DIR, [*args, *outputs])
        else:
            record(GPT3D, 8, args, tmp / f"{name}-rec")
            out[name] = (read_ranklog(ranklog_path(tmp / f"{name}-rec", SOLO_RANK)), None, args)
    return out


def test_assembly_keeps_each_ranks_rows(tmp, gpt_records):
    """What graph_log relies on, on the pipeline layouts recorded here (P2P included): the graph
    assembled from a real run's rank logs gives back every rank's rows and groups."""
    for name in set(LAYOUTS) - set(SHARED):
        spool = tmp / f"{name}-rec"
        trace = assemble_spool(spool, {"mode": "record"})
        for r in range(8):
            log, view = read_ranklog(ranklog_path(spool, r)), graph_log(trace, r)
            assert rows(view) == rows(log), (name, r)
            assert [x.ranks for x in view.groups] == [x.ranks for x in log.groups], (name, r)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_gpt3d_solo_rank_matches_real_run(tmp, gpt_records, name):
    real, store, args = gpt_records[name]
    env = {}
    if "moe" in name:  # the recorded routing counts: an exact replay
        env = {"PRISM_TENSOR_STORE": str(store)}
    spool = tmp / f"{name}-solo"
    p = solo(GPT3D, 8, SOLO_RANK, args, spool, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    mine = read_ranklog(ranklog_path(spool, SOLO_RANK))
    assert sum(n["kind"] == "comm" for n in mine.nodes) > 10
    assert rows(real) == rows(mine)
    assert [x.ranks for x in real.groups] == [x.ranks for x in mine.groups]


def test_gpt3d_moe_defaults_give_consistent_balanced_splits(tmp, gpt_records):
    """Without the store, the replicated routing counts make every rank's split sizes
    consistent with what it sends and receives; only the split sizes differ from the real run."""
    real, _, args = gpt_records["tp2dp4_moe_ep4"]
    spool = tmp / "moe-defaults"
    p = solo(GPT3D, 8, SOLO_RANK, args, spool)
    assert p.returncode == 0, p.stderr[-3000:]
    mine = read_ranklog(ranklog_path(spool, SOLO_RANK))
    skip = ("in_bytes", "out_bytes", "in_splits", "out_splits", "shape")
    assert rows(real, skip) == rows(mine, skip)
    a2a = [n for n in mine.nodes if n["op"] == "all_to_all"]
    assert a2a
    hidden_bytes = 32 * 4
    for n in a2a:
        assert sum(n["in_splits"]) * hidden_bytes == n["in_bytes"]
        assert sum(n["out_splits"]) * hidden_bytes == n["out_bytes"]
    # dispatch (forward) receives the same count from every peer: balanced
    dispatch = a2a[0]
    assert len(set(dispatch["out_splits"])) == 1


def test_solo_world_1024_is_fast(tmp):
    spool = tmp / "w1024"
    args = ["--tp", "2", "--pp", "8", "--layers", "8", "--hidden", "32", "--heads", "4",
            "--vocab", "64", "--seq", "8", "--micro-batch", "1", "--global-batch", "64",
            "--iters", "2"]  # fmt: skip
    p = solo(GPT3D, 1024, 3, args, spool)
    assert p.returncode == 0, p.stderr[-3000:]
    log = read_ranklog(ranklog_path(spool, 3))
    assert log.world_size == 1024
    dp = [g for g in log.groups if len(g.ranks) == 64]
    assert dp and 3 in dp[0].ranks
    assert p.wall < 60, p.wall


BAD_RULE = """
import torch
from prismllm.generate import rule

@rule(op="broadcast", dtype=torch.int64)
def tokens(call):
    return torch.zeros(3, dtype=torch.int64)   # wrong shape
"""

GOOD_RULE = """
import atexit, os, torch
from prismllm.generate import rule
hits = []
atexit.register(lambda: open(os.environ["HITS"], "w").write(str(len(hits))))

@rule(op="broadcast", dtype=torch.int64, group_size=2)   # token ids from TP rank 0
def tokens(call):
    hits.append(call.index)
    return torch.randint(0, 64, call.shape, dtype=call.dtype)
"""


def test_user_rule_answers_token_broadcast(tmp):
    rules = tmp / "good_rules.py"
    rules.write_text(GOOD_RULE)
    hits = tmp / "hits.txt"
    p = solo(
        GPT3D, 8, 1, [*TINY, "--tp", "2", "--pp", "2"], tmp / "good", env={"PRISM_RULES": str(rules), "HITS": str(hits)}
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert int(hits.read_text()) == 2 * 4  # 2 iterations x 4 micro-batches on TP rank 1


def test_bad_rule_is_one_clear_line(tmp):
    rules = tmp / "bad_rules.py"
    rules.write_text(BAD_RULE)
    p = solo(GPT3D, 8, 1, [*TINY, "--tp", "2", "--pp", "2"], tmp / "bad", env={"PRISM_RULES": str(rules)})
    assert p.returncode == 3
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("prism: error: rank 1: broadcast on group ")
    assert "[0, 1]" in lines[0] and "call 0" in lines[0] and "rule 'tokens'" in lines[0]
    assert "shape (3,) int64" in lines[0] and "(2, 1, 8)" in lines[0]
    assert "Traceback" not in p.stderr


SUBGROUPS = """
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
r = dist.get_rank()
threads = len(os.listdir("/proc/self/task"))
gs = [dist.new_group([r, (r + 1 + i % 7) % 8]) for i in range(300)]
be = [g._get_backend(torch.device("cpu")) for g in gs]
assert all(type(b) is dist.ProcessGroupGloo and b is be[0] for b in be)
assert len(os.listdir("/proc/self/task")) == threads  # nothing per group
assert (gs[1].rank(), gs[1].size(), be[1].rank(), be[1].size()) == (0, 2, 0, 1)
ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4), process_group=gs[1])
ddp(torch.ones(2, 4)).sum().backward()
print("SUBGROUPS OK")
"""


def test_solo_gloo_groups_share_one_real_gloo_backend(tmp):
    """C++ code (DDP's Logger) casts a group's GLOO backend to ProcessGroupGloo: every group
    registers the same real 1-rank one (no thread per group); collectives still reach the
    recording group (DDP over a subgroup is recorded on that subgroup)."""
    prog = tmp / "subgroups.py"
    prog.write_text(SUBGROUPS)
    p = solo(prog, 8, 3, [], tmp / "subgroups")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "SUBGROUPS OK" in p.stdout
    log = read_ranklog(ranklog_path(tmp / "subgroups", 3))
    g = {x.name: tuple(x.ranks) for x in log.groups}
    comm = [(g[n["group_name"]], n["op"]) for n in log.nodes if n["kind"] == "comm"]
    assert comm[:4] == [((3, 5), "all_gather"), ((3, 5), "broadcast"), ((3, 5), "broadcast"),
                        ((3, 5), "all_reduce")]  # fmt: skip


# ---- PyTorch DDP and FSDP2 (fully_shard) ---------------------------------------------------
PROGRAMS = ROOT / "tests" / "programs"
TORCH_RANK = 2  # neither the DDP broadcast source nor the last rank


def _torch_args(name, out):
    from test_recording import DDP_STEPS, FSDP_STEPS

    return {"ddp": [str(out), str(DDP_STEPS)], "fsdp2": [str(FSDP_STEPS)]}[name]


@pytest.fixture(scope="module")
def torch_records(torch_program_runs):
    """The real recorded runs on 4 ranks: test_recording's (shared, conftest.torch_program_runs)."""
    out = {}
    for name in ("ddp", "fsdp2"):
        run = torch_program_runs[name]
        assert run.nproc == 4
        run.ok()
        out[name] = run.spool
    return out


@pytest.mark.parametrize("name", ["ddp", "fsdp2"])
def test_torch_program_solo_rank_matches_real_run(tmp, torch_records, name):
    spool = tmp / f"{name}-solo"
    p = solo(PROGRAMS / f"{name}_train.py", 4, TORCH_RANK,
             _torch_args(name, tmp / f"{name}-solo-out"), spool)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"{'DDP' if name == 'ddp' else 'FSDP2'} OK {TORCH_RANK}" in p.stdout
    real = read_ranklog(ranklog_path(torch_records[name], TORCH_RANK))
    mine = read_ranklog(ranklog_path(spool, TORCH_RANK))
    assert sum(n["kind"] == "comm" for n in mine.nodes) > 3
    assert rows(real) == rows(mine)
    assert [x.ranks for x in real.groups] == [x.ranks for x in mine.groups]
