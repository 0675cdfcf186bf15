"""The tensor store's saving layer (prismllm/comm/saving.py) against NCCL's batch semantics,
which CPU runs never exercise: inside a coalesced batch (NCCL's ``batch_isend_irecv``) a
send/recv returns no Work and its data arrives with the batch's Work, returned by
``_end_coalescing``. A receive must be saved when that Work completes, not at issue (saving at
issue stored the buffer's old contents: the PP2 `--check` difference seen on 2 GPUs, where the
emulation's losses were bit-equal). A backend stand-in plays ProcessGroupNCCL's part."""

from __future__ import annotations

import types

import pytest
import torch

from prismllm.childenv import ChildEnv
from prismllm.comm import saving
from prismllm.generate.store import TensorStore


class BatchWork:
    def __init__(self):
        self.fut = torch.futures.Future()

    def get_future(self):
        return self.fut


class NcclLike:
    """send/recv inside a batch return None; the batch's Work comes from _end_coalescing."""

    def __init__(self):
        self.batch = None

    def recv(self, tensors, src, tag=0):
        return None

    def _end_coalescing(self, device):
        self.batch = BatchWork()
        return self.batch


@pytest.fixture
def store(tmp_path):
    saving.setup(0, ChildEnv(save_tensors="all", tensor_store=str(tmp_path / "store")))
    yield tmp_path / "store"
    saving.close()
    saving._WRITER = saving._SELECTOR = None


def owner(coalescing: bool):
    rec = types.SimpleNamespace(m_op=["recv"], m_label=[""], m_peer=[1], m_seq=[0], coal_depth=int(coalescing))
    return types.SimpleNamespace(_rec=rec, group_name="7", _global_ranks=[0, 1])


def test_batched_recv_is_saved_when_the_batch_completes(store):
    inner = NcclLike()
    si = saving.SavingInner(inner, owner(coalescing=True))
    buf = torch.zeros(4)
    assert si.recv([buf], 1, 0) is None
    work = si._end_coalescing(torch.device("cpu"))
    buf.fill_(7.0)  # the data arrives with the batch
    work.fut.set_result(None)
    saving.close()
    (saved,) = TensorStore(store, 0).get("7", [0, 1], "recv", 0, 1)
    assert torch.equal(saved, torch.full((4,), 7.0))


def test_a_call_that_returns_no_work_outside_a_batch_is_saved_at_once(store):
    si = saving.SavingInner(NcclLike(), owner(coalescing=False))
    buf = torch.full((2,), 3.0)
    si.recv([buf], 1, 0)
    buf.fill_(9.0)
    saving.close()
    (saved,) = TensorStore(store, 0).get("7", [0, 1], "recv", 0, 1)
    assert torch.equal(saved, torch.full((2,), 3.0))  # it returned complete: its value then
