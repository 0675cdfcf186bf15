"""`prism docs [TOPIC]`: the documentation, from the installed package. With no TOPIC, the
topics, one a page; with one, its page: Markdown as written when the output is a file or a pipe,
rendered for the terminal (through a pager, as git's help does) when it is one. The pages ship
inside the package, so a wheel shows the same pages as the repository, and a command's help
points to them by topic (`prism docs emulate`) rather than by a path."""

from __future__ import annotations

import argparse
import difflib
import os
import shutil
import sys
import textwrap
from importlib import resources
from importlib.resources.abc import Traversable

from rich.console import Console
from rich.markdown import Markdown

from prismllm.errors import PrismError, RequirementError

SUMMARY = "print a page of the documentation, or list the pages"
RAW_DESCRIPTION = False  # a docstring in prose, wrapped to the terminal
EXAMPLES = """
# the topics, one a page
prism docs
# a page: rendered and paged in a terminal, Markdown as written into a pipe or a file
prism docs getting-started
prism docs emulate | grep -n -A5 'Not supported'
"""

# The folders of the documentation, in the order the list shows them (the pages outside any folder
# first); a folder not named here comes after these, by name.
FOLDERS = ("commands", "stacks", "internals")
FIRST_PAGE = "getting-started"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "topic",
        nargs="?",
        metavar="TOPIC",
        help="a page's name, as `prism docs` lists them: e.g. concepts, exit-codes, graph-format, emulate",
    )


def run(args: argparse.Namespace) -> int:
    found = pages()
    if args.topic is None:
        print(topic_list(found, shutil.get_terminal_size().columns))
        return 0
    # a page named as a path (docs/commands/emulate.md, from an older help text) is its topic too
    topic = args.topic.removesuffix(".md").rsplit("/", 1)[-1]
    if topic not in found:
        close = difflib.get_close_matches(topic, list(found), n=3)
        hint = f"did you mean {' or '.join(close)}? " if close else ""
        raise PrismError(f"no page {args.topic!r}: {hint}`prism docs` lists the pages")
    show(found[topic][1].read_text(encoding="utf-8"))
    return 0


def pages() -> dict[str, tuple[str, Traversable]]:
    """Every page by its topic, the name of its file without .md (commands/emulate.md: emulate),
    with the folder it is in ("" for none), in the order the list shows them."""
    root = resources.files("prismllm").joinpath("docs")
    if not root.is_dir():
        raise RequirementError("this installation of prismllm has no documentation (prismllm/docs): reinstall it")
    folders = sorted(
        (d for d in root.iterdir() if d.is_dir()),
        key=lambda d: (FOLDERS.index(d.name) if d.name in FOLDERS else len(FOLDERS), d.name),
    )
    found: dict[str, tuple[str, Traversable]] = {}
    for folder, name in [(root, ""), *((d, d.name) for d in folders)]:
        for f in sorted((f for f in folder.iterdir() if f.name.endswith(".md")), key=lambda f: f.name):
            found.setdefault(f.name.removesuffix(".md"), (name, f))
    return found


def topic_list(found: dict[str, tuple[str, Traversable]], width: int) -> str:
    """The topics, a line of them per folder, wrapped to ``width``."""
    by_folder: dict[str, list[str]] = {}
    for topic, (folder, _) in found.items():
        by_folder.setdefault(folder or "guides", []).append(topic)
    label = max(map(len, by_folder)) + 2
    lines = [f"`prism docs TOPIC` prints a page; start with `prism docs {FIRST_PAGE}`.", ""]
    for folder, topics in by_folder.items():
        lines += textwrap.wrap(
            "  ".join(topics),
            width=max(width, label + 20),
            initial_indent=folder.ljust(label),
            subsequent_indent=" " * label,
            break_on_hyphens=False,
        )
    return "\n".join(lines)


def show(text: str) -> None:
    """A page on stdout: as written unless stdout is a terminal, which gets it rendered, through
    a pager when the page is longer than the screen."""
    if not sys.stdout.isatty():
        sys.stdout.write(text)
        return
    # as git does: less quits when one screen holds the page (F) and shows the colours (R)
    os.environ.setdefault("LESS", "FRX")
    console = Console()
    with console.pager(styles=True):
        console.print(Markdown(text))
