"""PrismTrace: the execution graph's on-disk schema, shared by every pipeline stage.

A graph is a directory:

    manifest.json     format name and version, world size, layout, command line, versions,
                      device, mode (record | solo | timed | calibrated)
    nodes.parquet     one row per compute span or communication event per rank
    edges.parquet     directional and synchronisation edges between nodes
    groups.parquet    the process groups, stored once
    iterations.parquet  per rank and iteration: start and end of the iteration

Node model of one rank (one stream of program order): the host program issues communication
calls; between two consecutive *points* (the issue of a call, the wait on an async call) the
device runs compute. So each rank's sequence alternates compute spans and communication
events, in program order (column ``index``). An asynchronous event has an issue point (its
own position) and a wait point (``wait_index``: the index of the first node that runs after
the program waited on it); the node at ``wait_index`` gets a ``wait`` edge from it.

Times are nanoseconds on one clock shared by all ranks of a host (``time.time_ns`` domain);
device-side times (CUDA events) are mapped onto it. -1 means unknown (e.g. a bare graph).
"""

from __future__ import annotations

import pyarrow as pa

FORMAT_NAME = "prismtrace"
FORMAT_VERSION = 1

# Node kinds and the communication ops a node may carry. ``op`` of a compute span is "compute".
KIND_COMPUTE = "compute"
KIND_COMM = "comm"

COLLECTIVE_OPS = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "barrier",
)
P2P_OPS = ("send", "recv")
COMM_OPS = COLLECTIVE_OPS + P2P_OPS

# Edge kinds. ``order``: program order on one rank (node i -> node i+1). ``wait``: an async
# communication event must finish before the node at its wait point starts. ``sync``: the
# participants of one collective instance, or a matched send/recv, meet (stored as a chain
# over the participants in group-rank order; for P2P from the send to the recv).
EDGE_ORDER = "order"
EDGE_WAIT = "wait"
EDGE_SYNC = "sync"
EDGE_KINDS = (EDGE_ORDER, EDGE_WAIT, EDGE_SYNC)

NODE_SCHEMA = pa.schema(
    [
        ("node_id", pa.int64()),  # unique in the graph
        ("rank", pa.int32()),  # global rank
        ("index", pa.int32()),  # position in the rank's program order, from 0
        ("iteration", pa.int32()),  # -1 before the first iteration boundary (set-up)
        ("kind", pa.string()),  # KIND_COMPUTE | KIND_COMM
        ("op", pa.string()),  # "compute" or one of COMM_OPS
        ("group", pa.int32()),  # group_id in groups.parquet, -1 for compute
        ("seq", pa.int64()),  # collectives: per (rank, group) count; p2p: per (rank, group, peer, op)
        ("peer", pa.int32()),  # send/recv: global rank of the peer; rooted ops: global root; else -1
        ("tag", pa.int32()),
        ("reduce_op", pa.string()),  # sum | avg | max | min | product | premul_sum:<factor> | ... ; "" where none
        ("dtype", pa.string()),  # e.g. "float32"; "" for compute
        ("shape", pa.list_(pa.int64())),  # input tensor shape (first tensor)
        ("in_bytes", pa.int64()),  # bytes this rank contributes (input tensors)
        ("out_bytes", pa.int64()),  # bytes this rank receives (output tensors)
        ("in_splits", pa.list_(pa.int64())),  # all_to_all input split sizes (rows); [] if none
        ("out_splits", pa.list_(pa.int64())),  # all_to_all output split sizes (rows); [] if none
        ("coalesced", pa.int32()),  # id of the coalesced batch (batch_isend_irecv, *_coalesced), -1
        ("async_op", pa.bool_()),  # the program got a Work back and waited on it later
        ("api", pa.string()),  # entry point that reached the backend, e.g. "allreduce", "_allgather_base"
        ("stream", pa.string()),  # "compute" for compute spans; "comm:<torch group name>" for comm events
        ("wait_index", pa.int32()),  # index of the first node after the wait point; -1 if sync/none
        ("issue_ns", pa.int64()),  # host time the call was issued (comm) or span began (compute)
        ("start_ns", pa.int64()),  # device-side start
        ("end_ns", pa.int64()),  # device-side end
        ("duration_ns", pa.int64()),  # device-side duration (end - start, or the backend's own timer)
        ("label", pa.string()),  # user label from prismllm.mark(), "" if none
    ]
)

