"""Export a PrismTrace as a Perfetto protobuf trace (``.pftrace``): what ``--perfetto`` shows
(:func:`prismllm.trace.perfetto.layout`), in Perfetto's native format, about a third the size
of the JSON. ui.perfetto.dev and Perfetto's trace_processor read it.

    export_perfetto_proto(trace, "trace.pftrace") -> dict of counts

The file is a ``perfetto.protos.Trace``: a stream of ``TracePacket``s (field 1), written here
with a small protobuf encoder (the subset of perfetto_trace.proto below, by field number).

Tracks (``TrackDescriptor``, all global tracks, none tied to a pid: a rank is no process of
this machine, and pid 0 is the kernel's idle process to trace_processor): a root "ranks";
under it "rank N" per rank (``sibling_order_rank`` N, children in explicit order); under each
rank "iterations", "compute", "comm:<group>" per communication stream, and a "peak memory"
counter track (``CounterDescriptor``, unit bytes) where the manifest has the rank's peak.
Slices nest on a track, so spans of one stream that overlap without nesting (async calls of a
group in flight together) go to a second track of the stream, "<name> (2)", and so on.

Sequences: each track with events is a packet sequence of its own (``trusted_packet_sequence_id``),
so that its events need no track id (``TrackEventDefaults.track_uuid``) and its timestamps can
be deltas: the sequence's first packet clears its incremental state, sets the defaults and a
``ClockSnapshot`` of an incremental clock (id 64, sequence-scoped) at 0 = BOOTTIME 0; every
later packet's ``timestamp`` is ns since the previous packet's. Times are ns from the trace's
start, as in the JSON (which has µs).

Events (``TrackEvent``): every node is a ``TYPE_SLICE_BEGIN`` (name, category, the JSON's args
as ``debug_annotations``) and a ``TYPE_SLICE_END``; an iteration likewise on "iterations"; the
counter is a ``TYPE_COUNTER`` at the start and at the end of the trace. Names, categories,
annotation names and string values are interned (``InternedData``, sent on a sequence the first
time it uses them). Every sync edge is a flow: its id (from 1) in ``flow_ids`` of both ends'
begin events; Perfetto draws the arrow from the earlier of the two (a destination that starts
first would drop a terminating flow). The graph's facts (world size, mode, device, command,
timeline, counts) are ``TraceAttributes`` (trace_processor's metadata ``trace_attribute.*``).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from prismllm.trace.graph import PrismTrace
from prismllm.trace.perfetto import MEMORY_COUNTER, layout, metadata, node_event, node_rows
from prismllm.trace.protowire import I64, LEN, VARINT, key, len_field, varint, varint_field
from prismllm.trace.spans import select_ranks, write_atomically

# Field numbers (perfetto.protos, protos/perfetto/trace/).
TRACE_PACKET = 1  # Trace.packet
# TracePacket
P_CLOCK_SNAPSHOT, P_TIMESTAMP, P_SEQUENCE_ID, P_TRACK_EVENT, P_INTERNED_DATA = 6, 8, 10, 11, 12
P_SEQUENCE_FLAGS, P_DEFAULTS, P_TRACK_DESCRIPTOR, P_FIRST_ON_SEQUENCE, P_TRACE_ATTRIBUTES = 13, 59, 60, 87, 126
SEQ_INCREMENTAL_STATE_CLEARED = 1  # TracePacket.SequenceFlags
# TracePacketDefaults, TrackEventDefaults
D_TIMESTAMP_CLOCK_ID, D_TRACK_EVENT_DEFAULTS, TED_TRACK_UUID = 58, 11, 11
# ClockSnapshot, ClockSnapshot.Clock, BuiltinClock
CS_CLOCKS, CLK_ID, CLK_TIMESTAMP, CLK_INCREMENTAL = 1, 1, 2, 3
BOOTTIME, INCREMENTAL_CLOCK = 6, 64  # 64..127: clocks of one sequence
# TrackDescriptor, CounterDescriptor
TD_UUID, TD_NAME, TD_PARENT, TD_COUNTER, TD_CHILD_ORDERING, TD_SIBLING_RANK = 1, 2, 5, 8, 11, 12
CHILD_ORDERING_EXPLICIT, CD_UNIT, UNIT_SIZE_BYTES = 3, 3, 3
# TrackEvent and its TYPE_*
TE_CATEGORY_IIDS, TE_DEBUG_ANNOTATIONS, TE_TYPE, TE_NAME_IID, TE_COUNTER_VALUE, TE_FLOW_IDS = 3, 4, 9, 10, 30, 47
SLICE_BEGIN, SLICE_END, COUNTER = 1, 2, 4
# DebugAnnotation
DA_NAME_IID, DA_BOOL, DA_INT, DA_ARRAY, DA_STRING_IID = 1, 2, 4, 12, 17
# InternedData; its entries are (iid = 1, name or str = 2)
I_CATEGORIES, I_NAMES, I_ANNOTATION_NAMES, I_STRINGS = 1, 2, 3, 29
# TraceAttributes, TraceAttributes.Attribute
TA_ATTRIBUTE, TA_KEY, TA_LONG, TA_STRING = 1, 1, 2, 3

_K_PACKET = key(TRACE_PACKET, LEN)
_K_TIMESTAMP = key(P_TIMESTAMP, VARINT)
_K_TRACK_EVENT = key(P_TRACK_EVENT, LEN)
_K_ANNOTATION = key(TE_DEBUG_ANNOTATIONS, LEN)
_K_FLOW = key(TE_FLOW_IDS, I64)
_BEGIN = varint_field(TE_TYPE, SLICE_BEGIN)
_END = varint_field(TE_TYPE, SLICE_END)
_K_DA_NAME = key(DA_NAME_IID, VARINT)
_K_DA_INT = key(DA_INT, VARINT)
_K_DA_STRING = key(DA_STRING_IID, VARINT)
_K_DA_ARRAY = key(DA_ARRAY, LEN)
# the args that differ from node to node: not worth a cache of their encodings
_UNIQUE = frozenset({"node_id", "index", "seq"})
_WRITE_EVERY = 1 << 20  # bytes buffered between writes


# what a track's span becomes: the TrackEvent fields after its type, given the span's number and
# the sequence (which interns the strings)
SpanEvent = Callable[[int, "_Sequence"], bytes]


class _Sequence:
    """One track's packet sequence: its events carry a time delta and no track id, and it is sent
    each interned string it uses once."""

    def __init__(self, out: _Out, track: int) -> None:
        self.out = out
        self.seq = varint_field(P_SEQUENCE_ID, out.next_sequence)
        out.next_sequence += 1
        self.head = self.seq + _K_TRACK_EVENT  # what follows an event packet's timestamp
        self.end = self.head + varint(len(_END)) + _END  # ... in a slice's end, all of it
        self.last = 0
        self.sent: dict[tuple[int, str], int] = {}
        self.pending: list[bytes] = []
        self.names: dict[str, bytes] = {}
        self.repeated: dict[tuple[str, Any], bytes] = {}  # (arg, value) -> its annotation
        self.events: dict[tuple[str, str], bytes] = {}  # (name, category) -> their fields
        defaults = varint_field(D_TIMESTAMP_CLOCK_ID, INCREMENTAL_CLOCK) + len_field(
            D_TRACK_EVENT_DEFAULTS, varint_field(TED_TRACK_UUID, track)
        )
        incremental = (
            varint_field(CLK_ID, INCREMENTAL_CLOCK) + varint_field(CLK_TIMESTAMP, 0) + varint_field(CLK_INCREMENTAL, 1)
        )
        boottime = varint_field(CLK_ID, BOOTTIME) + varint_field(CLK_TIMESTAMP, 0)
        # no primary_trace_clock: as the SDK's snapshots, BOOTTIME is the trace's clock by default
        snapshot = len_field(CS_CLOCKS, incremental) + len_field(CS_CLOCKS, boottime)
        out.packet(
            self.seq
            + varint_field(P_SEQUENCE_FLAGS, SEQ_INCREMENTAL_STATE_CLEARED)
            + varint_field(P_FIRST_ON_SEQUENCE, 1)
            + len_field(P_DEFAULTS, defaults)
            + len_field(P_CLOCK_SNAPSHOT, snapshot)
        )

    def iid(self, kind: int, s: str) -> int:
        """The interning id of ``s`` among ``kind``'s strings (InternedData field ``kind``)."""
        key = (kind, s)
        iid = self.sent.get(key)
        if iid is None:
            iid, entry = self.out.intern(key)
            self.sent[key] = iid
            self.pending.append(entry)
        return iid

    def event(self, ts: int, te: bytes) -> None:
        """A TrackEvent at ``ts`` (ns from the trace's start, never before the previous one),
        with the interned strings it is the first to use."""
        body = _K_TIMESTAMP + varint(ts - self.last) + self.head + varint(len(te)) + te
        if self.pending:
            body += len_field(P_INTERNED_DATA, b"".join(self.pending))
            self.pending.clear()
        self.last = ts
        self.out.packet(body)

    def end_slice(self, ts: int) -> None:
        """A TYPE_SLICE_END at ``ts`` (the commonest packet: made of constants but its time)."""
        self.out.packet(_K_TIMESTAMP + varint(ts - self.last) + self.end)
        self.last = ts

    def annotations(self, args: list[tuple[str, Any]]) -> bytes:
        """``debug_annotations`` of the args of :func:`prismllm.trace.perfetto.node_event`; an
        arg whose values repeat (all but _UNIQUE's) encoded once per value and sequence."""
        out = []
        repeated = self.repeated
        for k, v in args:
            if k in _UNIQUE:
                # inline: an int's annotation is < 128 bytes
                body = self.name(k) + _K_DA_INT + varint(v)
                out.append(_K_ANNOTATION + varint(len(body)) + body)
                continue
            arg = (k, tuple(v)) if type(v) is list else (k, v)
            encoded = repeated.get(arg)
            if encoded is None:
                encoded = repeated[arg] = self.annotation(k, v)
            out.append(encoded)
        return b"".join(out)

    def annotation(self, k: str, v: Any) -> bytes:
        """One DebugAnnotation field: an int, a bool, a str (interned) or a list of ints."""
        body = self.name(k)
        if v is True or v is False:
            body += varint_field(DA_BOOL, int(v))
        elif isinstance(v, str):
            body += _K_DA_STRING + varint(self.iid(I_STRINGS, v))
        elif isinstance(v, list):
            for x in v:
                item = _K_DA_INT + varint(x)
                body += _K_DA_ARRAY + varint(len(item)) + item
        else:
            body += _K_DA_INT + varint(v)
        return _K_ANNOTATION + varint(len(body)) + body

    def name(self, k: str) -> bytes:
        """An annotation's name field."""
        encoded = self.names.get(k)
        if encoded is None:
            encoded = self.names[k] = _K_DA_NAME + varint(self.iid(I_ANNOTATION_NAMES, k))
        return encoded

    def named(self, name: str, category: str) -> bytes:
        """A TrackEvent's name and category fields."""
        encoded = self.events.get((name, category))
        if encoded is None:
            encoded = self.events[name, category] = varint_field(TE_NAME_IID, self.iid(I_NAMES, name)) + varint_field(
                TE_CATEGORY_IIDS, self.iid(I_CATEGORIES, category)
            )
        return encoded


