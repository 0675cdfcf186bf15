"""The MoE mock router (prismllm.routing): statistics to counts, counts to logits, forcing and
observing a router inside a model, and measuring observed routing back into statistics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from prismllm.routing import measure
from prismllm.routing.assign import logits_for, topk_indices
from prismllm.routing.router import RouterSpec, install
from prismllm.routing.stats import (
    BALANCED,
    BalanceStats,
    RoutingError,
    achieved,
    balance_stats,
    counts_for,
    load_routing,
    parse_routing,
)

ROOT = Path(__file__).resolve().parents[1]
SKEWED = BalanceStats(br_min=0.7, br_max=2.2, br_avg=1.0, br_std=0.35, br_med=0.95, br_skew=1.5)
HEAVY = BalanceStats(br_min=0.2, br_max=3.5, br_avg=1.0, br_std=0.6, br_med=0.9, br_skew=2.5)


# ---------------------------------------------------------------------------------------------
# statistics -> counts
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "stats,experts,tokens,topk",
    [(SKEWED, 64, 4096, 8), (SKEWED, 32, 1024, 2), (HEAVY, 256, 16384, 8), (BALANCED, 16, 512, 2)],
)
def test_counts_round_trip_to_the_requested_stats(stats, experts, tokens, topk):
    counts = counts_for(stats, experts, tokens, topk)
    got = balance_stats(counts)
    unit = experts / (tokens * topk)  # one token, as a ratio
    assert got.br_avg == pytest.approx(1.0)
    assert got.br_min == pytest.approx(stats.br_min, abs=unit)  # exact up to rounding
    assert got.br_max == pytest.approx(stats.br_max, abs=unit)
    assert got.br_med == pytest.approx(stats.br_med, abs=2 * unit)
    assert got.br_std == pytest.approx(stats.br_std, rel=0.01, abs=2 * unit)
    assert got.br_skew == pytest.approx(stats.br_skew, rel=0.02, abs=0.02)
    assert achieved(stats, experts, tokens, topk) == got


@pytest.mark.parametrize(
    "stats,experts,tokens,topk",
    [
        (SKEWED, 64, 4096, 8),
        (HEAVY, 8, 100, 4),  # br_max 3.5 > experts/topk = 2: capped at every token
        (SKEWED, 3, 64, 1),
        (SKEWED, 2, 64, 1),
        (HEAVY, 5, 7, 5),  # every token picks every expert
        (BALANCED, 16, 500, 3),
        (SKEWED, 6, 1, 2),
    ],
)
def test_counts_and_assignment_invariants(stats, experts, tokens, topk):
    counts = counts_for(stats, experts, tokens, topk, key="layers.0.mlp.router")
    assert counts.dtype == np.int64 and counts.shape == (experts,)
    assert counts.sum() == tokens * topk and counts.min() >= 0 and counts.max() <= tokens
    idx = topk_indices(counts, tokens)
    assert idx.shape == (tokens, topk)
    assert all(len(set(row)) == topk for row in idx.tolist()), "a token picks an expert at most once"
    assert np.bincount(idx.reshape(-1), minlength=experts).tolist() == counts.tolist()
    logits = torch.from_numpy(logits_for(counts, tokens))
    picked = logits.topk(topk, dim=-1).indices.sort(dim=-1).values
    assert picked.tolist() == np.sort(idx, axis=1).tolist()
    assert torch.allclose(logits.topk(topk, dim=-1).values.softmax(-1), torch.full((tokens, topk), 1 / topk))


def test_the_cap_and_exact_max_where_integers_allow():
    counts = counts_for(HEAVY, 8, 100, 4)  # br_max 3.5 asks for 175 tokens of 100
    assert counts.max() == 100
    assert counts_for(SKEWED, 64, 4096, 8).max() == round(2.2 * 4096 * 8 / 64)


def test_counts_are_deterministic_and_the_permutation_follows_the_key():
    a = counts_for(SKEWED, 64, 4096, 8, key="decoder.layers.0.mlp.router")
    assert np.array_equal(a, counts_for(SKEWED, 64, 4096, 8, key="decoder.layers.0.mlp.router"))
    b = counts_for(SKEWED, 64, 4096, 8, key="decoder.layers.1.mlp.router")
    assert sorted(a) == sorted(b) and a.argmax() != b.argmax()
    code = (
        "from prismllm.routing.stats import BalanceStats, counts_for;"
        "print(counts_for(BalanceStats(0.7, 2.2, 1.0, 0.35, 0.95, 1.5), 64, 4096, 8,"
        " key='decoder.layers.0.mlp.router').tolist())"
    )
    env = {**os.environ, "PYTHONHASHSEED": "123"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == a.tolist()


# ---------------------------------------------------------------------------------------------
# routing files
# ---------------------------------------------------------------------------------------------
GOOD = SKEWED.to_dict()


def test_a_routing_file_selects_stats_by_regex(tmp_path):
    f = tmp_path / "routing.json"
    f.write_text(json.dumps({"default": GOOD, "modules": {r"layers\.1\.": "balanced", "@7$": GOOD}}))
    routing = load_routing(f)
    assert routing.stats_for("layers.1.mlp.router") == BALANCED
    assert routing.stats_for("layers.3.mlp.router@7") == SKEWED
    assert routing.stats_for("layers.11.mlp.router") == SKEWED
    assert parse_routing(routing.to_json()) == routing
    assert parse_routing({}).stats_for("x") == BALANCED


@pytest.mark.parametrize(
    "content,message",
    [
        ("{not json", "not JSON (Expecting property name"),
        ([1, 2], 'expected a JSON object with "default" and/or "modules"'),
        ({"defaults": GOOD}, "unknown key 'defaults'"),
        ({"default": "skewed"}, 'default: expected "balanced" or an object with br_min'),
        ({"default": {**GOOD, "br_std": None}}, "default: br_std must be a finite number, not None"),
        ({"default": {k: v for k, v in GOOD.items() if k != "br_med"}}, "default: missing br_med"),
        ({"default": {**GOOD, "br_p99": 2}}, "default: unknown br_p99"),
        ({"default": {**GOOD, "br_avg": 1.2}}, "br_avg 1.2 must be 1"),
        ({"default": {**GOOD, "br_max": 0.9}}, "br_max 0.9 < 1"),
        ({"default": {**GOOD, "br_min": 1.1}}, "br_min 1.1 > 1"),
        ({"default": {**GOOD, "br_min": -0.1}}, "br_min -0.1 is negative"),
        ({"default": {**GOOD, "br_min": 0.9, "br_med": 0.8}}, "br_min 0.9 > br_med 0.8"),
        ({"default": {**GOOD, "br_med": 2.5}}, "br_med 2.5 > br_max 2.2"),
        ({"default": {**GOOD, "br_std": 0.9}}, "br_std 0.9 exceeds 0.6, the most that br_min 0.7 and br_max 2.2"),
        ({"modules": {"layers.(": GOOD}}, "modules: 'layers.(' is not a valid regex"),
        ({"modules": {"x": {**GOOD, "br_max": 0.5}}}, "modules['x']: br_max 0.5 < 1"),
        ({"modules": [GOOD]}, '"modules" must map a regex'),
    ],
)
def test_a_bad_routing_file_is_one_clear_message(tmp_path, content, message):
    f = tmp_path / "routing.json"
    f.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(RoutingError) as e:
        load_routing(f)
    text = str(e.value)
    assert text.startswith(f"routing file {f}: ") and message in text and "\n" not in text, text


def test_a_missing_routing_file_and_a_bad_spec(tmp_path):
    with pytest.raises(RoutingError, match="cannot read it"):
        load_routing(tmp_path / "absent.json")
    with pytest.raises(RoutingError, match="expected NAME_OR_TYPE"):
        RouterSpec.parse("TopKRouter:gat-ing")
    assert RouterSpec.parse("TopKRouter:gating") == RouterSpec("TopKRouter", "gating")
    assert RouterSpec.parse("*.mlp.router") == RouterSpec("*.mlp.router", "forward")


# ---------------------------------------------------------------------------------------------
# forcing a router in a model
# ---------------------------------------------------------------------------------------------
class Router(nn.Module):
    def __init__(self, hidden: int, experts: int, topk: int, layer_number: int | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(experts, hidden) * 0.02)
        self.topk = topk
        if layer_number is not None:
            self.layer_number = layer_number

    def forward(self, tokens):
        return F.linear(tokens.float(), self.weight.float())


class MoE(nn.Module):
    """gpt3d's routing, without the experts: counts per expert of one forward."""

    def __init__(self, hidden: int, experts: int, topk: int, layer_number: int | None = None):
        super().__init__()
        self.router = Router(hidden, experts, topk, layer_number)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x):
        logits = self.router(x.reshape(-1, x.shape[-1]))
        top, idx = logits.topk(self.router.topk, dim=-1)
        self.counts = torch.bincount(idx.reshape(-1), minlength=logits.shape[-1])
        return self.proj(x) * top.softmax(-1).sum(-1, keepdim=True).view(x.shape[0], x.shape[1], 1)


