"""Kineto (Holistic Trace Analysis) and Chakra (ASTRA-sim) exports of a PrismTrace.

The graph: 4 ranks in lockstep, 2 iterations of 200 µs, each (times in µs from the iteration
start):

    0..100    compute "forward"
    100..120  all_reduce on the rank's tp group ({0,1} or {2,3}), 4 KiB
    120..150  async all_reduce on the world group, 1 MiB, waited for by "optimizer"
    120..170  compute "backward"      (overlaps the async all_reduce entirely)
    170..180  compute "optimizer"     (the wait point)
    180..185  send 0->2, 1->3 (ranks 2, 3 recv), 2 KiB
    185..200  idle

So per rank and iteration: 160 µs compute, 55 µs communication of which 30 µs overlap compute,
15 µs idle at the end.
"""

from __future__ import annotations

import json
import re

import pytest

from prismllm.errors import PrismError
from prismllm.trace import TraceError, assemble
from prismllm.trace.chakra import COMM_GROUP_FILE, export_chakra
from prismllm.trace.kineto import STREAM_COMPUTE, export_kineto
from prismllm.trace.ranklog import GroupInfo, RankLog
from prismllm.trace.synth import example_logs

US = 1000
T0 = 1_700_000_000_000_000_000  # a time.time_ns() value
ITER_US = 200
WORLD = 4
GROUPS = [GroupInfo("0", "default_pg", [0, 1, 2, 3]), GroupInfo("tp0", "tp", [0, 1]), GroupInfo("tp1", "tp", [2, 3])]


def program(rank: int) -> RankLog:
    nodes: list[dict] = []

    def add(it: int, s: int, e: int, **kw) -> dict:
        """A node of iteration ``it`` from ``s`` to ``e`` µs after the iteration's start."""
        base = T0 + it * ITER_US * US
        kw.setdefault("op", "compute")
        kw["kind"] = "compute" if kw["op"] == "compute" else "comm"
        kw.update(
            rank=rank,
            index=len(nodes),
            iteration=it,
            issue_ns=base + s * US,
            start_ns=base + s * US,
            end_ns=base + e * US,
            duration_ns=(e - s) * US,
        )
        nodes.append(kw)
        return kw

    for it in range(2):
        add(it, 0, 100, label="forward")
        add(
            it,
            100,
            120,
            op="all_reduce",
            group_name=f"tp{rank // 2}",
            in_bytes=4096,
            out_bytes=4096,
            dtype="float32",
            reduce_op="sum",
        )
        grad = add(
            it,
            120,
            150,
            op="all_reduce",
            group_name="0",
            in_bytes=1 << 20,
            out_bytes=1 << 20,
            dtype="bfloat16",
            reduce_op="avg",
            async_op=True,
        )
        add(it, 120, 170, label="backward")
        grad["wait_index"] = add(it, 170, 180, label="optimizer")["index"]
        if rank < 2:
            add(it, 180, 185, op="send", group_name="0", peer=rank + 2, in_bytes=2048, dtype="float32")
        else:
            add(it, 180, 185, op="recv", group_name="0", peer=rank - 2, out_bytes=2048, dtype="float32")
    iterations = [
        {"iteration": i, "start_ns": T0 + i * ITER_US * US, "end_ns": T0 + (i + 1) * ITER_US * US, "label": ""}
        for i in range(2)
    ]
    return RankLog(
        rank=rank, world_size=WORLD, device="cpu", clock="host", nodes=nodes, groups=GROUPS, iterations=iterations
    )


@pytest.fixture(scope="module")
def trace():
    return assemble([program(r) for r in range(WORLD)], {"mode": "record", "command": ["python", "train.py"]})


# ---------------------------------------------------------------------- Kineto
def read_events(path):
    with open(path) as f:
        first_lines = [f.readline() for _ in range(2)]
        f.seek(0)
        doc = json.load(f)
    return first_lines, doc