class _Out:
    """The packets, buffered into a binary file; the track ids (from 1), the sequence ids (from
    2: 1 is the tracing service's own in a recorded trace) and the interning ids (from 1 per
    kind, the same on every sequence)."""

    def __init__(self, f: BinaryIO) -> None:
        self.f = f
        self.buf: list[bytes] = []
        self.size = 0
        self.packets = 0
        self.tracks = 0
        self.next_sequence = 2
        self.interned: dict[tuple[int, str], tuple[int, bytes]] = {}
        self.per_kind: dict[int, int] = {}

    def packet(self, body: bytes) -> None:
        self.buf.append(_K_PACKET + varint(len(body)) + body)
        self.size += len(body)
        self.packets += 1
        if self.size > _WRITE_EVERY:
            self.flush()

    def flush(self) -> None:
        self.f.write(b"".join(self.buf))
        self.buf.clear()
        self.size = 0

    def intern(self, key: tuple[int, str]) -> tuple[int, bytes]:
        """(iid, its InternedData entry) of (kind, string)."""
        got = self.interned.get(key)
        if got is None:
            kind, s = key
            iid = self.per_kind[kind] = self.per_kind.get(kind, 0) + 1
            got = self.interned[key] = (iid, len_field(kind, varint_field(1, iid) + len_field(2, s.encode())))
        return got

    def track(self, name: str, parent: int = 0, order: int | None = None, extra: bytes = b"") -> int:
        """A new track (a TrackDescriptor packet, on no sequence: a descriptor stands alone); its uuid."""
        self.tracks += 1
        td = varint_field(TD_UUID, self.tracks) + len_field(TD_NAME, name.encode())
        if parent:
            td += varint_field(TD_PARENT, parent)
        if order is not None:
            td += varint_field(TD_SIBLING_RANK, order)
        self.packet(len_field(P_TRACK_DESCRIPTOR, td + extra))
        return self.tracks

    def stream(
        self,
        parent: int,
        order: int,
        name: str,
        start: list[int],
        end: list[int],
        first: int,
        last: int,
        event: SpanEvent,
    ) -> int:
        """The tracks of one stream under ``parent`` from ``order`` on: its spans, ``first`` to
        ``last`` of ``start``/``end`` (ns from the trace's start, in (start, -end) order), nested
        on as many lanes as they need; the next free ``order``."""
        for lane, events in enumerate(_nest(start[first:last], end[first:last])):
            seq = _Sequence(self, self.track(name if lane == 0 else f"{name} ({lane + 1})", parent, order))
            for k in events:
                if k >= 0:
                    seq.event(start[first + k], _BEGIN + event(first + k, seq))
                else:
                    seq.end_slice(end[first + ~k])
            order += 1
        return order


