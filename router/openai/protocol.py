"""OpenAI request parsing for ``router.openai`` (no I/O); the pieces of
response bodies are in ``bodies.py``, the choice and logit-edit fields in
``request_fields.py``.

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

from cluster.shared.choices import ranking_params
from cluster.shared.types import GenerationRequest, LoRARequest, SamplingParams
from router.backend import ModelInfo
from router.errors import NoReplicaError, OverloadedError
from router.limits import LimitError, Limits
from router.models import ModelNotFoundError
from router.openai.errors import APIError, bad_request, is_ids, number, param_of
from router.openai.request_fields import choice_fields, processor_fields, template_kwargs
from router.reasoning import ReasoningMode, constrain_after_reasoning
from router.structured_request import StructuredRequestError, structured_outputs_from_body
from router.tokenizer import RouterTokenizer
from router.tools import (ToolError, ToolPlan, apply_tool_constraint, message_tool_fields, parse_tool_plan,
                          resolve_parser)

MAX_CACHE_SALT_CHARS = 256
_FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
_INTS = ("seed", "top_k")



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
    reasoning: Optional[ReasoningMode] = None  # chat with a reasoning parser: the output is split (router/reasoning.py)

    def __post_init__(self) -> None:
        if not self.requests:
            self.requests = [self.request]
            self.logprobs = self.request.sampling_params.logprobs

    @property
    def num_generated(self) -> int:
        """Choices generated per prompt (``best_of`` or ``n``)."""
        return self.request.sampling_params.num_choices


def _check_model(body: dict, model: ModelInfo) -> tuple[str, Optional[LoRARequest]]:
    """The ``model`` the body names and the LoRA adapter it runs with (None: the model itself)."""
    name = body.get("model")
    if name is None or name == "":  # the default model, as ModelBackends.pick and gRPC take it
        return model.name, None
    if not isinstance(name, str):
        raise bad_request(f"model must be a string, got {name!r}", "model")
    lora = model.lora_request(name)
    if name != model.name and lora is None:
        raise APIError(
            404, f"the model {name!r} does not exist: this server serves {model.name!r}", "model",
            code="model_not_found",
        )
    return name, lora


def _check_unsupported(body: dict, chat: bool) -> None:
    if body.get("suffix"):
        raise bad_request("suffix is not supported (no fill-in-the-middle): leave it unset", "suffix")
    if chat and body.get("best_of") is not None:
        raise bad_request("best_of is only supported on /v1/completions: use n here", "best_of")
    if chat and body.get("echo"):
        raise bad_request("echo is only supported on /v1/completions: leave it unset here", "echo")
    # tools / tool_choice / functions: _tool_plan (router/tools) on chat, refused on completions


def _prompts(body: dict, limits: Limits) -> list[Any]:
    """The prompts of a completions body: a string, token ids, or a list of either."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not is_ids(prompt):
        limits.check_n(len(prompt), "prompt")
        return prompt
    return [prompt]


def _prompt_ids(prompt: Any, tokenizer: RouterTokenizer, name: str = "prompt") -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request(f"{name} is empty: send at least one character", "prompt")
        return tokenizer.encode(prompt)
    if is_ids(prompt):
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
    return _chat_prompt(body, tokenizer, limits, tools)[0]


