"""The MoE mock router: replay a job's routing skew without editing the program.

``stats``: balance-ratio statistics, routing files, and integer tokens per expert that
reproduce them; ``assign``: logits whose top-k realises those counts; ``router``: the hook that
forces them into (or observes them from) an unmodified program's router, imported on its own
since it needs torch; ``measure``: a routing file from observed runs (``prism moe-stats``).
"""

from prismllm.routing.measure import measure, read_observations, routing_from_counts
from prismllm.routing.stats import (
    BALANCED,
    BalanceStats,
    Routing,
    RoutingError,
    achieved,
    balance_stats,
    counts_for,
    load_routing,
    parse_routing,
)

__all__ = [
    "BALANCED",
    "BalanceStats",
    "Routing",
    "RoutingError",
    "achieved",
    "balance_stats",
    "counts_for",
    "load_routing",
    "measure",
    "parse_routing",
    "read_observations",
    "routing_from_counts",
]
