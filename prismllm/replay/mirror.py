"""Which ranks a replay may leave out: the copies of a solo capture's DP replicas.

A replay that must play some ranks for what they are (its sandbox ranks' worlds, whose virtual
ranks meet real ones) plays those worlds and one more, the *generic* world, and leaves out every
other world (``prismllm.trace.worlds``): each of its ranks arrives at each call when its image in
the generic world does (same durations, same peers' classes), so it is no member an instance
needs to wait for. The cost of a slice or an emulation then grows with the layout (ranks per
world), not with the world size.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from prismllm.trace.graph import PrismTrace
from prismllm.trace.worlds import plan_of


def mirror_plan(trace: PrismTrace, keep: Iterable[int] = ()) -> np.ndarray | None:
    """Per rank of the world: the rank of the generic world it moves with, or -1 for a rank the
    replay plays (its world holds a rank of ``keep``, or is the generic one); None where nothing
    can be left out (:func:`prismllm.trace.worlds.plan_of` says when)."""
    return plan_of(trace.manifest, trace.groups, keep)


__all__ = ["mirror_plan"]
