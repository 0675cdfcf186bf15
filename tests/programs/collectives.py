"""Every public torch.distributed API once, on the default group and on sub-groups.

Run with 4 ranks on gloo (CPU). The program checks every result itself (recording must not
change values) and prints "COLLECTIVES OK" at the end. ``tests/test_recording.py`` asserts
the node rows it produces; keep the two in step (the order of calls below is the order of
the expected rows there).

Groups: "0" default; new_group([0, 2]) -> "1"; new_group([1, 3]) -> "2";
new_subgroups(2) -> "3" ([0, 1]) and "4" ([2, 3]).
Iterations: 0 = set-up + phase A (default group), ended by an optimizer step;
1 = phase B (sub-groups), ended by an optimizer step; 2 = phase C, ended by prismllm.step();
3 = the tail (an optimizer step there no longer counts: the program called step()).
"""

import pickle

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.distributed_c10d import _coalescing_manager

import prismllm.api as prism

dist.init_process_group("gloo")
rank = dist.get_rank()
n = dist.get_world_size()
assert n == 4, "run with 4 ranks"
W = dist.group.WORLD

g_even = dist.new_group([0, 2])
g_odd = dist.new_group([1, 3])
g_pair, _ = dist.new_subgroups(2)
assert dist.get_backend() == "gloo" and dist.get_backend(g_pair) == "gloo"

model = torch.nn.Linear(2, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)


def optimizer_step():
    model.zero_grad()
    model(torch.ones(1, 2)).sum().backward()
    opt.step()


def close(a, b):
    assert torch.allclose(a, b), (a, b)


def split(r, j):  # rows rank r sends to rank j in the uneven all_to_all
    return r + j + 1


R = torch.arange(n, dtype=torch.float32)  # rank values
ar = lambda x: float(sum(range(1, n + 1))) * x  # noqa: E731  sum over ranks of (rank+1)*x

# ---------------- phase A: default group (iteration 0) ----------------
t = torch.full((4,), rank + 1.0)
dist.all_reduce(t)  # 1 sync sum
close(t, torch.full((4,), 10.0))

t = torch.full((4,), rank + 1.0)
w = dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True)  # 2 async max
busy = torch.randn(64, 64) @ torch.randn(64, 64)
w.wait()
close(t, torch.full((4,), 4.0))

t = torch.full((2,), rank + 1.0)
dist.all_reduce(t, op=dist.ReduceOp.MIN)  # 3
close(t, torch.full((2,), 1.0))
t = torch.full((2,), rank + 1.0, dtype=torch.float64)
dist.all_reduce(t, op=dist.ReduceOp.PRODUCT)  # 4
close(t, torch.full((2,), 24.0, dtype=torch.float64))

outs = [torch.empty(3) for _ in range(n)]
dist.all_gather(outs, torch.full((3,), float(rank)))  # 5
for j in range(n):
    close(outs[j], torch.full((3,), float(j)))

out = torch.empty(n * 3)
dist.all_gather_into_tensor(out, torch.full((3,), float(rank)))  # 6
close(out, R.repeat_interleave(3))

try:  # refused by the backend before any communication: must leave no row
    dist.all_gather_into_tensor(torch.empty(n * 3 + 1), torch.full((3,), float(rank)))
except (RuntimeError, ValueError):
    pass
else:
    raise AssertionError("gloo accepted a mis-sized all_gather_into_tensor")

out = torch.empty(2)
dist.reduce_scatter_tensor(out, torch.arange(2.0 * n) + rank)  # 7
close(out, 4 * torch.arange(2.0 * rank, 2.0 * rank + 2) + 6)

out = torch.empty(2)
dist.reduce_scatter(out, [torch.full((2,), float(j + rank)) for j in range(n)])  # 8
close(out, torch.full((2,), float(4 * rank + 6)))

in_sp = [split(rank, j) for j in range(n)]
out_sp = [split(j, rank) for j in range(n)]
inp = torch.cat([torch.full((split(rank, j), 2), float(10 * rank + j)) for j in range(n)])
out = torch.empty(sum(out_sp), 2)
dist.all_to_all_single(out, inp, out_sp, in_sp)  # 9 uneven
close(out, torch.cat([torch.full((split(j, rank), 2), float(10 * j + rank)) for j in range(n)]))

out = torch.empty(n)
dist.all_to_all_single(out, torch.arange(n, dtype=torch.float32) + 10 * rank)  # 10 even
close(out, 10 * R + rank)

outs = [torch.empty(1) for _ in range(n)]
try:
    dist.all_to_all(outs, [torch.full((1,), float(10 * rank + j)) for j in range(n)])  # 11
except RuntimeError as e:  # gloo has no alltoall before torch 2.13; no row may be recorded
    if "does not support alltoall" not in str(e):
        raise
    print("ALLTOALL UNSUPPORTED")
else:
    for j in range(n):
        close(outs[j], torch.full((1,), float(10 * j + rank)))

t = torch.full((5,), float(rank))
dist.broadcast(t, src=2)  # 12
close(t, torch.full((5,), 2.0))

t = torch.full((5,), float(rank))
dist.reduce(t, dst=1)  # 13
if rank == 1:
    close(t, torch.full((5,), 6.0))

gl = [torch.empty(2) for _ in range(n)] if rank == 3 else None
dist.gather(torch.full((2,), float(rank)), gl, dst=3)  # 14
if rank == 3:
    for j in range(n):
        close(gl[j], torch.full((2,), float(j)))

t = torch.empty(2)
dist.scatter(t, [torch.full((2,), float(j)) for j in range(n)] if rank == 0 else None, src=0)  # 15
close(t, torch.full((2,), float(rank)))

