"""What reaches `prism`'s entry point ends as one line and an exit code of prismllm.errors.ExitCode:
a damaged graph manifest (exit 3, naming the file and the field), a Python without torch (exit 4,
with the fix), an unexpected exception (exit 5, naming where); `prism --debug` and PRISM_DEBUG=1
add the traceback. Every command's --help and docs/exit-codes.md list the codes."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from prismllm.cli import main as climain
from prismllm.errors import EXIT_CODES_HELP, ExitCode
from prismllm.trace import assemble
from prismllm.trace.synth import example_logs

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def cli(capsys, monkeypatch):
    """``prism ARGV`` in-process -> (exit code, stdout, stderr); only the commands that read graphs
    are loaded."""
    monkeypatch.setattr(climain, "SUBCOMMANDS", ("show", "compare", "export"))
    monkeypatch.delenv("PRISM_DEBUG", raising=False)

    def run(*argv):
        rc = climain.main([str(a) for a in argv])
        out, err = capsys.readouterr()
        return rc, out, err

    return run


@pytest.fixture(scope="module")
def graph(tmp_path_factory) -> Path:
    """A 4-rank graph (read-only: tests damage copies of it)."""
    return assemble(example_logs(), {"mode": "record", "command": ["train.py"]}).save(
        tmp_path_factory.mktemp("graph") / "g"
    )


def damaged(graph: Path, tmp_path: Path, manifest_text: str) -> Path:
    g = tmp_path / "damaged"
    shutil.copytree(graph, g)
    (g / "manifest.json").write_text(manifest_text)
    return g


def one_line(err: str, command: str, code: int, rc: int) -> str:
    assert rc == code, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"prism {command}: error: "), err
    return lines[0]


# world_size and peak_memory_bytes values from the mutations that used to end in a traceback, and
# the world sizes that made an assistant allocate gigabytes
BAD_VALUES = [
    ("world_size", '"abc"', "world_size is 'abc', expected a whole number from 1 to 16777216"),
    ("world_size", "[]", "world_size is a list of 0, expected a whole number"),
    ("world_size", str(2**63), f"world_size is {2**63}, expected a whole number"),
    ("world_size", str(2**31), f"world_size is {2**31}, expected a whole number"),
    ("world_size", "NaN", "world_size is NaN, expected a whole number"),
    ("world_size", "true", "world_size is true, expected a whole number"),
    ("world_size", "0", "world_size is 0, expected a whole number from 1"),
    ("world_size", "2", "nodes.parquet: rank 3 is outside the world of 2"),
    ("peak_memory_bytes", '{"0": "2"}', "peak_memory_bytes.0 is '2', expected a whole number of bytes"),
    ("peak_memory_bytes", '{"9": 1}', "peak_memory_bytes has '9', not a rank of the world of 4"),
    ("layout", '{"tp": "x"}', "layout.tp is 'x', expected a whole number"),
    ("command", '"train.py"', "command is 'train.py', expected a list of strings"),
    ("cuda_on_cpu", '"no"', "cuda_on_cpu is 'no', expected true or false"),
]


@pytest.mark.parametrize("field,value,needle", BAD_VALUES, ids=[f"{f}={v[:12]}" for f, v, _ in BAD_VALUES])
def test_a_bad_manifest_value_is_one_line_naming_the_file_and_the_field(cli, graph, tmp_path, field, value, needle):
    m = json.loads((graph / "manifest.json").read_text())
    m.pop("peak_memory_bytes")  # the world size's own check first (its keys are ranks)
    # unsealed, as a graph written before seals: a sealed one's changed values end at its checksum
    # (values are checked first), and a world_size too small for the tables must be found anyway
    m.pop("manifest_crc32")
    m.pop("files")
    text = json.dumps({**m, field: "VALUE"}).replace('"VALUE"', value)
    g = damaged(graph, tmp_path, text)
    for command, argv in (("show", [g]), ("compare", [graph, g])):
        rc, _, err = cli(command, *argv)
        line = one_line(err, command, ExitCode.BAD_INPUT, rc)
        assert f"graph {g}" in line and needle in line, line


def test_a_manifest_without_world_size_or_nested_too_deep_is_one_line(cli, graph, tmp_path):
    m = json.loads((graph / "manifest.json").read_text())
    del m["world_size"]
    g = damaged(graph, tmp_path, json.dumps(m))
    rc, _, err = cli("show", g)
    assert one_line(err, "show", ExitCode.BAD_INPUT, rc).endswith(
        "manifest.json has no world_size; re-record the graph"
    )
    (g / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)  # json's RecursionError
    rc, _, err = cli("show", g)
    assert "manifest.json nests too deep" in one_line(err, "show", ExitCode.BAD_INPUT, rc)


def test_a_null_in_a_table_is_one_line(cli, graph, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    g = tmp_path / "nulls"
    shutil.copytree(graph, g)
    groups = pq.read_table(g / "groups.parquet")
    pq.write_table(groups.set_column(0, "group_id", pa.nulls(groups.num_rows, pa.int32())), g / "groups.parquet")
    rc, _, err = cli("show", g)
    assert "groups.parquet is " in one_line(err, "show", ExitCode.BAD_INPUT, rc)  # its checksum first
    rc, _, err = cli("show", g, "--no-verify")
    line = one_line(err, "show", ExitCode.BAD_INPUT, rc)
    assert f"graph {g}: groups.parquet: column 'group_id' has {groups.num_rows} null value(s)" in line


def test_debug_adds_the_traceback(cli, graph, tmp_path, monkeypatch):
    g = damaged(graph, tmp_path, json.dumps({**json.loads((graph / "manifest.json").read_text()), "world_size": "x"}))
    for argv, env in ((["--debug", "show", g], None), (["show", g], "1")):
        if env:
            monkeypatch.setenv("PRISM_DEBUG", env)
        rc, _, err = cli(*argv)
        assert rc == ExitCode.BAD_INPUT and err.startswith("Traceback (most recent call last):"), err
        assert err.strip().splitlines()[-1].startswith("prism show: error: graph ")


def test_an_unexpected_exception_is_one_line_naming_where(cli, graph, monkeypatch):
    from prismllm.cli import show

    def broken(trace):
        return {}["peak"]

    monkeypatch.setattr(show, "summarize", broken)
    rc, _, err = cli("show", graph)
    line = one_line(err, "show", ExitCode.INTERNAL, rc)
    assert re.search(r"internal error: KeyError: 'peak' \(at prismllm/cli/show\.py:\d+ in run\)", line), line
    assert "prism --debug" in line


def test_an_os_error_names_its_file(cli, graph, tmp_path, monkeypatch):
    from prismllm.cli import export

    def full(*a, **k):
        raise OSError(28, "No space left on device", str(tmp_path / "out.json"))

    monkeypatch.setattr(export, "export_perfetto", full)
    rc, _, err = cli("export", graph, "--perfetto", tmp_path / "out.json")
    line = one_line(err, "export", ExitCode.ENVIRONMENT, rc)
    assert line == f"prism export: error: {tmp_path / 'out.json'}: No space left on device"


# Two ways a Python has no torch: an import hook that finds nothing (as in a venv where it was never
# installed), and a module table that hides it (``import torch`` fails wherever it is reached).
HIDE_TORCH = {
    "finder": """
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "torch":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NoTorch())
""",
    "modules": "sys.modules['torch'] = None\n",
}


# `show` made to need torch on its way, as a command that imports it late would
SHOW_NEEDS_TORCH = """
import prismllm.cli.show as show
show.summarize = lambda trace: __import__("torch")
"""


@pytest.mark.parametrize("hide", list(HIDE_TORCH))
@pytest.mark.parametrize("command", ["run", "show"])
def test_without_torch_a_command_is_one_line_with_the_fix(tmp_path, graph, hide, command):
    """`prism run` looks for torch before anything starts; a command that reaches an import of
    torch on its way says the same there."""
    if command == "run":
        argv, setup = (
            ["run", "--world", "4", "--out", str(tmp_path / "o"), "--", str(ROOT / "examples" / "gpt3d.py")],
            "",
        )
    else:
        argv, setup = ["show", str(graph)], SHOW_NEEDS_TORCH
    code = f"import sys\n{HIDE_TORCH[hide]}{setup}\nfrom prismllm.cli.main import main\nsys.exit(main())\n"
    p = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)
    line = one_line(p.stderr, command, ExitCode.ENVIRONMENT, p.returncode)
    assert "prism needs PyTorch" in line and "pip install torch" in line, line


def test_every_help_lists_the_exit_codes(capsys):
    parser = climain.build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    assert EXIT_CODES_HELP in capsys.readouterr().out
    for name in climain.SUBCOMMANDS:
        with pytest.raises(SystemExit):
            parser.parse_args([name.replace("_", "-"), "--help"])
        assert EXIT_CODES_HELP in capsys.readouterr().out, name


def test_the_docs_list_every_exit_code():
    page = (ROOT / "docs" / "exit-codes.md").read_text()
    listed = {int(n) for n in re.findall(r"^\| (\d+) \|", page, flags=re.M)}
    assert listed == {int(c) for c in ExitCode}
    for c in ExitCode:
        assert re.search(rf"^\s+{int(c)}\s", EXIT_CODES_HELP, flags=re.M), c
