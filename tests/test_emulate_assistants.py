"""`prism emulate --assistants K`: the pruned groups are shared out among K assistant
processes (each replays the same plan of every virtual rank and plays the proxy of its own
groups). gpt3d TP2·DP2 at N = 4 with the last rank (which prints the losses) in the sandbox
and two assistants: the losses equal the real 4-rank run's, both assistants played groups,
and every process ended.
"""

from __future__ import annotations

import json
import re

import pytest
from test_emulate import GPT3D, LAYOUTS, SIZES

from prismllm.emulate import EmulateOptions, emulate
from prismllm.errors import PrismError

# test_emulate's TP2 program at N = 4: its real recording is shared (conftest.gpt3d_recording)
ARGS = [*LAYOUTS["tp2"], *SIZES]


def test_two_assistants_share_the_groups(tmp_path, capfd, gpt3d_recording):
    rec = gpt3d_recording(4, ARGS, save_tensors="all,inputs")
    real = rec.out
    real_loss = [r["loss"] for r in rec.log]

    out = tmp_path / "emu"
    res = emulate(
        EmulateOptions(
            graph=real,
            sandbox="3",
            out=out,
            script=GPT3D,
            args=[*ARGS, "--json-log", str(tmp_path / "emu.json")],
            timeout=240,
            assistants=2,
        )
    )
    emu_loss = [r["loss"] for r in json.loads((tmp_path / "emu.json").read_text())]
    assert emu_loss == pytest.approx(real_loss, rel=1e-5)
    info = json.loads((out / "emulate.json").read_text())
    assert info["assistants"] == 2 and info["assistant_returncodes"] == [0, 0]
    assert len(info["pids"]["assistants"]) == 2
    text = capfd.readouterr().out
    played = {int(m[1]): int(m[2]) for m in re.finditer(r"prism assistant (\d) of 2: replayed .* on (\d+) group", text)}
    assert sorted(played) == [0, 1] and all(n >= 1 for n in played.values()), text[-2000:]
    assert res.replay["answered"] > 0

    with pytest.raises(PrismError, match="--assistants must be 1 or more"):
        emulate(EmulateOptions(graph=real, sandbox="3", out=tmp_path / "bad", script=GPT3D, args=ARGS, assistants=0))
