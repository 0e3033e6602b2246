"""One routing decision, shared by Serve's request router
(``router/serve_router.py``) and the fleet simulator
(``cluster/bench/simulate.py``), so the simulator runs this code, not a copy.

Given a request's block-hash chain and the directory's answer (holders only,
or every live replica; ``None`` when the directory is unavailable) the core

1. credits the chains this router sent in the last seconds
   (``router/recent_sends.py``) where they go past the longest match the
   directory confirms,
2. picks the candidates: every replica in a small fleet; in a large one
   (more than ``full_rank_limit``) only the replicas that hold a prefix of the
   chain (the ``max_holders`` longest matches), the prefix's rendezvous
   replicas when it is hot, and ``sample_size`` replicas drawn at random
   (power-of-choices for load), so a decision's work does not grow with the
   fleet; for a request with a LoRA adapter also the adapter's homes and up
   to ``max_holders`` of the replicas that hold it (drawn at random),
3. builds their views (the caller's ``view_of``: the replica's own stats plus
   the prompt tokens this router sent it since them, ``pending_tokens``),
4. asks the policy for the ranking (``decide_ranking``: with the policy's
   hints, such as the holder a replica should fetch the prefix from;
   ``decide``: the ids alone), and records the send for step 1 and for
   ``pending_tokens`` (for a fetch, the prefill past the holder's match).
"""

from __future__ import annotations

import heapq
import random
import time
from collections import OrderedDict, deque
from typing import Callable, Optional, Sequence

from router.policies import Policy, ReplicaView, RoutingInput
from router.policies.base import Ranking, rank
from router.policies.kv_fetch import FETCH_HORIZON_S
from router.policies.lora_placement import adapter_key
from router.policies.prefix_cost import rendezvous
from router.prefix_rates import PrefixRates
from router.recent_sends import RecentSends

FULL_RANK_LIMIT = 16  # fleets up to this size are ranked whole
SAMPLE_SIZE = 4  # replicas drawn at random beyond the holders in a larger fleet
MAX_HOLDERS = 8  # longest-matching holders considered in a larger fleet
ADAPTER_HOMES_KEPT = 8  # first replicas of an adapter's rendezvous order cached
MAX_CACHED_ADAPTERS = 4096  # adapters whose order is cached (x fleet versions)
SENT_HORIZON_S = 60.0  # sends older than this are dropped even without newer stats
# A router extrapolates a prefix's rate to all routers only from at least this
# many of its own requests in a rate window: one request at one of 100 routers
# is not a hot prefix.
MIN_RATE_SAMPLES = 4.0

ViewOf = Callable[[str, Optional[int]], ReplicaView]  # (replica id, credited match or None) -> view


