"""The two response shapes of a generation: a whole JSON body, or server-sent
events (``data: {...}`` chunks, then ``data: [DONE]``).

Both close the backend stream however they end (done, error, client gone),
which makes the replica abort the sequence and free its blocks. A client that
disconnects from a non-streamed request cancels its generation (HTTP 499).

A chat request that offers tools has its output read by a tool-call parser
(``router/tools``): calls become ``message.tool_calls`` (streamed as
``delta.tool_calls[i]``: ``id``, ``type`` and ``function.name`` in a call's
first delta, ``function.arguments`` pieces after), the rest is ``content``
(None when only calls), and ``finish_reason`` is ``tool_calls`` when calls
were made and the output ended by itself. The whole answer feeds the same
parser as the stream, so both give the same calls.

With a reasoning parser (``router/reasoning.py``) the output is split first:
the think block becomes ``message.reasoning`` and ``message.reasoning_content``
(the same text under vLLM's new name and the old one that clients still read;
None when the model did not think), streamed as ``delta.reasoning`` and
``delta.reasoning_content`` pieces; only the content after it goes to the
tool-call parser. ``usage.completion_tokens_details.reasoning_tokens`` counts the
think block's tokens (every choice's), whole and streamed.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from cluster.shared.choices import select_best
from cluster.shared.types import StreamChunk
from router.openai.bodies import (chat_logprobs, completion_logprobs, echo_logprobs, finish_reason,
                                  merge_completion_logprobs, prompt_logprobs_body, usage_totals)
from router.openai.protocol import ParsedRequest, backend_error, error_response, internal_error
from router.reasoning import ReasoningParser, split_pieces
from router.tools import ParserDelta, make_parser, parse_tool_output, tool_finish_reason

logger = logging.getLogger(__name__)


async def close_stream(stream: AsyncIterator[StreamChunk]) -> None:
    """Closes the backend stream even inside a cancelled task (the replica then aborts)."""
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        with anyio.CancelScope(shield=True):
            await aclose()


class EventStream(StreamingResponse):
    """A server-sent-event response that always closes its body iterator.

    Starlette cancels the sending task when the client disconnects; that may
    leave the generator suspended at a ``yield``, so it is closed here.
    """

    media_type = "text/event-stream"

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]


@dataclass
class _Choice:
    """One choice of a non-streamed generation, as collected."""

    text: str = ""
    pieces: list = field(default_factory=list)  # (text, number of tokens) of each chunk
    logprobs: list = field(default_factory=list)
    last: Optional[StreamChunk] = None
    prompt_logprobs: Optional[list] = None

    @property
    def cumulative_logprob(self) -> float:
        return sum(entry.logprob for entry in self.logprobs)


class _Usage:
    """Counts of a request over its choices: each prompt once, every choice's completion."""

    def __init__(self, parsed: ParsedRequest) -> None:
        self.width = parsed.num_generated
        self.prompts: dict[int, tuple[int, int]] = {}  # prompt -> (prompt tokens, cached)
        self.completions: dict[int, int] = {}  # choice (internal index) -> completion tokens
        self.reasoning: Optional[dict[int, int]] = {} if parsed.chat and parsed.reasoning is not None else None

    def add(self, chunk: StreamChunk) -> None:
        self.prompts[chunk.index // self.width] = (chunk.prompt_tokens, chunk.cached_prompt_tokens)
        self.completions[chunk.index] = chunk.completion_tokens

    def body(self) -> dict[str, Any]:
        return usage_totals(sum(p for p, _ in self.prompts.values()), sum(self.completions.values()),
                            sum(c for _, c in self.prompts.values()),
                            None if self.reasoning is None else sum(self.reasoning.values()))


def _prompt_text(parsed: ParsedRequest, tokenizer: Any, prompt: int) -> str:
    """The prompt as the client sent it (decoded when sent as token ids), for echo."""
    texts = parsed.prompt_texts
    if prompt < len(texts) and texts[prompt] is not None:
        return texts[prompt]
    return tokenizer.decode(parsed.requests[prompt].prompt_token_ids, skip_special_tokens=False)


def _echo_logprobs(parsed: ParsedRequest, tokenizer: Any, prompt: int, entries: Optional[list]) -> Optional[dict]:
    if parsed.logprobs is None:
        return None
    return echo_logprobs(parsed.requests[prompt].prompt_token_ids, entries or [], parsed.logprobs, tokenizer)


def _select(parsed: ParsedRequest, collected: dict[int, _Choice]) -> list[tuple[int, int, _Choice]]:
    """``(returned index, prompt, choice)`` in order: per prompt its ``n`` choices, with
    best_of the n of highest cumulative logprob (ties: the lower index)."""
    width, n = parsed.num_generated, parsed.n
    out = []
    for prompt in range(len(parsed.requests)):
        mine = [collected.get(prompt * width + i, _Choice()) for i in range(width)]
        order = select_best([c.cumulative_logprob for c in mine], n) if width > n else list(range(width))
        out.extend((prompt * n + j, prompt, mine[i]) for j, i in enumerate(order))
    return out


async def whole_response(
    request: Request, tokenizer: Any, parsed: ParsedRequest, stream: AsyncIterator[StreamChunk],
    first: Optional[StreamChunk], ident: str, created: int,
) -> Response:
    """Collects the whole output; a client disconnect cancels the generation."""
    usage = _Usage(parsed)
    consumer = asyncio.ensure_future(_collect(stream, first, usage))
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not consumer.done():
            consumer.cancel()
            logger.info("client of %s went away: aborting", parsed.request.request_id)
        await asyncio.gather(consumer, watcher, return_exceptions=True)
        await close_stream(stream)
    if consumer.cancelled():
        return Response(status_code=499)
    exc = consumer.exception()
    if exc is not None:
        err = backend_error(exc)
        if err is None:
            logger.error("request %s failed", parsed.request.request_id, exc_info=exc)
            err = internal_error(parsed.request.request_id)
        return error_response(err)
    collected = consumer.result()
    choices = [_choice_body(parsed, tokenizer, index, prompt, result)
               for index, prompt, result in _select(parsed, collected)]
    if usage.reasoning is not None:
        usage.reasoning = {index: split_pieces(parsed.reasoning, choice.pieces)[2]
                           for index, choice in collected.items()}
    return JSONResponse({
        "id": ident, "object": "chat.completion" if parsed.chat else "text_completion", "created": created,
        "model": parsed.echo_model, "choices": choices, "usage": usage.body(),
    })


def _choice_body(parsed: ParsedRequest, tokenizer: Any, index: int, prompt: int, result: _Choice) -> dict[str, Any]:
    reason = finish_reason(result.last) if result.last else None
    want_logprobs = parsed.logprobs is not None
    if parsed.chat:
        lp = chat_logprobs(result.logprobs, tokenizer) if want_logprobs else None
        reasoning, content, _ = split_pieces(parsed.reasoning, result.pieces)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if parsed.reasoning is not None:
            message.update(reasoning=reasoning, reasoning_content=reasoning)
        tool_output = parse_tool_output(parsed.tools, content)
        if tool_output is not None and tool_output.tool_calls:
            message["content"] = tool_output.content
            message["tool_calls"] = [call.body() for call in tool_output.tool_calls]
            reason = tool_finish_reason(reason, len(tool_output.tool_calls))
        elif tool_output is not None:
            message["content"] = tool_output.content
        body = {"index": index, "message": message, "logprobs": lp, "finish_reason": reason}
    else:
        text = result.text
        lp = completion_logprobs(result.logprobs, tokenizer, 0) if want_logprobs else None
        if parsed.echo:
            head = _prompt_text(parsed, tokenizer, prompt)
            lp = merge_completion_logprobs(_echo_logprobs(parsed, tokenizer, prompt, result.prompt_logprobs), lp,
                                           len(head)) if want_logprobs else None
            text = head + text
        body = {"index": index, "text": text, "logprobs": lp, "finish_reason": reason}
    if parsed.prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs_body(result.prompt_logprobs, parsed.prompt_logprobs, tokenizer)
    return body


async def _collect(stream: AsyncIterator[StreamChunk], first: Optional[StreamChunk],
                   usage: _Usage) -> dict[int, _Choice]:
    collected: dict[int, _Choice] = {}
    prompt_lps: dict[int, list] = {}  # prompt -> its logprobs (on its first chunk only)
    chunk = first
    while chunk is not None:
        choice = collected.setdefault(chunk.index, _Choice())
        choice.text += chunk.text
        choice.pieces.append((chunk.text, len(chunk.token_ids)))
        choice.logprobs.extend(chunk.logprobs or ())
        choice.last = chunk
        usage.add(chunk)
        if chunk.prompt_logprobs is not None:
            prompt_lps[chunk.index // usage.width] = chunk.prompt_logprobs
        if chunk.finished:
            break
        chunk = await anext(stream, None)
    for index, choice in collected.items():
        choice.prompt_logprobs = prompt_lps.get(index // usage.width)
    return collected


async def event_stream(
    tokenizer: Any, parsed: ParsedRequest, stream: AsyncIterator[StreamChunk], first: Optional[StreamChunk],
    ident: str, created: int,
) -> AsyncIterator[str]:
    """Server-sent events of one streamed generation (every choice, each chunk
    tagged with its ``index``; best_of is never streamed, so indices are final)."""
    want_logprobs = parsed.logprobs is not None
    obj = "chat.completion.chunk" if parsed.chat else "text_completion"
    base = {"id": ident, "object": obj, "created": created, "model": parsed.echo_model}

    def event(choices: list, **extra: Any) -> str:
        return "data: " + json.dumps({**base, "choices": choices, **extra}) + "\n\n"

    last: Optional[StreamChunk] = None
    usage = _Usage(parsed)
    offsets: dict[int, int] = {}
    parsers: dict[int, Any] = {}  # chat with tools: one tool-call parser per choice
    thinkers: dict[int, ReasoningParser] = {}  # chat with a reasoning parser: one per choice
    prompt_lps: dict[int, list] = {}
    width = parsed.num_generated
    try:
        chunk = first
        while chunk is not None:
            last = chunk
            usage.add(chunk)
            index = chunk.index
            prompt = index // width
            if chunk.prompt_logprobs is not None:
                prompt_lps[prompt] = chunk.prompt_logprobs
            first_of_choice = index not in offsets
            if first_of_choice:
                offsets[index] = 0
                if parsed.chat:  # the role comes first, as OpenAI sends it
                    parsers[index] = make_parser(parsed.tools)
                    if parsed.reasoning is not None:
                        thinkers[index] = parsed.reasoning.make()
                    yield event([{"index": index, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None}])
                elif parsed.echo:
                    head = _prompt_text(parsed, tokenizer, prompt)
                    yield event([{"index": index, "text": head, "finish_reason": None,
                                  "logprobs": _echo_logprobs(parsed, tokenizer, prompt, prompt_lps.get(prompt))}])
                    offsets[index] = len(head)
            counted = index in thinkers and chunk.token_ids  # tokens without text still count as reasoning
            if chunk.text or chunk.finish_reason is not None or chunk.logprobs or first_of_choice or counted:
                entries = chunk.logprobs or []
                if parsed.chat:
                    delta, reason = _chat_delta(chunk, parsers[index], thinkers.get(index))
                    if index in thinkers and usage.reasoning is not None:
                        usage.reasoning[index] = thinkers[index].num_reasoning_tokens
                    choice = {"index": index, "delta": delta,
                              "logprobs": chat_logprobs(entries, tokenizer) if want_logprobs else None,
                              "finish_reason": reason}
                    # Text the tool-call parser holds back (a possible call) sends nothing yet.
                    held = not delta and reason is None and not (want_logprobs and entries)
                else:
                    choice = {"index": index, "text": chunk.text,
                              "logprobs": (completion_logprobs(entries, tokenizer, offsets[index])
                                           if want_logprobs else None),
                              "finish_reason": finish_reason(chunk)}
                    held = not (chunk.text or chunk.finish_reason is not None or entries)
                if first_of_choice and parsed.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = prompt_logprobs_body(prompt_lps.get(prompt), parsed.prompt_logprobs,
                                                                     tokenizer)
                    held = False
                offsets[index] += len(chunk.text)
                if not held:
                    yield event([choice])
            if chunk.finished:
                break
            chunk = await anext(stream, None)
        if parsed.include_usage:
            yield event([], usage=usage.body())
    except Exception as exc:  # noqa: BLE001 - reported in-band: the status is already sent
        err = backend_error(exc)
        if err is None:
            logger.error("stream %s failed", parsed.request.request_id, exc_info=exc)
            err = internal_error(parsed.request.request_id)
        yield "data: " + json.dumps(err.body()) + "\n\n"
    finally:
        if last is None or not last.finished:
            logger.info("stream %s ended early: closing the backend stream", parsed.request.request_id)
        await close_stream(stream)
    yield "data: [DONE]\n\n"


def _chat_delta(chunk: StreamChunk, tool_parser: Any,
                thinker: Optional[ReasoningParser] = None) -> tuple[dict[str, Any], Optional[str]]:
    """The chat ``delta`` and finish reason of one chunk: its reasoning (if a
    reasoning parser splits it), then its content through the tool-call parser if any."""
    reasoning, text = "", chunk.text
    if thinker is not None:
        reasoning, text = thinker.feed(text, len(chunk.token_ids))
        if chunk.finish_reason is not None:
            more_reasoning, more_text = thinker.finish()
            reasoning, text = reasoning + more_reasoning, text + more_text
    delta: dict[str, Any] = {"reasoning": reasoning, "reasoning_content": reasoning} if reasoning else {}
    if tool_parser is None:
        if text:
            delta["content"] = text
        return delta, finish_reason(chunk)
    out: ParserDelta = tool_parser.feed(text)
    if chunk.finish_reason is not None:
        out = out + tool_parser.finish()
    if out.content:
        delta["content"] = out.content
    if out.tool_calls:
        delta["tool_calls"] = [piece.body() for piece in out.tool_calls]
    return delta, tool_finish_reason(finish_reason(chunk), tool_parser.num_calls)


async def _wait_disconnect(request: Request) -> None:
    """Returns when the client closes the connection."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
