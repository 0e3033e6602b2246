"""Round-robin routing: replicas take turns, whatever their load or cache.

Algorithm
    Sort the live replicas by id (so the rotation does not depend on the
    order the caller lists them in), start at ``counter mod n`` and list the
    rest in rotation order; then advance the counter by one. With a stable
    replica set, request k goes to replica ``k mod n``; when replicas come or
    go the rotation continues over the new set.

Thresholds and defaults
    start = 0   Initial counter value (tests and benchmarks pin it).

The baseline of the routing benchmark: it spreads load evenly but scatters
each prefix over every replica, so caches hold n copies of the hot prefixes.
The counter is per policy instance (per router process); several routers
rotate independently, which keeps each one fair.
"""

from __future__ import annotations

from router.policies.base import RoutingInput


class RoundRobinPolicy:
    """Rotates over the replicas sorted by id.

    Args:
        start: Initial counter value (>= 0).
    """

    name = "round_robin"
    ranks_every_replica = True  # a rotation over a sample would not be round robin (router/decision.py)

    def __init__(self, start: int = 0) -> None:
        if not isinstance(start, int) or start < 0:
            raise ValueError(f"start must be an integer >= 0, got {start!r}")
        self._counter = start

    def choose(self, inp: RoutingInput) -> list[str]:
        """Returns every replica id, the next in turn first. Advances the counter."""
        ids = sorted(r.replica_id for r in inp.replicas)
        if not ids:
            return []
        first = self._counter % len(ids)
        self._counter += 1
        return ids[first:] + ids[:first]
