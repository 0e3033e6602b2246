"""Routing policies (router/policies): exact choices on hand-built replica views."""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.shared.types import ReplicaStats
from router.policies import (
    DEFAULT_POLICY,
    CacheAwarePolicy,
    LeastLoadPolicy,
    Policy,
    PowerOfTwoPolicy,
    PrefixCostPolicy,
    ReplicaView,
    RoundRobinPolicy,
    RoutingInput,
    get_policy,
    policy_names,
)


def make_view(replica_id: str, running: int = 0, matched=None, **kw) -> ReplicaView:
    return ReplicaView(replica_id=replica_id, num_running=running, matched_blocks=matched, **kw)


def make_input(*views: ReplicaView, num_blocks: int = 32) -> RoutingInput:
    return RoutingInput(num_blocks=num_blocks, num_prompt_tokens=num_blocks * 16, replicas=tuple(views))


def with_load(inp: RoutingInput, replica_id: str, delta: int = 1, matched=None) -> RoutingInput:
    """Returns ``inp`` with one more running sequence on ``replica_id``."""
    views = []
    for v in inp.replicas:
        if v.replica_id == replica_id:
            v = dataclasses.replace(v, num_running=v.num_running + delta)
            if matched is not None:
                v = dataclasses.replace(v, matched_blocks=matched)
        views.append(v)
    return dataclasses.replace(inp, replicas=tuple(views))


# ---------------------------------------------------------------- interface


def test_registry_names_default_and_instances():
    assert DEFAULT_POLICY == "prefix_cost"
    assert policy_names() == ["prefix_cost", "cache_aware", "least_load", "power_of_two", "round_robin"]
    assert isinstance(get_policy(), PrefixCostPolicy)
    for name in policy_names():
        policy = get_policy(name)
        assert isinstance(policy, Policy)
        assert policy.name == name


def test_unknown_policy_name_lists_choices():
    with pytest.raises(
        ValueError, match="unknown routing policy 'fastest'.*prefix_cost, cache_aware, least_load, power_of_two, round_robin"
    ):
        get_policy("fastest")


def test_unknown_parameter_lists_accepted_ones():
    with pytest.raises(ValueError, match="accepts: .*balance_abs_threshold"):
        get_policy("cache_aware", cache_threshold=0.5)


@pytest.mark.parametrize(
    "params",
    [
        {"balance_abs_threshold": -1},
        {"balance_rel_threshold": 0.5},
        {"min_match_ratio": 1.5},
        {"min_match_blocks": 0},
        {"kv_high_water": 0.0},
        {"swapped_weight": -1.0},
    ],
)
def test_bad_cache_aware_thresholds_are_rejected(params):
    with pytest.raises(ValueError, match=next(iter(params))):
        get_policy("cache_aware", **params)


def test_views_and_inputs_validate():
    with pytest.raises(ValueError, match="kv_cache_usage"):
        ReplicaView("a", kv_cache_usage=1.5)
    with pytest.raises(ValueError, match="num_waiting"):
        ReplicaView("a", num_waiting=-1)
    with pytest.raises(ValueError, match="unique"):
        make_input(make_view("a"), make_view("a"))


def test_view_from_stats():
    stats = ReplicaStats("r1", num_running=3, num_waiting=2, num_swapped=1, kv_cache_usage=0.5, num_cached_blocks=7)
    view = ReplicaView.from_stats(stats, matched_blocks=4)
    assert view == ReplicaView("r1", 3, 2, 1, 0.5, 7, 4)


def test_empty_replica_list_gives_empty_ranking():
    for name in policy_names():
        assert get_policy(name).choose(make_input()) == []


# ---------------------------------------------------------------- least_load


def test_least_load_orders_by_load_then_kv_then_id():
    inp = make_input(
        make_view("a", running=2),
        make_view("b", running=1, num_waiting=1, kv_cache_usage=0.2),
        make_view("c", running=1, kv_cache_usage=0.9),
        make_view("d", running=1, kv_cache_usage=0.1),
        make_view("e", running=1, kv_cache_usage=0.1),
    )
    # loads: a=2, b=2, c=1, d=1, e=1
    assert LeastLoadPolicy().choose(inp) == ["d", "e", "c", "a", "b"]


