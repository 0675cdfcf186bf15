"""The report page: one self-contained HTML file drawn from the data model of ``data.py``.

Nothing is fetched when the page opens: the stylesheet and the script (``assets/``) are inlined,
and the data travels as a JSON blob in ``<script type="application/json" id="report-data">``
(``<``, ``>`` and ``&`` written as ``\\u003c`` etc., so no string in it can close the element).
The text of the page (header, figures, captions, tables) is written here, so it reads without
the script too; ``assets/report.js`` draws the charts (SVG) from the blob: the critical path's
shares, the per-rank breakdown, the memory heat map and every rank's peak (a rank chooser), the
timeline (zoom, pan, hover) and the communicators' bar. It also adds the download buttons of
each heading that names a chart or table (``data-dl``: SVG, PNG and the data as CSV for a chart,
CSV for a table) and the iteration choice: the text of every iteration is written here, each in
an element with ``data-iteration``, and the script shows the chosen one's.
"""

from __future__ import annotations

import dataclasses
import datetime
import html
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

ASSETS = Path(__file__).with_name("assets")
MAX_TABLE_RANKS = 64  # above this, per-rank tables show the worst ranks and a summary


# ---------------------------------------------------------------------- formatting
def escape(x: Any) -> str:
    """Any value as HTML text (quotes too: safe in an attribute)."""
    return html.escape(str(x), quote=True)


def fmt_ns(ns: float | None) -> str:
    """62440708 -> "62.44 ms"; seconds from 1 s, µs below 1 ms."""
    if ns is None or not isinstance(ns, (int, float)) or not math.isfinite(ns) or ns < 0:
        return "–"
    if ns >= 1e9:
        return f"{ns / 1e9:.2f} s"
    if ns >= 1e6:
        return f"{ns / 1e6:.2f} ms"
    if ns >= 1e3:
        return f"{ns / 1e3:.1f} µs"
    return f"{ns:.0f} ns"


def fmt_bytes(b: float | None) -> str:
    """Binary units: "12.34 GiB", "512.0 MiB"; "–" for unknown (None or negative)."""
    if b is None or not isinstance(b, (int, float)) or b < 0:
        return "–"
    if b >= 2**30:
        return f"{b / 2**30:.2f} GiB"
    if b >= 2**20:
        return f"{b / 2**20:.1f} MiB"
    return f"{b / 2**10:.1f} KiB"


def _pct(x: float | None, signed: bool = False) -> str:
    if x is None or not math.isfinite(x):
        return "–"
    return f"{100 * x:+.1f} %" if signed else f"{100 * x:.1f} %"


def _rel(pred: float | None, real: float | None) -> float | None:
    if pred is None or real is None or pred < 0 or real <= 0:
        return None
    return (pred - real) / real


def _date(iso: str | None) -> str:
    if not iso:
        return "–"
    try:
        d = datetime.datetime.fromisoformat(iso)
    except ValueError:
        return str(iso)
    if d.tzinfo is not None:
        d = d.astimezone(datetime.UTC)
        return d.strftime("%Y-%m-%d %H:%M UTC")
    return d.strftime("%Y-%m-%d %H:%M")


def layout_text(layout: dict[str, Any] | None) -> str:
    """ "tp=2 · pp=2 · dp=2" (dimensions of size > 1, dp always)."""
    if not layout:
        return "none given"
    parts = [f"{k}={layout[k]}" for k in ("tp", "cp", "ep", "pp", "dp") if layout.get(k, 1) > 1 or k == "dp"]
    return " · ".join(parts)


def coords_text(layout: dict[str, Any] | None, world: int, rank: int) -> str:
    """ "pp 1 · tp 0" as data.coords_text writes it (the same mixed-radix rule, from the dict)."""
    if not layout:
        return f"rank {rank}"
    order = str(layout.get("order", "tp-cp-ep-dp-pp")).split("-")
    sizes = {
        "tp": layout.get("tp", 1),
        "cp": layout.get("cp", 1),
        "ep": layout.get("ep", 1),
        "dp": layout.get("edp", layout.get("dp", 1)),
        "pp": layout.get("pp", 1),
    }
    c, r = {}, rank
    for d in order:
        n = max(int(sizes.get(d, 1)), 1)
        c[d] = r % n
        r //= n
    ep, edp = c.get("ep", 0), c.get("dp", 0)
    dense = edp * sizes["ep"] + ep if order.index("ep") < order.index("dp") else ep * sizes["dp"] + edp
    c = {**c, "dp": dense}
    dims = [d for d in ("pp", "tp", "cp", "ep", "dp") if sizes[d] > 1]
    return " · ".join(f"{d} {c[d]}" for d in dims) or f"rank {rank}"


