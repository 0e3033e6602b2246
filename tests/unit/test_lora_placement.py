"""LoRA adapter placement: ``prefix_cost``'s adapter terms
(router/policies/lora_placement.py), the ``adapter_affinity`` baseline, the
decision core's adapter candidates, and ``prefixserve simulate --adapters``."""

from __future__ import annotations

import argparse
import random

import pytest

from cluster.bench import simulate
from cluster.shared.types import ReplicaStats
from router.decision import RoutingCore
from router.policies import ReplicaView, RoutingInput, get_policy
from router.policies.lora_placement import AdapterHomes, adapter_key
from router.policies.prefix_cost import rendezvous

LOAD = 32.0  # the policy's default adapter_load_tokens
EVICT = 256.0


def make_view(rid: str, holds=None, queued: int = 0, matched=0, num_adapters: int = 0, max_adapters: int = 0,
              running: int = 0) -> ReplicaView:
    return ReplicaView(rid, num_running=running, matched_blocks=matched, num_prefill_tokens=queued,
                       num_kv_blocks=1000, holds_adapter=holds, num_adapters=num_adapters, max_adapters=max_adapters)


def make_input(*views: ReplicaView, adapter: str = "chat", rate: float = 0.0, num_blocks: int = 8) -> RoutingInput:
    return RoutingInput(num_blocks, 16 * num_blocks, views, block_size=16, prefix_key=b"p" * 16, adapter=adapter,
                        adapter_rate=rate)


def make_policy(**params) -> object:
    return get_policy("prefix_cost", adapter_load_tokens=LOAD, adapter_eviction_tokens=EVICT, **params)


def test_a_holder_with_the_prefix_wins():
    views = (make_view("bare", holds=False), make_view("holder", holds=True),
             make_view("both", holds=True, matched=6))
    assert make_policy().choose(make_input(*views))[:2] == ["both", "holder"]


def test_a_busy_holder_loses_to_an_idle_non_holder_only_when_queueing_costs_more_than_the_load():
    policy = make_policy()
    slightly_busy = (make_view("holder", holds=True, queued=int(LOAD) - 4), make_view("idle", holds=False))
    assert policy.choose(make_input(*slightly_busy))[0] == "holder"
    busy = (make_view("holder", holds=True, queued=int(LOAD) + 4), make_view("idle", holds=False))
    assert policy.choose(make_input(*busy))[0] == "idle"


def test_a_full_stray_replica_pays_the_eviction_penalty_and_a_home_does_not():
    policy = make_policy()
    ids = ["r0", "r1", "r2"]
    home = min(ids, key=lambda r: rendezvous(adapter_key("chat"), r))
    strays = [r for r in ids if r != home]
    # Everyone full and without the adapter; the home is busier by less than the penalty.
    views = [make_view(r, holds=False, num_adapters=4, max_adapters=4, queued=(EVICT - 50 if r == home else 0))
             for r in ids]
    assert policy.choose(make_input(*views))[0] == home
    # A stray with a free slot pays the load only.
    views = [make_view(r, holds=False, num_adapters=(4 if r != strays[0] else 1), max_adapters=4,
                       queued=(EVICT - 50 if r == home else 0)) for r in ids]
    assert policy.choose(make_input(*views))[0] == strays[0]


def test_homes_grow_with_the_rate_at_once_and_shrink_with_hysteresis():
    homes = AdapterHomes(rps_per_home=2.0, shrink_ratio=0.5)
    assert homes.size("hot", 9.0, 100) == 5
    assert homes.size("hot", 9.0, 100) == 5  # idempotent
    assert homes.size("hot", 5.5, 100) == 5  # a dip does not drop a home
    assert homes.size("hot", 3.5, 100) == 4  # below half the rate that set k: k follows
    assert homes.size("hot", 12.0, 4) == 4  # capped by the fleet, remembered uncapped
    assert homes.size("hot", 12.0, 100) == 6
    for rate in (0.1, 1.5, 1.9, 0.5, 1.0):
        assert homes.size("cold", rate, 100) == 1
    assert len(homes) == 1  # only the hot adapter is stored
    assert AdapterHomes(rps_per_home=0).size("hot", 50.0, 100) == 1


