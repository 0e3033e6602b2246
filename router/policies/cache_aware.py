"""Cache-aware routing (the default): longest confirmed prefix, guarded by load.

Algorithm
    1. If no replica has a directory answer (``matched_blocks is None`` for
       all: Redis down or not consulted), return the least-load order
       (``least_load.py``) unchanged: load-only routing, exactly.
    2. Compute every replica's load (``running + waiting + swapped_weight *
       swapped``) and the least load ``min_load``. A replica is *eligible*
       for the cache-affinity choice only if all of:
         - it is not overloaded relative to the least-loaded replica:
               load <= max(min_load + balance_abs_threshold,
                           balance_rel_threshold * min_load)
           (the per-replica form of SGLang's imbalance test: SGLang balances
           when ``max - min > abs`` AND ``max > rel * min``, so a replica is
           fine when either slack holds);
         - its KV cache is below the high-water mark:
               kv_cache_usage < kv_high_water
           (a nearly full cache would have to evict or preempt to take the
           request's new blocks, and may evict the very prefix we chase);
         - its confirmed match is worth it:
               matched_blocks >= min_match_blocks  and
               matched_blocks / num_blocks >= min_match_ratio.
    3. If some replica is eligible, rank the eligible ones by the longest
       match, then load, then KV use, then id; append every other replica in
       least-load order (fallbacks when the favourite rejects).
    4. Otherwise (no worthwhile match: a new prefix, or its holders are
       overloaded) place it like SGLang does, on the *emptiest cache*: among
       the replicas within the load limit and below the KV high-water mark,
       the fewest cached blocks (``num_cached_blocks``), then load, KV use,
       id; then the rest in least-load order (only the least-load order when
       no replica qualifies). New tenants thus spread over the replicas' caches
       instead of all landing on the same idle replica (least load breaks
       ties by id), which would make that replica evict prefixes the others
       have room for.

    ``matched_blocks`` comes only from the Redis directory's LOOKUP, which
    names live, in-sync replicas and counts *leading* blocks they hold by
    hash (docs/DIRECTORY.md). Nothing else is trusted: no approximate tree
    of past routing decisions, no guess that "we sent this prefix there
    before". A replica without an answer (``None``) is treated as holding
    nothing. The replica still re-checks every block by hash on arrival, so
    a stale hint costs a recompute, never a wrong answer.

    Hot prefix: the holder keeps winning until its load exceeds the slack
    above the least-loaded replica; then requests go least-load, to replicas
    that (once they served one) also hold the prefix and become eligible
    too. Traffic for one hot prefix therefore spreads and the load spread
    stays within ``max(balance_abs_threshold, (rel - 1) * min_load)`` + 1.

Thresholds and defaults (SGLang router name -> ours)
    balance_abs_threshold = 8      SGLang ``balance_abs_threshold`` (64 in its
                                   current release, 32 earlier). Ours counts
                                   sequences per replica, which on our
                                   replicas (max_num_seqs of 8..64) is a much
                                   smaller scale than SGLang's GPU workers, so
                                   64 would never fire.
    balance_rel_threshold = 1.5    SGLang ``balance_rel_threshold`` (1.5).
    min_match_ratio = 0.3          SGLang ``cache_threshold`` (0.3; 0.5
                                   earlier): the fraction of the request's
                                   full blocks that must be cached. Below it
                                   SGLang picks the emptiest tree; we pick
                                   the replica with the emptiest cache among
                                   those within the load limit.
    min_match_blocks = 1           Also need at least this many blocks; raise
                                   it to ignore tiny shared headers (e.g. a
                                   chat template's first block).
    kv_high_water = 0.95           No affinity to a replica whose device KV
                                   cache is at least 95 % used.
    swapped_weight = 1.0           As in least_load.

    SGLang's ``eviction_interval`` / ``max_tree_size`` have no counterpart:
    there is no router-side tree to evict; the directory mirrors the replicas'
    own KV events.
"""

from __future__ import annotations

from router.policies.base import (
    DEFAULT_SWAPPED_WEIGHT,
    ReplicaView,
    RoutingInput,
    check_swapped_weight,
    ids_of,
    rank_by_load,
    replica_load,
)

DEFAULT_BALANCE_ABS_THRESHOLD = 8.0
DEFAULT_BALANCE_REL_THRESHOLD = 1.5
DEFAULT_MIN_MATCH_RATIO = 0.3
DEFAULT_MIN_MATCH_BLOCKS = 1
DEFAULT_KV_HIGH_WATER = 0.95