def _finite(x: Any) -> Any:
    """The data with NaN and infinities as null (JSON has neither)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def json_for_script(data: Any) -> str:
    """JSON that is safe inside a <script> element: no '<', '>', '&' or line separators appear
    literally (each is a JSON escape, which JSON.parse reads back as the same character)."""
    s = json.dumps(_finite(data), ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    for ch, esc in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
        s = s.replace(ch, esc)
    return s


def asset(name: str) -> str:
    text = (ASSETS / name).read_text(encoding="utf-8")
    if "</script" in text.lower() or "</style" in text.lower():  # our own files: a bug if so
        raise ValueError(f"report asset {name} contains a closing tag")
    return text


# ---------------------------------------------------------------------- sections
def _card(label: str, value: str, note: str, cls: str = "") -> str:
    return (
        f'<div class="card {cls}"><div class="card-label">{escape(label)}</div>'
        f'<div class="card-value">{escape(value)}</div><div class="card-note">{escape(note)}</div></div>'
    )


def iterations_text(its: list[int]) -> str:
    if not its:
        return "none"
    if len(its) > 2 and its == list(range(its[0], its[-1] + 1)):
        return f"{its[0]}–{its[-1]}"
    return ", ".join(str(i) for i in its)


def _header(d: dict[str, Any]) -> str:
    world = d.get("world_size") or 0
    layout = d.get("layout")
    pred = d.get("prediction") or {}
    cmd = " ".join(str(a) for a in (d.get("command") or [])) or "–"
    facts = [
        ("ranks", f"{world:,}"),
        ("layout", layout_text(layout)),
        ("device", d.get("device") or "–"),
        ("created", _date(d.get("created"))),
        ("prismllm", d.get("prismllm") or "–"),
    ]
    out = [
        f'<header id="top"><h1>{escape(d.get("title") or "prism report")}</h1>',
        f'<p class="command"><span class="k">command</span> <code>{escape(cmd)}</code></p>',
        '<dl class="facts">'
        + "".join(f"<div><dt>{escape(k)}</dt><dd>{escape(v)}</dd></div>" for k, v in facts)
        + "</dl>",
        '<div class="cards">',
    ]
    ipred = pred.get("iteration_ns")
    steady = pred.get("steady_iterations") or []
    out.append(
        _card(
            "Predicted iteration",
            fmt_ns(ipred),
            f"calibrated prediction for all {world:,} ranks: median of the steady iterations ({iterations_text(steady)})"
            if ipred is not None
            else "no prediction (the calibration found no steady iteration)",
            "main",
        )
    )
    emu = d.get("emulation")
    if emu and emu.get("per_rank"):
        items = sorted(emu["per_rank"].items(), key=lambda kv: int(kv[0]))
        where = emu.get("devices") or d.get("device") or "?"
        others = max(world - len(items), 0)
        shared = " (one shared GPU)" if emu.get("shared_gpu") else ""
        failed = "; the emulation did not finish cleanly" if emu.get("ok") is False else ""
        if len(items) <= 2:  # a card per rank run for real
            for r, m in items:
                med = m.get("median_steady_iteration_ns")
                vs = _rel(med, ipred)
                out.append(
                    _card(
                        f"Emulated iteration · rank {r}",
                        fmt_ns(med),
                        f"rank {r} run for real on {where}{shared}, the other {others:,} emulated"
                        + (f"; {_pct(vs, True)} against the prediction" if vs is not None else "")
                        + failed,
                    )
                )
        else:  # one card for all of them
            meds = [m.get("median_steady_iteration_ns") for _, m in items]
            known = [x for x in meds if x is not None]
            lo, hi = (min(known), max(known)) if known else (None, None)
            each = ", ".join(f"rank {r}: {fmt_ns(x)}" for (r, _), x in list(zip(items, meds))[:4])
            out.append(
                _card(
                    f"Emulated iteration · {len(items)} ranks",
                    fmt_ns(lo) if lo == hi else f"{fmt_ns(lo)} – {fmt_ns(hi)}",
                    f"run for real on {where}{shared}, the other {others:,} emulated; {each}"
                    + (" …" if len(items) > 4 else "")
                    + failed,
                )
            )
    else:
        out.append(_card("Emulated iteration", "not run", "no emulation in this run: only the prediction", "muted"))
    mem = d.get("memory") or {}
    mx = mem.get("max")
    if mem.get("known") and mx:
        known = [b for b in mem.get("per_rank") or [] if b is not None and b >= 0]
        out.append(
            _card(
                "Peak memory",
                fmt_bytes(mx.get("bytes")),
                f"rank {mx.get('rank')} ({mx.get('where')})" + (f"; least {fmt_bytes(min(known))}" if known else ""),
            )
        )
    else:
        cpu = "cpu" in str(d.get("device") or "").lower()
        out.append(
            _card(
                "Peak memory",
                "not measured on CPU" if cpu else "not measured",
                "the capture ran on the CPU, which has no device memory to measure: capture on GPUs for it"
                if cpu
                else str(mem.get("source") or "no peak memory in the capture"),
                "muted",
            )
        )
    bub = d.get("bubble")
    if bub and bub.get("fraction") is not None:
        worst = bub.get("max_rank")
        note = "share of the iteration all ranks together spend waiting for pipeline sends and receives"
        if worst is not None and bub.get("max") is not None:
            note += f"; worst rank {worst} ({coords_text(layout, world, int(worst))}): {_pct(bub['max'])}"
        out.append(_card("Pipeline bubble", _pct(bub["fraction"]), note))
    else:
        out.append(_card("Pipeline bubble", "none", "no pipeline sends or receives in the iteration", "muted"))
    out.append("</div>")
    stages = d.get("stages") or []
    if stages:
        longest = max((s.get("wall_s") or 0 for s in stages), default=0) or 1
        total = sum(s.get("wall_s") or 0 for s in stages)
        rows = "".join(
            f'<tr><td>{escape(s.get("name"))}</td><td class="num">{escape(_secs(s.get("wall_s")))}</td>'
            f'<td class="barcell"><span class="minibar" style="width:{100 * (s.get("wall_s") or 0) / longest:.1f}%">'
            f'</span></td><td class="what">{escape(s.get("what") or "")}</td></tr>'
            for s in stages
        )
        out.append(
            '<div class="stages"><h3 data-dl="stages-table">Stages of this run</h3><p class="caption">What '
            "<code>prism run</code> did to make this report, and how long each step took (wall-clock time on "
            'this machine).</p><table class="tbl" id="stages-table"><thead><tr><th>stage</th>'
            '<th class="num">wall time</th><th></th>'
            f"<th>what it did</th></tr></thead><tbody>{rows}</tbody><tfoot><tr><td>total</td>"
            f'<td class="num">{escape(_secs(total))}</td><td></td><td></td></tr></tfoot></table></div>'
        )
    out.append("</header>")
    return "\n".join(out)


def _secs(s: float | None) -> str:
    if s is None:
        return "–"
    if s >= 120:
        return f"{int(s // 60)} min {s % 60:.0f} s"
    return f"{s:.1f} s" if s >= 1 else f"{s * 1000:.0f} ms"


@dataclasses.dataclass
class _Section:
    """One numbered section of the page; numbered by its place (render_html), so a section added or
    left out never leaves a gap."""

    sid: str
    title: str
    caption: str
    body: str
    dl: str = ""  # the id of the chart or table whose downloads go beside the title, if any

    def html(self, num: int) -> str:
        dl = f' data-dl="{self.dl}"' if self.dl else ""
        return (
            f'<section id="{self.sid}"><h2{dl}><span class="num">{num}</span> {escape(self.title)}</h2>'
            f'<p class="caption">{self.caption}</p>{self.body}</section>'
        )


def _shown(d: dict[str, Any]) -> int | None:
    """The iteration the page shows first (timeline, critical path): the median."""
    return (d.get("critical_path") or {}).get("iteration")


def _each_iteration(d: dict[str, Any], items: list[dict[str, Any]], render: Callable[[dict[str, Any]], str]) -> str:
    """``render(item)`` for each iteration's item (a dict with ``iteration``), all but the shown
    one's hidden: the script shows the chosen iteration's (``data-iteration``)."""
    k = _shown(d)
    return "".join(
        f'<span data-iteration="{escape(x["iteration"])}"{"" if x["iteration"] == k else " hidden"}>{render(x)}</span>'
        for x in items
    )


def _iteration_choice(d: dict[str, Any]) -> str:
    """The selector of the iteration shown (every iteration with a critical path; the median
    first); nothing where there is one. Each selector on the page sets all of them."""
    paths = d.get("critical_paths") or []
    if len(paths) < 2:
        return ""
    pred = d.get("prediction") or {}
    times = {x["iteration"]: x.get("predicted_ns") for x in pred.get("iterations") or []}
    steady = set(pred.get("steady_iterations") or [])
    k = _shown(d)
    options = "".join(
        f'<option value="{escape(j)}"{" selected" if j == k else ""}>{escape(j)}: {escape(fmt_ns(times.get(j)))}'
        + (" (median)" if j == k else "" if j in steady else " (not steady)")
        + "</option>"
        for j in (cp["iteration"] for cp in paths)
    )
    return f'<label class="iteration-choice">Iteration <select class="iteration">{options}</select></label>'


def _where(d: dict[str, Any]) -> _Section:
    paths = d.get("critical_paths") or []
    br = d.get("breakdown")
    it = _shown(d) if paths else (br or {}).get("iteration")
    cap = (
        "The <b>critical path</b> is the chain of work, each piece waiting on the one before it, that sets how "
        "long the iteration takes: speeding up anything off it does not shorten the iteration. The bar splits it "
        "by what the work is: <i>compute</i>, a collective's data on the move (<i>transfer</i>) or its launch "
        "(<i>issue</i>). "
    )
    cap += (
        "All figures come from the calibrated prediction: every operation's time measured on the capture device, "
        f"then all ranks put together. They are for iteration {escape(it)}, the median of the steady ones"
        + ("; the critical path can show another, chosen below." if len(paths) > 1 else ".")
        if it is not None
        else ""
    )
    body = []
    if paths:
        predicted = (d.get("prediction") or {}).get("iteration_ns")
        body.append(
            _iteration_choice(d)
            + '<h3 data-dl="cp-chart">Critical path'
            + _each_iteration(d, paths, _path_heading)
            + '</h3><p class="caption">'
            + _each_iteration(d, paths, lambda cp: _path_against_iteration(cp, predicted))
            + '</p><div class="chart" id="cp-chart"></div>'
        )
    else:
        body.append('<p class="note">No critical path in the calibration.</p>')
    if br:
        n = len(br.get("ranks") or [])
        body.append(
            '<h3 data-dl="breakdown-chart">Per rank: what each rank spends the iteration on</h3><p class="caption">'
            "Each bar is one rank's iteration"
            + (
                f" (iteration {escape(br['iteration'])}, the median, whichever the critical path shows)"
                if len(paths) > 1
                else ""
            )
            + ", split into compute, communication that compute does not hide, waiting for "
            "a pipeline neighbour's send or receive (the pipeline bubble), and other waiting (for the "
            "slowest member of a collective)."
            + (
                f" With {n:,} ranks the bars are grouped (mean of the group; the line spans the group's "
                "shortest to longest iteration), and the strip below shows every rank's busy share "
                "(compute + communication not hidden)."
                if n > 64
                else ""
            )
            + '</p><div class="chart" id="breakdown-chart"></div>'
        )
    return _Section("where", "Where the iteration goes", cap, "".join(body))


def _path_heading(cp: dict[str, Any]) -> str:
    """ ": 61.85 ms, ending on rank 5, through 4 rank(s)" of one iteration's critical path."""
    return (
        f": {escape(fmt_ns(cp.get('total_ns')))}"
        + (f", ending on rank {escape(cp['end_rank'])}" if cp.get("end_rank") is not None else "")
        + (f", through {len(cp['ranks_visited']):,} rank(s)" if cp.get("ranks_visited") else "")
    )


