"""prismllm: emulate large-scale LLM training faithfully on a few devices."""

from prismllm.api import mark, step  # noqa: F401

__version__ = "0.1.0"
__all__ = ["mark", "step", "__version__"]
