"""Integrity by construction: a directory's manifest lists every file of it with its size and
CRC-32, and carries a CRC-32 of its own values; a reader checks both before it uses anything.

A writer seals the manifest last (:func:`sealed`), once every file it lists is complete; a reader
calls :func:`check_sealed`, which refuses, in one line naming the file, a manifest whose values or
a file whose bytes changed since. A manifest with neither key was written before manifests were
sealed: it is read as it is, unchecked.

CRC-32 (zlib's) is the checksum: it finds every burst error up to 32 bits and any other change
but one in 2^32, and costs ~1 GB/s on one core of a 2-core VM (docs/graph-format.md), so
checking a graph of 25 MB costs ~25 ms. It guards against damage, not against a forger.
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

FILES_KEY = "files"  # {file name: {"bytes": size, "crc32": 8 hex digits}}
CHECKSUM_KEY = "manifest_crc32"  # the CRC-32 of the manifest's other keys, as canonical JSON
SEAL_KEYS = (FILES_KEY, CHECKSUM_KEY)

_CHUNK = 1 << 20
_HEX8 = re.compile(r"[0-9a-f]{8}")


def crc32_file(path: str | Path) -> str:
    """zlib's CRC-32 of a file's bytes, as 8 hex digits."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def _crc32_of_values(manifest: dict[str, Any]) -> str:
    """The CRC-32 of a manifest's keys but the checksum, as canonical JSON (sorted keys, no
    spaces): the same for the dict a writer seals and the dict a reader parses back."""
    rest = {k: v for k, v in manifest.items() if k != CHECKSUM_KEY}
    text = json.dumps(rest, sort_keys=True, separators=(",", ":"))
    return f"{zlib.crc32(text.encode()):08x}"


def sealed(manifest: dict[str, Any], root: Path, names: Iterable[str]) -> dict[str, Any]:
    """``manifest`` (JSON values only) with the size and CRC-32 of each of ``names`` (files in
    ``root``, complete by now) and the checksum of its own values."""
    out = {k: v for k, v in manifest.items() if k not in SEAL_KEYS}
    out[FILES_KEY] = {n: {"bytes": (root / n).stat().st_size, "crc32": crc32_file(root / n)} for n in sorted(names)}
    out[CHECKSUM_KEY] = _crc32_of_values(out)
    return out


def unsealed(manifest: dict[str, Any]) -> dict[str, Any]:
    """The manifest's own values: what it says of the directory, without the seal's keys."""
    return {k: v for k, v in manifest.items() if k not in SEAL_KEYS}


def check_sealed(
    manifest: dict[str, Any],
    root: Path,
    required: Iterable[str],
    where: str,
    error: Callable[[str], Exception],
    fix: str,
) -> bool:
    """Check a manifest read from ``root``: its checksum against its values, then every file it
    lists (those in ``required`` must be listed) by size and CRC-32. Raises ``error(message)``,
    the message ``where: ...; fix``, on the first problem; returns False for a manifest written
    before manifests were sealed (nothing to check), True once everything checked out."""
    if not any(k in manifest for k in SEAL_KEYS):
        return False
    missing_key = next((k for k in SEAL_KEYS if k not in manifest), None)
    if missing_key is not None:
        raise error(f"{where}: the manifest has no {missing_key}, which a sealed manifest has; {fix}")
    checksum = manifest[CHECKSUM_KEY]
    if not isinstance(checksum, str) or not _HEX8.fullmatch(checksum):
        raise error(f"{where}: the manifest's {CHECKSUM_KEY} is not 8 hex digits; {fix}")
    if checksum != _crc32_of_values(manifest):
        raise error(
            f"{where}: the manifest's values do not match its {CHECKSUM_KEY} (it changed since it was written); {fix}"
        )
    files = manifest[FILES_KEY]
    if not isinstance(files, dict):
        raise error(f"{where}: the manifest's {FILES_KEY} is not an object; {fix}")
    unlisted = sorted(set(required) - set(files))
    if unlisted:
        raise error(f"{where}: the manifest lists no size and checksum for {', '.join(unlisted)}; {fix}")
    for name, entry in sorted(files.items()):
        if "/" in name or name in ("", ".", ".."):
            raise error(f"{where}: the manifest lists {name!r}, not a file name of the directory; {fix}")
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("bytes"), int)
            and not isinstance(entry.get("bytes"), bool)
            and isinstance(entry.get("crc32"), str)
            and _HEX8.fullmatch(entry["crc32"])
        ):
            raise error(f"{where}: the manifest's entry for {name} is not {{bytes, crc32}}; {fix}")
        path = root / name
        if not path.is_file():
            raise error(f"{where} is missing {name}, which its manifest lists; {fix}")
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise error(
                f"{where}: {name} is {size} bytes, its manifest says {entry['bytes']} (truncated or changed); {fix}"
            )
        if crc32_file(path) != entry["crc32"]:
            raise error(
                f"{where}: {name} does not match its checksum in the manifest (changed since it was written); {fix}"
            )
    return True


__all__ = ["CHECKSUM_KEY", "FILES_KEY", "SEAL_KEYS", "check_sealed", "crc32_file", "sealed", "unsealed"]
