"""Pruned collectives (prismllm.pruning) run for real on gloo.

Each case forms the small communicator -- k real members + 1 proxy, one thread each with
its own ProcessGroupGloo over a shared HashStore -- from random inputs for all n logical
members (fixed seed). Real members issue their planned call with their own tensors only; the
proxy gets the virtual members' inputs only (real members' entries are None). Every real
member's output must equal the logical result computed directly from the n inputs: exactly
for max/min/bitwise/gather/scatter/broadcast/all_to_all/send-recv, to float64 rounding for
sums/avg/product (the reduction order differs). The ``test_naive_*`` cases run plausible
but wrong plans on the same communicator and check that they do NOT match, so the exact
checks above are not vacuous.
"""

from __future__ import annotations

import datetime
import itertools
import struct
import threading

import pytest
import torch
import torch.distributed as dist

import prismllm.pruning as C
from prismllm.pruning.tensors import post_reduce, reduce

# Logical groups: (n, real members) -- first, middle and last positions, several at once.
GROUPS = [
    (4, (0,)),
    (4, (1, 3)),
    (4, (3,)),
    (4, (0, 1, 2)),
    (8, (0,)),
    (8, (1, 3)),
    (8, (7,)),
    (8, (2, 5, 6)),
]
GID = [f"n{n}-r{'_'.join(map(str, r))}" for n, r in GROUPS]

F64 = torch.float64
ROWS, COLS = 3, 5  # per-member chunk shape where one is needed

_STORE = dist.HashStore()
_CASE = itertools.count()


# ---------------------------------------------------------------------- harness
def _pg(prefix: str, rank: int, size: int) -> dist.ProcessGroup:
    G = dist.ProcessGroupGloo
    opts = G._Options()
    opts._devices = [G.create_device(hostname="127.0.0.1")]
    opts._timeout = datetime.timedelta(seconds=20)
    return G(dist.PrefixStore(prefix, _STORE), rank, size, opts)


