"""KV-aware autoscaling of the replica deployment (a Ray Serve custom policy).

An LLM replica is full when its KV cache is full or requests queue for
admission, long before Serve's request count says so: 30 requests with 8k
prompts fill a cache that 200 short ones do not. So the policy scales on what
the replicas report through ``record_autoscaling_stats()``
(``workers/replica.py``), which Serve averages per replica over
``look_back_period_s`` and hands over as ``ctx.aggregated_metrics``:

    kv_cache_usage   used device KV blocks / all (cached-but-free count as free)
    num_waiting      requests waiting for admission (not yet prefilling); the
                     requests Serve's handles hold back (replicas at
                     max_ongoing_requests, ctx.total_queued_requests) add to it
    ttft_s           mean time to first token of the last TTFT_WINDOW_S, or the
                     age of the oldest request still without one if larger
                     (a stalled queue shows before its first token comes)

Algorithm (one call per controller tick, ~0.1 s; state in ``policy_state``)::

    hold (return the current target) while a scale-up or -down is in flight
      (running replicas != target) or no replica has reported yet
    pressure = max(mean kv_cache_usage / target_kv_cache_usage,
                   mean num_waiting    / target_num_waiting,
                   mean ttft_s         / target_ttft_s)      # means over replicas
    pressure > 1                          -> want up:
        n + clamp(ceil(n * pressure) - n, 1, max_upscale_step)
    pressure * n / (n - 1) <= downscale_headroom (n > min_replicas)
                                          -> want down: n - 1
    otherwise                             -> stay (both timers reset)
    a "want" is acted on only after it held without a break for
    upscale_delay_s / downscale_delay_s; result clamped to [min, max]

The band between 1.0 (up) and ``downscale_headroom`` after removing a
replica (down) is the hysteresis: a load that just triggered a scale-up
cannot trigger a scale-down right after, and noise around the target resets
the timers instead of flapping. Scaling down removes one replica at a time
so the remaining caches warm up before the next removal.

Thresholds (``cluster.shared.config.AutoscalingConfig``, YAML ``autoscaling:``):

    min_replicas           1     never scale to zero (cold start = model load)
    max_replicas           4
    target_kv_cache_usage  0.75  leaves room for running sequences to grow
                                 without preemption (swap / recompute)
    target_num_waiting     2.0   per replica; a short queue is fine, a growing
                                 one is latency
    target_ttft_s          2.0   null ignores TTFT
    downscale_headroom     0.6   down only if one replica fewer stays <= 60 %
                                 of every target
    upscale_delay_s        10    pressure must hold this long before adding
    downscale_delay_s      60    low load must hold this long before removing
                                 (a removed replica's prefix cache is lost)
    max_upscale_step       2     replicas added per decision
    look_back_period_s     10    Serve's averaging window of the metrics
    metrics_interval_s     2     how often replicas push metrics to Serve

Serve's own ``upscale_delay_s`` / ``downscale_delay_s`` are set to 0 and its
scaling factors left at 1 (``serve_autoscaling_config``): Serve wraps every
custom policy with its delay logic, and two sets of timers would be hard to
reason about. Serve still clamps the result to ``[min_replicas,
max_replicas]`` (adjusted for target capacity).

Scale-down, what happens to the replica that goes (Ray Serve 2.60):

- Which replica: Serve does NOT let a policy choose; the policy returns only
  a count. The controller's scheduler picks (``_get_replicas_to_stop`` in
  ``serve/_private/deployment_scheduler.py``): replicas not yet running
  first, then replicas off the head node, then nodes with the fewest
  replicas (to free nodes), then the newest replica first. So the policy
  cannot prefer the replica whose cached prefixes are least hot in the
  directory. Newest-first is usually the right bias anyway (the newest
  replica has had the least time to build a hot cache), but a replica that
  holds the only copy of a hot prefix can be removed; its prefixes are
  recomputed on the next replica the router picks.
- No new requests at once: in the same controller tick the replica goes to
  STOPPING and leaves the running set broadcast to every handle; Serve's
  request router (and so ``router.serve_router.PrefixAwareRequestRouter``,
  which ranks only the ``candidate_replicas`` Serve passes in) stops
  sending to it. A request that raced the broadcast is still served; after
  the drain the replica rejects handle requests and the router retries them
  on another replica.
- Running streams finish: the replica drains (waits until it has no ongoing
  request, checking every ``graceful_shutdown_wait_loop_s``) for up to
  ``graceful_shutdown_timeout_s`` (30 s in ``cluster/app/builder.py``) before Serve
  kills it; streams longer than that end with finish reason ``abort``.
  Then Serve calls the replica's ``__del__`` -> ``ReplicaServer.shutdown``,
  which deregisters it from the prefix directory (its entries go at once;
  they were unused since it left the candidate set).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Mapping

from cluster.shared.config import AutoscalingConfig

if TYPE_CHECKING:
    from cluster.shared.config import ClusterConfig

# A child of Serve's logger: the policy runs in Serve's controller, whose log
# (and the dashboard's) shows Serve's records.
logger = logging.getLogger("ray.serve").getChild("prefixserve.autoscaling")

# Metric names of ReplicaServer.record_autoscaling_stats (the contract).
KV_CACHE_USAGE = "kv_cache_usage"
NUM_WAITING = "num_waiting"
NUM_RUNNING = "num_running"
TTFT_S = "ttft_s"

TTFT_WINDOW_S = 10.0  # recent first tokens the replica's ttft_s averages over
POLICY_IMPORT_PATH = "cluster.shared.autoscaling:KVAwareAutoscalingPolicy"

# Keys of our state in Serve's policy_state (Serve adds its own keys).
_UP_SINCE = "prefixserve_up_since"
_DOWN_SINCE = "prefixserve_down_since"
_LAST = "prefixserve_last"


@dataclasses.dataclass(frozen=True)
class Signals:
    """Per-replica means of the reported metrics, and the resulting pressure."""

    num_reporting: int
    kv_cache_usage: float
    num_waiting: float
    ttft_s: float
    pressure: float
    reason: str  # which signal sets the pressure


def read_signals(
    metrics: Mapping[str, Mapping[Any, float]],
    running: list,
    config: AutoscalingConfig,
    num_queued_at_handles: float = 0.0,
) -> Signals:
    """Averages the reported metrics over the running replicas that reported.

    Args:
        metrics: ``ctx.aggregated_metrics``: ``{metric: {replica_id: value}}``.
        running: ``ctx.running_replicas``; others' reports are ignored.
        config: The thresholds.
        num_queued_at_handles: ``ctx.total_queued_requests``: requests Serve
            holds back because replicas are at ``max_ongoing_requests``;
            they count as waiting.
    """
    usage = metrics.get(KV_CACHE_USAGE) or {}
    reporting = [r for r in running if r in usage]
    if not reporting:
        return Signals(0, 0.0, 0.0, 0.0, 0.0, "no replica reported yet")

    def mean(name: str) -> float:
        values = metrics.get(name) or {}
        return sum(float(values.get(r, 0.0)) for r in reporting) / len(reporting)

    kv, ttft = mean(KV_CACHE_USAGE), mean(TTFT_S)
    waiting = mean(NUM_WAITING) + max(0.0, float(num_queued_at_handles)) / len(reporting)
    ratios = {
        "kv_cache_usage": kv / config.target_kv_cache_usage,
        "num_waiting": waiting / config.target_num_waiting,
        "ttft_s": ttft / config.target_ttft_s if config.target_ttft_s else 0.0,
    }
    reason = max(ratios, key=ratios.__getitem__)
    return Signals(len(reporting), kv, waiting, ttft, ratios[reason], reason)


class KVAwareAutoscalingPolicy:
    """The Serve custom autoscaling policy (see the module doc).

    Serve instantiates it once per deployment with ``policy_kwargs`` (the
    fields of ``AutoscalingConfig``) and calls it every controller tick.

    Args:
        **thresholds: ``AutoscalingConfig`` fields; unknown names are errors.
    """

    def __init__(self, **thresholds: Any) -> None:
        names = {f.name for f in dataclasses.fields(AutoscalingConfig)}
        unknown = sorted(set(thresholds) - names)
        if unknown:
            raise ValueError(f"unknown autoscaling threshold(s) {unknown}; known: {sorted(names)}")
        self.config = AutoscalingConfig(**thresholds)

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        """Returns ``(desired replicas, policy state)`` for one tick."""
        return decide(ctx, self.config)


def decide(ctx: Any, config: AutoscalingConfig) -> tuple[int, dict[str, Any]]:
    """One autoscaling decision on an ``AutoscalingContext`` (pure but for ``ctx``)."""
    state = dict(ctx.policy_state or {})
    now = ctx.current_time if ctx.current_time is not None else time.time()
    target, current = ctx.target_num_replicas, ctx.current_num_replicas
    lower = max(config.min_replicas, ctx.capacity_adjusted_min_replicas)
    upper = min(config.max_replicas, ctx.capacity_adjusted_max_replicas)
    queued = ctx.total_queued_requests or 0.0
    signals = read_signals(ctx.aggregated_metrics or {}, list(ctx.running_replicas), config, queued)
    if current != target or signals.num_reporting == 0:
        # A change is in flight (replicas starting or stopping) or nothing
        # reported: new replicas' empty caches would read as spare capacity.
        state.pop(_UP_SINCE, None)
        state.pop(_DOWN_SINCE, None)
        return _clamp(target, lower, upper), state

    wanted = current
    if signals.pressure > 1.0:
        step = min(config.max_upscale_step, max(1, math.ceil(current * signals.pressure) - current))
        wanted = current + step
    elif current > 1 and signals.pressure * current / (current - 1) <= config.downscale_headroom:
        wanted = current - 1
    wanted = _clamp(wanted, lower, upper)

    decision = current
    if wanted > current:
        state.pop(_DOWN_SINCE, None)
        since = state.setdefault(_UP_SINCE, now)
        if now - since >= config.upscale_delay_s:
            decision = wanted
    elif wanted < current:
        state.pop(_UP_SINCE, None)
        since = state.setdefault(_DOWN_SINCE, now)
        if now - since >= config.downscale_delay_s:
            decision = wanted
    else:
        state.pop(_UP_SINCE, None)
        state.pop(_DOWN_SINCE, None)
    if decision != current:
        state.pop(_UP_SINCE, None)
        state.pop(_DOWN_SINCE, None)
        logger.info(
            "autoscaling %s: %d -> %d replicas (pressure %.2f from %s; kv %.2f, waiting %.1f, ttft %.2fs "
            "per replica over %d reporting)", ctx.deployment_name, current, decision, signals.pressure,
            signals.reason, signals.kv_cache_usage, signals.num_waiting, signals.ttft_s, signals.num_reporting,
        )
    state[_LAST] = {"pressure": signals.pressure, "reason": signals.reason, "wanted": wanted}
    return _clamp(decision, lower, upper), state


def _clamp(value: int, lower: int, upper: int) -> int:
    return max(lower, min(upper, value))


def serve_autoscaling_config(cluster: "ClusterConfig") -> dict[str, Any]:
    """The replica deployment's Serve ``autoscaling_config`` for our policy.

    Raises:
        ValueError: The cluster config has no ``autoscaling`` section.
    """
    scaling = cluster.autoscaling
    if scaling is None:
        raise ValueError("the cluster config has no autoscaling section")
    return {
        "min_replicas": scaling.min_replicas,
        "max_replicas": scaling.max_replicas,
        "initial_replicas": cluster.replicas,
        # Our policy keeps its own timers (module doc); Serve's would stack on them.
        "upscale_delay_s": 0.0,
        "downscale_delay_s": 0.0,
        "look_back_period_s": scaling.look_back_period_s,
        "metrics_interval_s": scaling.metrics_interval_s,
        "aggregation_function": "mean",
        "policy": {"policy_function": POLICY_IMPORT_PATH, "policy_kwargs": dataclasses.asdict(scaling)},
    }


class TTFTTracker:
    """The ``ttft_s`` a replica reports: recent time to first token.

    ``value()`` is the mean TTFT of requests whose first token came in the
    last ``window_s`` seconds, or the age of the oldest request still
    waiting for its first token if that is larger (0 when idle). Thread-safe.

    Args:
        window_s: How far back first tokens count.
        clock: Monotonic time source (tests inject one).
    """

    def __init__(self, window_s: float = TTFT_WINDOW_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._pending: dict[str, float] = {}  # request id -> arrival
        self._samples: list[tuple[float, float]] = []  # (first token at, ttft)

    def start(self, request_id: str) -> None:
        """A request arrived."""
        with self._lock:
            self._pending[request_id] = self._clock()

    def first_token(self, request_id: str) -> None:
        """The request's first token is out (later calls are no-ops)."""
        with self._lock:
            arrival = self._pending.pop(request_id, None)
            if arrival is not None:
                now = self._clock()
                self._samples.append((now, now - arrival))

    def discard(self, request_id: str) -> None:
        """The request ended (finished, failed or cancelled)."""
        with self._lock:
            self._pending.pop(request_id, None)

    def value(self) -> float:
        """Recent mean TTFT or the oldest pending request's age, whichever is larger."""
        with self._lock:
            now = self._clock()
            horizon = now - self.window_s
            self._samples = [s for s in self._samples if s[0] >= horizon]
            mean = sum(t for _, t in self._samples) / len(self._samples) if self._samples else 0.0
            oldest = max((now - t for t in self._pending.values()), default=0.0)
            return max(mean, oldest)