def test_least_load_weights_swapped_sequences():
    inp = make_input(make_view("a", running=2), make_view("b", num_swapped=1))
    assert LeastLoadPolicy().choose(inp) == ["b", "a"]
    assert LeastLoadPolicy(swapped_weight=3.0).choose(inp) == ["a", "b"]


# ---------------------------------------------------------------- round_robin


def test_round_robin_cycles_in_id_order_whatever_the_input_order():
    policy = RoundRobinPolicy()
    views = [make_view("c"), make_view("a"), make_view("b", running=9)]
    firsts = []
    for i in range(6):
        rotated = views[i % 3 :] + views[: i % 3]
        ranking = policy.choose(make_input(*rotated))
        assert sorted(ranking) == ["a", "b", "c"]
        firsts.append(ranking[0])
    assert firsts == ["a", "b", "c", "a", "b", "c"]
    assert RoundRobinPolicy(start=1).choose(make_input(*views)) == ["b", "c", "a"]


# ---------------------------------------------------------------- power_of_two


def test_power_of_two_is_deterministic_with_a_seeded_rng():
    views = [make_view(f"r{i}", running=i) for i in range(6)]
    inp = make_input(*views)
    first = [PowerOfTwoPolicy(rng=random.Random(7)).choose(inp) for _ in range(3)]
    policy_a, policy_b = PowerOfTwoPolicy(rng=random.Random(42)), PowerOfTwoPolicy(seed=42)
    seq_a = [policy_a.choose(inp) for _ in range(20)]
    seq_b = [policy_b.choose(inp) for _ in range(20)]
    assert first[0] == first[1] == first[2]
    assert seq_a == seq_b
    # Input order does not matter either.
    assert PowerOfTwoPolicy(seed=42).choose(make_input(*reversed(views))) == seq_a[0]


def test_power_of_two_takes_the_less_loaded_of_its_two_samples():
    views = [make_view(f"r{i}", running=10 * i) for i in range(5)]
    inp = make_input(*views)
    rng = random.Random(3)
    expected_pair = random.Random(3).sample(sorted(views, key=lambda v: v.replica_id), 2)
    best, other = sorted(expected_pair, key=lambda v: v.num_running)
    ranking = PowerOfTwoPolicy(rng=rng).choose(inp)
    assert ranking[:2] == [best.replica_id, other.replica_id]
    rest = [v.replica_id for v in views if v not in expected_pair]
    assert ranking[2:] == rest  # least-load order (views are built ascending)


def test_power_of_two_never_picks_the_most_loaded_of_several():
    views = [make_view("hot", running=50), make_view("a"), make_view("b"), make_view("c")]
    policy = PowerOfTwoPolicy(seed=0)
    assert all(policy.choose(make_input(*views))[0] != "hot" for _ in range(100))


# ---------------------------------------------------------------- cache_aware


def test_longest_match_wins_when_balanced():
    inp = make_input(
        make_view("a", running=2, matched=12),
        make_view("b", running=3, matched=24),
        make_view("c", running=0, matched=0),
    )
    assert CacheAwarePolicy().choose(inp) == ["b", "a", "c"]


def test_equal_matches_break_ties_by_load_then_id():
    inp = make_input(
        make_view("b", running=1, matched=16),
        make_view("a", running=1, matched=16),
        make_view("c", running=0, matched=16),
    )
    assert CacheAwarePolicy().choose(inp) == ["c", "a", "b"]


def test_overloaded_prefix_holder_loses_to_an_idle_replica():
    inp = make_input(make_view("holder", running=20, matched=32), make_view("idle", running=0, matched=0))
    assert CacheAwarePolicy().choose(inp) == ["idle", "holder"]
    # Just inside the slack (least load 0 + abs 8) the holder still wins.
    inp = make_input(make_view("holder", running=8, matched=32), make_view("idle", running=0, matched=0))
    assert CacheAwarePolicy().choose(inp) == ["holder", "idle"]


def test_relative_threshold_gives_slack_when_everyone_is_busy():
    # least load 40: limit = max(40 + 8, 1.5 * 40) = 60.
    busy = make_view("idle", running=40, matched=0)
    assert CacheAwarePolicy().choose(make_input(make_view("h", running=60, matched=32), busy))[0] == "h"
    assert CacheAwarePolicy().choose(make_input(make_view("h", running=61, matched=32), busy))[0] == "idle"


