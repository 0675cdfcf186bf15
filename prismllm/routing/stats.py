"""Balance-ratio statistics of an MoE layer, and integer token counts that reproduce them.

Why this exists: an MoE job's step time and peak memory depend on how unevenly its router
spreads tokens (the hottest expert's EP rank is the straggler of every all-to-all and holds the
largest activations), and a freshly initialised router in an emulation is balanced. Production
jobs log that unevenness per layer as *balance ratios*: tokens per expert divided by their
average, summarised as ``br_min, br_max, br_avg, br_std, br_med, br_skew``. This module turns
such a summary back into a concrete distribution -- integer tokens per expert for one gating
call of ``tokens`` tokens picking ``topk`` experts each -- that a mock router can force, so a
real job's skew can be replayed at any scale.

Definitions (the same in :func:`balance_stats` and in what :func:`counts_for` aims at):
``r = counts / mean(counts)``; ``br_min/br_max/br_med``: min, max and median of ``r`` (the
median of an even count is the mean of the middle two); ``br_avg = mean(r) = 1``;
``br_std``: population standard deviation of ``r``; ``br_skew``: Fisher-Pearson moment
coefficient ``m3 / m2**1.5`` of ``r`` (0 when ``r`` is constant).

Fidelity of :func:`counts_for` (measure it with :func:`achieved`): the total is exact and
every count lies in ``[0, tokens]`` (a token picks an expert at most once); ``br_max`` and
``br_min`` are the requested ones up to integer rounding (1 / mean tokens per expert), except
that ``br_max`` is capped at ``experts / topk`` (an expert cannot get more than every token);
``br_med`` is matched up to rounding where the other targets leave room for it; ``br_std`` is
matched where the bounds allow it and ``br_skew`` as closely as the other constraints allow
(both by a deterministic projected-gradient fit). Requests inconsistent for the number of
experts (say ``br_min`` 0.9 with ``br_max`` 2.5 over 3 experts) keep ``br_max`` first, then
``br_min``, then the median.

Which expert gets which count is a permutation seeded by a caller's key (a router's name), so
hot experts differ between layers and land on different EP ranks. Everything is numpy and
deterministic: every rank of an EP group derives the same counts, which is what solo capture
needs (its all-gather of routing counts hands every rank its own counts back).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from prismllm.errors import PrismError

FIELDS = ("br_min", "br_max", "br_avg", "br_std", "br_med", "br_skew")
BALANCED_WORD = "balanced"  # a routing-file entry: every expert gets the same count
_AVG_TOLERANCE = 0.01  # br_avg is 1 by definition; logged values carry rounding


class RoutingError(PrismError):
    """A routing file, a routing request or a router that cannot be used, in one line."""


@dataclasses.dataclass(frozen=True)
class BalanceStats:
    """Balance ratios (tokens per expert over their average) of one MoE layer."""

    br_min: float
    br_max: float
    br_avg: float
    br_std: float
    br_med: float
    br_skew: float

    @classmethod
    def balanced(cls) -> BalanceStats:
        return cls(1.0, 1.0, 1.0, 0.0, 1.0, 0.0)

    @property
    def is_balanced(self) -> bool:
        return self.br_min == 1.0 and self.br_max == 1.0

    def to_dict(self, digits: int = 6) -> dict[str, float]:
        return {f: round(float(getattr(self, f)), digits) for f in FIELDS}

    @classmethod
    def from_value(cls, value: Any, where: str) -> BalanceStats:
        """From a routing-file entry: ``"balanced"`` or an object with the six fields."""
        if value == BALANCED_WORD:
            return cls.balanced()
        if not isinstance(value, Mapping):
            raise RoutingError(f'{where}: expected "{BALANCED_WORD}" or an object with {", ".join(FIELDS)}')
        missing = [f for f in FIELDS if f not in value]
        unknown = sorted(set(value) - set(FIELDS))
        if missing or unknown:
            parts = ([f"missing {', '.join(missing)}"] if missing else []) + (
                [f"unknown {', '.join(unknown)}"] if unknown else []
            )
            raise RoutingError(f"{where}: {'; '.join(parts)} (the fields are {', '.join(FIELDS)})")
        nums = {}
        for f in FIELDS:
            v = value[f]
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
                raise RoutingError(f"{where}: {f} must be a finite number, not {v!r}")
            nums[f] = float(v)
        stats = cls(**nums)
        stats.check(where)
        return stats

    def check(self, where: str) -> None:
        """Raise RoutingError unless these ratios can describe tokens per expert."""
        m, mx, avg, sd, med = self.br_min, self.br_max, self.br_avg, self.br_std, self.br_med
        problem = None
        if abs(avg - 1.0) > _AVG_TOLERANCE:
            problem = f"br_avg {avg:g} must be 1 (ratios are over the average)"
        elif m < 0:
            problem = f"br_min {m:g} is negative"
        elif m > 1:
            problem = f"br_min {m:g} > 1 (the smallest ratio cannot exceed the average)"
        elif mx < 1:
            problem = f"br_max {mx:g} < 1 (the largest ratio cannot be below the average)"
        elif m > med:
            problem = f"br_min {m:g} > br_med {med:g}"
        elif med > mx:
            problem = f"br_med {med:g} > br_max {mx:g}"
        elif sd < 0:
            problem = f"br_std {sd:g} is negative"
        elif sd * sd > (1 - m) * (mx - 1) + 1e-6:
            # Bhatia-Davis: no distribution on [min, max] with mean 1 spreads more than this
            bound = math.sqrt(max(0.0, (1 - m) * (mx - 1)))
            problem = f"br_std {sd:g} exceeds {bound:.4g}, the most that br_min {m:g} and br_max {mx:g} allow"
        if problem:
            raise RoutingError(f"{where}: {problem}")


BALANCED = BalanceStats.balanced()


def balance_stats(counts: Any) -> BalanceStats:
    """The balance ratios of a vector of tokens per expert."""
    c = np.asarray(counts, dtype=np.float64).reshape(-1)
    if c.size == 0 or c.mean() <= 0:
        raise RoutingError("balance statistics need at least one expert and one routed token")
    r = c / c.mean()
    d = r - r.mean()
    m2, m3 = float(np.mean(d * d)), float(np.mean(d**3))
    skew = m3 / m2**1.5 if m2 > 1e-24 else 0.0
    return BalanceStats(
        br_min=float(r.min()),
        br_max=float(r.max()),
        br_avg=float(r.mean()),
        br_std=math.sqrt(m2),
        br_med=float(np.median(r)),
        br_skew=skew,
    )


# ----------------------------------------------------------------------------------------------
# The routing file
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Routing:
    """A parsed routing file: stats per router, chosen by the first module regex that
    ``re.search``-es the router's key (its qualified module name, see prismllm.routing.router),
    else the default."""

    default: BalanceStats
    modules: tuple[tuple[str, BalanceStats], ...] = ()

    def stats_for(self, key: str) -> BalanceStats:
        for pattern, stats in self.modules:
            if re.search(pattern, key):
                return stats
        return self.default

    def to_json(self) -> dict[str, Any]:
        def value(s: BalanceStats) -> Any:
            return BALANCED_WORD if s == BALANCED else s.to_dict()

        return {"default": value(self.default), "modules": {p: value(s) for p, s in self.modules}}


def parse_routing(obj: Any, source: str = "routing file") -> Routing:
    """A routing file's JSON value: ``{"default": STATS, "modules": {REGEX: STATS, ...}}``
    where STATS is ``"balanced"`` or ``{br_min, br_max, br_avg, br_std, br_med, br_skew}``.
    ``default`` is optional (balanced); so is ``modules``; ``note`` is free text, ignored."""
    if not isinstance(obj, Mapping):
        raise RoutingError(f'{source}: expected a JSON object with "default" and/or "modules"')
    unknown = sorted(set(obj) - {"default", "modules", "note"})
    if unknown:
        raise RoutingError(f'{source}: unknown key {", ".join(map(repr, unknown))} (expected "default", "modules")')
    default = BalanceStats.from_value(obj["default"], f"{source}: default") if "default" in obj else BALANCED
    mods = obj.get("modules", {})
    if not isinstance(mods, Mapping):
        raise RoutingError(f'{source}: "modules" must map a regex on the router\'s module name to its stats')
    out = []
    for pattern, value in mods.items():
        try:
            re.compile(pattern)
        except re.error as e:
            raise RoutingError(f"{source}: modules: {pattern!r} is not a valid regex ({e})") from None
        out.append((pattern, BalanceStats.from_value(value, f"{source}: modules[{pattern!r}]")))
    return Routing(default, tuple(out))


def load_routing(path: str | Path) -> Routing:
    """Read and check a routing file (``prism ... --routing FILE``)."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise RoutingError(f"routing file {p}: cannot read it ({e.strerror or e})") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise RoutingError(f"routing file {p}: not JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    return parse_routing(obj, f"routing file {p}")


