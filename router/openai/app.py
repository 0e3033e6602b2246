"""The routes of the OpenAI-compatible HTTP API over a :class:`router.backend.Backend`.

Routes::

    POST /v1/completions        prompt (string or token ids) → text
    POST /v1/chat/completions   messages (rendered with the chat template) → message
    POST /v1/responses          OpenAI's Responses API, stored responses in Redis (responses_api.py)
    POST /tokenize              vLLM's: prompt (or chat messages) → token ids, count
    POST /detokenize            vLLM's: token ids → text
    GET  /v1/models             the served models (several with ``models:``; a request's
                                ``model`` picks one, none names the first: router/models.py)
    GET  /health                200 while the server runs, 503 while it drains
    GET  /metrics               Prometheus text: the router's and every live replica's
                                series (with ``metrics``; see ``router/metrics.py``)

Both generation routes stream server-sent events with ``"stream": true``
(``data: {...}`` chunks, then ``data: [DONE]``); with
``stream_options.include_usage`` a last chunk with empty ``choices`` carries
``usage``. ``usage.prompt_tokens_details.cached_tokens`` is the replica's
prefix-cache hit. Errors are OpenAI bodies ``{"error": {...}}``: 400 bad
input (a limit of ``router.limits`` is named with the value allowed), 401
missing or wrong API key (``router.security``), 404 unknown model, 413 body
over ``max_request_bytes``, 429 overloaded or over the tenant's limits (with
``Retry-After``), 500 an unexpected error (the body names the request id
the router logged the cause under, never the exception's text), 503 no
replica. With API keys each request runs as its key's tenant
(``router.tenants``), whose limits are checked before the body is read.

When a streaming client disconnects, the response task is cancelled and the
backend's stream is closed, which makes the replica abort the sequence and
free its blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from typing import Any, Optional

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from router.backend import Backend
from router.errors import OverloadedError
from router.limits import OFFLOAD_BYTES, Limits
from router.models import ModelBackends, ModelNotFoundError
from router.openai.protocol import (APIError, ParsedRequest, backend_error, bad_request, error_response,
                                    internal_error, parse_request, tokenize_chat)
from router.openai.responses import EventStream, close_stream, event_stream, whole_response
from router.openai.lora_admin import LoRAAdmin
from router.openai.responses_api import ResponsesAPI
from router.streams import merge_indexed

logger = logging.getLogger(__name__)


class OpenAIServer:
    """The request handlers (one instance per app).

    Args:
        backend: Where requests go: one model's ``Backend``, or a
            ``router.models.ModelBackends`` whose request's ``model`` picks it.
        limits: Input limits (default ``Limits()``).
        security: ``router.security.Security``: with API keys, each request
            runs as its key's tenant (``router.tenants``); None runs requests as sent.
    """

    def __init__(self, backend: Backend | ModelBackends, limits: Optional[Limits] = None,
                 security: Any = None) -> None:
        self.backends = ModelBackends.of(backend)
        self.limits = limits or Limits()
        self.security = security

    async def models(self, request: Request) -> Response:
        """``GET /v1/models``."""
        await self.backends.refresh_adapters()
        cards = []
        for b in self.backends:  # each model, then its LoRA adapters (vLLM's cards: parent, root)
            card = {"object": "model", "created": 0, "owned_by": "prefixserve", "max_model_len": b.model.max_model_len}
            cards.append({"id": b.model.name, **card, "root": b.model.name, "parent": None})
            cards += [{"id": name, **card, "root": path, "parent": b.model.name}
                      for name, path in b.model.adapters.items()]
        return JSONResponse({"object": "list", "data": cards})

    async def health(self, request: Request) -> Response:
        """``GET /health``: 200, or 503 while the router drains (``router/drain.py``)."""
        if self.backends.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def completions(self, request: Request) -> Response:
        """``POST /v1/completions``."""
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        """``POST /v1/chat/completions``."""
        return await self._generate(request, chat=True)

    async def tokenize(self, request: Request) -> Response:
        """``POST /tokenize`` (vLLM's): ``{"prompt"}`` or ``{"messages"}`` (rendered with the
        chat template) → ``{"tokens", "count", "max_model_len"}``; ``return_token_strs``
        adds each token's text."""
        try:
            body = await self._json(request)
            backend = self._pick(body)
            tokenizer = backend.tokenizer
            if body.get("messages") is not None:
                if body.get("prompt") is not None:
                    raise bad_request("send prompt or messages, not both", "prompt")
                ids = tokenize_chat(body, tokenizer, self.limits)
            else:
                prompt = body.get("prompt")
                if not isinstance(prompt, str):
                    raise bad_request("prompt must be a string (or send messages)", "prompt")
                special = body.get("add_special_tokens", True)
                if not isinstance(special, bool):
                    raise bad_request("add_special_tokens must be true or false", "add_special_tokens")
                ids = tokenizer.encode(prompt, add_special_tokens=special) if prompt else []
            out: dict[str, Any] = {"tokens": ids, "count": len(ids), "max_model_len": backend.model.max_model_len}
            if body.get("return_token_strs"):
                out["token_strs"] = [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
            return JSONResponse(out)
        except APIError as err:
            return error_response(err)

    async def detokenize(self, request: Request) -> Response:
        """``POST /detokenize`` (vLLM's): ``{"tokens": [ids]}`` → ``{"prompt": text}``."""
        try:
            body = await self._json(request)
            tokenizer = self._pick(body).tokenizer
            tokens = body.get("tokens")
            if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
                raise bad_request("tokens must be a list of integer token ids", "tokens")
            try:
                tokenizer.check_token_ids(tokens, "tokens")
            except ValueError as exc:
                raise bad_request(str(exc), "tokens") from None
            return JSONResponse({"prompt": tokenizer.decode(tokens, skip_special_tokens=False)})
        except APIError as err:
            return error_response(err)

    async def _json(self, request: Request) -> dict:
        body = _decode(await self._read_body(request))  # API keys: checked by the middleware, like every route
        if not isinstance(body, dict):
            raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
        return body

    def _admit(self, request: Request) -> Any:
        """The caller's ``(tenant, admission)`` (``Security.admit``); ``(None, None)`` without security."""
        if self.security is None:
            return None, None
        return self.security.admit(request.headers.get("authorization"))

    def _pick(self, body: Any) -> Backend:
        """The backend of the body's ``model`` (400 not a string, 404 not served)."""
        name = body.get("model") if isinstance(body, dict) else None
        try:
            return self.backends.pick(name)
        except ModelNotFoundError as exc:
            raise APIError(404, str(exc), "model", code="model_not_found") from None
        except ValueError as exc:
            raise bad_request(str(exc), "model") from None

    def _parse(self, raw: bytes, chat: bool, limits: Limits) -> tuple[ParsedRequest, Backend]:
        body = _decode(raw)
        backend = self._pick(body)
        return parse_request(body, chat, backend.tokenizer, backend.model, limits), backend

    async def _generate(self, request: Request, chat: bool) -> Response:
        admission = None
        try:
            tenant, admission = self._admit(request)  # limits before reading, parsing or tokenizing
            limits = tenant.limits_over(self.limits) if tenant is not None else self.limits
            raw = await self._read_body(request)
            await self.backends.refresh_adapters()  # run-time LoRA adapters other routers added
            if len(raw) >= OFFLOAD_BYTES:  # parse and tokenize big bodies off the event loop
                parsed, backend = await asyncio.to_thread(self._parse, raw, chat, limits)
            else:
                parsed, backend = self._parse(raw, chat, limits)
            if tenant is not None:  # every prompt's request, not only the first
                parsed = dataclasses.replace(parsed, request=tenant.apply(parsed.request),
                                             requests=[tenant.apply(r) for r in parsed.requests])
        except (APIError, OverloadedError, PermissionError, ModelNotFoundError) as err:
            if admission is not None:
                admission.release()
            if isinstance(err, PermissionError):
                err = APIError(401, str(err), code="invalid_api_key")
            return error_response(err if isinstance(err, APIError) else backend_error(err))
        except BaseException:
            if admission is not None:
                admission.release()
            raise
        stream = self._open(backend, parsed)
        if admission is not None:
            stream = admission.meter(stream)  # releases the admission when the stream ends
        stream = stream.__aiter__()
        try:
            first = await stream.__anext__()  # errors before any output get a proper status
        except StopAsyncIteration:
            first = None
        except Exception as exc:  # noqa: BLE001 - mapped below
            await close_stream(stream)
            err = backend_error(exc)
            if err is None:
                request_id = parsed.request.request_id
                logger.exception("request %s failed", request_id)
                err = internal_error(request_id)
            return error_response(err)
        except BaseException:
            await close_stream(stream)
            raise
        prefix = "chatcmpl-" if chat else "cmpl-"
        ident = prefix + parsed.request.request_id
        created = int(time.time())
        if parsed.stream:
            events = event_stream(backend.tokenizer, parsed, stream, first, ident, created)
            return EventStream(events, headers={"Cache-Control": "no-cache"})
        return await whole_response(request, backend.tokenizer, parsed, stream, first, ident, created)

    def _open(self, backend: Backend, parsed: ParsedRequest) -> Any:
        """The request's stream: one backend stream, or with several prompts theirs
        merged, choice ``i`` of prompt ``p`` at index ``p * num_generated + i``."""
        if len(parsed.requests) == 1:
            return backend.stream(parsed.request)
        width = parsed.num_generated
        return merge_indexed([backend.stream(r) for r in parsed.requests],
                             [p * width for p in range(len(parsed.requests))], [width] * len(parsed.requests))

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


def _decode(raw: bytes) -> Any:
    """The JSON of a request body (a 400 when it is not JSON)."""
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise bad_request(f"the request body is not valid JSON ({exc}): send a JSON object") from None


def build_openai_app(backend: Backend, metrics: Any = None, *, limits: Optional[Limits] = None,
                     security: Any = None, response_store: Any = None) -> Starlette:
    """The ASGI app of the OpenAI-compatible API over ``backend``.

    Args:
        backend: Validated requests go to ``backend.stream()``; its tokenizer
            tokenizes prompts and renders chat templates.
        response_store: Where ``/v1/responses`` stores responses
            (``router.openai.response_store``); default the backend's
            ``response_store`` attribute, else none (``store: false`` only).
        metrics: A ``router.metrics.ClusterMetrics`` served at ``GET /metrics``
            (None: no such route).
        limits: Input limits and body size (default ``Limits()``).
        security: ``router.security.Security``; with API keys, every route
            but its open ones (``/health``, ``/metrics`` by default) needs
            ``Authorization: Bearer <key>``. TLS is :func:`serve_openai`'s.

    Returns:
        A Starlette app (serve it with :func:`serve_openai` or any ASGI server).
    """
    server = OpenAIServer(backend, limits, security)
    responses = ResponsesAPI(server, response_store, backend)
    lora_admin = LoRAAdmin(server)
    routes = [
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/v1/load_lora_adapter", lora_admin.load, methods=["POST"]),
        Route("/v1/unload_lora_adapter", lora_admin.unload, methods=["POST"]),
        Route("/tokenize", server.tokenize, methods=["POST"]),
        Route("/detokenize", server.detokenize, methods=["POST"]),
        Route("/health", server.health, methods=["GET"]),
        Route("/v1/responses", responses.create, methods=["POST"]),
        Route("/v1/responses/{response_id}", responses.retrieve, methods=["GET"]),
        Route("/v1/responses/{response_id}", responses.delete, methods=["DELETE"]),
        Route("/v1/responses/{response_id}/input_items", responses.input_items, methods=["GET"]),
        Route("/v1/responses/{response_id}/cancel", responses.cancel, methods=["POST"]),
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
        return error_response(APIError(status, message, type_="not_found_error"))

    middleware = []
    if security is not None and security.api_keys is not None:
        from starlette.middleware import Middleware

        from router.security import BearerAuthMiddleware

        middleware.append(Middleware(BearerAuthMiddleware, api_keys=security.api_keys,
                                     open_paths=security.open_http_paths()))
    return Starlette(routes=routes, exception_handlers={404: not_found, 405: not_found}, middleware=middleware)
