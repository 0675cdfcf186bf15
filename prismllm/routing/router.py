"""The mock router: force a chosen distribution of tokens over experts inside an unmodified
training program, or observe the one it produces.

Why this way: the routing of an MoE layer decides its all-to-all split sizes, each expert's
GEMM sizes and the straggler EP rank, so an emulation with a freshly initialised (balanced)
router misses a real job's skew. Editing the program is not an option, and replacing the
router would skip its own code (score function, capacity, aux losses). So the router's
*logits* are overwritten where the gate returns them, with logits whose top-k realises the
counts of :func:`prismllm.routing.stats.counts_for` (layout: :mod:`prismllm.routing.assign`).

Finding the router: a global module forward-pre-hook sees every module call. The first call
on a module that is neither indexed nor inside an indexed root makes it a root: its
``named_modules()`` give qualified names, and each module matching the :class:`RouterSpec`
(class name anywhere in its MRO, or a glob on the qualified name) gets its METHOD wrapped on
the instance (``forward``: a forward hook, since a call already under way has bound its
forward). Every later call of a known module costs one weak-set lookup.

The router's *key* names it in routing files and observations: its qualified name, plus
``@N`` where the module has an integer ``layer_number`` (Megatron-core's global layer number;
gpt3d's Router sets one too), so that a key means the same layer under any pipeline layout; a
name seen twice in one process (virtual pipeline chunks without layer numbers) gets ``#2``,
``#3``, ... The expert permutation is seeded by ``layer N`` where there is a layer number,
else by the key: identical on every rank of an EP group, different between layers.

Forcing adds no device allocation: the pattern for each (key, output shape, dtype) is built once
in pinned host memory (a plain CPU tensor when the output is on the CPU) and copied into the
gate's output with ``out.data.copy_(pattern, non_blocking=True)`` -- an asynchronous H2D copy on
the current stream into memory the program allocated. ``.data`` keeps autograd out of it: the
gate's backward runs on the gradients of the forced logits, with the program's own kernels and
memory, and an output that a custom autograd Function returned as a view (Megatron's
``RouterGatingLinearFunction`` with 3-D input) can be written. The same router gets the same
routing on every call, so activation recomputation routes as the forward did. A non-contiguous
output would make torch stage the copy through a device temporary; gates return contiguous ones.

Observing (no routing file, an output directory): each gating call's logits are copied
``non_blocking`` into a pinned host buffer (from a pool); a background thread waits for a CUDA
event recorded after the copy and counts top-k on the host (on the CPU: counted at once). For
Megatron's sigmoid / sqrt-softplus score functions with an ``expert_bias``, the bias is copied
too and added as Megatron does before its top-k. Group-limited routing and capacity dropping
are not modelled: the counts are what top-k of the scores picks. At exit (or
:meth:`Installation.flush`) ``moe-rank<RANK>.json`` is written (format in
:mod:`prismllm.routing.measure`).
"""

from __future__ import annotations

import atexit
import dataclasses
import fnmatch
import json
import os
import queue
import sys
import threading
import weakref
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from prismllm.routing.assign import logits_for
from prismllm.routing.measure import OBSERVE_FORMAT
from prismllm.routing.stats import BalanceStats, Routing, RoutingError, counts_for, load_routing

TOPK_ATTRIBUTES = ("topk", "top_k", "K")
_IN_FLIGHT = 16  # observed calls waiting for their counts before the program waits


@dataclasses.dataclass(frozen=True)
class RouterSpec:
    """Which modules are routers, and which of their methods returns the logits.

    Text form ``NAME_OR_TYPE[:METHOD]``: a Python identifier is a class name, matched anywhere
    in the module's MRO (``TopKRouter``); anything else is a glob on the qualified module name
    (``*.mlp.router``). METHOD defaults to ``forward``; Megatron-core: ``TopKRouter:gating``."""

    target: str
    method: str = "forward"

    @classmethod
    def parse(cls, text: str) -> RouterSpec:
        target, _, method = text.strip().partition(":")
        method = method or "forward"
        if not target or not method.isidentifier():
            raise RoutingError(
                f"--router-module {text!r}: expected NAME_OR_TYPE[:METHOD], e.g. TopKRouter:gating or '*.mlp.router'"
            )
        return cls(target, method)

    @property
    def by_type(self) -> bool:
        return self.target.isidentifier()

    def matches(self, module: nn.Module, name: str) -> bool:
        if self.by_type:
            return any(c.__name__ == self.target for c in type(module).__mro__)
        return fnmatch.fnmatchcase(name, self.target)


def router_topk(module: nn.Module) -> int | None:
    """The module's top-k (``topk``, ``top_k`` or ``K`` attribute), or None."""
    for attr in TOPK_ATTRIBUTES:
        k = getattr(module, attr, None)
        if isinstance(k, int) and not isinstance(k, bool) and k >= 1:
            return k
    return None


