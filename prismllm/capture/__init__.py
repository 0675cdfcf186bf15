"""capture: run a training program's ranks and record what they execute (the bare graph).

``launcher`` starts rank processes the way torchrun does and supervises them; ``record`` is
``prism record`` on top of it.
"""

from prismllm.capture.launcher import (
    LaunchError,
    LaunchInterrupted,
    LaunchResult,
    LaunchSpec,
    RankFailure,
    launch,
)

__all__ = ["LaunchError", "LaunchInterrupted", "LaunchResult", "LaunchSpec", "RankFailure", "launch"]
