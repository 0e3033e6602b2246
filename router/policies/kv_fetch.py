"""The price of fetching a prefix's KV from the replica that holds it, for
``prefix_cost`` (issue 33; the transfer path is docs/KV_TRANSFER.md).

The third option
    Besides a local hit on the holder (which may be loaded) and a cold
    prefill elsewhere, a less-loaded replica r may fetch the prefix's blocks
    from the holder h and prefill only the rest. With B tokens per block, P
    prompt tokens, m_h the blocks the directory confirms h holds and m_r those
    r holds (m_r < m_h):

        fetched   = B * (m_h - m_r)                     tokens whose KV moves
        bytes     = fetched * kv_bytes_per_token
        seconds   = bytes / fetch_bytes_per_s           the copy, end to end
                  + fetch_overhead_s                    asking the holder (one Ray call)
                  + bytes / fetch_holder_bytes_per_s    the holder's read (its cost to serve it)
        transfer  = seconds * prefill_tokens_per_s      in r's prefill tokens
                  + fetch_penalty_tokens                one more copy of the prefix

        cost_fetch(r) = queue(r) + new_prefill_weight * (P - B * m_h) + transfer

    against ``queue(r) + new_prefill_weight * (P - B * m_r)`` for recomputing.
    ``queue(r)`` is r's own queue in a fetch's cost even where r shares a
    machine's cores with the holder (a core group, charged the group's queue
    otherwise; ``prefix_cost``'s module doc says why).
    ``transfer`` is not weighted: the copy runs off the receiver's engine
    thread, so it delays this request only, not the ones queued behind it.
    On the default model a 512-token prefix moves 23.6 MB: ~32 ms, 15 prefill
    tokens, against 1024 weighted tokens to recompute it. Time alone would
    make a holder give up a request as soon as its queue is ~15 tokens longer
    than another's, and every small imbalance would copy the prefix: each
    copy takes cache room on the receiver and evicts another prefix there.
    ``fetch_penalty_tokens`` prices that: a holder keeps the request while its
    queue is within ~270 tokens (half a second on 2 cores) of the receiver's.

Which holder
    Among the replicas with fewer than ``fetch_max_exports`` fetches of their
    blocks in flight (``ReplicaView.num_exports``: what this router asked in
    the last ``FETCH_HORIZON_S``; a holder at its limit refuses the next
    export): the longest confirmed match (``matched_blocks`` as the directory
    answered it, never a hot-prefix credit), then the fewest exports in
    flight, then the fewest sequences (its export runs beside its own steps),
    then the prefix's rendezvous order (every router picks the same holder).

When a fetch is not priced
    - ``fetch_bytes_per_s`` is 0 (the default, see below) or the directory did
      not answer.
    - r would take more than half of its free blocks for the fetched ones:
      the receiver refuses such an import (``no_room``,
      ``workers/engine/kv_transfer.py``); r is then priced as a cold prefill.
      The prefill queued on r counts as taken: its figures are up to a second
      old, and requests sent to it since (this router's, in
      ``num_prefill_tokens``) take blocks before the fetch asks for room.
      Without that, ``bench routing`` (92-block pools, 32-block prefixes)
      saw 2 and 6 of 7 and 11 fetches refused ``no_room``, each request then
      prefilling cold on the receiver.

Parameters and defaults (``routing_policy_params`` of ``prefix_cost``)
    fetch_bytes_per_s           Bytes per second of a fetch, end to end
                                (the holder's gather, the object store, the
                                receiver's scatter); 0 turns fetch pricing
                                off. A deployment's default is
                                ``default_fetch_bytes_per_s``: 1.5e9 (what
                                loopback measured: 23.6 MB imported in ~15 ms
                                beyond the fixed cost) where each replica
                                reserves whole CPUs, 0 where replicas share
                                cores (``bench routing``, docs/KV_TRANSFER.md:
                                P99 TTFT 1.46-2.14x better with a core each,
                                0.80x, worse, on the packed pair). The
                                policy class alone defaults to 0.
    fetch_overhead_s = 0.010    Fixed time of a fetch: the Ray call to the
                                holder and its pin (14.6 ms asked, of which
                                6.5 ms the read, measured on an idle holder).
                                The pin runs beside a busy holder's forward
                                (``workers/engine/pool_gate.py``); before, it
                                waited for the holder's step and ``bench
                                routing`` measured 0.05-10 s (docs/KV_TRANSFER.md).
    fetch_holder_bytes_per_s = 1.0e10  The holder's read of the blocks it
                                sends (23.6 MB in 2.0-2.5 ms, into reused
                                buffers: ``workers/kv_copy.py``): CPU it
                                takes from its own steps. 0: not priced.
    kv_bytes_per_token = 46080  KV bytes per token when the replica does not
                                report them (``ReplicaView.kv_bytes_per_token``,
                                0: not reported; replicas report it in their
                                routing stats): the
                                default model in float32, 30 layers x K and V x
                                3 heads x 64 x 4 bytes; ~12300 with
                                ``kv_cache_dtype: int8`` (values and scales).
    fetch_penalty_tokens = 256  What one more copy of a prefix costs the fleet
                                (cache room on the receiver: another prefix
                                evicted there), in prefill tokens.
                                ``prefixserve simulate`` (8 replicas, 512
                                blocks each, 40 Zipf tenants of 1,024-token
                                prompts): at 0 it lowered the hit rate at a
                                light load (91.6% -> 84.8%; prefixes copied
                                everywhere evict each other); with 128-512
                                tokens it kept it (90.9-91.1%) and still cut
                                TTFT P99 at a load that queues on the holders
                                (13.3 s -> 2.4 s); docs/KV_TRANSFER.md.
    fetch_max_exports = 2       Exports a holder runs at once (the replicas'
                                ``cache.kv_transfer_max_concurrent``): a
                                holder with that many fetches in flight is
                                not named.
    prefill_tokens_per_s = 460  A replica's prefill rate, converting seconds
                                to prefill tokens (the default model on 2
                                cores, as ``prefixserve simulate`` models it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from router.policies.base import ReplicaView, RoutingInput

DEFAULT_FETCH_BYTES_PER_S = 0.0  # the policy alone; a deployment's: default_fetch_bytes_per_s
MEASURED_FETCH_BYTES_PER_S = 1.5e9  # loopback, docs/KV_TRANSFER.md
DEFAULT_FETCH_OVERHEAD_S = 0.010
DEFAULT_FETCH_HOLDER_BYTES_PER_S = 1.0e10
DEFAULT_KV_BYTES_PER_TOKEN = 46080.0
DEFAULT_FETCH_PENALTY_TOKENS = 256.0
DEFAULT_PREFILL_TOKENS_PER_S = 460.0
DEFAULT_FETCH_MAX_EXPORTS = 2
FETCH_HORIZON_S = 0.1  # a fetch hint counts as in flight this long (a 2,048-token prefix: ~0.1 s)


def default_fetch_bytes_per_s(replica_num_cpus: float) -> float:
    """``fetch_bytes_per_s`` for a deployment that does not set it: priced
    where each replica reserves whole CPUs (a less-loaded replica's cores are
    its own, otherwise idle, and a fetch puts them to work), off where
    replicas reserve a fraction and share the machine's cores (there a second
    batch slows the holder's more than the queue it saves). Module doc."""
    return MEASURED_FETCH_BYTES_PER_S if replica_num_cpus >= 1 else 0.0


