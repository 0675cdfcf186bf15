"""Numerical correctness under pruning for every collective (issue 12, item 3): the program of
tests/programs/collectives.py (every public torch.distributed API once, on the default group
and on sub-groups, each result checked by the program itself) recorded for real at N = 4 with
its collective inputs, then emulated with the sandbox ranks at several places in the groups
while one assistant plays the others from the recorded inputs. Each sandbox rank must reach
the program's own "COLLECTIVES OK": all-reduce (sum, max, min, product), all-gather (list and
tensor), reduce-scatter (tensor and list), all-to-all (uneven, even, list), broadcast, reduce,
gather, scatter, send/recv, isend/irecv, batch_isend_irecv, object collectives, barriers,
functional collectives and coalesced all-reduces, with the root, the source or the peer real
or virtual."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from conftest import PRISM

ROOT = Path(__file__).resolve().parents[1]
PROGRAM = str(ROOT / "tests" / "programs" / "collectives.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("collectives") / "rec"
    p = subprocess.run(
        [
            PRISM,
            "record",
            "--nproc",
            "4",
            "--devices",
            "cpu",
            "--out",
            str(out),
            "--save-tensors",
            "all,inputs",
            "--timeout",
            "120",
            "--",
            PROGRAM,
        ],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return out


@pytest.mark.parametrize("sandbox", ["1", "0,3", "2"])
def test_every_collective_is_exact_under_pruning(recorded, tmp_path, sandbox):
    """{1}: root of broadcast_object_list, reduce's destination; {0, 3}: scatter's source and
    gather's destination, and a real pair across every sub-group; {2}: broadcast's source."""
    p = subprocess.run(
        [
            PRISM,
            "emulate",
            "--graph",
            str(recorded),
            "--sandbox",
            sandbox,
            "--out",
            str(tmp_path / "emu"),
            "--check",
            "--timeout",
            "120",
            "--",
            PROGRAM,
        ],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    # groups: default [0-3], [0, 2], [1, 3], [0, 1], [2, 3]; the ones without a sandbox rank are
    # never instantiated, the others pruned to their sandbox ranks plus a proxy
    comms = json.loads((tmp_path / "emu" / "emulate.json").read_text())["communicators"]
    want = {"1": (3, 2, 2), "0,3": (5, 0, 3), "2": (3, 2, 2)}[sandbox]
    assert (comms["pruned"], comms["not_instantiated"], comms["largest_communicator"]) == want, comms
    assert comms["logical_groups"] == 5 and comms["all_real"] == 0 and comms["communicators"] == want[0]
    assert f"communicators: {want[0]} for 5 logical group(s)" in p.stderr
    for r in sandbox.split(","):
        assert f"COLLECTIVES OK {r}" in p.stdout + p.stderr, p.stdout[-3000:] + p.stderr[-3000:]
        # and every pruned output equals what the rank received in the real run, to the bit
        chk = json.loads((tmp_path / "emu" / f"check-rank-{r}.json").read_text())
        assert chk["compared"] >= 20 and chk["missing"] == chk["unfinished"] == chk["errors"] == 0, chk
        assert chk["max_abs_diff"] == 0, chk
