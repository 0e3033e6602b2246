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
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from cluster.shared.types import StreamChunk
from router.openai.protocol import (
    ParsedRequest,
    backend_error,
    chat_logprobs,
    completion_logprobs,
    error_response,
    finish_reason,
    internal_error,
    usage_body,
)
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
class _Result:
    """A whole non-streamed generation."""

    text: str
    last: Optional[StreamChunk]
    logprobs: list


async def whole_response(
    request: Request, tokenizer: Any, parsed: ParsedRequest, stream: AsyncIterator[StreamChunk],
    first: Optional[StreamChunk], ident: str, created: int,
) -> Response:
    """Collects the whole output; a client disconnect cancels the generation."""
    consumer = asyncio.ensure_future(_collect(stream, first))
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
    result: _Result = consumer.result()
    reason = finish_reason(result.last) if result.last else None
    want_logprobs = parsed.request.sampling_params.logprobs is not None
    if parsed.chat:
        lp = chat_logprobs(result.logprobs, tokenizer) if want_logprobs else None
        message: dict[str, Any] = {"role": "assistant", "content": result.text}
        tool_output = parse_tool_output(parsed.tools, result.text)
        if tool_output is not None and tool_output.tool_calls:
            message = {"role": "assistant", "content": tool_output.content,
                       "tool_calls": [call.body() for call in tool_output.tool_calls]}
            reason = tool_finish_reason(reason, len(tool_output.tool_calls))
        elif tool_output is not None:
            message["content"] = tool_output.content
        choice = {"index": 0, "message": message, "logprobs": lp, "finish_reason": reason}
        obj = "chat.completion"
    else:
        lp = completion_logprobs(result.logprobs, tokenizer, 0) if want_logprobs else None
        choice = {"index": 0, "text": result.text, "logprobs": lp, "finish_reason": reason}
        obj = "text_completion"
    return JSONResponse({
        "id": ident, "object": obj, "created": created, "model": parsed.echo_model,
        "choices": [choice], "usage": usage_body(result.last),
    })


async def _collect(stream: AsyncIterator[StreamChunk], first: Optional[StreamChunk]) -> _Result:
    parts: list[str] = []
    logprobs: list = []
    last = None
    chunk = first
    while chunk is not None:
        parts.append(chunk.text)
        logprobs.extend(chunk.logprobs or ())
        last = chunk
        if chunk.finished:
            break
        chunk = await anext(stream, None)
    return _Result("".join(parts), last, logprobs)


async def event_stream(
    tokenizer: Any, parsed: ParsedRequest, stream: AsyncIterator[StreamChunk], first: Optional[StreamChunk],
    ident: str, created: int,
) -> AsyncIterator[str]:
    """Server-sent events of one streamed generation."""
    want_logprobs = parsed.request.sampling_params.logprobs is not None
    obj = "chat.completion.chunk" if parsed.chat else "text_completion"
    base = {"id": ident, "object": obj, "created": created, "model": parsed.echo_model}

    def event(choices: list, **extra: Any) -> str:
        return "data: " + json.dumps({**base, "choices": choices, **extra}) + "\n\n"

    last: Optional[StreamChunk] = None
    offset = 0
    tool_parser = make_parser(parsed.tools) if parsed.chat else None
    try:
        if parsed.chat:  # the role comes first, as OpenAI sends it
            yield event([{"index": 0, "delta": {"role": "assistant", "content": ""},
                          "logprobs": None, "finish_reason": None}])
        chunk = first
        while chunk is not None:
            last = chunk
            if chunk.text or chunk.finished or chunk.logprobs:
                entries = chunk.logprobs or []
                if parsed.chat:
                    delta, reason = _chat_delta(chunk, tool_parser)
                    choice = {"index": 0, "delta": delta,
                              "logprobs": chat_logprobs(entries, tokenizer) if want_logprobs else None,
                              "finish_reason": reason}
                    # Text the tool-call parser holds back (a possible call) sends nothing yet.
                    held = not delta and reason is None and not (want_logprobs and entries)
                else:
                    choice = {"index": 0, "text": chunk.text,
                              "logprobs": (completion_logprobs(entries, tokenizer, offset)
                                           if want_logprobs else None),
                              "finish_reason": finish_reason(chunk)}
                    held = False
                offset += len(chunk.text)
                if not held:
                    yield event([choice])
            if chunk.finished:
                break
            chunk = await anext(stream, None)
        if parsed.include_usage:
            yield event([], usage=usage_body(last))
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


def _chat_delta(chunk: StreamChunk, tool_parser: Any) -> tuple[dict[str, Any], Optional[str]]:
    """The chat ``delta`` and finish reason of one chunk, through the tool-call parser if any."""
    if tool_parser is None:
        return ({"content": chunk.text} if chunk.text else {}), finish_reason(chunk)
    out: ParserDelta = tool_parser.feed(chunk.text)
    if chunk.finished:
        out = out + tool_parser.finish()
    delta: dict[str, Any] = {}
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
