"""The router as a Ray Serve deployment, for clusters that Serve manages
(KubeRay's RayService): each router replica runs the gRPC front end
(``router.server.RouterServer``) and the OpenAI-compatible HTTP API
(``router.openai``) on the fixed ports of its node.

    replicas = serve.deployment(ReplicaServer).bind(...)
    router = serve.deployment(RouterDeployment).options(
        num_replicas=2, max_replicas_per_node=1).bind(replicas, front)

With several models (``models:`` in the cluster config) the router gets a
handle per model's replica deployment (``{served name: handle}``) and serves
them all on the same ports; the request's ``model`` picks one
(``router/models.py``).

The fixed ports are why a node runs at most one router replica
(``max_replicas_per_node=1``): a second one could not bind them. Each router
holds a Serve handle of the replica deployment, so routing (the prefix-aware
``RequestRouter`` configured on that deployment, with its policy and one Redis
lookup per request) happens in the router's process, exactly as in the local
launcher, where the same front ends run inside ``prefixserve up``.

Serve calls ``check_health`` every few seconds: a router whose servers
stopped is restarted. On shutdown by Serve (scale-down, upgrade) the health
service reports NOT_SERVING first, then in-flight streams get
``router.drain_timeout_s`` seconds to finish. A pod that Kubernetes stops
drains the same way through its preStop hook (``router.admin_socket``,
``router/drain.py``), before SIGTERM reaches Ray.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any, Optional

from cluster.shared.config import LoRAConfig, RouterConfig
from router.backend import ModelInfo, RouterBackend
from router.models import ModelBackends
from router.tokenizer import RouterTokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServedModel:
    """One model a router serves (plain values, picklable).

    Attributes:
        model_dir: Folder with the model's tokenizer (and chat template).
        model_name: The name clients pass as ``model``.
        max_model_len: Longest prompt + output the replicas accept.
        namespace: The model's directory namespace.
        routing_policy: Its replicas' routing policy (the ``policy`` label
            of the router's metrics, served with the replicas' at ``/metrics``).
        lora: Its replicas' LoRA settings when they serve adapters, else None.
    """

    model_dir: str
    model_name: str
    max_model_len: int
    namespace: str
    routing_policy: str = "prefix_cost"
    lora: Optional[LoRAConfig] = None


@dataclass(frozen=True)
class FrontEndOptions:
    """Where and how a router replica serves (plain values, picklable).

    Attributes:
        model_dir: Folder with the (first) model's tokenizer (and chat template).
        model_name: The name clients pass as ``model``.
        max_model_len: Longest prompt + output the replicas accept.
        redis_url: The prefix directory (``ListReplicas``, ``/metrics``);
            None serves neither.
        namespace: Directory namespace.
        routing_policy: The replicas' routing policy (the ``policy`` label
            of the router's metrics, served with the replicas' at ``/metrics``).
        router: Ports, drain, migration limit, tool-call parser, input
            limits, TLS and API-key files (``cluster.shared.config.RouterConfig``); files are read in the
            router replica, where they are mounted.
        more_models: The other models of a several-model cluster, after
            the first (which the fields above describe).
        lora: The first model's LoRA settings (``ServedModel``).
    """

    model_dir: str
    model_name: str
    max_model_len: int
    redis_url: Optional[str]
    namespace: str
    routing_policy: str = "prefix_cost"
    router: RouterConfig = field(default_factory=RouterConfig)
    more_models: tuple[ServedModel, ...] = ()
    lora: Optional[LoRAConfig] = None

    @property
    def models(self) -> list[ServedModel]:
        """Every served model, the first (the default) first."""
        first = ServedModel(self.model_dir, self.model_name, self.max_model_len, self.namespace, self.routing_policy,
                            self.lora)
        return [first, *self.more_models]


class RouterDeployment:
    """One router replica: gRPC + HTTP front ends over the replica deployment.

    Args:
        replicas: ``DeploymentHandle`` of the replica deployment, or
            ``{model name: handle}`` of each model's (``options.models``).
        options: Ports, models and directory (``FrontEndOptions``).
    """

    async def __init__(self, replicas: Any, options: FrontEndOptions) -> None:
        from router.limits import Limits
        from router.security import Security
        from router.server import RouterServer

        self.options = options
        cfg = options.router
        limits = Limits.from_kwargs(**cfg.limits)
        security = Security.from_options(
            tls_cert=cfg.tls_cert, tls_key=cfg.tls_key, tls_client_ca=cfg.tls_client_ca,
            api_key_file=cfg.api_key_file, tenants_file=cfg.tenants_file, auth_health=cfg.auth_health,
            auth_metrics=cfg.auth_metrics)
        handles = replicas if isinstance(replicas, dict) else {options.model_name: replicas}
        # Wrong credentials / ACL: this replica fails to start, saying so.
        backend, directory, metrics = await open_models(handles, options.models, options.redis_url, cfg, limits,
                                                        check_access=True)
        if security is not None:
            security.tenant_gate.metrics = metrics.router
        self._backend = backend
        self._grpc: Any = RouterServer(backend, directory, host=cfg.host, port=cfg.grpc_port,
                                       limits=limits, security=security, health_port=cfg.health_port)
        self._http: Any = None
        self._drain: Any = None
        await self._grpc.start()
        if cfg.http_port is not None:
            from router.openai import serve_openai

            try:
                self._http = await serve_openai(backend, host=cfg.host, port=cfg.http_port,
                                                metrics=metrics,
                                                limits=limits, security=security)
            except BaseException:
                await self._grpc.stop(0)
                raise
        if cfg.admin_socket:
            from router.drain import DrainControl

            self._drain = DrainControl(cfg.admin_socket, self.drain)
            try:
                await self._drain.start()
            except BaseException:
                await asyncio.gather(*(f.stop(0) for f in (self._grpc, self._http) if f is not None))
                raise
        logger.info("router replica serving gRPC on %s%s", self._grpc.address,
                    f", HTTP on {self._http.url}" if self._http is not None else "")

    async def addresses(self) -> dict[str, Optional[str]]:
        """The bound front ends: ``{"grpc": "host:port", "http": "http://host:port"}``."""
        return {"grpc": self._grpc.address, "http": self._http.url if self._http is not None else None}

    async def drain(self, timeout_s: float) -> int:
        """NOT_SERVING, new requests refused, running streams get ``timeout_s``;
        returns the streams still running (``router/drain.py``)."""
        if self._grpc is not None:
            await self._grpc.not_serving()
        left = await self._backend.drain(timeout_s)
        logger.info("router drained: %d streams still running", left)
        return left

    async def check_health(self) -> None:
        """Serve's health check: fails once a front end has stopped."""
        if self._grpc is None or not self._grpc.serving:
            raise RuntimeError("the gRPC router is not serving")
        if self._http is not None and not self._http.running:
            raise RuntimeError("the OpenAI HTTP server exited")

    async def __del__(self) -> None:
        """Serve's shutdown hook: NOT_SERVING, then in-flight streams get ``router.drain_timeout_s``."""
        drain, self._drain = getattr(self, "_drain", None), None
        if drain is not None:
            await drain.stop()
        http, self._http = getattr(self, "_http", None), None
        grpc_server, self._grpc = getattr(self, "_grpc", None), None
        grace = self.options.router.drain_timeout_s
        await asyncio.gather(*(front.stop(grace) for front in (http, grpc_server) if front is not None),
                             return_exceptions=True)


