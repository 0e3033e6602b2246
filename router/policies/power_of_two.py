"""Power-of-two-choices routing: sample two replicas, take the less loaded.

Algorithm
    Draw two distinct replicas uniformly at random (from the replicas sorted
    by id, so a seeded RNG gives the same picks whatever the input order).
    The one that comes first in the least-load order (``least_load.py``:
    load, then KV use, then id) is chosen, the other is second; the remaining
    replicas follow in least-load order as fallbacks. One replica: it alone.

    Why two and not all: with many routers acting on slightly stale load
    numbers, always picking the global minimum makes them all herd onto the
    same replica; two random choices keep most of the balance of least-load
    (max load O(log log n) instead of O(log n) for pure random) while
    spreading concurrent decisions.

Thresholds and defaults
    swapped_weight = 1.0   As in least_load: a swapped sequence counts as one.
    seed = None            Seed of the policy's own ``random.Random`` (None:
                           from OS entropy); or inject ``rng`` directly.
"""

from __future__ import annotations

import random
from typing import Optional

from router.policies.base import (
    DEFAULT_SWAPPED_WEIGHT,
    RoutingInput,
    check_swapped_weight,
    ids_of,
    load_key,
    rank_by_load,
)


class PowerOfTwoPolicy:
    """Samples two replicas and prefers the less loaded one.

    Args:
        swapped_weight: Weight of a swapped-out sequence in the load (>= 0).
        seed: Seed for a private ``random.Random`` when ``rng`` is not given.
        rng: RNG to draw from (tests inject a seeded one). Takes precedence
            over ``seed``.
    """

    name = "power_of_two"

    def __init__(
        self,
        swapped_weight: float = DEFAULT_SWAPPED_WEIGHT,
        seed: Optional[int] = None,
        rng: Optional[random.Random] = None,
    ) -> None:
        self.swapped_weight = check_swapped_weight(swapped_weight)
        self._rng = rng if rng is not None else random.Random(seed)

    def choose(self, inp: RoutingInput) -> list[str]:
        """Returns every replica id, the better of two random picks first.

        Draws from the policy's RNG (its only state).
        """
        replicas = sorted(inp.replicas, key=lambda r: r.replica_id)
        if len(replicas) <= 1:
            return ids_of(replicas)
        pair = self._rng.sample(replicas, 2)
        pair.sort(key=lambda r: load_key(r, self.swapped_weight))
        picked = {r.replica_id for r in pair}
        rest = [r for r in rank_by_load(replicas, self.swapped_weight) if r.replica_id not in picked]
        return ids_of(pair) + ids_of(rest)
