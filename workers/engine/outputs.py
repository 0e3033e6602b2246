"""Plain data crossing the scheduler / model-runner boundary.

The scheduler returns a ``SchedulerOutput``; the runner (torch, possibly on
other processes for tensor parallelism) executes it and returns a
``ModelOutput``. The runner never mutates sequences: the lists it receives are
read-only views of the scheduler's state.

One step, as the runner sees it (B scheduled requests, T tokens)::

    scheduled[i].input_token_ids   tokens whose KV is computed this step; their
                                   positions are num_computed_tokens ... +len-1
    scheduled[i].block_ids         the whole block table after allocation
    scheduled[i].num_sample_tokens 0 for a prompt chunk that does not reach the
                                   end of the prompt, 1 otherwise, 1 + k for a
                                   decode with k speculated tokens
    scheduled[i].spec_token_ids    those k tokens (the tail of input_token_ids)
    scheduled[i].spec_parents      with a tree of proposals: each one's parent
                                   (an earlier index, -1 for the fed token);
                                   empty for a chain (each follows the last)

    ModelOutput.sampled_token_ids[i]  exactly num_sample_tokens tokens, or with
                                      speculated tokens 1 to 1 + k: the accepted
                                      ones and one sampled by the target
                                      (``workers/engine/spec_decode.py``)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from cluster.shared.types import FinishReason, SamplingParams, TokenLogprob


@dataclass
class ScheduledRequest:
    """One request's share of a step."""

    request_id: str
    input_token_ids: list[int]
    num_computed_tokens: int
    block_ids: Sequence[int]
    num_sample_tokens: int
    sampling_params: SamplingParams
    prompt_token_ids: Sequence[int]  # read-only: for penalties
    output_token_ids: Sequence[int]  # read-only: for penalties and seeded sampling
    spec_token_ids: Sequence[int] = ()  # speculated tokens: the last len() input tokens
    # A tree of proposals (several candidate continuations, verified together): the parent of
    # each speculated token, an earlier index or -1 (the fed token); empty for a chain. Token i's
    # KV slot is position num_computed_tokens + 1 + i; its position is its parent's + 1.
    spec_parents: Sequence[int] = ()
    num_proposals: int = 0  # guesses the runner's own proposer (Medusa heads) makes for the next step
    num_proposal_candidates: int = 1  # candidate continuations it makes (a tree when > 1)
    # With a structured-output grammar: the allowed tokens of each of the num_sample_tokens rows
    # (the fed token's, then each draft's), a backend buffer of packed bits ([rows, ceil(V / 32)]
    # int32 for xgrammar); None: unconstrained.
    grammar_bitmask: Any = None
    # Parallel sampling (n / best_of): the sampling parameters of the other choices, which fork
    # from this request at this step. The runner samples each from this request's last row, as a
    # request with those parameters and no output yet (ModelOutput.fork_samples).
    fork_params: Sequence[SamplingParams] = ()
    # With SamplingParams.min_tokens: the tokens that may not be sampled while the output is
    # shorter than min_tokens (the EOS tokens unless ignore_eos, and the stop token ids).
    min_tokens_banned_ids: Sequence[int] = ()
    # Longrope models: the sequence is past original_max_position_embeddings, its positions use the
    # rotary rows of the long factors (``workers/model/longrope.py``).
    rope_long: bool = False
    lora_slot: int = -1  # the LoRA adapter's slot in the layers (workers/lora/); -1: the base model

    @property
    def num_input_tokens(self) -> int:
        return len(self.input_token_ids)

    @property
    def seq_len(self) -> int:
        """Tokens in the KV cache after this step."""
        return self.num_computed_tokens + len(self.input_token_ids)