class Block(nn.Module):
    def __init__(self, mlp: nn.Module):
        super().__init__()
        self.mlp = mlp

    def forward(self, x):
        return x + self.mlp(x)


class Model(nn.Module):
    """gpt3d's module names: layers.<i>.mlp.router."""

    def __init__(self, layers: int = 2, hidden: int = 16, experts: int = 8, topk: int = 2, numbered: bool = False):
        super().__init__()
        self.layers = nn.ModuleList(
            Block(MoE(hidden, experts, topk, i + 1 if numbered else None)) for i in range(layers)
        )

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class Wrapper(nn.Module):
    """DDP's shape: the model under ``module``."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, x):
        return self.module(x)


@pytest.fixture
def installed():
    """Installations made by a test, closed after it."""
    made = []

    def make(*args, **kwargs):
        made.append(install(*args, **kwargs))
        return made[-1]

    yield make
    for inst in made:
        inst.close()


ROUTING = {"default": SKEWED.to_dict(), "modules": {r"layers\.1\.": "balanced"}}


@pytest.mark.parametrize(
    "spec,wrapped,keys",
    [
        ("Router", False, ["layers.0.mlp.router", "layers.1.mlp.router"]),
        ("*.mlp.router", True, ["module.layers.0.mlp.router", "module.layers.1.mlp.router"]),
        ("layers.1.mlp.router", False, ["layers.1.mlp.router"]),
    ],
)
def test_install_forces_the_routing_by_type_and_by_name(installed, spec, wrapped, keys):
    torch.manual_seed(0)
    model = Model()
    top = Wrapper(model) if wrapped else model
    inst = installed(spec, parse_routing(ROUTING))
    top(torch.randn(16, 4, 16)).sum().backward()  # 64 tokens; the gates' backward runs on forced logits
    assert sorted(inst.routers) == keys
    counts = [layer.mlp.counts for layer in model.layers]
    assert counts[1].tolist() == [16] * 8  # balanced
    if len(keys) == 1:
        return
    assert counts[0].tolist() == counts_for(SKEWED, 8, 64, 2, key=keys[0]).tolist()
    assert model.layers[0].mlp.router.weight.grad is not None
    top(torch.randn(16, 4, 16))  # other values, the same routing: recomputation routes alike
    assert torch.equal(model.layers[0].mlp.counts, counts[0])


def test_layer_numbers_key_the_routers_and_seed_the_permutation(installed):
    model = Model(layers=3, numbered=True)
    inst = installed("Router", parse_routing({"default": SKEWED.to_dict()}))
    model(torch.randn(8, 8, 16))
    assert sorted(inst.routers) == ["layers.0.mlp.router@1", "layers.1.mlp.router@2", "layers.2.mlp.router@3"]
    for i, layer in enumerate(model.layers):
        assert layer.mlp.counts.tolist() == counts_for(SKEWED, 8, 64, 2, key=f"layer {i + 1}").tolist()
    assert len({tuple(layer.mlp.counts.tolist()) for layer in model.layers}) == 3


def test_chunks_with_the_same_names_get_keys_of_their_own(installed):
    """Virtual pipeline chunks without layer numbers: two roots, the same qualified names."""
    chunks = [Model(), Model()]
    inst = installed("Router", parse_routing({"default": SKEWED.to_dict()}))
    for chunk in chunks:
        chunk(torch.randn(16, 4, 16))
    assert sorted(inst.routers) == [
        "layers.0.mlp.router",
        "layers.0.mlp.router#2",
        "layers.1.mlp.router",
        "layers.1.mlp.router#2",
    ]
    want = counts_for(SKEWED, 8, 64, 2, key="layers.0.mlp.router#2").tolist()
    assert chunks[1].layers[0].mlp.counts.tolist() == want != chunks[0].layers[0].mlp.counts.tolist()


def test_close_gives_the_program_its_modules_back():
    layer = Wrapper(TopKRouter())
    own = TopKRouter()
    own.gating = own_gating = lambda x: torch.zeros(*x.shape[:-1], 8)
    inst = install("TopKRouter:gating", parse_routing({}))
    layer(torch.randn(4, 2, 16))
    Wrapper(own)(torch.randn(4, 2, 16))
    assert "gating" in layer.module.__dict__ and own.gating is not own_gating
    inst.close()
    assert "gating" not in layer.module.__dict__ and own.gating is own_gating
    inst = install("Router", parse_routing({}))
    model = Model(layers=1)
    model(torch.randn(4, 2, 16))
    assert model.layers[0].mlp.router._forward_hooks
    inst.close()
    assert not model.layers[0].mlp.router._forward_hooks


class _Gate(torch.autograd.Function):
    """Megatron's RouterGatingLinearFunction: a view of an internal tensor comes out."""

    @staticmethod
    def forward(ctx, inp, weight):
        ctx.save_for_backward(inp, weight)
        out = torch.mm(inp.view(-1, inp.shape[-1]).float(), weight.float().t())
        return out.view(*inp.shape[:-1], -1)

    @staticmethod
    def backward(ctx, grad):
        inp, weight = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        return (g @ weight.float()).view(inp.shape).to(inp.dtype), (g.t() @ inp.view(-1, inp.shape[-1]).float())


