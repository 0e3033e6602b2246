"""The gRPC front end: ``prefixserve.v1.Generation`` over ``grpc.aio``.

    server = RouterServer(backend, directory=Directory.from_url(url, ns))
    port = await server.start()          # 127.0.0.1:<port>, SERVING
    ...
    await server.stop(grace=5.0)

Besides ``Generation`` the server answers the standard
``grpc.health.v1.Health`` service (SERVING for ``""`` and
``prefixserve.v1.Generation`` once started, NOT_SERVING while stopping) and
server reflection.

Errors map as the backend documents them (``router/backend.py``):

    ValueError          INVALID_ARGUMENT    the message names the field (and the limit)
    ModelNotFoundError  NOT_FOUND           the request's model is not served (router/models.py)
    OverloadedError     RESOURCE_EXHAUSTED  trailing metadata retry-after-ms: when to retry
    NoReplicaError      UNAVAILABLE
    deadline passed     DEADLINE_EXCEEDED
    PermissionError     UNAUTHENTICATED     no valid API key (the interceptor refuses first)
    anything else       INTERNAL            logged with the request id, which the details
                                            name (never the exception's text); the server
                                            keeps serving

Requests of at least ``OFFLOAD_BYTES`` are validated and tokenized in a
worker thread, not on the event loop. With API keys, each call runs as its
key's tenant (``router.tenants``): its rate and stream limits are checked
before the request is parsed, then its token cap, cache namespace and
priority cap apply.

Cancellation: when the client cancels or its deadline passes, gRPC cancels the
handler task; the ``async for`` over ``backend.stream()`` is interrupted, and
its ``finally`` cancels the Serve response, so the replica aborts the
sequence and frees its blocks. The handler also bounds the stream by the
deadline itself (``asyncio.timeout``), so a deadline is honoured even if the
transport notices it late.

Input limits (``router.limits.Limits``) apply to every request; messages
over ``max_request_bytes`` are refused by gRPC itself (RESOURCE_EXHAUSTED).
With ``security`` the server speaks TLS (mTLS with a client CA) and requires
``authorization: Bearer <key>`` metadata (``router.security``).

Tool calling (``GenerateRequest.tools``) follows the HTTP API
(``router/tools``): the tools are rendered into the prompt, ``tool_choice``
required / named constrains the output, and each chunk's text goes through the
request's tool-call parser: ``text`` carries the content, ``tool_calls`` each
call once, whole, on the chunk that completes it, and ``finish_reason`` is
``tool_calls`` when calls were made (``router/convert_tools.py``).

With a reasoning parser (``--reasoning-parser``, ``router/reasoning.py``) a
chat (``messages``) request's ``<think>`` block goes to each chunk's
``reasoning`` and ``text`` keeps the content, which alone is read for calls.

The server is stateless: several routers on one Redis behave as one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from typing import Any, AsyncIterator, Optional

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from router import convert
from router.backend import Backend
from router.convert_tools import ToolCallStream
from router.errors import NoReplicaError, OverloadedError
from router.limits import OFFLOAD_BYTES, Limits
from router.models import ModelBackends, ModelNotFoundError
from router.pb import generation_pb2 as pb
from router.pb import generation_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name  # prefixserve.v1.Generation
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 50051
RETRY_AFTER_KEY = "retry-after-ms"  # trailing metadata of RESOURCE_EXHAUSTED: milliseconds to wait


def status_for(exc: BaseException, request_id: str = "") -> tuple[grpc.StatusCode, str]:
    """The gRPC status and details for an error raised while serving a request
    (an unexpected error's text stays in the log: the client gets the request id)."""
    if isinstance(exc, PermissionError):
        return grpc.StatusCode.UNAUTHENTICATED, str(exc)
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, ModelNotFoundError):
        return grpc.StatusCode.NOT_FOUND, str(exc)
    if isinstance(exc, OverloadedError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, NoReplicaError):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    if isinstance(exc, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, "the deadline passed before the request finished"
    return grpc.StatusCode.INTERNAL, (f"internal error serving request {request_id or '(unassigned)'}: "
                                      "the router logged the cause under this id")


class GenerationServicer(pb_grpc.GenerationServicer):
    """Implements ``prefixserve.v1.Generation`` over a ``Backend``.

    Args:
        backend: Streams requests to the replicas (``RouterBackend`` or a
            fake), or ``router.models.ModelBackends``: the request's ``model`` picks one.
        directory: The prefix directory (``cluster.shared.directory.Directory``) whose
            replica stats answer ``ListReplicas``; None answers UNAVAILABLE.
        limits: Input limits (default ``Limits()``).
        security: ``router.security.Security``: with API keys, each call runs
            as its key's tenant (``router.tenants``); None runs requests as sent.
    """

    def __init__(self, backend: Backend | ModelBackends, directory: Any = None, limits: Optional[Limits] = None,
                 security: Any = None) -> None:
        self.backends = ModelBackends.of(backend)
        self.directory = directory
        self.limits = limits or Limits()
        self.security = security

    def _admit(self, context: grpc.aio.ServicerContext) -> Any:
        """The caller's ``(tenant, admission)`` (``Security.admit``); ``(None, None)`` without security."""
        if self.security is None:
            return None, None
        return self.security.admit(
            next((v for k, v in context.invocation_metadata() or () if k == "authorization"), None))

    def _convert(self, request: pb.GenerateRequest, limits: Limits) -> Any:
        """``(engine request, tool plan, reasoning mode, the model's backend)``."""
        backend = self.backends.pick(request.model)
        engine_request, tools = convert.request_and_tools_from_proto(request, backend.tokenizer,
                                                                     backend.model.max_model_len, limits)
        reasoning = convert.reasoning_mode_from_proto(request, backend.tokenizer, engine_request)
        asked = request.lora_adapter or request.model  # model may name a LoRA adapter too
        engine_request.lora_request = backend.model.lora_request(asked)
        if request.lora_adapter and engine_request.lora_request is None:
            raise ModelNotFoundError(f"the LoRA adapter {request.lora_adapter!r} does not exist: the model "
                                     f"{backend.model.name!r} serves {sorted(backend.model.adapters) or 'none'}")
        return engine_request, tools, reasoning, backend

    async def Generate(  # noqa: N802 - gRPC method name
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Validates the request and streams its chunks (see the module docstring)."""
        failure: Optional[tuple[grpc.StatusCode, str]] = None
        trailers: tuple[tuple[str, str], ...] = ()
        request_id = request.request_id or uuid.uuid4().hex  # names the request in logs and INTERNAL errors
        admission = None
        try:
            tenant, admission = self._admit(context)  # limits before any parsing or tokenizing
            limits = tenant.limits_over(self.limits) if tenant is not None else self.limits
            await self.backends.refresh_adapters()  # run-time LoRA adapters other routers added
            if request.ByteSize() >= OFFLOAD_BYTES:
                engine_request, tools, reasoning, backend = await asyncio.to_thread(self._convert, request, limits)
            else:
                engine_request, tools, reasoning, backend = self._convert(request, limits)
            tool_streams: dict[int, Any] = {}  # one tool-call parser per choice
            thinkers: dict[int, Any] = {}  # one reasoning parser per choice
            if not request.request_id:
                engine_request = dataclasses.replace(engine_request, request_id=request_id)
            if tenant is not None:
                engine_request = tenant.apply(engine_request)
            request_id = engine_request.request_id
            stream = backend.stream(engine_request)
            if admission is not None:
                stream = admission.meter(stream)
            try:
                while True:
                    # Bound each wait by the deadline (None: no deadline); not the
                    # yield, which runs gRPC's own code in this task.
                    async with asyncio.timeout(context.time_remaining()):
                        try:
                            chunk = await anext(stream)
                        except StopAsyncIteration:
                            break
                    response = convert.chunk_to_proto(chunk)
                    if reasoning is not None:  # reasoning first: tool calls are read from the content only
                        if chunk.index not in thinkers:
                            thinkers[chunk.index] = reasoning.make()
                        convert.split_reasoning_chunk(response, chunk, thinkers[chunk.index])
                    if tools is not None and chunk.index not in tool_streams:
                        tool_streams[chunk.index] = ToolCallStream.of(tools)
                    tool_stream = tool_streams.get(chunk.index)
                    yield response if tool_stream is None else tool_stream.rewrite(response, chunk)
            finally:
                await stream.aclose()  # cancels the Serve response if still running
        except asyncio.CancelledError:
            logger.info("request %s cancelled by the client", request_id)
            raise
        except Exception as exc:  # noqa: BLE001 - every error becomes a status, never a crash
            failure = status_for(exc, request_id)
            if isinstance(exc, OverloadedError):
                trailers = ((RETRY_AFTER_KEY, str(max(1, round(exc.retry_after_s * 1000)))),)
            if failure[0] is grpc.StatusCode.INTERNAL:
                logger.exception("request %s failed", request_id)
            else:
                logger.info("request %s: %s: %s", request_id, failure[0].name, failure[1])
        finally:
            if admission is not None:
                admission.release()
        if failure is not None:
            await context.abort(*failure, trailing_metadata=trailers)

    async def ListReplicas(  # noqa: N802 - gRPC method name
        self, request: pb.ListReplicasRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListReplicasResponse:
        """Each live replica's load, as its last directory heartbeat reported it."""
        if self.directory is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this router has no prefix directory configured")
        try:
            stats = await self.directory.replica_stats()
        except Exception as exc:  # noqa: BLE001 - DirectoryError and bugs alike
            logger.warning("ListReplicas: directory unavailable: %s", exc)
            failure = (grpc.StatusCode.UNAVAILABLE, "the replica directory is unavailable: retry later")
        else:
            return pb.ListReplicasResponse(replicas=[_replica_info(rid, s) for rid, s in sorted(stats.items())])
        await context.abort(*failure)


def _replica_info(replica_id: str, stats: dict) -> pb.ReplicaInfo:
    def number(name: str, cast: type) -> Any:
        value = stats.get(name, 0)
        try:
            return max(cast(value), 0)
        except (TypeError, ValueError, OverflowError):
            return cast(0)

    return pb.ReplicaInfo(
        replica_id=replica_id,
        num_running=number("num_running", int),
        num_waiting=number("num_waiting", int),
        kv_cache_usage=number("kv_cache_usage", float),
        num_cached_blocks=number("num_cached_blocks", int),
        num_swapped=number("num_swapped", int),
        prefix_cache_hit_rate=min(number("prefix_cache_hit_rate", float), 1.0),
        model=str(stats.get("model", "")),
        node=str(stats.get("node", "")),
        lora_adapters=[name for name in str(stats.get("lora_adapters", "")).split(",") if name],
    )


class RouterServer:
    """A ``grpc.aio`` server with Generation, Health and reflection.

    Args:
        backend: What serves the requests (``RouterBackend``, or ``ModelBackends`` of several models).
        directory: Prefix directory for ``ListReplicas`` (optional).
        host: Interface to bind (loopback by default).
        port: Port to bind; 0 picks a free one (see ``port`` after ``start``).
        limits: Input limits and message size (default ``Limits()``).
        security: TLS and API keys (``router.security.Security``); None
            serves plaintext without authentication.
        health_port: Also serve ``grpc.health.v1`` alone, in plaintext
            without a key, on this port (for Kubernetes' gRPC probes, which
            speak no TLS); it reports what the main port reports. None: none.
    """

    def __init__(self, backend: Backend | ModelBackends, directory: Any = None, host: str = DEFAULT_HOST,
                 port: int = DEFAULT_PORT, limits: Optional[Limits] = None, security: Any = None,
                 health_port: Optional[int] = None) -> None:
        self.backend = backend
        self.directory = directory
        self.limits = limits or Limits()
        self.security = security
        self.host = host
        self.requested_port = port
        self.port: Optional[int] = None
        self._server: Optional[grpc.aio.Server] = None
        self._health = health.aio.HealthServicer()
        self.requested_health_port = health_port
        self.health_port: Optional[int] = None
        self._health_server: Optional[grpc.aio.Server] = None

    @property
    def address(self) -> str:
        """``host:port`` as bound (after ``start``)."""
        return f"{self.host}:{self.port}"

    @property
    def serving(self) -> bool:
        """Started and not stopped."""
        return self._server is not None

    async def start(self) -> int:
        """Binds, starts serving and reports SERVING.

        Returns:
            The bound port.

        Raises:
            RuntimeError: The address could not be bound.
        """
        if self._server is not None:
            raise RuntimeError("the router server is already started")
        security = self.security
        server = grpc.aio.server(
            interceptors=security.grpc_interceptors() if security is not None else None,
            options=[("grpc.max_receive_message_length", self.limits.max_request_bytes)],
        )
        servicer = GenerationServicer(self.backend, self.directory, self.limits, security)
        pb_grpc.add_GenerationServicer_to_server(servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        names = (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, server)
        try:
            address = f"{self.host}:{self.requested_port}"
            if security is not None and security.tls is not None:
                port = server.add_secure_port(address, security.tls.grpc_credentials())
            else:
                port = server.add_insecure_port(address)
        except RuntimeError as exc:
            raise RuntimeError(f"cannot bind the gRPC router to {self.host}:{self.requested_port}: {exc}") from exc
        if port == 0:
            raise RuntimeError(f"cannot bind the gRPC router to {self.host}:{self.requested_port}")
        await server.start()
        self._server, self.port = server, port
        if self.requested_health_port is not None:
            await self._start_health_port()
        for service in ("", SERVICE_NAME):
            await self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        tls = security is not None and security.tls is not None
        logger.info("gRPC router serving on %s (%s%s)", self.address, "TLS" if tls else "plaintext",
                    ", API keys required" if security is not None and security.api_keys is not None else "")
        return port

    async def _start_health_port(self) -> None:
        """The plaintext health-only server (same servicer, so the same status)."""
        health_server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, health_server)
        port = health_server.add_insecure_port(f"{self.host}:{self.requested_health_port}")
        if port == 0:
            await self._server.stop(0)
            self._server = None
            raise RuntimeError(f"cannot bind the router's health port {self.host}:{self.requested_health_port}")
        await health_server.start()
        self._health_server, self.health_port = health_server, port
        logger.info("gRPC health (plaintext, health only) on %s:%d", self.host, port)

    async def not_serving(self) -> None:
        """Reports NOT_SERVING (a drain: the pod's readiness probe fails, calls go elsewhere)."""
        await self._health.enter_graceful_shutdown()

    async def stop(self, grace: Optional[float] = 5.0) -> None:
        """Reports NOT_SERVING, then stops; in-flight RPCs get ``grace`` seconds."""
        server, self._server = self._server, None
        if server is None:
            return
        await self._health.enter_graceful_shutdown()
        await server.stop(grace)
        health_server, self._health_server = self._health_server, None
        if health_server is not None:
            await health_server.stop(0)
        if self.directory is not None:
            try:
                await self.directory.aclose()
            except Exception:  # noqa: BLE001 - closing is best effort
                logger.debug("closing the directory client failed", exc_info=True)
        logger.info("gRPC router on %s stopped", self.address)

    async def wait_for_termination(self) -> None:
        """Blocks until the server stops."""
        if self._server is not None:
            await self._server.wait_for_termination()
