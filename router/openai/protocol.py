"""OpenAI request parsing and response bodies for ``router.openai`` (no I/O).

Requests are JSON objects as the OpenAI API (and vLLM's extras) define them.
Validation errors are :class:`APIError` whose message names the field as the
client spells it and says what to change; ``router.openai`` turns them into
``{"error": {"message", "type", "param", "code"}}`` bodies.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Optional

from starlette.responses import JSONResponse

from cluster.shared.types import GenerationRequest, SamplingParams, StreamChunk, TokenLogprob
from router.backend import ModelInfo
from router.errors import NoReplicaError, OverloadedError
from router.limits import LimitError, Limits
from router.structured_request import StructuredRequestError, structured_outputs_from_body
from router.tokenizer import RouterTokenizer
from router.tools import (ToolError, ToolPlan, apply_tool_constraint, message_tool_fields, parse_tool_plan,
                          resolve_parser)

MAX_CACHE_SALT_CHARS = 256
_FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
_INTS = ("seed", "top_k")
# Integer ranges of the gRPC contract (int64 seed, int32 top_k and priority), enforced on HTTP too.
_INT_RANGES = {"seed": (-2**63, 2**64 - 1), "top_k": (-2**31, 2**31 - 1), "priority": (-2**31, 2**31 - 1)}


class APIError(Exception):
    """An error returned to the client as an OpenAI error body.

    Args:
        status: HTTP status code.
        message: What went wrong and what to change.
        param: The request field at fault, if any.
        type_: OpenAI error type.
        code: Machine-readable code, if any.
        headers: Extra response headers (``Retry-After`` of a 429).
    """

    def __init__(
        self,
        status: int,
        message: str,
        param: Optional[str] = None,
        type_: str = "invalid_request_error",
        code: Optional[str] = None,
        headers: Optional[dict[str, str]] = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        """The JSON error body."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: Optional[str] = None) -> APIError:
    """A 400 ``invalid_request_error``."""
    return APIError(400, message, param)


def param_of(message: str) -> Optional[str]:
    """The field a ``SamplingParams``/tokenizer message starts with (``top_p must ...`` → ``top_p``)."""
    head = message.split(" ", 1)[0].split("[", 1)[0]
    return head if head.replace("_", "").replace(".", "").isalnum() else None


@dataclass
class ParsedRequest:
    """A validated OpenAI request, ready for ``Backend.stream``.

    A completions request may send several prompts: ``requests`` holds one
    engine request per prompt, in order (``request`` is the first). Each
    generates ``request.sampling_params.num_choices`` choices (``best_of``
    when set, else ``n``); the response returns ``n`` per prompt, choice
    ``j`` of prompt ``p`` at ``index`` ``p * n + j`` (OpenAI's numbering).
    """

    request: GenerationRequest
    stream: bool
    include_usage: bool
    chat: bool
    echo_model: str
    tools: Optional[ToolPlan] = None  # tools offered: the output is parsed for calls (router/tools)
    requests: list[GenerationRequest] = field(default_factory=list)
    n: int = 1  # choices returned per prompt
    echo: bool = False  # completions: the prompt's text (and logprobs) before each choice's
    logprobs: Optional[int] = None  # what the client asked (best_of computes them anyway, to rank)
    prompt_logprobs: Optional[int] = None  # vLLM's extra: each choice carries the prompt's
    prompt_texts: list[Optional[str]] = field(default_factory=list)  # each prompt as sent (None: token ids)

    def __post_init__(self) -> None:
        if not self.requests:
            self.requests = [self.request]
            self.logprobs = self.request.sampling_params.logprobs

    @property
    def num_generated(self) -> int:
        """Choices generated per prompt (``best_of`` or ``n``)."""
        return self.request.sampling_params.num_choices