def _path_against_iteration(cp: dict[str, Any], predicted: int | None) -> str:
    """Why the path's total is not the predicted iteration: the path adds up the work on it, within
    one iteration of the rank that ended last (calibrate.analyze walks back from its end to its
    start: a moment with no work of this iteration on the path is not in the sum), and the
    prediction is the median of the steady iterations."""
    total, own = cp.get("total_ns"), cp.get("iteration_ns")
    if total is None or own is None:
        return ""
    text = (
        f"The path adds up the work on it: {escape(fmt_ns(total))} of iteration {escape(cp.get('iteration'))}'s "
        f"{escape(fmt_ns(own))} on rank {escape(cp.get('end_rank'))}, the rank that ended it last"
    )
    if own > total:
        text += (
            f"; in the other {escape(fmt_ns(own - total))} the path holds no work of this iteration (before its "
            "first piece, which waits on work begun earlier, or between pieces)"
        )
    if predicted is not None and predicted != own:
        text += f". The predicted iteration, {escape(fmt_ns(predicted))}, is the median of the steady iterations"
    return f"{text}."


def _memory(d: dict[str, Any]) -> _Section:
    mem = d.get("memory") or {}
    if not mem.get("known"):
        cpu = "cpu" in str(d.get("device") or "").lower()
        return _Section(
            "memory",
            "Peak memory over the layout",
            "The most device memory each rank held at once, laid out by pipeline stage and model-parallel rank.",
            '<p class="note">Peak memory was not measured: '
            + (
                "the capture ran on the CPU, which has no device memory. Capture on GPUs to see it here."
                if cpu
                else escape(mem.get("source") or "the capture recorded none.")
            )
            + "</p>",
        )
    grid = mem.get("grid")
    cap = (
        "The most device memory each rank held at once ("
        + escape(mem.get("source") or "measured in the capture")
        + "). "
    )
    if grid:
        cap += (
            "Rows are pipeline stages, columns "
            + escape(_grid_cols_text(grid.get("cols") or "tp"))
            + "; each cell is the "
            + escape(grid.get("folded") or "max over the other dimensions")
            + ". Hover a cell for the exact bytes; the outlined cell holds the largest."
        )
    else:
        cap += "Without a layout, one cell per rank."
    body = '<div class="chart" id="memory-chart"></div>' + _memory_by_rank(d)
    return _Section("memory", "Peak memory over the layout", cap, body, dl="memory-chart")