def _nest(start: list[int], end: list[int]) -> list[list[int]]:
    """Spans (in (start, -end) order) onto lanes on which they nest. Per lane its begin and end
    events in time order: ``k`` begins span k, ``~k`` ends it."""
    stacks: list[list[int]] = []  # per lane: its open spans, innermost last
    lanes: list[list[int]] = []
    for k, (s, e) in enumerate(zip(start, end)):
        for stack, events in zip(stacks, lanes):
            while stack and end[stack[-1]] <= s:
                events.append(~stack.pop())
            if not stack or e <= end[stack[-1]]:
                stack.append(k)
                events.append(k)
                break
        else:
            stacks.append([k])
            lanes.append([k])
    for stack, events in zip(stacks, lanes):
        events.extend(~k for k in reversed(stack))
    return lanes


def _iteration(its: list[tuple[int, int, int, int, str]], k: int, seq: _Sequence) -> bytes:
    """The event of iteration span ``k`` of ``its`` (:attr:`Layout.iterations` entries)."""
    return seq.named(its[k][4], "iteration") + seq.annotations([("iteration", its[k][1])])


class _Nodes:
    """Node rows (:func:`prismllm.trace.perfetto.node_rows`) as span events; ``flows``: per row
    its ``flow_ids`` fields."""

    def __init__(self, rows: list[tuple[Any, ...]], group_label: dict[int, str], flows: list[bytes]) -> None:
        self.rows, self.group_label, self.flows = rows, group_label, flows

    def event(self, k: int, seq: _Sequence) -> bytes:
        name, cat, args = node_event(self.rows[k], self.group_label)
        return seq.named(name, cat) + seq.annotations(args) + self.flows[k]


