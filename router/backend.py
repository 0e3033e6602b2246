"""What the gRPC and HTTP front ends share: turning a validated request into
a stream of chunks from the replicas through Ray Serve.

``RouterBackend`` owns the Serve handle of the replica deployment (whose
request router applies the routing policy) and the router tokenizer. Front
ends convert their wire format into a ``GenerationRequest`` (tokenizing and
rendering chat templates here, never in a replica), call ``stream()``, and
map errors to their status codes:

    ValueError             bad input            INVALID_ARGUMENT / HTTP 400
    OverloadedError        queues are full      RESOURCE_EXHAUSTED / HTTP 429
                                                (+ retry-after-ms / Retry-After)
    NoReplicaError         no live replica,     UNAVAILABLE / HTTP 503
                           or this router drains
                           (with ``presence``: at once when the directory
                           saw none, router/presence.py)

Overload has three sources: this router already streams
``max_inflight_requests``; Serve cannot queue the request (its
``BackPressureError``); or the replica's waiting queue is full
(``ReplicaOverloadedError``, ``max_waiting_requests``). Each is rejected at
once, never queued without bound.

Cancelling the consumer of ``stream()`` cancels the Serve response, and the
replica aborts the sequence and frees its blocks. When a replica dies
mid-stream, the stream continues on another one (``router/migration.py``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional, Protocol

from cluster.shared.config import LoRAConfig
from cluster.shared.config.cluster import REPLICA_TRANSPORTS
from cluster.shared.types import GenerationRequest, LoRARequest, ReplicaOverloadedError, StreamChunk
from router.errors import NoReplicaError, OverloadedError
from router.migration import (DEFAULT_MIGRATION_LIMIT, DEFAULT_STALL_TIMEOUT_S, STALL_AVOID_S, MigrationLimitError,
                              migrating_choices)
from router.tokenizer import RouterTokenizer

logger = logging.getLogger(__name__)

DRAINING_MESSAGE = "this router is draining (its pod is stopping): retry, another router takes the request"


@dataclass(frozen=True)
class ModelInfo:
    """What front ends report about the served model.

    ``lora``: the replicas' LoRA settings when they serve adapters
    (``enable_lora``), else None. A request names an adapter as ``model``:
    its name, or ``<model>:<adapter>`` (Ray Serve LLM's form): one of
    ``lora_modules``, or a sub-folder of ``dynamic_lora_loading_path`` (when
    this process sees that folder, the sub-folder must hold an
    ``adapter_config.json``; when it does not, the replica loading it says).
    """

    name: str
    max_model_len: int
    lora: Optional[LoRAConfig] = None
    # Adapters added at run time (router/lora_registry.py; allow_runtime_lora_updating), else None.
    runtime: Any = field(default=None, compare=False, repr=False)

    @property
    def adapters(self) -> dict[str, str]:
        """The adapters it lists, name -> path: ``lora_modules``, then the
        dynamic folder's adapters this process can see (empty without LoRA)."""
        if self.lora is None:
            return {}
        found = dict(self.lora.modules)
        if self.runtime is not None:
            found.update((n, p) for n, p in self.runtime.names().items() if n not in found)
        folder = self.lora.dynamic_lora_loading_path
        if folder and os.path.isdir(folder):
            for name in sorted(os.listdir(folder)):
                path = self.lora.dynamic_path(name)
                if path and name not in found and os.path.isfile(os.path.join(path, "adapter_config.json")):
                    found[name] = path
        return found

    def adapter_of(self, asked: str) -> Optional[str]:
        """The adapter that ``asked`` names, or None (the model itself, or not this model's)."""
        lora = self.lora_request(asked)
        return lora.lora_name if lora is not None else None

    def lora_request(self, asked: Optional[str]) -> Optional[LoRARequest]:
        """The ``LoRARequest`` a request naming ``asked`` runs with (None: the base model, or
        a name that is not one of its adapters)."""
        if self.lora is None or not asked or asked == self.name:
            return None
        name = asked.removeprefix(self.name + ":")
        path = self.lora.modules.get(name)
        if path is not None:
            return LoRARequest(name, 0, path)
        added = self.runtime.get(name) if self.runtime is not None else None
        if added is not None:  # a new generation is read afresh by the replicas
            return LoRARequest(name, added[1], added[0])
        path = self.lora.dynamic_path(name)
        if path is None:
            return None
        if os.path.isdir(self.lora.dynamic_lora_loading_path or "") and \
                not os.path.isfile(os.path.join(path, "adapter_config.json")):
            return None
        return LoRARequest(name, 0, path)  # where only the replicas mount the folder, they load it or say why not


class Backend(Protocol):
    """The interface front ends use (tests may pass a fake)."""

    tokenizer: RouterTokenizer
    model: ModelInfo

    def stream(self, request: GenerationRequest) -> AsyncIterator[StreamChunk]: ...


class RouterBackend:
    """Streams requests to replicas through a Serve deployment handle.

    Args:
        handle: ``DeploymentHandle`` of the replica deployment.
        tokenizer: The model's router tokenizer.
        model: Name and limits of the served model.
        max_inflight_requests: Most requests streamed at once (both front
            ends together); more get ``OverloadedError``. None: unbounded.
        metrics: Counts each request's outcome in
            ``prefixserve:router_requests_total`` (``router/metrics.py``).
        migration_limit: Most times one request moves to another replica
            because its replica died (``router/migration.py``).
        stall_timeout_s: Seconds without a chunk, after a stream's first,
            after which its replica counts as dead and the stream migrates
            (None: never).
        replica_transport: ``direct``: a unary Serve call, the tokens
            sent by the replica's engine thread to this router's sink
            (``router/direct.py``); ``grpc``: Serve's gRPC stream to the
            replica (``_by_reference=False``); ``actor``: Ray actor tasks
            (``RouterConfig.replica_transport``).
        sink_host: The address the direct transport's sink binds and
            replicas connect to (this node's).
        same_loop: Run Serve's request router (our routing policy) on the
            front ends' event loop, through a handle of its own, instead of
            Serve's default thread with a second loop. Every request then
            saves two cross-thread hand-offs (~10% of the router's CPU per
            request, ``prefixserve bench router``); the decision's CPU is
            the same either way, since both threads share the GIL.
        presence: ``router.presence.ReplicaPresence`` of the model: new
            requests fail fast with ``NoReplicaError`` while the directory
            sees no live replica, instead of waiting in Serve's queue.
    """

    def __init__(self, handle: Any, tokenizer: RouterTokenizer, model: ModelInfo,
                 max_inflight_requests: Optional[int] = None, metrics: Optional[Any] = None,
                 migration_limit: int = DEFAULT_MIGRATION_LIMIT, replica_transport: str = "grpc",
                 same_loop: bool = True, presence: Optional[Any] = None,
                 stall_timeout_s: Optional[float] = DEFAULT_STALL_TIMEOUT_S, sink_host: str = "127.0.0.1") -> None:
        if replica_transport not in REPLICA_TRANSPORTS:
            raise ValueError(f"replica_transport must be one of {', '.join(REPLICA_TRANSPORTS)}, "
                             f"got {replica_transport!r}")
        self.handle = handle
        if replica_transport == "direct" and ray_tls_enabled():
            # Ray encrypts its own traffic; the direct sink is a plain TCP socket: stay on Serve's channel.
            logger.info("RAY_USE_TLS is on: streaming from replicas over Serve's gRPC channel, not the direct sink")
            replica_transport = "grpc"
        self.replica_transport = replica_transport
        self.same_loop = same_loop
        # The handle's streaming `generate` options, made on the serving loop (and
        # again if the backend is later used from another loop, e.g. a second asyncio.run).
        self._generate: Any = None
        self._generate_loop: Optional[asyncio.AbstractEventLoop] = None
        self._sink: Any = None  # the task starting router.direct.DirectSink on that loop (direct transport)
        self.sink_host = sink_host
        self.tokenizer = tokenizer
        self.model = model
        self.max_inflight_requests = max_inflight_requests
        self.num_inflight = 0
        self.metrics = metrics
        self.migration_limit = migration_limit
        self.stall_timeout_s = stall_timeout_s
        self.stalled_at: dict[str, float] = {}  # replica id -> when a stream left it for silence
        self.draining = False  # set by a drain (router/drain.py): new requests are refused
        self.presence = presence

    async def drain(self, timeout_s: float, poll_s: float = 0.05) -> int:
        """Refuses new requests and waits up to ``timeout_s`` for the running
        streams to finish; returns how many still run."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.num_inflight > 0 and loop.time() < deadline:
            await asyncio.sleep(poll_s)
        return self.num_inflight

    def stream(self, request: GenerationRequest) -> AsyncIterator[StreamChunk]:
        """Yields the request's chunks; the last one has a finish reason
        (errors as in ``_stream``); counts the outcome when ``metrics`` is set."""
        if self.metrics is None:
            return self._stream(request)
        from router.metrics import metered

        return metered(self._stream(request), self.metrics)

    async def _stream(self, request: GenerationRequest) -> AsyncIterator[StreamChunk]:
        """Yields the request's chunks; the last one has a finish reason.

        Raises:
            ValueError: The replica rejected the request as invalid.
            OverloadedError: Serve could not queue it anywhere.
            NoReplicaError: No replica is available, or the request's replicas
                died more often than ``migration_limit``.
        """
        if self.draining:
            raise NoReplicaError(DRAINING_MESSAGE)
        if self.presence is not None and self.presence.known_empty():
            raise NoReplicaError(f"the model {self.model.name!r} has no live replica (its replicas are down or "
                                 "restarting): retry later")
        cap = self.max_inflight_requests
        if cap is not None and self.num_inflight >= cap:
            raise OverloadedError(f"this router is streaming {self.num_inflight} requests, its "
                                  f"max_inflight_requests is {cap}: retry later")
        self.num_inflight += 1
        try:
            tokenizer = self.tokenizer if hasattr(self.tokenizer, "decode") else None
            avoid = self.stalled_replica_ids()
            if avoid:
                request = dataclasses.replace(request, avoid_replica_ids=avoid)
            stream = migrating_choices(self._attempt, request, self.migration_limit, tokenizer,
                                       stall_timeout_s=self.stall_timeout_s, on_stall=self.note_stall)
            try:
                async for chunk in stream:
                    yield chunk
            except MigrationLimitError as exc:
                raise NoReplicaError(str(exc)) from exc
            finally:
                await stream.aclose()
        finally:
            self.num_inflight -= 1

    def note_stall(self, replica_id: str) -> None:
        """A stream left ``replica_id`` because it went silent (``router/migration.py``)."""
        self.stalled_at[replica_id] = time.monotonic()

    def stalled_replica_ids(self) -> tuple[str, ...]:
        """Replicas that stalled in the last ``STALL_AVOID_S``: new requests avoid them
        until the directory drops them (or they turn out healthy)."""
        now = time.monotonic()
        for replica_id in [r for r, at in self.stalled_at.items() if now - at > STALL_AVOID_S]:
            del self.stalled_at[replica_id]
        return tuple(self.stalled_at)

    async def _attempt(self, request: GenerationRequest) -> AsyncIterator[StreamChunk]:
        """One Serve call; replica deaths propagate (``migrating_stream`` handles them)."""
        loop = asyncio.get_running_loop()
        if self._generate is None or self._generate_loop is not loop:
            self._generate, self._generate_loop = self._generate_handle(), loop
            self._sink = None
        if self.replica_transport == "direct":
            from router.direct import DirectSink, direct_attempt

            if self._sink is None:  # one sink per loop, started once however many requests wait for it
                self._sink = asyncio.ensure_future(DirectSink(self.sink_host).start())
            sink = await asyncio.shield(self._sink)
            async for chunk in direct_attempt(self._generate, sink, request, _replica_error):
                yield chunk
            return
        response = self._generate.remote(request)
        finished = False
        try:
            async for chunk in response:
                finished = chunk.finished
                yield chunk
        except Exception as exc:  # noqa: BLE001 - unwrap user errors raised in the replica
            mapped = _replica_error(exc)
            if mapped is exc:
                raise
            raise mapped from exc
        finally:
            if not finished:  # the replica's stream ends by itself after its last chunk
                response.cancel()  # aborts the sequence

    async def check_adapter(self, lora: LoRARequest) -> None:
        """Has one replica load ``lora`` (``ReplicaServer.load_lora_adapter``): a
        run-time load is refused with the replica's reason before any request names it.

        Raises:
            ValueError: The adapter cannot be loaded (missing, corrupt, too big a rank, ...).
        """
        from ray.serve.exceptions import DeploymentUnavailableError

        try:
            await self.handle.options(method_name="load_lora_adapter").remote(lora)
        except DeploymentUnavailableError as exc:
            raise NoReplicaError(f"no replica is available to load the adapter: {exc}") from exc
        except Exception as exc:  # noqa: BLE001 - unwrap the replica's ValueError
            cause = _user_error(exc)
            if cause is not None:
                raise cause from exc
            raise

    def _generate_handle(self) -> Any:
        """The streaming ``generate`` handle; called on the loop that serves the front ends."""
        handle = self.handle
        if self.same_loop and hasattr(handle, "deployment_id"):
            from ray.serve.handle import DeploymentHandle

            # A handle of our own, bound to this loop: the given one may be
            # used elsewhere (the launcher's calls, other loops, Serve's cache).
            handle = DeploymentHandle(handle.deployment_name, handle.app_name)
            handle._init(_run_router_in_separate_loop=False)
        if self.replica_transport == "direct":
            return handle.options(method_name="generate_direct", _by_reference=False)
        return handle.options(stream=True, method_name="generate", _by_reference=self.replica_transport == "actor")


def ray_tls_enabled() -> bool:
    """Whether Ray's own traffic is TLS (``RAY_USE_TLS``, as Ray reads it)."""
    return os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true")


def _replica_error(exc: BaseException) -> BaseException:
    """What a Serve call's error means to the front ends: the replica's ValueError or
    overload, Serve's back-pressure, no replica; else ``exc`` itself (a death: migrated)."""
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

    if isinstance(exc, BackPressureError):
        return OverloadedError(f"all replicas are at capacity, retry later: {exc}")
    if isinstance(exc, DeploymentUnavailableError):
        return NoReplicaError(f"no replica is available: {exc}")
    cause = _user_error(exc)
    if cause is not None:
        return cause
    overload = _overload(exc)
    if overload is not None:
        return OverloadedError(str(overload), overload.retry_after_s)
    return exc


def _overload(exc: BaseException) -> Optional[ReplicaOverloadedError]:
    """The replica's ReplicaOverloadedError inside Ray's task-error wrapper, if any."""
    for candidate in (getattr(exc, "cause", None), exc):
        if isinstance(candidate, ReplicaOverloadedError) and hasattr(candidate, "retry_after_s"):
            return candidate
    return None


def _user_error(exc: BaseException) -> Optional[ValueError]:
    """The replica's ValueError inside Ray's task-error wrapper, if any."""
    cause = getattr(exc, "cause", None)
    if isinstance(exc, ValueError):
        return exc
    if isinstance(cause, ValueError):
        return cause
    return None
