"""`prism capture` of real programs (the solo backend, and switch mode beside it): gpt3d against
its real recordings, MoE routing replayed from saved tensors, SPMD start-up patterns, a start-up
agreement check, an out-of-memory rank, and torch.distributed.pipelining end to end.

Split from test_capture_solo.py (the layout, replica and resume logic against a stand-in runner):
these start real ranks, each a Python process importing torch, so they are a file of their own
that a test worker can run beside the other.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import GPT3D, PRISM, gpt3d_sizes

from prismllm.capture.solo import CaptureOptions
from prismllm.cli import main as climain
from prismllm.trace import PrismTrace, compare_traces

ROOT = Path(__file__).resolve().parents[1]


def record_two_ranks(out: Path, save_tensors: str, program: list[str]) -> subprocess.CompletedProcess:
    """`prism record` of ``program`` on 2 CPU ranks, saving ``save_tensors``."""
    return subprocess.run(
        [PRISM, "record", "--nproc", "2", "--devices", "cpu", "--out", str(out), "--save-tensors", save_tensors,
         "--", *program],
        capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600,
    )  # fmt: skip


def solo_capture(out: Path, world: int, program: list[str], *options: str, timeout: int) -> subprocess.CompletedProcess:
    """`prism capture --mode solo` of ``program`` at ``world`` ranks, 2 at a time on the CPU."""
    return subprocess.run(
        [PRISM, "capture", "--mode", "solo", "--world", str(world), "--devices", "cpu", "--parallel", "2",
         "--out", str(out), *options, "--", *program],
        capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=timeout,
    )  # fmt: skip


def test_gpt3d_solo_capture_matches_record(tmp_path, gpt3d_recording):
    """The real 8-rank TP2·PP2·DP2 recording (test_record_gpt3d's, shared) against a solo
    capture of the same command, 2 ranks at a time."""
    from test_record_gpt3d import program, recording

    prog = [GPT3D, *program("tp2pp2dp2")]
    rec = recording(gpt3d_recording, "tp2pp2dp2").out
    cap = solo_capture(tmp_path / "cap", 8, prog, "--layout", "tp=2,pp=2", timeout=900)
    assert cap.returncode == 0, cap.stderr[-3000:]
    a, b = PrismTrace.load(rec), PrismTrace.load(tmp_path / "cap")
    res = compare_traces(a, b, timing=False)
    assert res.structure_equal, json.dumps(res.first_difference, indent=1, default=str)
    assert b.manifest["capture"]["ranks_run"] == 4


def test_gpt3d_switch_capture_is_the_real_run(tmp_path, gpt3d_recording):
    """The 8-rank TP2·PP2·DP2 recording (test_record_gpt3d's, shared) against a switch capture of
    the same command, two ranks running at a time: the same graph, and the same losses (the
    coordinator's sums in member order against gloo's)."""
    from test_record_gpt3d import program, recording

    rec = recording(gpt3d_recording, "tp2pp2dp2")
    log = tmp_path / "switch.json"
    p = subprocess.run(
        [PRISM, "capture", "--mode", "switch", "--world", "8", "--parallel", "2", "--devices", "cpu", "--out", str(tmp_path / "cap"),
         "--timeout", "600", "--", GPT3D, *program("tp2pp2dp2"), "--json-log", str(log)],
        capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=900,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    res = compare_traces(PrismTrace.load(rec.out), PrismTrace.load(tmp_path / "cap"), timing=False)
    assert res.structure_equal, json.dumps(res.first_difference, indent=1, default=str)
    got = json.loads(log.read_text())
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in rec.log], rel=1e-5)
    m = PrismTrace.load(tmp_path / "cap").manifest
    assert m["mode"] == "switch" and m["capture"]["ranks_run"] == 8 and m["capture"]["switches"] > 0


def test_moe_solo_capture_replays_saved_tensors(tmp_path):
    """MoE routing depends on values: generated outputs give other split sizes than the real
    run; `prism record --save-tensors all` + `prism capture --tensors` reproduce them exactly."""
    sizes = gpt3d_sizes(layers=4, global_batch=8, iters=2, bucket_mb="0.01")
    prog = [GPT3D, "--ep", "2", "--num-experts", "4", *sizes]
    rec = record_two_ranks(tmp_path / "rec", "all", prog)
    assert rec.returncode == 0, rec.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "rec" / "tensors").iterdir()) == [
        "manifest.json",  # sealed once the ranks exited
        "rank-000000.bin",
        "rank-000000.idx",
        "rank-000001.bin",
        "rank-000001.idx",
    ]
    real = PrismTrace.load(tmp_path / "rec")
    for name, extra in (("gen", []), ("store", ["--tensors", str(tmp_path / "rec" / "tensors")])):
        cap = solo_capture(tmp_path / name, 2, prog, *extra, timeout=600)
        assert cap.returncode == 0, cap.stderr[-3000:]
        res = compare_traces(real, PrismTrace.load(tmp_path / name), timing=False)
        if name == "gen":  # generated routing counts are not the real ones
            assert not res.structure_equal and res.first_difference["node_a"]["op"] == "all_to_all"
        else:
            assert res.structure_equal, json.dumps(res.first_difference, indent=1, default=str)


def test_record_save_tensors_bad_selector(tmp_path, capsys):
    script = tmp_path / "prog.py"
    script.write_text("print('never run')\n")
    code = climain.main(
        [
            "record",
            "--nproc",
            "1",
            "--out",
            str(tmp_path / "o"),
            "--save-tensors",
            "all_reduce,allreduce",
            "--",
            str(script),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "bad --save-tensors 'all_reduce,allreduce': unknown op(s) allreduce" in err
    assert not (tmp_path / "o").exists()


def test_tensor_store_with_expert_parallel_runs_every_rank(tmp_path):
    """Recorded values make expert-DP replicas route their own tokens: no dedup with --tensors
    (dense layouts keep it: their sizes never depend on values)."""
    from prismllm.capture.solo import plan_capture

    script = tmp_path / "prog.py"
    script.write_text("pass\n")
    (tmp_path / "store").mkdir()
    moe = CaptureOptions(
        world=16,
        out=tmp_path / "a",
        script=str(script),
        layout="tp=2,ep=4",
        parallel=2,
        devices="cpu",
        tensors=tmp_path / "store",
    )
    plan, _, _ = plan_capture(moe)
    assert plan.replicas.representatives == list(range(16))
    assert "each rank replays its own recorded routing" in plan.replicas.describe()
    plan, _, _ = plan_capture(dataclasses.replace(moe, tensors=None))
    assert len(plan.replicas.representatives) == 8 and "copy its all-to-all split sizes" in plan.replicas.describe()
    plan, _, _ = plan_capture(dataclasses.replace(moe, layout="tp=2,pp=2"))
    assert len(plan.replicas.representatives) == 4


def test_record_saves_inputs_at_issue(tmp_path):
    """`--save-tensors all,inputs`: each call's inputs are saved before the backend overwrites
    them in place, so every TP all-reduce's output is the sum (or max) of the ranks' inputs."""
    from prismllm.generate.store import TensorStore

    prog = [GPT3D, "--tp", "2", *gpt3d_sizes(layers=4, global_batch=8, iters=1)]
    rec = record_two_ranks(tmp_path / "rec", "all_reduce,inputs", prog)
    assert rec.returncode == 0, rec.stderr[-3000:]
    stores = [TensorStore(tmp_path / "rec" / "tensors", r) for r in (0, 1)]
    keys = [k for k in stores[0].entries if k[5] == "in"]
    assert len(keys) > 10 and {k[2] for k in keys} == {"all_reduce"}
    ops = set()
    for g, ranks, op, index, peer, _io in keys:
        ins = [s.get(g, ranks, op, index, peer, io="in")[0].double() for s in stores]
        out = stores[0].get(g, ranks, op, index, peer)[0].double()
        if torch.allclose(out, ins[0] + ins[1], rtol=1e-5, atol=1e-6):
            ops.add("sum")
        else:
            assert torch.equal(out, torch.maximum(*ins)), (g, index)
            ops.add("max")
    assert ops == {"sum", "max"}  # vocab-parallel cross-entropy uses both


SPMD_STARTUP = str(Path(__file__).resolve().parent / "programs" / "spmd_startup.py")


@pytest.mark.parametrize("parallel", [2, 1])
def test_solo_ranks_share_object_collectives_and_take_numpy_splits(tmp_path, parallel, recorded_graph):
    """Rank 1 receives the config rank 0 broadcast (published in the spool: root first); run
    together, each rank sees the other's gathered rank id; numpy split sizes reach the rank log
    as ints; a receive into a leaf that requires grad is filled. One rank at a time, rank 0
    cannot see rank 1's id (it has not run yet): the program's own check of the gathered ids
    fails, the documented limit of the fallback."""
    run = [PRISM, "capture", "--mode", "solo", "--world", "2", "--parallel", str(parallel), "--devices", "cpu"]
    r = subprocess.run(
        [*run, "--out", str(tmp_path / "solo"), "--", SPMD_STARTUP], capture_output=True, text=True, timeout=300
    )
    if parallel == 1:
        assert r.returncode != 0 and "gathered ranks [0, 0]" in r.stdout + r.stderr, r.stdout + r.stderr
        return
    assert r.returncode == 0, r.stdout + r.stderr
    assert "rank 0: ok" in r.stdout and "rank 1: ok" in r.stdout
    assert_equals_the_real_runs_structure(
        tmp_path / "solo", recorded_graph(2, ["--recorder", "python", "--", SPMD_STARTUP])
    )


def assert_equals_the_real_runs_structure(solo: Path, real: Path) -> None:
    """The captured graph at ``solo`` has the structure of the real run's recording ``real``."""
    cmp = subprocess.run([PRISM, "compare", str(real), str(solo)], capture_output=True, text=True, timeout=120)
    assert "structure: equal" in cmp.stdout, cmp.stdout


def test_the_rank_that_runs_out_of_memory_first_in_the_program_is_named(tmp_path):
    """Two solo ranks run out of memory: rank 0 in its second iteration, at once, rank 1 in its
    first, two seconds later. Rank 1 is named, with the calls each had made (a real run, whose
    ranks keep step at the all_reduces, runs out on rank 1)."""
    hungry = str(Path(__file__).parent / "programs" / "memory_hungry.py")
    argv = ["capture", "--world", "2", "--parallel", "2", "--devices", "cpu", "--out", str(tmp_path / "g")]
    p = subprocess.run([PRISM, *argv, "--", hungry, "--hungry-rank", "1", "--delay", "2", "--hungry-late", "0"],
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert p.returncode != 0
    assert "rank 1 ran out of memory in its solo run after 2 communication call(s)" in p.stderr, p.stderr[-2000:]
    assert "also out of memory: rank 0 after 4 call(s)" in p.stderr, p.stderr[-2000:]


P2P_STEPS = str(Path(__file__).resolve().parent / "programs" / "p2p_steps.py")


@pytest.mark.parametrize("parallel", [1, 2])
def test_a_small_send_answers_its_receiver(tmp_path, parallel, recorded_graph):
    """Rank 0 sends rank 1 how many all-reduces to run (tests/programs/p2p_steps.py). Solo
    capture keeps the small send, and the receiver, run after its sender or beside it, gets what
    was really sent: both ranks run three all-reduces, the graph equals the real run's, and the
    activation and its gradient are the real ones. The sends go with the graph (``objects/sent-*``)."""
    out = tmp_path / "solo"
    p = subprocess.run(
        [PRISM, "capture", "--mode", "solo", "--world", "2", "--parallel", str(parallel), "--devices", "cpu",
         "--out", str(out), "--", P2P_STEPS],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "rank 1: 3 steps (seed 1234), activation [2.5, 2.5, 2.5, 2.5]" in p.stdout, p.stdout
    if parallel == 2:  # rank 1's gradient came back while rank 0 waited for it
        assert "rank 0: 3 steps, gradient [5.0, 5.0, 5.0, 5.0]" in p.stdout, p.stdout
    assert len(list((out / "objects").glob("sent-*.tensor"))) == 3
    assert_equals_the_real_runs_structure(out, recorded_graph(2, ["--", P2P_STEPS]))


ZERO3_CHECK = str(Path(__file__).resolve().parent / "programs" / "zero3_check.py")


def test_a_start_up_agreement_check_passes_solo_capture_with_default_rules(tmp_path, recorded_graph):
    """A partitioning library's start-up check of the ZeRO stage-3 kind (tests/programs/zero3_check.py:
    each rank's parameter counts gathered as a tensor, its shard sizes as an object, a float
    checksum; a disagreement refused) passes solo capture with no rule: a rank run alone is
    answered with what it holds itself, as an SPMD program's peers hold the same. The graph equals
    the real run's."""
    out = tmp_path / "solo"
    p = subprocess.run(
        [PRISM, "capture", "--mode", "solo", "--world", "2", "--devices", "cpu", "--out", str(out), "--", ZERO3_CHECK],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert_equals_the_real_runs_structure(out, recorded_graph(2, ["--", ZERO3_CHECK]))


PIPELINE_TRAIN = str(Path(__file__).resolve().parent / "programs" / "pipeline_train.py")


def test_torch_pipelining_runs_with_no_recording(tmp_path, recorded_graph):
    """``torch.distributed.pipelining``'s stages send each other their shapes at the first step
    (``send_object_list``/``recv_object_list``), which no rule can invent. Solo capture: a rank
    receives what its sender, a solo rank of the same capture, sent; the messages go with the
    graph, and in the slices and the emulation a virtual sender sends them again (a replica, its
    representative's). Interleaved 1F1B with two pipelines side by side (N = 4, pp innermost),
    ``prism run`` end to end: the captured graph equals the real run's, the emulated last rank
    trains; the real run's recording keeps its messages as well and is emulated without its
    tensors. One rank at a time, the first stage waits on metadata from the second, which has not
    run: one line naming the call, the sender and the fixes."""
    program = ["--", PIPELINE_TRAIN, "--stages-per-rank", "2", "--dp", "2"]
    layout = ["--world", "4", "--layout", "pp=2,order=tp-pp-dp", "--devices", "cpu"]
    one = subprocess.run(
        [PRISM, "capture", "--mode", "solo", *layout, "--out", str(tmp_path / "one"), *program],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert one.returncode != 0
    assert "recv_object_list" in one.stderr and "its sender, rank 1, has not run" in one.stderr, one.stderr
    run = subprocess.run(
        [PRISM, "run", *layout, "--parallel", "2", "--sandbox", "3", "--out", str(tmp_path / "run"), *program],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    emulated = (tmp_path / "run" / "logs" / "emulate.log").read_text()
    assert "rank 3: iteration 3/3 | loss" in emulated, emulated[-2000:]
    real = recorded_graph(4, program)  # test_capture_switch's too
    assert_equals_the_real_runs_structure(tmp_path / "run" / "bare", real)
    # the real run's recording keeps its messages too: emulated without its tensors, and with the
    # issue thread serving the CPU's calls (a receive that takes a message is planned inline)
    emu = subprocess.run(
        [PRISM, "emulate", "--graph", str(real), "--sandbox", "3", "--devices", "cpu",
         "--out", str(tmp_path / "emu"), *program],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PRISM_ISSUE_THREAD": "all"},
    )  # fmt: skip
    assert emu.returncode == 0 and "rank 3: iteration 3/3 | loss" in emu.stdout, emu.stdout[-3000:] + emu.stderr[-3000:]
