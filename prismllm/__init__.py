"""prismllm: emulate large-scale LLM training faithfully on a few devices."""

__version__ = "0.1.0"
