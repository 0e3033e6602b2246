"""Conversions between the gRPC messages (``router.pb``) and ``cluster.shared.types``.

Validation errors are ``ValueError`` whose message names the field (as the
client spells it, e.g. ``sampling.top_p``) and says what to change; the
server maps them to ``INVALID_ARGUMENT``. A proto3 ``optional`` field that is
unset takes the Python default of ``cluster.shared.types.SamplingParams``.
Tool calling (``GenerateRequest.tools``, ``ChatMessage.tool_calls``,
``GenerateResponse.tool_calls``) converts in ``router/convert_tools.py``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import uuid
from dataclasses import fields
from typing import Optional

from cluster.shared.structured import StructuredOutputsParams
from cluster.shared.types import GenerationRequest, ReplicaStats, SamplingParams, StreamChunk, TokenLogprob
from router.limits import Limits
from router.convert_tools import chat_message, constrain, tool_plan_from_proto
from router.pb import generation_pb2 as pb
from router.reasoning import ReasoningMode, ReasoningParser, constrain_after_reasoning
from router.structured_request import check_json_schema
from router.tokenizer import RouterTokenizer
from router.tools import ToolPlan

MAX_REQUEST_ID_CHARS = 256
MAX_CACHE_SALT_CHARS = 256

# proto3 `optional` scalars: unset means "the Python default".
_OPTIONAL_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logprobs",
    "n",
    "min_tokens",
    "prompt_logprobs",
)
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
_REPEATED_FIELDS = ("stop", "stop_token_ids", "allowed_token_ids", "bad_words")
# Not on the wire: best_of (HTTP completions and the offline API: the router selects the best),
# bad_words_token_ids (the replica tokenizes bad_words into it).
_OFFLINE_ONLY = ("best_of", "bad_words_token_ids")
# Every other SamplingParams field must have a proto counterpart (a test checks it too).
assert {f.name for f in fields(SamplingParams)} == (set(_OPTIONAL_FIELDS) | set(_REPEATED_FIELDS) | {"ignore_eos"}
                                                    | {"structured_outputs", "logit_bias"} | set(_OFFLINE_ONLY))
_STRUCTURED = "sampling.structured_outputs"
_PROTO_KINDS = "json_schema, json_object, regex, choice, grammar or structural_tag"


def sampling_params_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """Builds validated ``SamplingParams`` from the proto (unset optional → default).

    Raises:
        ValueError: A value is out of range; the message starts with ``sampling.<field>``.
    """
    kwargs = {name: getattr(msg, name) for name in _OPTIONAL_FIELDS if msg.HasField(name)}
    for name in _FLOAT_FIELDS:
        if name in kwargs and not math.isfinite(kwargs[name]):
            raise ValueError(f"sampling.{name} must be a finite number, got {kwargs[name]!r}")
    kwargs["stop"] = tuple(msg.stop)
    kwargs["stop_token_ids"] = tuple(msg.stop_token_ids)
    kwargs["ignore_eos"] = msg.ignore_eos
    if msg.allowed_token_ids:
        kwargs["allowed_token_ids"] = tuple(msg.allowed_token_ids)
    kwargs["bad_words"] = tuple(msg.bad_words)
    for token_id, bias in msg.logit_bias.items():
        if not (math.isfinite(bias) and -100 <= bias <= 100):
            raise ValueError(f"sampling.logit_bias[{token_id}] = {bias!r} is out of range: biases must be in "
                             "[-100, 100]")
    kwargs["logit_bias"] = tuple(sorted(msg.logit_bias.items()))
    if msg.HasField("structured_outputs"):
        kwargs["structured_outputs"] = structured_outputs_from_proto(msg.structured_outputs)
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        raise ValueError(f"sampling.{exc}") from None


def structured_outputs_from_proto(msg: pb.StructuredOutputs) -> StructuredOutputsParams:
    """Builds the output constraint, its JSON schema checked as the HTTP API checks it.

    Raises:
        ValueError: No kind set, a bad value, an invalid schema or one the
            engine cannot enforce; the message names ``sampling.structured_outputs.<field>``.
    """
    kind = msg.WhichOneof("kind")
    if kind is None:
        raise ValueError(f"{_STRUCTURED} sets no constraint: set one of {_PROTO_KINDS}, or leave it unset")
    if kind == "json_object" and not msg.json_object:
        raise ValueError(f"{_STRUCTURED}.json_object must be true when set: set another kind, or leave it unset")
    kwargs: dict = {"disable_any_whitespace": msg.disable_any_whitespace}
    if msg.HasField("whitespace_limit"):
        kwargs["whitespace_limit"] = msg.whitespace_limit
    if kind == "json_schema":
        kwargs["json"] = msg.json_schema
    elif kind == "choice":
        kwargs["choice"] = tuple(msg.choice.items)
    else:
        kwargs[kind] = getattr(msg, kind)
    try:
        params = StructuredOutputsParams(**kwargs)
    except ValueError as exc:  # its messages name the Python field `json`; the proto's is json_schema
        raise ValueError("sampling." + re.sub(r"structured_outputs\.json\b", "structured_outputs.json_schema",
                                              str(exc))) from None
    if params.json is not None:
        check_json_schema(params.schema(), f"{_STRUCTURED}.json_schema")
    return params


def structured_outputs_to_proto(params: StructuredOutputsParams) -> pb.StructuredOutputs:
    """The proto of an output constraint (an unset whitespace limit stays unset)."""
    msg = pb.StructuredOutputs(disable_any_whitespace=params.disable_any_whitespace)
    if params.whitespace_limit is not None:
        msg.whitespace_limit = params.whitespace_limit
    kind = params.kind
    if kind == "json":
        msg.json_schema = params.json or ""
    elif kind == "choice":
        msg.choice.items.extend(params.choice or ())
    else:
        setattr(msg, kind, getattr(params, kind))
    return msg


def sampling_params_to_proto(params: SamplingParams) -> pb.SamplingParams:
    """The proto of ``params``; ``None`` (seed, logprobs) stays unset."""
    msg = pb.SamplingParams(
        stop=list(params.stop), stop_token_ids=list(params.stop_token_ids), ignore_eos=params.ignore_eos,
        allowed_token_ids=list(params.allowed_token_ids or ()), bad_words=list(params.bad_words),
        logit_bias=dict(params.logit_bias),
    )
    for name in _OPTIONAL_FIELDS:
        value = getattr(params, name)
        if value is not None:
            setattr(msg, name, value)
    if params.structured_outputs is not None:
        msg.structured_outputs.CopyFrom(structured_outputs_to_proto(params.structured_outputs))
    return msg


def prompt_ids_from_proto(msg: pb.GenerateRequest, tokenizer: RouterTokenizer,
                          tools: Optional[ToolPlan] = None) -> list[int]:
    """The prompt token ids of a request: tokenized text, rendered chat, or the ids as sent.

    Args:
        msg: The request.
        tokenizer: The model's router tokenizer.
        tools: The request's tool plan (``tool_plan_from_proto``): its tools
            are rendered with the messages.

    Raises:
        ValueError: No input, an empty one, out-of-range ids, or invalid
            messages (tool calls and results included).
    """
    kind = msg.WhichOneof("input")
    if kind is None:
        raise ValueError("the request has no input: set one of prompt, prompt_token_ids or messages")
    if kind != "messages" and msg.chat_template_kwargs_json:
        raise ValueError("chat_template_kwargs_json applies to messages only: leave it empty with " + kind)
    if kind == "prompt":
        if not msg.prompt:
            raise ValueError("prompt is empty: send at least one character")
        return tokenizer.encode(msg.prompt)
    if kind == "prompt_token_ids":
        ids = list(msg.prompt_token_ids.ids)
        if not ids:
            raise ValueError("prompt_token_ids.ids is empty: send at least one token id")
        tokenizer.check_token_ids(ids, "prompt_token_ids.ids")
        return ids
    messages = [chat_message(m, i) for i, m in enumerate(msg.messages.items)]
    try:
        ids = tokenizer.render_chat(messages, tools=tools.prompt_tools() if tools else None,
                                    template_kwargs=_template_kwargs(msg.chat_template_kwargs_json))
    except ValueError as exc:
        # ChatTemplate names fields as messages[i].role; the proto nests them in items.
        raise ValueError(str(exc).replace("messages[", "messages.items[")) from None
    if not ids:
        raise ValueError("messages rendered to an empty prompt: send at least one non-empty message")
    return ids


def _template_kwargs(text: str) -> Optional[dict]:
    """``chat_template_kwargs_json`` decoded (None when empty)."""
    if not text:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"chat_template_kwargs_json is not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError("chat_template_kwargs_json must be a JSON object, e.g. {\"enable_thinking\": false}")
    return value


def request_from_proto(
    msg: pb.GenerateRequest,
    tokenizer: RouterTokenizer,
    max_model_len: Optional[int] = None,
    limits: Optional[Limits] = None,
) -> GenerationRequest:
    """The engine request of ``msg`` (:func:`request_and_tools_from_proto`
    without the tool plan, which a server needs to parse the output)."""
    return request_and_tools_from_proto(msg, tokenizer, max_model_len, limits)[0]


def request_and_tools_from_proto(
    msg: pb.GenerateRequest,
    tokenizer: RouterTokenizer,
    max_model_len: Optional[int] = None,
    limits: Optional[Limits] = None,
) -> tuple[GenerationRequest, Optional[ToolPlan]]:
    """Validates a ``GenerateRequest`` and turns it into an engine request and
    its tool plan (``router/convert_tools.py``: tools rendered into the
    prompt, ``tool_choice`` required or named held by ``structured_outputs``).

    Args:
        msg: The request as received.
        tokenizer: The model's router tokenizer.
        max_model_len: When given, prompts must leave room for one output
            token (``len(prompt) < max_model_len``) and ``prompt +
            max_tokens <= max_model_len``; an unset ``max_tokens`` becomes
            ``min(16, room)``.
        limits: The server's input limits (default ``Limits()``).

    Returns:
        The request (``request_id`` a fresh uuid4 hex when ``msg`` has none)
        and the tool plan (None without tools).

    Raises:
        ValueError: Any invalid field, named in the message (``LimitError``
            for a limit, naming it and the value allowed; ``ToolError`` for
            a tool field).
    """
    limits = limits or Limits()
    if len(msg.request_id) > MAX_REQUEST_ID_CHARS:
        raise ValueError(f"request_id has {len(msg.request_id)} characters: use at most {MAX_REQUEST_ID_CHARS}")
    if len(msg.cache_salt) > MAX_CACHE_SALT_CHARS:
        raise ValueError(f"cache_salt has {len(msg.cache_salt)} characters: use at most {MAX_CACHE_SALT_CHARS}")
    sampling = msg.sampling
    limits.check_stop(sampling.stop, "sampling.stop")
    limits.check_stop_token_ids(sampling.stop_token_ids, "sampling.stop_token_ids")
    if sampling.HasField("logprobs"):
        limits.check_logprobs(sampling.logprobs, "sampling.logprobs")
    if sampling.HasField("prompt_logprobs"):
        limits.check_logprobs(sampling.prompt_logprobs, "sampling.prompt_logprobs")
    if sampling.HasField("n"):
        limits.check_n(sampling.n, "sampling.n")
    vocab = getattr(tokenizer, "vocab_size", None)
    if vocab is not None:
        for name in ("allowed_token_ids", "logit_bias"):
            ids = sorted(getattr(sampling, name))
            if ids and ids[-1] >= vocab:
                raise ValueError(f"sampling.{name} names token {ids[-1]}, outside the vocabulary [0, {vocab})")
    params = sampling_params_from_proto(sampling)
    tools = tool_plan_from_proto(msg, tokenizer)
    params = constrain(params, tools)
    kind = msg.WhichOneof("input")
    prompt_field = {"prompt_token_ids": "prompt_token_ids.ids", "messages": "messages.items"}.get(kind, "prompt")
    if kind == "messages":
        limits.check_messages(len(msg.messages.items), "messages.items")
    if kind == "prompt_token_ids" and max_model_len is not None:  # before checking every id
        limits.check_prompt(len(msg.prompt_token_ids.ids), max_model_len, prompt_field)
    prompt_ids = prompt_ids_from_proto(msg, tokenizer, tools)
    if max_model_len is not None:
        limits.check_prompt(len(prompt_ids), max_model_len, prompt_field)
    params = constrain_after_reasoning(params, _prompt_reasoning(msg, tokenizer, prompt_ids))
    requested = params.max_tokens if sampling.HasField("max_tokens") else None
    max_tokens = limits.resolve_max_tokens(requested, len(prompt_ids), max_model_len, "sampling.max_tokens",
                                           default=params.max_tokens)
    if max_tokens is not None and max_tokens != params.max_tokens:
        params = dataclasses.replace(params, max_tokens=max_tokens)
    request = GenerationRequest(
        request_id=msg.request_id or uuid.uuid4().hex,
        prompt_token_ids=prompt_ids,
        sampling_params=params,
        priority=msg.priority,
        cache_salt=msg.cache_salt,
    )
    return request, tools


def request_to_proto(request: GenerationRequest) -> pb.GenerateRequest:
    """The proto of an engine request (prompt as token ids), e.g. for clients and tests."""
    return pb.GenerateRequest(
        prompt_token_ids=pb.TokenIds(ids=request.prompt_token_ids),
        sampling=sampling_params_to_proto(request.sampling_params),
        request_id=request.request_id,
        priority=request.priority,
        cache_salt=request.cache_salt,
    )


def _logprob_to_proto(entry: TokenLogprob) -> pb.TokenLogprob:
    return pb.TokenLogprob(token_id=entry.token_id, logprob=entry.logprob,
                           top_logprobs=[pb.TopLogprob(token_id=t, logprob=lp) for t, lp in entry.top_logprobs])


def chunk_to_proto(chunk: StreamChunk) -> pb.GenerateResponse:
    """One streamed chunk; ``finish_reason`` and ``usage`` only on the last one of its choice."""
    msg = pb.GenerateResponse(text=chunk.text, token_ids=chunk.token_ids, replica_id=chunk.replica_id,
                              index=chunk.index)
    if chunk.logprobs:
        msg.logprobs.extend(_logprob_to_proto(e) for e in chunk.logprobs)
    if chunk.prompt_logprobs:
        msg.prompt_logprobs.extend(_logprob_to_proto(e) for e in chunk.prompt_logprobs[1:] if e is not None)
    if chunk.finish_reason is not None:
        msg.finish_reason = chunk.finish_reason.value
        msg.usage.CopyFrom(
            pb.Usage(
                prompt_tokens=chunk.prompt_tokens,
                completion_tokens=chunk.completion_tokens,
                cached_prompt_tokens=chunk.cached_prompt_tokens,
            )
        )
    return msg


def reasoning_mode_from_proto(msg: pb.GenerateRequest, tokenizer: RouterTokenizer,
                              request: GenerationRequest) -> Optional[ReasoningMode]:
    """How the output of ``msg`` splits into reasoning and content (``router/reasoning.py``):
    chat (``messages``) requests only, as over HTTP; whether the output starts in
    reasoning is read from the rendered prompt's last tokens (a grammar, if any,
    holds the content after the reasoning: ``request_and_tools_from_proto``)."""
    return _prompt_reasoning(msg, tokenizer, request.prompt_token_ids)


def _prompt_reasoning(msg: pb.GenerateRequest, tokenizer: RouterTokenizer,
                      prompt_ids: list[int]) -> Optional[ReasoningMode]:
    mode_of = getattr(tokenizer, "reasoning_mode", None)
    if mode_of is None or msg.WhichOneof("input") != "messages":
        return None
    return mode_of(tokenizer.decode(prompt_ids[-16:], skip_special_tokens=False))


def split_reasoning_chunk(response: pb.GenerateResponse, chunk: StreamChunk,
                          parser: ReasoningParser) -> pb.GenerateResponse:
    """Moves the reasoning out of ``response.text`` (its choice's ``parser`` holds
    what may start a tag) into ``response.reasoning``, in place, and on the
    choice's last chunk counts its reasoning tokens in ``usage``; returns ``response``."""
    reasoning, content = parser.feed(response.text, len(chunk.token_ids))
    if chunk.finish_reason is not None:
        more_reasoning, more_content = parser.finish()
        reasoning, content = reasoning + more_reasoning, content + more_content
        response.usage.reasoning_tokens = parser.num_reasoning_tokens
    response.reasoning, response.text = reasoning, content
    return response


def replica_stats_to_proto(stats: ReplicaStats) -> pb.ReplicaInfo:
    """One entry of ``ListReplicasResponse``."""
    return pb.ReplicaInfo(
        replica_id=stats.replica_id,
        num_running=stats.num_running,
        num_waiting=stats.num_waiting,
        kv_cache_usage=stats.kv_cache_usage,
        num_cached_blocks=stats.num_cached_blocks,
    )