def _memory_by_rank(d: dict[str, Any]) -> str:
    """Every rank's peak in rank order, from each source that has it, with a rank chooser. The
    run keeps a peak per rank and source, not memory over time, and the caption says so."""
    mem = d.get("memory") or {}
    world = d.get("world_size") or len(mem.get("per_rank") or [])
    emulated = any(
        _known(m.get("peak_memory_bytes")) for m in ((d.get("emulation") or {}).get("per_rank") or {}).values()
    )
    real = any(_known(x.get("real_bytes")) for x in (d.get("reference") or {}).get("per_rank") or [])
    sources = ["the solo capture (every rank run alone)"]
    sources += ["the emulation (the ranks run for real, inside the whole job)"] if emulated else []
    sources += ["the real run"] if real else []
    cap = (
        f"Every rank's peak, the data-parallel replicas not folded, from {_and(sources)}. The run keeps one "
        "peak per rank, not the memory over time (no stage records the allocator's history): choose a rank to "
        "read its figures."
    )
    start = (mem.get("max") or {}).get("rank", 0)
    return (
        f'<h3 data-dl="memory-ranks-chart">Peak memory rank by rank</h3><p class="caption">{cap}</p>'
        f'<div class="controls"><label>Rank <input type="number" id="memory-rank" min="0" max="{max(world - 1, 0)}" '
        f'step="1" value="{escape(start)}"></label><span class="memory-rank-text"></span></div>'
        '<div class="chart" id="memory-ranks-chart"></div>'
    )