async def open_models(handles: dict[str, Any], models: list[ServedModel], redis_url: Optional[str],
                      router: RouterConfig, limits: Any, check_access: bool = False) -> tuple[Any, Any, Any]:
    """The front ends' view of the served models: ``(ModelBackends, directory,
    /metrics renderer)``, one ``RouterBackend``, directory namespace and
    ``ClusterMetrics`` per model (merged, labelled by model, when several);
    the ``ModelBackends`` carries the ``/v1/responses`` store.
    Call it on the loop that serves the front ends (the async Redis clients
    belong to it).

    Args:
        handles: ``{model name: DeploymentHandle}`` of each model's replicas.
        models: What each model is (tokenizer folder, limits, namespace, policy).
        redis_url: The prefix directory; None: no ``ListReplicas`` and
            ``/metrics`` of the router's own series only.
        router: The router's settings (tool-call parser, migration, transport).
        limits: ``router.limits.Limits`` (the in-flight bound).
        check_access: Fail now when the directory refuses reads (credentials, ACL).
    """
    from pathlib import Path

    from cluster.shared.directory import Directory
    from cluster.shared.ray_local import node_ip
    from router.lora_registry import RuntimeAdapters
    from router.metrics import ClusterMetrics, get_router_metrics
    from router.models import ModelDirectories, ModelMetrics
    from router.presence import ReplicaPresence

    backends, directories, metrics = {}, {}, {}
    for model in models:
        tokenizer = RouterTokenizer.from_model_dir(Path(model.model_dir), tool_call_parser=router.tool_call_parser,
                                                   reasoning_parser=router.reasoning_parser)
        router_metrics = get_router_metrics(model.namespace, model.routing_policy)
        directory = Directory.from_url(redis_url, model.namespace) if redis_url else None
        if directory is not None and check_access:
            await directory.check_read_access()
        runtime = RuntimeAdapters.from_url(redis_url, model.namespace) \
            if model.lora is not None and model.lora.allow_runtime_lora_updating else None
        backends[model.model_name] = RouterBackend(
            handles[model.model_name], tokenizer, ModelInfo(model.model_name, model.max_model_len, model.lora, runtime),
            max_inflight_requests=limits.max_inflight_requests, metrics=router_metrics,
            migration_limit=router.migration_limit, replica_transport=router.replica_transport,
            stall_timeout_s=router.stall_timeout_s, sink_host=node_ip() or "127.0.0.1",
            presence=ReplicaPresence(directory) if directory is not None else None)
        directories[model.model_name] = directory
        metrics[model.model_name] = ClusterMetrics(router_metrics, directory)
    from router.openai.response_store import open_response_store

    front = ModelBackends(backends)
    # Stored /v1/responses: in Redis, shared by every router; without Redis in this router's memory.
    front.response_store = open_response_store(redis_url, models[0].namespace, router.responses_ttl_s,
                                               router.responses_max_record_bytes)
    if len(models) == 1:
        return front, directories[models[0].model_name], metrics[models[0].model_name]
    return front, ModelDirectories(directories), ModelMetrics(metrics)
