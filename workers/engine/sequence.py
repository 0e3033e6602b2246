"""A request inside the engine: its tokens, its block table and its state.

A ``Sequence`` is owned by the scheduler; the KV manager edits only its block
fields (``block_ids``, ``cpu_block_ids``, ``num_registered_blocks``,
``num_released_blocks``). The
model runner never sees it, only read-only views in ``ScheduledRequest``.

Tokens, computed tokens and blocks (block_size 4, prompt of 6, 3 generated)::

    token_ids            p0 p1 p2 p3 | p4 p5 o0 o1 | o2
    block_ids            [ 7         , 2           , 5  ]
    block_hashes         [ h1        , h2          ]      full blocks only
    num_computed_tokens  8  (KV of p0..o1 is in the cache; o2 was just
                            sampled, its KV is computed next step)

``block_hashes[i]`` chains on ``block_hashes[i-1]`` (``hash_root`` for i = 0)
as ``cluster.shared.hashing`` specifies; ``append_token`` extends the chain one block
at a time, so a step never rehashes the prompt.
"""

from __future__ import annotations

import enum
from typing import Iterable, Optional

from cluster.shared.hashing import hash_block, hash_block_chain, root_hash
from cluster.shared.types import FinishReason, GenerationRequest, SamplingParams


class SequenceStatus(enum.Enum):
    """Where a sequence is. Device blocks exist only while RUNNING, CPU
    blocks only while SWAPPED; WAITING and FINISHED sequences hold none."""

    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


