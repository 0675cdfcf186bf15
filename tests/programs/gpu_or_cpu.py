"""What the test programs that run on either share: join the world on a GPU where one is visible
(NCCL, the rank's GPU by LOCAL_RANK), else on the CPU (gloo)."""

import os

import torch
import torch.distributed as dist


def join_world() -> torch.device:
    """Init the default process group; return the device this rank computes on."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device
