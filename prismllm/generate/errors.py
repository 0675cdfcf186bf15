"""The generator's one error type: names rank, op, group and call index in one line."""

from __future__ import annotations

from prismllm.errors import PrismError

_LAST: list[GenerateError] = []


class GenerateError(PrismError):
    """A collective output the tensor generator cannot (or must not) produce: a rule returned
    a tensor of the wrong shape/dtype, raised, or no rule answers a collective that has no
    sensible default. ``prismllm.comm.bootstrap`` prints it as one line and exits 3."""

    def __init__(self, message: str):
        super().__init__(message)
        # Remember it: a C++ caller (DDP's reducer, functional collectives) turns the Python
        # exception into a RuntimeError; bootstrap still reports this message.
        _LAST.append(self)


def last_error() -> GenerateError | None:
    return _LAST[-1] if _LAST else None