# ----------------------------------------------------------------------------------------------
# Counts per expert from the statistics
# ----------------------------------------------------------------------------------------------
def counts_for(stats: BalanceStats, experts: int, tokens: int, topk: int, key: str | None = None) -> np.ndarray:
    """Tokens per expert (int64, length ``experts``) for one gating call of ``tokens`` tokens
    choosing ``topk`` distinct experts each: they sum to ``tokens * topk``, each lies in
    ``[0, tokens]``, and their balance ratios approach ``stats`` (module docstring). Sorted
    ascending without ``key``; with one, expert ``e`` gets the count that a permutation
    seeded by ``key`` gives it (the same on every process)."""
    if experts < 1 or tokens < 0 or not 1 <= topk <= experts:
        raise RoutingError(f"cannot route {tokens} tokens to top-{topk} of {experts} experts")
    counts = np.array(_sorted_counts(stats, experts, tokens, topk), dtype=np.int64)
    if key is None:
        return counts
    out = np.empty_like(counts)
    out[permutation(key, experts)] = counts
    return out


def permutation(key: str, experts: int) -> np.ndarray:
    """The experts in the order that receives ascending counts, seeded by ``key``."""
    seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")
    return np.random.default_rng(seed).permutation(experts)


def achieved(stats: BalanceStats, experts: int, tokens: int, topk: int) -> BalanceStats:
    """What :func:`counts_for` delivers for this request, to set beside what was asked."""
    if tokens == 0:
        return BALANCED
    return balance_stats(counts_for(stats, experts, tokens, topk))


