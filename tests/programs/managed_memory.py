"""A rank that holds CUDA managed memory (``cuMemAllocManaged``, unified memory), then makes
collectives: state the CUDA driver's checkpoint API does not move (its documented limits: no
unified or IPC memory). Switch mode on a GPU must stop with the driver's refusal, naming the
rank, rather than lose the memory."""

import ctypes
import os

import torch
import torch.distributed as dist

device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
torch.cuda.set_device(device)
dist.init_process_group("nccl")
t = torch.ones(4, device=device)  # the primary context current on this thread
cuda = ctypes.CDLL("libcuda.so.1")
managed = ctypes.c_uint64()
rc = cuda.cuMemAllocManaged(ctypes.byref(managed), ctypes.c_size_t(64 << 20), ctypes.c_uint(1))  # ATTACH_GLOBAL
assert rc == 0, f"cuMemAllocManaged: {rc}"
assert cuda.cuMemsetD8_v2(managed, ctypes.c_ubyte(7), ctypes.c_size_t(64 << 20)) == 0
for _ in range(3):
    dist.all_reduce(t)
torch.cuda.synchronize()
print(f"rank {dist.get_rank()}: sum {t.sum().item()}", flush=True)
dist.destroy_process_group()
