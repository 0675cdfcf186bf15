"""A data-parallel step whose memory a flag sets: ``--hungry-rank R`` makes rank R allocate
more host memory than any machine has in its first iteration (the CPU allocator refuses at once:
a real out-of-memory error, not a simulated one), after ``--delay`` seconds; ``--hungry-late R``
makes rank R do so in its second iteration, at once; ``--width N`` sets the model's width."""

import argparse
import time

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--hungry-rank", type=int, default=-1)
p.add_argument("--hungry-late", type=int, default=-1)
p.add_argument("--delay", type=float, default=0.0)
p.add_argument("--width", type=int, default=16)
args = p.parse_args()

dist.init_process_group("gloo")
model = torch.nn.Linear(args.width, args.width)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for it in range(2):
    loss = model(torch.ones(4, args.width)).sum()
    loss.backward()
    for q in model.parameters():
        dist.all_reduce(q.grad)
    if dist.get_rank() == args.hungry_rank and it == 0:
        time.sleep(args.delay)
        torch.empty(1 << 62, dtype=torch.uint8)  # 4 EiB
    if dist.get_rank() == args.hungry_late and it == 1:
        torch.empty(1 << 62, dtype=torch.uint8)
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
