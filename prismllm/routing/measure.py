"""Balance statistics measured from observed routing: the routing file a real run implies.

Why: ``prism moe-stats`` lets a user replay a job's skew without knowing its numbers, by
measuring a run (under the observing mock router, :mod:`prismllm.routing.router`) and writing
the routing file that forcing then reads. The statistics describe one gating call, as the mock
router forces one: each call's balance ratios are computed from its own tokens per expert, and
each statistic is averaged over the calls (of every rank) of a router; ``default`` averages over
every call of every router. Averaging per-call statistics rather than pooling counts keeps the
skew of a call: summed over many calls, hot experts of different calls would average out.

Input: ``moe-rank<R>.json`` per rank, written by the observing router::

    {"format": "prism-moe-observe/1", "rank": R,
     "routers": {KEY: {"experts": E, "topk": k, "calls": [[tokens per expert], ...]}}}

Output: a routing file (:func:`prismllm.routing.stats.parse_routing`) whose module regexes
select each observed router: ``@N$`` for a key with a layer number (the layer under any pipeline
layout), else the escaped qualified name after a dot or at the start, anchored at the end.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from prismllm.routing.stats import FIELDS, BalanceStats, RoutingError, balance_stats

OBSERVE_FORMAT = "prism-moe-observe/1"  # what prismllm.routing.router writes


def read_observations(directory: str | Path) -> dict[str, list[np.ndarray]]:
    """Tokens per expert of every observed call, per router key, over the ranks' files."""
    d = Path(directory)
    files = sorted(d.glob("moe-rank*.json"))
    if not files:
        raise RoutingError(f"{d}: no moe-rank*.json (observed routing) in it")
    calls: dict[str, list[np.ndarray]] = {}
    experts: dict[str, int] = {}
    for f in files:
        try:
            doc = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise RoutingError(f"{f}: unreadable observation ({e})") from None
        if not isinstance(doc, Mapping) or doc.get("format") != OBSERVE_FORMAT:
            raise RoutingError(f"{f}: not an observation of the mock router (format {OBSERVE_FORMAT})")
        for key, entry in doc.get("routers", {}).items():
            e = int(entry["experts"])
            if experts.setdefault(key, e) != e:
                raise RoutingError(f"{f}: router {key} has {e} experts, {experts[key]} in another rank's file")
            calls.setdefault(key, []).extend(np.asarray(c, dtype=np.int64) for c in entry["calls"])
    return calls


def key_pattern(key: str) -> str:
    """The routing-file regex that selects the router of this key (module docstring)."""
    layer = re.fullmatch(r".*@(\d+)", key)
    if layer:
        return rf"@{layer.group(1)}$"
    return rf"(^|\.){re.escape(key)}$"


def mean_stats(calls: Sequence[Any]) -> BalanceStats:
    """Each statistic averaged over the calls that routed any token."""
    per_call = [balance_stats(c) for c in calls if np.sum(c) > 0]
    if not per_call:
        raise RoutingError("no observed call routed a token")
    return BalanceStats(**{f: float(np.mean([getattr(s, f) for s in per_call])) for f in FIELDS})


def routing_from_counts(calls: Mapping[str, Sequence[Any]]) -> dict[str, Any]:
    """The routing file (JSON value) of tokens per expert per call, per router key."""
    routed = {k: [c for c in v if np.sum(c) > 0] for k, v in calls.items()}
    routed = {k: v for k, v in routed.items() if v}
    if not routed:
        raise RoutingError("no observed call routed a token")
    every = [c for v in routed.values() for c in v]
    n = sum(len(v) for v in routed.values())
    return {
        "note": f"measured from {n} gating calls of {len(routed)} routers",
        "default": mean_stats(every).to_dict(),
        "modules": {key_pattern(k): mean_stats(v).to_dict() for k, v in sorted(routed.items())},
    }


def measure(directory: str | Path) -> dict[str, Any]:
    """The routing file implied by a directory of observations (``prism moe-stats``)."""
    return routing_from_counts(read_observations(directory))
