"""LoRA adapter placement inside ``prefix_cost``: what a request's adapter
adds to a replica's cost, and over how many replicas an adapter lives.

Algorithm
    A request that names adapter ``a`` (``RoutingInput.adapter``) adds to the
    cost of replica r, in the prefill tokens of ``prefix_cost``:

        0                               r holds a (or did not say: None)
        load_tokens                     r does not hold a, r is one of a's homes
        load_tokens + eviction_tokens   r does not hold a, is not a home, and
                                        holds max_cpu_loras adapters already
        load_tokens                     otherwise (a stray with a free slot)

    ``load_tokens`` is the adapter's read (``load_s * prefill tokens/s``):
    the request waits for it, and so does every request queued behind it.
    Each replica measures its own (``ReplicaView.adapter_load_tokens``: the
    mean of its loads' seconds times its prefill steps' tokens/s,
    ``workers/lora/load_cost.py``); ``adapter_load_tokens`` stands in for a
    replica that has not measured both yet. ``eviction_tokens`` prices churn: a stray load on a
    full replica evicts an adapter that lives there, whose next request
    pays a load again (and the loads/evictions per minute are a cost of
    their own: disk reads, a slot rewrite in every targeted layer).

    Homes: the first ``k`` replicas of the adapter's rendezvous order (the
    order of ``rendezvous(b"lora\\0" + name, replica_id)``, the same at every
    router), where ``k`` follows the adapter's request rate with hysteresis:

        k grows to   ceil(rate / rps_per_home)                 at once
        k shrinks to ceil(rate / (shrink_ratio * rps_per_home)) only when lower

    so an adapter at 10 req/s with rps_per_home 2 lives on 5 replicas, and
    keeps them until its rate falls under 5 req/s (k 4 then): a rate that
    wobbles around a threshold does not add and drop a home each time. The
    homes of a cold adapter (k = 1) are not stored at all. A home pays the
    load but no eviction penalty, so new requests for a hot adapter spread
    over its homes (which load it once and then hold it) instead of
    queueing on the first holder or loading it on any idle replica.

    Holders keep a request as long as their queue is less than
    ``load_tokens`` (+ ``eviction_tokens`` against a full stray) longer than
    another replica's: a busy holder loses to an idle non-holder exactly
    when queueing costs more than loading. Prefix matches are credited as
    before: a request's blocks are hashed with its adapter's content hash,
    so only a holder (or a replica that held it) can match them, and a
    holder with the prefix wins over a holder without.

Parameters and defaults
    adapter_load_tokens = 32.0       One adapter read, in prefill tokens, for
                                     a replica that has not measured its own
                                     yet: rank 16 on the default model reads
                                     in 5-50 ms (docs/LORA.md); at ~460
                                     prefill tokens/s on 2 CPU cores 20 ms is
                                     ~9 tokens, on a GPU hundreds.
    adapter_eviction_tokens = 256.0  Churn penalty of a stray load on a full
                                     replica (``prefixserve simulate
                                     --adapters``, docs/BENCHMARKS.md "LoRA
                                     placement"). 0: no penalty.
    adapter_rps_per_home = 2.0       Requests/s of one adapter one home
                                     serves before the adapter gets another.
                                     0: one home per adapter.
    adapter_shrink_ratio = 0.5       Hysteresis of k (1.0: none).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Optional

from router.policies.base import ReplicaView

DEFAULT_ADAPTER_LOAD_TOKENS = 32.0
DEFAULT_ADAPTER_EVICTION_TOKENS = 256.0
DEFAULT_ADAPTER_RPS_PER_HOME = 2.0
DEFAULT_ADAPTER_SHRINK_RATIO = 0.5
MAX_TRACKED_ADAPTERS = 4096  # adapters with k > 1 remembered; the least recently seen go first


def adapter_key(name: str) -> bytes:
    """The rendezvous key of an adapter's homes (never equal to a block hash prefix key)."""
    return b"lora\0" + name.encode()


class AdapterHomes:
    """How many homes each adapter has (module doc), with hysteresis.

    Args:
        rps_per_home: Requests/s of one adapter per home (0: always 1 home).
        shrink_ratio: In (0, 1]; k drops only below this fraction of the
            rate that set it.
    """

    def __init__(self, rps_per_home: float = DEFAULT_ADAPTER_RPS_PER_HOME,
                 shrink_ratio: float = DEFAULT_ADAPTER_SHRINK_RATIO,
                 max_tracked: int = MAX_TRACKED_ADAPTERS) -> None:
        if not (rps_per_home >= 0 and math.isfinite(rps_per_home)):
            raise ValueError(f"adapter_rps_per_home must be a finite number >= 0, got {rps_per_home!r}")
        if not 0.0 < shrink_ratio <= 1.0:
            raise ValueError(f"adapter_shrink_ratio must be in (0, 1], got {shrink_ratio!r}")
        self.rps_per_home = float(rps_per_home)
        self.shrink_ratio = float(shrink_ratio)
        self.max_tracked = max_tracked
        self._sizes: "OrderedDict[str, int]" = OrderedDict()  # adapters with k > 1

    def size(self, adapter: str, rate: float, num_replicas: int) -> int:
        """k of ``adapter`` at ``rate`` requests/s in a fleet of ``num_replicas``.

        Updates the adapter's k (grows at once, shrinks with hysteresis);
        calling it again with the same rate returns the same k.
        """
        if not adapter or not self.rps_per_home or num_replicas <= 1:
            return 1
        low = math.ceil(rate / self.rps_per_home)
        high = math.ceil(rate / (self.shrink_ratio * self.rps_per_home))
        k = max(1, min(max(self._sizes.get(adapter, 1), low), high))  # the fleet's size caps the answer only
        if k > 1:
            self._sizes[adapter] = k
            self._sizes.move_to_end(adapter)
            while len(self._sizes) > self.max_tracked:
                self._sizes.popitem(last=False)
        else:
            self._sizes.pop(adapter, None)
        return min(k, num_replicas)

    def __len__(self) -> int:
        return len(self._sizes)


def adapter_cost(view: ReplicaView, is_home: bool, load_tokens: float, eviction_tokens: float) -> float:
    """Tokens a request's adapter adds to ``view``'s cost (module doc)."""
    holds: Optional[bool] = view.holds_adapter
    if holds is None or holds:
        return 0.0
    full = bool(view.max_adapters) and view.num_adapters >= view.max_adapters
    load = view.adapter_load_tokens or load_tokens  # what the replica measured, else the configured price
    return load + (eviction_tokens if full and not is_home else 0.0)