def _number(body: dict, name: str, integer: bool) -> Any:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        kind = "an integer" if integer else "a number"
        raise bad_request(f"{name} must be {kind}, got {value!r}", name)
    if integer and not isinstance(value, int):
        if not float(value).is_integer():
            raise bad_request(f"{name} must be an integer, got {value!r}", name)
        value = int(value)
    if not integer:
        value = float(value)
        if not math.isfinite(value):
            raise bad_request(f"{name} must be a finite number, got {value!r}", name)
    elif name in _INT_RANGES and not _INT_RANGES[name][0] <= value <= _INT_RANGES[name][1]:
        low, high = _INT_RANGES[name]
        raise bad_request(f"{name} must be in [{low}, {high}], got {value!r}", name)
    return value


def _check_model(body: dict, model: ModelInfo) -> str:
    name = body.get("model")
    if name is None:
        return model.name
    if not isinstance(name, str):
        raise bad_request(f"model must be a string, got {name!r}", "model")
    if name != model.name:
        raise APIError(
            404, f"the model {name!r} does not exist: this server serves {model.name!r}", "model",
            code="model_not_found",
        )
    return name


def _check_unsupported(body: dict, chat: bool) -> None:
    if body.get("suffix"):
        raise bad_request("suffix is not supported (no fill-in-the-middle): leave it unset", "suffix")
    if chat and body.get("best_of") is not None:
        raise bad_request("best_of is only supported on /v1/completions: use n here", "best_of")
    if chat and body.get("echo"):
        raise bad_request("echo is only supported on /v1/completions: leave it unset here", "echo")
    # tools / tool_choice / functions: _tool_plan (router/tools) on chat, refused on completions


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(p, int) and not isinstance(p, bool) for p in value)


def _prompts(body: dict, limits: Limits) -> list[Any]:
    """The prompts of a completions body: a string, token ids, or a list of either."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not _is_ids(prompt):
        limits.check_n(len(prompt), "prompt")
        return prompt
    return [prompt]


def _prompt_ids(prompt: Any, tokenizer: RouterTokenizer, name: str = "prompt") -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request(f"{name} is empty: send at least one character", "prompt")
        return tokenizer.encode(prompt)
    if _is_ids(prompt):
        if not prompt:
            raise bad_request(f"{name} is empty: send at least one token id", "prompt")
        try:
            tokenizer.check_token_ids(prompt, name)
        except ValueError as exc:
            raise bad_request(str(exc), "prompt") from None
        return list(prompt)
    if prompt is None:
        raise bad_request("prompt is required: send a string or a list of token ids", "prompt")
    raise bad_request(f"{name} must be a string or a list of token ids, got {type(prompt).__name__}", "prompt")


def _message_content(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(
                    f"messages[{i}].content[{j}] must be a text part {{'type': 'text', 'text': ...}}: "
                    "only text content is supported", "messages",
                )
            parts.append(part["text"])
        return "".join(parts)
    raise bad_request(f"messages[{i}].content must be a string or a list of text parts", "messages")


def _tool_plan(body: dict, chat: bool, tokenizer: RouterTokenizer) -> Optional[ToolPlan]:
    """The request's tool plan (None without tools); tools on completions are refused."""
    if not chat:
        for name in ("tools", "tool_choice", "functions", "function_call"):
            if body.get(name) is not None:
                raise bad_request(f"{name} is only supported on /v1/chat/completions: leave it unset here", name)
        return None
    template = tokenizer.chat_template
    try:
        parser = resolve_parser(getattr(tokenizer, "tool_call_parser", "auto"), template.source if template else None)
        return parse_tool_plan(body, parser)
    except ToolError as exc:
        raise bad_request(str(exc), exc.param) from None


def _chat_message(msg: Any, i: int) -> dict[str, Any]:
    """One message as the chat template takes it (tool calls and tool results kept)."""
    if not isinstance(msg, dict):
        raise bad_request(f"messages[{i}] must be an object with role and content", "messages")
    try:
        tool_fields = message_tool_fields(msg, f"messages[{i}]")
    except ToolError as exc:
        raise bad_request(str(exc), exc.param) from None
    return {"role": msg.get("role"), "content": _message_content(msg.get("content"), i), **tool_fields}


