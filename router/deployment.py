"""The router as a Ray Serve deployment, for clusters that Serve manages
(KubeRay's RayService): each router replica runs the gRPC front end
(``router.server.RouterServer``) and the OpenAI-compatible HTTP API
(``router.openai``) on the fixed ports of its node.

    replicas = serve.deployment(ReplicaServer).bind(...)
    router = serve.deployment(RouterDeployment).options(
        num_replicas=2, max_replicas_per_node=1).bind(replicas, front)

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

from cluster.shared.config import RouterConfig
from router.backend import ModelInfo, RouterBackend
from router.tokenizer import RouterTokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FrontEndOptions:
    """Where and how a router replica serves (plain values, picklable).

    Attributes:
        model_dir: Folder with the model's tokenizer (and chat template).
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
    """

    model_dir: str
    model_name: str
    max_model_len: int
    redis_url: Optional[str]
    namespace: str
    routing_policy: str = "prefix_cost"
    router: RouterConfig = field(default_factory=RouterConfig)


class RouterDeployment:
    """One router replica: gRPC + HTTP front ends over the replica deployment.

    Args:
        replicas: ``DeploymentHandle`` of the replica deployment.
        options: Ports, model and directory (``FrontEndOptions``).
    """

    async def __init__(self, replicas: Any, options: FrontEndOptions) -> None:
        from pathlib import Path

        from cluster.shared.directory import Directory
        from router.limits import Limits
        from router.metrics import ClusterMetrics, get_router_metrics
        from router.security import Security
        from router.server import RouterServer

        self.options = options
        cfg = options.router
        limits = Limits.from_kwargs(**cfg.limits)
        security = Security.from_options(
            tls_cert=cfg.tls_cert, tls_key=cfg.tls_key, tls_client_ca=cfg.tls_client_ca,
            api_key_file=cfg.api_key_file, tenants_file=cfg.tenants_file, auth_health=cfg.auth_health,
            auth_metrics=cfg.auth_metrics)
        tokenizer = RouterTokenizer.from_model_dir(Path(options.model_dir), tool_call_parser=cfg.tool_call_parser)
        router_metrics = get_router_metrics(options.namespace, options.routing_policy)
        if security is not None:
            security.tenant_gate.metrics = router_metrics
        backend = RouterBackend(replicas, tokenizer, ModelInfo(options.model_name, options.max_model_len),
                                max_inflight_requests=limits.max_inflight_requests, metrics=router_metrics,
                                migration_limit=cfg.migration_limit, replica_transport=cfg.replica_transport)
        directory = Directory.from_url(options.redis_url, options.namespace) if options.redis_url else None
        if directory is not None:
            await directory.check_read_access()  # wrong credentials / ACL: this replica fails to start, saying so
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
                                                metrics=ClusterMetrics(router_metrics, directory),
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
