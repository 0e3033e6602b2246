"""Admission's arithmetic: how many tokens a sequence starts with, where its
prefix-cache hit begins, and how much prefill work is queued.

A waiting sequence whose next uncached block is being prefilled by a running
sequence (two requests of one tenant arriving together) waits for that
prefill instead of computing the same blocks beside it: one step later they
are in the prefix cache and it starts from there (SGLang's in-batch prefix
caching). The scheduler's admission stops there too, so the order is kept.

Chunked prefill is "num_computed_tokens catches up with num_tokens": a
sequence gets ``min(uncomputed tokens, budget left)`` tokens this step, and
samples only when the chunk reaches its last known token (budget 16, a
40-token prompt next to one decoding sequence)::

    step 1   decode 1 | prompt  0..14  (15, no sample)
    step 2   decode 1 | prompt 15..29  (15, no sample)
    step 3   decode 1 | prompt 30..39  (10, samples its first token)

With ``enable_chunked_prefill`` off a prompt is admitted only whole. The one
exception is a sequence preempted for recompute whose prompt + output has
outgrown the budget: it is chunked, else it could never run again.
"""

from __future__ import annotations

from typing import Iterable, Optional

from workers.engine.kv_manager import KVCacheManager
from workers.engine.sequence import Sequence

STATS_EXACT_WAITING = 32  # waiting sequences whose cached prefix the stats look up


def blocks_in_prefill(running: Iterable[Sequence], block_size: int) -> set[bytes]:
    """Hashes of the full prompt blocks running sequences have not computed yet."""
    return {h for r in running if r.num_computed_tokens < len(r.block_hashes) * block_size
            for h in r.block_hashes[r.num_computed_tokens // block_size:]}


def chunk_size(seq: Sequence, num_computed: int, budget: int, *, enable_chunked_prefill: bool,
               max_num_batched_tokens: int) -> int:
    """Tokens to admit ``seq`` with this step; 0 means wait for a step with
    more budget (a whole prompt is due and chunking is off). A sequence that
    has outgrown the step budget (a recompute) is chunked anyway, else it
    could never run again."""
    remaining = seq.num_tokens - num_computed
    if remaining <= budget:
        return remaining
    if enable_chunked_prefill or remaining > max_num_batched_tokens:
        return budget
    return 0


def waits_for_prefill(seq: Sequence, num_hit_tokens: int, block_size: int, in_flight: set[bytes]) -> bool:
    """Whether ``seq``'s next uncached block is in a running prefill (so it
    should start from the cache next step instead)."""
    next_block = num_hit_tokens // block_size
    return next_block < len(seq.block_hashes) and seq.block_hashes[next_block] in in_flight


def queued_prefill_tokens(running: list[Sequence], waiting: list[Sequence], kv: KVCacheManager) -> int:
    """Prompt tokens of waiting and running sequences whose KV is not computed
    yet: the prefill work queued. A waiting sequence's leading blocks that are
    in the prefix cache, or that a running prefill is computing, do not count
    (it will start from them); past the first ``STATS_EXACT_WAITING`` waiting
    sequences the whole prompt counts. No mutation."""
    total = sum(max(0, seq.num_prompt_tokens - seq.num_computed_tokens) for seq in running)
    size = kv.block_size
    in_flight: Optional[set[bytes]] = blocks_in_prefill(running, size) if waiting and kv.enable_prefix_caching \
        else None
    for i, seq in enumerate(waiting):
        reusable = 0
        if in_flight is not None and i < STATS_EXACT_WAITING:
            _, reusable = kv.get_computed_blocks(seq)
            while reusable // size < len(seq.block_hashes) and seq.block_hashes[reusable // size] in in_flight:
                reusable += size
        total += max(0, seq.num_prompt_tokens - max(seq.num_computed_tokens, reusable))
    return total
