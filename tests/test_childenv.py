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