nxt, prv = (rank + 1) % n, (rank - 1) % n
rbuf = torch.empty(3)
if rank % 2 == 0:  # 16, 17: blocking send/recv ring
    dist.send(torch.full((3,), float(rank)), nxt)
    dist.recv(rbuf, prv)
else:
    dist.recv(rbuf, prv)
    dist.send(torch.full((3,), float(rank)), nxt)
close(rbuf, torch.full((3,), float(prv)))

rbuf = torch.empty(3)
ws = dist.isend(torch.full((3,), float(rank)), nxt, tag=7)  # 18
wr = dist.irecv(rbuf, prv, tag=7)  # 19
ws.wait()
wr.wait()
close(rbuf, torch.full((3,), float(prv)))

rbuf = torch.empty(4)
reqs = dist.batch_isend_irecv(  # 20, 21
    [dist.P2POp(dist.isend, torch.full((4,), float(rank)), nxt),
     dist.P2POp(dist.irecv, rbuf, prv)]
)  # fmt: skip
for q in reqs:
    q.wait()
close(rbuf, torch.full((4,), float(prv)))

objs = [None] * n
dist.all_gather_object(objs, {"rank": rank})  # 22, 23
assert objs == [{"rank": j} for j in range(n)], objs

lst = ["hello", 42] if rank == 1 else [None, None]
dist.broadcast_object_list(lst, src=1)  # 24, 25
assert lst == ["hello", 42], lst

dist.barrier()  # 26
dist.monitored_barrier()  # 27

t = torch.full((4,), rank + 1.0)
y = funcol.all_reduce(t, "sum", W)  # 28
close(funcol.wait_tensor(y), torch.full((4,), 10.0))

a, b = torch.full((2,), rank + 1.0), torch.full((3,), rank + 1.0)
with _coalescing_manager(W):  # 29, 30: one allreduce_coalesced, sync
    dist.all_reduce(a)
    dist.all_reduce(b)
close(a, torch.full((2,), 10.0))
close(b, torch.full((3,), 10.0))

a, b = torch.full((2,), rank + 1.0), torch.full((3,), rank + 1.0)
with _coalescing_manager(W, async_ops=True) as cm:  # 31, 32: async
    dist.all_reduce(a)
    dist.all_reduce(b)
busy = torch.randn(64, 64) @ torch.randn(64, 64)
cm.wait()
close(a, torch.full((2,), 10.0))

optimizer_step()  # boundary: end of iteration 0

# ---------------- phase B: sub-groups (iteration 1) ----------------
mine = g_even if rank % 2 == 0 else g_odd
members = [0, 2] if rank % 2 == 0 else [1, 3]
t = torch.full((4,), rank + 1.0)
dist.all_reduce(t, group=mine)  # B1
close(t, torch.full((4,), float(sum(m + 1 for m in members))))

out = torch.empty(2 * 3)
dist.all_gather_into_tensor(out, torch.full((3,), float(rank)), group=g_pair)  # B2
pair = [0, 1] if rank < 2 else [2, 3]
close(out, torch.tensor(pair, dtype=torch.float32).repeat_interleave(3))

t = torch.full((2,), float(rank))
dist.broadcast(t, src=members[1], group=mine)  # B3 (global src)
close(t, torch.full((2,), float(members[1])))

other = members[1] if rank == members[0] else members[0]
rbuf = torch.empty(2)
if rank == members[0]:  # B4, B5: send/recv inside the group, global peers
    dist.send(torch.full((2,), float(rank)), other, group=mine)
    dist.recv(rbuf, other, group=mine)
else:
    dist.recv(rbuf, other, group=mine)
    dist.send(torch.full((2,), float(rank)), other, group=mine)
close(rbuf, torch.full((2,), float(other)))

pother = pair[1] if rank == pair[0] else pair[0]
rbuf = torch.empty(5)
reqs = dist.batch_isend_irecv(  # B6, B7 on the pair group
    [dist.P2POp(dist.irecv, rbuf, pother, group=g_pair),
     dist.P2POp(dist.isend, torch.full((5,), float(rank)), pother, group=g_pair)]
)  # fmt: skip
for q in reqs:
    q.wait()
close(rbuf, torch.full((5,), float(pother)))

gr = pair.index(rank)
in_sp = [gr + 1, 2]  # member g sends g + 1 rows to member 0 and 2 rows to member 1
out_sp = [[1, 2][gr], [2, 2][gr]]
inp = torch.cat([torch.full((in_sp[j],), float(10 * rank + j)) for j in range(2)])
out = torch.empty(sum(out_sp))
w = dist.all_to_all_single(out, inp, out_sp, in_sp, group=g_pair, async_op=True)  # B8
w.wait()
close(out, torch.cat([torch.full((out_sp[j],), float(10 * pair[j] + gr)) for j in range(2)]))

dist.barrier(group=g_pair)  # B9

optimizer_step()  # boundary: end of iteration 1

# ---------------- phase C: explicit API (iteration 2, then the tail) ----------------
prism.mark("tail-allreduce")
t = torch.full((2,), 1.0)
dist.all_reduce(t)  # C1, labelled
close(t, torch.full((2,), 4.0))
prism.step()  # boundary: end of iteration 2

optimizer_step()  # ignored: the program now marks its own iterations
t = torch.full((1,), 1.0)
dist.all_reduce(t)  # C2, iteration 3 (never closed)
close(t, torch.full((1,), 4.0))

assert len(pickle.dumps({"rank": rank})) > 0
dist.destroy_process_group()
print("COLLECTIVES OK", rank)