def _chat_prompt(body: dict, tokenizer: RouterTokenizer, limits: Limits,
                 tools: Optional[ToolPlan] = None) -> tuple[list[int], str]:
    """The token ids of a chat body's prompt, and its rendered text."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list of {'role', 'content'} objects", "messages")
    limits.check_messages(len(messages), "messages")
    plain = [_chat_message(msg, i) for i, msg in enumerate(messages)]
    extra = template_kwargs(body, tokenizer.chat_template.source if tokenizer.chat_template else None)
    try:
        text = tokenizer.render_chat_text(plain, tools=tools.prompt_tools() if tools else None, template_kwargs=extra)
    except ValueError as exc:
        raise bad_request(str(exc), "chat_template_kwargs" if "chat_template_kwargs" in str(exc) else "messages") \
            from None
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise bad_request("messages rendered to an empty prompt: send at least one non-empty message", "messages")
    return ids, text


def _sampling_params(body: dict, chat: bool, prompt_lens: list[int], model: ModelInfo, limits: Limits,
                     vocab_size: Optional[int] = None) -> list[SamplingParams]:
    """The sampling parameters of each prompt (of ``prompt_lens`` tokens): the body's
    fields, parsed once, and each prompt's ``max_tokens``."""
    kwargs: dict[str, Any] = {}
    for name in _FLOATS:
        value = number(body, name, integer=False)
        if value is not None:
            kwargs[name] = value
    for name in _INTS:
        value = number(body, name, integer=True)
        if value is not None:
            kwargs[name] = value
    max_name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    requested = number(body, max_name, integer=True)
    max_tokens = []
    for prompt_len in prompt_lens:
        limits.check_prompt(prompt_len, model.max_model_len, "messages" if chat else "prompt")
        max_tokens.append(limits.resolve_max_tokens(requested, prompt_len, model.max_model_len, max_name,
                                                    default=None if chat else 16))
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
    kwargs.update(choice_fields(body, chat, limits))
    kwargs.update(processor_fields(body, vocab_size))
    prompt_lp = number(body, "prompt_logprobs", integer=True)
    limits.check_logprobs(prompt_lp, "prompt_logprobs")
    if prompt_lp is not None:
        kwargs["prompt_logprobs"] = prompt_lp
    try:  # response_format, structured_outputs, guided_*: enforced in the engine, never ignored
        kwargs["structured_outputs"] = structured_outputs_from_body(body)
    except StructuredRequestError as exc:
        raise bad_request(str(exc), exc.param) from None
    try:
        return [SamplingParams(**kwargs, max_tokens=m) for m in max_tokens]
    except ValueError as exc:
        raise bad_request(str(exc), param_of(str(exc))) from None


def _logprobs(body: dict, chat: bool, limits: Limits) -> Optional[int]:
    if not chat:
        num = number(body, "logprobs", integer=True)
        limits.check_logprobs(num, "logprobs")
        return num
    wanted = body.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise bad_request("logprobs must be true or false for chat completions", "logprobs")
    top = number(body, "top_logprobs", integer=True)
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
    name, lora = _check_model(body, model)
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
    reasoning = None
    if chat:
        chat_ids, chat_text = _chat_prompt(body, tokenizer, limits, tools)
        prompts = [chat_ids]
        reasoning = tokenizer.reasoning_mode(chat_text)
    else:
        raw = _prompts(body, limits)
        texts = [p if isinstance(p, str) else None for p in raw]
        prompts = [_prompt_ids(p, tokenizer, f"prompt[{i}]" if len(raw) > 1 else "prompt") for i, p in enumerate(raw)]
    vocab = getattr(tokenizer, "vocab_size", None)
    salt = body.get("cache_salt") or ""
    if not isinstance(salt, str) or len(salt) > MAX_CACHE_SALT_CHARS:
        raise bad_request(f"cache_salt must be a string of at most {MAX_CACHE_SALT_CHARS} characters", "cache_salt")
    priority = number(body, "priority", integer=True) or 0
    requests = []
    asked_logprobs = None
    for prompt_ids, params in zip(prompts, _sampling_params(body, chat, [len(p) for p in prompts], model, limits,
                                                            vocab)):
        try:
            params = constrain_after_reasoning(apply_tool_constraint(params, tools), reasoning)
        except ToolError as exc:
            raise bad_request(str(exc), exc.param) from None
        asked_logprobs = params.logprobs
        requests.append(GenerationRequest(
            request_id=uuid.uuid4().hex, prompt_token_ids=prompt_ids, sampling_params=_engine_params(params, echo),
            priority=priority, cache_salt=salt, arrival_time=time.time(), lora_request=lora,
        ))
    first = requests[0].sampling_params
    return ParsedRequest(requests[0], stream, include_usage, chat, name, tools, requests=requests, n=first.n,
                         echo=echo, logprobs=asked_logprobs,
                         prompt_logprobs=number(body, "prompt_logprobs", integer=True), prompt_texts=texts,
                         reasoning=reasoning)


def _engine_params(params: SamplingParams, echo: bool) -> SamplingParams:
    """What the replica runs for the client's ``params``: best_of ranks choices on their
    logprobs (computed even when not asked), echo with logprobs needs the prompt's."""
    params = ranking_params(params)
    if echo and params.logprobs is not None:
        params = replace(params, prompt_logprobs=max(params.logprobs, params.prompt_logprobs or 0))
    return params


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
    if isinstance(exc, ModelNotFoundError):  # e.g. a LoRA adapter the caller's API key may not use
        return APIError(404, str(exc), "model", code="model_not_found")
    return None
