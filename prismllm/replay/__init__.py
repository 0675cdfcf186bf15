"""Replay: walk the graphs of virtual ranks in logical time (the assistants' event loop)."""

from prismllm.replay.engine import (
    ExternalEvent,
    Replay,
    ReplayError,
    ReplayGraph,
    ReplayResult,
    ReplayStatus,
    replay,
)

__all__ = ["ExternalEvent", "Replay", "ReplayError", "ReplayGraph", "ReplayResult", "ReplayStatus", "replay"]
