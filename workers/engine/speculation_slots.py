"""The scheduler's side of speculative decoding: asking the speculator for
drafts within a step's budget, and applying what the runner verified.

A decode with drafts gets ``1 + len(drafts)`` slots (the fed token and one per
draft; a tree's nodes in depth-first order, ``spec_decode.py``). The runner
returns the accepted drafts and the target's next token; their KV is kept,
an accepted tree node computed away from its position is moved there in the
next step (``kv_moves``), and the rejected slots' blocks are freed.
"""

from __future__ import annotations

from typing import Callable, Optional

from cluster.shared.types import FinishReason
from workers.engine.forks import StepResult
from workers.engine.kv_manager import KVCacheManager
from workers.engine.outputs import ModelOutput, ScheduledRequest
from workers.engine.sequence import Sequence
from workers.engine.spec_decode import Speculator
from workers.engine.spec_trees import accepted_path, tree_depth
from workers.engine.structured import trim_drafts

Drafts = tuple[list[int], list[int]]  # tokens and their parents (empty: a chain)


def propose_drafts(speculator: Optional[Speculator], order: list[Sequence], budget: int,
                   max_model_len: int) -> dict[Sequence, Drafts]:
    """Speculated tokens for the decoding sequences of ``order`` (in one batch):
    none without a speculator, and never past a sequence's max_tokens or
    max_model_len, or the step's budget (the target's own token is always one
    more), nor, for a longrope model's short sequence, past the length where it
    turns long. Drafts a sequence's grammar rejects are cut (they could never be
    accepted)."""
    if speculator is None:
        return {}
    asks = []
    for seq in order:
        if seq.num_uncomputed_tokens != 1:
            continue
        slots = min(max_model_len - seq.num_tokens - 1, budget - 1)  # a tree's tokens, every branch
        if seq.long_rope_after is not None and not seq.rope_long:  # a step stays short (longrope.py)
            slots = min(slots, seq.long_rope_after - seq.num_tokens)
        room = min(seq.sampling_params.max_tokens - seq.num_output_tokens - 1, slots)  # tokens it may keep
        if room > 0:
            asks.append((seq, room, slots))
    if not asks:
        return {}
    drafts = speculator.propose_batch([(seq.request_id, seq.all_token_ids, room, slots)
                                       for seq, room, slots in asks])
    out = {}
    for (seq, _, _), d in zip(asks, drafts):
        if d[0] and seq.grammar is not None:
            d = trim_drafts(seq.grammar, *d)
        if d[0]:
            out[seq] = d
    return out


def receive_proposals(speculator: Optional[Speculator], seq: Sequence, model_out: ModelOutput, i: int) -> None:
    """Hands the runner's guesses for ``seq``'s next step to the speculator."""
    guesses = model_out.spec_proposals[i] if model_out.spec_proposals is not None else None
    if guesses and speculator is not None and not seq.is_finished:
        speculator.receive(seq.request_id, seq.num_tokens, guesses)


def apply_verified(seq: Sequence, req: ScheduledRequest, model_out: ModelOutput, i: int, *,
                   kv: KVCacheManager, speculator: Optional[Speculator],
                   check_stop: Callable[[Sequence, int], Optional[FinishReason]],
                   kv_moves: list[tuple[int, int]],
                   sliding_window: Optional[int]) -> tuple[StepResult, Optional[FinishReason]]:
    """Applies a verified decode to ``seq`` (mutates it, its blocks and
    ``kv_moves``). Returns its step result and why it ends (None: it goes
    on); the caller finishes a sequence that ends."""
    sampled = model_out.sampled_token_ids[i]
    num_drafts = len(req.spec_token_ids)
    assert 1 <= len(sampled) <= 1 + num_drafts, (req.request_id, sampled)
    path, reached, branches = accepted_path(req.spec_token_ids, req.spec_parents, sampled)
    assert len(path) == len(sampled) - 1, (req.request_id, sampled, path)
    if speculator is not None:
        speculator.observe_result(seq.request_id, tree_depth(req.spec_parents, num_drafts), len(sampled) - 1,
                                  num_drafts, branches, reached=reached)
    kept, reason = [], None
    for token_id in sampled:
        seq.append_token(token_id)
        kept.append(token_id)
        reason = check_stop(seq, token_id)
        if reason is not None:
            break
    # KV is valid for the fed token and every kept token but the last; an
    # accepted tree node away from its position moves there next step.
    start, bs, table = req.num_computed_tokens + 1, kv.block_size, seq.block_ids
    for depth, node in enumerate(path[: len(kept) - 1]):
        if node != depth:
            src, dst = start + node, start + depth
            kv_moves.append((table[src // bs] * bs + src % bs, table[dst // bs] * bs + dst % bs))
    seq.num_computed_tokens += len(kept)
    kv.cache_computed_blocks(seq)
    if reason is None:
        receive_proposals(speculator, seq, model_out, i)
        kv.trim(seq)
        if sliding_window is not None:
            kv.release_outside_window(seq, sliding_window)
    logprobs = model_out.logprobs[i] if i < len(model_out.logprobs) else None
    return (seq, kept, logprobs[: len(kept)] if logprobs is not None else None), reason