class Installation:
    """The installed hook; :func:`install` makes the one of a process."""

    def __init__(self, spec: RouterSpec, routing: Routing | None, observe_dir: Path | None, topk: int | None):
        self.spec, self.routing, self.topk = spec, routing, topk
        self.routers: dict[str, str] = {}  # key -> class name of each router found
        self._known: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self._roots: list[weakref.ref[nn.Module]] = []
        self._names: Counter[str] = Counter()
        self._undo: list[Callable[[], None]] = []
        self._sink = _Sink(observe_dir) if observe_dir is not None else None
        self._hook = torch.nn.modules.module.register_module_forward_pre_hook(self._pre_hook)
        self._closed = False

    # ---- discovery ---------------------------------------------------------------------------
    def _pre_hook(self, module: nn.Module, args: Any) -> None:
        if module in self._known:
            return
        for ref in self._roots:  # a module added to a known tree after it was indexed
            root = ref()
            if root is not None:
                self._index(root)
        if module not in self._known:
            self._roots.append(weakref.ref(module))
            self._index(module)

    def _index(self, root: nn.Module) -> None:
        for name, m in root.named_modules():
            if m in self._known:
                continue
            self._known.add(m)
            if self.spec.matches(m, name):
                self._attach(m, name)

    def _attach(self, module: nn.Module, name: str) -> None:
        layer = getattr(module, "layer_number", None)
        numbered = isinstance(layer, int) and not isinstance(layer, bool)
        name = name or type(module).__name__  # the router is the outermost module itself
        key = f"{name}@{layer}" if numbered else name
        self._names[key] += 1
        seen = self._names[key]
        key = f"{key}#{seen}" if seen > 1 else key
        seed = f"layer {layer}" if numbered and seen == 1 else key
        k = self.topk or router_topk(module)
        what = f"router {key} ({type(module).__name__})"
        if k is None:
            raise RoutingError(f"{what} has no {'/'.join(TOPK_ATTRIBUTES)} attribute: give the router's top-k")
        if self.routing is not None:
            handler: Callable[[Any], None] = _Forcer(what, self.routing.stats_for(key), seed, k)
        else:
            assert self._sink is not None
            handler = _Observer(what, key, k, module, self._sink)
        method = self.spec.method
        if method == "forward":
            handle = module.register_forward_hook(lambda _m, _args, out: handler(out))
            self._undo.append(handle.remove)
        else:
            original = getattr(module, method, None)
            if not callable(original):
                raise RoutingError(f"{what} has no method {method!r} (--router-module {self.spec.target}:{method})")

            def wrapped(*args: Any, **kwargs: Any) -> Any:
                out = original(*args, **kwargs)
                handler(out)
                return out

            own = module.__dict__.get(method)  # an attribute of the instance, not the class's method
            module.__dict__[method] = wrapped
            self._undo.append(lambda: module.__dict__.update({method: own}) if own else module.__dict__.pop(method))
        self.routers[key] = type(module).__name__

    # ---- end -----------------------------------------------------------------------------------
    def flush(self) -> Path | None:
        """Write what was observed (observe mode): ``moe-rank<RANK>.json``; its path."""
        return self._sink.write() if self._sink is not None else None

    def close(self) -> None:
        """Flush, remove the hooks and wrappers; the program's modules are as before."""
        global _active
        if self._closed:
            return
        self._closed = True
        self._hook.remove()
        for undo in self._undo:
            undo()
        self.flush()
        if self._sink is not None:
            self._sink.stop()
        if _active is self:
            _active = None

    def _at_exit(self) -> None:
        if not self.routers and not self._closed:
            print(
                f"prism: warning: --router-module {self.spec.target}:{self.spec.method} matched no module:"
                " MoE routing was neither forced nor observed",
                file=sys.stderr,
            )
        self.close()


_active: Installation | None = None


def install(
    spec: RouterSpec | str,
    routing: Routing | str | os.PathLike[str] | None = None,
    observe_dir: str | os.PathLike[str] | None = None,
    topk: int | None = None,
) -> Installation:
    """Install the mock router in this process, before the model runs: force ``routing`` (a
    :class:`Routing` or a routing file's path), or, without one, observe into ``observe_dir``.
    ``topk`` overrides the routers' own top-k attribute. At exit the observations are written
    and a spec that matched no module is reported on stderr."""
    global _active
    if (routing is None) == (observe_dir is None):
        raise RoutingError("the mock router needs either a routing file (to force) or an output directory (to observe)")
    if _active is not None:
        raise RoutingError("the mock router is already installed in this process")
    if not isinstance(spec, RouterSpec):
        spec = RouterSpec.parse(spec)
    if routing is not None and not isinstance(routing, Routing):
        routing = load_routing(routing)
    _active = Installation(spec, routing, Path(observe_dir) if observe_dir is not None else None, topk)
    atexit.register(_active._at_exit)
    return _active


