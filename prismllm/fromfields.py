"""Options handed on by field name: a command's parsed flags become a stage's options, and a
pipeline's options the options of each stage it runs, without listing every field that keeps its
name on the way."""

from __future__ import annotations

import dataclasses
from typing import Any, Self


class FromFields:
    """A dataclass mixin: :meth:`from_fields` builds one from another object's attributes."""

    @classmethod
    def from_fields(cls, source: Any, **given: Any) -> Self:
        """An instance whose fields are ``given``, else ``source``'s attribute of the same name where
        it has one (an ``argparse.Namespace``, another options dataclass), else the field's default.
        A field ``source`` has but must not hand on is given."""
        taken = {
            f.name: getattr(source, f.name)
            for f in dataclasses.fields(cls)
            if f.init and f.name not in given and hasattr(source, f.name)
        }
        return cls(**taken, **given)


__all__ = ["FromFields"]
