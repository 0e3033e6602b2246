"""The frozen configuration tree, read once at the entry points.

Knob names follow vLLM (block_size, max_num_seqs, max_num_batched_tokens,
enable_chunked_prefill, enable_prefix_caching, swap_space, preemption_mode,
tensor_parallel_size, enforce_eager, dtype, seed) so users find what they
know. Leaves of the program receive plain values, never this tree.

``EngineConfig.from_kwargs`` takes the flat keyword arguments users pass to
``LLM(...)`` or the CLI and rejects unknown keys by name;
``ClusterConfig.from_dict`` / ``from_yaml`` read the whole tree (the file of
``prefixserve up --config`` and the RayService's ``serveConfigV2`` args) and
reject unknown keys at any level by their full path.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Union

PREEMPTION_MODES = ("swap", "recompute")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flash_attn")
DTYPES = ("auto", "float32", "float16", "bfloat16")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache.

    Attributes:
        block_size: Tokens per KV block (the unit of prefix caching).
        num_kv_blocks: Device blocks; ``None`` sizes the pool from
            ``kv_cache_memory`` (CPU) or ``gpu_memory_utilization`` (GPU).
        kv_cache_memory: GiB of KV cache on CPU when ``num_kv_blocks`` is None.
        gpu_memory_utilization: Fraction of GPU memory for weights + KV.
        swap_space: GiB of CPU memory for blocks of preempted sequences.
        enable_prefix_caching: Reuse full blocks whose hash chain matches.
    """

    block_size: int = 16
    num_kv_blocks: Optional[int] = None
    kv_cache_memory: float = 2.0
    gpu_memory_utilization: float = 0.9
    swap_space: float = 1.0
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1 or None, got {self.num_kv_blocks}")
        if self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 GiB, got {self.kv_cache_memory}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 GiB, got {self.swap_space}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching.

    Attributes:
        max_num_seqs: Most sequences in one step.
        max_num_batched_tokens: Token budget of one step (prefill chunks plus
            one token per decoding sequence).
        enable_chunked_prefill: Split long prompts across steps so decodes are
            not starved. When off, a prompt is admitted only whole.
        preemption_mode: ``swap`` (copy blocks to CPU swap space, falling back
            to recompute when swap is full) or ``recompute``.
        max_waiting_requests: Admission bound of a serving replica (no vLLM
            equivalent; like SGLang's ``max_queued_requests``): it holds at
            most ``max_num_seqs + max_waiting_requests`` unfinished requests
            and rejects more at once with ``ReplicaOverloadedError`` (the
            router answers RESOURCE_EXHAUSTED / HTTP 429 with a retry hint).
            ``None`` is unbounded. The offline ``LLM`` queues everything.
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    preemption_mode: str = "swap"
    max_waiting_requests: Optional[int] = 256

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}): every running sequence needs a token of budget each step"
            )
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0 or None (unbounded), got {self.max_waiting_requests}")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything one replica's engine needs.

    Attributes:
        model: Local folder (config.json + safetensors + tokenizer.json) or a
            ``.gguf`` file; ``None`` means the packaged default model.
        tokenizer: Folder or tokenizer.json; defaults to the model's.
        dtype: Compute dtype; ``auto`` is float32 on CPU, bfloat16 on GPU.
        max_model_len: Longest prompt + output; ``None`` takes the model's
            ``max_position_embeddings``.
        seed: Seed of the sampling of requests that bring no seed.
        attention_backend: ``auto`` picks flash_attn on GPU when installed,
            else torch.
        enforce_eager: Never capture CUDA graphs (no effect on CPU).
        device: ``cpu`` or ``cuda``; ``None`` picks cuda when available.
    """

    model: Optional[str] = None
    tokenizer: Optional[str] = None
    dtype: str = "auto"
    max_model_len: Optional[int] = None
    seed: int = 0
    attention_backend: str = "auto"
    enforce_eager: bool = True
    device: Optional[str] = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        """Builds the tree from flat vLLM-style engine arguments.

        Raises:
            ValueError: For an unknown key, naming it and the closest known one.
        """
        sections = {"cache": CacheConfig, "scheduler": SchedulerConfig, "parallel": ParallelConfig}
        top_names = {f.name for f in dataclasses.fields(cls)} - set(sections)
        owner = {f.name: sec for sec, klass in sections.items() for f in dataclasses.fields(klass)}
        top: dict[str, Any] = {}
        nested: dict[str, dict[str, Any]] = {sec: {} for sec in sections}
        for key, value in kwargs.items():
            if key in top_names:
                top[key] = value
            elif key in owner:
                nested[owner[key]][key] = value
            else:
                known = sorted(top_names | set(owner))
                close = difflib.get_close_matches(key, known, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else f"; known arguments: {', '.join(known)}"
                raise ValueError(f"unknown engine argument {key!r}{hint}")
        built = {sec: klass(**nested[sec]) for sec, klass in sections.items()}
        return cls(**top, **built)

    def flat(self) -> dict[str, Any]:
        """Returns the flat engine arguments (inverse of ``from_kwargs``)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for sec in ("cache", "scheduler", "parallel"):
            out.update(dataclasses.asdict(out.pop(sec)))
        return out