def _known(b: int | None) -> bool:
    return b is not None and b >= 0


def _and(items: list[str]) -> str:
    """ "a", "a and b", "a, b and c"."""
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


# What each memory-grid column dimension is, for the caption.
_DIM_NAMES = {"tp": "tensor-parallel", "cp": "context-parallel", "ep": "expert-parallel"}


def _grid_cols_text(cols: str) -> str:
    """ "ep · tp" -> "the (expert-parallel, tensor-parallel) ranks, tp fastest"; "tp" -> "the
    tensor-parallel ranks" (older data names no more)."""
    dims = [d.strip() for d in cols.split("·") if d.strip()] or ["tp"]
    names = [_DIM_NAMES.get(d, d) for d in dims]
    if len(dims) == 1:
        return f"the {names[0]} ranks"
    return f"the ({', '.join(names)}) ranks, {dims[-1]} fastest"


def _timeline(d: dict[str, Any]) -> _Section:
    tl = d.get("timeline")
    title = "Timeline of an iteration"
    if not tl or not tl.get("ranks"):
        return _Section(
            "timeline",
            title,
            "What a few ranks do over the iteration.",
            '<p class="note">No timeline: the calibration holds no per-operation times.</p>' + _perfetto(d),
        )
    n = len(tl["ranks"])

    def which(x: dict[str, Any]) -> str:
        k = x["iteration"]
        spans = sum(len(s) for s in x["spans"])
        median = " (the median of the steady ones)" if k == tl["iteration"] else ""
        return f"Iteration {escape(k)}{median} as predicted, for {n} rank(s) ({spans:,} operations)."

    cap = (
        _each_iteration(d, tl.get("iterations") or [], which)
        + " Each rank has two lanes: the upper one is its program (compute, and the blocking calls it sits in), "
        "the lower one the communication it runs in the background. <i>Waiting</i> is time spent at a call until "
        "the group's last member arrives. The black tick under a span marks the critical path. Scroll to zoom, "
        "drag to pan, hover for details."
    )
    controls = (
        f'<div class="controls">{_iteration_choice(d)}<button type="button" data-zoom="in">Zoom in</button>'
        '<button type="button" data-zoom="out">Zoom out</button>'
        '<button type="button" data-zoom="reset">Reset zoom</button><span class="view-text"></span></div>'
    )
    body = controls + '<div class="chart" id="timeline-chart"></div>' + _perfetto(d)
    return _Section("timeline", title, cap, body, dl="timeline-chart")


