"""``prism report``: a self-contained HTML page of a run -- the predicted iteration time and where
it goes, peak memory over the layout and rank by rank, any iteration's timeline with its critical
path, a link to the run's Perfetto trace, the communicators, and a real run beside the prediction
when one is given; each chart and table can be downloaded (``data.py`` gathers it, ``html.py``
draws it; nothing is fetched when the page opens)."""

from __future__ import annotations

import os
from pathlib import Path

from prismllm.fsutil import write_file_atomically
from prismllm.outputs import REPORT_FILE
from prismllm.report.data import collect
from prismllm.report.html import render_html


def write_report(
    run_dir: str | os.PathLike,
    out: str | os.PathLike | None = None,
    *,
    reference: str | os.PathLike | None = None,
    ranks: list[int] | None = None,
    against: str | os.PathLike | None = None,
) -> Path:
    """Write RUN_DIR's report (default RUN_DIR/report.html); returns its path. ``against``:
    another run directory, its figures beside RUN_DIR's."""
    path = Path(out) if out is not None else Path(run_dir) / REPORT_FILE
    data = collect(run_dir, reference=reference, ranks=ranks, against=against, page=path)
    write_file_atomically(path, render_html(data))
    return path


__all__ = ["collect", "render_html", "write_report"]