def _spmd(size: int, fns) -> list:
    """Run fns[s](pg) for small ranks s = 0..size-1, each in a thread with its own gloo PG."""
    prefix = f"pruning/{next(_CASE)}"
    out = [None] * size
    errors = []

    def work(s: int) -> None:
        try:
            out[s] = fns[s](_pg(prefix, s, size))
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append((s, e))

    threads = [threading.Thread(target=work, args=(s,), daemon=True) for s in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a small-communicator member hung"
    if errors:
        raise errors[0][1]
    return out


def _pruned(p: C.Plan, inputs: list, program, scratch=None, coalesce: bool = False) -> tuple:
    """Run plan ``p``: ``program(g)`` -> (kwargs for sandbox_call, result getter). Returns
    ({real g: result}, proxy SmallCall). ``scratch``: sandbox_call's buffer source; ``coalesce``:
    the proxy's (the real members' comes with the program's kwargs)."""
    G = p.group
    virtual_only = [inputs[g] if not G.is_real(g) else None for g in range(G.n)]
    fns = []
    for g in G.real:

        def sb(pg, g=g):
            kwargs, get = program(g)
            C.run(pg, C.sandbox_call(p, g, scratch=scratch, **kwargs))
            return get()

        fns.append(sb)
    fns.append(lambda pg: C.run(pg, C.proxy_call(p, virtual_only, coalesce=coalesce)))
    res = _spmd(G.size, fns)
    return dict(zip(G.real, res[:-1])), res[-1]


def _gen(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return lambda *shape, dtype=F64: (
        torch.randn(*shape, generator=g, dtype=F64).to(dtype)
        if dtype.is_floating_point
        else torch.randint(-50, 50, shape, generator=g, dtype=dtype)
    )


def _close(a: torch.Tensor, b: torch.Tensor, exact: bool) -> None:
    b = b.reshape(a.shape)
    if exact:
        assert torch.equal(a, b), (a, b)
    else:
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


EXACT_OPS = {"max", "min", "band", "bor", "bxor"}


# ---------------------------------------------------------------------- all_reduce
@pytest.mark.parametrize(
    "match_bytes,coalesce", [(True, False), (False, False), (True, True)], ids=["matched", "compact", "split"]
)
@pytest.mark.parametrize("op", ["sum", "avg", "max", "min", "product", "premul_sum"])
@pytest.mark.parametrize("n,real", GROUPS, ids=GID)
def test_all_reduce(n, real, op, match_bytes, coalesce):
    """``split``: the padded call in two parts (the program's tensor in place, the padding apart),
    as on NCCL, where they go in one batch; gloo runs them one after the other."""
    rnd = _gen(1)
    inputs = [rnd(ROWS, COLS) for _ in range(n)]
    factor = 0.37 if op == "premul_sum" else None
    p = C.plan_all_reduce(n, real, (ROWS, COLS), op, dtype=F64, factor=factor, match_bytes=match_bytes)
    ref = C.reference(p, inputs)

    def program(g):
        t = inputs[g].clone()
        return {"tensor": t, "coalesce": coalesce}, lambda: t

    got, proxy = _pruned(p, inputs, program, coalesce=coalesce)
    assert bool(proxy.parts) == (coalesce and p.pad > 0)
    for g in real:
        _close(got[g], ref[g], op in EXACT_OPS)
    # the reference itself: the plain torch definition
    stack = torch.stack(inputs)
    direct = {
        "sum": stack.sum(0),
        "avg": stack.mean(0),
        "max": stack.amax(0),
        "min": stack.amin(0),
        "product": stack.prod(0),
        "premul_sum": (stack * factor if factor else stack).sum(0),
    }[op]
    _close(ref[real[0]], direct, op in EXACT_OPS)


@pytest.mark.parametrize("op", ["sum", "avg", "max", "min", "band", "bor", "bxor"])
@pytest.mark.parametrize("n,real", [(4, (1, 3)), (8, (7,))], ids=["n4-r1_3", "n8-r7"])
def test_all_reduce_int64(n, real, op):
    rnd = _gen(2)
    inputs = [rnd(7, dtype=torch.int64) for _ in range(n)]
    p = C.plan_all_reduce(n, real, 7, op, dtype=torch.int64)
    ref = C.reference(p, inputs)

    def program(g):
        t = inputs[g].clone()
        return {"tensor": t}, lambda: t

    got, _ = _pruned(p, inputs, program)
    for g in real:
        _close(got[g], ref[g], exact=True)
    if op == "avg":  # NCCL's integer AVG: sum, then divide truncating toward zero
        assert torch.equal(ref[real[0]], torch.stack(inputs).sum(0).div(n, rounding_mode="trunc"))


# ---------------------------------------------------------------------- reduce_scatter
@pytest.mark.parametrize("match_bytes", [True, False], ids=["matched", "compact"])
@pytest.mark.parametrize("op", ["sum", "avg", "max", "premul_sum"])
@pytest.mark.parametrize("n,real", GROUPS, ids=GID)
def test_reduce_scatter(n, real, op, match_bytes):
    rnd = _gen(3)
    inputs = [rnd(n * ROWS, COLS) for _ in range(n)]  # chunk r = rows [r*ROWS, (r+1)*ROWS)
    factor = 1.5 if op == "premul_sum" else None
    p = C.plan_reduce_scatter(n, real, (ROWS, COLS), op, dtype=F64, factor=factor, match_bytes=match_bytes)
    ref = C.reference(p, inputs)

    def program(g):
        inp = inputs[g].clone()
        out = torch.full((ROWS, COLS), float("nan"), dtype=F64)

        def get():
            assert torch.equal(inp, inputs[g])  # the program's input is left as it was
            return out

        return {"input": inp, "output": out}, get

    got, _ = _pruned(p, inputs, program)
    stack = torch.stack(inputs).view(n, n, ROWS, COLS)  # [src, chunk, ...]
    for g in real:
        _close(got[g], ref[g], op in EXACT_OPS)
        direct = {
            "sum": stack[:, g].sum(0),
            "avg": stack[:, g].mean(0),
            "max": stack[:, g].amax(0),
            "premul_sum": (stack[:, g] * 1.5).sum(0),
        }[op]
        _close(ref[g], direct, op in EXACT_OPS)


@pytest.mark.parametrize("n,real", [(4, (1, 3)), (8, (0,))], ids=["n4-r1_3", "n8-r0"])
def test_reduce_scatter_list_form(n, real):
    rnd = _gen(4)
    inputs = [[rnd(ROWS, COLS) for _ in range(n)] for _ in range(n)]
    p = C.plan_reduce_scatter(n, real, (ROWS, COLS), "sum", dtype=F64)
    ref = C.reference(p, inputs)

    def program(g):
        out = torch.empty(ROWS, COLS, dtype=F64)
        return {"input": [t.clone() for t in inputs[g]], "output": [out]}, lambda: out

    got, _ = _pruned(p, inputs, program)
    for g in real:
        _close(got[g], ref[g], exact=False)
        _close(got[g], sum(inputs[s][g] for s in range(n)), exact=False)


# ---------------------------------------------------------------------- all_gather
@pytest.mark.parametrize("form", ["tensor", "list"])
@pytest.mark.parametrize("n,real", GROUPS, ids=GID)
def test_all_gather(n, real, form):
    rnd = _gen(5)
    inputs = [rnd(ROWS, COLS) for _ in range(n)]
    p = C.plan_all_gather(n, real, (ROWS, COLS), dtype=F64)
    ref = C.reference(p, inputs)

    def program(g):
        out = (
            torch.empty(n * ROWS, COLS, dtype=F64)
            if form == "tensor"
            else [torch.empty(ROWS, COLS, dtype=F64) for _ in range(n)]
        )
        return {"input": inputs[g].clone(), "output": out}, (lambda: out if form == "tensor" else torch.cat(out))

    got, _ = _pruned(p, inputs, program)
    for g in real:
        _close(got[g], ref[g], exact=True)
        _close(got[g], torch.cat(inputs), exact=True)


@pytest.mark.parametrize("like_me", [False, True])
@pytest.mark.parametrize(
    "n,real,copies", [(4, (0,), (2, 1)), (4, (1,), (3, 1)), (8, (2, 5), (5, 3)), (4, (3,), (2, 1))]
)
def test_all_gather_output_in_runs(n, real, copies, like_me):
    """The sandbox's all_gather puts the small call's output into the program's with one copy per
    run of chunks that lie one after the other there (a virtual member's part of the proxy's slot
    after the last), or that repeat (like_me, integers: every virtual member holds this member's input): on
    a GPU each copy is a kernel, and four of them at N = 4 were most of a 64 KB call's 9 µs over
    the real one. Checked against the small call's output taken chunk by chunk."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountCopies(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += func is torch.ops.aten.copy_.default
            return func(*args, **(kwargs or {}))

    dt = torch.int64 if like_me else F64  # like_me fills the virtual slots of integers only
    p = C.plan_all_gather(n, real, (ROWS, COLS), dtype=dt)
    G, c, slot = p.group, p.numel, p.slot
    g = real[-1]
    i = G.small(g)
    out = torch.full((n * ROWS, COLS), -1, dtype=dt)
    call = C.sandbox_call(p, g, input=torch.zeros(ROWS, COLS, dtype=dt), output=out, like_me=like_me)
    call.output.copy_(torch.arange(call.output.numel(), dtype=dt))  # as the small call left it
    with CountCopies() as counted:
        call.finish()
    virtual = {v: x for x, v in enumerate(G.virtual)}
    for r in range(n):
        if G.is_real(r):
            at = G.small(r) * slot
        else:
            at = i * slot if like_me else G.proxy * slot + virtual[r] * c
        assert torch.equal(out.view(n, c)[r], call.output[at : at + c]), r
    assert counted.n == copies[like_me]


# ---------------------------------------------------------------------- broadcast, reduce
def _roots(n, real):
    virtual = [g for g in range(n) if g not in real]
    return sorted({real[0], real[-1], virtual[0], virtual[-1]})


@pytest.mark.parametrize("n,real", GROUPS, ids=GID)
def test_broadcast(n, real):
    rnd = _gen(6)
    inputs = [rnd(ROWS, COLS) for _ in range(n)]
    for root in _roots(n, real):
        p = C.plan_broadcast(n, real, (ROWS, COLS), root, dtype=F64)

        def program(g):
            t = inputs[g].clone()
            return {"tensor": t}, lambda: t

        got, proxy = _pruned(p, inputs, program)
        for g in real:
            _close(got[g], inputs[root], exact=True)
        _close(proxy.result, inputs[root], exact=True)  # a real root's data reached the proxy


@pytest.mark.parametrize("op", ["sum", "avg", "max", "premul_sum"])
@pytest.mark.parametrize("n,real", GROUPS, ids=GID)
def test_reduce(n, real, op):
    rnd = _gen(7)
    inputs = [rnd(ROWS, COLS) for _ in range(n)]
    factor = -0.5 if op == "premul_sum" else None
    for root in _roots(n, real):
        p = C.plan_reduce(n, real, (ROWS, COLS), root, op, dtype=F64, factor=factor)
        ref = C.reference(p, inputs)

        def program(g):
            t = inputs[g].clone()
            return {"tensor": t}, lambda: t

        got, proxy = _pruned(p, inputs, program)
        if root in real:
            _close(got[root], ref[root], op in EXACT_OPS)
        else:  # nobody real observes it; the proxy, as the root, holds the logical result
            full = reduce([x.reshape(-1) for x in inputs], op, factor)
            post_reduce(full, op, n)
            _close(proxy.result, full, op in EXACT_OPS)


# ---------------------------------------------------------------------- gather, scatter
@pytest.mark.parametrize("n,real", GROUPS, ids=GID)
def test_gather(n, real):
    rnd = _gen(8)
    inputs = [rnd(ROWS, COLS) for _ in range(n)]
    for root in _roots(n, real):
        p = C.plan_gather(n, real, (ROWS, COLS), root, dtype=F64)

        def program(g):
            out = [torch.empty(ROWS, COLS, dtype=F64) for _ in range(n)] if g == root else None
            return {"input": inputs[g].clone(), "output": out}, lambda: out

        got, proxy = _pruned(p, inputs, program)
        if root in real:
            for s in range(n):
                _close(got[root][s], inputs[s], exact=True)
        for g in real:
            if g != root:
                assert got[g] is None


@pytest.mark.parametrize("n,real", GROUPS, ids=GID)
def test_scatter(n, real):
    rnd = _gen(9)
    inputs = [[rnd(ROWS, COLS) for _ in range(n)] for _ in range(n)]  # member s's scatter list
    for root in _roots(n, real):
        p = C.plan_scatter(n, real, (ROWS, COLS), root, dtype=F64)

        def program(g):
            out = torch.full((ROWS, COLS), float("nan"), dtype=F64)
            return {"input": inputs[g] if g == root else None, "output": out}, lambda: out

        got, _ = _pruned(p, inputs, program)
        for g in real:
            _close(got[g], inputs[root][g], exact=True)


# ---------------------------------------------------------------------- all_to_all
def _splits(n: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(0, 4, (n, n), generator=g)
    s[0, n - 1] = 0  # some empty chunks
    s.fill_diagonal_(2)
    return s.tolist()


@pytest.mark.parametrize("form", ["single", "list"])
@pytest.mark.parametrize("n,real", GROUPS, ids=GID)
def test_all_to_all_uneven(n, real, form):
    rnd = _gen(10)
    splits = _splits(n, 11 + n)
    inputs = [rnd(sum(splits[s]), COLS) for s in range(n)]
    if form == "list":
        inputs = [list(x.split(splits[s])) for s, x in enumerate(inputs)]
    p = C.plan_all_to_all(n, real, splits, row_numel=COLS, dtype=F64)
    ref = C.reference(p, inputs)

    def program(g):
        rows_in = [splits[g][d] for d in range(n)]
        rows_out = [splits[s][g] for s in range(n)]
        if form == "single":
            out = torch.empty(sum(rows_out), COLS, dtype=F64)
            return {"input": inputs[g].clone(), "output": out}, lambda: out
        out = [torch.empty(r, COLS, dtype=F64) for r in rows_out]
        assert [t.shape[0] for t in inputs[g]] == rows_in
        return {"input": [t.clone() for t in inputs[g]], "output": out}, lambda: torch.cat(out)

    got, proxy = _pruned(p, inputs, program)
    flat = [torch.cat(x) if isinstance(x, list) else x for x in inputs]
    for g in real:
        _close(got[g], ref[g], exact=True)
        direct = torch.cat([flat[s].split(splits[s])[g] for s in range(n)])
        _close(got[g], direct, exact=True)
    # the proxy received exactly the real->virtual traffic
    assert proxy.result.numel() == sum(splits[r][v] * COLS for r in real for v in range(n) if v not in real)


@pytest.mark.parametrize("n,real", [(4, (1, 3)), (8, (0, 1))], ids=["n4-r1_3", "n8-r0_1"])
def test_all_to_all_even(n, real):
    rnd = _gen(12)
    inputs = [rnd(n * 2, COLS) for _ in range(n)]
    p = C.plan_all_to_all(n, real, numel=n * 2 * COLS, dtype=F64)

    def program(g):
        out = torch.empty(n * 2, COLS, dtype=F64)
        return {"input": inputs[g].clone(), "output": out}, lambda: out

    got, _ = _pruned(p, inputs, program)
    for g in real:
        _close(got[g], torch.cat([inputs[s][2 * g : 2 * g + 2] for s in range(n)]), exact=True)


# ---------------------------------------------------------------------- send/recv
def test_p2p_virtual_peers():
    """Pipeline-like traffic in a group of 8 with real {2, 5}: real<->virtual both ways,
    real->real, two virtual senders to the same real member with the same tag (the proxy
    must keep the real member's posting order), and a virtual->virtual message (dropped)."""
    n, real = 8, (2, 5)
    msgs = [
        C.Message(1, 2, 6),
        C.Message(2, 3, 4),
        C.Message(2, 5, 5),
        C.Message(4, 5, 3),
        C.Message(6, 5, 3),
        C.Message(5, 6, 2, tag=7),
        C.Message(0, 7, 9),
    ]
    rnd = _gen(13)
    payload = [rnd(m.numel) for m in msgs]
    p = C.plan_p2p(n, real, msgs, dtype=F64)
    assert [len(x) for x in p.p2p] == [3, 4, 5]  # message 6 (0 -> 7) is not instantiated
    assert all(o.message != 6 for ops in p.p2p for o in ops)

    def program(g):
        bufs = {}
        for i, m in enumerate(msgs):
            if m.src == g:
                bufs[i] = payload[i].clone()
            elif m.dst == g:
                bufs[i] = torch.full((m.numel,), float("nan"), dtype=F64)
        return {"tensors": bufs}, lambda: bufs

    virtual_payload = {i: payload[i] for i, m in enumerate(msgs) if m.src not in real}
    G = p.group
    fns = []
    for g in real:

        def sb(pg, g=g):
            kw, get = program(g)
            C.run(pg, C.sandbox_call(p, g, **kw))
            return get()

        fns.append(sb)
    fns.append(lambda pg: C.run(pg, C.proxy_call(p, virtual_payload)))
    res = _spmd(G.size, fns)
    for j, g in enumerate(real):
        for i, m in enumerate(msgs):
            if m.dst == g:
                _close(res[j][i], payload[i], exact=True)


def test_send_recv_single():
    """A real member receives from a virtual peer and sends to another (e.g. one pipeline stage)."""
    n, real = 4, (1,)
    rnd = _gen(14)
    x = rnd(ROWS, COLS)
    recv_plan = C.plan_recv(n, real, 0, 1, (ROWS, COLS), dtype=F64)
    y = torch.empty(ROWS, COLS, dtype=F64)
    _spmd(
        2,
        [
            lambda pg: C.run(pg, C.sandbox_call(recv_plan, 1, tensor=y)),
            lambda pg: C.run(pg, C.proxy_call(recv_plan, {0: x})),
        ],
    )  # message 0: 0 -> 1
    _close(y, x, exact=True)
    send_plan = C.plan_send(n, real, 1, 2, (ROWS, COLS), dtype=F64)
    assert send_plan.p2p == ((C.P2POp("send", 1, 0),), (C.P2POp("recv", 0, 0),))
    fns = [
        lambda pg: C.run(pg, C.sandbox_call(send_plan, 1, tensor=x.clone())),
        lambda pg: C.run(pg, C.proxy_call(send_plan, {})),
    ]
    _spmd(2, fns)
    assert send_plan.bytes[1] == C.LinkBytes(x.numel() * 8, 0, x.numel() * 8, 0)


def test_barrier():
    p = C.plan_barrier(4, (0, 2))
    _spmd(
        3, [lambda pg, g=g: C.run(pg, C.sandbox_call(p, g)) for g in (0, 2)] + [lambda pg: C.run(pg, C.proxy_call(p))]
    )


# ---------------------------------------------------------------------- generated virtual inputs
def _pruned_generated(p: C.Plan, program, bufs: C.GeneratedBuffers | None = None) -> dict:
    """Run plan ``p`` with generated virtual inputs: the proxy's kept buffers (``bufs``: kept from an
    earlier call), the real members' ``like_me`` post steps."""
    bufs = bufs or C.GeneratedBuffers()
    fns = []
    for g in p.group.real:

        def sb(pg, g=g):
            kwargs, get = program(g)
            C.run(pg, C.sandbox_call(p, g, like_me=True, **kwargs))
            return get()

        fns.append(sb)
    fns.append(lambda pg: C.run(pg, C.generated_proxy_call(p, bufs)))
    return dict(zip(p.group.real, _spmd(p.group.size, fns)[:-1]))


@pytest.mark.parametrize("op", ["sum", "avg", "max", "min", "premul_sum", "product"])
@pytest.mark.parametrize("n,real", [(4, (0,)), (8, (2, 5, 6)), (8, (7,))], ids=["n4-r0", "n8-r2_5_6", "n8-r7"])
def test_generated_inputs_answer_as_if_every_member_held_the_real_ones(n, real, op):
    """Without recorded inputs the sandbox sees the group's result as if every virtual member
    held what the real members hold (their mean), as solo capture's generator answers: a sum
    keeps the group's magnitude (n/k times the real members' sum), not the k/n share that zeros
    from the virtual members leave (which drove a vocabulary-parallel loss negative)."""
    rnd = _gen(15)
    own = {g: rnd(ROWS, COLS) for g in real}
    mean = sum(own.values()) / len(real)
    like_me = [own.get(g, mean) for g in range(n)]
    factor = 0.25 if op == "premul_sum" else None
    p = C.plan_all_reduce(n, real, (ROWS, COLS), op, dtype=F64, factor=factor)

    def program(g):
        t = own[g].clone()
        return {"tensor": t}, lambda: t

    bufs = C.GeneratedBuffers()
    got = _pruned_generated(p, program, bufs)
    again = _pruned_generated(p, program, bufs)  # the kept buffers a second time: the same answer
    for g in real:
        _close(again[g], got[g], exact=True)
    # a product is the generator's "input unchanged" for one real member: the reals' product
    ref = C.reference(
        p, [own.get(g, torch.ones(ROWS, COLS, dtype=F64)) for g in range(n)] if op == "product" else like_me
    )
    for g in real:
        _close(got[g], ref[g], op in EXACT_OPS)
    # reduce-scatter and reduce (real root) scale the same way
    rs = C.plan_reduce_scatter(n, real, (ROWS, COLS), "sum", dtype=F64)
    rs_in = {g: rnd(n * ROWS, COLS) for g in real}
    rs_mean = sum(rs_in.values()) / len(real)
    ref = C.reference(rs, [rs_in.get(g, rs_mean) for g in range(n)])

    def rs_program(g):
        out = torch.empty(ROWS, COLS, dtype=F64)
        return {"input": rs_in[g].clone(), "output": out}, lambda: out

    for g, got_g in _pruned_generated(rs, rs_program).items():
        _close(got_g, ref[g], exact=False)


def test_generated_inputs_of_gathers_broadcasts_and_exchanges():
    """all_gather: every virtual slot holds the member's own input where it is an integer (counts,
    sizes: values that decide shapes); where it is a float, what the real member gave the first
    all_gather of that size (zeros in that one: on a GPU, matrix products over zeros run faster
    than over real data, so a slice of FSDP2 fed zeros ran faster than the real job); a
    broadcast from a virtual root leaves the member's own copy (uninitialised values cleaned),
    virtual members send zeros (all_to_all, recv)."""
    n, real = 4, (1,)
    rnd = _gen(16)
    x = rnd(ROWS, COLS)
    ag = C.plan_all_gather(n, real, (ROWS, COLS), dtype=F64)

    def ag_program(g):
        out = torch.full((n * ROWS, COLS), float("nan"), dtype=F64)
        return {"input": x.clone(), "output": out}, lambda: out

    zero = torch.zeros_like(x)
    bufs = C.GeneratedBuffers()
    _close(_pruned_generated(ag, ag_program, bufs)[1], torch.cat([zero, x, zero, zero]), exact=True)
    first, x = x, rnd(ROWS, COLS)
    _close(_pruned_generated(ag, ag_program, bufs)[1], torch.cat([first, x, first, first]), exact=True)
    x = rnd(ROWS, COLS)  # echoed once a buffer: a third call still sees the first's
    _close(_pruned_generated(ag, ag_program, bufs)[1], torch.cat([first, x, first, first]), exact=True)
    # a buffer gone past the kept limit is made anew: zeros again, then the echo of its first call
    small = C.GeneratedBuffers(limit_bytes=9 * ROWS * COLS * 8)  # the call's input (3 chunks) and output (6)
    _pruned_generated(ag, ag_program, small)
    small.begin()
    small.kept("other", 9 * ROWS * COLS, F64)  # another call's: both of the first call's buffers go
    first, x = x, rnd(ROWS, COLS)
    _close(_pruned_generated(ag, ag_program, small)[1], torch.cat([zero, x, zero, zero]), exact=True)
    first, x = x, rnd(ROWS, COLS)
    _close(_pruned_generated(ag, ag_program, small)[1], torch.cat([first, x, first, first]), exact=True)
    # one virtual member, the program's output gathered in place: the same
    ag2 = C.plan_all_gather(2, (0,), (ROWS, COLS), dtype=F64)

    def ag2_program(g):
        out = torch.full((2 * ROWS, COLS), float("nan"), dtype=F64)
        return {"input": x.clone(), "output": out}, lambda: out

    bufs = C.GeneratedBuffers()
    _pruned_generated(ag2, ag2_program, bufs)
    _close(_pruned_generated(ag2, ag2_program, bufs)[0], torch.cat([x, x]), exact=True)
    counts = torch.tensor([3, 1, 4], dtype=torch.int64)
    agi = C.plan_all_gather(n, real, (3,), dtype=torch.int64)

    def agi_program(g):
        out = torch.full((n * 3,), -1, dtype=torch.int64)
        return {"input": counts.clone(), "output": out}, lambda: out

    assert torch.equal(_pruned_generated(agi, agi_program)[1], counts.repeat(n))
    bc = C.plan_broadcast(n, real, (ROWS, COLS), 0, dtype=F64)

    def bc_program(g):
        t = x.clone()
        return {"tensor": t}, lambda: t

    _close(_pruned_generated(bc, bc_program)[1], x, exact=True)  # its own copy, as a replica's
    bad = torch.tensor([1.0, float("nan"), float("inf")], dtype=F64)
    bc3 = C.plan_broadcast(n, real, (3,), 0, dtype=F64)

    def bad_program(g):
        t = bad.clone()
        return {"tensor": t}, lambda: t

    _close(_pruned_generated(bc3, bad_program)[1], torch.tensor([1.0, 0.0, 0.0], dtype=F64), exact=True)
    a2a = C.plan_all_to_all(n, real, numel=n * 2 * COLS, dtype=F64)

    def a2a_program(g):
        out = torch.full((n * 2, COLS), float("nan"), dtype=F64)
        return {"input": rnd(n * 2, COLS), "output": out}, lambda: out

    got = _pruned_generated(a2a, a2a_program)[1]
    assert torch.equal(got[:2], torch.zeros(2, COLS, dtype=F64)) and torch.equal(
        got[4:], torch.zeros(4, COLS, dtype=F64)
    )
    rv = C.plan_recv(n, real, 0, 1, (ROWS, COLS), dtype=F64)

    def rv_program(g):
        y = torch.full((ROWS, COLS), float("nan"), dtype=F64)
        return {"tensor": y}, lambda: y

    _close(_pruned_generated(rv, rv_program)[1], torch.zeros(ROWS, COLS, dtype=F64), exact=True)


# ---------------------------------------------------------------------- naive plans fail
def _naive_all_reduce(n, real, inputs, small_op_div):
    """Proxy sends the virtual sum, the small comm 'averages' over its own k+1 members."""
    k = len(real)
    vsum = sum(inputs[v] for v in range(n) if v not in real).reshape(-1)
    fns = []
    for g in real:

        def sb(pg, g=g):
            t = inputs[g].clone().reshape(-1)
            C.run(pg, C.SmallCall("all_reduce", 0, reduce_op="sum", input=t, output=t))
            return t / small_op_div(k)

        fns.append(sb)
    fns.append(
        lambda pg: C.run(pg, C.SmallCall("all_reduce", k, reduce_op="sum", input=vsum.clone(), output=vsum.clone()))
    )
    return _spmd(k + 1, fns)[:-1]


def test_naive_avg_over_small_group_is_wrong():
    n, real = 8, (1, 3)
    rnd = _gen(20)
    inputs = [rnd(ROWS, COLS) for _ in range(n)]
    good = torch.stack(inputs).mean(0).reshape(-1)
    naive = _naive_all_reduce(n, real, inputs, lambda k: k + 1)  # NCCL AVG on the small comm
    assert not torch.allclose(naive[0], good)
    right = _naive_all_reduce(n, real, inputs, lambda k: n)  # the plan's post step: / n
    torch.testing.assert_close(right[0], good, rtol=1e-12, atol=1e-12)


def test_naive_full_value_double_counts():
    """The proxy sending the full logical value (not full - sandbox) double counts the real members."""
    n, real = 4, (1, 3)
    rnd = _gen(21)
    inputs = [rnd(6) for _ in range(n)]
    full = torch.stack(inputs).sum(0)
    fns = [
        lambda pg, g=g: (
            C.run(pg, C.SmallCall("all_reduce", 0, reduce_op="sum", input=inputs[g].clone(), output=None)).input
        )
        for g in real
    ]
    fns.append(lambda pg: C.run(pg, C.SmallCall("all_reduce", 2, reduce_op="sum", input=full.clone())).input)
    out = _spmd(3, fns)
    assert not torch.allclose(out[0], full)
    torch.testing.assert_close(out[0], full + inputs[1] + inputs[3], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "op,like_me,premul,template",
    [
        ("sum", False, False, True),  # gloo's sum of recorded gradients: the program's tensors alone
        ("max", False, False, True),
        ("avg", False, False, False),  # divided by n after the call
        ("sum", True, False, False),  # scaled by n / k after the call
        ("avg", False, True, True),  # NCCL: the division inside the call (PREMUL_SUM)
        ("sum", True, True, True),
    ],
)
def test_a_reduce_scatter_with_nothing_after_it_has_a_lane_template(op, like_me, premul, template):
    """One virtual member, no padding: the small reduce-scatter reads the program's input and
    writes its output in place. Where no step follows it, the native lane can issue it again from
    a template (FSDP2's gradient reduce-scatters); where one does, it cannot."""
    p = C.plan_reduce_scatter(2, (1,), (ROWS, COLS), op, dtype=F64)
    inp, out = torch.zeros(2 * ROWS, COLS, dtype=F64), torch.zeros(ROWS, COLS, dtype=F64)
    call = C.sandbox_call(p, 1, input=inp, output=out, like_me=like_me, premul=premul)
    got = C.lane_template(call, [out, inp])
    assert (got is not None) == template, (call.post, got)
    if template:
        kind, red, factor, _root, in_role, out_role, pad = got
        assert kind == "reduce_scatter" and pad is None
        assert in_role == (1, 0, inp.numel()) and out_role == (0, 0, out.numel())
        assert (red == int(dist.ReduceOp.RedOpType.PREMUL_SUM.value)) == premul


def test_naive_reduce_scatter_layout_is_wrong():
    """Naive layout: small rank j reduces logical chunk j (as if the small comm were the group)."""
    n, real = 4, (1, 3)
    k = len(real)
    rnd = _gen(22)
    inputs = [rnd(n * 2) for _ in range(n)]
    ch = [x.view(n, 2) for x in inputs]
    p = C.plan_reduce_scatter(n, real, 2, "sum", dtype=F64, match_bytes=False)
    ref = C.reference(p, inputs)
    fns = []
    for j, g in enumerate(real):
        fns.append(
            lambda pg, g=g, j=j: (
                C.run(
                    pg,
                    C.SmallCall(
                        "reduce_scatter",
                        j,
                        reduce_op="sum",
                        input=ch[g][: k + 1].reshape(-1).clone(),
                        output=torch.empty(2, dtype=F64),
                    ),
                ).output
            )
        )
    vin = sum(ch[v][: k + 1] for v in range(n) if v not in real).reshape(-1)
    fns.append(
        lambda pg: (
            C.run(
                pg, C.SmallCall("reduce_scatter", k, reduce_op="sum", input=vin, output=torch.empty(2, dtype=F64))
            ).output
        )
    )
    out = _spmd(k + 1, fns)
    for j, g in enumerate(real):
        assert not torch.allclose(out[j], ref[g])


def test_naive_all_gather_order_is_wrong():
    """Taking the small all_gather's output in small-rank order (no re-ordering of slots)."""
    n, real = 4, (1, 3)
    rnd = _gen(23)
    inputs = [rnd(2) for _ in range(n)]
    p = C.plan_all_gather(n, real, 2, dtype=F64)
    calls = {}

    def sb(pg, g):
        out = torch.empty(n * 2, dtype=F64)
        call = C.sandbox_call(p, g, input=inputs[g].clone(), output=out)
        for w in C.issue(pg, call):
            w.wait()
        calls[g] = call
        return out

    fns = [lambda pg, g=g: sb(pg, g) for g in real]
    fns.append(lambda pg: C.run(pg, C.proxy_call(p, [None if g in real else inputs[g] for g in range(n)])))
    _spmd(3, fns)
    slot = p.slot
    raw = calls[1].output  # no finish(): slots in small-rank order, padded
    naive = torch.cat([raw[j * slot : j * slot + 2] for j in range(2)] + [raw[2 * slot : 2 * slot + 4]])
    assert not torch.equal(naive, torch.cat(inputs))
    calls[1].finish()  # the plan's post step puts the slots in logical order


def test_naive_all_to_all_without_permutation_is_wrong():
    n, real = 4, (1, 3)
    splits = _splits(n, 30)
    rnd = _gen(24)
    inputs = [rnd(sum(splits[s])) for s in range(n)]
    p = C.plan_all_to_all(n, real, splits, dtype=F64)
    ref = C.reference(p, inputs)
    # naive: send the program's input as is with the small splits
    fns = []
    for j, g in enumerate(real):

        def sb(pg, g=g, j=j):
            out = torch.empty(sum(p.small_recv[j]), dtype=F64)
            call = C.SmallCall(
                "all_to_all",
                j,
                input=inputs[g].clone(),
                output=out,
                in_splits=list(p.small_send[j]),
                out_splits=list(p.small_recv[j]),
            )
            return C.run(pg, call).output

        fns.append(sb)
    fns.append(lambda pg: C.run(pg, C.proxy_call(p, [None if g in real else inputs[g] for g in range(n)])))
    out = _spmd(3, fns)
    assert any(not torch.equal(out[j], ref[g]) for j, g in enumerate(real))


# ---------------------------------------------------------------------- bytes and plans
@pytest.mark.parametrize("n,real", GROUPS, ids=GID)
def test_bytes(n, real):
    k = len(real)
    it = 8
    ar = C.plan_all_reduce(n, real, 1 << 16, "sum", dtype=F64)
    rs = C.plan_reduce_scatter(n, real, 1 << 12, "sum", dtype=F64)
    ag = C.plan_all_gather(n, real, 1 << 12, dtype=F64)
    rs_c = C.plan_reduce_scatter(n, real, 1 << 12, "sum", dtype=F64, match_bytes=False)
    ar_c = C.plan_all_reduce(n, real, 1 << 16, "sum", dtype=F64, match_bytes=False)
    for g in real:
        b = ar.bytes[g]
        assert b.logical_send == round(2 * (n - 1) / n * (1 << 16) * it)
        assert 0 <= b.send - b.logical_send <= 2 * it  # matched to an element
        b = rs.bytes[g]
        assert b.logical_send == (n - 1) * (1 << 12) * it and 0 <= b.send - b.logical_send < k * it
        assert rs_c.bytes[g].send == k * (1 << 12) * it
        assert ar_c.bytes[g].send == round(2 * k / (k + 1) * (1 << 16) * it) and ar_c.pad == 0
        assert ag.bytes[g].send == k * (n - k) * (1 << 12) * it
        assert ag.bytes[g].ratio == pytest.approx(k * (n - k) / (n - 1))
    assert ar.pad == 0 if k == n - 1 else ar.pad > 0
    # exact-bytes plans
    splits = _splits(n, 40)
    a2a = C.plan_all_to_all(n, real, splits, row_numel=3, dtype=F64)
    for root in _roots(n, real):
        for pl in (C.plan_gather(n, real, 10, root), C.plan_scatter(n, real, 10, root), a2a):
            for g in real:
                b = pl.bytes[g]
                assert (b.send, b.recv) == (b.logical_send, b.logical_recv)
    root_gather = C.plan_gather(n, real, 10, real[0], dtype=F64)
    assert root_gather.bytes[real[0]].recv == (n - 1) * 10 * 8


def test_plan_dispatch_and_validation():
    assert C.plan("all_reduce", 4, [1], 8, "avg") == C.plan_all_reduce(4, [1], 8, "avg")
    assert C.plan("reduce_scatter", 4, [2], 8, dist.ReduceOp.MAX).small_reduce_op == "max"
    p = C.plan("all_reduce", 4, (3, 1), 8, "avg")
    assert p.group.real == (1, 3) and p.small_reduce_op == "sum"
    assert p.group.small(0) == p.group.proxy == 2 and p.group.small(3) == 1
    for bad in ([0, 1, 2, 3], [], [4], [1, 1]):
        with pytest.raises(C.PruningError):
            C.Pruned(4, tuple(bad))
    with pytest.raises(C.PruningError):
        C.plan_all_reduce(4, [0], 8, "premul_sum")  # no factor
    with pytest.raises(C.PruningError):
        C.plan("all_reduce_coalesced", 4, [0], 8)
    with pytest.raises(C.PruningError):
        C.proxy_call(C.plan_all_reduce(4, [0], 2), [None, torch.zeros(2), None, torch.zeros(2)])
    assert "reduce_scatter(sum) n=8 real=[1]" in C.describe(C.plan_reduce_scatter(8, [1], 4))


def test_all_reduce_bfloat16_sum():
    """Low precision: the proxy's partial sum is accumulated in float32 and rounded once."""
    n, real = 8, (3,)
    rnd = _gen(50)
    inputs = [rnd(64, dtype=torch.bfloat16) for _ in range(n)]
    p = C.plan_all_reduce(n, real, 64, "sum", dtype=torch.bfloat16)

    def program(g):
        t = inputs[g].clone()
        return {"tensor": t}, lambda: t

    got, _ = _pruned(p, inputs, program)
    exact = torch.stack([x.double() for x in inputs]).sum(0)
    torch.testing.assert_close(got[3].double(), exact, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("n,real", GROUPS, ids=GID)
def test_all_to_all_plans_from_each_sides_own_splits(n, real):
    """In emulation no side knows the whole split matrix: a sandbox member knows its own
    in/out splits (row and column), the proxy the virtual members' (from the graph). The plans
    each side builds from that (`splits_matrix`) give it the same small call as the full plan."""
    full = _splits(n, 31 + n)
    ref = C.plan_all_to_all(n, real, full, row_numel=COLS, dtype=F64)
    G = ref.group
    for i, g in enumerate(G.real):
        col = [full[s][g] for s in range(n)]
        p = C.plan_all_to_all(n, real, C.splits_matrix(n, {g: full[g]}, {g: col}), row_numel=COLS, dtype=F64)
        assert p.small_send[i] == ref.small_send[i] and p.small_recv[i] == ref.small_recv[i]
        assert p.splits[g] == ref.splits[g] and [r[g] for r in p.splits] == [r[g] for r in ref.splits]
    vs = G.virtual
    p = C.plan_all_to_all(
        n,
        real,
        C.splits_matrix(n, {v: full[v] for v in vs}, {v: [full[s][v] for s in range(n)] for v in vs}),
        row_numel=COLS,
        dtype=F64,
    )
    assert p.small_send[G.proxy] == ref.small_send[G.proxy]
    assert p.small_recv[G.proxy] == ref.small_recv[G.proxy]
    assert all(p.splits[v] == ref.splits[v] for v in vs)


def test_splits_matrix_rejects_members_that_disagree():
    with pytest.raises(C.PruningError, match="member 0 sends 3 rows to member 1, which expects 2"):
        C.splits_matrix(2, {0: [1, 3]}, {1: [2, 1]})
    with pytest.raises(C.PruningError, match="2 input splits for a group of 3"):
        C.splits_matrix(3, {0: [1, 3]})


def test_plan_once_reuses_a_plan_per_distinct_arguments():
    """The sandbox plans every pruned call on its critical path: plan_once hands back the same
    (frozen) plan for the same arguments -- a torch.Size and a tuple of the same shape alike --
    a new one when any argument differs, and plans afresh what cannot be hashed."""
    G = C.Pruned(4, (1,))
    a = C.plan_once(C.plan_all_reduce, 4, G, torch.Size([ROWS, COLS]), "sum", dtype=F64)
    assert C.plan_once(C.plan_all_reduce, 4, G, (ROWS, COLS), "sum", dtype=F64) is a
    assert a == C.plan_all_reduce(4, G, (ROWS, COLS), "sum", dtype=F64)
    for other in [
        C.plan_once(C.plan_all_reduce, 4, G, (ROWS, COLS), "max", dtype=F64),
        C.plan_once(C.plan_all_reduce, 4, G, (ROWS, COLS), "sum", dtype=torch.float32),
        C.plan_once(C.plan_all_reduce, 4, C.Pruned(4, (2,)), (ROWS, COLS), "sum", dtype=F64),
        C.plan_once(C.plan_all_reduce, 8, C.Pruned(8, (1,)), (ROWS, COLS), "sum", dtype=F64),
    ]:
        assert other is not a and other != a
    sp = _splits(4, 7)  # lists: unhashable, planned each time, still right
    p = C.plan_once(C.plan_all_to_all, 4, G, sp, row_numel=COLS, dtype=F64)
    assert p == C.plan_all_to_all(4, G, sp, row_numel=COLS, dtype=F64)
    with pytest.raises(C.PruningError):  # errors are raised, not cached
        C.plan_once(C.plan_all_reduce, 4, G, (ROWS, COLS), "no-such-op", dtype=F64)


# ---------------------------------------------------------------------- scratch from an arena
class _CheckingArena:
    """A stand-in for prismllm.comm.scratch.DeviceArena on the CPU: hands out buffers full of
    garbage unless asked for zeros, and counts what is taken and given back."""

    def __init__(self):
        self.taken, self.out = 0, {}
        self.lock = threading.Lock()

    def take(self, numel, dtype, zero=False):
        t = torch.zeros(numel, dtype=dtype) if zero else torch.full((numel,), 7, dtype=dtype)
        with self.lock:
            self.taken += 1
            self.out[t.data_ptr()] = t
        return t

    def give_back(self, buffers):
        with self.lock:
            for b in buffers:
                del self.out[b.data_ptr()]


@pytest.mark.parametrize("op", ["all_reduce", "reduce_scatter", "all_gather", "all_to_all", "reduce"])
def test_sandbox_buffers_come_from_the_arena_and_go_back(op):
    """On a GPU the sandbox's own buffers come from an arena outside PyTorch's allocator
    (so the program's peak memory is its own): each op's results stay right with buffers that
    start as garbage, every buffer taken is given back by ``finish``, and the arena is used."""
    n, real = 4, (1, 3)
    rnd = _gen(20)
    arena = _CheckingArena()
    if op == "all_reduce":
        inputs = [rnd(ROWS, COLS) for _ in range(n)]
        p = C.plan_all_reduce(n, real, (ROWS, COLS), "sum", dtype=F64)

        def program(g):
            t = inputs[g].clone()
            return {"tensor": t}, lambda: t
    elif op == "reduce":
        inputs = [rnd(ROWS, COLS) for _ in range(n)]
        p = C.plan_reduce(n, real, (ROWS, COLS), 1, "premul_sum", dtype=F64, factor=0.5)

        def program(g):
            t = inputs[g].clone()
            return {"tensor": t}, lambda: t
    elif op == "reduce_scatter":
        inputs = [rnd(n * ROWS, COLS) for _ in range(n)]
        p = C.plan_reduce_scatter(n, real, (ROWS, COLS), "sum", dtype=F64)

        def program(g):
            out = torch.empty(ROWS, COLS, dtype=F64)
            return {"input": inputs[g].clone(), "output": out}, lambda: out
    elif op == "all_gather":
        inputs = [rnd(ROWS, COLS) for _ in range(n)]
        p = C.plan_all_gather(n, real, (ROWS, COLS), dtype=F64)

        def program(g):
            out = torch.empty(n * ROWS, COLS, dtype=F64)
            return {"input": inputs[g].clone(), "output": out}, lambda: out
    else:
        splits = _splits(n, 21)
        inputs = [rnd(sum(splits[s]), COLS) for s in range(n)]
        p = C.plan_all_to_all(n, real, splits, row_numel=COLS, dtype=F64)

        def program(g):
            out = torch.empty(sum(splits[s][g] for s in range(n)), COLS, dtype=F64)
            return {"input": inputs[g].clone(), "output": out}, lambda: out

    ref = C.reference(p, inputs)
    got, _ = _pruned(p, inputs, program, scratch=lambda device: arena)
    for g in real:
        if ref[g] is not None:  # reduce: the root's result only
            _close(got[g], ref[g], exact=False)
    assert arena.taken > 0, f"{op}: no buffer came from the arena"
    assert not arena.out, f"{op}: {len(arena.out)} buffer(s) never given back"


@pytest.mark.parametrize("like_me", [False, True], ids=["recorded", "generated"])
@pytest.mark.parametrize("op", ["sum", "avg", "premul_sum", "max"])
@pytest.mark.parametrize("n,real", [(4, (0,)), (8, (2, 5, 6))], ids=["n4-r0", "n8-r2_5_6"])
def test_premul_factors_give_the_logical_result(n, real, op, like_me):
    """NCCL's pre-multiplied sum (each member scales its own contribution; gloo has none, so the
    arithmetic is checked here and the call on the GPU tests): the real members' factor times
    their inputs plus the proxy's factor times its buffer is the logical result, with recorded
    inputs (the proxy's buffer: its reduction of the virtual inputs) and with generated ones (the
    group as if every virtual member held the real members' mean; the proxy's buffer, whatever
    it holds, counts for nothing)."""
    rnd = _gen(17)
    inputs = [rnd(ROWS, COLS) for _ in range(n)]
    factor = 0.25 if op == "premul_sum" else None
    p = C.plan_all_reduce(n, real, (ROWS, COLS), op, dtype=F64, factor=factor)
    f = C.premul_factors(p, like_me)
    if op == "max" or (op == "sum" and not like_me):
        assert f is None  # a plain SUM (or MAX) is already right
        return
    own = sum(inputs[g] for g in real)
    if like_me:
        mean = own / len(real)
        expect = C.reference(p, [inputs[g] if g in real else mean for g in range(n)])[real[0]]
        proxy_buf = torch.full_like(own, 1e30)  # anything: its factor is 0
    else:
        expect = C.reference(p, inputs)[real[0]]
        proxy_buf = reduce([inputs[v].reshape(-1) for v in range(n) if v not in real], op, factor).view(own.shape)
    _close(f[0] * own + f[1] * proxy_buf, expect, exact=False)


@pytest.mark.parametrize("factor", [2.0, 1.0, 0.5, 0.25, 1 / 3, 4 / 3, 0.0])
def test_a_bf16_premul_factor_reads_as_itself_both_ways(factor):
    """ProcessGroupNCCL (torch 2.11) hands NCCL a bfloat16 PREMUL_SUM's factor as a float of which
    NCCL reads the first two bytes: every factor exact in bfloat16 read as zero, and a sandbox's
    bf16 gradients came back all zeros. The scalar prismllm hands over reads as bf16(factor) that
    way and rounded to bfloat16 as a fixed ProcessGroupNCCL rounds it; other dtypes keep theirs."""
    s = C.nccl_premul_scalar(factor, torch.bfloat16)
    low_half = int.from_bytes(struct.pack("<f", s)[:2], "little")
    read_by_nccl = torch.tensor([low_half], dtype=torch.int16).view(torch.bfloat16).item()
    rounded = torch.tensor(s, dtype=torch.float32).to(torch.bfloat16).item()
    want = torch.tensor(factor, dtype=torch.float32).to(torch.bfloat16).item()
    assert read_by_nccl == want and rounded == want, (s, read_by_nccl, rounded, want)
    assert C.nccl_premul_scalar(factor, torch.float16) == factor
    assert C.nccl_premul_scalar(factor, torch.float32) == factor


def test_a_bf16_plans_factors_are_handed_over_readable():
    """The sandbox's like-me factor (n / k) and the proxy's factors of a bf16 all-reduce go
    through nccl_premul_scalar; the program's own PREMUL_SUM factor goes as the program gave it."""
    bf16 = torch.bfloat16
    p = C.plan_all_reduce(4, (0,), (ROWS, COLS), "sum", dtype=bf16)
    assert C.premul_factors(p, like_me=True) == (C.nccl_premul_scalar(4.0, bf16), 0.0)
    p = C.plan_all_reduce(4, (0,), (ROWS, COLS), "premul_sum", dtype=bf16, factor=0.5)
    assert C.premul_factors(p, like_me=False) == (0.5, C.nccl_premul_scalar(1.0, bf16))


def test_generated_buffers_keep_at_most_their_limit():
    """The proxy keeps its generated buffers for reuse, the least recently used going past the
    limit, but never one of the call being made: a call whose own buffers exceed the limit keeps
    them all, and the next such call finds them (an 8 GB all_gather at N = 4 made its 18 GB anew
    each call and ran an H200 out of memory with 16 calls in flight)."""
    bufs = C.GeneratedBuffers(limit_bytes=3 * 1024 * 8)

    def one_call(role: str, fill=None) -> torch.Tensor:
        bufs.begin()
        return bufs.kept(role, 1024, F64, fill)

    a = one_call("zeros", 0)
    assert one_call("zeros", 0) is a  # kept
    one_call("recv")
    one_call("zeros", 0)  # used again: the most recent
    one_call("all_gather.out")
    one_call("x")  # a fourth: the least recently used ("recv") goes
    assert bufs.nbytes == 3 * 1024 * 8
    assert one_call("zeros", 0) is a
    assert torch.equal(a, torch.zeros(1024, dtype=F64))
    # one call's input and output, together over the limit: both kept, the others gone
    big = C.plan_all_gather(4, (0,), (1024,), dtype=F64)  # the proxy's input 3 chunks, output 2 x 3
    first = C.generated_proxy_call(big, bufs)
    assert first.post is not None and bufs.nbytes == 9 * 1024 * 8 > bufs.limit_bytes
    again = C.generated_proxy_call(big, bufs)
    assert again.input is first.input and again.output is first.output
    assert again.post is None  # found, so not echoed again
    bufs.begin()
    bufs.kept("zeros", 1024, F64, 0)  # a later call's buffer: the big call's go (least recent)
    assert bufs.nbytes == 1024 * 8