class RoutingCore:
    """The per-router state and logic of a decision (module doc).

    Args:
        policy: The ranking policy.
        block_size: Tokens per block.
        num_routers: Routers sharing the traffic (a prefix's rate is this
            router's rate times it, once this router saw ``MIN_RATE_SAMPLES``
            of its requests in a rate window).
        clock: Wall clock (seconds); replicas stamp their stats with it.
        rng: Draws the sampled candidates.
    """

    def __init__(self, policy: Policy, block_size: int, num_routers: int = 1,
                 clock: Callable[[], float] = time.time, rng: Optional[random.Random] = None,
                 full_rank_limit: int = FULL_RANK_LIMIT, sample_size: int = SAMPLE_SIZE,
                 max_holders: int = MAX_HOLDERS) -> None:
        self.policy = policy
        self.block_size = block_size
        self.num_routers = max(1, int(num_routers))
        self.clock = clock
        self.rng = rng or random.Random()
        self.full_rank_limit = full_rank_limit
        self.sample_size = sample_size
        self.max_holders = max_holders
        self.recent = RecentSends()
        self.rates = PrefixRates()
        self.adapter_rates = PrefixRates()
        # Per replica: (time, prompt tokens) of this router's sends, oldest first, and their sum.
        self._sent: dict[str, _Sends] = {}
        self._exports: dict[str, deque[float]] = {}  # holder -> times of this router's fetch hints naming it
        self._hot_sets: "OrderedDict[tuple, list[str]]" = OrderedDict()
        self._adapter_orders: "OrderedDict[tuple, list[str]]" = OrderedDict()
        self._fleet: tuple = ((), frozenset())  # the last fleet, as a tuple and as a set

    def decide(self, chain: Sequence[bytes], num_prompt_tokens: int, replica_ids: Sequence[str],
               counts: Optional[dict[str, int]], view_of: ViewOf, adapter: str = "",
               adapter_holders: Sequence[str] = ()) -> list[str]:
        """Ranks (a candidate subset of) ``replica_ids`` for one request, best first
        (``decide_ranking`` without the policy's hints)."""
        return self.decide_ranking(chain, num_prompt_tokens, replica_ids, counts, view_of, adapter,
                                   adapter_holders).replica_ids

    def decide_ranking(self, chain: Sequence[bytes], num_prompt_tokens: int, replica_ids: Sequence[str],
                       counts: Optional[dict[str, int]], view_of: ViewOf, adapter: str = "",
                       adapter_holders: Sequence[str] = ()) -> Ranking:
        """Ranks (a candidate subset of) ``replica_ids`` for one request, best first,
        with the policy's hints (``Ranking.fetch_from``).

        Args:
            chain: The request's block hashes.
            num_prompt_tokens: Its prompt length.
            replica_ids: The live replicas it may go to.
            counts: The directory's leading-block counts (holders, maybe
                everyone; -1 entries are left out by the caller), or None.
            view_of: Builds one replica's view given its credited match.
            adapter: The request's LoRA adapter ("": the base model).
            adapter_holders: The replicas that report holding it.
        """
        now = self.clock()
        if counts is not None:
            # A recent send is credited only past what the directory confirms
            # anywhere: it bridges the publish lag of a prefix the directory
            # does not know yet, and never outweighs a confirmed holder (a send
            # made while the directory was down may since have been evicted).
            counts = dict(counts)
            confirmed = max(counts.values(), default=0)
            for replica_id, sent in self.recent.leading(chain, now).items():
                if sent > confirmed and counts.get(replica_id, 0) >= 0:
                    counts[replica_id] = sent
        self._fleet_of(replica_ids)  # forgets the sends to replicas that left
        prefix_key = chain[0] if chain else b""
        rate = self.cluster_rate(self.rates.observe(prefix_key, now)) if prefix_key else 0.0
        adapter_rate = self.cluster_rate(self.adapter_rates.observe(adapter_key(adapter), now)) if adapter else 0.0
        candidates = self.candidates(replica_ids, counts, prefix_key, rate)
        if adapter and len(candidates) < len(replica_ids):
            candidates = self.with_adapter_candidates(candidates, replica_ids, adapter, adapter_rate, adapter_holders)
        views = [view_of(rid, None if counts is None else max(0, counts.get(rid, 0))) for rid in candidates]
        ranking = rank(self.policy, RoutingInput(len(chain), num_prompt_tokens, views, block_size=self.block_size,
                                                 prefix_key=prefix_key, prefix_rate=rate, adapter=adapter,
                                                 adapter_rate=adapter_rate))
        ranked = ranking.replica_ids
        if ranked:
            # A replica that fetches the prefix prefills past the holder's match only.
            counted = ranking.fetch_from.get(ranked[0], ranked[0])
            matched = 0 if counts is None else max(0, counts.get(counted, 0))
            sends = self._sent.get(ranked[0])
            if sends is None:
                sends = self._sent[ranked[0]] = _Sends()
            sends.add(now, max(0, num_prompt_tokens - self.block_size * matched))
            self.recent.record(chain, ranked[0], now)
            if counted != ranked[0]:
                self._exports.setdefault(counted, deque()).append(now)
                self.exports_in_flight(counted)  # drops the expired ones
        return ranking

    def cluster_rate(self, local_rate: float) -> float:
        """A prefix's request rate over all routers, from this router's share of it."""
        if local_rate * self.rates.window_s < MIN_RATE_SAMPLES:
            return local_rate
        return local_rate * self.num_routers

    def candidates(self, replica_ids: Sequence[str], counts: Optional[dict[str, int]], prefix_key: bytes,
                   rate: float) -> list[str]:
        """Every replica of a small fleet; holders, hot set and a sample of a large one."""
        if len(replica_ids) <= self.full_rank_limit or getattr(self.policy, "ranks_every_replica", False):
            return list(replica_ids)
        live, as_tuple = self._fleet_of(replica_ids)
        chosen: dict[str, None] = {}
        if counts:
            holders = sorted((n, rid) for rid, n in counts.items() if n > 0 and rid in live)
            for _, rid in holders[-self.max_holders:]:
                chosen[rid] = None
        hot_count = getattr(self.policy, "num_hot_for", None)
        if hot_count is not None and prefix_key:
            for rid in self.hot_set(replica_ids, prefix_key, hot_count(rate, len(replica_ids))):
                chosen[rid] = None
        for rid in self.rng.sample(as_tuple, min(self.sample_size, len(as_tuple))):
            chosen[rid] = None
        return list(chosen)

    def with_adapter_candidates(self, candidates: list[str], replica_ids: Sequence[str], adapter: str, rate: float,
                                holders: Sequence[str]) -> list[str]:
        """``candidates`` plus the adapter's homes in the fleet and a sample of its live holders."""
        live, _ = self._fleet_of(replica_ids)
        chosen = dict.fromkeys(candidates)
        home_count = getattr(self.policy, "num_adapter_homes", None)
        if home_count is not None:
            chosen.update(dict.fromkeys(self.adapter_homes(replica_ids, adapter,
                                                           home_count(adapter, rate, len(replica_ids)))))
        live_holders = [rid for rid in holders if rid in live and rid not in chosen]
        chosen.update(dict.fromkeys(self.rng.sample(live_holders, min(self.max_holders, len(live_holders)))))
        return list(chosen)

    def adapter_homes(self, replica_ids: Sequence[str], adapter: str, k: int) -> list[str]:
        """The first ``k`` replicas of the adapter's rendezvous order. Cached per adapter and
        fleet (the first ``max(k, ADAPTER_HOMES_KEPT)`` only: thousands of adapters over a
        large fleet), so a decision hashes the fleet once per adapter, not each time."""
        fleet, _ = self._fleet_of(replica_ids)
        cache_key = (adapter, fleet)
        order = self._adapter_orders.get(cache_key)
        if order is None or (len(order) < k and len(order) < len(replica_ids)):
            key = adapter_key(adapter)
            order = heapq.nsmallest(max(k, ADAPTER_HOMES_KEPT), replica_ids, key=lambda r: rendezvous(key, r))
            self._adapter_orders[cache_key] = order
            while len(self._adapter_orders) > MAX_CACHED_ADAPTERS:
                self._adapter_orders.popitem(last=False)
        else:
            self._adapter_orders.move_to_end(cache_key)
        return order[:k]

    def _fleet_of(self, replica_ids: Sequence[str]) -> tuple[frozenset, tuple]:
        """The fleet as a set and a tuple; the set is rebuilt only when the
        fleet changed (comparing tuples of the same strings is cheap), and
        then the sends to replicas that left are forgotten."""
        as_tuple = tuple(replica_ids)
        cached, live = self._fleet
        if as_tuple != cached:
            live = frozenset(as_tuple)
            self._fleet = (as_tuple, live)
            for gone in [rid for rid in self._sent if rid not in live]:
                del self._sent[gone]
            for gone in [rid for rid in self._exports if rid not in live]:
                del self._exports[gone]
        return live, as_tuple

    def hot_set(self, replica_ids: Sequence[str], prefix_key: bytes, k: int) -> list[str]:
        """The ``k`` first replicas of the prefix's rendezvous order. The order
        is computed once per prefix and fleet (O(fleet) hashes) and cached."""
        if k <= 1:
            return []
        fleet, _ = self._fleet_of(replica_ids)
        key = (prefix_key, fleet)
        order = self._hot_sets.get(key)
        if order is None:
            order = sorted(replica_ids, key=lambda r: rendezvous(prefix_key, r))
            self._hot_sets[key] = order
            while len(self._hot_sets) > 256:
                self._hot_sets.popitem(last=False)
        else:
            self._hot_sets.move_to_end(key)
        return order[:k]

    def exports_in_flight(self, replica_id: str) -> int:
        """Fetches from this holder that this router hinted in the last ``FETCH_HORIZON_S``
        (``ReplicaView.num_exports``)."""
        times = self._exports.get(replica_id)
        if not times:
            return 0
        horizon = self.clock() - FETCH_HORIZON_S
        while times and times[0] <= horizon:
            times.popleft()
        if not times:
            del self._exports[replica_id]
        return len(times)

    def pending_tokens(self, replica_id: str, stats_at: float) -> int:
        """Prompt tokens this router sent the replica after its stats were taken."""
        sends = self._sent.get(replica_id)
        if sends is None:
            return 0
        return sends.since(max(stats_at, self.clock() - SENT_HORIZON_S))


class _Sends:
    """One replica's recent sends, oldest first, with their running token sum:
    dropping the old ones costs O(dropped), not O(kept), per decision."""

    __slots__ = ("entries", "tokens")

    def __init__(self) -> None:
        self.entries: deque[tuple[float, int]] = deque()
        self.tokens = 0

    def add(self, at: float, tokens: int) -> None:
        self.entries.append((at, tokens))
        self.tokens += tokens

    def since(self, horizon: float) -> int:
        """Drops the sends made at or before ``horizon``; returns the tokens of the rest."""
        entries = self.entries
        while entries and entries[0][0] <= horizon:
            self.tokens -= entries.popleft()[1]
        return self.tokens
