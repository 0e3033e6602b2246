"""Least-load routing: send the request to the least busy replica.

Algorithm
    Rank every replica by

        load = num_running + num_waiting + swapped_weight * num_swapped

    ascending; ties go to the lower ``kv_cache_usage`` (more room for this
    request's blocks, less preemption risk), then to the lower replica id (a
    total order, so every router process ranks identically). The prefix
    directory is ignored.

    Counting sequences rather than tokens is deliberate: it is what replicas
    report cheaply every step, and the engine's token budget makes a running
    sequence cost about the same per step whatever its length.

Thresholds and defaults
    swapped_weight = 1.0   A swapped-out sequence still has to finish and must
                           first copy its KV back from CPU swap: it counts
                           like one queued request. Raise it to steer traffic
                           away from memory-pressured replicas harder.

This is also the fallback of ``cache_aware`` (no worthwhile match, load
imbalance, or Redis down), so the two agree exactly when the directory is
unavailable.
"""

from __future__ import annotations

from router.policies.base import (
    DEFAULT_SWAPPED_WEIGHT,
    RoutingInput,
    check_swapped_weight,
    ids_of,
    rank_by_load,
)


class LeastLoadPolicy:
    """Ranks replicas by ``(load, kv_cache_usage, replica_id)``.

    Args:
        swapped_weight: Weight of a swapped-out sequence in the load (>= 0).
    """

    name = "least_load"

    def __init__(self, swapped_weight: float = DEFAULT_SWAPPED_WEIGHT) -> None:
        self.swapped_weight = check_swapped_weight(swapped_weight)

    def choose(self, inp: RoutingInput) -> list[str]:
        """Returns every replica id, least loaded first. Does not mutate state."""
        return ids_of(rank_by_load(inp.replicas, self.swapped_weight))
