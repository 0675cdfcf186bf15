"""Every flag that two commands share means the same in both: the parsers are walked and, for each
flag string, its help, default, choices, type, metavar and destination must be one (they come
from prismllm.cli.options); and every command answers --help."""

from __future__ import annotations

import argparse
from collections import defaultdict

import pytest

from prismllm.cli.main import SUBCOMMANDS, build_parser


def subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def meaning(a: argparse.Action) -> tuple:
    return (
        a.help,
        repr(a.default),
        tuple(a.choices) if a.choices else None,
        getattr(a.type, "__name__", a.type),
        a.metavar,
        a.dest,
        a.nargs,
        type(a).__name__,
    )


def test_every_shared_flag_means_the_same_in_every_command():
    by_flag: dict[str, dict[str, tuple]] = defaultdict(dict)
    for name, p in subparsers().items():
        for a in p._actions:
            for flag in a.option_strings:
                if flag not in ("-h", "--help"):
                    by_flag[flag][name] = meaning(a)
    shared = {f: cmds for f, cmds in by_flag.items() if len(cmds) > 1}
    assert {"--devices", "--out", "--force", "--timeout", "--layout", "--inputs", "--tensors"} <= set(shared)
    differ = {f: sorted(cmds) for f, cmds in shared.items() if len(set(cmds.values())) > 1}
    assert differ == {}


def test_the_check_sees_a_flag_that_differs():
    a = argparse.ArgumentParser().add_argument("--devices", default="cpu", help="x")
    b = argparse.ArgumentParser().add_argument("--devices", default="auto", help="x")
    assert meaning(a) != meaning(b)


@pytest.mark.parametrize("command", [m.replace("_", "-") for m in SUBCOMMANDS])  # module moe_stats: moe-stats
def test_every_command_has_help(command, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([command, "--help"])
    assert e.value.code == 0 and f"prism {command}" in capsys.readouterr().out
