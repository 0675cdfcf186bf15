"""`prism run`: the whole pipeline (capture -> time -> calibrate -> emulate -> report) on the embedded
job, here at 8 ranks (TP2 x PP2 x DP2): every stage ran, the summary names the figures, the run
resumes without running a stage again, and a foreign directory is never deleted. The emulated
rank is the last one, a DP replica in the solo capture, so this also checks that a replica's
groups (derived names in the graph) are found by members."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
from pathlib import Path

import pytest
from conftest import GPT3D
from listeners import ListenerWatch, is_loopback
from test_report_html import Opened, browser  # noqa: F401  (browser: a fixture used below)

from prismllm.cli.main import main
from prismllm.launch.sandbox import ON_THE_CPU
from prismllm.report.html import fmt_ns

ROOT = Path(__file__).resolve().parents[1]
PROGRAMS = ROOT / "tests" / "programs"
JOB = [
    "--",
    GPT3D,
    "--tp",
    "2",
    "--pp",
    "2",
    "--layers",
    "2",
    "--hidden",
    "32",
    "--heads",
    "4",
    "--seq",
    "16",
    "--vocab",
    "128",
    "--micro-batch",
    "1",
    "--iters",
    "3",
    "--global-batch",
    "8",
]


ARGV = ["run", "--world", "8", "--layout", "tp=2,pp=2", "--sandbox", "7", "--devices", "cpu"]


@pytest.fixture(scope="module")
def ran(tmp_path_factory) -> tuple[Path, str]:
    """The job run once: (OUT, what it printed); what its processes listened on in LISTENED."""
    out = tmp_path_factory.mktemp("run") / "run"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), ListenerWatch() as watch:
        assert main([*ARGV, "--out", str(out), *JOB]) == 0
    LISTENED.update(watch.seen)
    return out, buf.getvalue()


LISTENED: set[tuple[str, int, str]] = set()


def test_every_stage_listens_on_loopback_only(ran):
    """As `ss -ltnp` during the run would show: the rendezvous stores, gloo's pairs and the
    assistants' channels of capture, time and emulate listen on loopback alone (the prism process
    and every process it started, sampled every 0.1 s)."""
    procs = {name for _, _, name in LISTENED}
    assert any("prismllm.assistant" in n for n in procs), LISTENED  # the emulation's processes were seen
    assert any("gpt3d.py" in n for n in procs), LISTENED
    assert not [s for s in LISTENED if not is_loopback(s[0])], sorted(LISTENED)


def test_run_goes_from_the_program_to_the_report_and_resumes(ran, tmp_path, capsys):
    out, shown = ran
    argv = [*ARGV, "--out", str(out)]
    state = json.loads((out / "run.json").read_text())
    assert [s["name"] for s in state["stages"]] == ["capture", "time", "calibrate", "emulate", "report"]
    # the prism process's own peak host memory in each stage (Linux), shown beside its wall time
    assert all(x["peak_rss_bytes"] > 2**20 for x in state["stages"]) and shown.count(" GiB ") >= 5
    s = state["summary"]
    assert s["predicted_iteration_ns"] > 0 and s["emulated"]["7"]["iteration_ns"] > 0
    assert 0 <= s["pipeline_bubble"] < 1 and s["critical_path_shares"]["compute"] > 0
    assert (out / "report.html").is_file() and (out / "cal" / "graph").is_dir()
    assert "predicted iteration" in shown and "report:" in shown and "{" not in shown  # no JSON unless --json
    assert len(shown.splitlines()) < 40
    # 80 columns: a line breaks between words, never between a flag and its value
    flags = [f"{a} {b}" for a, b in zip(JOB[2:], JOB[3:]) if a.startswith("--")]
    table = [line for line in shown.splitlines() if not line.startswith("report: ")]  # a path is never broken
    assert all(f in shown for f in flags) and max(map(len, table)) <= 80, shown
    # the same command again: every stage's output is there, nothing runs (capture would take seconds)
    walls = {x["name"]: x["wall_s"] for x in state["stages"]}
    assert main([*argv, *JOB]) == 0
    again = json.loads((out / "run.json").read_text())
    assert {x["name"]: x["wall_s"] for x in again["stages"] if x["name"] != "report"} == {
        k: v for k, v in walls.items() if k != "report"
    }
    # another job on the same directory needs --force; a foreign directory is never deleted
    assert main(["run", "--world", "4", "--out", str(out), *JOB]) == 2
    assert "holds a `prism run` of another job" in capsys.readouterr().err
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "keep.txt").write_text("x")
    assert main(["run", "--world", "8", "--out", str(tmp_path / "other"), "--force", *JOB]) == 2
    assert (tmp_path / "other" / "keep.txt").exists()


def test_another_warmup_recalibrates_and_reemulates_but_keeps_the_slices(ran, tmp_path, capsys):
    """`prism run --warmup 2` on a finished run of three iterations: the capture and the slices are
    kept, the prediction, the emulated rank's median and the virtual ranks' replay all leave out
    iterations 0 and 1; a warm-up that leaves none is refused, naming the option."""
    out = tmp_path / "run"
    shutil.copytree(ran[0], out)
    before = {x["name"]: x["wall_s"] for x in json.loads((out / "run.json").read_text())["stages"]}
    capsys.readouterr()
    assert main([*ARGV, "--out", str(out), "--warmup", "2", *JOB]) == 0
    assert "(calibrated, median of iteration 2, all ranks)" in " ".join(capsys.readouterr().out.split())
    after = {x["name"]: x["wall_s"] for x in json.loads((out / "run.json").read_text())["stages"]}
    assert [after[k] for k in ("capture", "time")] == [before[k] for k in ("capture", "time")]
    assert after["calibrate"] != before["calibrate"] or after["emulate"] != before["emulate"]
    cal = json.loads((out / "cal" / "summary.json").read_text())
    assert cal["warmup"] == 2 and cal["steady_iterations"] == [2]
    assert cal["predicted_iteration_ns"] == cal["iterations"][2]["predicted_ns"]
    emu = json.loads((out / "emulate" / "emulate.json").read_text())
    sb = emu["sandbox_results"]["7"]
    assert sb["iterations"] == [0, 1, 2] and sb["median_steady_iteration_ns"] == sb["iteration_ns"][2]
    assert emu["replay"]["steady_iterations"] == [2]
    capsys.readouterr()
    assert main([*ARGV, "--out", str(out), "--warmup", "3", *JOB]) != 0
    assert "--warmup 3: graph" in capsys.readouterr().err


def test_the_run_and_its_stages_print_one_json_document(ran, tmp_path, capsys):
    """--json: the figures and the paths written on stdout, the progress and the program's lines on
    stderr; a CPU rank's peak memory is null, with why."""
    out, _ = ran
    assert main([*ARGV, "--out", str(out), "--json", *JOB]) == 0  # resumed: nothing runs again
    s = json.loads(capsys.readouterr().out)
    assert s["predicted_iteration_ns"] > 0 and s["report"] == str(out / "report.html")
    assert s["emulated"]["7"]["peak_memory_bytes"] is None
    assert s["emulated"]["7"]["peak_memory_reason"] == ON_THE_CPU
    assert s["peak_memory"] is None and s["peak_memory_reason"] == ON_THE_CPU
    emu = tmp_path / "emu"
    argv = ["emulate", "--graph", str(out / "cal" / "graph"), "--sandbox", "7", "--devices", "cpu", "--out", str(emu)]
    assert main([*argv, "--json", *JOB]) == 0
    captured = capsys.readouterr()
    e = json.loads(captured.out)
    assert e["out"] == str(emu) and e["sandbox"] == [7] and e["returncodes"] == {"7": 0} and e["timing"] == "real"
    assert e["sandbox_results"]["7"]["median_steady_iteration_ns"] > 0 and e["prediction"]["predicted_iteration_ns"]
    assert e["sandbox_results"]["7"]["peak_memory_bytes"] is None
    assert "iteration 3/3 | loss" in captured.err  # gpt3d's own lines (rank 7 reports)
    html = tmp_path / "r.html"
    assert main(["report", str(out), "--html", str(html), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {
        "run": str(out),
        "report": str(html),
        "reference": None,
        "compare": None,
        "ranks": None,
    }


def test_the_report_sets_a_run_beside_another(ran, tmp_path, browser):  # noqa: F811
    """`prism report A --compare B`: B a copy of the run recalibrated with the slices' last transfer
    times (a change to compare), the figures of both in one section with the change between them,
    clean in Chromium; a directory with no calibration is named as the --compare one."""
    out, _ = ran
    other = tmp_path / "other"
    shutil.copytree(out, other)
    assert main(["calibrate", str(other / "time" / "graph"), "--out", str(other / "cal"), "--transfer", "last",
                 "--write-graph", "--force"]) == 0  # fmt: skip
    html = tmp_path / "cmp.html"
    assert main(["report", str(out), "--compare", str(other), "--html", str(html)]) == 0
    page = html.read_text()
    a = json.loads((out / "cal" / "summary.json").read_text())["predicted_iteration_ns"]
    b = json.loads((other / "cal" / "summary.json").read_text())["predicted_iteration_ns"]
    section = page[page.index('<section id="compare">') :]
    cells = re.findall(r"<td[^>]*>([^<]*)</td>", section)
    at = cells.index("Predicted iteration")
    assert cells[at + 1 : at + 4] == [fmt_ns(a), fmt_ns(b), "same" if a == b else f"{100 * (a - b) / b:+.1f} %"]
    assert str(other) in section
    o = Opened(browser, html)
    try:
        o.check_clean()
        assert o.count("#compare tbody tr") >= 10
    finally:
        o.close()
    assert main(["report", str(out), "--compare", str(tmp_path / "nothing"), "--html", str(html)]) != 0


def test_the_report_of_a_real_run_opens_clean_and_fast(ran, browser):  # noqa: F811
    """The page a real pipeline wrote, in Chromium: no script error, nothing fetched, every
    section drawn, painted within 2 s; the run's three iterations to choose from, another one
    redrawing the timeline and the critical path."""
    out, _ = ran
    o = Opened(browser, out / "report.html")
    try:
        o.check_clean()
        assert o.load_s < 2.0, o.load_s
        assert o.count("#cp-chart svg rect") >= 3 and o.count("#breakdown-chart svg rect") >= 4
        assert o.count("#timeline-chart path.span") >= 3 and o.count("#emulation") == 1
        median = json.loads((out / "cal" / "summary.json").read_text())["median_iteration"]
        assert o.page.eval_on_selector_all("#timeline select.iteration option", "os => os.map(x => x.value)") == [
            "0", "1", "2"
        ]  # fmt: skip
        assert o.page.input_value("#timeline select.iteration") == str(median)
        view, path = o.page.inner_text("#timeline .view-text"), o.page.inner_text("#cp-chart tbody")
        o.page.select_option("#timeline select.iteration", "0")  # the first: set-up included, far longer
        assert o.page.inner_text("#timeline .view-text") != view and o.page.inner_text("#cp-chart tbody") != path
        assert o.count("#timeline-chart path.span") >= 3
        o.check_clean()
    finally:
        o.close()


def test_a_virtual_roots_small_broadcast_is_what_the_capture_kept(tmp_path, capsys):
    """A program whose second rank of a pair receives token ids its root builds (Megatron's data
    path), run with no tensor store: the solo capture keeps the root's broadcasts with the graph,
    and the time slice and the emulation where rank 1 runs with rank 0 virtual receive them; the
    same emulation from the graph without them gets rank 1's own buffer (what a model then
    learns from: zeros)."""
    kept_broadcasts_reach_the_sandbox(tmp_path, capsys, "cpu")


def test_a_virtual_senders_small_send_is_what_the_capture_kept(tmp_path, capsys):
    """tests/programs/p2p_steps.py: rank 0 sends rank 1 how many all-reduces to run, then an
    activation. With rank 0 virtual, the time slice and the emulation of rank 1 receive what the
    capture kept of rank 0's sends (the assistant sends zeros: rank 1 would run no all-reduce and
    leave its graph)."""
    kept_sends_reach_the_sandbox(tmp_path, capsys, "cpu")


def test_a_virtual_peers_gradient_share_is_the_sandboxs_own(tmp_path, capsys):
    """tests/programs/ddp_own_grad.py: with its DDP peer virtual, the slice's and the emulated
    sandbox's averaged gradient is its own batch's (the group as if each member held what it
    holds), every step, the first call of a signature and the later ones alike."""
    own_gradient_reaches_the_optimizer(tmp_path, capsys, "cpu", "float32")


def run_with_rank_0_virtual(tmp_path: Path, capsys, devices: str, program: str, *args: str) -> tuple[Path, list[str]]:
    """`prism run` of tests/programs/PROGRAM ARGS at N = 2, rank 1 the sandbox on ``devices``: its
    directory, and what rank 1 printed in its time slice and in its emulation."""
    out = tmp_path / "run"
    argv = ["run", "--world", "2", "--sandbox", "1", "--devices", devices, "--out", str(out)]
    assert main([*argv, "--", str(PROGRAMS / program), *args]) == 0, capsys.readouterr().err
    slice_log = next((out / "time" / "slices").glob("slice-*1.log")).read_text()
    return out, [slice_log, (out / "logs" / "emulate.log").read_text()]


def own_gradient_reaches_the_optimizer(tmp_path: Path, capsys, devices: str, dtype: str) -> None:
    """The check of the test above on ``devices`` (test_emulate_gpu runs it on NCCL in bfloat16,
    where ProcessGroupNCCL once gave the sandbox all-zero gradients: pruning.calls.nccl_premul_scalar)."""
    _, logs = run_with_rank_0_virtual(tmp_path, capsys, devices, "ddp_own_grad.py", "4", dtype)
    for log in logs:
        lines = [ln.split("grad/own")[1].split() for ln in log.splitlines() if "grad/own" in ln]
        assert len(lines) == 4 and {r for ln in lines for r in ln} == {"1.000"}, log


def kept_sends_reach_the_sandbox(tmp_path: Path, capsys, devices: str) -> None:
    """The check of the test above on ``devices`` (test_emulate_gpu runs it on NCCL)."""
    _, logs = run_with_rank_0_virtual(tmp_path, capsys, devices, "p2p_steps.py")
    for log in logs:
        assert "rank 1: 3 steps (seed 1234), activation [2.5, 2.5, 2.5, 2.5]" in log, log


def kept_broadcasts_reach_the_sandbox(tmp_path: Path, capsys, devices: str) -> None:
    """The check of the test above on ``devices`` (test_emulate_gpu runs it on NCCL)."""
    out, logs = run_with_rank_0_virtual(tmp_path, capsys, devices, "root_broadcast.py")
    kept = sorted(p.name for p in (out / "bare" / "objects").glob("broadcast-*.tensor"))
    assert len(kept) == 3, kept  # one per iteration, from rank 0
    for log in logs:
        assert [f"rank 1: iteration {i}: ids as built" in log for i in range(3)] == [True] * 3, log
    for p in (out / "bare" / "objects").glob("broadcast-*.tensor"):
        p.unlink()
    capsys.readouterr()
    emu = ["emulate", "--graph", str(out / "cal" / "graph"), "--sandbox", "1", "--devices", devices]
    assert main([*emu, "--out", str(tmp_path / "emu"), "--", str(PROGRAMS / "root_broadcast.py")]) == 0
    printed = capsys.readouterr()
    assert "rank 1: iteration 0: ids not as built" in printed.out + printed.err