ROUTING_POLICIES = ("cache_aware", "least_load", "power_of_two", "round_robin")


@dataclass(frozen=True)
class RouterConfig:
    """The front ends (gRPC + OpenAI-compatible HTTP) and their Serve deployment.

    Attributes:
        host: Interface the routers bind; ``127.0.0.1`` locally, ``0.0.0.0``
            in a pod.
        grpc_port: Port of ``prefixserve.v1.Generation`` (fixed per node).
        http_port: Port of the OpenAI-compatible HTTP API; ``None`` serves none.
        num_routers: Router deployment replicas in a Serve application (at
            most one per node, so each node's fixed ports are bound once).
        router_num_cpus: CPUs reserved per router replica.
        router_resources: Custom Ray resources each router replica asks for,
            e.g. ``{prefixserve_router: 1}`` to place routers on the pods that
            advertise that resource (and that the gRPC / HTTP Services select).
        migration_limit: Most times one request's stream moves to another
            replica because its replica died (``router/migration.py``);
            past it the request fails with UNAVAILABLE.
        drain_timeout_s: On shutdown (SIGTERM), seconds running streams get
            to finish after the routers stop accepting requests.
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
        auth_health: Require a token for health checks too.
        auth_metrics: Require a token for ``GET /metrics`` too.
    """

    host: str = "127.0.0.1"
    grpc_port: int = 50051
    http_port: Optional[int] = 8000
    num_routers: int = 1
    router_num_cpus: float = 0.5
    router_resources: dict = field(default_factory=dict)
    migration_limit: int = 3
    drain_timeout_s: float = 30.0
    limits: dict = field(default_factory=dict)
    tls_cert: Optional[str] = None
    tls_key: Optional[str] = None
    tls_client_ca: Optional[str] = None
    api_key_file: Optional[str] = None
    auth_health: bool = False
    auth_metrics: bool = False

    def __post_init__(self) -> None:
        for name in ("grpc_port", "http_port"):
            port = getattr(self, name)
            if port is not None and not 0 <= port <= 65535:
                raise ValueError(f"{name} must be a port in 0..65535, got {port}")
        if self.grpc_port is not None and self.grpc_port == self.http_port and self.grpc_port != 0:
            raise ValueError(f"grpc_port and http_port must differ, both are {self.grpc_port}")
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


