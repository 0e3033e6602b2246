"""Builds the Ray Serve application: the replica deployment (one engine and
its tensor-parallel group per replica) and, for Serve-managed clusters
(KubeRay), the router deployment in front of it.

    serve.run(build_app(config))                      # replicas only (local: the
                                                      # launcher runs the router)
    serve.run(build_app(config, with_router=True))    # + router replicas

For a RayService's ``serveConfigV2``, ``app_builder`` is the import path
(``cluster.app:app_builder``) and the cluster config travels as its args::

    applications:
      - name: prefixserve
        import_path: cluster.app:app_builder
        args:
          config: {replicas: 2, redis_url: "redis://redis:6379", router: {host: 0.0.0.0}}
        # or: args: {config_path: /etc/prefixserve/cluster.yaml}

With several models (``models:``) each model gets a replica deployment of
its own (``replica-<name>``), with its replica count, autoscaling, routing
policy and directory namespace; the router deployment holds a handle of each
and routes by the request's ``model``. The local launcher runs each model's
replicas as an application of its own (``app_names``).

The router deployment runs at most one replica per node
(``max_replicas_per_node=1``) because it binds the node's fixed gRPC and HTTP
ports; ``router.num_routers`` says how many nodes get one.

With ``tensor_parallel_size = N > 1`` each replica asks Serve for a placement
group of ``1 + N`` bundles packed on one node (STRICT_PACK): bundle 0 holds
the replica actor (engine, scheduler), bundles 1..N the rank actors it
creates inside that group.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from cluster.shared.config import ClusterConfig
from cluster.shared.config.models import deployment_suffix
from cluster.shared.fingerprint import DEFAULT_MODEL_NAME, served_model_name  # noqa: F401 - the first re-exported

logger = logging.getLogger(__name__)

REPLICA_DEPLOYMENT = "replica"
ROUTER_DEPLOYMENT = "router"
APP_NAME = "prefixserve"


def app_names(config: ClusterConfig) -> dict[str, str]:
    """``{served model name: Serve application name}`` of the local launcher:
    ``prefixserve`` for one model, ``prefixserve-<name>`` for each of several."""
    models = config.models_by_name()
    if not config.multi_model:
        return {name: APP_NAME for name in models}
    return {name: f"{APP_NAME}-{deployment_suffix(name)}" for name in models}


def replica_options(config: ClusterConfig, name: str = REPLICA_DEPLOYMENT) -> dict[str, Any]:
    """Serve deployment options of the replica deployment (of one model)."""
    tp = config.engine.parallel.tensor_parallel_size
    options: dict[str, Any] = {
        "name": name,
        "num_replicas": config.replicas,
        "max_ongoing_requests": config.max_ongoing_requests,
        "ray_actor_options": {"num_cpus": config.replica_num_cpus},
        # Loading the model takes seconds; let Serve wait for it.
        "health_check_period_s": 5,
        "health_check_timeout_s": 60,
        "graceful_shutdown_timeout_s": 30,
    }
    options["request_router_config"] = request_router_config(config)
    if config.max_replicas_per_node is not None:  # else Serve's SPREAD: other nodes first, best effort
        options["max_replicas_per_node"] = config.max_replicas_per_node
    if config.autoscaling is not None:
        from cluster.shared.autoscaling import serve_autoscaling_config

        del options["num_replicas"]
        options["autoscaling_config"] = serve_autoscaling_config(config)
    # engine.device "cuda" asks Ray for one GPU per model shard: the replica's
    # own with tp 1, each rank's bundle with tp > 1.
    gpu = {"GPU": 1} if config.engine.device == "cuda" else {}
    if tp > 1:
        options["placement_group_bundles"] = [{"CPU": config.replica_num_cpus}] + [
            {"CPU": config.rank_num_cpus, **gpu} for _ in range(tp)
        ]
        options["placement_group_strategy"] = "STRICT_PACK"
    elif gpu:
        options["ray_actor_options"]["num_gpus"] = 1
    return options


def request_router_config(config: ClusterConfig) -> Any:
    """Serve's request router: our prefix-aware router with the policy."""
    from ray.serve.config import RequestRouterConfig

    from router.policies import get_policy
    from router.serve_router import PrefixAwareRequestRouter
    from cluster.shared.contract import contract_for
    from workers.model.loader import model_fingerprint, resolve_model

    policy_params = routing_params_for(config)
    get_policy(config.routing_policy, **policy_params)  # bad thresholds fail here, named
    model_dir = resolve_model(config.engine.model)
    fingerprint = model_fingerprint(model_dir)
    return RequestRouterConfig(
        request_router_class=PrefixAwareRequestRouter,
        request_router_kwargs={
            "redis_url": config.router_redis_url,  # the request router runs in the router's process
            "namespace": config.namespace,
            "policy": config.routing_policy,
            "policy_params": policy_params,
            "block_size": config.engine.cache.block_size,
            "model_fingerprint": fingerprint,
            # Replicas that declare another contract are refused (router/serve_router.py).
            "cache_contract": contract_for(config.engine.cache.block_size, fingerprint,
                                           config.engine.tokenizer or model_dir),
            # Each router sees about 1/num_routers of a prefix's requests (hot-prefix rates).
            "num_routers": config.router.num_routers,
            "directory_lookup": config.directory_lookup,
            "prefill_replicas": config.prefill_replicas,  # disaggregated prefill (router/policies/disagg.py)
        },
        # Load figures for the policy; the router also counts its own in-flight requests.
        request_routing_stats_period_s=1.0,
        request_routing_stats_timeout_s=5.0,
    )


