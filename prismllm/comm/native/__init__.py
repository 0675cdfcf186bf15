"""The native recording backend (``recording_backend.cpp``), built on first use.

``load()`` compiles the extension with ``torch.utils.cpp_extension`` (a C++ compiler is
needed; ~20-40 s once per torch version, cached under ``$PRISM_NATIVE_CACHE`` or torch's
extension cache) and returns the module. Concurrent ranks wait on torch's build lock, so a
job's first start builds it once.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType

_MOD: ModuleType | None = None
_SRC = Path(__file__).with_name("recording_backend.cpp")


def load() -> ModuleType:
    global _MOD
    if _MOD is None:
        import torch
        import torch.distributed  # noqa: F401  (the Backend and Work types the module uses)
        from torch.utils.cpp_extension import load as build

        cache = os.environ.get("PRISM_NATIVE_CACHE")
        if cache:
            os.makedirs(cache, exist_ok=True)
        tag = torch.__version__.replace(".", "_").replace("+", "_")
        try:
            _MOD = build(
                name=f"prism_native_{tag}",
                sources=[str(_SRC)],
                extra_cflags=["-O2"],
                build_directory=cache or None,
                verbose=False,
            )
        except Exception as e:  # no compiler, or headers that do not match
            raise RuntimeError(
                f"prism: the native recording backend could not be built ({e}); "
                "record with PRISM_NATIVE=0 to use the Python recording path"
            ) from None
    return _MOD
