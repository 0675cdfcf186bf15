"""PrismTrace: the execution graph (schema, assembly, validation, comparison, exports).

The names below are imported on first use: a rank process that reads only the schema (a solo
rank, a sandbox rank) does not load assembly, validation and ``pyarrow.compute`` (~0.1 s of
every such process's start on the 2-core VM)."""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

_HOMES = {
    "PrismTrace": "graph",
    "TraceError": "graph",
    "assemble": "assemble",
    "assemble_spool": "assemble",
    "validate": "validate",
    "compare_traces": "compare",
    "CompareResult": "compare",
}


class _Package(types.ModuleType):
    """``assemble`` and ``validate`` name both a function and the submodule it lives in. Importing
    a submodule binds the package's attribute of that name to the module; the package's name
    stays the function (``from prismllm.trace import validate``), as it did when the package
    imported its functions eagerly."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and _HOMES.get(name) == name:
            return
        super().__setattr__(name, value)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value


sys.modules[__name__].__class__ = _Package

__all__ = list(_HOMES)