def _perfetto(d: dict[str, Any]) -> str:
    """Links to the run's Perfetto traces (relative, so the page and the run move together), and
    how to open one; where there is none, how to write one."""
    traces = d.get("perfetto") or []
    if not traces:
        return (
            '<p class="note">Every rank and every operation in Perfetto: <code>prism export DIR/cal/graph '
            "--perfetto-proto DIR/trace.pftrace</code>, then <code>prism report DIR</code> links the trace here.</p>"
        )
    links = ", ".join(
        f'<a href="{escape(t["href"])}">{escape(t["file"])}</a> ({escape(t["format"])}, {escape(fmt_bytes(t["bytes"]))})'
        for t in traces
    )
    return (
        f'<p class="perfetto">Perfetto trace of this run: {links}. To open it, go to ui.perfetto.dev, choose '
        "<i>Open trace file</i> and pick the file (Perfetto reads it in the browser; it stays on this machine).</p>"
    )


def _emulation_section(d: dict[str, Any]) -> _Section:
    comm = d.get("communicators")
    emu = d.get("emulation")
    world = d.get("world_size") or 0
    layout = d.get("layout")
    body = []
    if comm:
        body.append(
            f'<h3 data-dl="comm-chart">Communicators: {comm.get("communicators", 0):,} created for '
            f"{comm.get('logical_groups', 0):,} "
            f'process groups of the program</h3><p class="caption">The program at {world:,} ranks asks for '
            f"{comm.get('logical_groups', 0):,} process groups. The emulation builds a real communicator only where "
            f"a group holds a rank that runs for real: {comm.get('all_real', 0):,} with only such ranks, "
            f"{comm.get('pruned', 0):,} cut down to those ranks plus one stand-in for the rest, and "
            f"{comm.get('not_instantiated', 0):,} never created. The largest communicator has "
            f"{comm.get('largest_communicator', 0):,} member(s), against a largest group of "
            f'{comm.get("largest_logical_group", 0):,} in the program.</p><div class="chart" id="comm-chart"></div>'
        )
    if emu:
        timing = emu.get("timing")
        how = {
            "real": "the emulated ranks answer at the times the calibration predicts, so the real ranks' "
            "iteration times are meaningful",
            "fast": "the emulated ranks answer at once: a check of correctness and memory, not of time",
        }
        body.append(
            f'<h3 data-dl="emulation-table">Ranks run for real</h3><p class="caption">Sandbox rank(s) '
            f"{escape(', '.join(str(r) for r in emu.get('sandbox') or []))} ran the real program on "
            f"{escape(emu.get('devices') or '?')}"
            + (" (one shared GPU)" if emu.get("shared_gpu") else "")
            + f"; timing <i>{escape(timing)}</i>: {escape(how.get(timing, 'as configured'))}."
            + ("" if emu.get("ok") is not False else " <b>The emulation did not finish cleanly.</b>")
            + "</p>"
        )
        pred = (d.get("prediction") or {}).get("iteration_ns")
        rows = []
        for r, m in sorted((emu.get("per_rank") or {}).items(), key=lambda kv: int(kv[0])):
            med = m.get("median_steady_iteration_ns")
            its = ", ".join(fmt_ns(x) for x in (m.get("iteration_ns") or []))
            rows.append(
                f"<tr><td>{escape(r)}</td><td>{escape(coords_text(layout, world, int(r)))}</td>"
                f'<td class="num">{escape(fmt_ns(med))}</td><td class="num">{escape(_pct(_rel(med, pred), True))}</td>'
                f'<td class="num">{escape(fmt_bytes(m.get("peak_memory_bytes")))}</td>'
                f'<td class="small">{escape(its)}</td></tr>'
            )
        if rows:
            body.append(
                '<table class="tbl" id="emulation-table"><thead><tr><th>rank</th><th>where</th>'
                '<th class="num">median steady iteration</th><th class="num">vs predicted</th><th class="num">peak memory</th>'
                f"<th>every iteration</th></tr></thead><tbody>{''.join(rows)}</tbody></table>"
            )
        if emu.get("virtual_ranks_iteration_ns") is not None:
            body.append(
                f'<p class="note">The emulated ranks\' own replay: median steady iteration '
                f"{escape(fmt_ns(emu['virtual_ranks_iteration_ns']))}.</p>"
            )
    if not body:
        body.append('<p class="note">No emulation in this run.</p>')
    return _Section(
        "emulation",
        "Emulation",
        "How the job was emulated: which ranks ran the real program, "
        "what they measured, and the communicators built for them.",
        "".join(body),
    )


