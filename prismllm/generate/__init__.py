"""Tensor generator for solo capture: outputs of collectives whose peers do not run.

``prismllm.generate.rule`` declares user rules (see ``rules.py``); ``generator.py`` holds the
defaults and the store > rules > defaults order; ``store.py`` the recorded-tensor store."""

from prismllm.generate.errors import GenerateError
from prismllm.generate.generator import DEFAULT, Call, TensorGenerator, default_fill
from prismllm.generate.rules import Rule, load_rules, rule
from prismllm.generate.store import Selector, TensorStore, TensorStoreWriter

__all__ = [
    "Call",
    "DEFAULT",
    "GenerateError",
    "Rule",
    "Selector",
    "TensorGenerator",
    "TensorStore",
    "TensorStoreWriter",
    "default_fill",
    "load_rules",
    "rule",
]