@dataclass(frozen=True)
class AutoscalingConfig:
    """Thresholds of the KV-aware autoscaling policy (``cluster/autoscaling.py``).

    Set ``autoscaling:`` in the cluster config to let Serve scale the replica
    deployment between ``min_replicas`` and ``max_replicas``; without it the
    deployment keeps ``replicas`` replicas. The algorithm and why each
    default is what it is are in ``cluster/autoscaling.py``'s header.

    Attributes:
        min_replicas: Fewest replicas (>= 1: a scale-to-zero replica would
            lose its prefix cache and make the first request wait for a
            model load).
        max_replicas: Most replicas.
        target_kv_cache_usage: Mean fraction of device KV blocks in use per
            replica that the policy steers to (cached-but-free blocks count
            as free).
        target_num_waiting: Mean requests waiting for admission per replica
            that the policy steers to.
        target_ttft_s: Mean time to first token (seconds) the policy steers
            to; ``None`` ignores TTFT.
        downscale_headroom: Scale down only when, with one replica fewer,
            every signal would still be at most this fraction of its target
            (the hysteresis band between scaling up at 1.0 and down here).
        upscale_delay_s: Pressure must stay above target this long before
            replicas are added.
        downscale_delay_s: Load must stay below the headroom this long before
            one replica is removed.
        max_upscale_step: Most replicas added by one decision.
        look_back_period_s: Window over which Serve averages each replica's
            reported metrics.
        metrics_interval_s: How often replicas push their metrics to Serve's
            controller (Serve marks this knob deprecated in favour of an
            environment variable but still reads it in 2.60).
    """

    min_replicas: int = 1
    max_replicas: int = 4
    target_kv_cache_usage: float = 0.75
    target_num_waiting: float = 2.0
    target_ttft_s: Optional[float] = 2.0
    downscale_headroom: float = 0.6
    upscale_delay_s: float = 10.0
    downscale_delay_s: float = 60.0
    max_upscale_step: int = 2
    look_back_period_s: float = 10.0
    metrics_interval_s: float = 2.0

    def __post_init__(self) -> None:
        if self.min_replicas < 1:
            raise ValueError(f"min_replicas must be >= 1 (scale to zero is not supported), got {self.min_replicas}")
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) must be >= min_replicas ({self.min_replicas})")
        if not 0.0 < self.target_kv_cache_usage <= 1.0:
            raise ValueError(f"target_kv_cache_usage must be in (0, 1], got {self.target_kv_cache_usage}")
        if self.target_num_waiting <= 0:
            raise ValueError(f"target_num_waiting must be > 0, got {self.target_num_waiting}")
        if self.target_ttft_s is not None and self.target_ttft_s <= 0:
            raise ValueError(f"target_ttft_s must be > 0 seconds or null (ignore TTFT), got {self.target_ttft_s}")
        if not 0.0 < self.downscale_headroom < 1.0:
            raise ValueError(
                f"downscale_headroom must be in (0, 1) so scale-up and scale-down thresholds differ, "
                f"got {self.downscale_headroom}"
            )
        for name in ("upscale_delay_s", "downscale_delay_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 seconds, got {getattr(self, name)}")
        if self.max_upscale_step < 1:
            raise ValueError(f"max_upscale_step must be >= 1, got {self.max_upscale_step}")
        if self.metrics_interval_s <= 0:
            raise ValueError(f"metrics_interval_s must be > 0 seconds, got {self.metrics_interval_s}")
        if self.look_back_period_s <= self.metrics_interval_s:
            raise ValueError(
                f"look_back_period_s ({self.look_back_period_s}) must be > metrics_interval_s "
                f"({self.metrics_interval_s}): the window must hold more than one report"
            )


