"""The report page (prismllm/report/html.py): (a) pure-Python checks of render_html -- nothing to
fetch, the data blob round-trips, a hostile title cannot break out of its element; (b) the pages of
the samples in tests/data/report/ opened in headless Chromium (Debian's /usr/bin/chromium driven
by the ``playwright`` package): no script error, every chart drawn, hover and zoom work, every
download (SVG, PNG, CSV) gives a file of what is shown, the memory rank chooser and the iteration
choice redraw, the 1024-rank page opens in under 2 s; a screenshot of each sample is saved (also
to /tmp/report-screens/). The browser tests skip when Chromium or playwright is missing."""

from __future__ import annotations

import copy
import csv
import io
import json
import os
import random
import re
import shutil
import struct
import time
import xml.etree.ElementTree as ET
import zlib
from pathlib import Path

import numpy as np
import pytest

from prismllm.layout import Layout
from prismllm.report.data import _memory, compare, memory_grid
from prismllm.report.html import fmt_bytes, fmt_ns, json_for_script, render_html

DATA = Path(__file__).resolve().parent / "data" / "report"
CHROMIUM = "/usr/bin/chromium"
SCREENS = Path("/tmp/report-screens")
LOAD_LIMIT_S = 2.0
HOSTILE = "</script><script>alert(1)</script>"


def load(name: str) -> dict:
    return json.loads((DATA / f"{name}.json").read_text())


