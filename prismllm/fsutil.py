"""File helpers: writing an output directory so that a crash never leaves half of one behind;
digests of files."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path


def write_dir_atomically(
    path: str | os.PathLike, marker: str, fill: Callable[[Path], None], refuse: Callable[[str], Exception], what: str
) -> Path:
    """Fill a temp directory beside ``path`` with ``fill(tmp)``, then rename it into place.

    An existing directory is replaced only when it holds ``marker`` (one of ours: a graph's
    manifest, a calibration's summary); any other non-empty directory, or a file, is refused
    with ``refuse(message)`` naming ``what`` is being written."""
    path = Path(path)
    if path.exists():
        if not path.is_dir():
            raise refuse(f"cannot write {what} to {path}: a file is in the way")
        if any(path.iterdir()) and not (path / marker).exists():
            raise refuse(
                f"cannot write {what} to {path}: the directory is not empty and holds no {what}; "
                f"choose another path or remove it"
            )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        fill(tmp)
        old = None
        if path.exists():
            old = path.parent / f".{path.name}.old-{os.getpid()}"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
        os.replace(tmp, path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def write_file_atomically(path: str | os.PathLike, text: str | bytes) -> Path:
    """Write ``text`` (or bytes) to a temp file beside ``path``, then rename it into place: a
    reader never sees half a file, a crash never leaves one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    try:
        if isinstance(text, bytes):
            tmp.write_bytes(text)
        else:
            tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def read_json(path: str | os.PathLike) -> dict | None:
    """A JSON object from a file, or None where there is none (missing, unreadable, not an object)."""
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) else None


def sha256_file(path: str | os.PathLike) -> str:
    """The SHA-256 of a file's bytes, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
