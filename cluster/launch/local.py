"""The local launcher behind ``prefixserve up``: Ray on loopback, a
``redis-server`` for the prefix directory, and the Serve application.

Everything listens on 127.0.0.1 (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``
keeps Ray's own traffic there). With ``grpc_port`` set, the gRPC router
(``router.server.RouterServer``) runs in this process on its own thread and
event loop once Serve is up. With several models (``models:``) each model's
replicas run as a Serve application of their own (``app_names``) and the
routers route by the request's ``model``. ``stop()`` shuts the router, Serve, Ray and Redis
down in that order, so no process outlives the launcher.

With ``ray_address`` it joins a Ray cluster that is already running (one
node or several, ``ray start`` or any managed Ray) instead of starting one:
the replicas go wherever Serve places them, a ``redis-server`` (unless
``redis_url`` is given) binds this node's address with a password so every
node reaches it, and ``stop()`` deletes only the Serve applications it
deployed and disconnects: that Ray, its Serve controller and other
applications keep running (``serve.delete`` of ours, never ``serve.shutdown``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from typing import Any, AsyncIterator, Optional

from cluster.app import APP_NAME, REPLICA_DEPLOYMENT, app_names, build_app, model_info
from cluster.shared.config import ClusterConfig
from cluster.shared.types import GenerationRequest, StreamChunk

logger = logging.getLogger(__name__)

# Serve drains replicas (graceful_shutdown_timeout_s 30 s) before it returns.
SERVE_SHUTDOWN_TIMEOUT_S = 60.0


class LocalCluster:
    """Starts and stops a whole cluster on this machine.

    Args:
        config: What to run.
        num_cpus: CPUs Ray may schedule (default: what the machine has, at
            least enough for the replicas' fractional reservations).
        grpc_port: Port of the gRPC router (0 picks a free one); None runs
            no router.
        grpc_host: Interface the routers bind (gRPC and HTTP).
        http_port: Port of the OpenAI-compatible HTTP API (0 picks a free
            one); None runs none.
        limits: Input limits and the router's in-flight bound
            (``router.limits.Limits``; default ``Limits()``).
        security: TLS and API keys of both front ends
            (``router.security.Security``); None: plaintext, no keys.
        ray_address: Join this running Ray cluster (``HOST:PORT`` of its
            GCS, ``auto``, ``ray://...``) instead of starting one.
    """

    def __init__(
        self,
        config: ClusterConfig,
        num_cpus: Optional[float] = None,
        grpc_port: Optional[int] = None,
        grpc_host: str = "127.0.0.1",
        http_port: Optional[int] = None,
        limits: Any = None,
        security: Any = None,
        ray_address: Optional[str] = None,
    ) -> None:
        self.config = config
        self.ray_address = ray_address
        self.node_ip: Optional[str] = None  # this node's address, once Ray is up
        self.limits = limits
        self.security = security
        self.num_cpus = num_cpus
        self.redis = None
        self.redis_url = config.redis_url
        self.handle: Any = None  # the first (default) model's replicas
        self.handles: dict[str, Any] = {}  # {served model name: its replica deployment's handle}
        self.started_ray = False
        self.startup_seconds = 0.0
        self.grpc_port = grpc_port
        self.grpc_host = grpc_host
        self.grpc_address: Optional[str] = None
        self.http_port = http_port
        self.http_url: Optional[str] = None
        self._http: Any = None
        self._router: Any = None
        self._router_loop: Optional[asyncio.AbstractEventLoop] = None
        self._router_thread: Optional[threading.Thread] = None

    def start(self) -> "LocalCluster":
        """Starts Redis (unless a URL was given), Ray and Serve; waits for replicas."""
        import ray
        from ray import serve

        from cluster.shared.ray_local import LOOPBACK, connect_ray, init_local_ray

        began = time.monotonic()
        self.started_ray = not ray.is_initialized() and self.ray_address is None
        if self.ray_address is not None:
            self.node_ip = connect_ray(self.ray_address)
        if self.redis_url is None:
            self._start_redis(self.node_ip or LOOPBACK)
        if self.ray_address is None:
            init_local_ray(num_cpus=self.num_cpus or self._cpus_needed())
            self.node_ip = LOOPBACK
        serve.start(proxy_location="Disabled")
        config = self.config if self.config.redis_url == self.redis_url else _with_redis(self.config, self.redis_url)
        names = app_names(config)
        for model_name, model in config.models_by_name().items():
            app = build_app(model, model_name=model_name, packed_replicas=config.max_num_replicas)
            self.handles[model_name] = serve.run(app, name=names[model_name], route_prefix=None, blocking=False)
        self.handle = next(iter(self.handles.values()))
        for app_name in names.values():
            self._wait_ready(app_name)
        if self.grpc_port is not None or self.http_port is not None:
            self._start_router()
        self.startup_seconds = time.monotonic() - began
        for model_name, model in self.config.models_by_name().items():
            logger.info("cluster ready in %.1fs: model %s, %d replica(s), tensor_parallel_size %d",
                        self.startup_seconds, model_name, model.replicas,
                        model.engine.parallel.tensor_parallel_size)
        return self

    def _start_redis(self, host: str) -> None:
        """A ``redis-server`` on ``host``; one every node can reach (not
        loopback) gets a random password, carried in its URL."""
        import secrets

        from cluster.launch.redis_server import RedisServer

        password = secrets.token_urlsafe(24) if self.ray_address is not None else None
        data_dir = self.config.redis_data_dir
        self.redis = RedisServer(host=host, password=password, data_dir=data_dir).start()
        self.redis_url = self.redis.url
        logger.info("redis-server on %s:%d%s%s", host, self.redis.port, " (password in its URL)" if password else "",
                    f", keys kept in {data_dir}" if data_dir else "")

    def _cpus_needed(self) -> float:
        needed = 0.0
        for model in self.config.models_by_name().values():
            tp = model.engine.parallel.tensor_parallel_size
            per_replica = model.replica_num_cpus + (model.rank_num_cpus * tp if tp > 1 else 0)
            needed += per_replica * model.max_model_replicas
        return max(float(os.cpu_count() or 1), needed)

    def _wait_ready(self, app_name: str = APP_NAME, timeout: float = 600.0) -> None:
        from ray import serve

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = serve.status().applications.get(app_name)
            if status is not None and status.status == "RUNNING":
                return
            if status is not None and status.status in ("DEPLOY_FAILED", "UNHEALTHY"):
                raise RuntimeError(f"the Serve application failed to start: {status.message or status}")
            time.sleep(0.5)
        raise TimeoutError(f"replicas not ready after {timeout:.0f}s")

    def _start_router(self) -> None:
        """Starts the gRPC router on a daemon thread with its own event loop."""
        from router.deployment import ServedModel, open_models
        from router.limits import Limits
        from router.server import RouterServer

        served = []
        for model_name, model in self.config.models_by_name().items():
            model_dir, _, max_len = model_info(model)
            served.append(ServedModel(model_dir, model_name, max_len, model.namespace, model.routing_policy,
                                      model.engine.lora if model.engine.lora.enable_lora else None))
        limits = self.limits or Limits()
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="grpc-router", daemon=True)
        thread.start()
        self._router_loop, self._router_thread = loop, thread

        async def start() -> tuple[Any, Any]:
            server = http = None
            # On this loop: the async Redis clients belong to it (the gRPC server closes them).
            backend, directory, metrics = await open_models(self.handles, served,
                                                            self.config.router.redis_url or self.redis_url,
                                                            self.config.router, limits)
            if self.security is not None:
                self.security.tenant_gate.metrics = metrics.router
            if self.grpc_port is not None:
                server = RouterServer(backend, directory, host=self.grpc_host, port=self.grpc_port,
                                      limits=limits, security=self.security)
                await server.start()
            if self.http_port is not None:
                from router.openai import serve_openai

                http = await serve_openai(backend, host=self.grpc_host, port=self.http_port, metrics=metrics,
                                          limits=limits, security=self.security)
            return server, http

        self._router, self._http = asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=60)
        if self._router is not None:
            self.grpc_address = self._router.address
        if self._http is not None:
            self.http_url = self._http.url

    def _stop_router(self, grace: Optional[float] = None) -> None:
        """Drains both front ends at once: they refuse new requests (gRPC
        health NOT_SERVING first) and running streams get ``grace`` seconds
        (default ``router.drain_timeout_s``) to finish."""
        loop, thread, router, http = self._router_loop, self._router_thread, self._router, self._http
        self._router = self._router_loop = self._router_thread = self._http = None
        if loop is None:
            return
        grace = self.config.router.drain_timeout_s if grace is None else grace

        async def drain() -> None:
            fronts = [(name, front) for name, front in (("HTTP", http), ("gRPC", router)) if front is not None]
            results = await asyncio.gather(*(front.stop(grace) for _, front in fronts), return_exceptions=True)
            for (name, _), result in zip(fronts, results):
                if isinstance(result, BaseException):
                    logger.error("stopping the %s router failed: %r", name, result)

        if http is not None or router is not None:
            logger.info("draining the routers: running streams get up to %.0fs", grace)
        try:
            asyncio.run_coroutine_threadsafe(drain(), loop).result(timeout=grace + 15)
        except Exception:  # noqa: BLE001 - keep tearing down
            logger.exception("draining the routers failed")
        try:  # what still runs there (directory followers, Serve's router tasks) ends before the loop does
            asyncio.run_coroutine_threadsafe(_cancel_other_tasks(), loop).result(timeout=10)
        except Exception:  # noqa: BLE001 - keep tearing down
            logger.warning("tasks on the router loop did not end when cancelled")
        loop.call_soon_threadsafe(loop.stop)
        if thread is not None:
            thread.join(timeout=10)
        if not loop.is_running():
            loop.close()

    async def generate(self, request: GenerationRequest) -> AsyncIterator[StreamChunk]:
        """Streams a request through Serve (the minimal in-process client)."""
        stream = self.handle.options(stream=True, method_name="generate").remote(request)
        try:
            async for chunk in stream:
                yield chunk
        finally:
            stream.cancel()  # a consumer that stops early aborts the request

    def stop(self) -> None:
        """Shuts down the gRPC router, Serve, Ray (if started here) and Redis (if started here).

        On a cluster it joined (``ray_address``) it deletes only its own
        applications and disconnects; Serve and Ray keep running.
        """
        import ray

        self._stop_router()
        if ray.is_initialized() and self.ray_address is not None:
            done = threading.Thread(target=_serve_delete, args=(list(app_names(self.config).values()),),
                                    name="serve-delete", daemon=True)
            done.start()
            done.join(SERVE_SHUTDOWN_TIMEOUT_S)
            if done.is_alive():
                logger.warning("deleting the Serve applications did not finish in %.0fs", SERVE_SHUTDOWN_TIMEOUT_S)
            ray.shutdown()  # the driver's connection only: the cluster stays
        elif ray.is_initialized():
            # Bounded: if Ray's own processes were signalled too (a terminal's
            # process group, `timeout`), the controller may never answer; then
            # ray.shutdown() below ends every Ray process anyway.
            done = threading.Thread(target=_serve_shutdown, name="serve-shutdown", daemon=True)
            done.start()
            done.join(SERVE_SHUTDOWN_TIMEOUT_S)
            if done.is_alive():
                logger.warning("serve.shutdown did not finish in %.0fs; stopping Ray directly",
                               SERVE_SHUTDOWN_TIMEOUT_S)
        if self.started_ray and ray.is_initialized():
            ray.shutdown()
        if self.redis is not None:
            self.redis.stop()
            self.redis = None
        logger.info("cluster stopped")

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _serve_shutdown() -> None:
    from ray import serve

    try:
        serve.shutdown()
    except Exception:  # noqa: BLE001 - keep tearing down
        logger.exception("serve.shutdown failed")


def _serve_delete(names: list[str]) -> None:
    from ray import serve

    for name in names:
        try:
            serve.delete(name)  # waits until its replicas are gone
            logger.info("deleted Serve application %s", name)
        except Exception:  # noqa: BLE001 - keep tearing down
            logger.exception("deleting Serve application %s failed", name)


def _with_redis(config: ClusterConfig, redis_url: Optional[str]) -> ClusterConfig:
    """The config the cluster runs with: the launcher's own Redis named by its URL (its
    ``redis_data_dir`` was the launcher's to use, and the two may not be given together)."""
    import dataclasses

    return dataclasses.replace(config, redis_url=redis_url, redis_data_dir=None)


def stats_of_every_replica(handle: Any, count: int, timeout: float = 60.0) -> dict[str, dict[str, Any]]:
    """``{replica_id: stats()}`` of ``count`` replicas. A Serve call cannot
    pick its replica, so this asks until each one has answered.

    Raises:
        TimeoutError: Fewer than ``count`` replicas answered within ``timeout``.
    """
    seen: dict[str, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout
    while len(seen) < count and time.monotonic() < deadline:
        stats = handle.stats.remote().result(timeout_s=30)
        seen[stats["replica_id"]] = stats
    if len(seen) < count:
        raise TimeoutError(f"only {len(seen)} of {count} replicas answered stats(): {sorted(seen)}")
    return seen


def replica_handle(app_name: str = APP_NAME) -> Any:
    """A handle to the replica deployment of a running application."""
    from ray import serve

    return serve.get_deployment_handle(REPLICA_DEPLOYMENT, app_name=app_name)


async def _cancel_other_tasks() -> None:
    """Cancels every other task of the running loop and waits for them."""
    rest = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in rest:
        task.cancel()
    await asyncio.gather(*rest, return_exceptions=True)
