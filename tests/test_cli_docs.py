"""Help that stands alone, from an installed wheel too (issue 40): `prism docs` shows the pages of
docs/ by topic, `prism example` writes examples/gpt3d.py, every command's --help ends with examples
that parse, and no help names a path of the repository that a wheel does not have."""

from __future__ import annotations

import argparse
import glob
import re
import shlex
import tomllib
from pathlib import Path

import pytest

from prismllm.cli import docs, example
from prismllm.cli.main import SUBCOMMANDS, _parse, build_parser, main

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs").glob("**/*.md"))
GPT3D = ROOT / "examples" / "gpt3d.py"

COMMANDS = ["", *(m.replace("_", "-") for m in SUBCOMMANDS)]  # "": `prism --help` itself


def help_text(command: str) -> str:
    """``prism [COMMAND] --help`` as printed (the top-level one for "")."""
    parser = build_parser()
    if not command:
        return parser.format_help()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[command].format_help()


def test_pyproject_ships_every_page_and_gpt3d():
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["prismllm"]
    shipped = {Path(p).resolve() for pattern in patterns for p in glob.glob(str(ROOT / "prismllm" / pattern))}
    assert {p.resolve() for p in [*PAGES, GPT3D]} <= shipped


def test_every_page_is_a_topic_of_its_own():
    stems = [p.stem for p in PAGES]
    assert len(stems) == len(set(stems)), "two pages of docs/ share a name: `prism docs NAME` shows one"
    assert set(docs.pages()) == set(stems)


def test_docs_lists_the_topics(capsys):
    assert main(["docs"]) == 0
    listed = set(re.findall(r"[\w-]+", capsys.readouterr().out))
    assert {p.stem for p in PAGES} <= listed


@pytest.mark.parametrize("topic", ["exit-codes", "emulate", "docs/commands/emulate.md"])
def test_docs_prints_a_page_as_written(topic, capsys):
    assert main(["docs", topic]) == 0
    page = next(p for p in PAGES if p.stem == Path(topic).stem)
    assert capsys.readouterr().out == page.read_text()


def test_an_unknown_topic_is_one_line_naming_the_close_ones(capsys):
    assert main(["docs", "emulte"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and "did you mean emulate?" in captured.err


def test_example_writes_gpt3d_and_keeps_a_file_already_there(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["example"]) == 0
    assert (tmp_path / "gpt3d.py").read_bytes() == GPT3D.read_bytes()
    assert "prism run --world 32" in capsys.readouterr().out

    target = tmp_path / "work" / "mine.py"
    assert main(["example", "gpt3d", str(target)]) == 0
    assert target.read_bytes() == GPT3D.read_bytes()
    target.write_text("# edited\n")
    assert main(["example", "gpt3d", str(target)]) == 2
    assert target.read_text() == "# edited\n"
    assert main(["example", "gpt3d", str(target), "--overwrite"]) == 0
    assert target.read_bytes() == GPT3D.read_bytes()


def test_example_prints_the_command_of_make_demo():
    make = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    demo_args = re.search(r"^DEMO_ARGS := (.*)$", make, re.M).group(1).split()
    recipe = re.search(r"^demo:.*\n\t(.*)$", make, re.M).group(1).split()
    named = {"$(VENV)/bin/prism": ["prism"], "$(DEMO_OUT)": ["out/demo"], "--force": [], "$(DEMO_ARGS)": demo_args}
    demo = [t for token in recipe for t in named.get(token, [token])]
    assert example.DEMO.format(program="examples/gpt3d.py").split() == demo


def example_lines(text: str) -> list[list[str]]:
    """The `prism ...` command lines under a help's ``examples:`` heading, continuations joined,
    each cut where a pipe starts."""
    section = text.split("\nexamples:\n", 1)[1].split("\n\n", 1)[0].replace("\\\n", " ")
    lines = [shlex.split(line) for line in section.splitlines() if line.strip().startswith("prism ")]
    return [argv[: argv.index("|")] if "|" in argv else argv for argv in lines]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_help_ends_with_examples_that_parse(command, capsys):
    lines = example_lines(help_text(command))
    assert len(lines) >= 2 and (not command or any(argv[1] == command for argv in lines))
    for argv in lines:
        try:
            _parse(build_parser(), argv[1:])
        except SystemExit as e:  # --help prints and exits 0; a command line argparse refuses exits 2
            assert e.code == 0 and "--help" in argv, f"`{shlex.join(argv)}` does not parse"


@pytest.mark.parametrize("command", COMMANDS)
def test_no_help_names_a_path_of_docs(command):
    assert "docs/" not in help_text(command)
