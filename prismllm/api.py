"""The public mark/step API for programs that want labels or explicit iterations.

Both are no-ops outside prism (no recorder installed), so a program can call them
unconditionally::

    import prismllm
    for batch in loader:
        prismllm.mark("forward")      # a compute span named "forward" starts here
        loss = model(batch).sum()
        loss.backward()
        opt.step()
        prismllm.step()               # explicit iteration boundary

``mark(label)`` ends the compute span under way and starts one named ``label``, which runs to
the next communication call (or mark); that call carries the label too (generator rules match
it). ``mark("")`` ends a named span without naming the next; ``with span(label):`` names exactly
the work inside the block (``mark(label)`` on entry, ``mark("")`` on exit). ``step()`` ends the
current iteration; once a program calls it, the automatic boundaries after optimizer steps
are ignored. A boundary with no communication since the previous one extends that iteration
instead of opening a new one (e.g. ``opt.step(); prismllm.step()``).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator


def _recorder():
    mod = sys.modules.get("prismllm.comm.recorder")
    return None if mod is None else mod.current()


def mark(label: str) -> None:
    """Start a compute span named ``label`` here (no-op outside prism)."""
    rec = _recorder()
    if rec is not None:
        rec.mark(label)


@contextlib.contextmanager
def span(label: str) -> Iterator[None]:
    """Name the compute of the block ``label`` (no-op outside prism)."""
    mark(label)
    try:
        yield
    finally:
        mark("")


def step() -> None:
    """Mark an iteration boundary (no-op outside prism)."""
    rec = _recorder()
    if rec is not None:
        rec.boundary(explicit=True)


__all__ = ["mark", "span", "step"]
