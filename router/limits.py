"""Input limits and the router's admission bound, in one place for both front ends.

The gRPC (``router.convert``) and HTTP (``router.openai.protocol``) front
ends call the same checks, naming the field as their clients spell it
(``sampling.stop`` over gRPC, ``stop`` over HTTP). A violation raises
:class:`LimitError` (a ``ValueError``): ``INVALID_ARGUMENT`` over gRPC, HTTP
400 with an OpenAI error body. Its message names the field, the value sent,
the limit (as the flag spells it) and the value allowed.

Defaults follow vLLM and the OpenAI API where they have one:

    limit                   default         like
    max_prompt_tokens       max_model_len-1 vLLM (one position left to generate)
    max_output_tokens       max_model_len - prompt   vLLM (prompt + max_tokens <= max_model_len)
    max_request_bytes       4 MiB           gRPC's default max_receive_message_length;
                                            HTTP bodies over it get 413
    max_messages            1024            chat messages per request
    max_stop_strings        16              OpenAI allows 4, vLLM any number
    max_stop_string_chars   256             characters per stop string
    max_stop_token_ids      64
    max_logprobs            20              vLLM's max_logprobs, OpenAI's top_logprobs
    max_n                   16              choices per request (n, best_of) and prompts per
                                            completions request, each
    max_inflight_requests   1024            per router, over both front ends (TGI's
                                            max_concurrent_requests); over it the
                                            router answers RESOURCE_EXHAUSTED / 429

``n`` / ``best_of`` above ``max_n`` are refused (and above a replica's
``max_num_seqs``, by the replica: every choice is a sequence). The replica checks again
what it cannot trust (``LLMEngine.validate``), so a bad request never reaches
the scheduler.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from cluster.shared.types import MAX_CHOICES, MAX_LOGPROBS, MAX_STOP_STRINGS

DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20
OFFLOAD_BYTES = 64 * 1024  # requests at least this large are parsed and tokenized off the event loop


class LimitError(ValueError):
    """A request exceeds a limit.

    Args:
        message: Names the field, the limit and the value allowed.
        param: The request field at fault, as the client spells it.
    """

    def __init__(self, message: str, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Limits:
    """What one request may ask for, and how many requests a router takes at once.

    Attributes:
        max_prompt_tokens: Most prompt tokens; None (or anything larger)
            means ``max_model_len - 1``.
        max_output_tokens: Cap on ``max_tokens``; None leaves only
            ``prompt + max_tokens <= max_model_len``.
        max_request_bytes: Largest gRPC message / HTTP body, in bytes.
        max_messages: Most chat messages in one request.
        max_stop_strings: Most stop strings.
        max_stop_string_chars: Longest stop string, in characters.
        max_stop_token_ids: Most stop token ids.
        max_logprobs: Most top log-probabilities per token (at most 20).
        max_n: Most choices per request (``n``, ``best_of``), and most
            prompts in one completions request.
        max_inflight_requests: Most requests one router streams at once;
            None is unbounded.
    """

    max_prompt_tokens: Optional[int] = None
    max_output_tokens: Optional[int] = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_messages: int = 1024
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_stop_token_ids: int = 64
    max_logprobs: int = 20
    max_n: int = 16
    max_inflight_requests: Optional[int] = 1024

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None and f.name in ("max_prompt_tokens", "max_output_tokens", "max_inflight_requests"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{f.name} must be an integer >= 1, got {value!r}")
        if self.max_stop_strings > MAX_STOP_STRINGS:
            raise ValueError(f"max_stop_strings must be at most {MAX_STOP_STRINGS}, got {self.max_stop_strings}")
        if self.max_logprobs > MAX_LOGPROBS:
            raise ValueError(f"max_logprobs must be at most {MAX_LOGPROBS}, got {self.max_logprobs}")
        if self.max_n > MAX_CHOICES:
            raise ValueError(f"max_n must be at most {MAX_CHOICES}, got {self.max_n}")
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be at least 1024, got {self.max_request_bytes}")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "Limits":
        """Builds limits from the flags set (``None`` values keep the defaults).

        Raises:
            ValueError: An unknown name or an invalid value.
        """
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown limits {unknown}: known limits are {sorted(known)}")
        return cls(**{k: v for k, v in kwargs.items() if v is not None})

    # ------------------------------------------------------------- checks
    def prompt_limit(self, max_model_len: int) -> int:
        """The most prompt tokens a request may have."""
        room = max_model_len - 1
        return room if self.max_prompt_tokens is None else min(room, self.max_prompt_tokens)

    def check_prompt(self, num_tokens: int, max_model_len: int, field: str) -> None:
        """Raises LimitError when a prompt of ``num_tokens`` is too long."""
        allowed = self.prompt_limit(max_model_len)
        if num_tokens <= allowed:
            return
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < max_model_len - 1:
            why = f"this server's max_prompt_tokens is {self.max_prompt_tokens}"
        else:
            why = f"max_model_len is {max_model_len}"  # one position is needed to generate
        raise LimitError(f"{field}: the prompt has {num_tokens} tokens but {why}: "
                         f"shorten it to at most {allowed} tokens", field)

    def resolve_max_tokens(self, requested: Optional[int], prompt_len: int, max_model_len: Optional[int],
                           field: str, default: Optional[int]) -> Optional[int]:
        """The ``max_tokens`` to run: the one requested if allowed, else a default.

        Args:
            requested: What the client asked for (None: unset).
            prompt_len: Prompt tokens.
            max_model_len: The model's context; None skips the context check.
            field: The client's name of the field.
            default: Used when unset (capped by what is allowed); None means
                as many as allowed.

        Returns:
            The value to run with, or ``default`` unchanged when no bound applies.

        Raises:
            LimitError: ``requested`` exceeds ``max_output_tokens`` or the context.
        """
        if requested is not None and requested < 1:
            return requested  # SamplingParams says "must be >= 1"
        room = None if max_model_len is None else max_model_len - prompt_len
        if requested is None:
            bounds = [b for b in (default, room, self.max_output_tokens) if b is not None]
            return min(bounds) if bounds else None
        if self.max_output_tokens is not None and requested > self.max_output_tokens:
            raise LimitError(f"{field} = {requested} exceeds this server's max_output_tokens of "
                             f"{self.max_output_tokens}: request at most {self.max_output_tokens}", field)
        if room is not None and requested > room:
            raise LimitError(
                f"{field} = {requested} is too large: the prompt has {prompt_len} tokens and max_model_len is "
                f"{max_model_len}, so request at most {room}", field,
            )
        return requested

    def check_stop(self, stop: Sequence[Any], field: str) -> None:
        """Raises LimitError for too many or too long stop strings."""
        if len(stop) > self.max_stop_strings:
            raise LimitError(f"{field} has {len(stop)} stop strings: this server's max_stop_strings is "
                             f"{self.max_stop_strings}, send at most that many", field)
        for i, s in enumerate(stop):
            if isinstance(s, str) and len(s) > self.max_stop_string_chars:
                raise LimitError(f"{field}[{i}] has {len(s)} characters: this server's max_stop_string_chars is "
                                 f"{self.max_stop_string_chars}, shorten it", field)

    def check_stop_token_ids(self, ids: Sequence[Any], field: str) -> None:
        """Raises LimitError for too many stop token ids."""
        if len(ids) > self.max_stop_token_ids:
            raise LimitError(f"{field} has {len(ids)} token ids: this server's max_stop_token_ids is "
                             f"{self.max_stop_token_ids}, send at most that many", field)

    def check_logprobs(self, num: Optional[int], field: str) -> None:
        """Raises LimitError when more top log-probabilities are asked than allowed."""
        if num is not None and num > self.max_logprobs:
            raise LimitError(f"{field} = {num} exceeds this server's max_logprobs of {self.max_logprobs}: "
                             f"ask for at most {self.max_logprobs}", field)

    def check_n(self, num: Optional[int], field: str) -> None:
        """Raises LimitError when more choices (or prompts) are asked than ``max_n``."""
        if num is not None and num > self.max_n:
            raise LimitError(f"{field} = {num} exceeds this server's max_n of {self.max_n}: ask for at most "
                             f"{self.max_n} (or raise --max-n)", field)

    def check_messages(self, num: int, field: str) -> None:
        """Raises LimitError for too many chat messages."""
        if num > self.max_messages:
            raise LimitError(f"{field} has {num} messages: this server's max_messages is {self.max_messages}, "
                             "send at most that many (drop or summarize older turns)", field)

    def request_too_large(self, num_bytes: int) -> str:
        """The message for a request body / message over ``max_request_bytes``."""
        return (f"the request has {num_bytes} bytes but this server's max_request_bytes is "
                f"{self.max_request_bytes}: send a smaller request")