def _route(core: RoutingCore, fleet: list[str], holders: dict[str, set], adapter: str, now: list[float]) -> str:
    """One decision over a fleet of full replicas whose queues are what this router sent in the
    last second; the chosen replica loads the adapter."""
    ranked = core.decide([adapter.encode().ljust(16, b".")], 64, fleet, {},
                         lambda rid, m: make_view(rid, holds=rid in holders.setdefault(adapter, set()), matched=m,
                                                  queued=core.pending_tokens(rid, now[0] - 1.0), num_adapters=4,
                                                  max_adapters=4),
                         adapter=adapter, adapter_holders=sorted(holders.get(adapter, ())))
    holders[adapter].add(ranked[0])
    now[0] += 0.1
    return ranked[0]


def test_a_hot_adapter_spreads_over_more_replicas_and_a_cold_one_stays_home():
    now = [0.0]
    fleet = [f"replica-{i:03d}" for i in range(40)]
    core = RoutingCore(make_policy(adapter_rps_per_home=2.0), 16, clock=lambda: now[0], rng=random.Random(0))
    holders: dict[str, set] = {}
    # 10 req/s of "hot" (5 homes at 2 req/s each) for 40 s, then 20 s more.
    hot_targets = [_route(core, fleet, holders, "hot", now) for _ in range(400)]
    assert len(set(hot_targets)) >= 5  # spread, not piled on the first holder
    homes = core.adapter_homes(fleet, "hot", 5)
    assert homes == sorted(fleet, key=lambda r: rendezvous(adapter_key("hot"), r))[:5]
    assert core.adapter_homes(fleet, "hot", 12) == sorted(fleet, key=lambda r: rendezvous(adapter_key("hot"), r))[:12]
    assert set(homes) <= holders["hot"]  # its homes hold it
    settled = set(holders["hot"])
    for _ in range(200):
        _route(core, fleet, holders, "hot", now)
    assert holders["hot"] == settled  # and then no more loads at a steady rate
    # A cold adapter: one request every 5 s, always to the same replica, no new loads.
    cold_targets = []
    for _ in range(10):
        now[0] += 5.0
        cold_targets.append(_route(core, fleet, holders, "cold", now))
    assert len(set(cold_targets)) == 1
    assert core.policy.num_adapter_homes("cold", 0.2, len(fleet)) == 1


def test_requests_without_an_adapter_rank_as_before():
    rng = random.Random(3)
    policy = make_policy()
    for _ in range(50):
        views = [ReplicaView(f"r{i}", num_running=rng.randrange(4), matched_blocks=rng.randrange(9),
                             num_prefill_tokens=rng.randrange(500), num_kv_blocks=1000) for i in range(6)]
        with_adapters = [ReplicaView(**{**v.__dict__, "holds_adapter": rng.random() < 0.5,
                                        "num_adapters": 4, "max_adapters": 4}) for v in views]
        base = RoutingInput(8, 128, views, block_size=16, prefix_key=b"k" * 16)
        mixed = RoutingInput(8, 128, with_adapters, block_size=16, prefix_key=b"k" * 16)
        assert policy.choose(mixed) == policy.choose(base) == get_policy("prefix_cost").choose(base)


def test_adapter_affinity_prefers_holders_with_room_then_load():
    policy = get_policy("adapter_affinity", max_ongoing_requests=4)
    views = (make_view("idle"), make_view("holder", holds=True, running=2), make_view("full", holds=True, running=4))
    assert policy.choose(make_input(*views)) == ["holder", "idle", "full"]
    assert policy.choose(make_input(*views, adapter="")) == ["idle", "holder", "full"]


def test_views_carry_the_replicas_adapters():
    stats = ReplicaStats("r1", 1, 0, 0, 0.2, 3, lora_adapters=(("chat", "c0ffee"),), max_cpu_loras=4)
    view = ReplicaView.from_stats(stats, 2, adapter="chat")
    assert (view.holds_adapter, view.num_adapters, view.max_adapters) == (True, 1, 4)
    assert ReplicaView.from_stats(stats, 2, adapter="sql").holds_adapter is False
    assert ReplicaView.from_stats(stats, 2).holds_adapter is None