def routing_params_for(config: ClusterConfig) -> dict[str, Any]:
    """The routing policy's parameters: the configured ones, and for
    ``prefix_cost`` the fetch pricing that suits how the replicas reserve
    CPUs where ``fetch_bytes_per_s`` is not set (``router/policies/kv_fetch.py``)."""
    from router.policies.kv_fetch import default_fetch_bytes_per_s

    params = dict(config.routing_policy_params)
    if config.routing_policy == "prefix_cost" and "fetch_bytes_per_s" not in params:
        params["fetch_bytes_per_s"] = default_fetch_bytes_per_s(config.replica_num_cpus)
        if params["fetch_bytes_per_s"]:
            logger.info("prefix_cost prices KV fetches (fetch_bytes_per_s %.3g): each replica reserves %g CPUs",
                        params["fetch_bytes_per_s"], config.replica_num_cpus)
    return params


def router_options(config: ClusterConfig) -> dict[str, Any]:
    """Serve deployment options of the router deployment."""
    return {
        "name": ROUTER_DEPLOYMENT,
        "num_replicas": config.router.num_routers,
        # Each router binds its node's fixed ports: never two on one node.
        "max_replicas_per_node": 1,
        "ray_actor_options": {"num_cpus": config.router.router_num_cpus,
                              **({"resources": dict(config.router.router_resources)}
                                 if config.router.router_resources else {})},
        "health_check_period_s": 5,
        "health_check_timeout_s": 30,
        # Serve waits this long for __del__ (the drain) before killing the actor.
        "graceful_shutdown_timeout_s": config.router.drain_timeout_s + 10,
    }


def model_info(config: ClusterConfig) -> tuple[str, str, int]:
    """``(model folder, name clients pass as model, max_model_len)`` of the
    served model (of a single-model config: one of ``models_by_name()``)."""
    import json
    from pathlib import Path

    from workers.model.loader import resolve_model

    model_dir = resolve_model(config.engine.model)
    name = served_model_name(config.engine.model)
    if config.engine.max_model_len is not None:
        max_len = config.engine.max_model_len
    else:
        config_file = Path(model_dir) / "config.json"
        hf = json.loads(config_file.read_text()) if config_file.is_file() else {}
        max_len = int(hf.get("max_position_embeddings") or 2048)
    return str(model_dir), name, max_len


def build_app(config: ClusterConfig, with_router: bool = False, model_name: Optional[str] = None,
              packed_replicas: Optional[int] = None) -> Any:
    """The bound Serve application (``serve.run`` it).

    Args:
        config: The cluster.
        with_router: Put the router deployment (gRPC + HTTP front ends on
            ``config.router``'s ports) in front of the replicas as ingress;
            required with several models (without it, build one app per
            model from ``config.models_by_name()``).
        model_name: The ``model`` label of the replicas' metrics (default:
            the model's served name).
        packed_replicas: Most replicas of every model on one machine
            (default: this config's).
    """
    from ray import serve

    from workers.replica import ReplicaServer

    if config.multi_model and not with_router:
        raise ValueError("a config with models: builds one application per model without the router: "
                         "build_app(c) for c in config.models_by_name().values()")
    packed = packed_replicas or config.max_num_replicas
    models = config.models_by_name()
    replicas: dict[str, Any] = {}
    for name, model in models.items():
        deployment_name = f"{REPLICA_DEPLOYMENT}-{deployment_suffix(name)}" if config.multi_model \
            else REPLICA_DEPLOYMENT
        deployment = serve.deployment(ReplicaServer).options(**replica_options(model, deployment_name))
        replicas[name] = deployment.bind(model.engine.flat(), model.redis_url, model.namespace, freeze_heap=True,
                                         packed_replicas=packed, model_name=model_name or name)
    if not with_router:
        return next(iter(replicas.values()))
    from router.deployment import FrontEndOptions, RouterDeployment, ServedModel
    from router.limits import Limits

    Limits.from_kwargs(**config.router.limits)  # a misspelled limit fails here, not in each router replica
    served = []
    for name, model in models.items():
        model_dir, _, max_len = model_info(model)
        served.append(ServedModel(model_dir, name, max_len, model.namespace, model.routing_policy,
                                  model.engine.lora if model.engine.lora.enable_lora else None))
    first = served[0]
    front = FrontEndOptions(model_dir=first.model_dir, model_name=first.model_name,
                            max_model_len=first.max_model_len, redis_url=config.router_redis_url,
                            namespace=first.namespace, routing_policy=first.routing_policy, router=config.router,
                            more_models=tuple(served[1:]), lora=first.lora)
    handles = replicas if config.multi_model else replicas[first.model_name]
    return serve.deployment(RouterDeployment).options(**router_options(config)).bind(handles, front)


def app_builder(args: dict[str, Any]) -> Any:
    """Serve application builder for ``serveConfigV2`` (``cluster.app:app_builder``).

    Args:
        args: ``{"config": <cluster config mapping>}`` or
            ``{"config_path": <YAML file>}`` (the schema of ``prefixserve up
            --config``); replicas and the router deployment are built.

    Raises:
        ValueError: Neither or both keys given, another key, or an invalid config.
    """
    args = dict(args or {})
    unknown = sorted(set(args) - {"config", "config_path"})
    if unknown or ("config" in args) == ("config_path" in args):
        raise ValueError(
            "app_builder args must hold exactly one of 'config' (a cluster config mapping) or "
            f"'config_path' (a YAML file); got keys {sorted(args)}"
        )
    if "config_path" in args:
        config = ClusterConfig.from_yaml(args["config_path"])
    else:
        config = ClusterConfig.from_dict(args["config"])
    if config.redis_url is None:
        raise ValueError("a Serve-managed cluster needs redis_url (the prefix directory); set it in the config")
    return build_app(config, with_router=True)