def _reference_section(d: dict[str, Any]) -> _Section | None:
    ref = d.get("reference")
    if not ref:
        return None
    world = d.get("world_size") or 0
    layout = d.get("layout")
    it = ref.get("iteration") or {}
    rows = []
    for x in ref.get("per_rank") or []:
        et = _rel(x.get("predicted_ns"), x.get("real_ns"))
        pb, rb = x.get("predicted_bytes"), x.get("real_bytes")
        em = _rel(pb, rb) if pb is not None and pb >= 0 and rb is not None and rb >= 0 else None
        rows.append((x.get("rank"), x, et, em))
    body = [
        '<div class="cards">'
        + _card("Predicted iteration", fmt_ns(it.get("predicted_ns")), "the calibrated prediction", "main")
        + _card("Real iteration", fmt_ns(it.get("real_ns")), "median of the real run's steady iterations")
        + _card("Error", _pct(it.get("rel_error"), True), "(predicted − real) / real")
        + "</div>"
    ]

    def err_cell(e: float | None) -> str:
        cls = "" if e is None else ("bad" if abs(e) > 0.1 else "warn" if abs(e) > 0.05 else "good")
        return f'<td class="num {cls}">{escape(_pct(e, True))}</td>'

    shown = rows
    note = ""
    if len(rows) > MAX_TABLE_RANKS:
        worst = sorted(rows, key=lambda t: -max(abs(t[2] or 0), abs(t[3] or 0)))[:32]
        shown = sorted(worst, key=lambda t: t[0])
        ets = [abs(t[2]) for t in rows if t[2] is not None]
        ems = [abs(t[3]) for t in rows if t[3] is not None]
        note = (
            f'<p class="note">{len(rows):,} ranks: the 32 with the largest errors are listed. '
            + (f"Iteration time: mean |error| {_pct(sum(ets) / len(ets))}, largest {_pct(max(ets))}. " if ets else "")
            + (f"Peak memory: mean |error| {_pct(sum(ems) / len(ems))}, largest {_pct(max(ems))}." if ems else "")
            + "</p>"
        )
    trs = "".join(
        f"<tr><td>{escape(r)}</td><td>{escape(coords_text(layout, world, int(r)))}</td>"
        f'<td class="num">{escape(fmt_ns(x.get("predicted_ns")))}</td>'
        f'<td class="num">{escape(fmt_ns(x.get("real_ns")))}</td>'
        f'{err_cell(et)}<td class="num">{escape(fmt_bytes(x.get("predicted_bytes")))}</td>'
        f'<td class="num">{escape(fmt_bytes(x.get("real_bytes")))}</td>{err_cell(em)}</tr>'
        for r, x, et, em in shown
    )
    body.append(
        note + '<table class="tbl ref" id="reference-table"><thead><tr><th>rank</th><th>where</th>'
        '<th class="num">predicted iteration</th><th class="num">real</th><th class="num">error</th><th class="num">predicted peak '
        'memory</th><th class="num">real</th><th class="num">error</th></tr></thead>'
        f"<tbody>{trs}</tbody></table>"
    )
    cap = (
        "The prediction beside a real run of the same job ("
        + escape(ref.get("source") or "a recorded run")
        + "): per rank, the iteration time (predicted: the rank's span in the median iteration; real: the median "
        "of its iterations after the first) and the peak memory. Errors are (predicted − real) / real; "
        "within ±5 % is green, beyond ±10 % red."
    )
    return _Section("reference", "Prediction against a real run", cap, "".join(body), dl="reference-table")


