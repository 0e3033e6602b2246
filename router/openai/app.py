"""OpenAI-compatible HTTP API over a :class:`router.backend.Backend`.

Routes::

    POST /v1/completions        prompt (string or token ids) → text
    POST /v1/chat/completions   messages (rendered with the chat template) → message
    GET  /v1/models             the one served model
    GET  /health                200 while the server runs
    GET  /metrics               Prometheus text: the router's and every live replica's
                                series (with ``metrics``; see ``router/metrics.py``)

Both generation routes stream server-sent events with ``"stream": true``
(``data: {...}`` chunks, then ``data: [DONE]``); with
``stream_options.include_usage`` a last chunk with empty ``choices`` carries
``usage``. ``usage.prompt_tokens_details.cached_tokens`` is the replica's
prefix-cache hit. Errors are OpenAI bodies ``{"error": {...}}``: 400 bad
input (a limit of ``router.limits`` is named with the value allowed), 401
missing or wrong API key (``router.security``), 404 unknown model, 413 body
over ``max_request_bytes``, 429 overloaded (with ``Retry-After``), 503 no
replica.

When a streaming client disconnects, the response task is cancelled and the
backend's stream is closed, which makes the replica abort the sequence and
free its blocks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import socket
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional

import anyio
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from cluster.types import StreamChunk
from router.backend import Backend, NoReplicaError, OverloadedError
from router.limits import Limits
from router.openai_protocol import (
    APIError,
    ParsedRequest,
    bad_request,
    chat_logprobs,
    completion_logprobs,
    finish_reason,
    param_of,
    parse_request,
    usage_body,
)

logger = logging.getLogger(__name__)


def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def _backend_error(exc: BaseException) -> Optional[APIError]:
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


async def _close(stream: AsyncIterator[StreamChunk]) -> None:
    """Closes the backend stream even inside a cancelled task (the replica then aborts)."""
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        with anyio.CancelScope(shield=True):
            await aclose()


class _EventStream(StreamingResponse):
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


class OpenAIServer:
    """The request handlers (one instance per app).

    Args:
        backend: Where requests go.
    """

    def __init__(self, backend: Backend, limits: Optional[Limits] = None) -> None:
        self.backend = backend
        self.limits = limits or Limits()

    async def models(self, request: Request) -> Response:
        """``GET /v1/models``."""
        model = self.backend.model
        card = {"id": model.name, "object": "model", "created": 0, "owned_by": "prefixserve",
                "max_model_len": model.max_model_len}
        return JSONResponse({"object": "list", "data": [card]})

    async def health(self, request: Request) -> Response:
        """``GET /health``."""
        return JSONResponse({"status": "ok"})

    async def completions(self, request: Request) -> Response:
        """``POST /v1/completions``."""
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        """``POST /v1/chat/completions``."""
        return await self._generate(request, chat=True)

    async def _generate(self, request: Request, chat: bool) -> Response:
        try:
            raw = await self._read_body(request)
            try:
                body = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
                raise bad_request(f"the request body is not valid JSON ({exc}): send a JSON object") from None
            parsed = parse_request(body, chat, self.backend.tokenizer, self.backend.model, self.limits)
        except APIError as err:
            return _error_response(err)
        stream = self.backend.stream(parsed.request).__aiter__()
        try:
            first = await stream.__anext__()  # errors before any output get a proper status
        except StopAsyncIteration:
            first = None
        except Exception as exc:  # noqa: BLE001 - mapped below
            await _close(stream)
            err = _backend_error(exc)
            if err is None:
                logger.exception("request %s failed", parsed.request.request_id)
                err = APIError(500, f"internal error: {exc}", type_="internal_error")
            return _error_response(err)
        except BaseException:
            await _close(stream)
            raise
        prefix = "chatcmpl-" if chat else "cmpl-"
        ident = prefix + parsed.request.request_id
        created = int(time.time())
        if parsed.stream:
            events = self._events(parsed, stream, first, ident, created)
            return _EventStream(events, headers={"Cache-Control": "no-cache"})
        return await self._whole(request, parsed, stream, first, ident, created)

    async def _read_body(self, request: Request) -> bytes:
        """The body, refused with 413 once it passes ``max_request_bytes`` (declared or streamed)."""
        limit = self.limits.max_request_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise APIError(413, self.limits.request_too_large(int(declared)), code="request_too_large")
        parts, size = [], 0
        async for part in request.stream():
            size += len(part)
            if size > limit:
                raise APIError(413, self.limits.request_too_large(size) + " (counted so far)",
                               code="request_too_large")
            parts.append(part)
        return b"".join(parts)

    async def _whole(
        self, request: Request, parsed: ParsedRequest, stream: AsyncIterator[StreamChunk],
        first: Optional[StreamChunk], ident: str, created: int,
    ) -> Response:
        """Collects the whole output; a client disconnect cancels the generation."""
        consumer = asyncio.ensure_future(self._collect(stream, first))
        watcher = asyncio.ensure_future(_wait_disconnect(request))
        try:
            await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not consumer.done():
                consumer.cancel()
                logger.info("client of %s went away: aborting", parsed.request.request_id)
            await asyncio.gather(consumer, watcher, return_exceptions=True)
            await _close(stream)
        if consumer.cancelled():
            return Response(status_code=499)
        exc = consumer.exception()
        if exc is not None:
            err = _backend_error(exc)
            if err is None:
                logger.error("request %s failed", parsed.request.request_id, exc_info=exc)
                err = APIError(500, f"internal error: {exc}", type_="internal_error")
            return _error_response(err)
        result: _Result = consumer.result()
        tokenizer = self.backend.tokenizer
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

    @staticmethod
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

    async def _events(
        self, parsed: ParsedRequest, stream: AsyncIterator[StreamChunk], first: Optional[StreamChunk],
        ident: str, created: int,
    ) -> AsyncIterator[str]:
        """Server-sent events of one streamed generation."""
        tokenizer = self.backend.tokenizer
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
            err = _backend_error(exc)
            if err is None:
                logger.error("stream %s failed", parsed.request.request_id, exc_info=exc)
                err = APIError(500, f"internal error: {exc}", type_="internal_error")
            yield "data: " + json.dumps(err.body()) + "\n\n"
        finally:
            if last is None or not last.finished:
                logger.info("stream %s ended early: closing the backend stream", parsed.request.request_id)
            await _close(stream)
        yield "data: [DONE]\n\n"


async def _wait_disconnect(request: Request) -> None:
    """Returns when the client closes the connection."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def build_openai_app(backend: Backend, metrics: Any = None, *, limits: Optional[Limits] = None,
                     security: Any = None) -> Starlette:
    """The ASGI app of the OpenAI-compatible API over ``backend``.

    Args:
        backend: Validated requests go to ``backend.stream()``; its tokenizer
            tokenizes prompts and renders chat templates.
        metrics: A ``router.metrics.ClusterMetrics`` served at ``GET /metrics``
            (None: no such route).
        limits: Input limits and body size (default ``Limits()``).
        security: ``router.security.Security``; with API keys, every route
            but its open ones (``/health``, ``/metrics`` by default) needs
            ``Authorization: Bearer <key>``. TLS is :func:`serve_openai`'s.

    Returns:
        A Starlette app (serve it with :func:`serve_openai` or any ASGI server).
    """
    server = OpenAIServer(backend, limits)
    routes = [
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/health", server.health, methods=["GET"]),
    ]
    if metrics is not None:
        from router.metrics import CONTENT_TYPE

        async def scrape(request: Request) -> Response:
            return Response(await metrics.render(), headers={"Content-Type": CONTENT_TYPE})

        routes.append(Route("/metrics", scrape, methods=["GET"]))

    async def not_found(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 404)
        if status == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        else:
            message = f"{request.url.path} is not a route of this API: use /v1/completions, /v1/chat/completions"
        return _error_response(APIError(status, message, type_="not_found_error"))

    middleware = []
    if security is not None and security.api_keys is not None:
        from starlette.middleware import Middleware

        from router.security import BearerAuthMiddleware

        middleware.append(Middleware(BearerAuthMiddleware, api_keys=security.api_keys,
                                     open_paths=security.open_http_paths()))
    return Starlette(routes=routes, exception_handlers={404: not_found, 405: not_found}, middleware=middleware)


