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

import threading
from collections import deque
from dataclasses import dataclass, field, fields
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

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class DeferredText:
    """The detokenization of one request without stop strings, run by whoever
    reads its outputs' text (the replica's event loop, the ``LLM`` API) instead
    of on the engine thread between steps: nothing the engine decides depends
    on that text (stop strings do, and requests with them are detokenized in
    the step). Outputs are detokenized in their order whatever order they are
    read in (or read by several threads), each once; outputs nobody reads, nor
    any later one, are never detokenized.

    Args:
        detok: The request's ``IncrementalDetokenizer`` (``append`` / ``flush``).
    """

    def __init__(self, detok: Any) -> None:
        self._detok = detok
        self._lock = threading.Lock()  # the engine thread adds, a reader resolves
        self._pending: deque[tuple[list[int], bool]] = deque()
        self._texts: list[str] = []  # the deltas so far, by output number (as long as the outputs)
        self._count = 0

    def add(self, new_token_ids: list[int], final: bool) -> int:
        """Queues one output's tokens (``final``: then flush); returns its number."""
        with self._lock:
            number = self._count
            self._count += 1
            self._pending.append((new_token_ids, final))
            return number

    def text(self, number: int) -> str:
        """Output ``number``'s text delta (detokenizing the outputs before it first)."""
        with self._lock:
            while len(self._texts) <= number:
                ids, final = self._pending.popleft()
                text = self._detok.append(ids) if ids else ""
                self._texts.append(text + self._detok.flush() if final else text)
            return self._texts[number]


class DeferredTextOutput(RequestOutput):
    """A ``RequestOutput`` whose ``new_text`` comes from a ``DeferredText`` on first read.

    Equality, ``repr`` and pickling see the resolved text.
    """

    def __init__(self, source: DeferredText, number: int, **fields: Any) -> None:
        super().__init__(new_text="", **fields)
        self._source: Optional[DeferredText] = source
        self._number = number

    @property  # type: ignore[override]
    def new_text(self) -> str:
        if self._source is not None:
            self._text, self._source = self._source.text(self._number), None
        return self._text

    @new_text.setter
    def new_text(self, value: str) -> None:
        self._text, self._source = value, None

    def __eq__(self, other: object) -> bool:  # as a RequestOutput with this text
        return isinstance(other, RequestOutput) and all(
            getattr(self, f.name) == getattr(other, f.name) for f in fields(RequestOutput))

    __hash__ = None  # type: ignore[assignment]  # as RequestOutput's (a mutable dataclass)

    def __getstate__(self) -> dict:
        self.new_text  # noqa: B018 - resolve before crossing a process boundary
        return {k: v for k, v in self.__dict__.items() if k != "_source"} | {"_source": None}
