"""The process contract (prismllm.childenv): what a parent hands a child, read back and checked."""

from __future__ import annotations

import pytest

from prismllm.childenv import ChildEnv
from prismllm.errors import PrismError


def test_every_choice_of_the_process_contract_is_checked_from_its_annotation():
    assert ChildEnv.from_env({"PRISM_HEAD_START": "iteration", "PRISM_MODE": "emulate"}).head_start == "iteration"
    for var, bad in (("PRISM_HEAD_START", "always"), ("PRISM_MODE", "replay"), ("PRISM_REPLAY_TIMING", "slow")):
        with pytest.raises(PrismError, match=rf"^{var}='{bad}': expected one of "):
            ChildEnv.from_env({var: bad})


def test_no_variable_of_the_contract_is_a_users_setting():
    """A parent writes the contract's variables into a child's environment, which also inherits the
    user's settings: one name for both would hand the child the user's raw value (PRISM_NATIVE_LANE
    is read by the launcher, which hands the child its decision as PRISM_NATIVE_LANE_ON)."""
    import dataclasses

    from prismllm.childenv import USER_SETTINGS, variable

    contract = {variable(f.name) for f in dataclasses.fields(ChildEnv)}
    # PRISM_NATIVE means one thing both ways (record through the native backend), and `prism record`
    # always hands its ranks its own choice
    assert contract & set(USER_SETTINGS) == {"PRISM_NATIVE"}, contract & set(USER_SETTINGS)
    # every bool field reads "0" as false
    child = ChildEnv.from_env({"PRISM_NATIVE_LANE_ON": "0", "PRISM_TRANSFER_DURATIONS": "1", "PRISM_NATIVE": "0"})
    assert (child.native_lane_on, child.transfer_durations, child.native) == (False, True, False)


def test_the_default_head_start_is_none_where_the_slices_run_the_native_lane(monkeypatch):
    """--head-start auto: the lane's slices run without a head start (it needs the Python
    recorder), the Python path's with the overhead one; an explicit choice stands either way."""
    from prismllm.childenv import head_start_for, native_lane_setting

    assert head_start_for("auto", native_lane=True) is None
    assert head_start_for("auto", native_lane=False) == "overhead"
    assert head_start_for("iteration", native_lane=True) == "iteration"
    assert head_start_for("off", native_lane=False) is None
    with pytest.raises(PrismError, match="^--head-start 'always': expected one of auto, overhead"):
        head_start_for("always", native_lane=False)
    monkeypatch.delenv("PRISM_NATIVE_LANE", raising=False)
    assert native_lane_setting(on_gpu=True) and not native_lane_setting(on_gpu=False)  # auto: the lane on NCCL
    monkeypatch.setenv("PRISM_NATIVE_LANE", "1")
    assert native_lane_setting(on_gpu=False)
    monkeypatch.setenv("PRISM_NATIVE_LANE", "0")
    assert not native_lane_setting(on_gpu=True)
    monkeypatch.setenv("PRISM_NATIVE_LANE", "yes")
    with pytest.raises(PrismError, match="^PRISM_NATIVE_LANE='yes': auto"):
        native_lane_setting(on_gpu=True)


def test_a_run_whose_slices_would_run_another_way_is_another_job(monkeypatch):
    """`prism run` resumes a stage only for the same job: with ``--head-start auto`` the slices'
    lane and head start follow PRISM_NATIVE_LANE, so the setting is part of the timed graph's job."""
    from prismllm.pipeline.run import RunOptions

    opts = RunOptions(world=4, out="out", script="train.py")
    monkeypatch.setenv("PRISM_NATIVE_LANE", "0")
    python_path = opts.time_job()
    monkeypatch.setenv("PRISM_NATIVE_LANE", "1")
    lane = opts.time_job()
    assert (python_path["head_start"], python_path["native_lane"]) == ("overhead", False)
    assert (lane["head_start"], lane["native_lane"]) == ("off", True)
