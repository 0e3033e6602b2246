"""Prefix-cost routing (the default): the replica where this request's work,
plus the work already queued there, is smallest, counted in tokens.

Algorithm
    For each replica r, with B tokens per block, P prompt tokens and m_r the
    leading blocks of the request the directory confirms r holds:

        new_prefill(r) = max(0, P - B * m_r)           tokens r would prefill
        cost(r)        = num_prefill_tokens(r)         prefill already queued there
                       + new_prefill_weight * new_prefill(r)
                       + decode_token_weight * num_decode_tokens(r)
                       + sequence_tokens * (running + waiting + swapped)(r)

    and ranks replicas by ``(tier, cost, rendezvous(prefix_key, r))``:

    - ``tier`` 1 for a replica without KV headroom: its KV use is at least
      ``kv_high_water``, or it has fewer free blocks than the request needs
      (``ceil(new_prefill / B) + 1``); it would have to evict (maybe the very
      prefix we chase) or preempt. Tier 0 otherwise.
    - The tie-break is rendezvous hashing of the request's prefix key (its
      first block hash) with the replica id: every router ranks the same
      prefix alike (no herding of several routers onto the lowest id), while
      different prefixes spread over the replicas. A new tenant arriving at
      two routers at once lands on one replica, not two.

    The figures are the replicas' own (``ReplicaStats``, refreshed about once
    a second and shared by every router), plus the prompt tokens this router
    sent to a replica since its figures were taken (``router/serve_router.py``),
    so a burst does not pile onto one replica between two refreshes.

    What the cost compares: the prefill tokens a match saves against the
    tokens already waiting on the holder. A holder keeps the request while
    ``queue(holder) - queue(other) < new_prefill_weight * saved tokens``
    (+ decode terms), so a
    hot prefix spills to another replica exactly when waiting for the holder
    costs more than recomputing the prefix elsewhere, whatever the prompt
    length (SGLang's and our old cache_aware thresholds counted sequences
    and ignored prompt lengths). Matches of any length count, in tokens.

Hot prefixes
    When the router's estimate of a prefix's request rate (``prefix_rate``,
    all routers together) exceeds ``hot_prefix_rps`` (what one replica serves
    of it), the ``k = min(R, ceil(prefix_rate / hot_prefix_rps))`` replicas
    that rank highest in the prefix's rendezvous order are priced as if they
    held the longest confirmed match: new requests for it go to those k
    replicas, which warm up, instead of queueing on the holder until it spills.
    All routers pick the same k replicas (rendezvous), so the replicated set
    stays small and stable.

LoRA adapters
    A request with an adapter adds the adapter's load (and, on a full replica
    outside the adapter's homes, an eviction penalty) to the cost of every
    replica that does not hold it; hot adapters get more homes. The rule,
    its parameters (``adapter_*``) and their defaults are in
    ``router/policies/lora_placement.py``. A base-model request pays nothing.

Replicas that split one machine's cores
    Replicas packed on one machine with a fraction of a CPU each split its
    cores by how many are busy (``workers/core_share.py``; the same
    ``core_group``). Such a group is priced as one engine
    (``router/policies/core_groups.py``): each member is charged the group's
    whole queue, an idle or full member costs ``pack_idle_tokens`` more
    while another is open (busy below ``pack_max_seqs`` sequences, with KV
    headroom), and among open members the fullest goes first. So requests
    pack onto one running batch, which reads the weights once a step for all
    of them, instead of two batches reading them twice; a long confirmed
    prefix on an idle sibling still wins. Replicas with cores of their own
    (whole CPUs, GPUs, one per machine) are never packed.

Fetching the prefix from its holder (issue 33)
    With ``fetch_bytes_per_s`` > 0 a third option is priced: a replica that
    lacks (part of) the longest confirmed match may fetch it from the holder
    (``docs/KV_TRANSFER.md``) and prefill only the rest. Its cost is its queue,
    the request's prefill past the holder's match, and the transfer (bytes
    over a bandwidth, a fixed overhead and the holder's read, in its prefill
    tokens, plus a penalty for the copy's cache room); it is priced so where that is cheaper than recomputing. The
    ranking (``rank``) then names, for each such replica, the holder to fetch
    from (``Ranking.fetch_from``). The formula, the choice of holder, when a
    fetch is not priced, and the parameters (``fetch_*``, ``kv_bytes_per_token``,
    ``prefill_tokens_per_s``, off by default) are in
    ``router/policies/kv_fetch.py``. Hot prefixes are then replicated by
    copying: a replica of the hot set that does not hold the prefix, credited
    the match, is priced as a fetch from the holder (the match plus the
    transfer) and its ranking entry says to fetch, so it warms up with a copy
    of the blocks instead of recomputing them (where the copy would cost more
    than recomputing, or it has no room to import, it keeps the credit and
    recomputes, as without fetches).

    A fetch into a member of a core group (below) is charged the receiver's
    own queue, not the group's: the request then waits for the receiver's
    steps only, and adds the prefill past the match (tens of tokens) to the
    shared cores, where a cold prefill adds the whole prompt. Charged the
    group's queue, as the holder is, a fetch could never beat the holder it
    copies from (the same queue, the same prefill, plus the transfer): with
    fetch pricing on, ``bench routing``'s two replicas sharing 2 cores made no
    fetch at all (docs/KV_TRANSFER.md). With the receiver's own queue a fetch
    wins once the group's queue exceeds the receiver's by the transfer and
    the wake cost (about 270 + 128 tokens for a 512-token prefix: the hot
    request would otherwise wait about a second behind the holder's prefills).
    With fetch pricing on, a member that holds the longest confirmed match is
    charged its own queue too, for the same reason: a hit there waits for its
    steps alone. Charged the group's, a sibling that had fetched a hot prefix
    cost more for holding it than it had for fetching it, and the next request
    of that prefix went back behind the busy holder's prefill: the copy was
    never used (docs/KV_TRANSFER.md). Fetch pricing off, packing is unchanged.

Directory down
    No replica has a confirmed match (``matched_blocks is None``): every
    ``m_r`` is 0 and the ranking is by queued work alone.

Parameters and defaults
    new_prefill_weight = 2.0    Weight of the request's own new prefill tokens
                                against tokens already queued: a prefix
                                recomputed elsewhere delays this request and
                                also every request queued behind it there, and
                                may evict another tenant's prefix. 1.0 balances
                                queues greedily; ``prefixserve simulate`` (10
                                replicas, the default trace) gave 0.93 of the
                                oracle hit rate at 1.0, 0.99 at 2.0, 0.995 at
                                3.0, with TTFT P50 0.35 / 0.28 / 0.32 s.
    decode_token_weight = 0.02  A decoding sequence's context token, in prefill
                                tokens: each decode step reads it in attention
                                (measured on the default model on CPU: a
                                decode row with 600 tokens of context adds
                                ~1.5 ms to a step, a prefill token ~2 ms of
                                GEMM per 512-token chunk, i.e. ~0.02 per
                                token per step over a request's TTFT).
    sequence_tokens = 16.0      Fixed cost per sequence on the replica (per-step
                                overhead; also orders replicas that report no
                                token figures by their sequence counts).
    kv_high_water = 0.95        KV use at or above which a replica is tier 1.
    hot_prefix_rps = 8.0        Requests/s of one prefix that one replica
                                serves; above it the prefix is replicated.
                                0 turns replication off.
    pack_max_seqs = 32          Sequences a replica of a core group takes
                                before an idle sibling is woken (0 turns
                                packing off). On CPU a decode step reads the
                                weights once for the whole batch, so one
                                replica batching 16 out-runs two batching 8
                                on the same cores (docs/BENCHMARKS.md).
    pack_idle_tokens = 128.0    What waking an idle sibling of a core group
                                (or queueing on a full one) costs, in prefill
                                tokens: less than a confirmed prefix match of
                                more than 4 blocks (64 tokens, weighted 2.0),
                                which still wins.
"""