def _chat_ids(body: dict, tokenizer: RouterTokenizer, limits: Limits, tools: Optional[ToolPlan] = None) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list of {'role', 'content'} objects", "messages")
    limits.check_messages(len(messages), "messages")
    plain = [_chat_message(msg, i) for i, msg in enumerate(messages)]
    try:
        ids = tokenizer.render_chat(plain, tools=tools.prompt_tools() if tools else None)
    except ValueError as exc:
        raise bad_request(str(exc), "messages") from None
    if not ids:
        raise bad_request("messages rendered to an empty prompt: send at least one non-empty message", "messages")
    return ids


def _sampling_params(body: dict, chat: bool, prompt_len: int, model: ModelInfo, limits: Limits,
                     vocab_size: Optional[int] = None) -> SamplingParams:
    kwargs: dict[str, Any] = {}
    for name in _FLOATS:
        value = _number(body, name, integer=False)
        if value is not None:
            kwargs[name] = value
    for name in _INTS:
        value = _number(body, name, integer=True)
        if value is not None:
            kwargs[name] = value
    limits.check_prompt(prompt_len, model.max_model_len, "messages" if chat else "prompt")
    max_name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = limits.resolve_max_tokens(_number(body, max_name, integer=True), prompt_len, model.max_model_len,
                                           max_name, default=None if chat else 16)
    kwargs["max_tokens"] = max_tokens
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise bad_request("stop must be a string or a list of strings", "stop")
        limits.check_stop(stop, "stop")
        kwargs["stop"] = tuple(stop)
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
            raise bad_request("stop_token_ids must be a list of integer token ids", "stop_token_ids")
        limits.check_stop_token_ids(stop_ids, "stop_token_ids")
        if any(not 0 <= t < 2**32 for t in stop_ids):
            raise bad_request("stop_token_ids must be token ids in [0, 2**32)", "stop_token_ids")
        kwargs["stop_token_ids"] = tuple(stop_ids)
    ignore_eos = body.get("ignore_eos")
    if ignore_eos is not None:
        if not isinstance(ignore_eos, bool):
            raise bad_request("ignore_eos must be true or false", "ignore_eos")
        kwargs["ignore_eos"] = ignore_eos
    kwargs["logprobs"] = _logprobs(body, chat, limits)
    kwargs.update(_choice_fields(body, chat, limits))
    kwargs.update(_processor_fields(body, vocab_size))
    prompt_lp = _number(body, "prompt_logprobs", integer=True)
    limits.check_logprobs(prompt_lp, "prompt_logprobs")
    if prompt_lp is not None:
        kwargs["prompt_logprobs"] = prompt_lp
    try:  # response_format, structured_outputs, guided_*: enforced in the engine, never ignored
        kwargs["structured_outputs"] = structured_outputs_from_body(body)
    except StructuredRequestError as exc:
        raise bad_request(str(exc), exc.param) from None
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        raise bad_request(str(exc), param_of(str(exc))) from None


def _choice_fields(body: dict, chat: bool, limits: Limits) -> dict[str, Any]:
    """``n`` and ``best_of`` (completions only), within ``max_n``; best_of >= n, not streamed."""
    out: dict[str, Any] = {}
    n = _number(body, "n", integer=True)
    if n is not None:
        if n < 1:
            raise bad_request(f"n must be >= 1, got {n}", "n")
        limits.check_n(n, "n")
        out["n"] = n
    best_of = None if chat else _number(body, "best_of", integer=True)
    if best_of is not None:
        if best_of < (n or 1):
            raise bad_request(f"best_of = {best_of} must be >= n = {n or 1}: raise best_of or lower n", "best_of")
        limits.check_n(best_of, "best_of")
        if best_of > (n or 1) and body.get("stream"):
            raise bad_request("best_of cannot be streamed (the best choices are known only at the end): "
                              "set stream to false or leave best_of unset", "best_of")
        out["best_of"] = best_of
    return out


