"""Adapter affinity ("stick to a holder"): Ray Serve LLM's rule for LoRA
requests, the baseline of ``prefixserve simulate --adapters``.

Algorithm
    For a request with a LoRA adapter: the replicas that hold the adapter
    and have fewer than ``max_ongoing_requests`` sequences (running + waiting
    + swapped), least loaded first; then every other replica, least loaded
    first (it loads the adapter). Serve's multiplexed-model routing works
    this way: replicas that report the model id first, the rest when those
    are full (their ``max_ongoing_requests`` rejects). A request without an
    adapter goes by load alone (``least_load``'s order).

    It ignores prefixes and the cost of a load: a hot adapter stays on its
    first holders until they fill, and a cold one loads wherever is idlest.

Thresholds and defaults
    max_ongoing_requests = 16    Sequences at which a holder counts as full.
    swapped_weight = 1.0         As in ``least_load``.
"""

from __future__ import annotations

from router.policies.base import (
    DEFAULT_SWAPPED_WEIGHT,
    RoutingInput,
    check_swapped_weight,
    ids_of,
    rank_by_load,
    replica_load,
)

DEFAULT_MAX_ONGOING_REQUESTS = 16


class AdapterAffinityPolicy:
    """Holders of the request's adapter with room first, then by load (module doc)."""

    name = "adapter_affinity"

    def __init__(self, max_ongoing_requests: int = DEFAULT_MAX_ONGOING_REQUESTS,
                 swapped_weight: float = DEFAULT_SWAPPED_WEIGHT) -> None:
        if not isinstance(max_ongoing_requests, int) or max_ongoing_requests < 1:
            raise ValueError(f"max_ongoing_requests must be an integer >= 1, got {max_ongoing_requests!r}")
        self.max_ongoing_requests = max_ongoing_requests
        self.swapped_weight = check_swapped_weight(swapped_weight)

    def choose(self, inp: RoutingInput) -> list[str]:
        """Returns every replica id, best first. Does not mutate state."""
        ranked = rank_by_load(inp.replicas, self.swapped_weight)
        if not inp.adapter:
            return ids_of(ranked)
        holders = [r for r in ranked
                   if r.holds_adapter and replica_load(r, self.swapped_weight) < self.max_ongoing_requests]
        chosen = {r.replica_id for r in holders}
        return ids_of(holders) + [r.replica_id for r in ranked if r.replica_id not in chosen]
