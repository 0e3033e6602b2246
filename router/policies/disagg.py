"""Disaggregated prefill: which replica prefills a request and which decodes it
(issue 33 item 4; the replica's side is ``workers/disagg.py``, the design and
its numbers docs/DISAGGREGATION.md).

Roles
    ``prefill_replicas`` N (the model's serving config; 0, the default, turns
    this off): a replica whose Serve rank (``record_replica_metadata``) is
    below N is a ``prefill`` replica (SGLang's ``--disaggregation-mode
    prefill``, vLLM's ``kv_producer``), every other one a ``decode`` replica
    (``decode``, ``kv_consumer``); with N = 0 every replica is ``both``
    (``kv_both``: today's behaviour). A replica that reported no rank counts
    as ``decode``: it is never asked to prefill for another.

The pair, on top of the policy's ranking (the policy, ``prefix_cost`` by
default, has already weighed every replica's confirmed prefix match and load)
    1. Off, or no live replica of one of the two roles: the ranking as it is
       (a lone survivor of either role serves requests whole: nothing is
       refused while a role is missing).
    2. Decode replicas first, in the policy's order; then the prefill
       replicas, in the policy's order: Serve tries those only when every
       decode replica rejects the request, and such a one serves it whole.
    3. The prefill replica P: the first prefill replica of the policy's
       order (its longest confirmed match, its lightest queue).
    4. Hints: each decode replica D missing at least ``MIN_TRANSFER_BLOCKS``
       (1) of the prompt's transferable blocks (its confirmed match below
       them; unknown counts as 0) gets ``fetch_from[D] = P`` and the request
       ``prefill_first``: D asks P to prefill, pulls the blocks, decodes.
       A decode replica that holds the whole prefix gets no hint and hits
       locally. Transferable: the prompt's full blocks but the one holding
       its last token, ``(num_prompt_tokens - 1) // block_size`` (the decode
       replica computes the last token itself, as on a local hit).
    5. A request with a LoRA adapter gets no hints (the fetch does not hash
       adapters yet, docs/KV_TRANSFER.md): the decode replica prefills it.

Not priced (yet): whether disaggregating pays for this request (a short
prompt, an idle decode replica). On CPU it does not pay in TTFT (measured in
docs/DISAGGREGATION.md), so it stays off by default.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional

from router.policies.base import Ranking

ROLES = ("both", "prefill", "decode")
MIN_TRANSFER_BLOCKS = 1  # a decode replica missing fewer of the prompt's blocks prefills them itself


def role_of(rank: Optional[int], prefill_replicas: int) -> str:
    """A replica's role from its Serve rank (None: it did not report one)."""
    if prefill_replicas <= 0:
        return "both"
    return "prefill" if rank is not None and 0 <= rank < prefill_replicas else "decode"


@dataclass(frozen=True)
class Pairing:
    """The ranking to hand Serve, the fetch hints, and whether the hinted replicas prefill first."""

    replica_ids: list[str]
    fetch_from: Mapping[str, str] = field(default_factory=dict)
    prefill_first: bool = False


def pair(ranking: Ranking, roles: Mapping[str, str], matched: Mapping[str, Optional[int]],
         num_prompt_tokens: int, block_size: int, has_adapter: bool = False) -> Pairing:
    """Steps 1-5 of the module doc. ``roles``: replica id -> role (absent: ``both``);
    ``matched``: replica id -> its confirmed leading blocks of the prompt (absent or None: 0)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    prefill = [rid for rid in ranking.replica_ids if roles.get(rid, "both") == "prefill"]
    decode = [rid for rid in ranking.replica_ids if roles.get(rid, "both") == "decode"]
    if not prefill or not decode:
        return Pairing(list(ranking.replica_ids), dict(ranking.fetch_from))
    others = [rid for rid in ranking.replica_ids if rid not in prefill and rid not in decode]  # "both"
    order = decode + others + prefill
    transferable = max(0, (num_prompt_tokens - 1) // block_size)
    if has_adapter or transferable < MIN_TRANSFER_BLOCKS:
        return Pairing(order)
    source = prefill[0]
    hints = {rid: source for rid in decode if transferable - (matched.get(rid) or 0) >= MIN_TRANSFER_BLOCKS}
    return Pairing(order, hints, prefill_first=bool(hints))
