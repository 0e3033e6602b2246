"""Random routing: a uniformly random order of the replicas, whatever their
load, cache or adapters. The floor every other policy must beat
(``prefixserve simulate``); never a production choice.

Thresholds and defaults
    seed = None    Seeds the policy's own RNG (tests and benchmarks pin it).
"""

from __future__ import annotations

import random
from typing import Optional

from router.policies.base import RoutingInput


class RandomPolicy:
    """Shuffles the replicas (sorted by id first, so a seed gives one order)."""

    name = "random"
    ranks_every_replica = True  # a draw from a sample biased to holders would not be random (router/decision.py)

    def __init__(self, seed: Optional[int] = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, inp: RoutingInput) -> list[str]:
        """Returns every replica id in random order. Advances the RNG."""
        ids = sorted(r.replica_id for r in inp.replicas)
        self._rng.shuffle(ids)
        return ids
