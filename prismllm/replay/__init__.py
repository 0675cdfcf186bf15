"""Replay: walk the graphs of ranks in logical time (the assistants' event loop, and the solver
that calibration runs).

``graph.py`` builds the columnar :class:`ReplayGraph` of a PrismTrace; ``engine.py`` is the
event loop (:class:`Replay`); ``durations.py`` turns a graph's measurements into the durations a
replay is fed; ``solve.py`` replays every rank with them (:func:`solve`).
"""

from prismllm.replay.durations import (
    TRANSFER_RULES,
    CalibrationError,
    Durations,
    Measured,
    durations_for,
    measured,
    resolve_rule,
    slice_of_rank,
)
from prismllm.replay.engine import (
    ExternalEvent,
    Replay,
    ReplayResult,
    ReplayStatus,
    replay,
)
from prismllm.replay.graph import (
    INST_COLLECTIVE,
    INST_P2P,
    ReplayError,
    ReplayGraph,
    ranges,
)
from prismllm.replay.solve import Solution, solve

__all__ = [
    "CalibrationError",
    "Durations",
    "ExternalEvent",
    "INST_COLLECTIVE",
    "INST_P2P",
    "Measured",
    "Replay",
    "ReplayError",
    "ReplayGraph",
    "ReplayResult",
    "ReplayStatus",
    "Solution",
    "TRANSFER_RULES",
    "durations_for",
    "measured",
    "ranges",
    "replay",
    "resolve_rule",
    "slice_of_rank",
    "solve",
]
