"""Builds the Ray Serve application: the replica deployment (one engine and
its tensor-parallel group per replica).

With ``tensor_parallel_size = N > 1`` each replica asks Serve for a placement
group of ``1 + N`` bundles packed on one node (STRICT_PACK): bundle 0 holds
the replica actor (engine, scheduler), bundles 1..N the rank actors it
creates inside that group.
"""

from __future__ import annotations

from typing import Any

from cluster.config import ClusterConfig

REPLICA_DEPLOYMENT = "replica"
APP_NAME = "prefixserve"


def replica_options(config: ClusterConfig) -> dict[str, Any]:
    """Serve deployment options of the replica deployment."""
    tp = config.engine.parallel.tensor_parallel_size
    options: dict[str, Any] = {
        "name": REPLICA_DEPLOYMENT,
        "num_replicas": config.replicas,
        "max_ongoing_requests": config.max_ongoing_requests,
        "ray_actor_options": {"num_cpus": config.replica_num_cpus},
        # Loading the model takes seconds; let Serve wait for it.
        "health_check_period_s": 5,
        "health_check_timeout_s": 60,
        "graceful_shutdown_timeout_s": 30,
    }
    options["request_router_config"] = request_router_config(config)
    if tp > 1:
        options["placement_group_bundles"] = [{"CPU": config.replica_num_cpus}] + [
            {"CPU": config.rank_num_cpus} for _ in range(tp)
        ]
        options["placement_group_strategy"] = "STRICT_PACK"
    return options


def request_router_config(config: ClusterConfig) -> Any:
    """Serve's request router: our prefix-aware router with the policy."""
    from ray.serve.config import RequestRouterConfig

    from router.serve_router import PrefixAwareRequestRouter
    from workers.model.loader import model_fingerprint, resolve_model

    return RequestRouterConfig(
        request_router_class=PrefixAwareRequestRouter,
        request_router_kwargs={
            "redis_url": config.redis_url,
            "namespace": config.namespace,
            "policy": config.routing_policy,
            "block_size": config.engine.cache.block_size,
            "model_fingerprint": model_fingerprint(resolve_model(config.engine.model)),
        },
        # Load figures for the policy; the router also counts its own in-flight requests.
        request_routing_stats_period_s=1.0,
        request_routing_stats_timeout_s=5.0,
    )


def build_app(config: ClusterConfig) -> Any:
    """The bound Serve application (``serve.run`` it)."""
    from ray import serve

    from workers.replica import ReplicaServer

    deployment = serve.deployment(ReplicaServer).options(**replica_options(config))
    return deployment.bind(config.engine.flat(), config.redis_url, config.namespace)
