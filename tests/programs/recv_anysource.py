"""Two ranks: rank 0 sends a tensor, rank 1 receives it from any source (``dist.recv`` without
``src``), which a real run supports and emulation cannot replay (the sender of each message must
be known in advance)."""

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.arange(4, dtype=torch.float32)
if dist.get_rank() == 0:
    dist.send(t, 1)
else:
    src = dist.recv(t)
    print(f"rank 1 received {t.tolist()} from rank {src}", flush=True)
dist.destroy_process_group()
