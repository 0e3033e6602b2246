"""The two response shapes of a generation: a whole JSON body, or server-sent
events (``data: {...}`` chunks, then ``data: [DONE]``).

Both close the backend stream however they end (done, error, client gone),
which makes the replica abort the sequence and free its blocks. A client that
disconnects from a non-streamed request cancels its generation (HTTP 499).
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
        choice = {"index": 0, "message": {"role": "assistant", "content": result.text},
                  "logprobs": lp, "finish_reason": reason}
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
                    choice = {"index": 0, "delta": {"content": chunk.text} if chunk.text else {},
                              "logprobs": chat_logprobs(entries, tokenizer) if want_logprobs else None,
                              "finish_reason": finish_reason(chunk)}
                else:
                    choice = {"index": 0, "text": chunk.text,
                              "logprobs": (completion_logprobs(entries, tokenizer, offset)
                                           if want_logprobs else None),
                              "finish_reason": finish_reason(chunk)}
                offset += len(chunk.text)
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


async def _wait_disconnect(request: Request) -> None:
    """Returns when the client closes the connection."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