from __future__ import annotations

import hashlib
import math

from router.policies.base import Ranking, ReplicaView, RoutingInput
from router.policies.core_groups import Packing, num_seqs, plan_packing
from router.policies.kv_fetch import (
    DEFAULT_FETCH_BYTES_PER_S,
    DEFAULT_FETCH_HOLDER_BYTES_PER_S,
    DEFAULT_FETCH_MAX_EXPORTS,
    DEFAULT_FETCH_OVERHEAD_S,
    DEFAULT_FETCH_PENALTY_TOKENS,
    DEFAULT_KV_BYTES_PER_TOKEN,
    DEFAULT_PREFILL_TOKENS_PER_S,
    FetchPricing,
    best_holder,
    has_room_to_import,
)
from router.policies.lora_placement import (
    DEFAULT_ADAPTER_EVICTION_TOKENS,
    DEFAULT_ADAPTER_LOAD_TOKENS,
    DEFAULT_ADAPTER_RPS_PER_HOME,
    DEFAULT_ADAPTER_SHRINK_RATIO,
    AdapterHomes,
    adapter_cost,
    adapter_key,
)

DEFAULT_NEW_PREFILL_WEIGHT = 2.0
DEFAULT_DECODE_TOKEN_WEIGHT = 0.02
DEFAULT_SEQUENCE_TOKENS = 16.0
DEFAULT_KV_HIGH_WATER = 0.95
DEFAULT_HOT_PREFIX_RPS = 8.0
DEFAULT_PACK_MAX_SEQS = 32
DEFAULT_PACK_IDLE_TOKENS = 128.0


