"""Plain data shared by every process: sampling parameters, requests, stream chunks.

Nothing here imports torch, ray or grpc. Field names follow vLLM's
``SamplingParams`` so users (and the gRPC contract) find the knobs they know.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional

from cluster.shared.structured import StructuredOutputsParams

# Hard caps that keep one request from taking a replica down. They are not
# user knobs; the router validates tighter per-deployment limits later.
MAX_STOP_STRINGS = 64
MAX_LOGPROBS = 20


class ReplicaOverloadedError(RuntimeError):
    """A replica's waiting queue is full (``max_waiting_requests``): retry later.

    Raised by the replica before it queues anything; the router maps it to
    ``RESOURCE_EXHAUSTED`` / HTTP 429 with ``retry_after_s`` as the hint.

    Args:
        message: Says which bound was hit.
        retry_after_s: When a retry is likely to be admitted, in seconds.
    """

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def __reduce__(self):  # crosses process boundaries (Ray) with its hint
        return (type(self), (str(self), self.retry_after_s))


class FinishReason(str, enum.Enum):
    """Why a request ended. ``str`` values are what the APIs return."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # cancelled by the client or the server


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next tokens of one request.

    Args:
        max_tokens: Most tokens to generate (>= 1).
        temperature: 0 means greedy; otherwise logits are divided by it.
        top_p: Nucleus sampling mass, in (0, 1].
        top_k: Keep the k most likely tokens; -1 (or 0) disables.
        min_p: Drop tokens whose probability is below min_p * p(max).
        seed: Per-request seed: the same seed gives the same tokens whatever
            else is in the batch.
        stop: Strings that end generation; the stop string is not returned.
        stop_token_ids: Token ids that end generation (kept in ``token_ids``).
        ignore_eos: Keep generating past the EOS token.
        repetition_penalty: >1 discourages tokens seen in prompt or output
            (CTRL-style: positive logits divided, negative multiplied).
        presence_penalty: Subtracted once from tokens present in the output.
        frequency_penalty: Subtracted per occurrence in the output.
        logprobs: Number of top log-probabilities to return per token
            (``None``: none; 0: only the sampled token's).
        prompt_logprobs: The same for every prompt token after the first
            (vLLM's knob: perplexity, scoring). Such a prompt is computed in
            full, never read from the prefix cache.
        structured_outputs: A constraint the output must match (JSON
            schema, regex, choice, grammar; ``cluster/shared/structured.py``),
            enforced in the engine; a dict is read as vLLM's request object.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    structured_outputs: Optional[StructuredOutputsParams] = None

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            object.__setattr__(self, "structured_outputs", StructuredOutputsParams.from_mapping(self.structured_outputs))
        # Accept lists from users; store tuples so the object stays hashable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        self._validate()

    def validate(self) -> None:
        """Checks every field again (an unpickled copy skipped ``__post_init__``).

        Raises:
            ValueError: A value is out of range, named in the message.
        """
        self._validate()

    def _validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}; use 1.0 to disable")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled), 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be > 0 (1.0 disables), got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(self.stop)}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative token ids")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}] or None, got {self.logprobs!r}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}] or None, got {self.prompt_logprobs!r}")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ValueError("structured_outputs must be a StructuredOutputsParams (or a dict of its fields)")
            self.structured_outputs.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


@dataclass(frozen=True)
class TokenLogprob:
    """Log-probability of one generated token and the top alternatives."""

    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass
class GenerationRequest:
    """One request as the engine receives it (already tokenized)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0  # lower value = served first (vLLM convention)
    cache_salt: str = ""  # isolates prefix-cache entries between tenants
    arrival_time: float = 0.0
    # The last N prompt tokens are output a client has already received (a stream migrated from a
    # replica that died, ``router/migration.py``): a structured-output constraint starts after them.
    num_resumed_output_tokens: int = 0


@dataclass
class StreamChunk:
    """A delta of one request's output, as streamed to clients."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: Optional[FinishReason] = None
    logprobs: Optional[list[TokenLogprob]] = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    replica_id: str = ""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class ReplicaStats:
    """Load of one replica, as the router and autoscaler see it."""

    replica_id: str
    num_running: int
    num_waiting: int
    num_swapped: int
    kv_cache_usage: float  # used device blocks / total, in [0, 1]
    num_cached_blocks: int
    # Work in tokens, for the routers' cost model (router/policies/prefix_cost.py):
    num_prefill_tokens: int = 0  # prompt tokens of waiting and running sequences not computed yet
    num_decode_tokens: int = 0  # context tokens of the decoding sequences (what each step's attention reads)
    num_kv_blocks: int = 0  # device KV blocks in the pool (kv_cache_usage * this = blocks in use)
    at: float = 0.0  # time.time() when the figures were read
