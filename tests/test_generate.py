"""The tensor generator (prismllm.generate): defaults, user rules, the recorded-tensor store.
In-process and fast: Calls are built by hand."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from prismllm.errors import PrismError  # noqa: E402
from prismllm.generate import (  # noqa: E402
    Call,
    GenerateError,
    Selector,
    TensorGenerator,
    TensorStore,
    TensorStoreWriter,
    load_rules,
    rule,
)


def call(op, output=None, input=None, *, n=4, grank=1, index=0, **kw):
    ranks = tuple(range(10, 10 + n))
    return Call(
        rank=ranks[grank],
        op=op,
        api=op,
        group_ranks=ranks,
        group_desc=kw.pop("desc", ""),
        group_name="7",
        group_rank=grank,
        index=index,
        input=input,
        output=output,
        **kw,
    )


def test_defaults_reductions():
    g = TensorGenerator(0)
    t = torch.full((3,), 2.0)
    g.fill(call("all_reduce", t, t, reduce_op="sum"))
    assert t.tolist() == [8.0] * 3
    for red in ("avg", "max", "min", "premul_sum", "product"):
        t = torch.full((2,), 3.0)
        g.fill(call("all_reduce", t, t, reduce_op=red))
        assert t.tolist() == [3.0, 3.0]
    b = torch.tensor([True, False])
    g.fill(call("all_reduce", b, b, reduce_op="sum"))
    assert b.tolist() == [True, False]
    out, inp = torch.empty(2), torch.arange(8.0)
    g.fill(call("reduce_scatter", out, inp, reduce_op="sum"))
    assert out.tolist() == [8.0, 12.0]  # chunk of group rank 1, x 4


def test_defaults_gather_broadcast_recv():
    g = TensorGenerator(0)
    x = torch.tensor([1, 2, 3])
    out = torch.empty(12, dtype=torch.long)
    g.fill(call("all_gather", out, x))
    assert out.tolist() == [1, 2, 3] * 4
    slots = [torch.empty(3, dtype=torch.long) for _ in range(4)]
    g.fill(call("all_gather", slots, x))
    assert all(s.tolist() == [1, 2, 3] for s in slots)
    # A non-source rank keeps its own copy of replicated state (DDP's shape check broadcasts
    # int64 sizes/strides, its bucket rebuild int32 indices, flags are bool) ...
    meta = torch.tensor([64, 32, 32, 1, 64, 1], dtype=torch.long)
    idx = torch.tensor([3, 2, 1, 0, 2], dtype=torch.int32)
    flags = torch.tensor([True, False])
    for t in (meta, idx, flags):
        want = t.tolist()
        g.fill(call("broadcast", t, root=10))
        assert t.tolist() == want
    # ... but a torch.empty receive buffer (token ids from TP rank 0) holds pointers and float
    # bit patterns: zeros instead (valid token ids)
    ids = torch.tensor([[5, 139_872_345_678_912], [7, 3]], dtype=torch.long)
    g.fill(call("broadcast", ids, root=10))
    assert ids.eq(0).all()
    ids32 = torch.tensor([1, 2, 0x3F800000], dtype=torch.int32)  # 1.0f's bits
    g.fill(call("broadcast", ids32, root=10))
    assert ids32.eq(0).all()
    junk = torch.tensor([1, 0, 7], dtype=torch.uint8).view(torch.bool)
    g.fill(call("broadcast", junk, root=10))
    assert junk.view(torch.uint8).eq(0).all()
    f = torch.tensor([1.0, float("nan"), float("inf")])
    g.fill(call("broadcast", f, root=10))
    assert f.tolist() == [1.0, 0.0, 0.0]  # own copy kept, non-finite cleaned
    r = torch.ones(4)
    g.fill(call("recv", r, peer=11))
    assert r.eq(0).all()


def test_default_all_to_all_uneven():
    g = TensorGenerator(0)
    inp = torch.arange(10.0).view(10, 1)  # sends 1, 2, 3, 4 rows
    out = torch.full((8, 1), -1.0)  # receives 2, 2, 2, 2 rows
    g.fill(call("all_to_all", out, inp, in_splits=(1, 2, 3, 4), out_splits=(2, 2, 2, 2)))
    assert out.view(-1).tolist() == [0.0, 0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 7.0]


def test_moe_counts_replicated_give_consistent_splits():
    """gpt3d's dispatch: all-gather the per-expert counts, derive splits. With replicated
    counts, what a rank receives from each peer equals what it sends to itself."""
    g = TensorGenerator(0)
    ep, E = 4, 8
    L = E // ep
    counts = torch.tensor([3, 1, 0, 4, 2, 2, 1, 3])
    all_counts = torch.empty(ep * E, dtype=torch.long)
    g.fill(call("all_gather", all_counts, counts, n=ep))
    c = all_counts.view(ep, E).tolist()
    me = 1
    in_splits = [sum(c[me][j * L : (j + 1) * L]) for j in range(ep)]
    out_splits = [sum(c[j][me * L : (me + 1) * L]) for j in range(ep)]
    assert sum(in_splits) == int(counts.sum())
    assert out_splits == [int(counts[me * L : (me + 1) * L].sum())] * ep


def test_rules_match_and_errors(tmp_path):
    f = tmp_path / "rules.py"
    f.write_text(
        "import torch\n"
        "from prismllm.generate import rule, DEFAULT\n"
        "@rule(op='broadcast', group=[11, 10, 12, 13], dtype='int64', index=range(0, 5))\n"
        "def tokens(call):\n"
        "    return torch.full(call.shape, 7, dtype=call.dtype)\n"
        "@rule(label='skip')\n"
        "def skip(call):\n"
        "    return DEFAULT\n"
        "@rule(op='all_reduce', group='dp', shape=(None, 2))\n"
        "def inplace(call):\n"
        "    call.output.fill_(5)\n"
        "@rule(op='recv')\n"
        "def bad(call):\n"
        "    return torch.zeros(1, dtype=torch.float64)\n"
    )
    rules = load_rules(f)
    assert [r.name for r in rules] == ["tokens", "skip", "inplace", "bad"]
    g = TensorGenerator(0, rules)
    t = torch.empty(2, 3, dtype=torch.long)
    g.fill(call("broadcast", t, root=10, index=4))
    assert t.eq(7).all()
    t.zero_()
    g.fill(call("broadcast", t, root=10, index=5))  # index out of range: default
    assert t.eq(0).all()
    x = torch.ones(3, 2)
    g.fill(call("all_reduce", x, x, reduce_op="sum", desc="dp"))
    assert x.eq(5).all()
    x = torch.ones(3)
    g.fill(call("all_reduce", x, x, reduce_op="sum", label="skip"))
    assert x.eq(4).all()  # DEFAULT: falls through to sum x 4
    with pytest.raises(GenerateError) as e:
        g.fill(call("recv", torch.empty(4), peer=12, index=3))
    msg = str(e.value)
    assert msg.startswith("rank 11: recv on group 7 [10, 11, 12, 13] call 3 peer 12: rule 'bad'")
    assert "shape (1,) float64" in msg and "(4,) float32" in msg
    assert isinstance(e.value, PrismError)
    with pytest.raises(PrismError, match="no such file"):
        load_rules(tmp_path / "missing.py")


def test_store_roundtrip_and_priority(tmp_path):
    w = TensorStoreWriter(tmp_path, 11)
    w.save("7", (10, 11, 12, 13), "broadcast", 2, -1, "", [torch.arange(6, dtype=torch.long).view(2, 3)])
    w.save("8", (10, 11), "recv", 0, 10, "", [torch.tensor([1.5, 2.5], dtype=torch.bfloat16)])
    w.save("7", (10, 11, 12, 13), "all_gather", 3, -1, "", [torch.ones(2), torch.zeros(2)])
    # another group of the same ranks (e.g. DP and EP groups when ep == dp): its own entries
    w.save("9", (10, 11, 12, 13), "all_gather", 3, -1, "", [torch.full((2,), 5.0)] * 2)
    w.close()
    s = TensorStore(tmp_path, 11)
    assert len(s) == 4
    assert s.get("8", (10, 11), "recv", 0, 10)[0].tolist() == [1.5, 2.5]
    assert s.get("8", (10, 11), "recv", 1, 10) is None
    assert s.get("9", (10, 11, 12, 13), "all_gather", 3)[0].tolist() == [5.0, 5.0]
    raw = (tmp_path / "rank-000011.idx").read_bytes()
    assert b"pickle" not in raw and b"torch" not in raw

    @rule(op="broadcast")
    def never(call):  # the store answers first
        raise AssertionError

    g = TensorGenerator(11, [never.prism_rule], s)
    t = torch.empty(2, 3, dtype=torch.long)
    g.fill(call("broadcast", t, root=10, index=2))
    assert t.view(-1).tolist() == list(range(6))
    slots = [torch.empty(2), torch.empty(2)]
    g.fill(call("all_gather", slots, torch.ones(2), index=3))
    assert slots[1].eq(0).all()
    with pytest.raises(GenerateError, match="recorded tensor store holds shape"):
        g.fill(call("broadcast", torch.empty(3, dtype=torch.long), root=10, index=2))


def test_selector():
    s = Selector("all_gather,label:moe")
    assert s("all_gather", "") and s("all_reduce", "moe") and not s("all_reduce", "x")
    assert Selector("all")("recv", "") and not Selector("")


def test_store_reads_from_many_threads(tmp_path):
    """The assistant's group workers read one rank's store at once: every read must return
    its own call's bytes (a shared file position once mixed them up)."""
    import threading

    w = TensorStoreWriter(tmp_path, 3)
    want = {i: torch.arange(i * 1000, i * 1000 + 257 + i, dtype=torch.float32) for i in range(40)}
    for i, t in want.items():
        w.save("1", (3, 4), "all_reduce", i, -1, "", [t])
    w.close()
    s = TensorStore(tmp_path, 3)
    bad = []

    def reader(k: int) -> None:
        for j in range(300):
            i = (k * 7 + j) % 40
            if not torch.equal(s.get("1", (3, 4), "all_reduce", i)[0], want[i]):
                bad.append(i)

    ts = [threading.Thread(target=reader, args=(k,)) for k in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not bad


def test_a_receive_into_a_leaf_that_requires_grad_is_filled_outside_autograd():
    """Pipeline schedules receive into leaves that require grad; a real backend writes them
    from C++, and so must the generator (an in-place write under grad mode raises)."""
    g = TensorGenerator(1)
    buf = torch.empty(3, requires_grad=True)
    g.fill(Call(rank=1, op="recv", api="recv", group_ranks=(0, 1), group_desc="", group_name="0",
                group_rank=1, index=0, peer=0, output=buf))  # fmt: skip
    assert buf.detach().tolist() == [0.0, 0.0, 0.0] and buf.requires_grad
