"""What the exports share: each node's measured span, a graph's rows rank by rank, and writing an
output file so that a reader never sees half of it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from prismllm.errors import PrismError, RequirementError
from prismllm.trace.graph import PrismTrace, TraceError


def node_spans(trace: PrismTrace) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(start_ns, end_ns, known) per node row: start_ns..end_ns, falling back to issue_ns and
    duration_ns where those are missing."""
    start = trace.column("start_ns").astype(np.int64)
    end = trace.column("end_ns").astype(np.int64)
    issue = trace.column("issue_ns").astype(np.int64)
    dur = trace.column("duration_ns").astype(np.int64)
    start = np.where((start < 0) & (issue >= 0) & (dur >= 0), issue, start)
    end = np.where((end < 0) & (start >= 0) & (dur >= 0), start + dur, end)
    return start, end, (start >= 0) & (end >= start)


def prev_waited(is_async: np.ndarray) -> np.ndarray:
    """Per node of one rank's program order: the position of the nearest earlier node the program
    waited for (any node but an async call), -1 where none: what a node starts after, in the
    exports that draw dependencies (Chakra's, Kineto's stream waits)."""
    pos = np.arange(len(is_async))
    last = np.maximum.accumulate(np.where(~is_async, pos, -1)) if len(pos) else pos
    return np.r_[-1, last[:-1]] if len(pos) else pos


def measured_spans(trace: PrismTrace, what: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`node_spans`; TraceError naming ``what`` for a graph without any times (an export
    of measured spans has nothing to show for it)."""
    start, end, known = node_spans(trace)
    if not known.any():
        raise TraceError(
            f"cannot export {what}: the graph has no times (a bare graph); time it first "
            f"(prism time), or export --perfetto, which lays a bare graph out by program order"
        )
    return start, end, known


def rank_rows(trace: PrismTrace, ranks: list[int] | None) -> tuple[PrismTrace, list[int], list[np.ndarray]]:
    """The graph restricted to ``ranks`` (all when None; PrismError, a usage error, for a rank
    outside the world), the ranks with nodes, and per rank its node rows in program order."""
    if ranks is not None:
        bad = [r for r in ranks if not 0 <= int(r) < trace.world_size]
        if bad:
            raise PrismError(f"rank {bad[0]} is outside the graph's world of {trace.world_size} ranks")
        trace = select_ranks(trace, ranks)
    order = trace.program_order()
    rank_o = trace.column("rank").astype(np.int64)[order]
    present = np.unique(rank_o)
    bounds = np.searchsorted(rank_o, np.r_[present, present[-1] + 1 if len(present) else 0])
    rows = [order[bounds[k] : bounds[k + 1]] for k in range(len(present))]
    return trace, [int(r) for r in present], rows


def write_atomically(path: Path, write: Any, binary: bool = False) -> Any:
    """``write(file)`` into a temp file beside ``path``, then rename (a reader never sees half a
    file); RequirementError on an OS error."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        with open(tmp, "wb" if binary else "w") as f:
            result = write(f)
        os.replace(tmp, path)
    except OSError as e:
        raise RequirementError(f"cannot write {path}: {e.strerror or e}") from None
    return result


def select_ranks(trace: PrismTrace, ranks: list[int]) -> PrismTrace:
    """The graph restricted to some ranks (nodes, their edges, their iterations)."""
    keep = pa.array(sorted(set(int(r) for r in ranks)), type=pa.int32())
    nodes = trace.nodes.filter(pc.is_in(trace.nodes.column("rank"), value_set=keep))
    ids = nodes.column("node_id").combine_chunks()
    e = trace.edges
    edges = e.filter(pc.and_(pc.is_in(e.column("src"), value_set=ids), pc.is_in(e.column("dst"), value_set=ids)))
    it = trace.iterations
    iterations = it.filter(pc.is_in(it.column("rank"), value_set=keep))
    return PrismTrace(manifest=trace.manifest, nodes=nodes, edges=edges, groups=trace.groups, iterations=iterations)
