"""Request validation, in one place: what a request must be to run on this
engine, with messages that say what to change.

``check_request`` checks the request itself (types, ids, token ids within the
vocabulary), everything again even when the router validated it: a request
that crossed a process boundary (unpickled, ``__post_init__`` not run) must
not reach the scheduler with bad values. ``fit_problem`` checks that the
prompt and its output can ever fit this engine (``max_model_len``, the step
budget without chunked prefill, the KV pool).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from cluster.shared.sizes import cdiv
from cluster.shared.types import GenerationRequest, SamplingParams


@dataclass(frozen=True)
class Capacity:
    """What bounds a request on one engine."""

    max_model_len: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    block_size: int
    num_device_blocks: int
    sliding_window: Optional[int] = None  # every layer's; a sequence then holds its window's blocks only


def check_request(request: GenerationRequest, vocab_size: int) -> None:
    """Raises ValueError saying what to change if the request is malformed."""
    if not isinstance(request, GenerationRequest):
        raise ValueError(f"expected a GenerationRequest, got {type(request).__name__}")
    if not isinstance(request.request_id, str) or not request.request_id:
        raise ValueError(f"request_id must be a non-empty string, got {request.request_id!r}")
    if not isinstance(request.priority, int) or not isinstance(request.cache_salt, str):
        raise ValueError("priority must be an integer and cache_salt a string")
    params = request.sampling_params
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
    try:
        params.validate()
    except TypeError as exc:
        raise ValueError(f"sampling_params has a value of the wrong type: {exc}") from None
    ids = request.prompt_token_ids
    if not isinstance(ids, (list, tuple)):
        raise ValueError(f"prompt_token_ids must be a list of token ids, got {type(ids).__name__}")
    bad = [t for t in ids if not isinstance(t, int) or t < 0 or t >= vocab_size]
    if bad:
        raise ValueError(f"prompt has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    resumed = request.num_resumed_output_tokens
    if not isinstance(resumed, int) or not 0 <= resumed < max(1, len(ids)):
        raise ValueError(f"num_resumed_output_tokens must be in [0, {len(ids)}) (the prompt's tail), got {resumed!r}")
    if params.structured_outputs is not None and params.ignore_eos:
        raise ValueError("ignore_eos cannot be combined with structured_outputs: the grammar ends the output "
                         "with the end-of-sequence token; unset ignore_eos")


def fit_problem(num_prompt_tokens: int, max_tokens: int, capacity: Capacity) -> Optional[str]:
    """Says what to change if a request can never run here, else None.

    The KV a request may need is that of its prompt and all but its last
    possible output token, capped by ``max_model_len``.
    """
    max_model_len = capacity.max_model_len
    if num_prompt_tokens < 1:
        return "prompt is empty: send at least one token (or non-empty text)"
    if num_prompt_tokens >= max_model_len:
        return (
            f"prompt has {num_prompt_tokens} tokens but max_model_len is {max_model_len}: "
            f"shorten the prompt to at most {max_model_len - 1} tokens (one is needed to generate)"
        )
    if not capacity.enable_chunked_prefill and num_prompt_tokens > capacity.max_num_batched_tokens:
        return (
            f"prompt has {num_prompt_tokens} tokens but max_num_batched_tokens is "
            f"{capacity.max_num_batched_tokens} and chunked prefill is off: shorten the prompt, "
            f"raise max_num_batched_tokens or set enable_chunked_prefill"
        )
    num_kv_tokens = min(num_prompt_tokens + max_tokens, max_model_len) - 1
    num_blocks = cdiv(num_kv_tokens, capacity.block_size)
    if capacity.sliding_window is not None:
        # Blocks outside the window are released after each step: the most held at
        # once is the prompt's (a prefill in one step) or a window's and two more.
        num_blocks = min(num_blocks, max(cdiv(num_prompt_tokens, capacity.block_size),
                                         cdiv(capacity.sliding_window, capacity.block_size) + 2))
    if num_blocks > capacity.num_device_blocks:
        return (
            f"prompt of {num_prompt_tokens} tokens with max_tokens {max_tokens} needs up to "
            f"{num_blocks} KV blocks of {capacity.block_size} tokens but the cache holds "
            f"{capacity.num_device_blocks}: lower max_tokens, shorten the prompt or raise "
            f"num_kv_blocks / kv_cache_memory"
        )
    return None
