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
MAX_LOGIT_BIAS = 1024  # logit_bias entries (OpenAI allows 300 on its side)
MAX_ALLOWED_TOKEN_IDS = 1 << 17
MAX_BAD_WORDS = 256
# What one request may fork into (n, best_of) before a replica's own max_num_seqs bounds it.
MAX_CHOICES = 256


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
        n: Choices to return. The prompt is prefilled once; its KV blocks
            are shared by the choices (``workers/engine/scheduler.py``).
            Choice i samples with seed ``seed + i`` when ``seed`` is set, so
            it equals a single request with that seed.
        best_of: Choices to generate, of which the ``n`` with the highest
            cumulative logprob are returned (OpenAI's ``best_of``; >= n;
            the engine generates them all, the caller selects).
        logit_bias: Token id -> bias added to its logit, in [-100, 100]
            (OpenAI: -100 bans the token, 100 forces it); a dict or pairs.
        allowed_token_ids: Only these tokens may be sampled (vLLM).
        bad_words: Words never generated (vLLM): their last token is banned
            where the output ends with the rest of the word; the engine
            tokenizes them into ``bad_words_token_ids``.
        bad_words_token_ids: Token sequences never generated, as above.
        min_tokens: Tokens generated before EOS, stop token ids or stop
            strings may end the output (vLLM).
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
    n: int = 1
    best_of: Optional[int] = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: Optional[tuple[int, ...]] = None
    bad_words: tuple[str, ...] = ()
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    min_tokens: int = 0

    def __post_init__(self) -> None:
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        try:
            object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in bias)))
        except (TypeError, ValueError):
            raise ValueError("logit_bias must map token ids (integers) to numbers in [-100, 100], "
                             f"got {self.logit_bias!r}") from None
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        if isinstance(self.bad_words, str):
            object.__setattr__(self, "bad_words", (self.bad_words,))
        else:
            object.__setattr__(self, "bad_words", tuple(self.bad_words))
        object.__setattr__(self, "bad_words_token_ids", tuple(tuple(w) for w in self.bad_words_token_ids))
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
        self._validate_choices_and_processors()

    def _validate_choices_and_processors(self) -> None:
        if not isinstance(self.n, int) or not 1 <= self.n <= MAX_CHOICES:
            raise ValueError(f"n must be an integer in [1, {MAX_CHOICES}], got {self.n!r}")
        if self.best_of is not None:
            if not isinstance(self.best_of, int) or not self.n <= self.best_of <= MAX_CHOICES:
                raise ValueError(f"best_of must be an integer in [n, {MAX_CHOICES}] (n = {self.n}), "
                                 f"got {self.best_of!r}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}")
        for token_id, bias in self.logit_bias:
            if token_id < 0:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token_id}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias!r} for token {token_id}")
        if len({t for t, _ in self.logit_bias}) != len(self.logit_bias):
            raise ValueError("logit_bias names a token id twice")
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not ids or len(ids) > MAX_ALLOWED_TOKEN_IDS:
                raise ValueError(f"allowed_token_ids must hold 1 to {MAX_ALLOWED_TOKEN_IDS} token ids, got {len(ids)}")
            if any(not isinstance(t, int) or t < 0 for t in ids):
                raise ValueError("allowed_token_ids must be token ids (integers >= 0)")
        if len(self.bad_words) > MAX_BAD_WORDS or len(self.bad_words_token_ids) > 4 * MAX_BAD_WORDS:
            raise ValueError(f"at most {MAX_BAD_WORDS} bad_words are allowed, got {len(self.bad_words)}")
        if any(not isinstance(w, str) or not w for w in self.bad_words):
            raise ValueError("bad_words must be non-empty strings")
        if any(not w or any(not isinstance(t, int) or t < 0 for t in w) for w in self.bad_words_token_ids):
            raise ValueError("bad_words_token_ids must be non-empty lists of token ids")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens = {self.max_tokens}], "
                             f"got {self.min_tokens!r}")

    @property
    def num_choices(self) -> int:
        """Sequences the engine generates: ``best_of`` when set, else ``n``."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def has_logit_processors(self) -> bool:
        """Whether sampling edits this row's logits: bias, allowed ids, bad words or min_tokens."""
        return bool(self.logit_bias or self.allowed_token_ids is not None or self.bad_words_token_ids
                    or self.min_tokens)

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


@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter for a request, as vLLM names it: ``LoRARequest(name, id, path)``.

    ``lora_path`` is a PEFT folder (``adapter_config.json`` +
    ``adapter_model.safetensors``). The engine tells adapters apart by
    ``(lora_name, lora_path)`` and keys their prefix cache by the content of
    the weights, so ``lora_int_id`` is kept only for vLLM's signature.
    """

    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("LoRARequest needs a lora_name (a non-empty string)")
        if not isinstance(self.lora_path, str):
            raise ValueError(f"LoRARequest lora_path must be a string, got {type(self.lora_path).__name__}")


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
    lora_request: Optional[LoRARequest] = None  # None: the base model
    # Replicas a migrated stream left because they went silent (``router/migration.py``): the request
    # router sends it elsewhere while another replica is live.
    avoid_replica_ids: tuple[str, ...] = ()
    # The request router's fetch hints (issue 33, docs/KV_TRANSFER.md): replica id -> the replica
    # holding the prefix that it should fetch the KV from before it prefills; set per decision.
    kv_fetch_from: dict[str, str] = field(default_factory=dict)
    # Disaggregated prefill (docs/DISAGGREGATION.md): the hinted replica is a prefill replica; ask it to prefill first.
    kv_prefill_first: bool = False


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
    # With SamplingParams.prompt_logprobs, on the request's first chunk: one per prompt token
    # (None for the first).
    prompt_logprobs: Optional[list[Optional[TokenLogprob]]] = None
    # Parallel sampling (n / best_of): the choice of this chunk, and whether other choices are
    # still streaming (finish_reason then ends this choice only; completion_tokens is its own).
    index: int = 0
    more_choices: bool = False

    @property
    def finished(self) -> bool:
        """The whole request ended (every choice)."""
        return self.finish_reason is not None and not self.more_choices


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
    lora_adapters: tuple[tuple[str, str], ...] = ()  # loaded LoRA adapters: (name, content hash)
    max_cpu_loras: int = 0  # LoRA adapters it keeps loaded at most (0: no LoRA); the router prices evictions
    lora_load_tokens: float = 0.0  # a LoRA load's wait in prefill tokens, measured (0: not yet; lora/load_cost.py)