class Sequence:
    """One request's tokens and scheduling state.

    Args:
        request_id: Unique among unfinished requests.
        prompt_token_ids: At least one token.
        sampling_params: How to sample; defaults to ``SamplingParams()``.
        block_size: Tokens per KV block (the unit of hashing).
        model_fingerprint: Identifies the weights in the hash chain.
        cache_salt: Isolates this tenant's prefix-cache entries.
        priority: Lower is served first (vLLM convention).
        arrival_time: Ties in priority go to the earlier arrival.

    The engine validates requests before it builds sequences
    (``validation.py``): an empty prompt here is a bug (asserted).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Iterable[int],
        sampling_params: Optional[SamplingParams] = None,
        *,
        block_size: int,
        model_fingerprint: str = "",
        cache_salt: str = "",
        priority: int = 0,
        arrival_time: float = 0.0,
        long_rope_after: Optional[int] = None,
    ) -> None:
        prompt = [int(t) for t in prompt_token_ids]
        assert prompt and block_size >= 1, (request_id, block_size)
        self.request_id = request_id
        self.prompt_token_ids = prompt
        self.output_token_ids: list[int] = []
        self._token_ids = list(prompt)  # prompt + output, kept to slice chunks cheaply
        self.sampling_params = sampling_params if sampling_params is not None else SamplingParams()
        self.block_size = block_size
        self.cache_salt = cache_salt
        self.priority = priority
        self.arrival_time = arrival_time

        self.status = SequenceStatus.WAITING
        self.finish_reason: Optional[FinishReason] = None
        self.finish_message: Optional[str] = None  # why the engine (not the user) ended it
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens hit in the prefix cache at first admission
        self.num_preemptions = 0
        # Set by the engine, on its clock: added, then first scheduled (queue time).
        self.queued_time: Optional[float] = None
        self.first_scheduled_time: Optional[float] = None
        # With sampling_params.prompt_logprobs: one entry per prompt token (None for the
        # first), filled as chunks are computed; handed out once, with the first output.
        self.prompt_logprobs: Optional[list] = None
        self.prompt_logprobs_sent = False
        # With sampling_params.structured_outputs: the grammar state (workers/engine/structured.py),
        # advanced by every token the sequence keeps.
        self.grammar = None
        # Parallel sampling: the choices still to fork from this sequence when it samples its
        # first token, as (request id, sampling params, grammar state); set by the engine.
        self.pending_forks: list[tuple[str, SamplingParams, object]] = []
        self.choice_index = 0  # which choice of its request this sequence is
        self.group_id = request_id  # the request's id (a fork's own id differs)
        self.lora = None  # workers.lora.manager.ActiveLoRA: its adapter (None: the base model)

        # Owned by the KV manager.
        self.block_ids: list[int] = []  # device block table while RUNNING
        self.cpu_block_ids: list[int] = []  # swap blocks while SWAPPED
        self.num_registered_blocks = 0  # leading full blocks already offered to the prefix cache
        # Leading table entries whose blocks were released because no layer's sliding
        # window reaches them any more; they point at the first block still held.
        self.num_released_blocks = 0

        # Longrope models: original_max_position_embeddings. A longer sequence is computed with the
        # long factors (``rope_long``), and its blocks hash on another root (not hittable by short ones).
        self.long_rope_after = long_rope_after
        self.rope_restart = False  # it crossed to long with KV computed short: recompute it all
        self._root_args = (model_fingerprint, cache_salt)
        self.hash_root = self._root()
        self.block_hashes: list[bytes] = hash_block_chain(prompt, block_size, self.hash_root)

    @classmethod
    def from_request(cls, request: GenerationRequest, *, block_size: int, model_fingerprint: str) -> "Sequence":
        """Builds a waiting sequence from an (already tokenized) request."""
        return cls(
            request.request_id,
            request.prompt_token_ids,
            request.sampling_params,
            block_size=block_size,
            model_fingerprint=model_fingerprint,
            cache_salt=request.cache_salt,
            priority=request.priority,
            arrival_time=request.arrival_time,
        )

    def fork(self, request_id: str, sampling_params: SamplingParams, choice_index: int) -> "Sequence":
        """A new waiting sequence with this one's prompt (and its hashes, not
        recomputed) and its output so far, holding no blocks. No mutation of
        ``self``."""
        child = Sequence.__new__(Sequence)
        child.__dict__.update(self.__dict__)
        child.request_id = request_id
        child.sampling_params = sampling_params
        child.output_token_ids = list(self.output_token_ids)
        child._token_ids = list(self._token_ids)
        child.block_hashes = list(self.block_hashes)
        child.status = SequenceStatus.WAITING
        child.finish_reason = None
        child.finish_message = None
        child.num_computed_tokens = 0
        child.num_preemptions = 0
        child.prompt_logprobs = None
        child.prompt_logprobs_sent = True
        child.grammar = None
        child.pending_forks = []
        child.choice_index = choice_index
        child.block_ids = []
        child.cpu_block_ids = []
        child.num_registered_blocks = 0
        child.num_released_blocks = 0
        return child

    # ---------------------------------------------------------------- sizes
    @property
    def num_tokens(self) -> int:
        return len(self._token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose KV is not in the cache yet (1 for a decoding sequence)."""
        return len(self._token_ids) - self.num_computed_tokens

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then output. A live view: do not mutate."""
        return self._token_ids

    @property
    def last_token_id(self) -> int:
        return self._token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    # -------------------------------------------------------------- mutation
    def append_token(self, token_id: int) -> None:
        """Appends a generated token and, when it fills a block, that block's
        hash (mutates the sequence)."""
        self.output_token_ids.append(token_id)
        self._token_ids.append(token_id)
        bs = self.block_size
        if len(self._token_ids) % bs == 0:
            parent = self.block_hashes[-1] if self.block_hashes else self.hash_root
            self.block_hashes.append(hash_block(parent, self._token_ids[-bs:]))
        assert len(self.block_hashes) == len(self._token_ids) // bs
        if self.long_rope_after is not None and len(self._token_ids) == self.long_rope_after + 1:
            self.hash_root = self._root()  # now long: every block rehashed, its KV to recompute
            self.block_hashes = hash_block_chain(self._token_ids, bs, self.hash_root)
            self.rope_restart = self.num_computed_tokens > 0

    @property
    def rope_long(self) -> bool:
        """Whether a longrope model computes this sequence with its long factors:
        it is longer than ``original_max_position_embeddings`` (transformers' rule)."""
        return self.long_rope_after is not None and len(self._token_ids) > self.long_rope_after

    def _root(self) -> bytes:
        fingerprint, salt = self._root_args
        return root_hash(fingerprint + ("/longrope-long" if self.rope_long else ""), salt)

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_ids}, cpu_blocks={self.cpu_block_ids})"
        )
