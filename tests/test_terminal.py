"""The tables prism prints wrap a cell between words only: a number stays with its unit and a flag
with its value at any terminal width; a word wider than its column is folded, never cut off."""

from __future__ import annotations

import io

import pytest
from rich import box
from rich.cells import cell_len
from rich.console import Console

from prismllm.terminal import Table, break_offsets

CRITICAL_PATH = "transfer all_reduce 64 %, compute 17 %, issue recv 8 %, issue send 2 %, 107.41 ms"
JOB = "examples/gpt3d.py --tp 2 --pp 2 --layers 2 --hidden 32 --heads 4 --seq 16 --vocab 128 at 8 ranks"


def rendered(width: int, *rows: tuple[str, str], frame: box.Box | None = None) -> str:
    t = Table(show_header=False, box=frame, padding=(0, 1))
    t.add_column(style="bold")
    t.add_column()
    for row in rows:
        t.add_row(*row)
    console = Console(width=width, file=io.StringIO(), color_system=None)
    console.print(t)
    return console.file.getvalue()


@pytest.mark.parametrize("width", range(40, 121, 4))
def test_a_cell_breaks_between_words_never_inside_a_figure_or_a_flag(width):
    text = rendered(width, ("critical path", CRITICAL_PATH), ("job", JOB))
    assert all(cell_len(line) <= width for line in text.splitlines())
    words = text.split()
    assert sorted(words) == sorted(f"critical path {CRITICAL_PATH} job {JOB}".split())  # no word split
    for glued in ("64 %", "17 %", "8 %", "2 %", "107.41 ms", "--tp 2", "--heads 4", "--vocab 128", "--hidden 32"):
        assert glued in text, (width, text)


def test_boxed_tables_and_markup_wrap_the_same_way():
    text = rendered(44, ("[red]critical path[/red]", CRITICAL_PATH), frame=box.SQUARE)
    assert "2 %" in text and "107.41 ms" in text and "[red]" not in text


def test_a_part_wider_than_its_column_is_folded():
    assert break_offsets("abcdefghij", 4) == [4, 8]
    assert break_offsets("a --heads 4 b", 9) == [2, 12]  # "a" / "--heads 4" / "b"
    assert break_offsets("send 2 % --x -1 --y --z v", 80) == []
    assert rendered(22, ("job", "examples/gpt3d.py --tp 2")).splitlines() == [
        " job  examples/gpt3d. ",
        "      py --tp 2       ",
    ]