def _token_id_list(body: dict, name: str, vocab_size: Optional[int]) -> Optional[tuple[int, ...]]:
    value = body.get(name)
    if value is None:
        return None
    if not _is_ids(value) or not value:
        raise bad_request(f"{name} must be a non-empty list of integer token ids", name)
    bad = [t for t in value if t < 0 or (vocab_size is not None and t >= vocab_size)]
    if bad:
        raise bad_request(f"{name} holds {bad[0]}, not a token id: ids must be in [0, {vocab_size})", name)
    return tuple(value)


def _processor_fields(body: dict, vocab_size: Optional[int]) -> dict[str, Any]:
    """``logit_bias`` (OpenAI: token id -> [-100, 100]) and vLLM's ``allowed_token_ids``,
    ``bad_words`` and ``min_tokens``."""
    out: dict[str, Any] = {}
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise bad_request('logit_bias must be an object mapping token ids to biases, like {"50256": -100}',
                              "logit_bias")
        pairs = []
        for key, value in bias.items():
            text = str(key).strip()
            if not (text.isdigit() and (vocab_size is None or int(text) < vocab_size)):
                limit = f"[0, {vocab_size})" if vocab_size is not None else "integers >= 0"
                raise bad_request(f"logit_bias key {key!r} is not a token id: keys must be token ids in {limit}",
                                  "logit_bias")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
                raise bad_request(f"logit_bias[{key!r}] = {value!r} is out of range: biases must be numbers "
                                  "in [-100, 100]", "logit_bias")
            pairs.append((int(text), float(value)))
        out["logit_bias"] = tuple(pairs)
    allowed = _token_id_list(body, "allowed_token_ids", vocab_size)
    if allowed is not None:
        out["allowed_token_ids"] = allowed
    words = body.get("bad_words")
    if words is not None:
        if isinstance(words, str):
            words = [words]
        if not isinstance(words, list) or not all(isinstance(w, str) and w for w in words):
            raise bad_request("bad_words must be a list of non-empty strings", "bad_words")
        out["bad_words"] = tuple(words)
    min_tokens = _number(body, "min_tokens", integer=True)
    if min_tokens is not None:
        out["min_tokens"] = min_tokens
    return out


def _logprobs(body: dict, chat: bool, limits: Limits) -> Optional[int]:
    if not chat:
        num = _number(body, "logprobs", integer=True)
        limits.check_logprobs(num, "logprobs")
        return num
    wanted = body.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise bad_request("logprobs must be true or false for chat completions", "logprobs")
    top = _number(body, "top_logprobs", integer=True)
    limits.check_logprobs(top, "top_logprobs")
    if top is not None and top < 0:
        raise bad_request(f"top_logprobs must be in [0, {limits.max_logprobs}], got {top}", "top_logprobs")
    if top is not None and not wanted:
        raise bad_request("top_logprobs needs logprobs: set logprobs to true", "top_logprobs")
    return (top or 0) if wanted else None


def tokenize_chat(body: dict, tokenizer: RouterTokenizer, limits: Limits) -> list[int]:
    """The token ids of a ``/tokenize`` body's chat ``messages`` (and ``tools``), as a
    chat request renders them."""
    try:
        tools = _tool_plan(body, True, tokenizer)
        return _chat_ids(body, tokenizer, limits, tools)
    except LimitError as exc:
        raise bad_request(str(exc), exc.param) from None


def parse_request(
    body: Any, chat: bool, tokenizer: RouterTokenizer, model: ModelInfo, limits: Optional[Limits] = None,
) -> ParsedRequest:
    """Validates an OpenAI completions / chat completions body.

    Args:
        body: The decoded JSON body.
        chat: True for ``/v1/chat/completions``.
        tokenizer: The model's router tokenizer.
        model: The served model.
        limits: The server's input limits (default ``Limits()``).

    Raises:
        APIError: 400 for invalid input (naming the field and, for a limit,
            the value allowed), 404 for an unknown model.
    """
    try:
        return _parse_request(body, chat, tokenizer, model, limits or Limits())
    except LimitError as exc:
        raise bad_request(str(exc), exc.param) from None


