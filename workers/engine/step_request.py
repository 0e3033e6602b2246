"""One sequence's work in a step, as the runner reads it (``ScheduledRequest``):
the tokens to feed (its next known tokens, then any drafts), whether it
samples, the grammar masks and banned tokens for what it samples, the
choices it forks and the guesses the speculator wants back."""

from __future__ import annotations

from typing import Optional
from typing import Sequence as Sequence_

from workers.engine.outputs import ScheduledRequest
from workers.engine.sequence import Sequence
from workers.engine.spec_decode import Speculator
from workers.engine.stopping import TokenStops
from workers.engine.structured import GrammarBackend, fill_draft_masks


def make_scheduled(seq: Sequence, num_new: int, spec: tuple[Sequence_[int], Sequence_[int]], *,
                   speculator: Optional[Speculator], structured: Optional[GrammarBackend],
                   stops: TokenStops) -> ScheduledRequest:
    """``seq``'s ``num_new`` tokens this step, the last ``len(spec[0])`` of them
    drafts with parents ``spec[1]``. No mutation of ``seq``."""
    drafts, parents = spec
    start = seq.num_computed_tokens
    num_known = num_new - len(drafts)  # tokens of the sequence; the drafts follow
    samples = start + num_known == seq.num_tokens
    guesses = speculator.runner_proposals_wanted(seq.request_id) if samples and speculator else 0
    masks = None
    if samples and seq.grammar is not None:
        assert structured is not None, "a sequence with a grammar needs the engine's grammar backend"
        masks = fill_draft_masks(seq.grammar, structured, drafts, parents)
    return ScheduledRequest(
        request_id=seq.request_id,
        input_token_ids=seq.all_token_ids[start : start + num_known] + list(drafts),
        num_computed_tokens=start,
        block_ids=list(seq.block_ids),
        num_sample_tokens=1 + len(drafts) if samples else 0,
        sampling_params=seq.sampling_params,
        prompt_token_ids=seq.prompt_token_ids,
        output_token_ids=seq.output_token_ids,
        spec_token_ids=list(drafts),
        spec_parents=list(parents),
        num_proposals=guesses,
        num_proposal_candidates=speculator.num_candidates if guesses else 1,
        grammar_bitmask=masks,
        fork_params=tuple(p for _, p, _ in seq.pending_forks) if samples else (),
        min_tokens_banned_ids=stops.min_tokens_banned(seq) if samples else (),
        rope_long=seq.rope_long,
        lora_slot=seq.lora.slot if seq.lora is not None else -1,
    )