class CacheAwarePolicy:
    """Longest confirmed prefix match among replicas that are not overloaded.

    Args:
        balance_abs_threshold: Load slack (sequences) above the least-loaded
            replica that a cache holder may carry and still be preferred (>= 0).
        balance_rel_threshold: Load ratio to the least-loaded replica that a
            cache holder may reach and still be preferred (>= 1).
        min_match_ratio: Least ``matched_blocks / num_blocks`` worth routing
            on, in [0, 1].
        min_match_blocks: Least ``matched_blocks`` worth routing on (>= 1).
        kv_high_water: KV use at or above which a replica gets no affinity,
            in (0, 1].
        swapped_weight: Weight of a swapped-out sequence in the load (>= 0).
    """

    name = "cache_aware"

    def __init__(
        self,
        balance_abs_threshold: float = DEFAULT_BALANCE_ABS_THRESHOLD,
        balance_rel_threshold: float = DEFAULT_BALANCE_REL_THRESHOLD,
        min_match_ratio: float = DEFAULT_MIN_MATCH_RATIO,
        min_match_blocks: int = DEFAULT_MIN_MATCH_BLOCKS,
        kv_high_water: float = DEFAULT_KV_HIGH_WATER,
        swapped_weight: float = DEFAULT_SWAPPED_WEIGHT,
    ) -> None:
        if not balance_abs_threshold >= 0:
            raise ValueError(f"balance_abs_threshold must be >= 0, got {balance_abs_threshold!r}")
        if not balance_rel_threshold >= 1.0:
            raise ValueError(f"balance_rel_threshold must be >= 1.0, got {balance_rel_threshold!r}")
        if not 0.0 <= min_match_ratio <= 1.0:
            raise ValueError(f"min_match_ratio must be in [0, 1], got {min_match_ratio!r}")
        if not isinstance(min_match_blocks, int) or min_match_blocks < 1:
            raise ValueError(f"min_match_blocks must be an integer >= 1, got {min_match_blocks!r}")
        if not 0.0 < kv_high_water <= 1.0:
            raise ValueError(f"kv_high_water must be in (0, 1], got {kv_high_water!r}")
        self.balance_abs_threshold = float(balance_abs_threshold)
        self.balance_rel_threshold = float(balance_rel_threshold)
        self.min_match_ratio = float(min_match_ratio)
        self.min_match_blocks = min_match_blocks
        self.kv_high_water = float(kv_high_water)
        self.swapped_weight = check_swapped_weight(swapped_weight)

    def choose(self, inp: RoutingInput) -> list[str]:
        """Returns every replica id, best first. Does not mutate state."""
        by_load = rank_by_load(inp.replicas, self.swapped_weight)
        if not inp.directory_available:
            return ids_of(by_load)
        favourites = self.affinity_candidates(inp)
        if not favourites:
            return self.place_new(inp, by_load)
        favourites.sort(
            key=lambda r: (
                -self._matched(r, inp.num_blocks),
                replica_load(r, self.swapped_weight),
                r.kv_cache_usage,
                r.replica_id,
            )
        )
        chosen = {r.replica_id for r in favourites}
        return ids_of(favourites) + [r.replica_id for r in by_load if r.replica_id not in chosen]

    def place_new(self, inp: RoutingInput, by_load: list[ReplicaView]) -> list[str]:
        """Order for a request no replica holds worth routing on: the emptiest
        cache among the replicas within the load limit first (step 4)."""
        min_load = replica_load(by_load[0], self.swapped_weight) if by_load else 0.0
        limit = self.load_limit(min_load)
        fit = [r for r in by_load
               if replica_load(r, self.swapped_weight) <= limit and r.kv_cache_usage < self.kv_high_water]
        fit.sort(key=lambda r: (r.num_cached_blocks, replica_load(r, self.swapped_weight), r.kv_cache_usage,
                                r.replica_id))
        chosen = {r.replica_id for r in fit}
        return ids_of(fit) + [r.replica_id for r in by_load if r.replica_id not in chosen]

    def load_limit(self, min_load: float) -> float:
        """Highest load a cache holder may carry, given the least replica load."""
        return max(min_load + self.balance_abs_threshold, self.balance_rel_threshold * min_load)

    def affinity_candidates(self, inp: RoutingInput) -> list[ReplicaView]:
        """Returns the replicas eligible for the cache-affinity choice (unordered).

        Eligible: a worthwhile confirmed match, load within ``load_limit`` of
        the least-loaded replica, and KV use below ``kv_high_water``.
        """
        if inp.num_blocks == 0 or not inp.replicas:
            return []
        min_load = min(replica_load(r, self.swapped_weight) for r in inp.replicas)
        limit = self.load_limit(min_load)
        return [
            r
            for r in inp.replicas
            if self._match_worth_it(self._matched(r, inp.num_blocks), inp.num_blocks)
            and replica_load(r, self.swapped_weight) <= limit
            and r.kv_cache_usage < self.kv_high_water
        ]

    def _match_worth_it(self, matched: int, num_blocks: int) -> bool:
        return matched >= self.min_match_blocks and matched >= self.min_match_ratio * num_blocks

    @staticmethod
    def _matched(view: ReplicaView, num_blocks: int) -> int:
        # None (no directory answer) means "nothing confirmed"; a count above
        # the chain length cannot be right, so cap it rather than trust it.
        if view.matched_blocks is None:
            return 0
        return min(view.matched_blocks, num_blocks)