@dataclass(frozen=True)
class ClusterConfig:
    """A local or KubeRay cluster: replicas of one engine, and the directory.

    Attributes:
        replicas: Serve replicas (each owns one engine and its TP group).
        replica_num_cpus: CPUs reserved per replica actor; fractional so
            several fit on a small machine.
        rank_num_cpus: CPUs reserved per tensor-parallel rank actor.
        redis_url: The prefix directory; None lets the local launcher start
            a ``redis-server`` on a loopback port.
        namespace: Directory namespace (one per model / cluster).
        max_ongoing_requests: Serve's cap of concurrent requests per replica.
        routing_policy: ``cache_aware`` (default), ``least_load``,
            ``power_of_two`` or ``round_robin`` (``router/policies/``).
        routing_policy_params: The policy's thresholds by name, e.g.
            ``{balance_abs_threshold: 16}`` for ``cache_aware`` (each
            policy file's header lists them with their defaults); unknown
            names are errors.
        engine: The engine of every replica.
        router: The gRPC / HTTP front ends.
        autoscaling: ``None`` keeps ``replicas`` replicas; set, Serve scales
            between its ``min_replicas`` and ``max_replicas`` with the
            KV-aware policy, starting from ``replicas``.

    ``from_dict`` / ``from_yaml`` read the same tree from a mapping or a YAML
    file (``prefixserve up --config``, the RayService's ``serveConfigV2``);
    ``to_dict`` writes it back.
    """

    replicas: int = 1
    replica_num_cpus: float = 0.5
    rank_num_cpus: float = 0.5
    redis_url: Optional[str] = None
    namespace: str = "default"
    max_ongoing_requests: int = 256
    routing_policy: str = "cache_aware"
    routing_policy_params: dict = field(default_factory=dict)
    engine: EngineConfig = field(default_factory=EngineConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    autoscaling: Optional[AutoscalingConfig] = None

    def __post_init__(self) -> None:
        if self.routing_policy not in ROUTING_POLICIES:
            close = difflib.get_close_matches(self.routing_policy, ROUTING_POLICIES, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"routing_policy must be one of {ROUTING_POLICIES}, got {self.routing_policy!r}{hint}")
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if self.replica_num_cpus <= 0 or self.rank_num_cpus <= 0:
            raise ValueError("replica_num_cpus and rank_num_cpus must be > 0 (fractions are fine)")
        if self.max_ongoing_requests < 1:
            raise ValueError(f"max_ongoing_requests must be >= 1, got {self.max_ongoing_requests}")
        scaling = self.autoscaling
        if scaling is not None and not scaling.min_replicas <= self.replicas <= scaling.max_replicas:
            raise ValueError(
                f"with autoscaling, replicas ({self.replicas}) is the initial replica count and must lie in "
                f"[min_replicas, max_replicas] = [{scaling.min_replicas}, {scaling.max_replicas}]; "
                f"set replicas: {min(max(self.replicas, scaling.min_replicas), scaling.max_replicas)}"
            )

    @property
    def max_num_replicas(self) -> int:
        """Most replicas the deployment can have (for sizing local Ray)."""
        return self.autoscaling.max_replicas if self.autoscaling is not None else self.replicas

    @classmethod
    def from_dict(cls, mapping: Mapping[str, Any]) -> "ClusterConfig":
        """Builds the tree from a nested mapping (a parsed YAML file).

        Every level is checked strictly: an unknown or misspelled key, or a
        value of the wrong type, is an error naming its full key path (e.g.
        ``engine.cache.blok_size``) and the closest known key. Under
        ``engine:`` the knobs of its sections may be given nested
        (``cache: {block_size: 16}``) or flat as vLLM names them
        (``block_size: 16``), not both for one knob. ``redis_url: env:NAME``
        reads the URL from environment variable ``NAME`` now (a password
        kept in a Kubernetes Secret stays out of the manifest).

        Raises:
            ValueError: Says which key to change and how.
        """
        if isinstance(mapping, Mapping) and isinstance(mapping.get("redis_url"), str):
            mapping = {**mapping, "redis_url": _from_env(mapping["redis_url"], "redis_url")}
        return _build(cls, mapping, "")

    @classmethod
    def from_yaml(cls, path: Union[str, "os.PathLike[str]"]) -> "ClusterConfig":
        """Reads ``from_dict``'s schema from a YAML file.

        Raises:
            ValueError: Unreadable file, not a mapping, or an invalid config
                (the message names the file and the key).
        """
        import yaml

        try:
            with open(path, encoding="utf-8") as f:
                data = yaml.safe_load(f)
        except OSError as exc:
            raise ValueError(f"cannot read the cluster config {path}: {exc}") from exc
        except yaml.YAMLError as exc:
            raise ValueError(f"{path} is not valid YAML: {exc}") from exc
        if data is None:
            data = {}
        try:
            return cls.from_dict(data)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from exc

    def to_dict(self) -> dict[str, Any]:
        """The nested mapping ``from_dict`` reads back (plain YAML/JSON values)."""
        return dataclasses.asdict(self)


# ------------------------------------------------------------ strict loading
_ENGINE_SECTIONS = ("cache", "scheduler", "parallel")
_KIND_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _build(cls: type, mapping: Any, path: str) -> Any:
    """Builds dataclass ``cls`` from ``mapping``; ``path`` prefixes error keys."""
    where = path or "the cluster config"
    if not isinstance(mapping, Mapping):
        raise ValueError(f"{where} must be a mapping of keys to values, got {type(mapping).__name__}")
    if cls is EngineConfig:
        mapping = _nest_engine_keys(mapping, path)
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    values: dict[str, Any] = {}
    for key, value in mapping.items():
        if key not in names:
            raise ValueError(_unknown_key(key, names, path))
        values[key] = _convert(value, hints[key], _join(path, key))
    try:
        return cls(**values)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}" if path else str(exc)) from exc


