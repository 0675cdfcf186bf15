"""Parallel layout: each rank's coordinates, and the classes of ranks whose graphs are equal
up to renaming (solo capture runs one representative per class).

    layout = Layout.parse("tp=2,pp=8,ep=4", world=1024)
    layout.coords(5)            # {"tp": 1, "cp": 0, "ep": 2, "dp": 0, "pp": 0}
    plan = replica_plan(layout) # representatives, replica_of, shift per rank, rank maps

Rank order (Megatron's ``order`` string, fastest-varying dimension first; default
``tp-cp-ep-dp-pp``): rank = mixed-radix number over the dimensions of ``order``. EP is carved
out of data parallelism as in Megatron-core and examples/gpt3d.py: the dense DP size is
``dp = world / (tp * cp * pp)``; inside it ``ep`` expert-parallel ranks and ``edp = dp / ep``
expert-data-parallel ranks, and the ``dp`` letter of ``order`` is the edp dimension. With the
default order ep varies faster than edp: dense dp_rank = edp_rank * ep + ep_rank (gpt3d's
rule), so ``tp-cp-ep-dp-pp`` with cp=1 is gpt3d's "tp fastest, then dp, then pp".

Replica classes. Two ranks that differ only in their edp coordinate run the same program on
different data: the DP replicas (ep = 1) or the expert-data-parallel replicas (ep > 1). The
representative of each class is its member with edp = 0, so the representatives cover every
distinct (tp, cp, ep, pp) coordinate: ``world / edp`` of them. A replica with edp = j is its
representative renamed by the *translation* ``shift_j``: the permutation of all ranks that
adds j (mod edp) to the edp coordinate. It maps the representative's TP, CP, EP and PP groups
onto the replica's, and the DP, expert-DP and world groups onto themselves (as sets).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from prismllm.errors import PrismError
from prismllm.specs import parse_layout

DIMS = ("tp", "cp", "ep", "dp", "pp")
DEFAULT_ORDER = "tp-cp-ep-dp-pp"
# Keys --layout accepts besides the sizes and ``order``: recorded, no effect on coordinates.
INFO_KEYS = ("vpp", "sp", "schedule", "etp")


@dataclasses.dataclass(frozen=True)
class Layout:
    world: int
    tp: int = 1
    cp: int = 1
    ep: int = 1
    pp: int = 1
    order: tuple[str, ...] = tuple(DEFAULT_ORDER.split("-"))
    info: tuple[tuple[str, Any], ...] = ()  # extra keys (vpp, schedule, ...) kept for the manifest

    # ------------------------------------------------------------------ sizes
    @property
    def dp(self) -> int:
        """Dense data-parallel size (ep * edp)."""
        return self.world // (self.tp * self.cp * self.pp)

    @property
    def edp(self) -> int:
        """Expert-data-parallel size: the replicas of each (tp, cp, ep, pp) coordinate."""
        return self.dp // self.ep

    def sizes(self) -> dict[str, int]:
        """Sizes of the ``order`` dimensions (its ``dp`` is edp)."""
        return {"tp": self.tp, "cp": self.cp, "ep": self.ep, "dp": self.edp, "pp": self.pp}

    # ------------------------------------------------------------------ parsing
    @classmethod
    def parse(cls, spec: str | dict | None, world: int) -> Layout | None:
        """``"tp=2,pp=2,ep=2,order=tp-cp-ep-dp-pp"`` (or a dict) -> Layout; None -> None.

        A layout that does not fit the world raises PrismError with one clear message."""
        if spec is None:
            return None
        if isinstance(spec, str):
            try:
                items: dict[str, Any] = dict(parse_layout(spec))
            except ValueError as e:
                raise PrismError(str(e)) from None
            text = spec
        else:
            items = dict(spec)
            text = ",".join(f"{k}={v}" for k, v in items.items())
        if not items:
            raise PrismError(f"bad --layout {text!r}: expected key=value[,key=value...], e.g. tp=2,pp=2")
        # edp: what ``to_dict`` adds (a manifest's layout reads back); derived, checked below
        edp = items.pop("edp", None)
        known = set(DIMS) | {"order"} | set(INFO_KEYS)
        unknown = sorted(set(items) - known)
        if unknown:
            raise PrismError(
                f"bad --layout {text!r}: unknown key {unknown[0]!r} (known: tp, cp, ep, pp, dp, order; "
                f"recorded only: {', '.join(INFO_KEYS)})"
            )
        sizes: dict[str, int] = {}
        for k in DIMS:
            if k in items:
                try:
                    v = int(items[k])
                except (TypeError, ValueError):
                    raise PrismError(f"bad --layout {text!r}: {k} must be an integer, not {items[k]!r}") from None
                if v < 1:
                    raise PrismError(f"bad --layout {text!r}: {k} must be at least 1, not {v}")
                sizes[k] = v
        order = cls._parse_order(str(items.get("order", DEFAULT_ORDER)), sizes, text)
        tp, cp, ep, pp = (sizes.get(k, 1) for k in ("tp", "cp", "ep", "pp"))
        if world < 1:
            raise PrismError(f"--world must be at least 1, not {world}")
        model = tp * cp * pp
        if world % model:
            raise PrismError(
                f"layout {text!r} does not divide the world: tp*cp*pp = {tp}*{cp}*{pp} = {model} "
                f"does not divide --world {world}"
            )
        dp = world // model
        if "dp" in sizes and sizes["dp"] != dp:
            raise PrismError(
                f"layout {text!r} does not fit the world: dp={sizes['dp']} but --world {world} / "
                f"(tp*cp*pp = {model}) = {dp}"
            )
        if dp % ep:
            raise PrismError(
                f"layout {text!r} does not divide the world: ep={ep} does not divide dp = "
                f"{world} / (tp*cp*pp = {model}) = {dp} (EP is carved out of DP)"
            )
        if edp is not None and int(edp) != dp // ep:
            raise PrismError(
                f"layout {text!r} does not fit the world: edp={edp} but dp / ep = {dp} / {ep} = {dp // ep}"
            )
        info = tuple((k, _scalar(items[k])) for k in INFO_KEYS if k in items)
        return cls(world=world, tp=tp, cp=cp, ep=ep, pp=pp, order=order, info=info)

    @staticmethod
    def _parse_order(order: str, sizes: dict[str, int], text: str) -> tuple[str, ...]:
        parts = [p.strip().lower() for p in order.split("-") if p.strip()]
        if len(set(parts)) != len(parts) or any(p not in DIMS for p in parts):
            raise PrismError(
                f"bad --layout {text!r}: order {order!r} must list distinct dimensions out of "
                f"{'-'.join(DIMS)} (fastest first), e.g. order={DEFAULT_ORDER}"
            )
        for d in DIMS:  # a dimension left out of the order must have size 1 (dp is always there)
            if d not in parts:
                if d == "dp" or sizes.get(d, 1) > 1:
                    raise PrismError(f"bad --layout {text!r}: order {order!r} lacks {d}")
                parts.append(d)
        return tuple(parts)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "tp": self.tp,
            "cp": self.cp,
            "ep": self.ep,
            "dp": self.dp,
            "edp": self.edp,
            "pp": self.pp,
            "order": "-".join(self.order),
        }
        d.update(dict(self.info))
        return d

    def canonical(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.to_dict().items())

    # ------------------------------------------------------------------ coordinates
    def coords_array(self, ranks: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """Coordinates of ``ranks`` (default all), one int64 array per dimension name."""
        r = np.arange(self.world, dtype=np.int64) if ranks is None else np.asarray(ranks, dtype=np.int64)
        sizes = self.sizes()
        out: dict[str, np.ndarray] = {}
        for d in self.order:
            out[d] = r % sizes[d]
            r = r // sizes[d]
        return out

    def coords(self, rank: int) -> dict[str, int]:
        """One rank's coordinates; ``dp`` here is the dense DP coordinate (edp*ep + ep when ep
        varies faster), ``edp`` the expert-data-parallel one."""
        if not 0 <= rank < self.world:
            raise PrismError(f"rank {rank} is outside the world of {self.world}")
        c = {k: int(v[0]) for k, v in self.coords_array(np.array([rank])).items()}
        out = {"tp": c["tp"], "cp": c["cp"], "ep": c["ep"], "edp": c["dp"], "pp": c["pp"]}
        out["dp"] = self.dense_dp_rank(out["ep"], out["edp"])
        return out

    def spanned(self, ranks: list[int]) -> list[str]:
        """The dimensions (``order`` names, fastest first) along which ``ranks`` differ."""
        c = self.coords_array(np.asarray(ranks, dtype=np.int64))
        return [d for d in self.order if len(np.unique(c[d])) > 1]

    def dense_dp_rank(self, ep_rank: int, edp_rank: int) -> int:
        if self.order.index("ep") < self.order.index("dp"):
            return edp_rank * self.ep + ep_rank
        return ep_rank * self.edp + edp_rank

    def rank_of(self, coords: dict[str, np.ndarray | int]) -> np.ndarray:
        """Inverse of :meth:`coords_array` (keys are the ``order`` names; dp = edp)."""
        sizes = self.sizes()
        r = np.zeros(np.shape(next(iter(coords.values()))), dtype=np.int64)
        mult = 1
        for d in self.order:
            r = r + np.asarray(coords[d], dtype=np.int64) * mult
            mult *= sizes[d]
        return r

    def shift(self, j: np.ndarray | int, ranks: np.ndarray) -> np.ndarray:
        """``shift_j(ranks)``: add ``j`` (mod edp) to the edp coordinate of each rank
        (vectorised; ``j`` per element or one value)."""
        c = self.coords_array(ranks)
        c["dp"] = (c["dp"] + np.asarray(j, dtype=np.int64)) % self.edp
        return self.rank_of(c)


@dataclasses.dataclass
class ReplicaPlan:
    """Which ranks run, and how every other rank is renamed from one that did.

    ``replica_of[r]``: the representative whose graph rank r takes (r itself for one).
    ``map_of[r]``: the renaming that turns that representative into r (-1: none, r is a
    representative); ``rename(map_ids, ranks)`` applies renamings to ranks, elementwise, with
    ``rename(map_of[r], replica_of[r]) == r``. For a layout, map m is ``shift_m``."""

    world: int
    representatives: list[int]
    replica_of: np.ndarray
    map_of: np.ndarray
    layout: Layout | None
    why_all: str = ""  # why every rank runs although a layout was given

    def rename(self, map_ids: np.ndarray, ranks: np.ndarray) -> np.ndarray:
        map_ids = np.asarray(map_ids, dtype=np.int64)
        ranks = np.asarray(ranks, dtype=np.int64)
        if self.layout is None:
            return ranks.copy()
        return self.layout.shift(np.maximum(map_ids, 0), ranks)

    @property
    def dedup(self) -> bool:
        return len(self.representatives) < self.world

    def classes(self) -> dict[int, list[int]]:
        """representative -> all ranks of its class (itself first)."""
        out: dict[int, list[int]] = {r: [] for r in self.representatives}
        for r, rep in enumerate(self.replica_of.tolist()):
            out[rep].append(r)
        return out

    def describe(self) -> str:
        if self.layout is None:
            return f"all {self.world} ranks run ({self.why_all or 'no --layout: no replica deduplication'})"
        lay = self.layout
        if lay.ep == 1:
            return (
                f"{len(self.representatives)} of {self.world} ranks run (one per (tp, cp, pp) "
                f"coordinate); each stands for {lay.edp} DP replicas"
            )
        return (
            f"{len(self.representatives)} of {self.world} ranks run (one per (tp, cp, ep, pp) "
            f"coordinate); each stands for {lay.edp} expert-data-parallel replicas, which copy "
            f"its all-to-all split sizes (MoE routing depends on each rank's data: with --tensors "
            f"every rank runs its own)"
        )


def replica_plan(layout: Layout | None, world: int | None = None) -> ReplicaPlan:
    """The representatives (edp coordinate 0) and the renaming of every replica; without a
    layout every rank is its own representative."""
    if layout is None:
        if world is None or world < 1:
            raise PrismError("a world size is needed")
        ranks = np.arange(world, dtype=np.int64)
        return ReplicaPlan(world, ranks.tolist(), ranks.copy(), np.full(world, -1, dtype=np.int64), None)
    world = layout.world
    c = layout.coords_array()
    edp = c["dp"]
    base = dict(c)
    base["dp"] = np.zeros_like(edp)
    replica_of = layout.rank_of(base)
    reps = np.flatnonzero(edp == 0)
    map_of = np.where(edp == 0, -1, edp)
    return ReplicaPlan(world, reps.tolist(), replica_of, map_of, layout)


def _scalar(v: Any) -> Any:
    try:
        return int(v)
    except (TypeError, ValueError):
        return v