@dataclass
class SchedulerOutput:
    """Everything the runner does in one step, in this order:

    0. move KV rows ``kv_moves`` (``(from_slot, to_slot)``, every layer): the
       accepted branch of a tree verified last step, to its positions,
    1. copy ``swap_out`` blocks device -> CPU (``(device_block, cpu_block)``),
    2. copy ``swap_in`` blocks CPU -> device (``(cpu_block, device_block)``),
    3. run the forward pass over ``scheduled`` and sample.

    ``finished_request_ids`` lists requests that ended since the last step, so
    a runner holding per-request state can drop it.
    """

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    finished_request_ids: set[str] = field(default_factory=set)
    kv_moves: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(len(r.input_token_ids) for r in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.swap_in and not self.swap_out and not self.kv_moves


@dataclass
class ModelOutput:
    """What the runner returns, aligned with ``SchedulerOutput.scheduled``."""

    sampled_token_ids: list[list[int]]
    logprobs: list[Optional[list[TokenLogprob]]]
    # Per scheduled request asking for them: (position of the first, logprobs of the prompt
    # tokens at that position and on) for the prompt tokens this step's chunk predicts.
    prompt_logprobs: Optional[list[Optional[tuple[int, list[TokenLogprob]]]]] = None
    # Per scheduled request asking for them (num_proposals): the runner's guesses of the
    # tokens after the ones it returned, for the next step's speculation: candidate
    # continuations, the likeliest first (one unless num_proposal_candidates > 1).
    spec_proposals: Optional[list[Optional[list[list[int]]]]] = None
    # Per scheduled request with fork_params: one (token id, logprobs or None) per fork, in order.
    fork_samples: Optional[list[Optional[list[tuple[int, Optional[list[TokenLogprob]]]]]]] = None


@dataclass
class RequestOutput:
    """A request's progress after one engine step (deltas, not totals)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finish_reason: Optional[FinishReason]
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    new_logprobs: Optional[list[TokenLogprob]] = None
    # With SamplingParams.prompt_logprobs, in the request's first output: one per prompt
    # token, None for the first (nothing predicts it).
    prompt_logprobs: Optional[list[Optional[TokenLogprob]]] = None
    finish_message: Optional[str] = None  # why the engine (not the user) ended it
    queue_time: Optional[float] = None  # seconds from add_request to first scheduled (engine clock)
    # Parallel sampling (SamplingParams.n / best_of): which choice these tokens belong to, and
    # whether other choices of the request are still generating (finish_reason then ends this
    # choice only). Counts (num_output_tokens) are this choice's.
    index: int = 0
    more_choices: bool = False

    @property
    def finished(self) -> bool:
        """The whole request ended (every choice)."""
        return self.finish_reason is not None and not self.more_choices


def merge_outputs(first: RequestOutput, later: RequestOutput) -> RequestOutput:
    """One output covering two consecutive ones of a request (``first``
    then ``later``): their tokens, text and logprobs in order, ``later``'s
    totals and finish. A stream sends it as one chunk where the client
    receives the same tokens and text either way. Both are of one choice
    (the same ``index``)."""
    assert first.index == later.index, (first.index, later.index)
    logprobs = first.new_logprobs
    if later.new_logprobs is not None:
        logprobs = (logprobs or []) + later.new_logprobs
    return RequestOutput(
        request_id=first.request_id,
        new_token_ids=first.new_token_ids + later.new_token_ids,
        new_text=first.new_text + later.new_text,
        finish_reason=later.finish_reason,
        num_prompt_tokens=later.num_prompt_tokens,
        num_output_tokens=later.num_output_tokens,
        num_cached_tokens=later.num_cached_tokens,
        new_logprobs=logprobs,
        prompt_logprobs=first.prompt_logprobs if first.prompt_logprobs is not None else later.prompt_logprobs,
        finish_message=later.finish_message,
        queue_time=first.queue_time if first.queue_time is not None else later.queue_time,
        index=later.index,
        more_choices=later.more_choices,
    )


def chunk_due(held: RequestOutput, sent_first: set[int], stream_interval: int) -> bool:
    """Whether the tokens held for a stream go out now: at a finish, as a choice's
    first token, or once ``stream_interval`` of them are held (``stream_interval``)."""
    return held.finish_reason is not None or held.index not in sent_first \
        or len(held.new_token_ids) >= stream_interval
