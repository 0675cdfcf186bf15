"""Damaged inputs are refused in one line, or harmless (issue 37, points 1 and 8).

The session's 2-rank TP2 recording of gpt3d with its tensor store (conftest.gpt3d_recording,
test_emulate's too) is mutated a few hundred times, seeded (benchmarks/fuzz_inputs.py: bit flips,
truncation, empty, deleted and swapped files, bad manifest values, index offsets), and each copy
goes through the loaders in-process (PrismTrace.load, validate, verify_store, every store entry
read): no exception but a one-line PrismError, no hang, and whatever is accepted equals the
original; graphs edited consistently and sealed again are refused by validation or shown different
by `prism compare`. The issue's two cases, two ranks' stores swapped and every index offset set to -1, are
refused by `prism emulate` before any process starts; a store written before seals (no
manifest) still loads, its index still checked against its data and the graph.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest
from test_emulate import GPT3D, LAYOUTS, PRISM, SIZES

from prismllm.errors import ExitCode
from prismllm.generate.store import StoreError, rank_files, verify_store
from prismllm.launch.sandbox import recorded_inputs
from prismllm.trace import PrismTrace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import fuzz_inputs  # noqa: E402

CASES = 300
RESEALED = 150
SEED = 37


@pytest.fixture(scope="module")
def graph(gpt3d_recording) -> Path:
    return gpt3d_recording(2, [*LAYOUTS["tp2"], *SIZES], save_tensors="all,inputs").out


def copy(graph: Path, tmp_path: Path) -> Path:
    g = tmp_path / "g"
    shutil.copytree(graph, g)
    return g


def test_record_seals_its_store(graph):
    store = graph / "tensors"
    m = json.loads((store / "manifest.json").read_text())
    assert sorted(m["files"]) == rank_files(store) == [f"rank-00000{r}.{e}" for r in (0, 1) for e in ("bin", "idx")]
    verify_store(store, PrismTrace.load(graph), str(graph))


def fuzzed(graph: Path, case: Path, cases: int, mutate, judge) -> dict[str, int]:
    """Tally of ``judge(case)`` over ``cases`` seeded ``mutate(graph, case, rng)``; fails on any failure outcome."""
    rng = random.Random(SEED)
    tally, failures = {}, []
    for i in range(cases):
        what = mutate(graph, case, rng)
        outcome, detail = judge(case)
        tally[outcome] = tally.get(outcome, 0) + 1
        if outcome in fuzz_inputs.FAILURES:
            failures.append(f"case {i} ({what}): {outcome} {detail}")
    assert not failures, "\n".join(failures)
    return tally


def test_mutated_inputs_are_refused_in_one_line_or_harmless(graph, tmp_path):
    original = fuzz_inputs.snapshot(graph)
    tally = fuzzed(graph, tmp_path / "case", CASES, fuzz_inputs.mutate,
                   lambda case: fuzz_inputs.load_outcome(case, original, timeout_s=20))  # fmt: skip
    assert tally["refused"] >= CASES * 0.9, tally  # almost every mutation changes a byte that is checked


def test_consistent_edits_are_refused_or_shown_by_compare(graph, tmp_path):
    """A graph changed and sealed again (its checksums hold): validation refuses it, or `prism
    compare` against the original reports the change (structure, manifest or timing)."""
    original = PrismTrace.load(graph)
    tally = fuzzed(graph, tmp_path / "case", RESEALED, fuzz_inputs.reseal,
                   lambda case: fuzz_inputs.reseal_outcome(case, original, timeout_s=20))  # fmt: skip
    assert tally.get("refused", 0) and tally.get("noticed", 0), tally


def emulate(g: Path, out: Path, *extra: str) -> tuple[int, str]:
    cmd = [PRISM, "emulate", "--graph", str(g), "--sandbox", "0", "--devices", "cpu", "--out", str(out), *extra,
           "--", GPT3D, *LAYOUTS["tp2"], *SIZES]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    return p.returncode, p.stderr


def rewrite_index(idx: Path, change) -> None:
    entries = list(msgpack.Unpacker(open(idx, "rb"), raw=False, strict_map_key=False))
    for e in entries:
        change(e)
    idx.write_bytes(b"".join(msgpack.packb(e, use_bin_type=True) for e in entries))


def negative_offsets(entry: dict) -> None:
    for t in entry["tensors"]:
        t["offset"] = -1


def test_swapped_stores_and_negative_offsets_are_refused_before_any_process_starts(graph, tmp_path):
    """The issue's cases (exit 0 with another loss before): one line naming the file, exit 3, and
    no process launched (the sandbox run's directory is never made)."""
    g = copy(graph, tmp_path)
    store = g / "tensors"
    for ext in ("idx", "bin"):
        a, b = store / f"rank-000000.{ext}", store / f"rank-000001.{ext}"
        a.rename(store / "tmp")
        b.rename(a)
        (store / "tmp").rename(b)
    rc, err = emulate(g, tmp_path / "out1")
    assert rc == ExitCode.BAD_INPUT and len(err.strip().splitlines()) == 1, err
    assert f"tensor store {store}: rank-000000.bin does not match its checksum" in err, err
    assert not (tmp_path / "out1" / "ranklogs").exists()

    g = copy(graph, tmp_path / "b")
    rewrite_index(g / "tensors" / "rank-000001.idx", negative_offsets)
    rc, err = emulate(g, tmp_path / "out2")
    assert rc == ExitCode.BAD_INPUT and len(err.strip().splitlines()) == 1, err
    assert "rank-000001.idx is " in err, err
    assert not (tmp_path / "out2" / "ranklogs").exists()


def test_a_store_written_before_seals_loads_its_index_still_checked(graph, tmp_path):
    g = copy(graph, tmp_path)
    store = g / "tensors"
    (store / "manifest.json").unlink()
    assert recorded_inputs(g, None, "recorded") == store  # no checksums to check: read as it is

    rewrite_index(store / "rank-000001.idx", negative_offsets)
    with pytest.raises(StoreError, match=r"rank-000001.idx: entry 0 tensor 0's bytes -1\.\.\+\d+ are outside the data"):
        recorded_inputs(g, None, "recorded")

    shutil.copy(graph / "tensors" / "rank-000001.idx", store / "rank-000001.idx")

    def float32_as_int32(entry: dict) -> None:  # the same bytes, another dtype: only the graph tells
        for t in entry["tensors"]:
            if t["dtype"] == "float32":
                t["dtype"] = "int32"

    rewrite_index(store / "rank-000001.idx", float32_as_int32)
    with pytest.raises(StoreError) as e:
        recorded_inputs(g, None, "recorded")
    assert "rank-000001.idx: the inputs of" in str(e.value) and "are int32 [" in str(e.value), e.value
    assert "the store is not this graph's" in str(e.value)
    assert recorded_inputs(g, None, "recorded", verify=False) == store  # --no-verify: not checked here


def test_no_verify_skips_the_checksums(graph, tmp_path):
    g = copy(graph, tmp_path)
    data = bytearray((g / "tensors" / "rank-000000.bin").read_bytes())
    data[100] ^= 1
    (g / "tensors" / "rank-000000.bin").write_bytes(bytes(data))
    with pytest.raises(StoreError, match="rank-000000.bin does not match its checksum"):
        recorded_inputs(g, None, "auto")
    assert recorded_inputs(g, None, "auto", verify=False) == g / "tensors"