def make_large(sample: dict, tp: int = 8, pp: int = 8, dp: int = 16, spans_per_rank: int = 2000) -> dict:
    """A job of tp*pp*dp ranks (default 1024) made from the 8-rank sample: per-rank breakdown and
    memory for every rank, an 8x8 memory grid, a timeline of one rank per pipeline stage with
    ~``spans_per_rank`` spans each (the sample's spans repeated, times compressed to one iteration),
    and a reference of every rank."""
    rng = random.Random(1)
    world = tp * pp * dp
    d = copy.deepcopy(sample)
    d["title"] = f"gpt3d.py: {world} ranks (tp={tp}, pp={pp}, dp={dp})"
    d["world_size"] = world
    d["device"] = "NVIDIA H100 80GB HBM3"
    d["layout"] = {"tp": tp, "cp": 1, "ep": 1, "dp": dp, "edp": dp, "pp": pp, "order": "tp-cp-ep-dp-pp"}

    def coords(r: int) -> tuple[int, int, int]:  # (tp, dp, pp): tp fastest, then dp, then pp
        return r % tp, (r // tp) % dp, r // (tp * dp)

    span = sample["breakdown"]["span_ns"][0]
    b = {
        "iteration": sample["breakdown"]["iteration"],
        "ranks": list(range(world)),
        "span_ns": [],
        "compute_ns": [],
        "comm_exposed_ns": [],
        "p2p_wait_ns": [],
        "idle_ns": [],
    }
    for r in range(world):
        _, _, s = coords(r)
        edge = abs(s - (pp - 1) / 2) / ((pp - 1) / 2)  # the first and last stages wait the most
        sp = int(span * (1 + 0.02 * rng.random()))
        compute = int(sp * (0.45 - 0.15 * edge) * (1 + 0.05 * rng.random()))
        comm = int(sp * 0.2 * (1 + 0.1 * rng.random()))
        idle = sp - compute - comm
        b["span_ns"].append(sp)
        b["compute_ns"].append(compute)
        b["comm_exposed_ns"].append(comm)
        b["idle_ns"].append(idle)
        b["p2p_wait_ns"].append(int(idle * (0.5 + 0.4 * edge)))
    d["breakdown"] = b
    per = []
    for r in range(world):
        t, _, s = coords(r)
        per.append(int((20.0 - 1.1 * s + 0.05 * t + 0.2 * rng.random()) * 2**30))
    m = max(range(world), key=per.__getitem__)
    t, q, s = coords(m)
    d["memory"] = {
        "per_rank": per,
        "known": True,
        "source": "solo capture: torch.cuda.max_memory_allocated of each rank run alone",
        "max": {"rank": m, "bytes": per[m], "where": f"pp {s} · tp {t} · dp {q}"},
        "grid": memory_grid(Layout(world=world, tp=tp, pp=pp), np.asarray(per, dtype=np.int64)),
    }
    src = sample["timeline"]["iterations"][0]["spans"]
    end = sample["timeline"]["iterations"][0]["end_ns"]
    rows = []
    for s in range(pp):
        base = src[s % len(src)]
        reps = max(round(spans_per_rank / max(len(base), 1)), 1)
        spans = []
        for k in range(reps):
            off = k * end
            spans += [
                [ln, kind, (a + off) // reps, (e + off) // reps, name, crit if k == reps - 1 else 0]
                for ln, kind, a, e, name, crit in base
            ]
        rows.append(spans)
    k = sample["timeline"]["iteration"]
    d["timeline"] = {
        "iteration": k,
        "ranks": [{"rank": s * tp * dp, "label": f"pp {s} · tp 0 · dp 0"} for s in range(pp)],
        "iterations": [{"iteration": k, "end_ns": end, "spans": rows}],
    }
    d["critical_path"] = {
        **sample["critical_path"],
        "end_rank": world - 1,
        "ranks_visited": list(range(0, world, tp * dp // 2)),
    }
    d["critical_paths"] = [d["critical_path"]]
    d["communicators"] = {
        "logical_groups": 1 + world // tp + world // dp + world // pp + 2 * tp * dp,
        "not_instantiated": 1100,
        "all_real": 2,
        "pruned": 30,
        "largest_logical_group": world,
        "largest_communicator": 5,
        "communicators": 32,
    }
    d["communicators"]["not_instantiated"] = d["communicators"]["logical_groups"] - 32
    emu_rank = sample["emulation"]["per_rank"]["7"]
    d["emulation"] = {
        **sample["emulation"],
        "sandbox": [0, 1, 2, 3],
        "devices": "cuda:0",
        "per_rank": {str(r): {**emu_rank, "peak_memory_bytes": per[r]} for r in range(4)},
    }
    d["reference"] = {
        "source": "/data/real-1024",
        "iteration": {"predicted_ns": span, "real_ns": int(span / 1.05), "rel_error": 0.05},
        "per_rank": [
            {
                "rank": r,
                "predicted_ns": b["span_ns"][r],
                "real_ns": int(b["span_ns"][r] * (1 + 0.1 * (rng.random() - 0.5))),
                "predicted_bytes": per[r],
                "real_bytes": int(per[r] * (1 + 0.04 * rng.random())),
            }
            for r in range(world)
        ],
    }
    return d


def make_moe(sample: dict, tp: int = 2, pp: int = 4, ep: int = 32, dp: int = 128) -> dict:
    """A 1024-rank MoE job (pp=4, tp=2, ep=32 carved out of dp=128: 64 columns a stage) whose
    peak memory is skewed by expert rank (a few hot experts), its grid made by ``_memory``."""
    d = make_large(sample, tp=tp, pp=pp, dp=dp, spans_per_rank=200)
    layout = Layout(world=tp * pp * dp, tp=tp, pp=pp, ep=ep)
    c = layout.coords_array()
    hot = (c["ep"] % 7 == 3).astype(np.float64)  # the experts the router favours hold more
    per = ((20.0 - 1.1 * c["pp"] + 0.05 * c["tp"] + 3.0 * hot + 0.01 * c["dp"]) * 2**30).astype(np.int64)
    d["title"] = f"moe.py: {layout.world} ranks (tp={tp}, pp={pp}, ep={ep}, dp={dp})"
    d["layout"] = layout.to_dict()
    d["memory"] = _memory({"peak_memory_bytes": {str(r): int(v) for r, v in enumerate(per)}}, layout.world, layout)
    return d


def make_sparse(sample: dict) -> dict:
    """A run that got only as far as calibrate, without a layout: every optional part missing."""
    d = copy.deepcopy(sample)
    for k in ("breakdown", "bubble", "critical_path", "timeline", "communicators", "emulation", "reference", "layout"):
        d[k] = None
    d["stages"], d["critical_paths"] = [], []
    d["prediction"] = {"iteration_ns": None, "median_iteration": None, "steady_iterations": [], "iterations": []}
    return d


def make_unlaid(large: dict) -> dict:
    """The large job without a layout: no memory grid (a cell per rank instead), ranks grouped in runs."""
    d = copy.deepcopy(large)
    d["layout"] = None
    d["memory"]["grid"] = None
    return d


def before(sample: dict) -> dict:
    """The sample as an earlier run of it might have been: 25 % slower, its stages longer."""
    d = copy.deepcopy(sample)
    d["prediction"]["iteration_ns"] = int(d["prediction"]["iteration_ns"] * 1.25)
    d["critical_path"]["total_ns"] = int(d["critical_path"]["total_ns"] * 1.25)
    for st in d["stages"]:
        st["wall_s"] *= 2
    return d


def with_iterations(sample: dict) -> dict:
    """The sample with every iteration of its prediction to choose from, each made from the median
    one's critical path and timeline scaled in time to that iteration's predicted time, and a
    Perfetto trace beside it."""
    d = copy.deepcopy(sample)
    k = d["critical_path"]["iteration"]
    times = {x["iteration"]: x["predicted_ns"] for x in d["prediction"]["iterations"]}
    cp, tl = d["critical_path"], d["timeline"]["iterations"][0]
    d["critical_paths"], d["timeline"]["iterations"] = [], []
    for j in sorted(times):
        f = times[j] / times[k]
        d["critical_paths"].append(
            {
                **cp,
                "iteration": j,
                "total_ns": round(cp["total_ns"] * f),
                "iteration_ns": round(cp["iteration_ns"] * f),
                "by_kind": {what: round(ns * f) for what, ns in cp["by_kind"].items()},
            }  # fmt: skip
        )
        d["timeline"]["iterations"].append(
            {
                "iteration": j,
                "end_ns": round(tl["end_ns"] * f),
                "spans": [
                    [[ln, kind, round(a * f), round(b * f), name, c] for ln, kind, a, b, name, c in spans]
                    for spans in tl["spans"]
                ],
            }  # fmt: skip
        )
    d["perfetto"] = [{"file": "cal/trace.pftrace", "href": "cal/trace.pftrace", "format": "protobuf", "bytes": 201728}]
    return d


def make_compared(a: dict, b: dict) -> dict:
    """Run ``a``'s page with run ``b`` beside it (``prism report A --compare B``)."""
    d = copy.deepcopy(a)
    d["compare"] = compare(a, b, "/runs/before")
    return d


def samples() -> dict[str, dict]:
    cpu = load("cpu-8ranks")
    large = make_large(cpu)
    gpu = load("gpu-8ranks")
    return {
        "cpu-8ranks": cpu,
        "gpu-8ranks": gpu,
        "gpu-vs-cpu": make_compared(gpu, before(cpu)),
        "gpu-iterations": with_iterations(gpu),
        "large-1024ranks": large,
        "large-16384ranks": make_large(cpu, dp=256, spans_per_rank=200),
        "large-no-layout": make_unlaid(large),
        "moe-skew": make_moe(cpu),
        "sparse": make_sparse(cpu),
    }


@pytest.fixture(scope="module")
def pages() -> dict[str, tuple[dict, str]]:
    return {name: (d, render_html(d)) for name, d in samples().items()}


def blob(page: str) -> str:
    m = re.search(r'<script type="application/json" id="report-data">(.*?)</script>', page, re.S)
    assert m, "no data blob"
    return m.group(1)


# ---------------------------------------------------------------------- (a) the HTML itself
def test_large_sample_shape():
    d = make_large(load("cpu-8ranks"))
    assert d["world_size"] == 1024 and len(d["breakdown"]["span_ns"]) == 1024
    assert len(d["memory"]["per_rank"]) == 1024 and len(d["memory"]["grid"]["values"]) == 8
    assert all(len(row) == 8 for row in d["memory"]["grid"]["values"])
    assert len(d["timeline"]["ranks"]) == 8 and len(d["timeline"]["iterations"]) == 1
    assert all(1900 <= len(spans) <= 2100 for spans in d["timeline"]["iterations"][0]["spans"])


def test_nothing_to_fetch(pages):
    for name, (d, page) in pages.items():
        # the only address in the page is the SVG namespace (an identifier, never fetched)
        urls = set(re.findall(r"https?://[^\s\"'<>)]*", page, re.I))
        assert urls <= {"http://www.w3.org/2000/svg"}, (name, urls)
        # no element loads anything (the script makes its downloads from blob: and data: addresses, in the page)
        markup = re.sub(r"<script\b.*?</script>", "", page, flags=re.S)
        assert not re.search(r"\bsrc\s*=", markup, re.I), name
        # a link only to a file of the run (the Perfetto trace), by a relative path, followed only when clicked
        links = re.findall(r"\bhref\s*=\s*\"([^\"]*)\"", markup, re.I)
        assert links == [t["href"] for t in d.get("perfetto") or []], (name, links)
        assert all(":" not in h and not h.startswith("/") for h in links), links
        assert "@import" not in page, name
        for target in re.findall(r"url\(\s*['\"]?([^'\")]*)", page):
            assert target.startswith(("#", "data:")), (name, target)
        assert "<link" not in page.lower() and "<iframe" not in page.lower(), name


def test_blob_round_trips(pages):
    for name, (d, page) in pages.items():
        assert json.loads(blob(page)) == d, name
        assert page.count("<script") == 2, name  # the blob and the script, nothing else


def test_hostile_strings_stay_inside():
    d = load("cpu-8ranks")
    d["title"] = HOSTILE
    d["command"] = ["train.py", "--name", HOSTILE, "<!--", "&amp;"]
    d["timeline"]["iterations"][0]["spans"][0][0][4] = HOSTILE
    d["perfetto"] = [{"file": HOSTILE, "href": '"><script>', "format": "JSON", "bytes": 1}]
    page = render_html(d)
    assert "alert(1)</script>" not in page and "<script>alert" not in page
    assert page.count("<script") == 2 and page.count("</script>") == 2
    assert 'href="&quot;&gt;&lt;script&gt;"' in page
    assert "<title>&lt;/script&gt;&lt;script&gt;alert(1)&lt;/script&gt;</title>" in page
    assert json.loads(blob(page)) == d
    assert "\u2028" not in json_for_script({"x": "a\u2028b"})
    nan = json.loads(json_for_script({"x": float("nan"), "y": [float("inf"), 1.5]}))
    assert nan == {"x": None, "y": [None, 1.5]}


def test_sections_in_order(pages):
    _, page = pages["gpu-8ranks"]
    ids = re.findall(r'<(?:header|section) id="([a-z-]+)"', page)
    assert ids == ["top", "where", "memory", "timeline", "emulation", "reference"]
    assert "reference" not in re.findall(r'<section id="([a-z-]+)"', pages["cpu-8ranks"][1])
    for _, html in pages.values():  # numbered from 1, with no gap where a section is left out
        nums = [int(n) for n in re.findall(r"<h2[^>]*><span class=\"num\">(\d+)</span>", html)]
        assert nums == list(range(1, len(nums) + 1)), nums


def test_two_runs_side_by_side(pages):
    """`--compare`: every figure of both runs in one table with the change from the other run; a
    figure only one run has is shown with a dash; texts say same or differs; where both measured
    every rank's peak memory, how many differ and the most."""
    a, b = pages["gpu-8ranks"][0], before(pages["cpu-8ranks"][0])
    d, html = pages["gpu-vs-cpu"]
    ids = re.findall(r'<(?:header|section) id="([a-z-]+)"', html)
    assert ids[-1] == "compare" and "compare" not in pages["gpu-8ranks"][1]
    rows = {r["what"]: r for r in d["compare"]["rows"]}
    pa, pb = a["prediction"]["iteration_ns"], b["prediction"]["iteration_ns"]
    assert (rows["Predicted iteration"]["a"], rows["Predicted iteration"]["b"]) == (pa, pb)
    section = html[html.index('<section id="compare">') :]
    cells = re.findall(r"<td[^>]*>([^<]*)</td>", section)
    at = cells.index("Predicted iteration")
    assert cells[at + 1 : at + 4] == [fmt_ns(pa), fmt_ns(pb), f"{100 * (pa - pb) / pb:+.1f} %"]
    at = cells.index("Ranks")
    assert cells[at + 3] == "same"
    at = cells.index("Device")
    assert cells[at + 1 : at + 4] == [a["device"], b["device"], "differs"]
    # a figure only one run has: the GPU run's peak memory, against a CPU run that measured none
    at = cells.index("Largest peak memory")
    assert cells[at + 1 : at + 4] == [fmt_bytes(a["memory"]["max"]["bytes"]), "–", ""]
    assert "Pipeline bubble" in cells or not (a["bubble"] or b["bubble"])
    assert "/runs/before" in section
    same = compare(a, a, "itself")
    assert all(r["a"] == r["b"] for r in same["rows"])
    mem = same.get("memory")
    assert mem == {"ranks": a["world_size"], "differ": 0, "largest": None}, mem
    other = copy.deepcopy(a)
    other["memory"]["per_rank"][3] += 2**20
    assert compare(a, other, "x")["memory"]["largest"] == {
        "rank": 3, "a": a["memory"]["per_rank"][3], "b": a["memory"]["per_rank"][3] + 2**20,
    }  # fmt: skip


def test_the_critical_path_says_how_it_stands_to_the_iteration(pages):
    d, html = pages["gpu-8ranks"]
    cp = d["critical_path"]
    assert f"The path adds up the work on it: {fmt_ns(cp['total_ns'])} of iteration {cp['iteration']}" in html
    if cp["iteration_ns"] > cp["total_ns"]:
        assert f"in the other {fmt_ns(cp['iteration_ns'] - cp['total_ns'])} the path holds no work" in html


def test_header_figures(pages):
    cpu, gpu = pages["cpu-8ranks"][1], pages["gpu-8ranks"][1]
    assert "62.44 ms" in cpu  # predicted
    assert "99.99 ms" in cpu and "rank 7 run for real on cpu" in cpu  # emulated, and where
    assert "not measured on CPU" in cpu and "30.7 %" in cpu  # memory, bubble
    for stage in ("capture", "time", "calibrate", "emulate", "report"):
        assert f"<td>{stage}</td>" in cpu
    d = pages["gpu-8ranks"][0]
    assert fmt_bytes(d["memory"]["max"]["bytes"]) in gpu and d["memory"]["max"]["where"] in gpu
    assert "+4.3 %" in gpu  # the iteration-level error against the real run
    assert fmt_ns(61_835_832) == "61.84 ms" and fmt_bytes(3 * 2**30) == "3.00 GiB" and fmt_bytes(-1) == "–"
    sparse = pages["sparse"][1]
    assert "no emulation" in sparse.lower() and "No timeline" in sparse


# ---------------------------------------------------------------------- (b) in a browser
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


@pytest.fixture(scope="module")
def browser():
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"no {CHROMIUM} (Debian's chromium package: apt-get install -y chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("the playwright package is not installed (pip install playwright; no browser download)")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture(scope="module")
def files(pages, tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("report")
    paths = {}
    for name, (_, page) in pages.items():
        paths[name] = out / f"{name}.html"
        paths[name].write_text(page, encoding="utf-8")
    return paths


class Opened:
    """A page opened in the browser, with its script errors and any request that left it."""

    def __init__(self, browser, path: Path):
        self.errors: list[str] = []
        self.requests: list[str] = []
        self.page = browser.new_page(viewport={"width": 1280, "height": 900})
        self.page.set_default_timeout(5000)
        self.page.on("pageerror", lambda e: self.errors.append(f"pageerror: {e}"))
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(f"console: {m.text}"))
        # blob: and data: are the page's own downloads and PNG drawing, made in it
        local = ("file:", "data:", "about:", "blob:")
        self.page.on("request", lambda r: r.url.startswith(local) or self.requests.append(r.url))
        t0 = time.perf_counter()
        self.page.goto(path.as_uri(), wait_until="load")
        # the first frame painted after the load event
        self.page.evaluate("() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")
        self.load_s = time.perf_counter() - t0

    def count(self, selector: str) -> int:
        return self.page.locator(selector).count()

    def check_clean(self):
        assert not self.errors, self.errors
        assert not self.requests, f"the page fetched {self.requests}"

    def close(self):
        self.page.close()


def screenshot(o: Opened, name: str, tmp: Path, suffix: str = "") -> None:
    png = tmp / f"{name}{suffix}.png"
    o.page.screenshot(path=str(png), full_page=True)
    assert png.stat().st_size > 10_000
    try:
        SCREENS.mkdir(parents=True, exist_ok=True)
        shutil.copy(png, SCREENS / png.name)
    except OSError:
        pass


@pytest.mark.parametrize(
    "name",
    [
        "cpu-8ranks",
        "gpu-8ranks",
        "gpu-vs-cpu",
        "gpu-iterations",
        "large-1024ranks",
        "large-16384ranks",
        "large-no-layout",
        "moe-skew",
        "sparse",
    ],
)
def test_page_draws(browser, files, pages, tmp_path, name):
    d = pages[name][0]
    o = Opened(browser, files[name])
    try:
        o.check_clean()
        if d["critical_path"]:
            assert o.count("#cp-chart svg rect") >= 3
            assert o.count("#cp-chart tbody tr") >= 3
        if d["breakdown"]:
            assert o.count("#breakdown-chart svg rect") >= 4
            if len(d["breakdown"]["ranks"]) > 64:  # grouped (per stage) and a strip of every rank
                groups = d["layout"]["pp"] if d["layout"] else 64
                assert o.count("#breakdown-chart svg .whisker") == groups
                # a cell a rank, or past 2048 ranks a cell a run of them
                per = -(-d["world_size"] // 2048)
                assert o.count("#breakdown-chart svg g rect[data-tip]") == -(-d["world_size"] // per)
                if d["layout"]:  # a tick where each stage but the first begins
                    assert o.count("#breakdown-chart svg line.sep") == groups - 1
        if d["memory"]["known"]:
            g = d["memory"]["grid"]["values"] if d["memory"]["grid"] else [d["memory"]["per_rank"]]
            assert o.count("#memory-chart rect.cell") == len(g) * len(g[0])
            assert o.count("#memory-chart .max-cell") == 1
            assert o.count("#memory-ranks-chart path.mem-line") >= 1 and o.count("#memory-ranks-chart .mem-marker") == 1
        else:
            assert "not measured" in o.page.inner_text("#memory")
        if d["timeline"]:
            drawn = o.page.eval_on_selector_all(
                "#timeline-chart path.span", "ps => ps.filter(p => (p.getAttribute('d') || '').length > 0).length"
            )
            assert drawn >= 3
            assert o.page.eval_on_selector("#timeline-chart path.crit", "p => p.getAttribute('d').length") > 0
            assert o.count("#timeline-chart .axis text") >= 3
        if d["communicators"]:
            assert o.count("#comm-chart svg rect") >= 2
        if d.get("compare"):
            assert o.count("#compare tbody tr") >= 10 and o.page.is_visible("#compare table")
        # every heading of a chart drawn or a table has its downloads
        heads = o.count("[data-dl]")
        assert o.count("[data-dl] .dl") == heads and (heads > 2 or name == "sparse")
        screenshot(o, name, tmp_path)
        if name == "gpu-8ranks":  # how it prints: no controls, the charts redrawn to the page's width
            o.page.set_viewport_size({"width": 794, "height": 1123})  # A4 at 96 dpi
            o.page.emulate_media(media="print")
            o.page.wait_for_timeout(300)
            assert not o.page.is_visible("#timeline .controls")
            width = o.page.eval_on_selector("#timeline-chart svg", "s => s.getBoundingClientRect().width")
            assert width <= 794, width
            screenshot(o, name, tmp_path, "-print")
            pdf = o.page.pdf(format="A4", print_background=True)
            assert pdf.startswith(b"%PDF") and len(pdf) > 20_000
            o.check_clean()
    finally:
        o.close()


def tick_labels(o: Opened) -> list[str]:
    return o.page.eval_on_selector_all("#timeline-chart .axis text.tick", "ts => ts.map(t => t.textContent)")


def test_hover_and_zoom(browser, files):
    o = Opened(browser, files["cpu-8ranks"])
    try:
        o.page.locator("#timeline-chart svg").scroll_into_view_if_needed()
        box = o.page.locator("#timeline-chart svg").bounding_box()
        # rank 0's program lane at 7 % of the iteration: an all_reduce (3.0-5.7 ms of 61.8)
        x = box["x"] + 150 + (box["width"] - 162) * 0.07
        y = box["y"] + (28 + 8) * box["height"] / o.page.eval_on_selector(
            "#timeline-chart svg", "s => s.viewBox.baseVal.height"
        )
        o.page.mouse.move(x, y)
        assert o.page.is_visible("#tip")
        tip = o.page.inner_text("#tip")
        assert "rank 0" in tip and re.search(r"\d (ms|µs|ns)", tip), tip
        before, view = tick_labels(o), o.page.inner_text("#timeline .view-text")
        o.page.mouse.wheel(0, -600)  # zoom in around the pointer
        o.page.wait_for_timeout(100)
        after = tick_labels(o)
        assert after != before and o.page.inner_text("#timeline .view-text") != view
        o.page.mouse.move(x, y)
        o.page.mouse.down()
        o.page.mouse.move(x - 200, y, steps=4)  # drag to pan later in time
        o.page.mouse.up()
        o.page.wait_for_timeout(100)
        assert tick_labels(o) != after
        o.page.click("#timeline [data-zoom=reset]")
        o.page.wait_for_timeout(100)
        assert tick_labels(o) == before
        o.page.click("#timeline [data-zoom=in]")
        o.page.wait_for_timeout(100)
        assert tick_labels(o) != before
        # a breakdown column and a critical-path segment show their figures too
        o.page.hover("#breakdown-chart g.col >> nth=0")
        assert "rank 0" in o.page.inner_text("#tip") and "compute" in o.page.inner_text("#tip")
        o.check_clean()
    finally:
        o.close()
    o = Opened(browser, files["gpu-8ranks"])
    try:
        o.page.hover("#memory-chart rect.cell >> nth=0")
        assert "bytes" in o.page.inner_text("#tip") and "pp 0 · tp 0" in o.page.inner_text("#tip")
        o.check_clean()
    finally:
        o.close()


def test_memory_columns_of_an_moe_layout(browser, files, pages):
    """The MoE grid's 64 (ep, tp) columns: their labels as ticks, thinned so that none overlap,
    and in each cell's tip; the caption names the column dimensions."""
    d, page = pages["moe-skew"]
    labels = d["memory"]["grid"]["col_labels"]
    assert len(labels) == 64 and labels[:3] == ["ep 0 · tp 0", "ep 0 · tp 1", "ep 1 · tp 0"]
    assert "columns the (expert-parallel, tensor-parallel) ranks" in page
    o = Opened(browser, files["moe-skew"])
    try:
        o.check_clean()
        ticks = o.page.eval_on_selector_all(
            "#memory-chart text.col-tick",
            "ts => ts.map(t => { const b = t.getBBox(); return [t.textContent, b.x, b.width]; })",
        )
        assert 2 <= len(ticks) <= 32 and ticks[0][0] == "ep 0 · tp 0"
        assert all(t[0] in labels and t[0].endswith("tp 0") for t in ticks)  # at expert-rank starts
        for a, b in zip(ticks, ticks[1:], strict=False):
            assert a[1] + a[2] <= b[1], (a, b)  # no two labels overlap
        o.page.hover("#memory-chart rect.cell >> nth=5")  # stage 0, column 5
        assert "pp 0 · ep 2 · tp 1" in o.page.inner_text("#tip")
        o.check_clean()
    finally:
        o.close()


def test_large_page_opens_fast(browser, files):
    times = []
    for _ in range(2):  # the first open also warms the browser's caches; the limit holds for both
        o = Opened(browser, files["large-1024ranks"])
        try:
            o.check_clean()
            nav = o.page.evaluate(
                "() => { const n = performance.getEntriesByType('navigation')[0]; "
                "const p = performance.getEntriesByName('first-paint')[0]; "
                "return [n.loadEventEnd, p ? p.startTime : null]; }"
            )
            times.append(o.load_s)
            paint = f", first paint at {nav[1]:.0f} ms" if nav[1] is not None else ""
            print(
                f"\n1024-rank page ({files['large-1024ranks'].stat().st_size / 1e6:.1f} MB): opened and painted "
                f"in {o.load_s:.3f} s (load event at {nav[0]:.0f} ms{paint})"
            )
        finally:
            o.close()
    assert max(times) < LOAD_LIMIT_S, times


# ---------------------------------------------------------------------- downloads, choices
def download(o: Opened, selector: str) -> tuple[str, bytes]:
    """Click a download button: (the file's name, its bytes)."""
    with o.page.expect_download() as dl:
        o.page.click(selector)
    return dl.value.suggested_filename, Path(dl.value.path()).read_bytes()


def png_size_and_pixels(data: bytes) -> tuple[int, int, bytes]:
    """A PNG's width, height and its image data, unpacked (filter bytes and pixels)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", data[:8]
    width, height = struct.unpack(">II", data[16:24])
    idat, at = b"", 8
    while at < len(data):
        n, kind = struct.unpack(">I4s", data[at : at + 8])
        idat += data[at + 8 : at + 8 + n] if kind == b"IDAT" else b""
        at += 12 + n
    return width, height, zlib.decompress(idat)


CHARTS = ("cp-chart", "breakdown-chart", "memory-chart", "memory-ranks-chart", "timeline-chart", "comm-chart")
TABLES = ("stages-table", "emulation-table", "reference-table", "compare-table")


def test_downloads_of_every_chart_and_table(browser, files, pages):
    """Beside each heading of a chart, its picture as SVG (a file of its own: well-formed, every
    element of the chart and its legend) and PNG (the SVG drawn on a canvas at twice its size, not
    blank), and the data behind it as CSV; beside a table's, the table as CSV, cell for cell."""
    d = pages["gpu-vs-cpu"][0]
    world, emu = d["world_size"], d["emulation"]["per_rank"]["7"]["peak_memory_bytes"]
    rows_of = {  # the data rows each chart's CSV has
        "cp-chart": len(d["critical_path"]["by_kind"]),
        "breakdown-chart": world,
        "memory-chart": len(d["memory"]["grid"]["values"]),
        "memory-ranks-chart": world,
        "timeline-chart": sum(len(s) for s in d["timeline"]["iterations"][0]["spans"]),
        "comm-chart": 3,
    }
    o = Opened(browser, files["gpu-vs-cpu"])
    try:
        heads = o.page.eval_on_selector_all(
            "[data-dl]",
            "hs => hs.map(h => [h.getAttribute('data-dl'), [...h.querySelectorAll('.dl button')].map(b => b.dataset.as)])",
        )
        assert dict(heads) == {**{c: ["svg", "png", "csv"] for c in CHARTS}, **{t: ["csv"] for t in TABLES}}
        for target, _ in heads:
            name, data = download(o, f'[data-dl="{target}"] .dl [data-as=csv]')
            rows = list(csv.reader(io.StringIO(data.decode())))
            assert name.startswith("gpt3d-py-8-ranks-tp-2-pp-2-dp-2-") and name.endswith(".csv"), name
            if target in TABLES:
                shown = o.page.eval_on_selector(
                    f"#{target}", "t => [...t.rows].map(r => [...r.cells].map(c => c.textContent.trim()))"
                )
                assert rows == shown and len(rows) >= 2, target
                continue
            assert len(rows) == rows_of[target] + 1, (target, rows[:3])
            name, data = download(o, f'[data-dl="{target}"] .dl [data-as=svg]')
            svg = ET.fromstring(data)
            assert name.endswith(".svg") and svg.tag == "{http://www.w3.org/2000/svg}svg", name
            drawn = o.page.eval_on_selector(f"#{target}", "b => b.querySelectorAll('svg *').length")
            legend = o.count(f"#{target} .legend > span")
            assert len(list(svg.iter())) == 1 + 1 + drawn + 2 * legend, target  # root, background, chart, legend
            assert "fill:" in (svg.get("style") or "") and "data-tip" not in data.decode()
            name, data = download(o, f'[data-dl="{target}"] .dl [data-as=png]')
            w, h, pixels = png_size_and_pixels(data)
            assert name.endswith(".png") and (w, h) == (2 * int(svg.get("width")), 2 * int(svg.get("height"))), target
            assert len(set(pixels)) > 20, target  # drawn, not a blank canvas
        # the data behind the charts, as the page has it
        _, data = download(o, '[data-dl="memory-ranks-chart"] .dl [data-as=csv]')
        rows = list(csv.reader(io.StringIO(data.decode())))
        assert rows[0] == [
            "rank",
            "where",
            "solo capture (bytes)",
            "emulation (run for real) (bytes)",
            "real run (bytes)",
        ]
        real7 = d["reference"]["per_rank"][7]["real_bytes"]
        assert rows[8] == ["7", "pp 1 · tp 1 · dp 1", str(d["memory"]["per_rank"][7]), str(emu), str(real7)]
        assert rows[1][3] == ""  # rank 0 did not run for real
        name, data = download(o, '[data-dl="cp-chart"] .dl [data-as=csv]')
        rows = list(csv.reader(io.StringIO(data.decode())))
        assert name.endswith("-cp-iteration-2.csv")
        assert {r[1]: int(r[2]) for r in rows[1:]} == d["critical_path"]["by_kind"]
        o.check_clean()
    finally:
        o.close()


def test_memory_rank_chooser(browser, files, pages):
    """Every rank's peak from each source in rank order; the rank chosen (at first the one with the
    most) is marked, with its figures beside the chooser, and another choice moves both."""
    d = pages["gpu-8ranks"][0]
    per, emu = d["memory"]["per_rank"], d["emulation"]["per_rank"]["7"]["peak_memory_bytes"]
    o = Opened(browser, files["gpu-8ranks"])
    try:

        def shown() -> tuple[str, str, int]:
            return (
                o.page.inner_text("#memory .memory-rank-text"),
                o.page.eval_on_selector("#memory-ranks-chart .mem-marker", "l => l.getAttribute('x1')"),
                o.count("#memory-ranks-chart .mem-at"),
            )

        # the capture and the real run as lines, the one rank run for real as a dot
        assert o.count("#memory-ranks-chart path.mem-line") == 2
        text, x, at = shown()
        real = fmt_bytes(d["reference"]["per_rank"][3]["real_bytes"])
        figures = f"solo capture {fmt_bytes(per[3])} · emulation (run for real) – · real run {real}"
        assert text == f"rank 3 (pp 0 · tp 1 · dp 1): {figures}" and at == 2
        o.page.fill("#memory-rank", "7")
        text7, x7, at7 = shown()
        assert text7.startswith("rank 7 (pp 1 · tp 1 · dp 1): ") and f"(run for real) {fmt_bytes(emu)}" in text7
        assert float(x7) > float(x) and at7 == 3
        o.page.fill("#memory-rank", "0")
        assert shown()[0].startswith("rank 0 ") and float(shown()[1]) < float(x)
        o.check_clean()
    finally:
        o.close()


def test_iteration_choice(browser, files, pages):
    """The timeline and the critical path show the median iteration first; choosing another in
    either selector sets both, shows that iteration's text, redraws both charts with its data and
    names the downloads after it; choosing the median again gives the first view back."""
    d = pages["gpu-iterations"][0]
    cps = {cp["iteration"]: cp for cp in d["critical_paths"]}
    ends = {x["iteration"]: x["end_ns"] for x in d["timeline"]["iterations"]}
    o = Opened(browser, files["gpu-iterations"])
    try:

        def chosen() -> list[str]:
            return o.page.eval_on_selector_all("select.iteration", "ss => ss.map(s => s.value)")

        def heading() -> str:
            return o.page.inner_text('#where h3[data-dl="cp-chart"]')

        def first_cp_row() -> str:
            return o.page.inner_text("#cp-chart tbody tr >> nth=0")

        assert chosen() == ["2", "2"]
        assert o.page.eval_on_selector_all("#timeline select.iteration option", "os => os.map(x => x.textContent)") == [
            f"0: {fmt_ns(3580810702)} (not steady)",
            f"1: {fmt_ns(63034916)}",
            f"2: {fmt_ns(61846500)} (median)",
        ]
        assert fmt_ns(cps[2]["total_ns"]) in heading()
        ticks, view, row = tick_labels(o), o.page.inner_text("#timeline .view-text"), first_cp_row()
        o.page.select_option("#timeline select.iteration", "0")
        o.page.wait_for_timeout(100)
        assert chosen() == ["0", "0"]
        assert fmt_ns(cps[0]["total_ns"]) in heading() and fmt_ns(cps[2]["total_ns"]) not in heading()
        assert "Iteration 0 as predicted" in o.page.inner_text("#timeline .caption")
        assert "of iteration 0's" in o.page.inner_text("#where h3 + .caption")
        assert tick_labels(o) != ticks and o.page.inner_text("#timeline .view-text").endswith(f"of {fmt_ns(ends[0])}")
        assert first_cp_row() != row and fmt_ns(max(cps[0]["by_kind"].values())) in first_cp_row()
        name, data = download(o, '[data-dl="timeline-chart"] .dl [data-as=csv]')
        rows = list(csv.reader(io.StringIO(data.decode())))
        assert name.endswith("-timeline-iteration-0.csv") and {r[0] for r in rows[1:]} == {"0"}
        assert max(int(r[5]) for r in rows[1:]) > 10 * ends[2]  # iteration 0's times (set-up included)
        o.page.select_option("#where select.iteration", "2")
        o.page.wait_for_timeout(100)
        assert chosen() == ["2", "2"] and tick_labels(o) == ticks and o.page.inner_text("#timeline .view-text") == view
        assert first_cp_row() == row
        o.check_clean()
    finally:
        o.close()
