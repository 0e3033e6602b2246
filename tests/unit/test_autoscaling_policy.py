"""The KV-aware autoscaling policy on synthetic Serve ``AutoscalingContext``s.

The contexts are Ray Serve's own class, filled as the controller fills them
(``aggregated_metrics`` keyed by ``ReplicaID``); the policy is called through
Serve's wrapper too (``_apply_autoscaling_config``), with the Serve config
``serve_autoscaling_config`` builds, so Serve's delay logic is part of what
is tested.
"""

from __future__ import annotations

import random
from typing import Optional

import pytest
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.autoscaling_policy import _apply_autoscaling_config
from ray.serve.config import AutoscalingConfig as ServeAutoscalingConfig
from ray.serve.config import AutoscalingContext

from cluster.shared import autoscaling
from cluster.shared.autoscaling import KVAwareAutoscalingPolicy, TTFTTracker, serve_autoscaling_config
from cluster.shared.config import AutoscalingConfig, ClusterConfig

DEPLOYMENT = DeploymentID(name="replica", app_name="test")


def replica_ids(n: int) -> list[ReplicaID]:
    return [ReplicaID(f"r{i}", DEPLOYMENT) for i in range(n)]


class Controller:
    """Drives a policy the way Serve's controller does: one call per tick,
    policy state carried over, the target applied at once (replicas start
    instantly here unless ``pending`` says otherwise)."""

    def __init__(self, scaling: AutoscalingConfig, replicas: int = 1) -> None:
        self.cluster = ClusterConfig(replicas=replicas, autoscaling=scaling)
        serve_config = ServeAutoscalingConfig(**serve_autoscaling_config(self.cluster))
        self.serve_config = serve_config
        self.policy = _apply_autoscaling_config(KVAwareAutoscalingPolicy(**serve_config.policy.policy_kwargs))
        self.state: dict = {}
        self.target = replicas
        self.running = replicas
        self.now = 1000.0
        self.history: list[int] = [replicas]

    def context(self, per_replica: dict[str, list[float]], queued: float = 0.0) -> AutoscalingContext:
        ids = replica_ids(self.running)
        metrics = {name: dict(zip(ids, values)) for name, values in per_replica.items()}
        return AutoscalingContext(
            deployment_id=DEPLOYMENT, deployment_name=DEPLOYMENT.name, app_name=DEPLOYMENT.app_name,
            current_num_replicas=self.running, target_num_replicas=self.target, running_replicas=ids,
            total_num_requests=0.0, total_queued_requests=queued, aggregated_metrics=metrics, raw_metrics={},
            capacity_adjusted_min_replicas=self.serve_config.min_replicas,
            capacity_adjusted_max_replicas=self.serve_config.max_replicas,
            policy_state=dict(self.state), last_scale_up_time=None, last_scale_down_time=None,
            current_time=self.now, config=self.serve_config,
        )

    def tick(self, kv: float, waiting: float = 0.0, ttft: float = 0.0, dt: float = 1.0,
             queued: float = 0.0, start_replicas: bool = True) -> int:
        """Every replica reports the same figures; returns the new target."""
        n = self.running
        ctx = self.context({"kv_cache_usage": [kv] * n, "num_waiting": [waiting] * n, "ttft_s": [ttft] * n},
                           queued)
        decision, self.state = self.policy(ctx)
        # Serve clamps to its bounds after the policy.
        self.target = max(self.serve_config.min_replicas, min(self.serve_config.max_replicas, decision))
        if start_replicas:
            self.running = self.target
        self.now += dt
        self.history.append(self.target)
        return self.target


def fast(**overrides) -> AutoscalingConfig:
    base = dict(min_replicas=1, max_replicas=4, upscale_delay_s=5.0, downscale_delay_s=20.0)
    return AutoscalingConfig(**{**base, **overrides})


def test_kv_pressure_scales_up_with_an_idle_queue():
    ctl = Controller(fast())
    # KV 95 % full, nobody waiting, TTFT fine: request counts would say "idle".
    targets = [ctl.tick(kv=0.95, waiting=0, ttft=0.1) for _ in range(8)]
    assert targets[:5] == [1] * 5  # upscale_delay_s = 5 ticks of 1 s
    assert targets[5] == 2
    assert ctl.state["prefixserve_last"]["reason"] == "kv_cache_usage"