def test_the_serve_router_passes_the_adapter_and_its_holders_to_the_policy():
    import asyncio

    serve_common = pytest.importorskip("ray.serve._private.common")
    from cluster.shared.types import GenerationRequest, LoRARequest, SamplingParams
    from router.serve_router import PrefixAwareRequestRouter
    from tests.unit.test_serve_router import FakeReplica

    router = PrefixAwareRequestRouter(serve_common.DeploymentID("d", "app"),
                                      serve_common.DeploymentHandleSource.UNKNOWN)
    router.initialize_state(redis_url=None, block_size=4, model_fingerprint="fp")
    holder, full = FakeReplica("holder"), FakeReplica("full")
    holder.routing_stats = {"lora_adapters": (("chat", "c0ffee"),), "max_cpu_loras": 4, "num_prefill_tokens": 20}
    full.routing_stats = {"lora_adapters": tuple((f"a{i}", str(i)) for i in range(4)), "max_cpu_loras": 4}

    def first(lora_request):
        request = GenerationRequest("x", list(range(12)), SamplingParams(), lora_request=lora_request)
        return asyncio.run(router._choose_for(request, [full, holder]))[0][0].replica_id.unique_id

    assert first(None) == "full"  # the base model: the emptier queue
    assert first(LoRARequest("chat")) == "holder"  # 20 queued tokens cost less than a load and an eviction


def test_a_replicas_measured_load_price_replaces_the_configured_one():
    """A busy holder keeps a request against an idle replica whose measured load costs more than
    the holder's queue, and loses it to one whose measured load costs less, whatever the default."""
    policy = make_policy()
    holder = make_view("holder", holds=True, queued=100)
    for measured, winner in ((400.0, "holder"), (60.0, "idle"), (0.0, "idle")):  # 0: not measured, LOAD (32)
        idle = ReplicaView("idle", matched_blocks=0, num_kv_blocks=1000, holds_adapter=False,
                           adapter_load_tokens=measured)
        assert policy.choose(make_input(holder, idle))[0] == winner, measured
    assert get_policy("prefix_cost", adapter_load_tokens=500).choose(make_input(holder, ReplicaView(
        "idle", matched_blocks=0, num_kv_blocks=1000, holds_adapter=False)))[0] == "holder"
    stats = ReplicaStats("r1", 0, 0, 0, 0.0, 0, lora_load_tokens=57.5)
    assert ReplicaView.from_stats(stats, 0, adapter="chat").adapter_load_tokens == 57.5
    with pytest.raises(ValueError, match="adapter_load_tokens"):
        ReplicaView("r", adapter_load_tokens=-1.0)


def test_the_serve_router_reads_the_measured_load_price():
    serve_common = pytest.importorskip("ray.serve._private.common")
    from router.serve_router import PrefixAwareRequestRouter
    from tests.unit.test_serve_router import FakeReplica

    router = PrefixAwareRequestRouter(serve_common.DeploymentID("d", "app"),
                                      serve_common.DeploymentHandleSource.UNKNOWN)
    router.initialize_state(redis_url=None, block_size=4, model_fingerprint="fp")
    replica = FakeReplica("r")
    for reported, read in ((123.5, 123.5), ("nan", 0.0), (-4, 0.0), (None, 0.0)):
        replica.routing_stats = {"lora_adapters": (), "lora_load_tokens": reported}
        assert router._view(replica, 0, "chat").adapter_load_tokens == read


# ---------------------------------------------------------------- simulator
def sim_args(tmp_path, **overrides):
    parser = argparse.ArgumentParser()
    simulate.add_simulate_args(parser)
    args = parser.parse_args(["--requests", "1500", "--tenants", "50", "--documents", "100", "--blocks-per-replica",
                              "2048", "--adapters", "60", "--max-cpu-loras", "4", "--adapter-load-ms", "50",
                              "--json", str(tmp_path / "sim.json"), "--plot", ""])
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def test_the_placement_loads_fewer_adapters_than_random(tmp_path):
    args = sim_args(tmp_path)
    trace = simulate.synthetic_trace(args, args.rate_per_replica * 20)
    assert len({r.adapter for r in trace}) > 20
    results = {policy: simulate.run_one(args, trace, policy, 20, num_routers=2)
               for policy in ("prefix_cost", "adapter_affinity", "random")}
    placed, rand = results["prefix_cost"], results["random"]
    assert placed["adapter_loads_per_min"] < 0.6 * rand["adapter_loads_per_min"]
    assert placed["ttft_p99_s"] < rand["ttft_p99_s"]
    again = simulate.run_one(args, trace, "prefix_cost", 20, num_routers=2)
    assert again["adapter_loads_per_min"] == placed["adapter_loads_per_min"]  # seeded


def test_the_adapter_options_are_checked(tmp_path):
    assert simulate.run_simulate(sim_args(tmp_path, max_cpu_loras=0)) == 2
    with pytest.raises(ValueError, match="adapter_load_tokens"):
        simulate.run_simulate(sim_args(tmp_path, policy_params={"prefix_cost": {"adapter_load_tokens": -1}}))