def export_perfetto_proto(trace: PrismTrace, out: str | os.PathLike, ranks: list[int] | None = None) -> dict[str, Any]:
    """Write the Perfetto protobuf trace of the graph (or of some ``ranks`` only). Returns the
    counts :func:`prismllm.trace.perfetto.export_perfetto` returns, with ``packets`` and
    ``tracks`` for its ``events``."""
    if ranks is not None:
        trace = select_ranks(trace, ranks)
    return write_atomically(Path(out), lambda f: _write(trace, f), binary=True)


def _write(trace: PrismTrace, f: BinaryIO) -> dict[str, Any]:
    lay = layout(trace)
    out = _Out(f)
    t0 = lay.t0

    # the flows of each node row (it is an end of), ids from 1 in the order of lay.flow_src
    n_flows = len(lay.flow_src)
    ends = np.concatenate([lay.flow_src, lay.flow_dst])
    o = np.argsort(ends, kind="stable")
    flow_rows = ends[o]
    flow_fields = [_K_FLOW + struct.pack("<Q", x) for x in np.tile(np.arange(1, n_flows + 1), 2)[o].tolist()]

    # the rows shown, rank by rank, each rank's track by track, its spans in (start, -end) order
    rows = np.flatnonzero(lay.known)
    rows = rows[np.lexsort((-lay.end[rows], lay.start[rows], lay.tid[rows], lay.rank[rows]))]
    bounds = np.searchsorted(lay.rank[rows], lay.ranks + [max(lay.ranks, default=0) + 1])
    iterations: dict[int, list[tuple[int, int, int, int, str]]] = {}
    for it in sorted(lay.iterations, key=lambda x: (x[2], -x[3])):
        iterations.setdefault(it[0], []).append(it)

    # the graph's facts first, for a reader that stops early
    n_nodes = len(rows)
    skipped = len(lay.known) - n_nodes
    facts = metadata(trace, lay) | {"nodes_exported": n_nodes, "nodes_without_times": skipped, "flows": n_flows}
    attributes = b""
    for name, v in facts.items():
        if v is None:
            continue
        value = (
            varint_field(TA_LONG, v)
            if isinstance(v, int)
            else len_field(TA_STRING, (v if isinstance(v, str) else json.dumps(v)).encode())
        )
        attributes += len_field(TA_ATTRIBUTE, len_field(TA_KEY, f"prismtrace.{name}".encode()) + value)
    out.packet(len_field(P_TRACE_ATTRIBUTES, attributes))

    explicit = varint_field(TD_CHILD_ORDERING, CHILD_ORDERING_EXPLICIT)
    root = out.track("ranks", extra=explicit)
    for k, r in enumerate(lay.ranks):
        parent = out.track(f"rank {r}", root, r, explicit)
        order = 0
        mine = iterations.get(r, [])
        if mine:
            start = [s - t0 for _, _, s, _, _ in mine]
            end = [e - t0 for _, _, _, e, _ in mine]
            order = out.stream(parent, order, "iterations", start, end, 0, len(mine), partial(_iteration, mine))

        sel = rows[bounds[k] : bounds[k + 1]]
        if len(sel):
            lo = np.searchsorted(flow_rows, sel, side="left").tolist()
            hi = np.searchsorted(flow_rows, sel, side="right").tolist()
            flows = [b"".join(flow_fields[a:b]) for a, b in zip(lo, hi)]
            nodes = _Nodes(list(node_rows(trace.nodes.take(sel))), lay.group_label, flows)
            tid = lay.tid[sel]
            start, end = (lay.start[sel] - t0).tolist(), (lay.end[sel] - t0).tolist()
            cuts = np.flatnonzero(np.r_[True, tid[1:] != tid[:-1], True]).tolist()
            for a, b in zip(cuts[:-1], cuts[1:]):
                order = out.stream(parent, order, lay.track_names[int(tid[a])], start, end, a, b, nodes.event)

        if r in lay.peak_memory:
            track = out.track(
                MEMORY_COUNTER, parent, order, len_field(TD_COUNTER, varint_field(CD_UNIT, UNIT_SIZE_BYTES))
            )
            seq = _Sequence(out, track)
            for ts in (0, lay.t_end - t0):
                seq.event(ts, varint_field(TE_TYPE, COUNTER) + varint_field(TE_COUNTER_VALUE, lay.peak_memory[r]))

    out.flush()
    return {
        "packets": out.packets,
        "tracks": out.tracks,
        "nodes": n_nodes,
        "nodes_without_times": skipped,
        "flows": n_flows,
        "iterations": len(lay.iterations),
        "memory_counters": len(lay.peak_memory),
        "synthetic": lay.synthetic,
    }
