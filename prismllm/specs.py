"""The command-line value syntaxes shared by every stage, each parsed in one place: rank lists
(``0,2-3``), parallel layouts (``tp=2,pp=4``) and device lists (``cpu``, ``cuda``,
``cuda:0,0,1``).

Parsers raise :class:`ValueError` with a message that names the value and the expected syntax;
a caller adds which flag or variable it came from (``--sandbox: ...``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

# ---------------------------------------------------------------------------------------------
# Rank lists


def parse_ranks(spec: str, world: int | None = None) -> tuple[int, ...]:
    """``"3,0-1, 1"`` -> (0, 1, 3): sorted, each rank once. With ``world``, every rank must lie
    in ``0 .. world - 1``."""
    out: set[int] = set()
    for part in (p.strip() for p in str(spec).split(",")):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            a, b = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"bad rank list {spec!r}: expected e.g. 0,2-3") from None
        if a < 0 or b < a:
            raise ValueError(f"bad rank range {part!r} in {spec!r}")
        out.update(range(a, b + 1))
    if not out:
        raise ValueError(f"empty rank list {spec!r}")
    ranks = tuple(sorted(out))
    if world is not None and ranks[-1] >= world:
        first = next(r for r in ranks if r >= world)
        raise ValueError(f"rank list {spec!r} names rank {first}; the world has ranks 0..{world - 1}")
    return ranks


def format_ranks(ranks: Sequence[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2,5,7-8" (what :func:`parse_ranks` reads back)."""
    rs = sorted(set(ranks))
    out: list[str] = []
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        out.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return ",".join(out)


# ---------------------------------------------------------------------------------------------
# Layouts


def parse_layout(spec: str | dict | None) -> dict[str, int | str] | None:
    """``"tp=2, PP=4,schedule=1f1b"`` -> {"tp": 2, "pp": 4, "schedule": "1f1b"} (keys lower case,
    integer values as ints); a dict is returned as it is, None as None. Which keys mean what,
    and whether the layout fits a world, is :class:`prismllm.layout.Layout`'s business."""
    if spec is None or isinstance(spec, dict):
        return spec
    out: dict[str, int | str] = {}
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, value = item.partition("=")
        key, value = key.strip().lower(), value.strip()
        if not sep or not key or not value:
            raise ValueError(f"bad --layout {spec!r}: expected key=value[,key=value...], e.g. tp=2,pp=2")
        if key in out:
            raise ValueError(f"bad --layout {spec!r}: {key} given twice")
        try:
            out[key] = int(value)
        except ValueError:
            out[key] = value
    if not out:
        raise ValueError(f"bad --layout {spec!r}: expected key=value[,key=value...], e.g. tp=2,pp=2")
    return out


# ---------------------------------------------------------------------------------------------
# Devices


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """Where processes run: ``cpu`` (gloo; processes stand in for devices), ``cuda`` (one GPU
    each, in index order), ``cuda:G,G,...`` (these GPUs in order; a GPU listed twice is shared
    by two processes) or ``auto`` (CUDA where enough GPUs are visible, else the CPU)."""

    kind: str  # "cpu" | "cuda" | "auto"
    gpus: tuple[int, ...] | None = None  # the listed GPUs of cuda:G,...; None: not listed

    @property
    def text(self) -> str:
        if self.gpus is not None:
            return "cuda:" + ",".join(map(str, self.gpus))
        return self.kind

    @property
    def shares_gpu(self) -> bool:
        return self.gpus is not None and len(set(self.gpus)) != len(self.gpus)

    def __str__(self) -> str:
        return self.text


def parse_devices(spec: str | None) -> DeviceSpec:
    """``cpu``, ``cuda``, ``cuda:0,0,1`` or ``auto`` (also None or "") -> DeviceSpec."""
    v = (spec or "").strip().lower()
    if v in ("", "auto"):
        return DeviceSpec("auto")
    if v in ("cpu", "cuda"):
        return DeviceSpec(v)
    if v.startswith("cuda:"):
        items = [x.strip() for x in v[5:].split(",")]
        if items and all(x.isdigit() for x in items):
            return DeviceSpec("cuda", tuple(int(x) for x in items))
    raise ValueError(
        f"bad --devices {spec!r}: expected cpu, cuda or cuda:G,G,... (GPU indices; one listed twice is shared)"
    )


def cuda_on_cpu_devices(spec: str | None) -> DeviceSpec:
    """The devices of a run whose program's CUDA calls are mapped to the CPU (``--cuda-on-cpu``):
    the CPU, for ``cpu`` and ``auto``; a GPU is refused (ValueError)."""
    dev = parse_devices(spec)
    if dev.kind == "cuda":
        raise ValueError(
            f"--devices {dev.text}: this run maps the program's CUDA calls to the CPU (--cuda-on-cpu, kept in "
            f"the graph's manifest); use --devices cpu, or capture without --cuda-on-cpu to run on GPUs"
        )
    return DeviceSpec("cpu")


__all__ = ["DeviceSpec", "cuda_on_cpu_devices", "format_ranks", "parse_devices", "parse_layout", "parse_ranks"]
