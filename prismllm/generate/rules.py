"""User rules: a Python file (``prism capture --rules FILE``) that declares, with ``@rule``, how to
produce the outputs of chosen collectives in solo mode.

    # my_rules.py
    import torch
    from prismllm.generate import rule, DEFAULT

    VOCAB = 50257

    @rule(op="broadcast", dtype=torch.int64, group_size=8)     # token ids from TP rank 0
    def token_ids(call):
        return torch.randint(0, VOCAB, call.shape, dtype=call.dtype)

    @rule(op="broadcast_object_list", index=0)                 # dataloader status object
    def loader_state(call):
        return [{"epoch": 0, "exhausted": False}]

    @rule(label="moe-counts")                                  # prismllm.mark("moe-counts")
    def counts(call):
        per_expert = call.input.sum() // call.input.numel()    # balanced routing
        return torch.full(call.shape, int(per_expert), dtype=call.dtype)

Matching keywords (all optional; a rule matches when every given one matches; the first
matching rule in file order answers):

* ``op``: an op name or a tuple of them: ``all_reduce``, ``all_gather``, ``reduce_scatter``,
  ``all_to_all``, ``broadcast``, ``reduce``, ``gather``, ``scatter``, ``recv`` (tensor
  ops, as recorded), or ``broadcast_object_list``, ``all_gather_object``,
  ``scatter_object_list``, ``recv_object_list``, ``gather_object`` (object collectives);
* ``group``: the group's ``group_desc`` (a string), its global ranks (a list/tuple/set,
  compared as a set), or a predicate ``f(call) -> bool``; ``group_size``: an int;
* ``index``: the per-group call index (the recorded ``seq``): an int, a range/set/list, or a
  predicate; ``rank``: the global rank(s) the rule applies to;
* ``shape`` (a tuple, ``None`` entries are wildcards), ``dtype`` (a torch.dtype or its name),
  ``label`` (the ``prismllm.mark`` label of the call); ``when``: any predicate on the call.

The function receives a :class:`prismllm.generate.Call` and returns a tensor of exactly
``call.shape`` and ``call.dtype`` (copied into the program's own output tensor, on its
device), or ``None`` after filling ``call.output`` in place itself, or ``DEFAULT`` to fall
through to the default. Object rules return the Python objects (for
``broadcast_object_list``: the list; ``all_gather_object`` / ``gather_object``: one object
per group member; ``scatter_object_list`` / ``recv_object_list``: the list received).
"""

from __future__ import annotations

import os
import runpy
from collections.abc import Callable
from typing import Any

import torch

from prismllm.errors import InputError

_REGISTRY: list[Rule] | None = None


def _as_pred(v, name):
    if v is None:
        return None
    if callable(v):
        return v
    if isinstance(v, int):
        return lambda x: x == v
    if isinstance(v, (range, set, frozenset, list, tuple)):
        s = frozenset(v)
        return lambda x: x in s
    raise TypeError(f"rule keyword {name}={v!r}: expected an int, a collection or a predicate")


class Rule:
    def __init__(self, fn: Callable, *, op=None, group=None, group_size=None, index=None,
                 rank=None, shape=None, dtype=None, label=None, when=None):  # fmt: skip
        self.fn = fn
        self.name = getattr(fn, "__name__", "rule")
        self.ops = None if op is None else ({op} if isinstance(op, str) else set(op))
        self.group = group
        self.group_size = group_size
        self.index = _as_pred(index, "index")
        self.rank = _as_pred(rank, "rank")
        self.shape = None if shape is None else tuple(shape)
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        self.dtype = dtype
        self.label = label
        self.when = when

    def matches(self, call) -> bool:
        if self.ops is not None and call.op not in self.ops:
            return False
        if self.group_size is not None and call.group_size != self.group_size:
            return False
        g = self.group
        if g is not None:
            if isinstance(g, str):
                if call.group_desc != g:
                    return False
            elif callable(g):
                if not g(call):
                    return False
            elif frozenset(g) != frozenset(call.group_ranks):
                return False
        if self.index is not None and not self.index(call.index):
            return False
        if self.rank is not None and not self.rank(call.rank):
            return False
        if self.label is not None and call.label != self.label:
            return False
        if self.dtype is not None and call.dtype != self.dtype:
            return False
        if self.shape is not None:
            cs = tuple(call.shape) if call.shape is not None else None
            if cs is None or len(cs) != len(self.shape):
                return False
            if any(a is not None and a != b for a, b in zip(self.shape, cs)):
                return False
        if self.when is not None and not self.when(call):
            return False
        return True

    def __repr__(self) -> str:
        return f"rule {self.name!r}"


def rule(fn: Callable | None = None, **match: Any):
    """Decorator: ``@rule(op=..., group=..., ...)`` (or bare ``@rule``: matches everything)."""

    def deco(f):
        r = Rule(f, **match)
        if _REGISTRY is not None:
            _REGISTRY.append(r)
        f.prism_rule = r
        return f

    if fn is not None and callable(fn) and not match:
        return deco(fn)
    return deco


def load_rules(path: str | os.PathLike) -> list[Rule]:
    """Run the rules file and return the rules it declared, in order. A file may also define
    ``RULES = [...]`` (Rule objects or decorated functions)."""
    global _REGISTRY

    if not os.path.exists(path):
        raise InputError(f"--rules {path}: no such file")
    prev, _REGISTRY = _REGISTRY, []
    try:
        ns = runpy.run_path(str(path), run_name="prism_rules")
        found = list(_REGISTRY)
    finally:
        _REGISTRY = prev
    for extra in ns.get("RULES", []) or []:
        r = extra if isinstance(extra, Rule) else getattr(extra, "prism_rule", None)
        if r is None:
            raise InputError(f"--rules {path}: RULES holds {extra!r}, not a rule")
        if r not in found:
            found.append(r)
    return found


__all__ = ["Rule", "rule", "load_rules"]
