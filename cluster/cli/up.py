"""``prefixserve up``: a local cluster (Ray on loopback, redis-server,
replicas, gRPC and OpenAI front ends) from flags and an optional config file,
serving until Ctrl-C or SIGTERM. With ``--address`` (or ``RAY_ADDRESS``) it
deploys onto a Ray cluster that is already running instead (docs/MULTINODE.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from typing import Any

from cluster.cli.flags import add_engine_args, add_router_args, engine_kwargs, limits_from_args, security_from_args

logger = logging.getLogger("prefixserve")

# `up` flags that override a top-level field of the cluster config.
_UP_CLUSTER_FLAGS = ("replicas", "replica_num_cpus", "rank_num_cpus", "redis_url", "redis_data_dir", "namespace",
                     "max_ongoing_requests", "routing_policy", "directory_lookup", "max_replicas_per_node",
                     "prefill_replicas")


def add_up_args(up: argparse.ArgumentParser) -> None:
    """The flags of ``up``: cluster, front ends, engine."""
    from cluster.shared.config import (DIRECTORY_LOOKUPS, REASONING_PARSERS, REPLICA_TRANSPORTS, ROUTING_POLICIES,
                                      TOOL_CALL_PARSERS)

    up.add_argument("--config", default=None, metavar="CLUSTER_YAML",
                    help="cluster config file (the RayService's schema); flags override its values")
    up.add_argument("--address", default=None, metavar="HOST:PORT|auto",
                    help="deploy onto this running Ray cluster (its head's GCS address, or auto) instead of "
                         "starting one; default: $RAY_ADDRESS if set. Stopping deletes only our Serve "
                         "applications; Ray keeps running")
    up.add_argument("--max-replicas-per-node", type=int, default=None,
                    help="most replicas of a model on one Ray node (default: no cap; Serve spreads replicas "
                         "over the nodes with room, best effort)")
    # Defaults None: unset flags keep the --config file's value (or the config default).
    up.add_argument("--replicas", type=int, default=None, help="default: 1")
    up.add_argument("--prefill-replicas", type=int, default=None,
                    help="disaggregated prefill: this many replicas only prefill, the others decode "
                         "(docs/DISAGGREGATION.md; default 0: every replica does both)")
    up.add_argument("--replica-num-cpus", type=float, default=None,
                    help="CPUs reserved per replica (fractional; default 0.5)")
    up.add_argument("--rank-num-cpus", type=float, default=None,
                    help="CPUs reserved per tensor-parallel rank (default 0.5)")
    up.add_argument("--redis-url", default=None, help="use this Redis instead of starting redis-server")
    up.add_argument("--redis-data-dir", default=None, metavar="DIR",
                    help="the started redis-server keeps its keys in DIR (append-only file), so stored responses "
                         "survive its restart (default: nothing on disk)")
    up.add_argument("--namespace", default=None, help="prefix-directory namespace (default 'default')")
    up.add_argument("--max-ongoing-requests", type=int, default=None, help="default: 256")
    up.add_argument("--routing-policy", default=None, choices=list(ROUTING_POLICIES), help="default: prefix_cost")
    up.add_argument("--directory-lookup", default=None, choices=list(DIRECTORY_LOOKUPS),
                    help="index: each router follows the directory into a local index (default); redis: one Lua "
                         "lookup per request")
    up.add_argument("--grpc-port", type=int, default=None,
                    help="port of the gRPC router (0: pick a free one; default 50051)")
    up.add_argument("--grpc-host", default=None, help="interface the gRPC and HTTP routers bind (default 127.0.0.1)")
    up.add_argument("--http-port", type=int, default=None,
                    help="port of the OpenAI-compatible HTTP API (0: pick a free one; -1: none; default 8000)")
    up.add_argument("--migration-limit", type=int, default=None,
                    help="most times a stream moves to another replica when its replica dies (default 3)")
    up.add_argument("--stall-timeout-s", type=float, default=None,
                    help="seconds a replica may send nothing after a stream's first chunk before the stream "
                         "migrates as from a dead replica (default 20; 0: never)")
    up.add_argument("--replica-transport", choices=list(REPLICA_TRANSPORTS), default=None,
                    help="how the routers stream from replicas: direct (default: a Serve call per request, the "
                         "tokens sent by the replica's engine thread to the router's sink), grpc (Serve's stream, "
                         "a message per token) or actor (Ray actor tasks, where only Ray's ports are open)")
    up.add_argument("--tool-call-parser", choices=list(TOOL_CALL_PARSERS), default=None,
                    help="how the routers read tool calls out of the output: auto (default) picks llama3_json "
                         "for a Llama 3.x chat template, else hermes (<tool_call> blocks)")
    up.add_argument("--reasoning-parser", choices=list(REASONING_PARSERS), default=None,
                    help="split <think>...</think> from the answer as reasoning: qwen3, deepseek_r1, auto (from the "
                         "chat template) or none (default: all content)")
    up.add_argument("--drain-timeout-s", type=float, default=None,
                    help="on SIGTERM, seconds running streams get to finish (default 30)")
    up.add_argument("--prompt", default=None, help="send one prompt through the cluster once it is up")
    up.add_argument("--max-tokens", type=int, default=64, help="for --prompt")
    up.add_argument("--exit-after-prompt", action="store_true", help="stop after --prompt instead of serving")
    add_router_args(up)
    up.add_argument("--model", action="append", default=None, metavar="MODEL",
                    help="model folder or .gguf file (default: the packaged model); repeat it to serve several "
                         "models in one cluster, each named by its folder or file name, with the engine and "
                         "replica flags applied to each (or list them under models: in --config)")
    add_engine_args(up, exclude=("model",))


def run_up(args: argparse.Namespace) -> int:
    """Starts the cluster, optionally streams ``--prompt``, serves until a signal, stops everything."""
    import asyncio
    import os
    import signal
    import threading

    from cluster.launch.local import LocalCluster

    config = up_config(args)
    stop = threading.Event()

    def on_signal(*_: object) -> None:
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    cluster = LocalCluster(config, grpc_port=config.router.grpc_port, grpc_host=config.router.host,
                           http_port=config.router.http_port,
                           limits=limits_from_args(args, config.router.limits),
                           security=security_from_args(args, config.router),
                           ray_address=args.address or os.environ.get("RAY_ADDRESS") or None)
    try:
        cluster.start()
        # ray.init installs its own SIGTERM handler (it aborts): take it back.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_signal)
        rss_mib, count = _tree_rss_mib()
        logger.info("ready: gRPC on %s, OpenAI HTTP on %s, start-up %.1fs, %d processes, RSS %.0f MiB; "
                    "Ctrl-C or SIGTERM stops", cluster.grpc_address, cluster.http_url, cluster.startup_seconds,
                    count, rss_mib)
        if args.prompt:
            asyncio.run(_stream_prompt(cluster, args.prompt, args.max_tokens))
        if not args.exit_after_prompt:
            stop.wait()
    finally:
        cluster.stop()
    return 0


def up_config(args: argparse.Namespace) -> Any:
    """The ``ClusterConfig`` of ``up``: the ``--config`` file (or the
    defaults), then every flag given on the command line on top of it.

    Raises:
        ValueError: The file or a flag is invalid (names the key).
    """
    from cluster.shared.config import ClusterConfig, EngineConfig

    base = ClusterConfig.from_yaml(args.config) if args.config else ClusterConfig()
    top = {name: getattr(args, name) for name in _UP_CLUSTER_FLAGS if getattr(args, name) is not None}
    router = {}
    if args.grpc_port is not None:
        router["grpc_port"] = args.grpc_port
    if args.grpc_host is not None:
        router["host"] = args.grpc_host
    if args.http_port is not None:
        router["http_port"] = None if args.http_port < 0 else args.http_port
    if args.stall_timeout_s is not None:
        router["stall_timeout_s"] = args.stall_timeout_s if args.stall_timeout_s > 0 else None
    for name in ("migration_limit", "drain_timeout_s", "replica_transport", "tool_call_parser",
                 "reasoning_parser"):
        if getattr(args, name) is not None:
            router[name] = getattr(args, name)
    router_config = dataclasses.replace(base.router, **router)
    flags = {k: v for k, v in engine_kwargs(args).items() if k != "model"}
    models = args.model or []
    if len(models) > 1 or base.multi_model:
        return _models_config(base, models, top, flags, router_config)
    if models:
        flags["model"] = models[0]
    engine = base.engine
    if flags:
        engine = EngineConfig.from_kwargs(**{**base.engine.flat(), **flags})
    return dataclasses.replace(base, **top, engine=engine, router=router_config)


def _models_config(base: Any, models: list[str], top: dict[str, Any], flags: dict[str, Any], router: Any) -> Any:
    """A several-model config: ``--model`` given more than once (each an entry with
    the top-level and engine flags), or the ``--config`` file's ``models:`` with the
    flags applied to every entry."""
    from cluster.shared.config import ClusterConfig, EngineConfig, ModelConfig
    from cluster.shared.config.models import SERVING_FIELDS

    shared = {k: v for k, v in top.items() if k in ("redis_url", "redis_data_dir", "namespace")}
    per_model = {k: v for k, v in top.items() if k not in shared}
    if base.multi_model and models:
        raise ValueError("the --config file lists models: already; add the models there, not with --model")
    if base.multi_model:
        entries = [dataclasses.replace(m, **per_model, engine=EngineConfig.from_kwargs(**{**m.engine.flat(), **flags}))
                   for m in base.models]
    else:
        entries = [ModelConfig(**{**{f: getattr(base, f) for f in SERVING_FIELDS if f != "engine"}, **per_model},
                               engine=EngineConfig.from_kwargs(**{**base.engine.flat(), **flags, "model": m}))
                   for m in models]
    return ClusterConfig(**{**{f: getattr(base, f) for f in ("redis_url", "redis_data_dir", "namespace")}, **shared},
                         router=router, models=entries)


async def _stream_prompt(cluster: Any, prompt: str, max_tokens: int) -> None:
    from tokenizers import Tokenizer

    from cluster.shared.types import GenerationRequest, SamplingParams
    from workers.model.loader import resolve_model

    first = next(iter(cluster.config.models_by_name().values()))  # the default model
    model_dir = resolve_model(first.engine.model)
    if not (model_dir / "tokenizer.json").is_file():
        raise ValueError(f"{model_dir} has no tokenizer.json: --prompt needs one")
    ids = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(prompt).ids
    request = GenerationRequest("cli-prompt", ids, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    async for chunk in cluster.generate(request):
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        if chunk.finished:
            sys.stdout.write("\n")
            logger.info("replica=%s finish_reason=%s cached_prompt_tokens=%d",
                        chunk.replica_id, chunk.finish_reason.value, chunk.cached_prompt_tokens)


def _tree_rss_mib() -> tuple[float, int]:
    """RSS of this process and all its descendants (Ray, Redis, replicas)."""
    import psutil

    me = psutil.Process()
    procs = [me] + me.children(recursive=True)
    total = 0
    for proc in procs:
        try:
            total += proc.memory_info().rss
        except psutil.Error:
            pass
    return total / 2**20, len(procs)