@functools.lru_cache(maxsize=256)
def _sorted_counts(stats: BalanceStats, n: int, tokens: int, topk: int) -> tuple[int, ...]:
    total = tokens * topk
    if tokens == 0 or n == 1 or stats.is_balanced:
        return tuple(sorted(total // n + (i < total % n) for i in range(n)))
    ratios, pins = _continuous(stats, n, cap=n / topk)
    return tuple(_integers(ratios, pins, total, tokens).tolist())


def _continuous(stats: BalanceStats, n: int, cap: float) -> tuple[np.ndarray, list[int]]:
    """Ascending ratios with mean 1 in ``[0, cap]``, and the indices pinned (min, max, median)
    whose values are targets of their own."""
    hi = min(stats.br_max, cap)
    lo = min(stats.br_min, 1.0)
    if n == 2:
        hi = min(hi, 2.0)
        return np.array([2.0 - hi, hi]), [1]
    # the others must fit between min and max with mean 1: else min gives way (max is capped)
    lo = min(lo, (n - hi) / (n - 1))
    lo = max(lo, n - (n - 1) * hi)
    med_idx = [(n - 1) // 2] if n % 2 else [n // 2 - 1, n // 2]
    n_low = med_idx[0] - 1  # free values between min and median
    n_high = n - 1 - med_idx[-1] - 1  # free values between median and max
    c = len(med_idx)
    # medians that leave the free values a feasible sum
    med_lo = (n - lo - hi - n_high * hi) / (c + n_low)
    med_hi = (n - lo - hi - n_low * lo) / (c + n_high)
    med_lo, med_hi = max(med_lo, lo), min(med_hi, hi)
    x = np.empty(n)
    x[0], x[-1] = lo, hi
    if med_lo <= med_hi:
        med = min(max(stats.br_med, med_lo), med_hi)
        x[med_idx] = med
        free = np.r_[1 : med_idx[0], med_idx[-1] + 1 : n - 1]
        bounds_lo = np.r_[np.full(n_low, lo), np.full(n_high, med)]
        bounds_hi = np.r_[np.full(n_low, med), np.full(n_high, hi)]
        start = np.r_[np.linspace(lo, med, n_low + 2)[1:-1], np.linspace(med, hi, n_high + 2)[1:-1]]
        pins = [0, n - 1, *med_idx]
    else:  # min and max leave no room for the median: it floats
        free = np.arange(1, n - 1)
        bounds_lo, bounds_hi = np.full(n - 2, lo), np.full(n - 2, hi)
        start = np.linspace(lo, hi, n)[1:-1]
        pins = [0, n - 1]
    target = n - x[pins].sum()
    x[free] = _project(start, bounds_lo, bounds_hi, target)
    x[free] = _fit(x, free, bounds_lo, bounds_hi, target, stats.br_std, stats.br_skew)
    order = np.argsort(x, kind="stable")
    return x[order], sorted(int(np.flatnonzero(order == p)[0]) for p in pins)


def _project(v: np.ndarray, lo: np.ndarray, hi: np.ndarray, total: float) -> np.ndarray:
    """The point of ``{lo <= y <= hi, sum y = total}`` nearest to ``v`` (shift and clip)."""
    if v.size == 0:
        return v
    a, b = float(np.min(v - hi)) - 1.0, float(np.max(v - lo)) + 1.0
    for _ in range(100):
        tau = 0.5 * (a + b)
        if np.clip(v - tau, lo, hi).sum() > total:
            a = tau
        else:
            b = tau
    return np.clip(v - 0.5 * (a + b), lo, hi)


def _objective(x: np.ndarray, std: float, skew: float) -> tuple[float, np.ndarray]:
    """Squared relative misses of std (weight 1) and skew (weight 1/4), and their gradient."""
    n = x.size
    d = x - x.mean()
    m2 = float(np.mean(d * d))
    if m2 < 1e-24:
        return (std / max(std, 0.05)) ** 2, np.zeros(n)
    m3 = float(np.mean(d**3))
    s = math.sqrt(m2)
    g = m3 / m2**1.5
    ws, wg = max(std, 0.05), max(abs(skew), 1.0)
    es, eg = (s - std) / ws, (g - skew) / wg
    d_std = d / (n * s)
    d_skew = 3 * (d * d - m2) / (n * m2**1.5) - 3 * m3 * d / (n * m2**2.5)
    return es * es + 0.25 * eg * eg, 2 * es / ws * d_std + 0.5 * eg / wg * d_skew


def _fit(
    x: np.ndarray, free: np.ndarray, lo: np.ndarray, hi: np.ndarray, total: float, std: float, skew: float
) -> np.ndarray:
    """Projected gradient descent with backtracking over the free values."""
    x = x.copy()
    if free.size == 0:
        return x[free]
    n = x.size
    value, grad = _objective(x, std, skew)
    step = 1.0
    for _ in range(400):
        if value < 1e-12:
            break
        z = x[free]
        while step > 1e-9:
            trial = _project(z - step * n * grad[free], lo, hi, total)
            y = x.copy()
            y[free] = trial
            v, g = _objective(y, std, skew)
            if v < value - 1e-4 * float(np.dot(n * grad[free], z - trial)) and v < value:
                break
            step *= 0.5
        else:
            break
        improved = value - v
        x, value, grad = y, v, g
        step = min(step * 2.0, 1e3)
        if improved < 1e-14:
            break
    return x[free]


def _integers(ratios: np.ndarray, pins: list[int], total: int, cap: int) -> np.ndarray:
    """Round ``ratios * mean`` to integers in ``[0, cap]`` summing to ``total``: pinned values
    (min, max, median) by nearest rounding, the others by largest remainder within the pinned
    min and max. Pins give way (median, then min, then max) only when the others cannot absorb
    the rounding."""
    n = ratios.size
    want = ratios * (total / n)
    c = np.clip(np.rint(want), 0, cap).astype(np.int64)
    free = np.ones(n, dtype=bool)
    free[pins] = False
    lo_all, hi_all = int(c[0]), int(c[-1])
    c[free] = np.clip(np.floor(want[free]), lo_all, hi_all)
    lo = np.where(free, lo_all, c)
    hi = np.where(free, hi_all, c)
    relax = [i for i in pins if i not in (0, n - 1)] + [0, n - 1]
    for step in range(len(relax) + 1):
        _fill(c, want, lo, hi, total)
        if c.sum() == total or step == len(relax):
            break
        lo[relax[step]], hi[relax[step]] = 0, cap
    return np.sort(c)


def _fill(c: np.ndarray, want: np.ndarray, lo: np.ndarray, hi: np.ndarray, total: int) -> None:
    """Move ``c`` toward sum ``total`` by unit steps within ``[lo, hi]``, largest residual first."""
    while True:
        need = total - int(c.sum())
        if need == 0:
            return
        residual = want - c if need > 0 else c - want
        room = (c < hi) if need > 0 else (c > lo)
        idx = np.flatnonzero(room)
        if idx.size == 0:
            return
        idx = idx[np.argsort(-residual[idx], kind="stable")][: abs(need)]
        c[idx] += 1 if need > 0 else -1
