"""The assistant: one process that plays every virtual rank for the sandbox's real ranks
(``python -m prismllm.assistant``; ``proxy.py`` says how)."""

from prismllm.assistant.proxy import Assistant, AssistantError

__all__ = ["Assistant", "AssistantError"]