def _compare_value(v: Any, kind: str) -> str:
    if v is None:
        return "–"
    return {
        "ns": fmt_ns,
        "bytes": fmt_bytes,
        "share": _pct,
        "s": _secs,
        "count": lambda x: f"{x:,}",
        "layout": layout_text,
    }.get(kind, str)(v)


def _compare_change(a: Any, b: Any, kind: str) -> tuple[str, str]:
    """The change from the other run to this one, and its cell's class: a relative change for a
    figure, "same" or "differs" for a text."""
    if a is None or b is None:
        return "", ""
    if a == b:
        return "same", ""
    if kind in ("text", "layout"):
        return "differs", "warn"
    if kind == "share":  # a share's change in points, not relative
        d = a - b
        return f"{d * 100:+.1f} pt", "" if abs(d) < 0.005 else "warn"
    e = _rel(a, b)
    if e is None:  # from nothing (0) to something
        return "", "warn"
    return _pct(e, True), "" if abs(e) < 0.01 else "warn"


def _compare_section(d: dict[str, Any]) -> _Section | None:
    cmp = d.get("compare")
    if not cmp:
        return None
    trs = []
    for row in cmp.get("rows") or []:
        kind, a, b = row.get("kind", "text"), row.get("a"), row.get("b")
        if a is None and b is None:  # neither run has it (a CPU run's peak memory)
            continue
        change, cls = _compare_change(a, b, kind)
        trs.append(
            f'<tr><td>{escape(row.get("what"))}</td><td class="num">{escape(_compare_value(a, kind))}</td>'
            f'<td class="num">{escape(_compare_value(b, kind))}</td><td class="num {cls}">{escape(change)}</td></tr>'
        )
    note = ""
    mem = cmp.get("memory")
    if mem:
        big = mem.get("largest")
        note = f'<p class="note">Peak memory: {mem["differ"]:,} of {mem["ranks"]:,} ranks differ' + (
            f"; the most on rank {big['rank']}: {fmt_bytes(big['a'])} here, {fmt_bytes(big['b'])} there "
            f"({_pct(_rel(big['a'], big['b']), True)}).</p>"
            if big
            else ".</p>"
        )
    body = (
        note + '<table class="tbl cmp" id="compare-table"><thead><tr><th>figure</th><th class="num">this run</th>'
        '<th class="num">the other</th><th class="num">change</th></tr></thead>'
        f"<tbody>{''.join(trs)}</tbody></table>"
    )
    cap = (
        "This run beside "
        + escape(cmp.get("source") or "another run")
        + (f" ({escape(cmp.get('title'))})" if cmp.get("title") else "")
        + ": each figure of the two, and the change from that run to this one ((this − other) / other; "
        "a share in points). Changes of 1 % or more, and texts that differ, are marked."
    )
    return _Section("compare", "Against another run", cap, body, dl="compare-table")


# ---------------------------------------------------------------------- the page
def render_html(data: dict[str, Any]) -> str:
    """The whole report page for ``data`` (``data.collect``'s dict) as one string."""
    css, js = asset("report.css"), asset("report.js")
    sections = [
        _where(data), _memory(data), _timeline(data), _emulation_section(data), _reference_section(data),
        _compare_section(data),
    ]  # fmt: skip
    parts = [_header(data), *(s.html(i) for i, s in enumerate((s for s in sections if s is not None), 1))]
    return (
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        # no request may leave the page: scripts and styles inline only, images as data: only
        '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; '
        "script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:\">"
        f"<title>{escape(data.get('title') or 'prism report')}</title>\n<style>\n{css}\n</style></head>\n"
        f"<body><main>\n{''.join(parts)}\n"
        f"<footer>Written by prismllm {escape(data.get('prismllm') or '')} · prism report · "
        f"{escape(_date(data.get('created')))}</footer></main>\n"
        '<div id="tip" role="tooltip" hidden></div>\n'
        f'<script type="application/json" id="report-data">{json_for_script(data)}</script>\n'
        f"<script>\n{js}\n</script>\n</body></html>\n"
    )


__all__ = ["coords_text", "fmt_bytes", "fmt_ns", "iterations_text", "json_for_script", "layout_text", "render_html"]
