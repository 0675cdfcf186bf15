"""prismllm: emulate large-scale LLM training faithfully on a few devices."""

from prismllm.api import mark, span, step  # noqa: F401

__version__ = "0.1.0"
__all__ = ["mark", "span", "step", "__version__"]
