"""The sweep page: one self-contained HTML table of a ``prism sweep`` (OUT/sweep.json), each point
with its predicted iteration time and peak memory, the fastest point that fits marked, points
that ran out of memory marked at the rank that did, each linking its own report."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from prismllm.fsutil import write_file_atomically
from prismllm.report.html import asset, escape, fmt_bytes, fmt_ns


def best_point(points: list[dict[str, Any]]) -> int | None:
    """The point with the shortest predicted iteration among those that ran (None if none)."""
    ok = [p for p in points if p["status"] == "ok" and p.get("predicted_iteration_ns") is not None]
    return min(ok, key=lambda p: p["predicted_iteration_ns"])["point"] if ok else None


def _status(p: dict[str, Any]) -> tuple[str, str]:
    if p["status"] == "ok":
        return "ok", ""
    if p["status"] == "out_of_memory":
        return f"out of memory (rank {p['oom_rank']})" if p.get("oom_rank") is not None else "out of memory", "bad"
    return "failed", "bad"


def render_sweep_html(state: dict[str, Any], base: Path) -> str:
    keys = [k for k, _ in state["grid"]]
    points = state["points"]
    best = best_point(points)
    emulated = any(p.get("emulated_iteration_ns") is not None for p in points)
    head = "".join(f"<th>{escape(k)}</th>" for k in keys) + (
        "<th>status</th>"
        + ("" if state.get("memory_only") else "<th>predicted iteration</th>")
        + ("<th>emulated iteration (rank)</th>" if emulated else "")
        + "<th>peak memory (on rank)</th><th>least</th><th>report</th>"
    )
    rows = []
    for p in points:
        status, cls = _status(p)
        cells = "".join(f"<td>{escape(p['values'].get(k, ''))}</td>" for k in keys)
        cells += f'<td class="{cls}" title="{escape(p.get("error") or "")}">{escape(status)}</td>'
        if not state.get("memory_only"):
            mark = " ★" if p["point"] == best else ""
            cells += (
                f'<td class="{"good" if mark else ""}">{escape(fmt_ns(p.get("predicted_iteration_ns")))}{mark}</td>'
            )
        if emulated:
            r = p.get("emulated_rank")
            cells += (
                f"<td>{escape(fmt_ns(p.get('emulated_iteration_ns')))}{escape(f' ({r})' if r is not None else '')}</td>"
            )
        peak = p.get("peak_memory_bytes")
        where = f" ({p['peak_memory_at']})" if peak is not None and p.get("peak_memory_at") else ""
        cells += f"<td>{escape(fmt_bytes(peak))}{escape(where)}</td><td>{escape(fmt_bytes(p.get('least_memory_bytes')))}</td>"
        rep = p.get("report")
        if rep and Path(rep).is_file():
            rel = os.path.relpath(rep, base)
            cells += f'<td><a href="{escape(rel)}">report</a></td>'
        else:
            cells += "<td>–</td>"
        rows.append(f"<tr>{cells}</tr>")
    n_oom = sum(p["status"] == "out_of_memory" for p in points)
    cap = (
        f"{len(points)} point(s) of {escape(state.get('script', ''))}; "
        + ("peak memory per rank from the solo capture. " if state.get("memory_only") else "")
        + ("★ the fastest point that ran. " if best is not None else "")
        + (f"{n_oom} point(s) ran out of memory. " if n_oom else "")
        + "Hover a failed point for its message."
    )
    css = asset("report.css")
    return (
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'\">"
        f"<title>prism sweep</title>\n<style>\n{css}\n</style></head>\n<body><main>\n"
        f'<section id="sweep"><h2>Sweep</h2><p class="caption">{cap}</p>'
        f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table></section>\n"
        "<footer>Written by prism sweep</footer></main></body></html>\n"
    )


def write_sweep_report(state: dict[str, Any], path: str | os.PathLike) -> Path:
    path = Path(path)
    write_file_atomically(path, render_sweep_html(state, path.parent))
    return path


__all__ = ["best_point", "render_sweep_html", "write_sweep_report"]