def test_kineto_files(trace, tmp_path):
    stats = export_kineto(trace, tmp_path / "k", keep_warmup=True)
    assert stats["files"] == [str(tmp_path / "k" / f"rank-{r}.json") for r in range(WORLD)]
    assert (stats["ranks"], stats["kernels"], stats["nodes_without_times"], stats["profiler_steps"]) == (4, 48, 0, 8)
    assert stats["base_time_ns"] == T0
    for r in range(WORLD):
        lines, doc = read_events(tmp_path / "k" / f"rank-{r}.json")
        # HTA finds the rank with a line-wise regex before it parses anything
        assert re.search(r'"rank":\s+(\d+)', lines[1]).group(1) == str(r)
        info = doc["distributedInfo"]
        assert (info["rank"], info["world_size"], info["backend"]) == (r, WORLD, "nccl")
        assert [g["pg_name"] for g in info["pg_config"]] == ["0", f"tp{r // 2}"]
        assert doc["baseTimeNanoseconds"] == T0
        events = doc["traceEvents"]
        kernels = [e for e in events if e.get("cat") == "kernel"]
        launches = {e["args"]["correlation"]: e for e in events if e.get("name") == "cudaLaunchKernel"}
        assert len(kernels) == 12 and set(launches) == {k["args"]["correlation"] for k in kernels}
        comm = [k for k in kernels if k["name"].startswith("ncclKernel_")]
        assert [k["name"] for k in comm[:4]] == [
            "ncclKernel_AllReduce",
            "ncclKernel_AllReduce",
            "ncclKernel_Send" if r < 2 else "ncclKernel_Recv",
            "ncclKernel_AllReduce",
        ]
        # compute on one stream, each group's communication on a stream of its own
        assert {k["args"]["stream"] for k in kernels if k not in comm} == {STREAM_COMPUTE}
        tp_stream = {k["args"]["stream"] for k in comm if k["args"]["Process Group Name"].startswith("tp")}
        world_stream = {k["args"]["stream"] for k in comm if k["args"]["Process Group Name"] == "0"}
        assert len(tp_stream) == len(world_stream) == 1 and tp_stream != world_stream
        assert STREAM_COMPUTE not in tp_stream | world_stream
        grad = comm[1]
        assert (grad["ts"], grad["dur"]) == (120, 30)
        assert (grad["args"]["In msg nelems"], grad["args"]["Group size"]) == (1 << 19, 4)
        steps = [(e["name"], e["ts"], e["dur"]) for e in events if e["name"].startswith("ProfilerStep#")]
        # each step ends 1 ns before the next begins: HTA's step window includes its end
        assert steps == [("ProfilerStep#0", 0, 199.999), ("ProfilerStep#1", 200, 199.999)]


def test_kineto_ranks(trace, tmp_path):
    stats = export_kineto(trace, tmp_path / "k", ranks=[2], keep_warmup=True)
    assert stats["files"] == [str(tmp_path / "k" / "rank-2.json")] and stats["kernels"] == 12
    with pytest.raises(PrismError, match="rank 7 is outside the graph's world of 4 ranks"):
        export_kineto(trace, tmp_path / "k2", ranks=[7])


def hta_analysis(trace_dir, **kw):
    pytest.importorskip(
        "hta.trace_analysis", reason="Holistic Trace Analysis (pip install holistictraceanalysis) is not installed"
    )
    from hta.trace_analysis import TraceAnalysis

    return TraceAnalysis(trace_dir=str(trace_dir), **kw)


@pytest.mark.filterwarnings("ignore::FutureWarning")  # HTA's own pandas calls
def test_kineto_in_hta(trace, tmp_path):
    # by default the warm-up (iteration 0) is left out, as a PyTorch profile with a warm-up step
    stats = export_kineto(trace, tmp_path / "k")
    assert (stats["kernels"], stats["warmup_nodes"], stats["profiler_steps"]) == (24, 24, 4)
    analysis = hta_analysis(tmp_path / "k")
    assert analysis.get_profiler_steps() == [1]
    # one step of 185 µs of kernels: HTA keeps a trace's only step
    breakdown = analysis.get_temporal_breakdown(visualize=False).set_index("rank")
    assert sorted(breakdown.index) == [0, 1, 2, 3]
    for r in range(WORLD):
        row = breakdown.loc[r]
        assert row["compute_time(us)"] == pytest.approx(160)
        assert row["non_compute_time(us)"] == pytest.approx(20 + 5)  # communication not under compute
        assert row["kernel_time(us)"] == pytest.approx(185) and row["idle_time(us)"] == 0
    overlap = analysis.get_comm_comp_overlap(visualize=False).set_index("rank")
    # 30 of every 55 µs of communication run under compute
    assert list(overlap["comp_comm_overlap_pctg"]) == [pytest.approx(round(100 * 30 / 55, 2))] * WORLD

    # the warm-up kept: all profiler steps, 2 iterations of 185 µs of kernels and 15 µs idle between
    export_kineto(trace, tmp_path / "all", keep_warmup=True)
    analysis = hta_analysis(tmp_path / "all", include_last_profiler_step=True)
    assert analysis.get_profiler_steps() == [0, 1]
    breakdown = analysis.get_temporal_breakdown(visualize=False).set_index("rank")
    assert list(breakdown["compute_time(us)"]) == [pytest.approx(2 * 160)] * WORLD
    assert list(breakdown["idle_time(us)"]) == [pytest.approx(15)] * WORLD
    assert list(breakdown["kernel_time(us)"]) == [pytest.approx(ITER_US + 185)] * WORLD
    # by default HTA leaves out the last profiler step, as a real profile's last step is cut short
    breakdown = hta_analysis(tmp_path / "all").get_temporal_breakdown(visualize=False).set_index("rank")
    assert list(breakdown["compute_time(us)"]) == [pytest.approx(160)] * WORLD