def test_holder_with_full_kv_cache_gets_no_affinity():
    inp = make_input(
        make_view("full", running=3, matched=32, kv_cache_usage=0.96),
        make_view("other", running=1, matched=0, kv_cache_usage=0.3),
    )
    assert CacheAwarePolicy().choose(inp) == ["other", "full"]
    assert CacheAwarePolicy(kv_high_water=1.0).choose(inp) == ["full", "other"]


def test_small_matches_fall_back_to_least_load():
    # 9 of 32 blocks = 0.28 < min_match_ratio 0.3: not worth a busier replica.
    inp = make_input(make_view("a", running=3, matched=9), make_view("b", running=1, matched=0))
    assert CacheAwarePolicy().choose(inp) == ["b", "a"]
    inp = make_input(make_view("a", running=3, matched=10), make_view("b", running=1, matched=0))
    assert CacheAwarePolicy().choose(inp) == ["a", "b"]
    # min_match_blocks: 2 matched blocks are a full 100 % of a 2-block prompt.
    inp = make_input(make_view("a", running=3, matched=2), make_view("b", running=1, matched=0), num_blocks=2)
    assert CacheAwarePolicy().choose(inp) == ["a", "b"]
    assert CacheAwarePolicy(min_match_blocks=3).choose(inp) == ["b", "a"]


def test_prompt_without_full_blocks_routes_on_load():
    inp = make_input(make_view("a", running=3, matched=0), make_view("b", running=1, matched=0), num_blocks=0)
    assert CacheAwarePolicy().choose(inp) == ["b", "a"]


def test_unconfirmed_replica_counts_as_holding_nothing():
    # Directory answered for "a" only; "b" (None) may hold the prefix, but it is
    # not confirmed, so it gets no affinity.
    inp = make_input(make_view("a", running=2, matched=4), make_view("b", running=0, matched=None))
    assert CacheAwarePolicy().choose(inp) == ["b", "a"]
    inp = make_input(make_view("a", running=2, matched=16), make_view("b", running=0, matched=None))
    assert CacheAwarePolicy().choose(inp) == ["a", "b"]


def test_redis_down_behaves_exactly_like_least_load():
    views = [
        make_view("a", running=5, kv_cache_usage=0.2),
        make_view("b", running=1, num_swapped=2),
        make_view("c", running=3, kv_cache_usage=0.1),
        make_view("d", running=3, kv_cache_usage=0.05),
    ]
    inp = make_input(*views)
    # loads: a=5, b=1+2 swapped=3, c=3, d=3; ties by KV use.
    assert CacheAwarePolicy().choose(inp) == LeastLoadPolicy().choose(inp) == ["b", "d", "c", "a"]


@pytest.mark.parametrize("learns_prefix", [False, True])
def test_hot_prefix_spreads_under_concurrency(learns_prefix):
    """Many concurrent requests for one cached prefix: the holder is preferred
    only while within the load slack, so requests spread and load stays bounded.
    With ``learns_prefix`` a replica that served the prefix holds it from then on."""
    policy = CacheAwarePolicy()
    inp = make_input(make_view("a", matched=32), make_view("b", matched=0), make_view("c", matched=0))
    counts = {"a": 0, "b": 0, "c": 0}
    for _ in range(120):
        chosen = policy.choose(inp)[0]
        counts[chosen] += 1
        inp = with_load(inp, chosen, matched=32 if learns_prefix else None)
        loads = [v.num_running for v in inp.replicas]
        assert max(loads) <= policy.load_limit(min(loads)) + 1
    assert sum(1 for n in counts.values() if n > 0) > 1
    assert counts["a"] == max(counts.values())  # affinity still pays off
    assert min(counts.values()) > 0


def test_hot_prefix_on_two_replicas_alternates_once_both_hold_it():
    policy = CacheAwarePolicy(balance_abs_threshold=2)
    inp = make_input(make_view("a", matched=32), make_view("b", matched=32))
    firsts = []
    for _ in range(6):
        chosen = policy.choose(inp)[0]
        firsts.append(chosen)
        inp = with_load(inp, chosen)
    assert firsts == ["a", "b", "a", "b", "a", "b"]


# ---------------------------------------------------------------- properties