def _logits_of(out: Any, what: str) -> tuple[int, int]:
    """(tokens, experts) of a gate's output, or RoutingError if it is not logits."""
    if not isinstance(out, torch.Tensor) or out.dim() not in (2, 3) or not out.is_floating_point():
        got = f"a {out.dim()}-D {out.dtype} tensor" if isinstance(out, torch.Tensor) else type(out).__name__
        raise RoutingError(
            f"{what}: the routed method returned {got}, not logits [tokens, experts] or [s, b, experts]: "
            "name the method that returns them (Megatron-core: TopKRouter:gating)"
        )
    experts = out.shape[-1]
    return (out.numel() // experts if experts else 0), experts


class _Forcer:
    """Overwrites one router's logits with the pattern of its stats."""

    def __init__(self, what: str, stats: BalanceStats, seed: str, topk: int):
        self.what, self.stats, self.seed, self.topk = what, stats, seed, topk
        self.patterns: dict[tuple, torch.Tensor] = {}

    def __call__(self, out: Any) -> None:
        tokens, experts = _logits_of(out, self.what)
        if tokens == 0:
            return
        key = (out.shape, out.dtype, out.is_cuda)
        pattern = self.patterns.get(key)
        if pattern is None:
            pattern = self.patterns[key] = self._build(out, tokens, experts)
        out.data.copy_(pattern, non_blocking=True)

    def _build(self, out: torch.Tensor, tokens: int, experts: int) -> torch.Tensor:
        if self.topk > experts:
            raise RoutingError(f"{self.what}: top-{self.topk} of {experts} experts")
        counts = counts_for(self.stats, experts, tokens, self.topk, key=self.seed)
        host = torch.from_numpy(logits_for(counts, tokens)).to(out.dtype).view(out.shape)
        if not out.is_cuda:
            return host
        pinned = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
        pinned.copy_(host)
        return pinned


class _Observer:
    """Hands one router's logits (and expert bias) to the sink, without device allocation."""

    def __init__(self, what: str, key: str, topk: int, module: nn.Module, sink: _Sink):
        self.what, self.key, self.topk, self.sink = what, key, topk, sink
        self.module = weakref.ref(module)

    def __call__(self, out: Any) -> None:
        tokens, experts = _logits_of(out, self.what)
        if tokens == 0:
            return
        module = self.module()
        score = getattr(module, "score_function", "softmax")
        bias = getattr(module, "expert_bias", None)
        if score not in ("sigmoid", "sqrtsoftplus") or not isinstance(bias, torch.Tensor):
            score, bias = "softmax", None  # top-k of the logits is the routing
        self.sink.observe(self.key, self.topk, out.detach(), bias, score)


class _Sink:
    """Counts of the observed calls per router key, and the file they are written to."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.routers: dict[str, dict[str, Any]] = {}
        self.free: dict[tuple, list[torch.Tensor]] = {}  # pinned buffers, by (shape, dtype)
        self.lock = threading.Lock()
        self.queue: queue.Queue = queue.Queue(maxsize=_IN_FLIGHT)
        self.thread: threading.Thread | None = None

    def observe(self, key: str, topk: int, logits: torch.Tensor, bias: torch.Tensor | None, score: str) -> None:
        if not logits.is_cuda:
            self._record(key, topk, _count(logits, topk, bias, score))
            return
        buf = self._buffer(logits.shape, logits.dtype)
        buf.copy_(logits, non_blocking=True)
        bias_buf = None
        if bias is not None:
            bias_buf = self._buffer(bias.shape, bias.dtype)
            bias_buf.copy_(bias.detach(), non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        if self.thread is None:
            self.thread = threading.Thread(target=self._work, name="prism-moe-observe", daemon=True)
            self.thread.start()
        self.queue.put((key, topk, buf, event, bias_buf, score))

    def _buffer(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        with self.lock:
            free = self.free.get((shape, dtype))
            if free:
                return free.pop()
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def _release(self, buf: torch.Tensor) -> None:
        with self.lock:
            self.free.setdefault((buf.shape, buf.dtype), []).append(buf)

    def _work(self) -> None:
        while True:
            item = self.queue.get()
            try:
                if item is None:
                    return
                key, topk, buf, event, bias_buf, score = item
                event.synchronize()
                self._record(key, topk, _count(buf, topk, bias_buf, score))
                self._release(buf)
                if bias_buf is not None:
                    self._release(bias_buf)
            finally:
                self.queue.task_done()

    def _record(self, key: str, topk: int, counts: list[int]) -> None:
        entry = self.routers.setdefault(key, {"experts": len(counts), "topk": topk, "calls": []})
        entry["calls"].append(counts)

    def write(self) -> Path:
        self.queue.join()
        rank = int(os.environ.get("RANK", "0"))
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"moe-rank{rank}.json"
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps({"format": OBSERVE_FORMAT, "rank": rank, "routers": self.routers}))
        os.replace(tmp, path)
        return path

    def stop(self) -> None:
        if self.thread is not None:
            self.queue.put(None)
            self.thread.join()
            self.thread = None


def _count(logits: torch.Tensor, topk: int, bias: torch.Tensor | None, score: str) -> list[int]:
    """Tokens per expert that top-k of these (host) logits picks, Megatron's score+bias first."""
    experts = logits.shape[-1]
    scores = logits.reshape(-1, experts).float()
    if bias is not None:
        scores = torch.sigmoid(scores) if score == "sigmoid" else torch.nn.functional.softplus(scores).sqrt()
        scores = scores + bias.float()
    picked = scores.topk(topk, dim=-1).indices
    return torch.bincount(picked.reshape(-1), minlength=experts).tolist()
