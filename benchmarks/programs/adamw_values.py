"""Does AdamW's step time depend on the gradients' values? One GPU, the GPU suite's DDP model
(benchmarks/programs/torch_parallel.py: hidden 2048, 8 layers, vocab 32000, bf16, its AdamW):
each run builds the model afresh and times ``optimizer.step()`` (CUDA events) for 12 steps with
the gradients of a real backward pass (``real``), all zeros (``zero``: what a sandbox rank's
optimizer got while ProcessGroupNCCL read a bf16 pre-multiplied factor as 0) or a real pass's
scaled by 1e-30 (``tiny``: near bf16's smallest normal numbers). One JSON line a run, the
median of steps 3-12 in ms.

    python benchmarks/programs/adamw_values.py [--kinds real,zero,tiny,real]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from torch_parallel import GPT, param_groups  # noqa: E402 - the suite's model and optimizer


def run(kind: str, dev: torch.device, steps: int = 12) -> dict:
    torch.manual_seed(0)
    model = GPT(32000, 2048, 16, 8).to(dev, torch.bfloat16)
    opt = torch.optim.AdamW(param_groups(model), lr=1e-4)
    tokens = torch.randint(0, 32000, (4, 1025), device=dev)
    times = []
    for _ in range(steps):
        if kind == "zero":
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
        else:
            model.zero_grad(set_to_none=False)
            logits = model(tokens[:, :-1])
            F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
            if kind == "tiny":
                for p in model.parameters():
                    p.grad.mul_(1e-30)
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        opt.step()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return {
        "grads": kind,
        "step_ms_median": round(statistics.median(times[2:]), 3),
        "step_ms": [round(t, 2) for t in times],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kinds", default="real,zero,tiny,real")
    a = ap.parse_args()
    dev = torch.device("cuda", 0)
    for kind in a.kinds.split(","):
        print(json.dumps({"gpu": torch.cuda.get_device_name(dev), **run(kind, dev)}), flush=True)


if __name__ == "__main__":
    main()