@st.composite
def routing_inputs(draw):
    num_blocks = draw(st.integers(min_value=0, max_value=64))
    ids = draw(st.lists(st.text("abcxyz0123-", min_size=1, max_size=6), max_size=8, unique=True))
    redis_up = draw(st.booleans())
    views = []
    for replica_id in ids:
        matched = None
        if redis_up:
            matched = draw(st.one_of(st.none(), st.integers(min_value=0, max_value=num_blocks + 4)))
        views.append(
            ReplicaView(
                replica_id=replica_id,
                num_running=draw(st.integers(0, 300)),
                num_waiting=draw(st.integers(0, 300)),
                num_swapped=draw(st.integers(0, 50)),
                kv_cache_usage=draw(st.floats(0.0, 1.0)),
                num_cached_blocks=draw(st.integers(0, 10_000)),
                matched_blocks=matched,
            )
        )
    return RoutingInput(num_blocks=num_blocks, num_prompt_tokens=num_blocks * 16 + 3, replicas=tuple(views))


_PROPERTY_POLICIES = {
    name: get_policy(name, **({"seed": 0} if name == "power_of_two" else {})) for name in policy_names()
}
_PROPERTY_POLICIES["cache_aware_tight"] = CacheAwarePolicy(
    balance_abs_threshold=0, balance_rel_threshold=1.0, min_match_ratio=0.0
)


@settings(max_examples=300, deadline=None)
@given(inp=routing_inputs())
def test_every_policy_returns_a_permutation_of_the_replicas(inp):
    ids = sorted(v.replica_id for v in inp.replicas)
    for name, policy in _PROPERTY_POLICIES.items():
        ranking = policy.choose(inp)
        assert sorted(ranking) == ids, name


@settings(max_examples=200, deadline=None)
@given(inp=routing_inputs())
def test_cache_aware_first_choice_is_never_overloaded_or_unconfirmed(inp):
    policy = CacheAwarePolicy()
    ranking = policy.choose(inp)
    if not ranking:
        return
    views = {v.replica_id: v for v in inp.replicas}
    least = LeastLoadPolicy().choose(inp)
    if not inp.directory_available:
        assert ranking == least
        return
    first = views[ranking[0]]
    if ranking[0] != least[0]:
        # Only an eligible, confirmed holder may displace the least-loaded
        # replica -- or, when there is none, the emptiest cache that is
        # neither overloaded nor nearly full.
        assert first.kv_cache_usage < policy.kv_high_water
        candidates = policy.affinity_candidates(inp)
        if candidates:
            assert first in candidates
            assert first.matched_blocks is not None and first.matched_blocks >= 1
        else:
            loads = [r.num_running + r.num_waiting + r.num_swapped for r in inp.replicas]
            assert first.num_running + first.num_waiting + first.num_swapped <= policy.load_limit(min(loads))
            fit = [r for r in inp.replicas if r.kv_cache_usage < policy.kv_high_water
                   and r.num_running + r.num_waiting + r.num_swapped <= policy.load_limit(min(loads))]
            assert first.num_cached_blocks == min(r.num_cached_blocks for r in fit)


def test_cache_aware_places_new_prefixes_on_the_emptiest_cache():
    """No holder: not the idle replica with the smaller id (least load's tie-break)
    but the one whose cache holds fewer blocks, so tenants spread over the caches."""
    policy = CacheAwarePolicy()
    views = (ReplicaView("a", num_cached_blocks=96, matched_blocks=0),
             ReplicaView("b", num_cached_blocks=32, matched_blocks=0))
    assert policy.choose(RoutingInput(8, 128, views)) == ["b", "a"]
    # ... unless it is overloaded or nearly full.
    busy = (ReplicaView("a", num_cached_blocks=96, matched_blocks=0),
            ReplicaView("b", num_running=20, num_cached_blocks=32, matched_blocks=0))
    assert policy.choose(RoutingInput(8, 128, busy)) == ["a", "b"]
    full = (ReplicaView("a", num_cached_blocks=96, matched_blocks=0),
            ReplicaView("b", kv_cache_usage=0.99, num_cached_blocks=32, matched_blocks=0))
    assert policy.choose(RoutingInput(8, 128, full)) == ["a", "b"]


def test_the_cluster_config_accepts_exactly_the_registered_policies():
    from cluster.shared.config import ROUTING_POLICIES

    assert sorted(ROUTING_POLICIES) == sorted(policy_names())