@pytest.mark.filterwarnings("ignore::FutureWarning")  # HTA's own pandas calls
@pytest.mark.parametrize("keep_warmup", [False, True])
def test_kineto_hta_critical_path(trace, tmp_path, keep_warmup):
    """HTA's critical path of the steady iteration runs through the kernels the graph makes
    wait for each other across streams: forward, the rank's tp all_reduce (sync), backward,
    optimizer, send/recv; not the async world all_reduce that backward overlaps."""
    stats = export_kineto(trace, tmp_path / "k", keep_warmup=keep_warmup)
    assert stats["stream_waits"] == (44 if keep_warmup else 20)
    analysis = hta_analysis(tmp_path / "k", include_last_profiler_step=True)
    gid = {g["name"]: i for i, g in trace.group_info().items()}
    world = stats["streams"][f"comm:{gid['0']}"]
    for r in range(WORLD):
        tp = stats["streams"][f"comm:{gid[f'tp{r // 2}']}"]
        # the steady iteration: the first step, or the second where the warm-up is kept
        graph, ok = analysis.critical_path_analysis(rank=r, annotation="ProfilerStep", instance_id=int(keep_warmup))
        assert ok
        path = graph.get_critical_path_breakdown()
        kernels = path[path["type"].eq("critical_path_operator") & path["stream"].ge(0)]
        assert sorted(zip(kernels["s_name"], kernels["stream"], kernels["duration"])) == [
            ("compute: backward", STREAM_COMPUTE, 50),
            ("compute: forward", STREAM_COMPUTE, 100),
            ("compute: optimizer", STREAM_COMPUTE, 10),
            ("ncclKernel_AllReduce", tp, 20),
            ("ncclKernel_Send" if r < 2 else "ncclKernel_Recv", world, 5),
        ]
        # from stream to stream through HTA's synchronisation edges (the Stream Wait Events)
        assert path["type"].eq("critical_path_sync_dependency").sum() >= 3


@pytest.mark.filterwarnings("ignore::FutureWarning")  # HTA's own pandas calls
def test_kineto_hta_groups(trace, tmp_path):
    """Process groups carry the graph's names and descriptions, a group without one (torch's
    "undefined") its ranks, in distributedInfo and in every communication kernel's args."""
    import pyarrow as pa

    from prismllm.trace.graph import PrismTrace

    g = trace.groups
    desc = ["undefined" if n.startswith("tp") else d for n, d in zip(g["name"].to_pylist(), g["desc"].to_pylist())]
    groups = g.set_column(g.schema.get_field_index("desc"), "desc", pa.array(desc, pa.string()))
    unnamed = PrismTrace(
        manifest=trace.manifest, nodes=trace.nodes, edges=trace.edges, groups=groups, iterations=trace.iterations
    )
    export_kineto(unnamed, tmp_path / "k")
    pytest.importorskip("hta.common.trace")
    from hta.common.trace import Trace
    from hta.configs.parser_config import ParserConfig

    available = ParserConfig.get_all_available_args()
    names = ("nccl::process_group_name", "nccl::process_group_desc", "nccl::process_group_ranks")
    hta = Trace(
        trace_dir=str(tmp_path / "k"),
        parser_config=ParserConfig(ParserConfig.get_default_args() + [available[k] for k in names]),
    )
    hta.load_traces(include_last_profiler_step=True)
    hta.decode_symbol_ids()
    for r in range(WORLD):
        tp = ("tp0", "ranks 0-1", [0, 1]) if r < 2 else ("tp1", "ranks 2-3", [2, 3])
        pgs = hta.meta_data[r]["distributedInfo"]["pg_config"]
        assert [(pg["pg_name"], pg["pg_desc"], pg["ranks"]) for pg in pgs] == [("0", "default_pg", [0, 1, 2, 3]), tp]
        df = hta.get_trace(r)
        comm = df[df["s_name"].str.startswith("ncclKernel_")]
        seen = {(n, d, tuple(json.loads(k))) for n, d, k in comm[list(c.split("::")[1] for c in names)].values}
        assert seen == {("0", "default_pg", (0, 1, 2, 3)), (tp[0], tp[1], tuple(tp[2]))}


