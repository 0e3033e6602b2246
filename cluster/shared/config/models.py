"""One served model of a cluster: its engine, replicas, autoscaling and routing.

A cluster serves one model from its top-level fields (``engine``,
``replicas``, ``routing_policy``, ...) or several from ``models:``, a list
of ``ModelConfig`` with the same per-model fields (Ray Serve LLM's list of
``LLMConfig`` in one OpenAI app)::

    models:
      - name: smollm                      # what clients pass as `model`
        engine: {model: /models/smollm}
        replicas: 2
      - name: qwen3
        engine: {model: /models/qwen3, max_num_seqs: 64}
        routing_policy: cache_aware
        autoscaling: {min_replicas: 1, max_replicas: 3}

Each model gets its own replica deployment, prefix-directory namespace
(default ``<cluster namespace>.<name>``), routing policy and autoscaling;
the routers route by the request's ``model``.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from cluster.shared.config.engine import EngineConfig
from cluster.shared.fingerprint import served_model_name

ROUTING_POLICIES = ("cache_aware", "least_load", "power_of_two", "prefix_cost", "round_robin")
# The baselines benchmarks deploy to compare against (router/policies/registry.py BASELINE_POLICIES):
# accepted in a config, not offered by `prefixserve up --routing-policy`.
BASELINE_ROUTING_POLICIES = ("adapter_affinity", "random")
DIRECTORY_LOOKUPS = ("index", "redis")
# The per-model fields, shared by ModelConfig and ClusterConfig's top level.
SERVING_FIELDS = ("replicas", "replica_num_cpus", "rank_num_cpus", "max_ongoing_requests", "routing_policy",
                  "routing_policy_params", "directory_lookup", "engine", "autoscaling", "max_replicas_per_node",
                  "prefill_replicas")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$")


@dataclass(frozen=True)
class AutoscalingConfig:
    """Thresholds of the KV-aware autoscaling policy (``cluster/shared/autoscaling.py``).

    Set ``autoscaling:`` in the cluster config to let Serve scale the replica
    deployment between ``min_replicas`` and ``max_replicas``; without it the
    deployment keeps ``replicas`` replicas. The algorithm and why each
    default is what it is are in ``cluster/shared/autoscaling.py``'s header.

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


def check_serving_fields(config: Any) -> None:
    """Validates the per-model fields of a ``ModelConfig`` or ``ClusterConfig``.

    Raises:
        ValueError: Names the field and what to set.
    """
    if config.routing_policy not in ROUTING_POLICIES + BASELINE_ROUTING_POLICIES:
        close = difflib.get_close_matches(config.routing_policy, ROUTING_POLICIES, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"routing_policy must be one of {ROUTING_POLICIES}, got {config.routing_policy!r}{hint}")
    if config.directory_lookup not in DIRECTORY_LOOKUPS:
        raise ValueError(f"directory_lookup must be one of {DIRECTORY_LOOKUPS}, got {config.directory_lookup!r}")
    if config.replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {config.replicas}")
    if config.replica_num_cpus <= 0 or config.rank_num_cpus <= 0:
        raise ValueError("replica_num_cpus and rank_num_cpus must be > 0 (fractions are fine)")
    if config.max_ongoing_requests < 1:
        raise ValueError(f"max_ongoing_requests must be >= 1, got {config.max_ongoing_requests}")
    per_node = config.max_replicas_per_node
    if per_node is not None and per_node < 1:
        raise ValueError(f"max_replicas_per_node must be >= 1 (or unset for no cap), got {per_node}")
    if per_node is not None and config.engine.parallel.tensor_parallel_size > 1:
        raise ValueError("max_replicas_per_node applies to replicas without tensor parallelism (Serve refuses it "
                         "with placement groups); unset it with tensor_parallel_size > 1")
    scaling = config.autoscaling
    fewest = scaling.min_replicas if scaling is not None else config.replicas
    if not 0 <= config.prefill_replicas < fewest:
        raise ValueError(f"prefill_replicas must be >= 0 and leave a decode replica: below replicas (or autoscaling's "
                         f"min_replicas), {fewest}; got {config.prefill_replicas} (0: every replica prefills and decodes)")
    if scaling is not None and not scaling.min_replicas <= config.replicas <= scaling.max_replicas:
        raise ValueError(
            f"with autoscaling, replicas ({config.replicas}) is the initial replica count and must lie in "
            f"[min_replicas, max_replicas] = [{scaling.min_replicas}, {scaling.max_replicas}]; "
            f"set replicas: {min(max(config.replicas, scaling.min_replicas), scaling.max_replicas)}"
        )


@dataclass(frozen=True)
class ModelConfig:
    """One entry of ``ClusterConfig.models``: a model and the replicas that serve it.

    Attributes:
        name: What clients pass as ``model`` (OpenAI field, gRPC
            ``GenerateRequest.model``) and the ``model`` label of its
            metrics; default: the folder name of ``engine.model`` (or the
            packaged default model's name).
        namespace: Its prefix-directory namespace; default
            ``<cluster namespace>.<name>``. Two models never share one.
        replicas: Serve replicas of this model (each owns one engine).
        replica_num_cpus: CPUs reserved per replica actor.
        rank_num_cpus: CPUs reserved per tensor-parallel rank actor.
        max_ongoing_requests: Serve's cap of concurrent requests per replica.
        routing_policy: This model's routing policy (``router/policies/``).
        routing_policy_params: The policy's thresholds by name.
        directory_lookup: ``index`` or ``redis`` (docs/DIRECTORY.md).
        engine: The engine of this model's replicas.
        autoscaling: ``None`` keeps ``replicas``; set, Serve scales this
            model's deployment with the KV-aware policy.
        max_replicas_per_node: Most of this model's replicas on one Ray node
            (Serve's ``max_replicas_per_node``); ``None``: no cap, Serve
            spreads replicas over the nodes with room (best effort).
        prefill_replicas: Disaggregated prefill (docs/DISAGGREGATION.md): the replicas of Serve rank below it
            only prefill, the others decode; 0 (default): every replica does both.
    """

    name: Optional[str] = None
    namespace: Optional[str] = None
    replicas: int = 1
    replica_num_cpus: float = 0.5
    rank_num_cpus: float = 0.5
    max_ongoing_requests: int = 256
    routing_policy: str = "prefix_cost"
    routing_policy_params: dict = field(default_factory=dict)
    directory_lookup: str = "index"
    engine: EngineConfig = field(default_factory=EngineConfig)
    autoscaling: Optional[AutoscalingConfig] = None
    max_replicas_per_node: Optional[int] = None
    prefill_replicas: int = 0

    def __post_init__(self) -> None:
        if self.name is not None and not _NAME.match(self.name):
            raise ValueError(f"name must be 1-128 letters, digits or . _ : / @ + - (starting with a letter "
                             f"or digit), got {self.name!r}")
        if self.namespace is not None and not self.namespace:
            raise ValueError("namespace must not be empty (leave it out for <cluster namespace>.<name>)")
        check_serving_fields(self)

    @property
    def served_name(self) -> str:
        """The name clients pass as ``model``."""
        return self.name or served_model_name(self.engine.model)


def deployment_suffix(name: str) -> str:
    """A Serve-safe suffix for a model's deployment and application names."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", name)
