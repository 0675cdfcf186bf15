"""What-if on a calibrated graph: re-solve it with some spans scaled, shifted or replaced, or its
communication timed by another network, and say what the iteration time and the critical path
become (``prism whatif``, docs/commands/whatif.md).

A *change* (``--scale``) is ``SELECTOR:AMOUNT``. The selector is comma-separated conditions,
all of which must hold:

- ``op=NAME[|NAME...]``: the op (``compute`` for compute spans, else a communication op);
- ``label=TEXT`` / ``label~REGEX``: the ``prismllm.mark`` label (exact / a regular expression
  searched in it): a compute span opened by ``mark``, or with a communication op, the call that
  closes it;
- ``group=KIND``: communication whose group spans the layout dimensions ``KIND`` (``tp``,
  ``pp``, ``dp``, ``ep``, ``cp``, or a combination like ``tp-pp``; ``dp`` also matches the dense
  data-parallel group ``ep-dp``), or whose group description (``group_desc``) is ``KIND``;
- ``size=N``: communication in a group of N ranks (a send/recv pair counts 2);
- ``rank=RANKS``: spans of these ranks (``0-3,8``); an instance when one of its members is.

The amount is a factor (``0.5``, ``x0.5``), an addition (``+2ms``, ``-300us``) or a replacement
(``=1.5ms``). A compute span scales its own duration; a communication instance scales its
transfer (what every member waits for once the last one has arrived), so a selector on
communication changes the instance once however many members match. A selector picks
communication only when it names it (a communication op, ``group`` or ``size``); otherwise it
picks compute spans: ``label~attention:0.7`` is a faster attention, not a faster all-reduce
after it. Changes apply in order.

``--network FILE`` (TOML) times the communication it covers from a bus bandwidth and a
latency, the convention of nccl-tests: ``t = latency + S * factor / busbw`` with ``S`` the
op's buffer (all_reduce, broadcast, reduce, send/recv: the buffer; all_gather: the whole output;
reduce_scatter and all_to_all: the whole input) and ``factor`` 2(n-1)/n for all_reduce, (n-1)/n
for all_gather, reduce_scatter and all_to_all, 1 otherwise::

    [[link]]
    group = "tp"            # conditions as for --scale: op, label, label_regex, group, size,
                            # rank (here: tensor-parallel groups); none: all communication
    busbw_gbps = 360        # bus bandwidth, GB/s (1e9 bytes per second)
    latency_us = 8

    [[link]]
    size = 2                # e.g. every send/recv pair
    busbw_gbps = 40
    latency_us = 15

The first ``[[link]]`` whose selector matches an instance times it; ``--scale`` changes apply
after the network. Memory does not change: a what-if changes durations, never what a rank holds.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import tomllib
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from prismllm.calibrate.report import calibrated_table, summarize, write
from prismllm.errors import PrismError
from prismllm.layout import Layout
from prismllm.outdir import writing
from prismllm.outputs import SUMMARY_FILE
from prismllm.replay import INST_P2P, Durations, ReplayGraph, Solution, solve
from prismllm.specs import parse_ranks
from prismllm.terminal import Table
from prismllm.trace.graph import PrismTrace
from prismllm.trace.schema import COMM_OPS
from prismllm.trace.summary import WARMUP, fmt_ns

_I64 = np.int64
_UNITS_NS = {"ns": 1, "us": 1_000, "µs": 1_000, "ms": 1_000_000, "s": 1_000_000_000}


class WhatIfError(PrismError):
    """A change, a network file or a CAL that a what-if cannot use."""


# ---------------------------------------------------------------------- selectors
@dataclasses.dataclass(frozen=True)
class Selector:
    """Which spans a change applies to (every given condition must hold)."""

    text: str
    ops: frozenset[str] = frozenset()
    label: str | None = None  # exact
    label_re: re.Pattern | None = None
    group: str | None = None
    size: int | None = None
    ranks: frozenset[int] | None = None

    @property
    def picks_comm(self) -> bool:
        """Communication is picked only by name: a communication op, a group or a size."""
        return self.group is not None or self.size is not None or bool(self.ops - {"compute"})

    @property
    def picks_compute(self) -> bool:
        """Compute spans, unless the selector names only communication."""
        return self.group is None and self.size is None and (not self.ops or "compute" in self.ops)


def parse_selector(text: str, where: str) -> Selector:
    items = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        m = re.fullmatch(r"(op|label|group|size|rank)\s*([=~])\s*(.+)", item)
        if m is None:
            raise WhatIfError(
                f"{where}: bad condition {item!r}: expected op=NAME, label=TEXT, label~REGEX, group=KIND, size=N or rank=RANKS"
            )
        items.append((m.group(1), m.group(2), m.group(3).strip()))
    return _selector(items, text, where)


def _selector(items: list[tuple[str, str, Any]], text: str, where: str) -> Selector:
    """A Selector from (key, '=' or '~', value) conditions."""
    kw: dict[str, Any] = {}
    for key, how, value in items:
        if how == "~" and key != "label":
            raise WhatIfError(f"{where}: {key}~ is not a condition; only label~REGEX matches a pattern")
        if key == "op":
            kw["ops"] = frozenset(v.strip() for v in str(value).split("|") if v.strip())
            bad = sorted(kw["ops"] - {"compute", *COMM_OPS})
            if bad:
                raise WhatIfError(f"{where}: op={bad[0]!r} is not an op; known: compute, {', '.join(COMM_OPS)}")
        elif key == "label" and how == "~":
            try:
                kw["label_re"] = re.compile(str(value))
            except re.error as e:
                raise WhatIfError(f"{where}: label~{value!r} is not a regular expression: {e}") from None
        elif key == "label":
            kw["label"] = str(value)
        elif key == "group":
            kw["group"] = str(value)
        elif key == "size":
            try:
                kw["size"] = int(value)
            except ValueError:
                raise WhatIfError(f"{where}: size={value!r} is not an integer") from None
        elif key == "rank":
            try:
                kw["ranks"] = frozenset(parse_ranks(str(value)))
            except ValueError as e:
                raise WhatIfError(f"{where}: rank={value!r}: {e}") from None
        else:
            raise WhatIfError(f"{where}: unknown condition {key!r}; known: op, label, label_regex, group, size, rank")
    if not kw:
        raise WhatIfError(f"{where}: empty selector; e.g. op=all_to_all, label~attention, group=tp")
    return Selector(text=text, **kw)


# ---------------------------------------------------------------------- amounts
@dataclasses.dataclass(frozen=True)
class Amount:
    kind: str  # "factor" | "add" | "set"
    value: float  # the factor, or nanoseconds

    def apply(self, ns: np.ndarray) -> np.ndarray:
        if self.kind == "factor":
            out = ns * self.value
        elif self.kind == "add":
            out = ns + self.value
        else:
            out = np.full(len(ns), self.value)
        return np.maximum(np.rint(out), 0).astype(_I64)

    def describe(self) -> str:
        if self.kind == "factor":
            return f"x{self.value:g}"
        return ("+" if self.kind == "add" and self.value >= 0 else "=" if self.kind == "set" else "") + _fmt(self.value)


def _fmt(ns: float) -> str:
    for unit, f in (("s", 1e9), ("ms", 1e6), ("us", 1e3)):
        if abs(ns) >= f:
            return f"{ns / f:g}{unit}"
    return f"{ns:g}ns"


def duration_ns(text: str, where: str) -> float:
    """``2ms``, ``300us``, ``1.5s``, ``40ns`` in ns; WhatIfError naming ``where`` otherwise."""
    m = re.fullmatch(r"([-+]?[0-9]*\.?[0-9]+(?:e[-+]?[0-9]+)?)\s*(ns|us|µs|ms|s)", text.strip())
    if m is None:
        raise WhatIfError(f"{where}: {text!r} is not a duration; e.g. 2ms, 300us, 1.5s")
    return float(m.group(1)) * _UNITS_NS[m.group(2)]


def parse_amount(text: str, where: str) -> Amount:
    t = text.strip()
    if t.startswith("="):
        return Amount("set", duration_ns(t[1:], where))
    if t[:1] in "+-" and re.search(r"[a-zµ]\s*$", t):
        return Amount("add", duration_ns(t, where))
    try:
        f = float(t[1:] if t[:1] in "x*" else t)
    except ValueError:
        raise WhatIfError(
            f"{where}: amount {text!r}: expected a factor (0.5, x2), an addition (+2ms, -300us) or a replacement (=1ms)"
        ) from None
    if not np.isfinite(f) or f < 0:
        raise WhatIfError(f"{where}: factor {text!r} must be a finite number >= 0")
    return Amount("factor", f)


@dataclasses.dataclass(frozen=True)
class Change:
    selector: Selector
    amount: Amount

    @property
    def text(self) -> str:
        return f"{self.selector.text}:{self.amount.describe()}"


def parse_change(text: str) -> Change:
    """``SELECTOR:AMOUNT`` (the amount follows the last colon)."""
    where = f"--scale {text!r}"
    sel, sep, amount = text.rpartition(":")
    if not sep or not sel.strip():
        raise WhatIfError(f"{where}: expected SELECTOR:AMOUNT, e.g. 'op=all_to_all:0.5' or 'label~attention:+1ms'")
    return Change(parse_selector(sel, where), parse_amount(amount, where))


# ---------------------------------------------------------------------- networks
@dataclasses.dataclass(frozen=True)
class Link:
    selector: Selector
    busbw_bytes_per_ns: float  # = GB/s
    latency_ns: float


def load_network(path: str | os.PathLike) -> list[Link]:
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except OSError as e:
        raise WhatIfError(f"--network {path}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise WhatIfError(f"--network {path}: not TOML: {e}") from None
    links = doc.get("link")
    if not isinstance(links, list) or not links:
        raise WhatIfError(f"--network {path}: no [[link]] table; see `prism whatif --help`")
    out = []
    for i, entry in enumerate(links):
        where = f"--network {path} [[link]] #{i + 1}"
        entry = dict(entry)
        try:
            bw = float(entry.pop("busbw_gbps"))
        except (KeyError, TypeError, ValueError):
            raise WhatIfError(f"{where}: needs busbw_gbps = <GB/s>") from None
        lat_us = entry.pop("latency_us", 0.0)
        try:
            lat = float(lat_us) * 1e3
        except (TypeError, ValueError):
            raise WhatIfError(f"{where}: latency_us must be a number, not {lat_us!r}") from None
        if bw <= 0 or lat < 0:
            raise WhatIfError(f"{where}: busbw_gbps must be > 0 and latency_us >= 0")
        items = [("label", "~", v) if k == "label_regex" else (k, "=", v) for k, v in entry.items()]
        if not items:  # a link without conditions covers all communication
            items = [("op", "=", "|".join(COMM_OPS))]
        text = ",".join(f"{k}{how}{v}" for k, how, v in items)
        out.append(Link(_selector(items, text, where), bw, lat))
    return out


# ---------------------------------------------------------------------- matching
class _Spans:
    """What the selectors test, per node position and per instance of a ReplayGraph."""

    def __init__(self, graph: ReplayGraph, layout: Layout | None) -> None:
        g, trace = graph, graph.trace
        self.g = g
        self.rank = g.ranks[g.rank_pos]
        self.label = np.asarray(trace.nodes.column("label").take(pa.array(g.row)).to_pylist(), dtype=object)
        self.op = np.asarray(g.op_names, dtype=object)[g.op_code] if g.num_nodes else np.zeros(0, object)
        ni = g.num_instances
        self.inst_op = np.asarray(g.op_names, dtype=object)[g.inst_op] if ni else np.zeros(0, object)
        is_p2p = g.inst_kind == INST_P2P
        self.inst_size = np.where(is_p2p, 2, g.group_size[np.maximum(g.inst_group, 0)]) if ni else np.zeros(0, _I64)
        self.inst_member_rank = self.rank[g.inst_nodes]
        self.inst_seg = np.repeat(np.arange(ni), np.diff(g.inst_ptr))
        self.layout = layout if layout is not None else self._read_layout(trace)
        self._kinds: dict[int, tuple[str, str]] = {}
        # bytes of each instance's buffer S (nccl-tests convention), from its first member
        first = g.inst_nodes[g.inst_ptr[:-1]] if ni else np.zeros(0, _I64)
        inb = trace.column("in_bytes").astype(_I64)[g.row][first] if ni else np.zeros(0, _I64)
        outb = trace.column("out_bytes").astype(_I64)[g.row][first] if ni else np.zeros(0, _I64)
        self.inst_in_bytes, self.inst_out_bytes = inb, outb

    @staticmethod
    def _read_layout(trace: PrismTrace) -> Layout | None:
        spec = trace.manifest.get("layout")
        if not spec:
            return None
        try:
            return Layout.parse(spec, trace.world_size)
        except PrismError:
            return None

    def _group_kind(self, inst: int) -> tuple[str, str]:
        """(layout dimensions the instance's ranks span, e.g. 'tp' or 'ep-dp'; group_desc)."""
        g = self.g
        key = int(g.inst_group[inst]) if g.inst_kind[inst] != INST_P2P else -2 - inst
        if key in self._kinds:
            return self._kinds[key]
        ranks = np.asarray(g.instance_ranks(inst), dtype=_I64)
        desc = ""
        if g.inst_kind[inst] != INST_P2P:
            desc = str(g.trace.group_info().get(int(g.inst_group[inst]), {}).get("desc", ""))
        kind = ""
        if self.layout is not None and len(ranks):
            c = self.layout.coords_array(ranks)
            kind = "-".join(d for d in self.layout.order if len(np.unique(c[d])) > 1)
        self._kinds[key] = (kind, desc)
        return kind, desc

    def _label_ok(self, sel: Selector, labels: np.ndarray) -> np.ndarray:
        ok = np.ones(len(labels), dtype=bool)
        if sel.label is not None:
            ok &= labels == sel.label
        if sel.label_re is not None:
            ok &= np.fromiter((bool(sel.label_re.search(x or "")) for x in labels), dtype=bool, count=len(labels))
        return ok

    def compute(self, sel: Selector) -> np.ndarray:
        """Node positions of the compute spans the selector picks."""
        g = self.g
        if not sel.picks_compute:
            return np.zeros(0, dtype=_I64)
        pos = np.flatnonzero(~g.is_comm)
        ok = self._label_ok(sel, self.label[pos])
        if sel.ranks is not None:
            ok &= np.isin(self.rank[pos], list(sel.ranks))
        return pos[ok]

    def instances(self, sel: Selector) -> np.ndarray:
        """Instances the selector picks."""
        g = self.g
        ni = g.num_instances
        if not sel.picks_comm or not ni:
            return np.zeros(0, dtype=_I64)
        ok = np.ones(ni, dtype=bool)
        if sel.ops:
            ok &= np.isin(self.inst_op, list(sel.ops))
        if sel.size is not None:
            ok &= self.inst_size == sel.size
        if sel.label is not None or sel.label_re is not None:
            member = self._label_ok(sel, self.label[g.inst_nodes])
            ok &= np.bincount(self.inst_seg[member], minlength=ni) > 0
        if sel.ranks is not None:
            member = np.isin(self.inst_member_rank, list(sel.ranks))
            ok &= np.bincount(self.inst_seg[member], minlength=ni) > 0
        if sel.group is not None:
            want = sel.group.lower()
            for i in np.flatnonzero(ok):
                kind, desc = self._group_kind(int(i))
                ok[i] = kind == want or (want == "dp" and kind == "ep-dp") or (desc and desc == sel.group)
        return np.flatnonzero(ok)

    def network_time(self, insts: np.ndarray, link: Link) -> np.ndarray:
        op = self.inst_op[insts]
        n = self.inst_size[insts].astype(np.float64)
        inb = self.inst_in_bytes[insts].astype(np.float64)
        outb = self.inst_out_bytes[insts].astype(np.float64)
        size = np.where(
            op == "all_gather",
            outb,
            np.where(np.isin(op, ["reduce_scatter", "all_to_all"]), inb, np.maximum(inb, outb)),
        )
        frac = np.where(n > 1, (n - 1) / np.maximum(n, 1), 0.0)
        factor = np.where(
            op == "all_reduce",
            2 * frac,
            np.where(np.isin(op, ["all_gather", "reduce_scatter", "all_to_all"]), frac, 1.0),
        )
        factor = np.where(op == "barrier", 0.0, factor)
        return np.rint(link.latency_ns + size * factor / link.busbw_bytes_per_ns).astype(_I64)


# ---------------------------------------------------------------------- the what-if
@dataclasses.dataclass
class Applied:
    """What one change (or network link) touched."""

    change: str
    compute_spans: int = 0
    instances: int = 0
    before_ns: int = 0  # sum of the touched durations before the change
    after_ns: int = 0


def _apply(
    graph: ReplayGraph,
    d: Durations,
    changes: list[Change],
    network: list[Link],
    layout: Layout | None,
    log: list[Applied],
) -> None:
    spans = _Spans(graph, layout)
    if network:
        claimed = np.zeros(graph.num_instances, dtype=bool)
        for link in network:
            insts = spans.instances(link.selector)
            insts = insts[~claimed[insts]]
            claimed[insts] = True
            new = spans.network_time(insts, link)
            a = Applied(
                f"network {link.selector.text}",
                instances=len(insts),
                before_ns=int(d.transfer_ns[insts].sum()),
                after_ns=int(new.sum()),
            )
            d.transfer_ns[insts] = new
            log.append(a)
    for ch in changes:
        pos = spans.compute(ch.selector)
        insts = spans.instances(ch.selector)
        a = Applied(ch.text, compute_spans=len(pos), instances=len(insts))
        a.before_ns = int(d.compute_ns[pos].sum() + d.transfer_ns[insts].sum())
        d.compute_ns[pos] = ch.amount.apply(d.compute_ns[pos])
        d.transfer_ns[insts] = ch.amount.apply(d.transfer_ns[insts])
        a.after_ns = int(d.compute_ns[pos].sum() + d.transfer_ns[insts].sum())
        log.append(a)


def calibration_source(cal: Path) -> dict[str, Any]:
    """What CAL was solved from (its summary.json), with the graph paths resolved."""
    f = cal / SUMMARY_FILE
    try:
        summary = json.loads(f.read_text())
    except FileNotFoundError:
        raise WhatIfError(
            f"{cal} is not a calibration (no {SUMMARY_FILE}); give the directory `prism calibrate --out` wrote"
        ) from None
    except (OSError, ValueError) as e:
        raise WhatIfError(f"{f}: unreadable: {e}") from None

    def resolve(p: str | None) -> str | None:
        if p is None:
            return None
        for cand in (Path(p), cal / p, cal.parent / p):
            if (cand / "manifest.json").is_file():
                return str(cand)
        raise WhatIfError(f"{cal} was solved from {p!r}, which is gone (no manifest.json there); give --graph GRAPH")

    return {
        "graph": resolve(summary.get("graph")),
        "durations": resolve(summary.get("durations_from")),
        "rule": summary.get("transfer_rule") or "auto",
        "warmup": int(summary.get("warmup", WARMUP)),  # the baseline's and the what-if's medians leave out as many
    }


def whatif(
    cal: str | os.PathLike,
    changes: list[Change],
    network: list[Link] | None = None,
    *,
    graph: str | os.PathLike | None = None,
    layout: str | None = None,
    out: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """Solve CAL's graph as calibrated (the baseline) and with the changes; return both
    summaries and what changed. ``layout``: the layout ``group=`` conditions read, where the
    graph's manifest has none. ``out``: write the changed solution as a calibration directory
    (``prism report`` reads it), as its one writer from the start (``prismllm.outdir``)."""
    with writing(out):
        network = network or []
        if not changes and not network:
            raise WhatIfError("nothing to change: give --scale SELECTOR:AMOUNT and/or --network FILE")
        cal_path = Path(cal)
        src = (
            calibration_source(cal_path)
            if graph is None
            else {"graph": str(graph), "durations": None, "rule": "auto", "warmup": WARMUP}
        )
        trace = PrismTrace.load(src["graph"])
        other = PrismTrace.load(src["durations"]) if src["durations"] else None
        lay = Layout.parse(layout, trace.world_size) if layout else None
        if lay is None and not trace.manifest.get("layout") and any(c.selector.group for c in changes):
            raise WhatIfError(
                f"group= needs the graph's layout, and {src['graph']} has none (recorded without --layout): give --layout, "
                f"e.g. --layout tp=2,pp=2, or select by size=N"
            )
        names = (src["graph"], str(src["durations"]))
        base = solve(trace, durations=other, rule=src["rule"], names=names, warmup=src["warmup"])
        log: list[Applied] = []
        new = solve(
            trace,
            durations=other,
            rule=src["rule"],
            names=names,
            validate_graph=False,
            adjust=lambda g, d: _apply(g, d, changes, network, lay, log),
            warmup=src["warmup"],
        )
        before = summarize(base, src["graph"], src["durations"])
        after = summarize(new, src["graph"], src["durations"])
        after["whatif"] = {"changes": [c.text for c in changes], "network": [link.selector.text for link in network]}
        if out is not None:
            write(out, calibrated_table(new), after)
        return _result(base, new, before, after, log, out)


def _result(base: Solution, new: Solution, before: dict, after: dict, log: list[Applied], out) -> dict[str, Any]:
    b, a = before["predicted_iteration_ns"], after["predicted_iteration_ns"]

    def path(s: dict) -> dict | None:
        cp = s.get("critical_path")
        if not cp:
            return None
        return {k: cp[k] for k in ("iteration", "total_ns", "end_rank", "ranks_visited", "by_kind")}

    untouched = [x.change for x in log if not (x.compute_spans or x.instances)]
    return {
        "format": "prism-whatif",
        "format_version": 1,
        "graph": before["graph"],
        "baseline_iteration_ns": b,
        "whatif_iteration_ns": a,
        "change_ns": (a - b) if (a is not None and b is not None) else None,
        "rel_change": ((a - b) / b) if (a is not None and b) else None,
        "memory": "unchanged (a what-if changes durations only)",
        "applied": [dataclasses.asdict(x) for x in log],
        "matched_nothing": untouched,
        "critical_path_before": path(before),
        "critical_path_after": path(after),
        "written": str(out) if out is not None else None,
    }


def render(r: dict[str, Any], console) -> None:
    head = Table(title=f"what-if on {r['graph']}", show_header=False, title_justify="left")
    head.add_column(style="bold")
    head.add_column()
    pct = "-" if r["rel_change"] is None else f"{100 * r['rel_change']:+.2f}%"
    head.add_row("iteration, as calibrated", fmt_ns(r["baseline_iteration_ns"]))
    head.add_row("iteration, what-if", f"{fmt_ns(r['whatif_iteration_ns'])}  ({pct})")
    head.add_row("peak memory", "unchanged (durations only)")
    if r["written"]:
        head.add_row("written", r["written"])
    console.print(head)
    t = Table(title="changes", title_justify="left")
    for c in ("change", "compute spans", "instances", "their time before", "after"):
        t.add_column(c, justify="left" if c == "change" else "right")
    for x in r["applied"]:
        t.add_row(
            x["change"], f"{x['compute_spans']:,}", f"{x['instances']:,}", fmt_ns(x["before_ns"]), fmt_ns(x["after_ns"])
        )
    console.print(t)
    for c in r["matched_nothing"]:
        console.print(f"[yellow]warning:[/] {c} matched nothing in the graph")
    b, a = r["critical_path_before"], r["critical_path_after"]
    if b and a:
        t = Table(
            title=f"critical path: ends on rank {b['end_rank']} -> {a['end_rank']}, "
            f"{len(b['ranks_visited'])} -> {len(a['ranks_visited'])} rank(s) visited",
            title_justify="left",
        )
        for c in ("what", "before", "share", "after", "share "):
            t.add_column(c, justify="left" if c == "what" else "right")
        keys = list(dict.fromkeys(list(a["by_kind"]) + list(b["by_kind"])))[:10]
        for k in keys:
            vb, va = b["by_kind"].get(k, 0), a["by_kind"].get(k, 0)
            t.add_row(
                k,
                fmt_ns(vb),
                f"{100 * vb / max(b['total_ns'], 1):.1f}%",
                fmt_ns(va),
                f"{100 * va / max(a['total_ns'], 1):.1f}%",
            )
        console.print(t)


__all__ = [
    "Amount",
    "Change",
    "Link",
    "Selector",
    "WhatIfError",
    "calibration_source",
    "duration_ns",
    "load_network",
    "parse_change",
    "parse_selector",
    "render",
    "whatif",
]