def test_queue_and_ttft_pressure_scale_up_with_a_cool_cache():
    by_queue = Controller(fast(upscale_delay_s=0.0))
    assert by_queue.tick(kv=0.1, waiting=5.0) > 1
    by_ttft = Controller(fast(upscale_delay_s=0.0))
    assert by_ttft.tick(kv=0.1, waiting=0.0, ttft=6.0) > 1
    by_handle_queue = Controller(fast(upscale_delay_s=0.0))
    assert by_handle_queue.tick(kv=0.1, queued=10) > 1
    ttft_off = Controller(fast(upscale_delay_s=0.0, target_ttft_s=None))
    assert ttft_off.tick(kv=0.1, waiting=0.0, ttft=60.0) == 1


def test_scale_up_step_is_proportional_and_bounded():
    ctl = Controller(fast(upscale_delay_s=0.0, max_upscale_step=2), replicas=2)
    # pressure 3 on 2 replicas wants 6 -> step capped at 2.
    assert ctl.tick(kv=0.75, waiting=6.0) == 4
    # at max_replicas: stays.
    assert ctl.tick(kv=1.0, waiting=50.0) == 4


def test_no_flapping_under_noise():
    rng = random.Random(0)
    # Load inside the band (per replica 0.6 +- 0.12 of KV, queue blips): never a change.
    ctl = Controller(fast(), replicas=2)
    for _ in range(600):  # ten minutes of 1 s ticks
        ctl.tick(kv=0.6 + rng.uniform(-0.12, 0.12), waiting=rng.choice([0, 0, 0, 1, 3]))
    assert set(ctl.history) == {2}
    # A total load right at the target of 2 replicas, spread over however
    # many run, jittering +-20 %: at most one step, and never back and forth.
    ctl = Controller(fast(), replicas=2)
    for _ in range(600):
        total_kv = 2 * 0.75 * (1 + rng.uniform(-0.2, 0.2))
        ctl.tick(kv=min(1.0, total_kv / ctl.running))
    changes = [(a, b) for a, b in zip(ctl.history, ctl.history[1:]) if a != b]
    assert len(changes) <= 1, changes


def test_hysteresis_scales_down_one_at_a_time_only_after_the_delay():
    ctl = Controller(fast(upscale_delay_s=0.0, downscale_delay_s=20.0), replicas=3)
    # Light load: with 2 replicas it would be 0.3 * 3 / 2 / 0.75 = 0.6 of target -> down allowed.
    targets = [ctl.tick(kv=0.3) for _ in range(25)]
    assert targets[:20] == [3] * 20
    assert targets[20] == 2  # one replica removed, not two
    # Moderate load right at the band: removing another would exceed the headroom.
    targets = [ctl.tick(kv=0.5) for _ in range(100)]
    assert set(targets) == {2}


def test_a_scale_up_is_not_undone_by_the_load_that_caused_it():
    ctl = Controller(fast(upscale_delay_s=0.0, downscale_delay_s=0.0), replicas=1)
    assert ctl.tick(kv=0.9) == 2
    # The same total load now spread over 2 replicas: 0.45 each, 0.6 of target.
    # Removing one would bring it back to 1.2x target: must stay.
    for _ in range(50):
        assert ctl.tick(kv=0.45) == 2


def test_a_break_in_pressure_restarts_the_upscale_delay():
    ctl = Controller(fast(upscale_delay_s=5.0))
    for _ in range(4):
        ctl.tick(kv=0.95)
    ctl.tick(kv=0.5)  # dip back into the band
    assert [ctl.tick(kv=0.95) for _ in range(5)] == [1] * 5
    assert ctl.tick(kv=0.95) == 2


