"""The decision core shared by the Serve router and the simulator (router/decision.py)."""

from __future__ import annotations

import random

import pytest

from router.decision import RoutingCore
from router.policies import ReplicaView, get_policy

CHAIN = [bytes([i]) * 16 for i in range(8)]


def idle_view(rid, matched):
    return ReplicaView(rid, matched_blocks=matched)


def test_large_fleet_ranks_holders_and_a_sample_only():
    ids = [f"r{i}" for i in range(1000)]
    core = RoutingCore(get_policy("prefix_cost"), block_size=16, rng=random.Random(0), clock=lambda: 100.0)
    seen = []

    def view(rid, matched):
        seen.append(rid)
        return idle_view(rid, matched)

    ranked = core.decide(CHAIN, 128, ids, {"r500": 8, "r7": 3}, view)
    assert ranked[0] == "r500"
    assert {"r500", "r7"} <= set(ranked) and len(ranked) == len(seen) <= 2 + core.sample_size
    # A small fleet is ranked whole.
    assert sorted(RoutingCore(get_policy("prefix_cost"), 16).decide(CHAIN, 128, ids[:5], {}, idle_view)) == ids[:5]


def test_the_core_credits_what_it_sent_and_counts_its_pending_tokens():
    now = [10.0]
    core = RoutingCore(get_policy("prefix_cost"), block_size=16, clock=lambda: now[0])
    ids = ["a", "b"]
    first = core.decide(CHAIN, 128, ids, {}, idle_view)[0]
    assert core.pending_tokens(first, stats_at=5.0) == 128  # sent after those stats
    assert core.pending_tokens(first, stats_at=11.0) == 0  # newer stats include it
    now[0] = 11.0
    # The directory does not know the chain yet; the router's own send is credited.
    assert core.decide(CHAIN, 128, ids, {}, idle_view)[0] == first
    assert core.decide(CHAIN, 128, ids, None, idle_view)  # directory down: still ranks


def test_a_hot_prefix_brings_its_rendezvous_replicas_into_the_candidates():
    ids = [f"r{i}" for i in range(200)]
    now = [0.0]
    core = RoutingCore(get_policy("prefix_cost", hot_prefix_rps=1.0), block_size=16, clock=lambda: now[0],
                       rng=random.Random(1))
    for i in range(400):  # 40 requests/s for 10 s
        now[0] = i * 0.025
        ranked = core.decide(CHAIN, 128, ids, {"r0": 8}, idle_view)
    hot = core.hot_set(ids, CHAIN[0], get_policy("prefix_cost", hot_prefix_rps=1.0).num_hot_for(25.0, 200))
    assert len(hot) >= 20 and set(hot) <= set(ranked)


def test_one_request_at_one_of_many_routers_is_not_a_hot_prefix():
    core = RoutingCore(get_policy("prefix_cost"), block_size=16, num_routers=100)
    window = core.rates.window_s
    assert core.cluster_rate(1 / window) == 1 / window  # one request in the window: its own rate
    assert core.cluster_rate(5 / window) == pytest.approx(500 / window)  # enough to extrapolate


def test_a_recent_send_never_outweighs_a_confirmed_holder():
    # Sent to "b" while the directory was down; the directory now confirms "a".
    now = [0.0]
    core = RoutingCore(get_policy("cache_aware"), block_size=16, clock=lambda: now[0])
    core.recent.record(CHAIN, "b", now=0.0)
    now[0] = 1.0
    assert core.decide(CHAIN, 128, ["a", "b"], {"a": 8}, idle_view)[0] == "a"
    # ... while past the directory's knowledge it is credited.
    fresh = RoutingCore(get_policy("cache_aware"), block_size=16, clock=lambda: now[0])
    fresh.recent.record(CHAIN, "b", now=0.5)
    assert fresh.decide(CHAIN, 128, ["a", "b"], {"a": 2}, idle_view)[0] == "b"
