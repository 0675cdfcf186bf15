"""A Work of the native lane's Python path, asked from C++ as the native recorder's resolver
asks it: whether it completed and its device time. Prints ``LANE WORK completed=.. duration=..``
for a pruned Work waited on and for a Work that reports a device time."""

import tempfile

import torch
import torch.distributed as dist

from prismllm.comm import native
from prismllm.comm.sandbox import PrunedWork

lane_module = native.load()
dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp(), 1), rank=0, world_size=1)
gloo = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))


class TimedWork(dist.Work):
    """Done, with a device time (as a pruned Work's small NCCL calls report theirs)."""

    def is_completed(self) -> bool:
        return True

    def _get_duration(self) -> float:
        return 1.5


class PythonSide:
    """The lane's Python backend: each call's Work in turn, no template (every call to Python)."""

    def __init__(self) -> None:
        self.works: list[dist.Work] = []

    def native_call(self, method, rows, program, *args):
        return self.works.pop(0), None, None


side = PythonSide()
lane = lane_module.PrunedLane(0, 2, side, "gloo", False, False, [])
t = torch.ones(4)
side.works.append(PrunedWork([gloo.allreduce([t])], [], [t]))
w = lane.allreduce([t], dist.AllreduceOptions())
w.wait()
print(f"LANE WORK completed={w.is_completed()}")
side.works.append(TimedWork())
w = lane.allreduce([t], dist.AllreduceOptions())
print(f"LANE WORK completed={w.is_completed()} duration={w._get_duration()}")
# the Works and the gloo backend go while the interpreter runs: gloo's worker thread drops its
# reference to a Work after completing it, and a last drop during finalization, without the GIL,
# aborted the process ("terminate called without an active exception", once in a loaded suite)
del w, lane, side, t, gloo
dist.destroy_process_group()