# ---------------------------------------------------------------------- Chakra
NODE_TYPES = {"COMP_NODE": 4, "COMM_SEND_NODE": 5, "COMM_RECV_NODE": 6, "COMM_COLL_NODE": 7}
ALL_REDUCE = 0


def chakra_messages():
    """GlobalMetadata and Node classes built from descriptors mirroring the et_def.proto fields
    the exporter writes (Chakra itself is not on PyPI)."""
    pytest.importorskip("google.protobuf", reason="protobuf (pip install protobuf) is not installed")
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    T = descriptor_pb2.FieldDescriptorProto
    f = descriptor_pb2.FileDescriptorProto(name="prism_test_et_def.proto", package="ChakraProtoMsg", syntax="proto3")

    def field(msg, name, number, ftype, label=T.LABEL_OPTIONAL, type_name=None, oneof=None):
        fd = msg.field.add(name=name, number=number, type=ftype, label=label)
        if type_name:
            fd.type_name = type_name
        if oneof is not None:
            fd.oneof_index = oneof

    attr = f.message_type.add(name="AttributeProto")
    attr.oneof_decl.add(name="value")
    field(attr, "name", 1, T.TYPE_STRING)
    for name, number, ftype in [
        ("int32_val", 7, T.TYPE_INT32),
        ("int64_val", 9, T.TYPE_INT64),
        ("uint64_val", 13, T.TYPE_UINT64),
        ("bool_val", 27, T.TYPE_BOOL),
        ("string_val", 29, T.TYPE_STRING),
    ]:
        field(attr, name, number, ftype, oneof=0)
    meta = f.message_type.add(name="GlobalMetadata")
    field(meta, "version", 1, T.TYPE_STRING)
    field(meta, "attr", 2, T.TYPE_MESSAGE, T.LABEL_REPEATED, ".ChakraProtoMsg.AttributeProto")
    node_type = f.enum_type.add(name="NodeType")
    for name, number in [("INVALID_NODE", 0)] + list(NODE_TYPES.items()):
        node_type.value.add(name=name, number=number)
    node = f.message_type.add(name="Node")
    field(node, "id", 1, T.TYPE_UINT64)
    field(node, "name", 2, T.TYPE_STRING)
    field(node, "type", 3, T.TYPE_ENUM, type_name=".ChakraProtoMsg.NodeType")
    field(node, "ctrl_deps", 4, T.TYPE_UINT64, T.LABEL_REPEATED)
    field(node, "data_deps", 5, T.TYPE_UINT64, T.LABEL_REPEATED)
    field(node, "start_time_micros", 6, T.TYPE_UINT64)
    field(node, "duration_micros", 7, T.TYPE_UINT64)
    field(node, "attr", 10, T.TYPE_MESSAGE, T.LABEL_REPEATED, ".ChakraProtoMsg.AttributeProto")

    pool = descriptor_pool.DescriptorPool()
    pool.Add(f)

    def cls(name):
        desc = pool.FindMessageTypeByName(f"ChakraProtoMsg.{name}")
        if hasattr(message_factory, "GetMessageClass"):
            return message_factory.GetMessageClass(desc)
        return message_factory.MessageFactory(pool).GetPrototype(desc)  # protobuf < 4.22

    return cls("GlobalMetadata"), cls("Node")


