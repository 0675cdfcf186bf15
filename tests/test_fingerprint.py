"""The program fingerprint: a graph made from one program and argument list is refused, at the
start of `prism emulate` / `prism time`, for another (prismllm/launch/program.py)."""

from __future__ import annotations

import shutil

import pytest

from prismllm.capture.common import build_manifest
from prismllm.errors import PrismError
from prismllm.launch.program import check_program, program_fingerprint

ARGS = ["--tp", "2", "--layers", "2", "--json-log", "out/real.json"]


@pytest.fixture
def program(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('train')\n")
    config = tmp_path / "model.yaml"
    config.write_text("hidden: 32\n")
    return script, config


def manifest_of(script, args, mode="record"):
    m = build_manifest(world_size=4, layout=None, script=str(script), args=args, argv=None, device="cpu")
    m["mode"] = mode
    return m


def test_same_program_and_arguments_pass(program, tmp_path):
    script, config = program
    m = manifest_of(script, [*ARGS, "--config", str(config)])
    check_program(m, str(script), [*ARGS, "--config", str(config)], 4)
    # another path to the same bytes, for the script and for an input file
    other = tmp_path / "copy"
    other.mkdir()
    shutil.copy(script, other / "train.py")
    shutil.copy(config, other / "model.yaml")
    check_program(
        m, str(other / "train.py"), [*ARGS[:-1], "out/elsewhere.json", "--config", str(other / "model.yaml")], 4
    )
    # an output flag may be left out, or added
    check_program(m, str(script), ["--tp", "2", "--layers", "2", "--config", str(config)], 4)
    m2 = manifest_of(script, ["--tp", "2"])
    check_program(m2, str(script), ["--tp", "2", "--save-params", "params/"], 4)


def test_other_arguments_are_refused_with_the_first_difference(program):
    script, _ = program
    m = manifest_of(script, ARGS)
    with pytest.raises(PrismError, match=r"with --tp 2 but you launched --tp 1.*launch the graph's own command"):
        check_program(m, str(script), ["--tp", "1", *ARGS[2:]], 4)
    with pytest.raises(PrismError, match=r"with --layers 2 but you launched it without --layers 2"):
        check_program(m, str(script), ["--tp", "2", "--json-log", "x.json"], 4)
    with pytest.raises(PrismError, match=r"without --dist-opt but you launched --dist-opt"):
        check_program(m, str(script), [*ARGS, "--dist-opt"], 4)


def test_an_edited_script_or_input_is_refused(program, tmp_path):
    script, config = program
    m = manifest_of(script, ["--config", str(config)], mode="calibrated")
    other = tmp_path / "other.yaml"
    other.write_text("hidden: 64\n")
    with pytest.raises(
        PrismError, match=r"--config .*other.yaml, whose content differs.*then `prism time` and `prism calibrate`"
    ):
        check_program(m, str(script), ["--config", str(other)], 4)
    script.write_text("print('edited')\n")
    with pytest.raises(PrismError, match=r"is not that file any more \(sha256"):
        check_program(m, str(script), ["--config", str(config)], 4)


def test_switch_off_and_old_graphs(program, monkeypatch):
    script, _ = program
    m = manifest_of(script, ARGS)
    monkeypatch.setenv("PRISM_PROGRAM_CHECK", "off")
    check_program(m, str(script), ["--tp", "8"], 4)
    monkeypatch.delenv("PRISM_PROGRAM_CHECK")
    old = {"world_size": 4, "command": [str(script), *ARGS], "mode": "record"}  # before fingerprints
    check_program(old, "/elsewhere/train.py", ARGS, 4)
    with pytest.raises(PrismError, match="with --tp 2 but you launched --tp 4"):
        check_program(old, str(script), ["--tp", "4", *ARGS[2:]], 4)
    assert program_fingerprint(script, ARGS)["name"] == "train.py"