def _parse_request(
    body: Any, chat: bool, tokenizer: RouterTokenizer, model: ModelInfo, limits: Limits,
) -> ParsedRequest:
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    name = _check_model(body, model)
    _check_unsupported(body, chat)
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise bad_request("stream must be true or false", "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad_request("stream_options must be an object like {'include_usage': true}", "stream_options")
    include_usage = bool((options or {}).get("include_usage"))
    echo = body.get("echo") or False
    if not isinstance(echo, bool):
        raise bad_request("echo must be true or false", "echo")
    tools = _tool_plan(body, chat, tokenizer)
    texts: list[Optional[str]] = [None]
    if chat:
        prompts = [_chat_ids(body, tokenizer, limits, tools)]
    else:
        raw = _prompts(body, limits)
        texts = [p if isinstance(p, str) else None for p in raw]
        prompts = [_prompt_ids(p, tokenizer, f"prompt[{i}]" if len(raw) > 1 else "prompt") for i, p in enumerate(raw)]
    vocab = getattr(tokenizer, "vocab_size", None)
    salt = body.get("cache_salt") or ""
    if not isinstance(salt, str) or len(salt) > MAX_CACHE_SALT_CHARS:
        raise bad_request(f"cache_salt must be a string of at most {MAX_CACHE_SALT_CHARS} characters", "cache_salt")
    priority = _number(body, "priority", integer=True) or 0
    requests = []
    asked_logprobs = None
    for prompt_ids in prompts:
        params = _sampling_params(body, chat, len(prompt_ids), model, limits, vocab)
        try:
            params = apply_tool_constraint(params, tools)
        except ToolError as exc:
            raise bad_request(str(exc), exc.param) from None
        asked_logprobs = params.logprobs
        requests.append(GenerationRequest(
            request_id=uuid.uuid4().hex, prompt_token_ids=prompt_ids, sampling_params=_engine_params(params, echo),
            priority=priority, cache_salt=salt, arrival_time=time.time(),
        ))
    first = requests[0].sampling_params
    return ParsedRequest(requests[0], stream, include_usage, chat, name, tools, requests=requests, n=first.n,
                         echo=echo, logprobs=asked_logprobs,
                         prompt_logprobs=_number(body, "prompt_logprobs", integer=True), prompt_texts=texts)


def _engine_params(params: SamplingParams, echo: bool) -> SamplingParams:
    """What the replica runs for the client's ``params``: best_of ranks choices on their
    logprobs (computed even when not asked), echo with logprobs needs the prompt's."""
    if params.best_of is not None and params.best_of > params.n and params.logprobs is None:
        params = replace(params, logprobs=0)
    if echo and params.logprobs is not None:
        params = replace(params, prompt_logprobs=max(params.logprobs, params.prompt_logprobs or 0))
    return params


def usage_body(last: Optional[StreamChunk]) -> dict[str, Any]:
    """``usage`` from the final chunk's counters."""
    prompt = last.prompt_tokens if last else 0
    completion = last.completion_tokens if last else 0
    return usage_totals(prompt, completion, last.cached_prompt_tokens if last else 0)


def usage_totals(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    """``usage`` of a request: each prompt counted once, the completion tokens of every choice."""
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def finish_reason(chunk: StreamChunk) -> Optional[str]:
    """The finish reason as OpenAI spells it (``stop`` / ``length``; ``abort`` as vLLM does), None until the end."""
    return chunk.finish_reason.value if chunk.finish_reason is not None else None


def completion_logprobs(entries: list[TokenLogprob], tokenizer: RouterTokenizer, offset: int) -> dict[str, Any]:
    """Legacy completions ``logprobs`` object for ``entries`` (text offsets start at ``offset``)."""
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for entry in entries:
        token = tokenizer.decode([entry.token_id], skip_special_tokens=False)
        out["tokens"].append(token)
        out["token_logprobs"].append(entry.logprob)
        out["top_logprobs"].append(
            {tokenizer.decode([t], skip_special_tokens=False): lp for t, lp in entry.top_logprobs}
        )
        out["text_offset"].append(offset)
        offset += len(token)
    return out


def echo_logprobs(prompt_ids: list[int], entries: list[Optional[TokenLogprob]], top: int,
                  tokenizer: RouterTokenizer) -> dict[str, Any]:
    """Legacy completions ``logprobs`` of an echoed prompt: every prompt token, its
    logprob and ``top`` alternatives (``None`` for the first: nothing predicts it)."""
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = 0
    for i, token_id in enumerate(prompt_ids):
        token = tokenizer.decode([token_id], skip_special_tokens=False)
        entry = entries[i] if i < len(entries) else None
        out["tokens"].append(token)
        out["token_logprobs"].append(entry.logprob if entry is not None else None)
        out["top_logprobs"].append({tokenizer.decode([t], skip_special_tokens=False): lp
                                    for t, lp in entry.top_logprobs[:top]} if entry is not None else None)
        out["text_offset"].append(offset)
        offset += len(token)
    return out


def merge_completion_logprobs(first: Optional[dict[str, Any]], later: Optional[dict[str, Any]],
                              shift: int) -> Optional[dict[str, Any]]:
    """Two legacy ``logprobs`` objects end to end (``later``'s offsets moved by ``shift``)."""
    if first is None or later is None:
        return later if first is None else first
    return {"tokens": first["tokens"] + later["tokens"],
            "token_logprobs": first["token_logprobs"] + later["token_logprobs"],
            "top_logprobs": first["top_logprobs"] + later["top_logprobs"],
            "text_offset": first["text_offset"] + [o + shift for o in later["text_offset"]]}


def prompt_logprobs_body(entries: Optional[list[Optional[TokenLogprob]]], top: int,
                         tokenizer: RouterTokenizer) -> Optional[list[Optional[dict[str, Any]]]]:
    """vLLM's ``prompt_logprobs``: per prompt token ``None`` (the first) or
    ``{token_id: {"logprob", "rank", "decoded_token"}}`` for the token and its ``top`` best
    (rank 1 is the likeliest; None for the prompt's token outside the top)."""
    if entries is None:
        return None
    out: list[Optional[dict[str, Any]]] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        ranks = {t: r + 1 for r, (t, _) in enumerate(entry.top_logprobs)}
        items = {entry.token_id: entry.logprob, **{t: lp for t, lp in entry.top_logprobs[:top]}}
        out.append({str(t): {"logprob": lp, "rank": ranks.get(t),
                             "decoded_token": tokenizer.decode([t], skip_special_tokens=False)}
                    for t, lp in items.items()})
    return out


def chat_logprobs(entries: list[TokenLogprob], tokenizer: RouterTokenizer) -> dict[str, Any]:
    """Chat ``logprobs`` object (``{"content": [...]}``) for ``entries``."""

    def item(token_id: int, logprob: float) -> dict[str, Any]:
        token = tokenizer.decode([token_id], skip_special_tokens=False)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {
        "content": [
            {**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top_logprobs]}
            for e in entries
        ]
    }


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def internal_error(request_id: str) -> APIError:
    """The 500 of an unexpected error: names the request id the cause was logged
    under, never the exception's text (which may hold internal detail)."""
    return APIError(500, f"internal error serving request {request_id}: the router logged the cause under this id",
                    type_="internal_error")


def backend_error(exc: BaseException) -> Optional[APIError]:
    """The API error of an exception ``Backend.stream`` raised, or None if unexpected."""
    if isinstance(exc, ValueError):
        return bad_request(str(exc), param_of(str(exc)))
    if isinstance(exc, OverloadedError):
        retry_after = str(max(1, math.ceil(exc.retry_after_s)))  # whole seconds, as HTTP has it
        return APIError(429, str(exc), type_="rate_limit_error", code="overloaded",
                        headers={"Retry-After": retry_after})
    if isinstance(exc, NoReplicaError):
        return APIError(503, str(exc), type_="service_unavailable", code="no_replica")
    return None