EDGE_SCHEMA = pa.schema(
    [
        ("src", pa.int64()),
        ("dst", pa.int64()),
        ("kind", pa.string()),  # EDGE_KINDS
    ]
)

GROUP_SCHEMA = pa.schema(
    [
        ("group_id", pa.int32()),
        ("name", pa.string()),  # torch.distributed group name (same on every member)
        ("desc", pa.string()),  # torch group_desc, e.g. "default_pg" or user's description
        ("ranks", pa.list_(pa.int32())),  # global ranks in group-rank order
    ]
)

ITERATION_SCHEMA = pa.schema(
    [
        ("rank", pa.int32()),
        ("iteration", pa.int32()),
        ("start_ns", pa.int64()),
        ("end_ns", pa.int64()),
        ("label", pa.string()),
    ]
)

# The node columns that say which call a node is: its place in its rank's program, its iteration,
# and what it calls (op on group, its seq there, its peer), which tells a collective instance or a
# send/recv pair. What a reader of calls (an export, the replay) selects first.
CALL_COLUMNS = ("index", "iteration", "kind", "op", "group", "seq", "peer")

# Default values for node columns a producer may leave out.
NODE_DEFAULTS: dict[str, object] = {
    "iteration": -1,
    "group": -1,
    "seq": -1,
    "peer": -1,
    "tag": 0,
    "reduce_op": "",
    "dtype": "",
    "shape": [],
    "in_bytes": 0,
    "out_bytes": 0,
    "in_splits": [],
    "out_splits": [],
    "coalesced": -1,
    "async_op": False,
    "api": "",
    "stream": "compute",
    "wait_index": -1,
    "issue_ns": -1,
    "start_ns": -1,
    "end_ns": -1,
    "duration_ns": -1,
    "label": "",
}

FILES = {
    "nodes": ("nodes.parquet", NODE_SCHEMA),
    "edges": ("edges.parquet", EDGE_SCHEMA),
    "groups": ("groups.parquet", GROUP_SCHEMA),
    "iterations": ("iterations.parquet", ITERATION_SCHEMA),
}
MANIFEST_FILE = "manifest.json"
# The largest world a graph may describe: above any real job, and low enough that arrays of one
# entry per rank stay small (a world size of 2**31 read from a damaged manifest would otherwise
# allocate gigabytes).
MAX_WORLD_SIZE = 1 << 24
# What the manifest's other keys hold when present and not null (every load checks them, and
# world_size: a whole number from 1 to MAX_WORLD_SIZE; peak_memory_bytes: {rank: bytes, -1 unknown}).
MANIFEST_VALUES = {
    "mode": "a string",
    "recorder": "a string",
    "device": "a string or a list of strings",
    "clock": "a string or a list of strings",
    "command": "a list of strings",
    "argv": "a list of strings",
    "gpus": "a list of strings",
    "cuda_on_cpu": "true or false",
    "layout": "an object",
    "program": "an object",
    "routing": "an object",
    "capture": "an object",
    "timing": "an object",
    "calibration": "an object",
    "versions": "an object",
    "peak_memory_bytes": "an object",
    "replicas": "an object",
}
# The manifest key of a graph whose replicas are their representatives' copies, renamed (every
# duration equal; prismllm.trace.replicate writes it): what lets a replay leave most of them out
# (prismllm.replay.mirror). A stage that gives ranks durations of their own drops it.
REPLICAS_KEY = "replicas"
# A graph directory may also hold the collective tensors its recording saved (prismllm.generate.store).
TENSORS_DIR = "tensors"
# ... and the object lists a solo capture's ranks sent each other (send_object_list), one file a
# message (prismllm.comm.solo_objects): what a virtual sender sends a sandbox rank in emulation.
OBJECTS_DIR = "objects"


def split_reduce_op(name: str) -> tuple[str, float | None]:
    """A node's ``reduce_op`` -> (the op, its factor): ``"premul_sum:0.5"`` -> ("premul_sum", 0.5)
    (NCCL's PREMUL_SUM multiplies every input by its factor before the sum, so the graph keeps
    it: what an emulation multiplies the virtual members' inputs by); any other -> (name, None)."""
    op, sep, factor = (name or "").partition(":")
    return op, (float(factor) if sep else None)
