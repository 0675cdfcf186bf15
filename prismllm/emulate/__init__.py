"""Emulation: sandbox ranks run the real program, assistants replay every other rank
(docs/commands/emulate.md)."""

from prismllm.emulate.run import EmulateOptions, EmulateResult, emulate

__all__ = ["EmulateOptions", "EmulateResult", "emulate"]