class TopKRouter(nn.Module):
    """Megatron-core's shape: gating() returns [s, b, E] logits, routing() picks top-k."""

    def __init__(self, hidden: int = 16, experts: int = 8, topk: int = 2):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(experts, hidden) * 0.02)
        self.topk = topk

    def gating(self, x):
        return _Gate.apply(x, self.weight)

    def forward(self, x):
        logits = self.gating(x)
        probs, idx = logits.view(-1, logits.shape[-1]).topk(self.topk, dim=-1)
        return probs.softmax(-1), idx


def test_megatron_style_gating_method(installed):
    layer = Wrapper(TopKRouter())  # Megatron's MoELayer calls self.router
    inst = installed("TopKRouter:gating", parse_routing({"default": HEAVY.to_dict()}))
    x = torch.randn(16, 4, 16, requires_grad=True)
    probs, idx = layer(x)
    (probs.sum() + x.sum()).backward()
    assert list(inst.routers) == ["module"]
    want = counts_for(HEAVY, 8, 64, 2, key="module")
    assert torch.bincount(idx.reshape(-1), minlength=8).tolist() == want.tolist()
    assert torch.equal(probs, torch.full_like(probs, 0.5))


def test_a_method_that_does_not_return_logits_is_one_clear_message(installed):
    router = TopKRouter()
    installed("TopKRouter", parse_routing({}))  # forward returns (probs, indices)
    with pytest.raises(
        RoutingError, match=r"router TopKRouter \(TopKRouter\): the routed method returned tuple.*TopKRouter:gating"
    ):
        router(torch.randn(4, 2, 16))


