"""How a routing travels from the command line to every process that runs the program.

``prism record`` and ``prism capture`` take ``--router-module SPEC`` and ``--routing FILE``;
the graph's manifest keeps both (the routing file's *content*, not its path), and every later
stage that runs the program from that graph (time's slices, emulate's sandbox ranks) forces the
same routing: a graph's memory and time are those of one routing, whatever stage measures them.
A child gets them through the process contract (:class:`prismllm.childenv.ChildEnv`: the
routing as JSON text) and installs the mock router in its bootstrap.
"""

from __future__ import annotations

import json
import os
from typing import Any

from prismllm.routing.stats import Routing, RoutingError, load_routing, parse_routing

OBSERVE_DIR = "moe"  # where `prism record --router-module` without --routing writes its observations


def check_spec(text: str) -> str:
    """A ``--router-module`` value, checked without torch: ``NAME_OR_TYPE[:METHOD]``."""
    target, _, method = text.partition(":")
    if not target.strip() or (":" in text and not method.strip().isidentifier()):
        raise RoutingError(
            f"--router-module {text!r}: expected a class name or a glob on the module's name, then "
            "optionally :METHOD (the method that returns the logits), e.g. TopKRouter:gating or '*.mlp.router'"
        )
    return text.strip()


def manifest_entry(router_module: str | None, routing: str | os.PathLike | None, observed: bool = False) -> dict | None:
    """What the graph's manifest keeps of ``--router-module`` / ``--routing`` (None: neither)."""
    if routing is not None and router_module is None:
        raise RoutingError("--routing needs --router-module: the router whose logits it forces")
    if router_module is None:
        return None
    spec = check_spec(router_module)
    if routing is None:
        return {"router_module": spec, "routing": None, "observed": OBSERVE_DIR if observed else None}
    return {"router_module": spec, "routing": load_routing(routing).to_json(), "observed": None}


def child_fields(entry: dict[str, Any] | None, observe_dir: str | None = None) -> dict[str, Any]:
    """ChildEnv fields for a graph's ``routing`` entry: force its routing; observing only with
    ``observe_dir`` (a recording)."""
    if not entry:
        return {}
    if entry.get("routing") is not None:
        return {"router_module": entry["router_module"], "routing": json.dumps(entry["routing"], sort_keys=True)}
    if observe_dir is not None:
        return {"router_module": entry["router_module"], "routing_observe": observe_dir}
    return {}


def routing_of(text: str) -> Routing:
    """The Routing a child was handed (ChildEnv.routing)."""
    try:
        return parse_routing(json.loads(text), "the routing handed to this process")
    except ValueError as e:
        raise RoutingError(f"the routing handed to this process is not JSON: {e}") from None


__all__ = ["OBSERVE_DIR", "check_spec", "child_fields", "manifest_entry", "routing_of"]