def test_min_and_max_bounds():
    low = Controller(fast(min_replicas=2, downscale_delay_s=0.0), replicas=2)
    assert all(low.tick(kv=0.0) == 2 for _ in range(10))
    high = Controller(fast(max_replicas=3, upscale_delay_s=0.0), replicas=3)
    assert all(high.tick(kv=1.0, waiting=100) == 3 for _ in range(10))


def test_holds_while_replicas_start_or_before_any_report():
    ctl = Controller(fast(upscale_delay_s=0.0))
    assert ctl.tick(kv=0.95, start_replicas=False) == 2
    # The new replica is still starting: no further step on the old one's figures.
    assert all(ctl.tick(kv=1.0, waiting=20, start_replicas=False) == 2 for _ in range(5))
    ctl.running = 2
    ctx = ctl.context({})  # nothing reported yet
    decision, _ = ctl.policy(ctx)
    assert decision == 2


def test_reports_of_replicas_that_are_gone_are_ignored():
    ctl = Controller(fast(upscale_delay_s=0.0), replicas=1)
    stale = ReplicaID("gone", DEPLOYMENT)
    ctx = ctl.context({"kv_cache_usage": [0.1], "num_waiting": [0.0]})
    ctx.aggregated_metrics["kv_cache_usage"][stale] = 1.0
    ctx.aggregated_metrics.setdefault("num_waiting", {})[stale] = 100.0
    decision, _ = ctl.policy(ctx)
    assert decision == 1


def test_serve_accepts_the_generated_config_and_policy_kwargs_are_checked():
    cluster = ClusterConfig(replicas=2, autoscaling=AutoscalingConfig(min_replicas=1, max_replicas=3))
    generated = serve_autoscaling_config(cluster)
    serve_config = ServeAutoscalingConfig(**generated)
    assert serve_config.initial_replicas == 2
    assert serve_config.upscale_delay_s == 0 and serve_config.downscale_delay_s == 0
    assert serve_config.policy.policy_function == autoscaling.POLICY_IMPORT_PATH
    with pytest.raises(ValueError, match="target_kv_cach_usage"):
        KVAwareAutoscalingPolicy(target_kv_cach_usage=0.5)


def test_victim_choice_is_documented_as_serve_s():
    # Serve 2.60's policies return a count only; the module doc must say so
    # and what Serve does instead (if Serve adds a hook, this should change).
    import inspect

    from ray.serve._private.deployment_scheduler import DeploymentScheduler

    assert "max_num_to_stop" in inspect.signature(DeploymentScheduler._get_replicas_to_stop).parameters
    doc = autoscaling.__doc__
    assert "does NOT let a policy choose" in doc and "newest replica first" in doc


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_ttft_tracker_window_and_stalled_requests():
    clock = FakeClock()
    tracker = TTFTTracker(window_s=10.0, clock=clock)
    assert tracker.value() == 0.0
    tracker.start("a")
    clock.now = 0.5
    tracker.first_token("a")
    tracker.first_token("a")  # later tokens do not count
    tracker.start("b")
    clock.now = 2.0
    tracker.first_token("b")  # 1.5 s
    assert tracker.value() == pytest.approx(1.0)
    tracker.start("stuck")
    clock.now = 6.0  # waiting 4 s without a token: larger than the mean
    assert tracker.value() == pytest.approx(4.0)
    tracker.discard("stuck")
    clock.now = 20.0  # samples left the window
    assert tracker.value() == 0.0


def _cfg(**kw) -> Optional[ClusterConfig]:
    return ClusterConfig.from_dict(kw)


def test_replica_options_use_the_policy_instead_of_a_fixed_count(monkeypatch):
    from cluster import app

    monkeypatch.setattr(app, "request_router_config", lambda config: None)
    fixed = app.replica_options(_cfg(replicas=2))
    assert fixed["num_replicas"] == 2 and "autoscaling_config" not in fixed
    scaled = app.replica_options(_cfg(replicas=1, autoscaling={"max_replicas": 2}))
    assert "num_replicas" not in scaled
    assert scaled["autoscaling_config"]["policy"]["policy_function"] == autoscaling.POLICY_IMPORT_PATH
    assert scaled["autoscaling_config"]["max_replicas"] == 2
