"""RankLog: what one rank's producer (recorder, solo capture, slice timer) hands to the graph.

Each rank writes one msgpack file ``rank-<rank:06d>.msgpack`` into a spool directory; the
launcher assembles all of them into a PrismTrace directory (``prismllm.trace.assemble``).
msgpack, never pickle: the files cross process and machine boundaries.

A node row is a dict with the columns of ``schema.NODE_SCHEMA`` except ``node_id`` and
``group``: a rank does not know graph-wide group ids, so it names its group by the
torch.distributed group name in ``group_name`` ("" for compute). ``rank`` and ``index`` are
filled by the producer. Missing optional columns take ``schema.NODE_DEFAULTS``.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import msgpack

RANKLOG_VERSION = 1


@dataclasses.dataclass
class GroupInfo:
    name: str  # torch.distributed group name, identical on every member
    desc: str  # group_desc
    ranks: list[int]  # global ranks in group-rank order


@dataclasses.dataclass
class RankLog:
    rank: int
    world_size: int
    device: str  # "cpu" or the GPU's name
    # "host" (wall clock), "cuda" (CUDA events mapped to the host clock) or "cuda-iterations"
    # (the iteration boundaries so, every other point on the host: prism emulate on a GPU)
    clock: str
    nodes: list[dict[str, Any]]
    groups: list[GroupInfo]
    iterations: list[dict[str, Any]]  # {"iteration", "start_ns", "end_ns", "label"}
    peak_memory_bytes: int = -1  # torch.cuda.max_memory_allocated at exit, -1 on CPU
    # host time the emulation layer spent on the rank's calls, left out of its host clock
    # (prism emulate on CPU; Recorder.exclude)
    excluded_ns: int = 0
    # the same layer's host time on any device (on GPU counted, not left out: a host-bound
    # rank's device waits for it; docs/commands/time.md)
    emulation_host_ns: int = 0
    # device memory the emulation's pruned calls took outside the program's allocator, so not
    # in peak_memory_bytes (prism emulate on GPU; prismllm.comm.scratch)
    scratch_bytes: int = 0
    # asynchronous pruned calls planned and issued off the program's thread (PRISM_ISSUE_THREAD)
    calls_off_thread: int = 0
    # emulation_host_ns by part over the steady iterations: part -> [calls, wall ns, CPU ns]
    # (Recorder.emulation_host_parts)
    emulation_host_parts: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    # emulation's native lane (PRISM_NATIVE_LANE=1), over the whole run: calls issued from a
    # template ("fast") and calls handed to the Python backend ("python"), with their host time
    # ("fast_ns", "python_ns"; "fast_issue_ns": the part of fast_ns in the small backend's own
    # call); empty where the Python path ran
    native_lane: dict[str, int] = dataclasses.field(default_factory=dict)
    # GPU: asynchronous calls whose transfer time came from NCCL's own events ("read"), those
    # whose did not ("missing": their transfers end where the program waited) and the first
    # missing one with why (Recorder.transfer_durations)
    transfer_durations: dict[str, Any] = dataclasses.field(default_factory=dict)
    # GPU slices (prism time): the host's head starts given, the points timed after the first and
    # those at which the device had caught up with the host anyway (Recorder.head_start_counts)
    head_start: dict[str, int] = dataclasses.field(default_factory=dict)
    # GPU slices and emulations: the clock the rank's GPU ran at while busy (NVML's SM clock and
    # power medians, the highest temperature; prismllm.comm.gpuclock); empty where not read
    gpu: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["version"] = RANKLOG_VERSION
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RankLog:
        version = d.get("version")
        if version != RANKLOG_VERSION:
            raise ValueError(f"rank log version {version!r}, expected {RANKLOG_VERSION}")
        groups = [GroupInfo(**g) for g in d["groups"]]
        fields = {f.name for f in dataclasses.fields(cls)} - {"groups"}
        return cls(groups=groups, **{k: v for k, v in d.items() if k in fields})


def ranklog_path(spool: str | os.PathLike, rank: int) -> Path:
    return Path(spool) / f"rank-{rank:06d}.msgpack"


def write_ranklog(spool: str | os.PathLike, log: RankLog) -> Path:
    """Write atomically (temp file + rename) so a crash never leaves a half file behind."""
    path = ranklog_path(spool, log.rank)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(msgpack.packb(log.to_dict(), use_bin_type=True))
    os.replace(tmp, path)
    return path


def read_ranklog(path: str | os.PathLike) -> RankLog:
    with open(path, "rb") as f:
        return RankLog.from_dict(msgpack.unpackb(f.read(), raw=False, strict_map_key=False))