def rendezvous(prefix_key: bytes, replica_id: str) -> bytes:
    """Highest-random-weight order of a replica for a prefix (lower sorts first)."""
    return hashlib.blake2b(prefix_key + b"\0" + replica_id.encode(), digest_size=8).digest()


class PrefixCostPolicy:
    """Least queued-plus-new work in tokens, prefix matches credited (module doc)."""

    name = "prefix_cost"

    def __init__(
        self,
        new_prefill_weight: float = DEFAULT_NEW_PREFILL_WEIGHT,
        decode_token_weight: float = DEFAULT_DECODE_TOKEN_WEIGHT,
        sequence_tokens: float = DEFAULT_SEQUENCE_TOKENS,
        kv_high_water: float = DEFAULT_KV_HIGH_WATER,
        hot_prefix_rps: float = DEFAULT_HOT_PREFIX_RPS,
        adapter_load_tokens: float = DEFAULT_ADAPTER_LOAD_TOKENS,
        adapter_eviction_tokens: float = DEFAULT_ADAPTER_EVICTION_TOKENS,
        adapter_rps_per_home: float = DEFAULT_ADAPTER_RPS_PER_HOME,
        adapter_shrink_ratio: float = DEFAULT_ADAPTER_SHRINK_RATIO,
        pack_max_seqs: int = DEFAULT_PACK_MAX_SEQS,
        pack_idle_tokens: float = DEFAULT_PACK_IDLE_TOKENS,
        fetch_bytes_per_s: float = DEFAULT_FETCH_BYTES_PER_S,
        fetch_overhead_s: float = DEFAULT_FETCH_OVERHEAD_S,
        fetch_holder_bytes_per_s: float = DEFAULT_FETCH_HOLDER_BYTES_PER_S,
        kv_bytes_per_token: float = DEFAULT_KV_BYTES_PER_TOKEN,
        prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S,
        fetch_penalty_tokens: float = DEFAULT_FETCH_PENALTY_TOKENS,
        fetch_max_exports: int = DEFAULT_FETCH_MAX_EXPORTS,
    ) -> None:
        for name, value in (("new_prefill_weight", new_prefill_weight),
                            ("decode_token_weight", decode_token_weight), ("sequence_tokens", sequence_tokens),
                            ("hot_prefix_rps", hot_prefix_rps), ("adapter_load_tokens", adapter_load_tokens),
                            ("adapter_eviction_tokens", adapter_eviction_tokens),
                            ("pack_idle_tokens", pack_idle_tokens)):
            if not (isinstance(value, (int, float)) and value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if not (isinstance(fetch_max_exports, int) and fetch_max_exports >= 1):
            raise ValueError(f"fetch_max_exports must be an integer >= 1, got {fetch_max_exports!r}")
        if not (isinstance(pack_max_seqs, int) and pack_max_seqs >= 0):
            raise ValueError(f"pack_max_seqs must be an integer >= 0, got {pack_max_seqs!r}")
        if not 0.0 < kv_high_water <= 1.0:
            raise ValueError(f"kv_high_water must be in (0, 1], got {kv_high_water!r}")
        self.new_prefill_weight = float(new_prefill_weight)
        self.decode_token_weight = float(decode_token_weight)
        self.sequence_tokens = float(sequence_tokens)
        self.kv_high_water = float(kv_high_water)
        self.hot_prefix_rps = float(hot_prefix_rps)
        self.adapter_load_tokens = float(adapter_load_tokens)
        self.adapter_eviction_tokens = float(adapter_eviction_tokens)
        self.adapter_homes = AdapterHomes(adapter_rps_per_home, adapter_shrink_ratio)
        self.pack_max_seqs = pack_max_seqs
        self.pack_idle_tokens = float(pack_idle_tokens)
        self.fetch_max_exports = fetch_max_exports
        self.fetch = FetchPricing(fetch_bytes_per_s, fetch_overhead_s, fetch_holder_bytes_per_s, kv_bytes_per_token,
                                  prefill_tokens_per_s, fetch_penalty_tokens)

    def choose(self, inp: RoutingInput) -> list[str]:
        """Returns every replica id, best first (``rank`` without its hints)."""
        return self.rank(inp).replica_ids

    def rank(self, inp: RoutingInput) -> Ranking:
        """Every replica id, best first, and the holder each replica priced as a fetch
        should fetch from. Mutates only the adapters' home counts (``AdapterHomes``,
        idempotent for a repeated input)."""
        matched = self.credited_matches(inp)
        homes = self.adapter_home_ids(inp)
        packing = self.packing(inp)
        plans = self.fetch_plans(inp, matched)
        own = self.own_queue_holders(inp)
        keys = {}
        for r in inp.replicas:
            plan = plans.get(r.replica_id)
            keys[r.replica_id] = (self.sort_key(inp, r, plan[1], homes, packing, plan[2]) if plan
                                  else self.sort_key(inp, r, matched[r.replica_id], homes, packing,
                                                     own_queue=r.replica_id in own))
        ranked = sorted(keys, key=keys.__getitem__)
        return Ranking(ranked, {rid: plan[0] for rid, plan in plans.items()})

    def sort_key(self, inp: RoutingInput, view: ReplicaView, matched_blocks: int,
                 adapter_homes: frozenset = frozenset(), packing: Packing = Packing(),
                 fetched_blocks: int = 0, own_queue: bool = False) -> tuple[int, float, int, bytes]:
        """``(tier, cost, pack order, rendezvous)`` of one replica (module doc);
        ``adapter_homes``: the ids of the request's adapter's homes among ``inp.replicas``;
        ``packing``: the core groups' terms (``router/policies/core_groups.py``);
        ``fetched_blocks``: blocks of ``matched_blocks`` it would fetch (priced by
        ``kv_fetch``; they need room as its new blocks do); ``own_queue``: charged its
        own queue even in a core group (``own_queue_holders``)."""
        block = inp.tokens_per_block
        new_prefill = max(0, inp.num_prompt_tokens - block * matched_blocks)
        rid = view.replica_id
        # A fetch, or a hit on a holder of the longest match with fetches priced, waits for
        # the replica's own queue, not its core group's (module doc).
        shared = rid in packing.queue and not fetched_blocks and not own_queue
        cost = (packing.queue[rid] if shared else self.queue_cost(view)) \
            + self.new_prefill_weight * new_prefill + packing.penalty.get(rid, 0.0)
        if fetched_blocks:
            cost += self.fetch.transfer_tokens(view, block * fetched_blocks)
        if inp.adapter:
            cost += adapter_cost(view, view.replica_id in adapter_homes, self.adapter_load_tokens,
                                 self.adapter_eviction_tokens)
        return (0 if self.has_headroom(view, new_prefill + block * fetched_blocks, block) else 1, cost,
                packing.order.get(rid, 0), rendezvous(inp.prefix_key, rid))

    def queue_cost(self, view: ReplicaView) -> float:
        """The work queued on a replica, in prefill tokens (module doc)."""
        return (view.num_prefill_tokens + self.decode_token_weight * view.num_decode_tokens
                + self.sequence_tokens * num_seqs(view))

    def own_queue_holders(self, inp: RoutingInput) -> frozenset:
        """With fetch pricing on, the replicas whose confirmed match is the longest (> 0):
        charged their own queue in a core group, as a replica fetching that match would be
        (module doc). Empty with fetch pricing off (the packing rule alone)."""
        if not self.fetch.enabled:
            return frozenset()
        confirmed = {r.replica_id: min(r.matched_blocks or 0, inp.num_blocks) for r in inp.replicas}
        best = max(confirmed.values(), default=0)
        return frozenset(rid for rid, m in confirmed.items() if best and m == best)

    def fetch_plans(self, inp: RoutingInput, credited: dict[str, int]) -> dict[str, tuple[str, int, int]]:
        """``{replica: (holder, blocks matched after the fetch, blocks fetched)}`` for the
        replicas priced as fetching (``kv_fetch`` module doc): where a fetch costs less than
        recomputing (for a hot prefix's set too: credited the match, it would recompute it)."""
        if not self.fetch.enabled or not inp.prefix_key:
            return {}
        holder = best_holder(inp, lambda rid: rendezvous(inp.prefix_key, rid), self.fetch_max_exports)
        if holder is None:
            return {}
        holder_id, holder_blocks = holder
        block, plans = inp.tokens_per_block, {}
        for view in inp.replicas:
            own = min(view.matched_blocks or 0, inp.num_blocks)
            fetched = holder_blocks - own
            if view.replica_id == holder_id or fetched <= 0 or not has_room_to_import(view, fetched, block):
                continue
            # Cheaper than recomputing the blocks (which a hot-set replica, credited the
            # match, would otherwise do to warm up): priced, and hinted, as a fetch.
            if self.fetch.transfer_tokens(view, block * fetched) < self.new_prefill_weight * block * fetched:
                plans[view.replica_id] = (holder_id, holder_blocks, fetched)
        return plans

    def packing(self, inp: RoutingInput) -> Packing:
        """The terms of replicas that split one machine's cores (``core_groups``)."""
        return plan_packing(inp.replicas, self.queue_cost, self.pack_max_seqs, self.pack_idle_tokens,
                            self.kv_high_water)

    def has_headroom(self, view: ReplicaView, new_prefill: int, block: int) -> bool:
        """Whether the replica can take the request's new blocks without evicting or preempting."""
        if view.kv_cache_usage >= self.kv_high_water:
            return False
        if not view.num_kv_blocks:
            return True
        free = round(view.num_kv_blocks * (1.0 - view.kv_cache_usage))  # usage is a ratio of integers
        return math.ceil(new_prefill / max(1, block)) + 1 <= free

    def num_hot_replicas(self, inp: RoutingInput) -> int:
        """k: how many replicas a prefix at ``inp.prefix_rate`` should be spread over (1: not hot)."""
        if not inp.prefix_key:
            return 1
        return self.num_hot_for(inp.prefix_rate, len(inp.replicas))

    def num_hot_for(self, rate: float, num_replicas: int) -> int:
        """k for a prefix at ``rate`` requests/s in a fleet of ``num_replicas``."""
        if not self.hot_prefix_rps or rate <= self.hot_prefix_rps:
            return 1
        return max(1, min(num_replicas, math.ceil(rate / self.hot_prefix_rps)))

    def credited_matches(self, inp: RoutingInput) -> dict[str, int]:
        """Blocks credited per replica: its confirmed match, and for a hot
        prefix the best confirmed match on its k rendezvous replicas."""
        matched = {r.replica_id: min(r.matched_blocks or 0, inp.num_blocks) for r in inp.replicas}
        k = self.num_hot_replicas(inp)
        if k > 1:
            best = max(matched.values(), default=0)
            for view in sorted(inp.replicas, key=lambda r: rendezvous(inp.prefix_key, r.replica_id))[:k]:
                matched[view.replica_id] = best
        return matched

    def num_adapter_homes(self, adapter: str, rate: float, num_replicas: int) -> int:
        """k: the homes of an adapter at ``rate`` requests/s (``lora_placement.AdapterHomes``)."""
        return self.adapter_homes.size(adapter, rate, num_replicas)

    def adapter_home_ids(self, inp: RoutingInput) -> frozenset:
        """The request's adapter's homes among ``inp.replicas``: the first k of its
        rendezvous order (the decision core adds the fleet's first k to the candidates)."""
        if not inp.adapter:
            return frozenset()
        k = self.num_adapter_homes(inp.adapter, inp.adapter_rate, len(inp.replicas))
        key = adapter_key(inp.adapter)
        return frozenset(sorted((r.replica_id for r in inp.replicas), key=lambda rid: rendezvous(key, rid))[:k])