@dataclass(frozen=True)
class FetchPricing:
    """The fetch cost model's parameters (module doc); ``enabled`` when priced."""

    fetch_bytes_per_s: float = DEFAULT_FETCH_BYTES_PER_S
    fetch_overhead_s: float = DEFAULT_FETCH_OVERHEAD_S
    fetch_holder_bytes_per_s: float = DEFAULT_FETCH_HOLDER_BYTES_PER_S
    kv_bytes_per_token: float = DEFAULT_KV_BYTES_PER_TOKEN
    prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S
    fetch_penalty_tokens: float = DEFAULT_FETCH_PENALTY_TOKENS

    def __post_init__(self) -> None:
        for name in ("fetch_bytes_per_s", "fetch_overhead_s", "fetch_holder_bytes_per_s", "kv_bytes_per_token",
                     "prefill_tokens_per_s", "fetch_penalty_tokens"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.fetch_bytes_per_s and not (self.kv_bytes_per_token and self.prefill_tokens_per_s):
            raise ValueError("pricing fetches (fetch_bytes_per_s > 0) needs kv_bytes_per_token and "
                             "prefill_tokens_per_s > 0")

    @property
    def enabled(self) -> bool:
        return self.fetch_bytes_per_s > 0

    def seconds(self, receiver: ReplicaView, num_tokens: int) -> float:
        """Time to fetch ``num_tokens`` tokens' KV into ``receiver``, the holder's read included."""
        num_bytes = num_tokens * (receiver.kv_bytes_per_token or self.kv_bytes_per_token)
        holder = num_bytes / self.fetch_holder_bytes_per_s if self.fetch_holder_bytes_per_s else 0.0
        return num_bytes / self.fetch_bytes_per_s + self.fetch_overhead_s + holder

    def transfer_tokens(self, receiver: ReplicaView, num_tokens: int) -> float:
        """``seconds`` in the receiver's prefill tokens, plus the penalty (module doc)."""
        return self.seconds(receiver, num_tokens) * self.prefill_tokens_per_s + self.fetch_penalty_tokens


def best_holder(inp: RoutingInput, order_key, max_exports: int = DEFAULT_FETCH_MAX_EXPORTS
                ) -> Optional[tuple[str, int]]:
    """``(holder id, its confirmed blocks)``: below ``max_exports`` exports in flight, longest
    confirmed match, fewest exports, fewest sequences, then ``order_key(replica_id)``
    (rendezvous); None when no such replica holds a block."""
    held = [v for v in inp.replicas if (v.matched_blocks or 0) > 0 and v.num_exports < max_exports]
    if not held:
        return None
    best = min(held, key=lambda v: (-min(v.matched_blocks, inp.num_blocks), v.num_exports,
                                    v.num_running + v.num_waiting + v.num_swapped, order_key(v.replica_id)))
    return best.replica_id, min(best.matched_blocks, inp.num_blocks)


def has_room_to_import(view: ReplicaView, num_blocks: int, block_size: int = 16) -> bool:
    """Whether the receiver would accept ``num_blocks`` imported blocks: at most half of its
    free blocks (the receiver's own rule), counting as taken the blocks of the prefill
    queued there (``num_prefill_tokens``: its own figure plus what this router sent since,
    which will hold blocks by the time the fetch asks); True when its pool size is unknown."""
    if not view.num_kv_blocks:
        return True
    free = round(view.num_kv_blocks * (1.0 - view.kv_cache_usage))
    free -= math.ceil(view.num_prefill_tokens / max(1, block_size))
    return 2 * num_blocks <= free