def _nest_engine_keys(mapping: Mapping[str, Any], path: str) -> dict[str, Any]:
    """Moves flat vLLM-style section knobs (``block_size``) into their section."""
    owner = {
        f.name: section
        for section, klass in zip(_ENGINE_SECTIONS, (CacheConfig, SchedulerConfig, ParallelConfig))
        for f in dataclasses.fields(klass)
    }
    nested: dict[str, Any] = {}
    flat: dict[str, dict[str, Any]] = {}
    for key, value in mapping.items():
        if key in owner and key not in _ENGINE_SECTIONS:
            flat.setdefault(owner[key], {})[key] = value
        else:
            nested[key] = value
    engine_names = [f.name for f in dataclasses.fields(EngineConfig)]
    for key in nested:
        if key not in engine_names:
            raise ValueError(_unknown_key(key, engine_names + sorted(owner), path))
    for section, knobs in flat.items():
        given = nested.get(section) or {}
        if not isinstance(given, Mapping):
            continue  # _build reports the wrong type with its path
        both = sorted(set(knobs) & set(given))
        if both:
            raise ValueError(
                f"{_join(path, both[0])} and {_join(path, section + '.' + both[0])} are both set; keep one"
            )
        nested[section] = {**given, **knobs}
    return nested


def _convert(value: Any, hint: Any, path: str) -> Any:
    """Checks ``value`` against a field's type hint; nested dataclasses recurse."""
    if typing.get_origin(hint) is Union:
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None:
            return None
        hint = options[0]
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, path)
    if hint is bool:
        ok = isinstance(value, bool)
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif hint is str:
        ok = isinstance(value, str)
    else:
        ok = True
    if not ok:
        kind = _KIND_NAMES.get(hint, getattr(hint, "__name__", str(hint)))
        raise ValueError(f"{path} must be {kind}, got {value!r} ({type(value).__name__})")
    return value


def _from_env(value: str, path: str) -> str:
    """``env:NAME`` -> the value of environment variable NAME; other values as they are."""
    if not value.startswith("env:"):
        return value
    name = value[len("env:"):]
    if not name or name not in os.environ:
        raise ValueError(f"{path} is {value!r} but environment variable {name!r} is not set; "
                         "set it (e.g. from a Secret) or give the URL itself")
    return os.environ[name]


def _unknown_key(key: Any, known: list[str], path: str) -> str:
    close = difflib.get_close_matches(str(key), known, n=1)
    hint = f"; did you mean {_join(path, close[0])!r}?" if close else f"; known keys: {', '.join(known)}"
    return f"unknown key {_join(path, str(key))!r}{hint}"


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key
