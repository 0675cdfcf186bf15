"""Switch mode on GPUs (issue 38): every rank of an N-rank gpt3d runs on the machine's GPU(s), one
rank holding each GPU at a time; a rank that waits on a collective has its device state moved to
the host (the driver's checkpoint API) and another rank's moved back. The captured graph equals
the real run's recording, every rank's peak memory is the real rank's to the byte, and the last
rank's losses are the real run's. Run on the device machine: ``pytest -m gpu
tests/test_capture_switch_gpu.py``.

The real run shares the GPU(s) among its four ranks (each NCCL's own host, as in
test_emulate_gpu.py); switch mode needs no NCCL: the coordinator carries out every collective on
the host.
"""

from __future__ import annotations

import json
import re
import subprocess

import pytest

torch = pytest.importorskip("torch")

from conftest import PRISM, ROOT  # noqa: E402
from test_capture_switch import same_structure  # noqa: E402
from test_emulate import GPT3D, SIZES, assert_same_losses  # noqa: E402
from test_emulate_gpu import ENV, prism, two_gpus  # noqa: E402

from prismllm.errors import ExitCode  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GPUS = "cuda:0,1" if two_gpus() else "cuda:0"
PROGRAM = [GPT3D, "--tp", "2", "--pp", "2", *SIZES]
PROGRAMS = ROOT / "tests" / "programs"


def test_four_ranks_take_turns_on_the_gpus_with_the_real_runs_graph_memory_and_losses(tmp_path):
    """Two ranks at a time (on two GPUs one each, on one GPU both): the other two wait with their
    device state on the host. The summary says what the swaps cost."""
    real_log, switch_log = tmp_path / "real.json", tmp_path / "switch.json"
    shared = ",".join(["0,1" if two_gpus() else "0,0"] * 2)
    prism("record", "--nproc", "4", "--devices", f"cuda:{shared}", "--out", str(tmp_path / "rec"),
          "--timeout", "240", "--", *PROGRAM, "--json-log", str(real_log))  # fmt: skip
    shown = prism("capture", "--mode", "switch", "--world", "4", "--devices", GPUS, "--parallel", "2",
                  "--out", str(tmp_path / "cap"), "--timeout", "240", "--", *PROGRAM,
                  "--json-log", str(switch_log)).stdout  # fmt: skip
    assert re.search(r"swaps +\d+ out of the GPUs, each out [\d.]+ s, back [\d.]+ s", shown), shown[-2000:]
    same_structure(tmp_path / "rec", tmp_path / "cap")
    rec = json.loads((tmp_path / "rec" / "manifest.json").read_text())
    cap = json.loads((tmp_path / "cap" / "manifest.json").read_text())
    assert cap["device"] == "cuda" and rec["device"] == "cuda"
    assert cap["peak_memory_bytes"] == rec["peak_memory_bytes"], (cap["peak_memory_bytes"], rec["peak_memory_bytes"])
    assert all(int(v) > 0 for v in cap["peak_memory_bytes"].values())
    assert_same_losses(json.loads(real_log.read_text()), json.loads(switch_log.read_text()))
    swaps = cap["capture"]["swaps"]
    # every rank but the first of each GPU arrives to a taken GPU; each stop moves device state out
    assert cap["capture"]["switches"] > 0 and swaps["out"] >= cap["capture"]["switches"], cap["capture"]
    assert swaps["bytes_out"] is None or swaps["bytes_out"] > 0, swaps


@pytest.mark.parametrize("program, prefix", [("work_lifetimes.py", "MEM "), ("nccl_memory.py", "rank ")])
def test_what_a_work_keeps_alive_is_nccls_with_the_rank_swapped_out_between_calls(tmp_path, program, prefix):
    """The allocated bytes at each point of a program that shows what a Work keeps alive (a sync
    call on the current stream, an async one's stash until wait, P2P's recordStream, a batch's Work,
    NCCL's barrier tensor) equal the real run's, with one rank on one GPU at a time: each rank's
    device state goes out and back between its calls, and its Works are ProcessGroupNCCL's."""
    lines = {}
    for name, argv in (
        ("real", ["record", "--nproc", "2", "--devices", "cuda:0,0"]),
        ("switch", ["capture", "--mode", "switch", "--world", "2", "--devices", "cuda:0"]),
    ):
        p = prism(*argv, "--out", str(tmp_path / name), "--timeout", "200", "--", str(PROGRAMS / program))
        lines[name] = sorted(ln for ln in p.stdout.splitlines() if ln.startswith(prefix))
    assert lines["real"] and lines["switch"] == lines["real"], lines
    cap = json.loads((tmp_path / "switch" / "manifest.json").read_text())["capture"]
    assert cap["swaps"]["out"] > 0, cap


def test_a_rank_the_driver_cannot_checkpoint_ends_the_capture_in_one_line(tmp_path):
    """A rank holding unified (managed) memory, which the driver's checkpoint API does not move:
    the first swap out is refused (driver 580 on an H200: CUDA_ERROR_NOT_SUPPORTED), and the
    capture ends every rank with one line naming the GPU, the rank and the driver's error; the
    spool is kept for the ranks' logs."""
    argv = ["capture", "--mode", "switch", "--world", "2", "--devices", "cuda:0", "--parallel", "1"]
    p = subprocess.run([PRISM, *argv, "--out", str(tmp_path / "o"), "--timeout", "200", "--",
                        str(PROGRAMS / "managed_memory.py")], capture_output=True, text=True, env=ENV, timeout=300)  # fmt: skip
    assert p.returncode not in (ExitCode.OK, ExitCode.INTERNAL), (p.returncode, p.stdout[-2000:], p.stderr[-3000:])
    err = [ln for ln in p.stderr.splitlines() if "error:" in ln]  # after the progress lines
    assert len(err) == 1 and re.search(
        r"GPU 0: the CUDA driver refused checkpoint of rank [01]: CUDA_ERROR_", err[0]
    ), err
    assert (tmp_path / "o" / ".spool").is_dir()
    assert subprocess.run(["pgrep", "-f", "managed_memory.py"], capture_output=True).returncode == 1  # none left