class OpenAIServerHandle:
    """A running :func:`serve_openai` server.

    Attributes:
        host: The bound address.
        port: The bound port (the real one when 0 was asked).
    """

    def __init__(self, server: uvicorn.Server, task: asyncio.Task, host: str, port: int, tls: bool = False) -> None:
        self._server = server
        self._task = task
        self.host = host
        self.port = port
        self.tls = tls

    @property
    def url(self) -> str:
        """Base URL of the API, e.g. ``http://127.0.0.1:8000/v1`` (``https`` with TLS)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}/v1"

    @property
    def running(self) -> bool:
        """Whether the server task is still serving."""
        return not self._task.done()

    async def stop(self, grace: Optional[float] = None) -> None:
        """Stops accepting requests, lets running ones (streams too) finish, and returns when closed.

        Args:
            grace: Seconds running requests get before they are cut; None
                keeps the server's setting (5 s).
        """
        if grace is not None:
            self._server.config.timeout_graceful_shutdown = grace
        self._server.should_exit = True
        try:
            await self._task
        except asyncio.CancelledError:
            pass


class _EmbeddedServer(uvicorn.Server):
    """uvicorn in someone else's event loop: leaves the process's signal handlers alone."""

    def capture_signals(self):  # type: ignore[override]
        import contextlib

        return contextlib.nullcontext()


async def serve_openai(backend: Backend, host: str = "127.0.0.1", port: int = 8000,
                       metrics: Any = None, *, limits: Optional[Limits] = None,
                       security: Any = None) -> OpenAIServerHandle:
    """Serves the OpenAI API with uvicorn in the current event loop.

    Args:
        backend: The request backend.
        host: Address to bind (loopback by default).
        port: Port to bind; 0 picks a free one (see ``handle.port``).
        metrics: Serves ``GET /metrics`` (``router.metrics.ClusterMetrics``).
        limits: Input limits and body size (default ``Limits()``).
        security: ``router.security.Security``: HTTPS with its TLS files
            (client certificates required with a client CA) and API keys.

    Returns:
        A handle with ``.port`` and ``async stop()``.

    Raises:
        OSError: The address cannot be bound.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    bound = sock.getsockname()[1]
    tls = security.tls if security is not None else None
    config = uvicorn.Config(
        build_openai_app(backend, metrics, limits=limits, security=security), lifespan="off",
        log_level="warning", access_log=False, timeout_graceful_shutdown=5,
        **(tls.uvicorn_options() if tls is not None else {}),
    )
    server = _EmbeddedServer(config)
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            sock.close()
            task.result()  # raises the startup error
            raise RuntimeError("the OpenAI HTTP server exited during startup")
        await asyncio.sleep(0.01)
    handle = OpenAIServerHandle(server, task, host, bound, tls=tls is not None)
    logger.info("OpenAI-compatible API on %s", handle.url)
    return handle