class _Ops(TorchDispatchMode):
    """Every aten op run, and how many of its outputs have storage of their own."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {
            t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
        }
        out = func(*args, **kwargs)
        new = [
            t
            for t in tree_flatten(out)[0]
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs
        ]
        self.ops.append((str(func), len(new)))
        return out


def test_forcing_adds_no_allocation_only_a_copy_into_the_output(installed):
    torch.manual_seed(0)
    model = Model(layers=1)
    x = torch.randn(16, 4, 16)

    def ops() -> list[tuple[str, int]]:
        with _Ops() as mode, torch.no_grad():
            model(x)
        return mode.ops

    plain = ops()
    installed("Router", parse_routing({"default": SKEWED.to_dict()}))
    model(x)  # first call: the pattern is built (host memory, once per router and shape)
    forced = ops()
    extra = list(forced)
    for op in plain:
        extra.remove(op)
    assert sorted(extra) == [("aten.copy_.default", 0), ("aten.detach.default", 0)]
    assert sum(n for _, n in forced) == sum(n for _, n in plain)


@pytest.mark.gpu
def test_forcing_on_cuda_allocates_no_device_memory(installed):
    model = Model(layers=2).cuda()
    x = torch.randn(64, 8, 16, device="cuda")

    def allocations() -> tuple[int, int]:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_stats()
        model(x).sum().backward()
        torch.cuda.synchronize()
        after = torch.cuda.memory_stats()
        return after["allocation.all.allocated"] - before["allocation.all.allocated"], after["allocated_bytes.all.peak"]

    allocations()  # warm up the caching allocator and the kernels
    plain = allocations()
    installed("Router", parse_routing({"default": SKEWED.to_dict()}))
    model(x)  # the patterns are built: pinned host memory
    assert allocations() == plain
    want = counts_for(SKEWED, 8, 512, 2, key="layers.0.mlp.router").tolist()
    assert model.layers[0].mlp.counts.tolist() == want


@pytest.mark.gpu
def test_observing_on_cuda_allocates_no_device_memory(installed, tmp_path):
    """A Megatron-shaped bf16 gate with a sigmoid score and an expert bias, observed on CUDA."""
    wanted = counts_for(HEAVY, 16, 4096, 4, key="w")
    fixed = torch.from_numpy(logits_for(wanted, 4096)).to("cuda", torch.bfloat16).view(512, 8, 16)
    router = TopKRouter(experts=16, topk=4).cuda()
    router.score_function = "sigmoid"
    router.expert_bias = torch.linspace(-0.3, 0.3, 16, device="cuda")
    router.gating = lambda x: fixed.clone()
    layer = Wrapper(router)
    x = torch.randn(512, 8, 16, device="cuda")

    def allocations() -> int:
        torch.cuda.synchronize()
        before = torch.cuda.memory_stats()["allocation.all.allocated"]
        for _ in range(5):
            layer(x)
        torch.cuda.synchronize()
        return torch.cuda.memory_stats()["allocation.all.allocated"] - before

    allocations()
    plain = allocations()
    inst = installed("TopKRouter:gating", observe_dir=tmp_path)
    assert allocations() == plain
    calls = json.loads(inst.flush().read_text())["routers"]["module"]["calls"]
    assert calls == [wanted.tolist()] * 5


def test_megatron_routing_picks_the_assigned_experts():
    """Megatron-core's own top-k with each score function, pre-softmax and an expert bias."""
    moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")
    counts = counts_for(SKEWED, 16, 128, 4, key="k")
    logits = torch.from_numpy(logits_for(counts, 128)).to(torch.bfloat16)
    bias = torch.linspace(-0.4, 0.4, 16)
    for kw in (
        {"score_function": "softmax"},
        {"score_function": "softmax", "use_pre_softmax": True},
        {"score_function": "sigmoid", "expert_bias": bias},
        {"score_function": "sigmoid", "expert_bias": bias, "scaling_factor": 2.5},
    ):
        probs, routing_map = moe_utils.topk_routing_with_score_function(logits, 4, **kw)
        assert routing_map.sum(0).tolist() == counts.tolist(), kw
        assert routing_map.sum(1).eq(4).all(), kw


