"""The cluster around the engines: replicas, the Redis directory, the
routers (gRPC and OpenAI HTTP front ends) and autoscaling.

``ClusterConfig.from_dict`` / ``from_yaml`` read the whole tree (the file of
``prefixserve up --config`` and the RayService's ``serveConfigV2`` args)
strictly, through ``loading.py``.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Union

from cluster.shared.config.engine import EngineConfig
from cluster.shared.config.loading import build_strict, read_yaml_mapping
from cluster.shared.config.models import (SERVING_FIELDS,
                                          AutoscalingConfig, ModelConfig, check_serving_fields, deployment_suffix)
from cluster.shared.fingerprint import served_model_name

REPLICA_TRANSPORTS = ("direct", "grpc", "actor")
# Output formats of tool calls (router/tools: "auto" reads the chat template); vLLM's flag values.
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json")
# How reasoning (<think>...</think>) is split from content (router/reasoning.py); vLLM's flag values.
REASONING_PARSERS = ("none", "auto", "qwen3", "deepseek_r1")


@dataclass(frozen=True)
class RouterConfig:
    """The front ends (gRPC + OpenAI-compatible HTTP) and their Serve deployment.

    Attributes:
        host: Interface the routers bind; ``127.0.0.1`` locally, ``0.0.0.0``
            in a pod.
        grpc_port: Port of ``prefixserve.v1.Generation`` (fixed per node).
        http_port: Port of the OpenAI-compatible HTTP API; ``None`` serves none.
        health_port: Port of a plaintext, key-free ``grpc.health.v1`` (only
            that service), for Kubernetes' gRPC probes when the gRPC port
            speaks TLS; ``None`` serves none.
        num_routers: Router deployment replicas in a Serve application (at
            most one per node, so each node's fixed ports are bound once).
        router_num_cpus: CPUs reserved per router replica.
        router_resources: Custom Ray resources each router replica asks for,
            e.g. ``{prefixserve_router: 1}`` to place routers on the pods that
            advertise that resource (and that the gRPC / HTTP Services select).
        migration_limit: Most times one request's stream moves to another
            replica because its replica died (``router/migration.py``);
            past it the request fails with UNAVAILABLE.
        stall_timeout_s: Seconds a stream's replica may send nothing, after
            the stream's first chunk, before the router takes it for dead:
            it cancels the call and migrates the stream like a dead
            replica's (``router/migration.py``). Queueing and prefill before
            the first chunk never count, however long the prompt. None
            disables it (a stalled node's streams then end at their deadline).
        replica_transport: How a router's Serve handle talks to the replicas:
            ``direct`` (default) makes one unary Serve call per request and
            the replica's engine thread sends the tokens to the router over
            a TCP connection of its own, one frame per step for all of that
            router's streams (``workers/engine/direct_stream.py``; Serve still
            routes, admits, cancels and reports deaths); ``grpc`` streams
            each token over Serve's gRPC channel to the replica
            (``_by_reference=False``; ~40% less router CPU per request than
            actor tasks, ``prefixserve bench router``); ``actor`` uses Ray
            actor tasks and object refs, for networks that let only Ray's
            own ports through between pods.
        tool_call_parser: How the routers read tool calls out of the model's
            output (``router/tools``, vLLM's ``--tool-call-parser``): ``auto``
            (default) picks ``llama3_json`` for a Llama 3.x chat template and
            ``hermes`` (``<tool_call>`` blocks) for every other; ``hermes`` or
            ``llama3_json`` force one.
        reasoning_parser: How the routers split a reasoning model's
            ``<think>…</think>`` from its answer (``router/reasoning.py``,
            vLLM's ``--reasoning-parser``): ``none`` (default) leaves it in
            the content; ``qwen3`` (reasoning only inside a leading think
            block) or ``deepseek_r1`` (the output starts in reasoning until
            ``</think>``) return it as ``reasoning`` / ``reasoning_content``
            (chat), ``reasoning`` output items (Responses) and the gRPC
            ``reasoning`` field; ``auto`` picks one from the chat template,
            none when it shows no think block.
        drain_timeout_s: On shutdown (SIGTERM), seconds running streams get
            to finish after the routers stop accepting requests.
        admin_socket: Unix socket on which a router replica accepts a drain
            request (``prefixserve router-drain``, a pod's preStop hook;
            ``router/drain.py``); None opens none.
        limits: Input limits and the in-flight bound of each router, by the
            names of ``router.limits.Limits`` (``max_prompt_tokens``,
            ``max_output_tokens``, ``max_request_bytes``, ``max_messages``,
            ``max_stop_strings``, ``max_stop_string_chars``,
            ``max_stop_token_ids``, ``max_logprobs``,
            ``max_inflight_requests``); unknown names are errors.
        tls_cert: PEM certificate: serve gRPC and HTTP over TLS (with ``tls_key``).
        tls_key: PEM private key of ``tls_cert``.
        tls_client_ca: PEM CA: require client certificates it signed (mTLS).
        api_key_file: File with one accepted bearer token per line (a
            mounted Secret); unset: no authentication.
        redis_url: The routers' own URL of the prefix directory, for a
            read-only Redis ACL user (``cluster/shared/directory/acl.py``);
            None: the cluster's ``redis_url``. ``env:NAME`` reads it from a
            variable.
        tenants_file: YAML file binding keys to tenants (cache namespace,
            priority cap, rate / stream / token limits; ``router/tenants.py``),
            a mounted Secret; usable with or without ``api_key_file``.
        auth_health: Require a token for health checks too.
        auth_metrics: Require a token for ``GET /metrics`` too.
        responses_ttl_s: Seconds a stored ``/v1/responses`` response (and its
            input items) lives after its last write, in Redis or a router's
            memory (``router/openai/response_store.py``); 7 days by default.
        responses_max_record_bytes: Largest stored response with its input
            and conversation (its JSON); a larger one is a 400 that says the
            size (``store: false`` still answers). 8 MiB by default.
    """

    host: str = "127.0.0.1"
    grpc_port: int = 50051
    http_port: Optional[int] = 8000
    health_port: Optional[int] = None
    num_routers: int = 1
    router_num_cpus: float = 0.5
    router_resources: dict = field(default_factory=dict)
    migration_limit: int = 3
    stall_timeout_s: Optional[float] = 20.0
    replica_transport: str = "direct"
    tool_call_parser: str = "auto"
    reasoning_parser: str = "none"
    drain_timeout_s: float = 30.0
    admin_socket: Optional[str] = None
    redis_url: Optional[str] = None
    limits: dict = field(default_factory=dict)
    tls_cert: Optional[str] = None
    tls_key: Optional[str] = None
    tls_client_ca: Optional[str] = None
    api_key_file: Optional[str] = None
    tenants_file: Optional[str] = None
    auth_health: bool = False
    auth_metrics: bool = False
    responses_ttl_s: float = 7 * 24 * 3600.0
    responses_max_record_bytes: int = 8 * 2**20

    def __post_init__(self) -> None:
        if self.responses_ttl_s <= 0 or self.responses_max_record_bytes <= 0:
            raise ValueError(f"responses_ttl_s and responses_max_record_bytes must be > 0, got "
                             f"{self.responses_ttl_s} and {self.responses_max_record_bytes}")
        for name in ("grpc_port", "http_port", "health_port"):
            port = getattr(self, name)
            if port is not None and not 0 <= port <= 65535:
                raise ValueError(f"{name} must be a port in 0..65535, got {port}")
        fixed = [p for p in (self.grpc_port, self.http_port, self.health_port) if p]
        if len(fixed) != len(set(fixed)):
            raise ValueError(f"grpc_port, http_port and health_port must differ, got {self.grpc_port}, "
                             f"{self.http_port} and {self.health_port}")
        if self.num_routers < 1:
            raise ValueError(f"num_routers must be >= 1, got {self.num_routers}")
        if self.router_num_cpus <= 0:
            raise ValueError(f"router_num_cpus must be > 0, got {self.router_num_cpus}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("router TLS needs both tls_cert and tls_key")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("router tls_client_ca (mTLS) needs tls_cert and tls_key too")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if self.migration_limit < 0:
            raise ValueError(f"migration_limit must be >= 0, got {self.migration_limit}")
        if self.stall_timeout_s is not None and self.stall_timeout_s <= 0:
            raise ValueError(f"stall_timeout_s must be > 0 (or null to disable), got {self.stall_timeout_s}")
        if self.replica_transport not in REPLICA_TRANSPORTS:
            raise ValueError(f"replica_transport must be one of {', '.join(REPLICA_TRANSPORTS)}, "
                             f"got {self.replica_transport!r}")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                             f"got {self.tool_call_parser!r}")
        if self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, "
                             f"got {self.reasoning_parser!r}")


@dataclass(frozen=True)
class ClusterConfig:
    """A local or KubeRay cluster: replicas of one model (or of each of ``models``), and the directory.

    Attributes:
        replicas: Serve replicas (each owns one engine and its TP group).
        replica_num_cpus: CPUs reserved per replica actor; fractional so
            several fit on a small machine.
        rank_num_cpus: CPUs reserved per tensor-parallel rank actor.
        redis_url: The prefix directory; None lets the local launcher start
            a ``redis-server`` on a loopback port.
        redis_data_dir: A folder where the local launcher's ``redis-server``
            keeps its keys (an append-only file, fsync every second), so
            stored Responses API responses survive its restart and the next
            ``prefixserve up`` with the same folder; None (default): nothing
            on disk. Only without ``redis_url`` (persist an external Redis
            in its own config).
        namespace: Directory namespace (one per model / cluster).
        max_ongoing_requests: Serve's cap of concurrent requests per replica.
        routing_policy: ``prefix_cost`` (default), ``cache_aware``,
            ``least_load``, ``power_of_two`` or ``round_robin``
            (``router/policies/``).
        routing_policy_params: The policy's thresholds by name, e.g.
            ``{balance_abs_threshold: 16}`` for ``cache_aware`` (each
            policy file's header lists them with their defaults); unknown
            names are errors. ``prefix_cost`` prices KV fetches between
            replicas where ``replica_num_cpus`` >= 1 unless
            ``fetch_bytes_per_s`` is set (``router/policies/kv_fetch.py``).
        directory_lookup: ``index`` (default): each router follows the
            prefix directory into a local index and decides without a Redis
            call; ``redis``: one Lua lookup per request (docs/DIRECTORY.md).
        engine: The engine of every replica.
        router: The gRPC / HTTP front ends.
        autoscaling: ``None`` keeps ``replicas`` replicas; set, Serve scales
            between its ``min_replicas`` and ``max_replicas`` with the
            KV-aware policy, starting from ``replicas``.
        models: Several models in one cluster (``ModelConfig``, in
            ``models.py``): each entry has its own engine, replicas,
            autoscaling, routing policy and directory namespace, and the
            routers route by the request's ``model``; the first is the
            default for requests that name none. Set, the per-model fields
            above stay unset (an error says which to move).
        max_replicas_per_node: Most replicas on one Ray node (Serve's
            ``max_replicas_per_node``; a hard cap, so a cluster needs that
            many nodes with room). ``None`` (default): no cap; Serve
            schedules replicas with Ray's SPREAD strategy, so they land on
            different nodes where there is room (best effort).
        prefill_replicas: Disaggregated prefill (docs/DISAGGREGATION.md):
            the replicas of Serve rank below it are ``prefill`` replicas
            (SGLang's ``--disaggregation-mode prefill``, vLLM's
            ``kv_producer``), the others ``decode`` (``kv_consumer``); a
            request is prefilled on one, its KV pulled by the other, which
            decodes. 0 (default): every replica does both (``kv_both``).

    ``from_dict`` / ``from_yaml`` read the same tree from a mapping or a YAML
    file (``prefixserve up --config``, the RayService's ``serveConfigV2``);
    ``to_dict`` writes it back.
    """

    replicas: int = 1
    replica_num_cpus: float = 0.5
    rank_num_cpus: float = 0.5
    redis_url: Optional[str] = None
    redis_data_dir: Optional[str] = None
    namespace: str = "default"
    max_ongoing_requests: int = 256
    routing_policy: str = "prefix_cost"
    routing_policy_params: dict = field(default_factory=dict)
    directory_lookup: str = "index"
    engine: EngineConfig = field(default_factory=EngineConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    autoscaling: Optional[AutoscalingConfig] = None
    models: list[ModelConfig] = field(default_factory=list)
    max_replicas_per_node: Optional[int] = None
    prefill_replicas: int = 0

    def __post_init__(self) -> None:
        check_serving_fields(self)
        if self.redis_data_dir is not None and self.redis_url is not None:
            raise ValueError("redis_data_dir is the folder of the redis-server the launcher starts, but redis_url "
                             "names another Redis: drop one of them (persist an external Redis in its own config)")
        models = [build_strict(ModelConfig, m, f"models[{i}]") if isinstance(m, Mapping) else m
                  for i, m in enumerate(self.models)]
        object.__setattr__(self, "models", models)
        if not models:
            return
        defaults = ClusterConfig()
        for name in SERVING_FIELDS:
            if getattr(self, name) != getattr(defaults, name):
                raise ValueError(f"{name} is set at the top level but models: is set too: with a list of "
                                 f"models, set {name} in each entry (models[i].{name})")
        for i, model in enumerate(models):
            if not isinstance(model, ModelConfig):
                raise ValueError(f"models[{i}] must be a mapping of a model's fields, got {type(model).__name__}")
        names = [m.served_name for m in models]
        for name in names:
            if names.count(name) > 1:
                raise ValueError(f"two models are named {name!r}: give each entry of models: its own name "
                                 "(what clients pass as model)")
        suffixes = [deployment_suffix(n) for n in names]
        for name, suffix in zip(names, suffixes):
            if suffixes.count(suffix) > 1:
                raise ValueError(f"model names {sorted(n for n, s in zip(names, suffixes) if s == suffix)} map "
                                 f"to one deployment name ({suffix!r}): rename one")
        spaces = [m.namespace or f"{self.namespace}.{n}" for m, n in zip(models, names)]
        for space in spaces:
            if spaces.count(space) > 1:
                raise ValueError(f"two models share the directory namespace {space!r}: each model needs its "
                                 "own (leave namespace out for <cluster namespace>.<name>)")

    @property
    def max_num_replicas(self) -> int:
        """Most replicas of every model together (for sizing local Ray)."""
        return sum(c.max_model_replicas for c in self.models_by_name().values())

    @property
    def max_model_replicas(self) -> int:
        """Most replicas this (single-model) config's deployment can have."""
        return self.autoscaling.max_replicas if self.autoscaling is not None else self.replicas

    @property
    def multi_model(self) -> bool:
        """Whether ``models:`` lists the served models (each its own deployment)."""
        return bool(self.models)

    def models_by_name(self) -> dict[str, "ClusterConfig"]:
        """``{served name: single-model ClusterConfig}`` in the order given.

        Without ``models:`` it is this config under its engine's name; with
        it, each entry becomes a config of its own (its per-model fields, its
        namespace, the shared ``redis_url`` and ``router``), which the
        builders of one model's deployment take.
        """
        if not self.models:
            return {served_model_name(self.engine.model): self}
        out: dict[str, ClusterConfig] = {}
        for model in self.models:
            name = model.served_name
            fields = {f: getattr(model, f) for f in SERVING_FIELDS}
            out[name] = ClusterConfig(redis_url=self.redis_url, router=self.router,
                                      namespace=model.namespace or f"{self.namespace}.{name}", **fields)
        return out

    @classmethod
    def from_dict(cls, mapping: Mapping[str, Any]) -> "ClusterConfig":
        """Builds the tree from a nested mapping (a parsed YAML file).

        Every level is checked strictly: an unknown or misspelled key, or a
        value of the wrong type, is an error naming its full key path (e.g.
        ``engine.cache.blok_size``) and the closest known key. Under
        ``engine:`` the knobs of its sections may be given nested
        (``cache: {block_size: 16}``) or flat as vLLM names them
        (``block_size: 16``), not both for one knob. ``redis_url: env:NAME``
        (and ``router.redis_url``) stays as written: each process reads
        variable ``NAME`` when it connects (``Directory.from_url``), so a
        password kept in a Kubernetes Secret stays out of the manifest and
        reaches only the pods given that variable.

        Raises:
            ValueError: Says which key to change and how.
        """
        return build_strict(cls, mapping)

    @property
    def router_redis_url(self) -> Optional[str]:
        """The URL routers read the directory with (``router.redis_url`` or ``redis_url``)."""
        return self.router.redis_url or self.redis_url

    @classmethod
    def from_yaml(cls, path: Union[str, "os.PathLike[str]"]) -> "ClusterConfig":
        """Reads ``from_dict``'s schema from a YAML file.

        Raises:
            ValueError: Unreadable file, not a mapping, or an invalid config
                (the message names the file and the key).
        """
        data = read_yaml_mapping(path)
        try:
            return cls.from_dict(data)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from exc

    def to_dict(self) -> dict[str, Any]:
        """The nested mapping ``from_dict`` reads back (plain YAML/JSON values)."""
        return dataclasses.asdict(self)