def read_et(path, meta_cls, node_cls):
    """Length-delimited messages: the metadata, then the nodes."""
    data = path.read_bytes()
    pos, messages = 0, []
    while pos < len(data):
        size = shift = 0
        while True:
            b = data[pos]
            pos += 1
            size |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                break
        messages.append(data[pos : pos + size])
        pos += size
    meta = meta_cls.FromString(messages[0])
    return meta, [node_cls.FromString(m) for m in messages[1:]]


def attrs(node):
    return {a.name: getattr(a, a.WhichOneof("value")) for a in node.attr}


def test_chakra(trace, tmp_path):
    meta_cls, node_cls = chakra_messages()
    stats = export_chakra(trace, tmp_path / "c")
    assert stats["files"] == [str(tmp_path / "c" / f"prism.{r}.et") for r in range(WORLD)]
    assert stats["workload"] == str(tmp_path / "c" / "prism")
    assert stats["nodes"] == 48 and stats["nodes_without_times"] == 0
    assert stats["nodes_by_type"] == {"COMP_NODE": 24, "COMM_COLL_NODE": 16, "COMM_SEND_NODE": 4, "COMM_RECV_NODE": 4}
    groups = json.loads((tmp_path / "c" / COMM_GROUP_FILE).read_text())
    assert groups == {"1": [0, 1, 2, 3], "2": [0, 1], "3": [2, 3]}

    p2p = {}
    for r in range(WORLD):
        meta, nodes = read_et(tmp_path / "c" / f"prism.{r}.et", meta_cls, node_cls)
        assert meta.version == "1.0.0"
        assert attrs(meta) == {"source": "prismllm", "rank": r, "world_size": WORLD}
        assert [n.id for n in nodes] == list(range(12))
        p2p_type = NODE_TYPES["COMM_SEND_NODE" if r < 2 else "COMM_RECV_NODE"]
        assert [n.type for n in nodes[:6]] == [4, 7, 7, 4, 4, p2p_type]
        assert [n.duration_micros for n in nodes[:6]] == [100, 20, 30, 50, 10, 5]
        assert nodes[6].start_time_micros == ITER_US
        # tp all_reduce, then the async world all_reduce: types, sizes, groups (pg_name = group id + 1)
        tp, grad = attrs(nodes[1]), attrs(nodes[2])
        assert nodes[1].attr[1].WhichOneof("value") == "int64_val"  # ALL_REDUCE = 0 is still written
        assert tp == {"is_cpu_op": False, "comm_type": ALL_REDUCE, "comm_size": 4096, "pg_name": str(2 + r // 2)}
        assert grad == {"is_cpu_op": False, "comm_type": ALL_REDUCE, "comm_size": 1 << 20, "pg_name": "1"}
        assert r in groups[tp["pg_name"]]
        # dependencies: program order, except that "backward" does not wait for the async
        # all_reduce; "optimizer" (the wait point) does, and so does the next call on its stream
        deps = [list(n.data_deps) for n in nodes]
        assert deps[:7] == [[], [0], [1], [1], [2, 3], [2, 4], [5]]
        assert all(not n.ctrl_deps for n in nodes)
        for n in nodes:
            if n.type in (5, 6):
                a = attrs(n)
                p2p.setdefault((a["comm_src"], a["comm_dst"], a["comm_tag"]), []).append((r, n.type, a["comm_size"]))
    # every send meets its recv on (src, dst, tag): 0->2 and 1->3, once per iteration
    assert len(p2p) == 4 and {(src, dst) for src, dst, _ in p2p} == {(0, 2), (1, 3)}
    for (src, dst, _), ends in p2p.items():
        assert sorted(ends) == [(src, 5, 2048), (dst, 6, 2048)]


def test_chakra_ranks(trace, tmp_path):
    stats = export_chakra(trace, tmp_path / "c", ranks=[0, 3], prefix="job")
    assert stats["files"] == [str(tmp_path / "c" / "job.0.et"), str(tmp_path / "c" / "job.3.et")]
    assert stats["nodes"] == 24


# ---------------------------------------------------------------------- no times
@pytest.mark.parametrize("export", [export_kineto, export_chakra])
def test_bare_graph(export, tmp_path):
    bare = assemble(example_logs(times=False), {"mode": "capture"})
    with pytest.raises(TraceError) as e:
        export(bare, tmp_path / "out")
    message = str(e.value)
    assert "the graph has no times (a bare graph)" in message and "\n" not in message
    assert not (tmp_path / "out").exists()
