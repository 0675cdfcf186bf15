"""Tables for the terminal that wrap a cell between words only: a number stays with its unit
("2 %", "107.41 ms") and a flag with its value ("--heads 4"), whatever the terminal's width. A
part wider than its whole column is folded, as rich folds a long word.

Every table prism prints is a :class:`Table` (rich's, whose text cells are :class:`Cell`)."""

from __future__ import annotations

import re
from collections.abc import Iterator

from rich import table as rich_table
from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, RenderableType
from rich.measure import Measurement
from rich.text import Text

# the spaces a line never breaks at: between a number and its unit, between a flag and its value
_GLUED = re.compile(
    r"(?<=\d)(?P<unit> )(?=(?:%|[KMGT]?i?B|[mµun]?s|min|h)(?![\w/]))"
    r"|(?:^|(?<=\s))--[A-Za-z][\w.-]*(?P<flag> )(?=[^\s-]|-\d)"
)


def _parts(line: str) -> list[tuple[int, int]]:
    """(start, end) of each unbreakable part of ``line``: its words, glued where :data:`_GLUED` says."""
    glued = {m.start("unit") if m.group("unit") else m.start("flag") for m in _GLUED.finditer(line)}
    parts: list[tuple[int, int]] = []
    start = None
    for i, ch in enumerate(line + " "):
        if ch == " " and i not in glued:
            if start is not None:
                parts.append((start, i))
                start = None
        elif start is None:
            start = i
    return parts


def break_offsets(line: str, width: int) -> list[int]:
    """Where to break one line (offsets, as rich's ``Text.divide`` takes them) so that each piece
    fits ``width`` cells, breaking only between the parts of :func:`_parts`; a part wider than
    ``width`` is folded."""
    width = max(width, 1)
    offsets: list[int] = []
    piece = None  # where the current piece starts
    for start, end in _parts(line):
        if piece is not None and cell_len(line[piece:end]) <= width:
            continue
        if piece is not None:
            offsets.append(start)
        piece = start
        while cell_len(line[piece:end]) > width:  # fold a part wider than the column
            piece += width
            offsets.append(piece)
    return offsets


class Cell:
    """A table cell's text (rich markup) that wraps between the parts of :func:`break_offsets`."""

    def __init__(self, markup: str):
        self.markup = markup

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        lines = console.render_str(self.markup).plain.split("\n")
        widest_part = max((cell_len(ln[a:b]) for ln in lines for a, b in _parts(ln)), default=0)
        return Measurement(widest_part, max(map(cell_len, lines))).clamp(max_width=options.max_width)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> Iterator[RenderableType]:
        text = console.render_str(self.markup, highlight=options.highlight)
        if options.no_wrap:
            yield text
            return
        pieces = []
        for line in text.split("\n", allow_blank=True):
            for piece in line.divide(break_offsets(line.plain, options.max_width)):
                piece.rstrip()
                pieces.append(piece)
        yield Text("\n").join(pieces)  # every piece fits the width: rich breaks none of them again


class Table(rich_table.Table):
    """rich's Table whose text cells wrap between words only (:class:`Cell`)."""

    def add_row(self, *renderables: RenderableType | None, **kwargs) -> None:
        super().add_row(*(Cell(r) if isinstance(r, str) else r for r in renderables), **kwargs)


__all__ = ["Cell", "Table", "break_offsets"]
