"""A program whose path depends on all-reduced values, as training loops do: it skips the step
when the gradient norm (a MAX over ranks) is not finite, and stops once the mean loss (a SUM over
ranks, divided) falls under a bound. Each rank's own values differ from the group's: rank r's loss
is (r + 1) / 2**it, and the last rank's norm is infinite in iteration 1. Run with 4 ranks on gloo:
the real run takes 5 iterations (the mean loss 2.5 / 2**it passes 0.2 at it = 4) and skips the step
of iteration 1; a rank that saw only its own values would take another path. Prints its path."""

import torch
import torch.distributed as dist

BOUND = 0.2
dist.init_process_group("gloo")
rank, n = dist.get_rank(), dist.get_world_size()
weights = torch.zeros(4)
path = []
for it in range(10):
    loss = torch.tensor([(rank + 1) / 2**it])
    dist.all_reduce(loss)
    loss /= n
    norm = torch.tensor([float("inf") if (rank == n - 1 and it == 1) else 1.0 + rank])
    dist.all_reduce(norm, op=dist.ReduceOp.MAX)
    if torch.isfinite(norm).all():
        update = torch.ones(4) * it
        dist.all_reduce(update)  # the step: every rank applies the same update
        weights += update
        path.append(f"step{it}")
    else:
        path.append(f"skip{it}")
    if loss.item() < BOUND:
        break
print(f"PATH {rank} {' '.join(path)} weights {weights.tolist()}", flush=True)
dist.destroy_process_group()
