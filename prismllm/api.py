"""The public mark/step API for programs that want labels or explicit iterations.

Both are no-ops outside prism (no recorder installed), so a program can call them
unconditionally::

    import prismllm
    for batch in loader:
        prismllm.mark("forward")      # labels the next node that starts after this call
        loss = model(batch).sum()
        loss.backward()
        opt.step()
        prismllm.step()               # explicit iteration boundary

``mark(label)`` labels the next node that starts after the call -- usually the next
communication call (the compute span already under way is not split). ``step()`` ends the
current iteration; once a program calls it, the automatic boundaries after optimizer steps
are ignored. A boundary with no communication since the previous one extends that iteration
instead of opening a new one (e.g. ``opt.step(); prismllm.step()``).
"""

from __future__ import annotations

import sys


def _recorder():
    mod = sys.modules.get("prismllm.comm.recorder")
    return None if mod is None else mod.current()


def mark(label: str) -> None:
    """Label the next node recorded (no-op outside prism)."""
    rec = _recorder()
    if rec is not None:
        rec.mark(label)


def step() -> None:
    """Mark an iteration boundary (no-op outside prism)."""
    rec = _recorder()
    if rec is not None:
        rec.boundary(explicit=True)


__all__ = ["mark", "step"]