# ---------------------------------------------------------------------------------------------
# observing, and measuring back
# ---------------------------------------------------------------------------------------------
def test_observe_then_measure_round_trips(installed, tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    model = Model(layers=2, numbered=True)
    wanted = {1: counts_for(SKEWED, 8, 64, 2, key="a"), 2: counts_for(HEAVY, 8, 64, 2, key="b")}
    for i, layer in enumerate(model.layers):  # each gate returns logits that route as wanted
        fixed = torch.from_numpy(logits_for(wanted[i + 1], 64))
        layer.mlp.router.forward = lambda tokens, fixed=fixed: fixed.clone()
    inst = installed("*.router", observe_dir=tmp_path)
    for _ in range(3):
        model(torch.randn(16, 4, 16))
    path = inst.flush()
    assert path == tmp_path / "moe-rank3.json"
    doc = json.loads(path.read_text())
    assert doc["rank"] == 3 and sorted(doc["routers"]) == ["layers.0.mlp.router@1", "layers.1.mlp.router@2"]
    assert doc["routers"]["layers.0.mlp.router@1"]["calls"] == [wanted[1].tolist()] * 3
    routing = parse_routing(measure(tmp_path))
    for n, stats in ((1, SKEWED), (2, HEAVY)):
        got = routing.stats_for(f"decoder.layers.{n + 4}.mlp.router@{n}")  # any layout's name
        assert got == BalanceStats(**balance_stats(wanted[n]).to_dict())
        assert got.br_max == pytest.approx(stats.br_max, abs=0.07)
    pooled = routing.default
    assert pooled.br_max == pytest.approx((balance_stats(wanted[1]).br_max + balance_stats(wanted[2]).br_max) / 2)


def test_observations_are_written_at_exit_and_an_unmatched_spec_is_reported(tmp_path):
    script = textwrap.dedent(
        f"""
        import torch
        from torch import nn
        from prismllm.routing.router import install
        install("Gate", observe_dir={str(tmp_path)!r}, topk=1)
        class Gate(nn.Linear):
            pass
        m = nn.Sequential(nn.Linear(4, 4), Gate(4, 3))
        m(torch.randn(5, 4))
        """
    )
    env = {**os.environ, "RANK": "1"}
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads((tmp_path / "moe-rank1.json").read_text())
    assert doc["routers"]["1"]["experts"] == 3 and sum(doc["routers"]["1"]["calls"][0]) == 5
    script = script.replace('install("Gate"', 'install("Gat"')
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0 and "--router-module Gat:forward matched no module" in proc.stderr, proc.stderr


def test_measure_needs_observations(tmp_path):
    with pytest.raises(RoutingError, match="no moe-rank"):
        measure(tmp_path)
    (tmp_path / "moe-rank0.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(RoutingError, match="not an observation of the mock router"):
        measure(tmp_path)


# ---- through prism: record observes, moe-stats measures, record and capture force ---------------
GPT3D_MOE = [str(ROOT / "examples" / "gpt3d.py"), "--ep", "2", "--num-experts", "8", "--iters", "2", "--seq", "64",
             "--layers", "2", "--hidden", "32", "--heads", "4", "--vocab", "128"]  # fmt: skip


def _prism(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([str(Path(sys.executable).with_name("prism")), *args], capture_output=True, text=True, env=env)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    return p


def test_a_forced_routing_makes_the_solo_capture_route_as_the_real_run(tmp_path):
    """gpt3d EP2 with 8 experts on 2 CPU processes. Observed and measured: its own routing's
    statistics (``prism moe-stats``). Forced (a skewed routing): the real run and the solo capture
    issue the same all-to-all split sizes, and the skew is there (uneven splits); the graph keeps
    the routing and `prism time` forces it again (structure equal to the recording's)."""
    _prism("record", "--nproc", "2", "--devices", "cpu", "--router-module", "Router", "--out", str(tmp_path / "obs"),
           "--", *GPT3D_MOE)  # fmt: skip
    stats = tmp_path / "own.json"
    _prism("moe-stats", str(tmp_path / "obs"), "--write", str(stats))
    own = load_routing(stats)
    assert own.stats_for("layers.0.mlp.router@1").br_max > 1.0
    skew = tmp_path / "skew.json"
    skew.write_text(json.dumps({"default": SKEWED.to_dict()}))
    force = ["--router-module", "Router", "--routing", str(skew)]
    _prism("record", "--nproc", "2", "--devices", "cpu", *force, "--out", str(tmp_path / "real"), "--", *GPT3D_MOE)
    _prism("capture", "--world", "2", "--devices", "cpu", *force, "--out", str(tmp_path / "solo"), "--", *GPT3D_MOE)
    timed = ["--devices", "cpu", "--parallel", "2", "--out", str(tmp_path / "time")]
    _prism("time", "--graph", str(tmp_path / "solo"), *timed, "--", *GPT3D_MOE)
    from prismllm.trace.graph import PrismTrace

    splits = {}
    for g in ("real", "solo", "time/graph"):
        t = PrismTrace.load(tmp_path / g)
        assert t.manifest["routing"]["routing"]["default"]["br_max"] == pytest.approx(2.2)
        n = t.nodes.to_pandas()
        a = n[n.op == "all_to_all"].sort_values(["rank", "index"])
        splits[g] = [tuple(x) for x in a.in_splits]
    assert splits["real"] == splits["solo"] == splits["time/graph"]
    assert any(len(set(s)) > 1 for s in splits["real"])  # skewed: uneven splits
    assert "structure: equal" in _prism("compare", str(tmp_path / "real"), str(tmp_path / "time/graph")).stdout
