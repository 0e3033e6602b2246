"""Replicas that split one machine's cores, priced as one engine (``prefix_cost``'s
packing rule).

Replicas packed on one machine, each with a fraction of a CPU, split its
cores by how many of them are busy (``workers/core_share.py``; they report
the same ``core_group``). Two consequences for routing:

- **Their queues are one queue.** Work queued on a sibling runs on the same
  cores as work queued here, so every member of a group is charged the
  group's whole queue (queued prefill, decode tokens, sequences), not its
  own. Spreading a burst over siblings therefore buys nothing, and a
  request's choice between them is made by what differs: its prefix match
  (its new prefill), its KV headroom, and the cost below. One exception:
  a sibling priced as fetching the prefix (``kv_fetch``) is charged its own
  queue, since the request then waits for that sibling's steps alone and adds
  only the prefill past the match to the shared cores (``prefix_cost``).
- **A second running batch reads the weights again.** Each busy replica reads
  the whole model every decode step, so two batches of 2 cost about twice
  one batch of 4 (measured on 2 cores: 2 replicas at 4 concurrent requests
  gave 0.66-0.68x the throughput of one engine batching all four). While a
  member is *open* (busy with fewer than ``pack_max_seqs`` sequences and KV
  headroom; a request this router just sent makes it busy before its figures
  say so), an idle sibling costs ``pack_idle_tokens`` more, and so does a
  *full* one (at ``pack_max_seqs`` or without headroom); among open members
  the one with the most sequences goes first, so batches that a burst split
  merge again as their requests finish.

A confirmed prefix on an idle sibling still wins when it saves more than the
wake cost (more than 4 blocks of 16 tokens, weighted 2.0, against 128). The
rule applies only with ``pack_max_seqs`` > 0 and to groups with at least two
members among the ranked replicas; replicas with cores of their own (whole
CPUs, GPUs, one per machine: ``core_group`` "") are priced on their own
queues as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from router.policies.base import ReplicaView


@dataclass(frozen=True)
class Packing:
    """Per replica id: the queue it is charged (its group's, for members of a
    packed group), what waking or overfilling it adds, and its order among
    equal costs (``-sequences`` for an open member: the fullest first)."""

    queue: dict[str, float] = field(default_factory=dict)
    penalty: dict[str, float] = field(default_factory=dict)
    order: dict[str, int] = field(default_factory=dict)


def num_seqs(view: ReplicaView) -> int:
    """Sequences a replica holds: running, waiting and swapped."""
    return view.num_running + view.num_waiting + view.num_swapped


def batch_size(view: ReplicaView) -> int:
    """Sequences a replica holds, at least 1 when prefill is queued there: a request
    this router just sent counts before the replica's figures show it (its prompt is
    in ``num_prefill_tokens``), so a burst decided in one go packs instead of
    finding every member idle."""
    return max(num_seqs(view), 1 if view.num_prefill_tokens > 0 else 0)


def plan_packing(views: Sequence[ReplicaView], queue_cost: Callable[[ReplicaView], float], pack_max_seqs: int,
                 pack_idle_tokens: float, kv_high_water: float) -> Packing:
    """The packing terms for ``views`` (module doc); empty where nothing is packed."""
    if not pack_max_seqs:
        return Packing()
    groups: dict[str, list[ReplicaView]] = {}
    for view in views:
        if view.core_group:
            groups.setdefault(view.core_group, []).append(view)
    packing = Packing()
    for members in groups.values():
        if len(members) < 2:
            continue
        shared = sum(queue_cost(v) for v in members)
        open_ = {v.replica_id for v in members
                 if 0 < batch_size(v) < pack_max_seqs and v.kv_cache_usage < kv_high_water}
        idle = {v.replica_id for v in members if batch_size(v) == 0}
        for view in members:
            rid = view.replica_id
            packing.queue[rid] = shared
            if rid in open_:
                packing.order[rid] = -batch_size(view)
            elif (rid in idle and open_) or (rid not in idle and (open_ or idle)):
                packing.penalty[rid] = pack_idle_tokens
    return packing
