"""The native backends (``recording_backend.cpp``, with the pruned groups' lane of ``pruned_lane.h``), built on first use.

``load()`` compiles the extension with ``torch.utils.cpp_extension`` (a C++ compiler is
needed; ~20-40 s once per torch version and source, cached under ``$PRISM_NATIVE_CACHE`` or
``~/.cache/prismllm/native``) and returns the module. The build directory is named after the
torch version and the digest of the source and the Python ABI, and the build reads a copy of the
source kept there: installations of prismllm that share the cache (two virtual environments, two
checkouts) share a build of the same source and never rebuild each other's, and a changed source
builds anew. A finished build is marked (``TAG.built``) and later loads import its library
directly: torch's builder, asked again from another environment, sees other include paths in
its build file and compiles again (two checkouts used side by side rebuilt each other's, ~40 s
each time on two cores, while their ranks waited).

Concurrent ranks build it once: each takes ``build.lock`` in the build directory, a file
holding its host and pid, before handing over to torch. Torch's own lock there is an empty
file, so a build killed half-way left it behind and every later start waited on it forever;
under ``build.lock`` no other prism process can be building, so a torch lock found there is
left over and is removed (with a message). A ``build.lock`` whose process is gone is removed
the same way; one still held after ``$PRISM_NATIVE_BUILD_TIMEOUT`` seconds (default 600)
ends the wait with a message naming the file and its holder.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import socket
import sys
import sysconfig
import time
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import torch
import torch.distributed  # noqa: F401  (the Backend and Work types the module uses)

from prismllm.childenv import user_setting
from prismllm.errors import RequirementError

_MOD: ModuleType | None = None
_SRC = Path(__file__).with_name("recording_backend.cpp")
_HEADERS = (Path(__file__).with_name("pruned_lane.h"),)  # included by _SRC


def build_directory(tag: str) -> Path:
    root = user_setting("PRISM_NATIVE_CACHE")
    if not root:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "prismllm", "native")
    return Path(root) / tag


def _tag() -> str:

    # the Python ABI too: a library built for one Python is not another's, and a finished build is
    # imported without asking torch's builder (see load)
    abi = str(sysconfig.get_config_var("SOABI")).encode()
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in (_SRC, *_HEADERS)) + abi).hexdigest()[:12]
    return "prism_native_" + torch.__version__.replace(".", "_").replace("+", "_") + "_" + digest


class NativeBuildError(RequirementError, RuntimeError):
    """The extension could not be built; the message says how to do without it."""


class BuildLockTimeout(RuntimeError):
    """The build lock stayed held by a live process for longer than the timeout."""


def needs_build() -> bool:
    """Whether ``load()`` will compile (no library of this torch version and source yet)."""
    tag = _tag()
    return not (build_directory(tag) / f"{tag}.so").exists()


def _holder(lock: Path) -> tuple[str, int] | None:
    """(host, pid) written in a build lock, None when the file is gone or half-written."""
    try:
        host, pid = lock.read_text().split()
        return host, int(pid)
    except (OSError, ValueError):
        return None


def _older_than(lock: Path, seconds: float) -> bool:
    try:
        return time.time() - lock.stat().st_mtime > seconds
    except OSError:
        return False  # removed meanwhile: the next try takes it


def _gone(holder: tuple[str, int] | None, lock: Path, timeout: float) -> bool:
    """Whether the process that wrote ``lock`` can no longer be building."""
    if holder is None:  # unreadable: the writer died between create and write, or is writing
        return _older_than(lock, 5.0)
    host, pid = holder
    if host != socket.gethostname():  # a shared cache: only its age tells
        return _older_than(lock, timeout)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        pass
    return False


@contextmanager
def _build_lock(directory: Path):
    timeout = float(user_setting("PRISM_NATIVE_BUILD_TIMEOUT", "600"))
    lock = directory / "build.lock"
    start = time.monotonic()
    while True:
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _holder(lock)
            if _gone(holder, lock, timeout):
                print(f"prism: removing {lock}, left by {holder or 'a process that died'}", file=sys.stderr)
                lock.unlink(missing_ok=True)
                continue
            if time.monotonic() - start > timeout:
                raise BuildLockTimeout(
                    f"prism: waited {timeout:.0f} s for the native backend's build, held by "
                    f"{holder} through {lock}; if that process is not building any more, "
                    "remove the file (or raise PRISM_NATIVE_BUILD_TIMEOUT)"
                ) from None
            time.sleep(0.2)
            continue
        try:
            os.write(fd, f"{socket.gethostname()} {os.getpid()}\n".encode())
        finally:
            os.close(fd)
        break
    try:
        left = directory / "lock"  # torch's: nobody else can hold it while we hold ours
        if left.exists():
            print(f"prism: removing {left}, left by a build that was stopped", file=sys.stderr)
            left.unlink(missing_ok=True)
        yield
    finally:
        lock.unlink(missing_ok=True)


def load(without: str = "`prism record --recorder python` records through the Python path") -> ModuleType:
    """The built module. ``without``: how to do without it, said where the build fails."""
    global _MOD
    if _MOD is None:
        # torch's extension builder (setuptools, ninja): only when the module is loaded
        from torch.utils.cpp_extension import load as build

        tag = _tag()
        directory = build_directory(tag)
        _MOD = _built(directory, tag)
        if _MOD is not None:
            return _MOD
        try:
            directory.mkdir(parents=True, exist_ok=True)
            with _build_lock(directory):
                src = directory / _SRC.name  # the digest names the directory: same content, same path
                for f in (*_HEADERS, _SRC):  # the source last: its presence says the copy is whole
                    if not (directory / f.name).exists():
                        shutil.copyfile(f, directory / f.name)
                _MOD = build(
                    name=tag,
                    sources=[str(src)],
                    extra_cflags=["-O2"],
                    build_directory=str(directory),
                    verbose=False,
                )
                (directory / f"{tag}.built").touch()  # the library is whole: later loads import it
        except BuildLockTimeout:
            raise
        except Exception as e:  # no compiler, headers that do not match, an unwritable cache
            raise NativeBuildError(
                f"prism: the native recording backend could not be built in {directory} ({_first_line(e)}); {without}"
            ) from None
    return _MOD


def _built(directory: Path, tag: str) -> ModuleType | None:
    """The library of a finished build of ``tag``, imported; None where there is none (or it does
    not import: then the builder makes it again)."""
    library = directory / f"{tag}.so"
    if not ((directory / f"{tag}.built").exists() and library.exists()):
        return None
    try:
        spec = importlib.util.spec_from_file_location(tag, library)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except Exception:  # damaged or foreign: build again
        return None
    return module


def _first_line(e: Exception) -> str:
    """A build failure's gist: torch's message carries the whole compiler log."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    return (errors or lines or [type(e).__name__])[0][:300]
