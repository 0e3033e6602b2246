"""The prefix-cost policy (router/policies/prefix_cost.py) and the per-prefix
rate estimate it reads (router/prefix_rates.py): exact choices on hand-built
views, and properties over random ones."""

from __future__ import annotations

import collections
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.policies import PrefixCostPolicy, ReplicaView, RoutingInput, get_policy
from router.policies.prefix_cost import rendezvous
from router.prefix_rates import PrefixRates

B = 16


def inp(*views, prompt=512, key=b"k", rate=0.0):
    return RoutingInput(num_blocks=prompt // B, num_prompt_tokens=prompt, replicas=tuple(views), block_size=B,
                        prefix_key=key, prefix_rate=rate)


def test_holder_keeps_the_request_while_its_queue_is_shorter_than_the_saved_prefill():
    # The holder saves 512 - 32 = 480 tokens of prefill (30 of 32 blocks); at
    # new_prefill_weight w it keeps the request while its queue is below w * 480.
    for weight in (1.0, 2.0):
        policy = PrefixCostPolicy(new_prefill_weight=weight, decode_token_weight=0, sequence_tokens=0)
        for queued_on_holder, expected in ((0, "holder"), (479 * weight, "holder"), (481 * weight, "other")):
            views = (ReplicaView("holder", matched_blocks=30, num_prefill_tokens=int(queued_on_holder)),
                     ReplicaView("other", matched_blocks=0))
            assert policy.choose(inp(*views))[0] == expected, (weight, queued_on_holder)


def test_the_same_queues_give_different_choices_for_short_and_long_prompts():
    # Sequence counts are equal; only the tokens differ. A 4-block match is
    # worth 64 tokens: not enough to wait behind 200 queued tokens, while a
    # 60-block match (960 tokens) is.
    policy = PrefixCostPolicy(new_prefill_weight=1.0, decode_token_weight=0)
    short = (ReplicaView("holder", num_waiting=1, matched_blocks=4, num_prefill_tokens=200),
             ReplicaView("other", num_waiting=1, matched_blocks=0, num_prefill_tokens=0))
    long = (ReplicaView("holder", num_waiting=1, matched_blocks=60, num_prefill_tokens=200),
            ReplicaView("other", num_waiting=1, matched_blocks=0, num_prefill_tokens=0))
    assert policy.choose(inp(*short, prompt=128))[0] == "other"
    assert policy.choose(inp(*long, prompt=1024))[0] == "holder"


def test_a_small_match_still_counts():
    # cache_aware ignored matches below 30 % of the prompt; here 2 of 32 blocks break the tie.
    views = (ReplicaView("a", matched_blocks=0), ReplicaView("b", matched_blocks=2))
    assert PrefixCostPolicy(pack_max_seqs=8).choose(inp(*views))[0] == "b"


def test_decode_load_and_sequence_counts_add_to_the_cost():
    policy = PrefixCostPolicy(new_prefill_weight=1.0, decode_token_weight=0.5, sequence_tokens=10)
    views = (ReplicaView("a", num_running=2, num_decode_tokens=100),  # 50 + 20
             ReplicaView("b", num_running=1, num_decode_tokens=150))  # 75 + 10
    assert policy.choose(inp(*views)) == ["a", "b"]
    assert policy.sort_key(inp(*views), views[0], 0)[1] == 512 + 50 + 20


@pytest.mark.parametrize("usage,blocks,first", [(0.96, 0, "b"), (0.5, 100, "a"), (0.5, 4, "b")])
def test_a_replica_without_kv_headroom_ranks_after_those_with_it(usage, blocks, first):
    # "a" holds 30 of the 32 blocks and is otherwise idle: it wins unless it is
    # nearly full, or has fewer free blocks (0.5 * 4 = 2) than the request's
    # 2 new blocks + 1 need.
    views = (ReplicaView("a", matched_blocks=30, kv_cache_usage=usage, num_kv_blocks=blocks),
             ReplicaView("b", matched_blocks=0, num_kv_blocks=1000, num_prefill_tokens=5000))
    assert PrefixCostPolicy(pack_max_seqs=8).choose(inp(*views))[0] == first


def test_headroom_counts_the_new_blocks():
    policy = PrefixCostPolicy()
    view = ReplicaView("a", kv_cache_usage=0.9, num_kv_blocks=100)  # 10 free blocks
    assert policy.has_headroom(view, new_prefill=9 * B, block=B)  # 9 + 1
    assert not policy.has_headroom(view, new_prefill=9 * B + 1, block=B)  # 10 + 1


def test_directory_down_ranks_by_queued_work_alone():
    views = (ReplicaView("a", num_prefill_tokens=300), ReplicaView("b", num_prefill_tokens=100),
             ReplicaView("c", num_prefill_tokens=200))
    assert PrefixCostPolicy(pack_max_seqs=8).choose(inp(*views)) == ["b", "c", "a"]


def test_ties_follow_the_prefix_alike_in_every_router_and_spread_over_prefixes():
    ids = ["r0", "r1", "r2", "r3"]
    firsts = collections.Counter()
    for i in range(2000):
        key = i.to_bytes(4, "little")
        forward = PrefixCostPolicy(pack_max_seqs=8).choose(inp(*[ReplicaView(r) for r in ids], key=key))
        backward = PrefixCostPolicy(pack_max_seqs=8).choose(inp(*[ReplicaView(r) for r in reversed(ids)], key=key))
        assert forward == backward == sorted(ids, key=lambda r: rendezvous(key, r))
        firsts[forward[0]] += 1
    assert set(firsts) == set(ids)
    assert all(350 <= n <= 650 for n in firsts.values()), firsts


def test_hot_prefix_is_replicated_on_its_rendezvous_replicas():
    ids = [f"r{i}" for i in range(8)]
    key = b"hot-tenant"
    order = sorted(ids, key=lambda r: rendezvous(key, r))
    holder = order[5]  # holds the prefix, but is not among the first rendezvous replicas
    policy = PrefixCostPolicy(new_prefill_weight=1.0, hot_prefix_rps=4.0, decode_token_weight=0, sequence_tokens=0)

    def views(queued_on_holder):
        return [ReplicaView(r, matched_blocks=30 if r == holder else 0,
                            num_prefill_tokens=queued_on_holder if r == holder else 100) for r in ids]

    # Not hot: the holder wins (its queue of 300 < 480 saved + 100).
    assert policy.choose(inp(*views(300), key=key, rate=3.0))[0] == holder
    assert policy.num_hot_replicas(inp(*views(300), key=key, rate=3.0)) == 1
    # 10 req/s over 4 req/s per replica: k = 3 replicas are priced as holders:
    # the first three rendezvous replicas (queue 100) beat the holder (300).
    hot = inp(*views(300), key=key, rate=10.0)
    assert policy.num_hot_replicas(hot) == 3
    assert policy.choose(hot)[:3] == order[:3]
    credited = policy.credited_matches(hot)
    assert {r for r, m in credited.items() if m == 30} == set(order[:3]) | {holder}
    # Replication off: the holder again.
    assert PrefixCostPolicy(new_prefill_weight=1.0, hot_prefix_rps=0, decode_token_weight=0,
                            sequence_tokens=0).choose(hot)[0] == holder


@pytest.mark.parametrize("params", [{"new_prefill_weight": -1}, {"decode_token_weight": -1}, {"sequence_tokens": math.inf},
                                    {"kv_high_water": 0}, {"hot_prefix_rps": -0.5}])
def test_bad_parameters_are_rejected_by_name(params):
    with pytest.raises(ValueError, match=next(iter(params))):
        get_policy("prefix_cost", **params)


@st.composite
def cost_inputs(draw):
    n = draw(st.integers(1, 6))
    num_blocks = draw(st.integers(0, 64))
    views = [ReplicaView(f"r{i}", num_running=draw(st.integers(0, 40)), num_waiting=draw(st.integers(0, 40)),
                         num_swapped=draw(st.integers(0, 5)), kv_cache_usage=draw(st.floats(0, 1)),
                         matched_blocks=draw(st.one_of(st.none(), st.integers(0, num_blocks + 3))),
                         num_prefill_tokens=draw(st.integers(0, 10_000)),
                         num_decode_tokens=draw(st.integers(0, 50_000)), num_kv_blocks=draw(st.integers(0, 500)))
             for i in range(n)]
    return RoutingInput(num_blocks, num_blocks * B + draw(st.integers(0, B - 1)), tuple(views), block_size=B,
                        prefix_key=draw(st.binary(min_size=0, max_size=16)),
                        prefix_rate=draw(st.floats(0, 100)))


@settings(max_examples=300, deadline=None)
@given(case=cost_inputs())
def test_first_choice_has_the_least_cost_in_the_best_tier(case):
    policy = PrefixCostPolicy()
    ranking = policy.choose(case)
    assert sorted(ranking) == sorted(v.replica_id for v in case.replicas)
    credited = policy.credited_matches(case)
    keys = {v.replica_id: policy.sort_key(case, v, credited[v.replica_id]) for v in case.replicas}
    assert [keys[r] for r in ranking] == sorted(keys.values())
    # Crediting never exceeds the chain, nor the best confirmed match.
    best = max((min(v.matched_blocks or 0, case.num_blocks) for v in case.replicas), default=0)
    assert all(0 <= m <= best for m in credited.values())


def test_rates_converge_decay_and_stay_bounded():
    rates = PrefixRates(window_s=10.0, max_keys=3)
    rate = 0.0
    for i in range(400):  # 4 requests/s for 100 s
        rate = rates.observe(b"a", i * 0.25)
    assert 3.6 < rate < 4.4
    # 60 s of silence: e^-6 of it is left, plus the new request's own 0.1.
    assert rates.observe(b"a", 100.0 + 60.0) == pytest.approx(rate * math.exp(-6.025) + 0.1, rel=1e-3)
    for key in (b"b", b"c", b"d"):
        rates.observe(key, 200.0)
    assert len(rates) == 3
    assert rates.observe(b"a", 200.0) == pytest.approx(0.1)  # evicted: starts over


def test_recent_sends_credit_leading_blocks_until_they_expire():
    from router.recent_sends import RecentSends

    recent = RecentSends(ttl_s=5.0, max_entries=100, stride=1)
    a, b, c, d = (bytes([i]) * 16 for i in range(4))
    recent.record([a, b, c], "r1", now=0.0)
    recent.record([a, d], "r2", now=1.0)
    assert recent.leading([a, b, c, d], now=2.0) == {"r1": 3, "r2": 1}
    assert recent.leading([a, d], now=2.0) == {"r1": 1, "r2": 2}
    assert recent.leading([a, b], now=5.5) == {"r2": 1}  # r1's send expired at 5.0
    assert recent.leading([a], now=6.5) == {} and len(recent) == 0
    recent.record([a, b, c], "r1", now=10.0)
    recent.record([a, b, c], "r1", now=12.0)  # a resend extends the credit
    assert recent.leading([a, b], now=16.0) == {"r1": 2}


def test_recent_sends_stay_bounded():
    from router.recent_sends import RecentSends

    recent = RecentSends(ttl_s=100.0, max_entries=10, stride=1)
    for i in range(50):
        recent.record([i.to_bytes(16, "little")], "r", now=float(i))
    assert len(recent) == 10
    assert recent.leading([(49).to_bytes(16, "little")], now=50.0) == {"r": 1}
    assert recent.leading([(0).to_bytes(16, "little")], now=50.0) == {}


def test_recent_sends_keep_checkpoints_and_round_credits_down_to_them():
    from router.recent_sends import RecentSends

    recent = RecentSends(ttl_s=5.0, stride=4)
    chain = [bytes([i]) * 16 for i in range(10)]
    recent.record(chain, "r", now=0.0)
    assert len(recent) == 3  # depths 3, 7 and the last, 9
    assert recent.leading(chain, now=1.0) == {"r": 10}
    assert recent.leading(chain[:9] + [b"x" * 16], now=1.0) == {"r": 8}  # rounded down to depth 7
    assert recent.leading(chain + [bytes([i]) * 16 for i in range(10, 14)], now=1.0) == {"r": 8}
    assert recent.leading(chain[:2], now=1.0) == {}


# ------------------------------------------------ replicas splitting one machine's cores

def busy(replica_id, seqs, group="10.0.0.1", **kw):
    return ReplicaView(replica_id, num_running=seqs, matched_blocks=0, num_decode_tokens=300 * seqs,
                       core_group=group, **kw)


@pytest.mark.parametrize("seqs, expected", [(1, "busy"), (3, "busy"), (6, "busy"), (7, "busy"), (8, "idle"),
                                            (12, "idle")])
def test_requests_pack_onto_a_busy_sibling_until_its_batch_is_full(seqs, expected):
    # Same cores, one queue: an idle sibling costs pack_idle_tokens (128) more while the busy
    # one runs fewer than pack_max_seqs (8); at 8 the busy one is full and costs that instead.
    policy = PrefixCostPolicy(pack_max_seqs=8)
    views = (busy("busy", seqs), busy("idle", 0))
    assert policy.choose(inp(*views, prompt=256))[0] == expected


def test_replicas_with_cores_of_their_own_are_never_packed():
    policy = PrefixCostPolicy(pack_max_seqs=8)
    for views in ((busy("busy", 2, group=""), busy("idle", 0, group="")),
                  (busy("busy", 2, group="10.0.0.1"), busy("idle", 0, group="10.0.0.2"))):  # other machines
        assert policy.choose(inp(*views, prompt=256))[0] == "idle"
    assert PrefixCostPolicy(pack_max_seqs=0).choose(inp(busy("busy", 2), busy("idle", 0), prompt=256))[0] == "idle"


def test_packing_is_on_by_default_for_core_groups():
    assert PrefixCostPolicy().choose(inp(busy("busy", 2), busy("idle", 0), prompt=256))[0] == "busy"


def test_a_busy_sibling_without_kv_headroom_is_not_packed_onto():
    views = (busy("busy", 2, kv_cache_usage=0.97), busy("idle", 0))
    assert PrefixCostPolicy(pack_max_seqs=8).choose(inp(*views, prompt=256))[0] == "idle"


def test_a_long_confirmed_prefix_on_the_idle_sibling_still_wins_over_packing():
    # 13 of 16 blocks held: 208 tokens saved, weighted 416, more than pack_idle_tokens (128).
    views = (busy("busy", 2), ReplicaView("holder", matched_blocks=13, core_group="10.0.0.1"))
    assert PrefixCostPolicy(pack_max_seqs=8).choose(inp(*views, prompt=256))[0] == "holder"


def test_prefill_queued_on_a_sibling_is_charged_to_the_whole_group():
    # The queue runs on the same cores whichever member holds it: a burst still packs,
    # while the same queue on a replica with cores of its own spreads it.
    views = (busy("busy", 1, num_prefill_tokens=256), busy("idle", 0))
    assert PrefixCostPolicy(pack_max_seqs=8).choose(inp(*views, prompt=256))[0] == "busy"
    alone = (busy("busy", 1, group="", num_prefill_tokens=256), busy("idle", 0, group=""))
    assert PrefixCostPolicy(pack_max_seqs=8).choose(inp(*alone, prompt=256))[0] == "idle"
    # Against a replica on another machine the group's whole queue counts.
    other = (busy("a", 1, num_prefill_tokens=200), busy("b", 1, num_prefill_tokens=200),
             busy("c", 1, group="10.0.0.9", num_prefill_tokens=300))
    assert PrefixCostPolicy(pack_max_seqs=8).choose(inp(*other, prompt=256))[0] == "c"


def test_split_batches_of_a_group_merge_onto_the_fullest():
    views = (busy("small", 1), busy("large", 3), busy("idle", 0))
    assert PrefixCostPolicy(pack_max_seqs=8).choose(inp(*views, prompt=256)) == ["large", "small", "idle"]


def test_a_full_member_wakes_an_idle_sibling_rather_than_queue():
    views = (busy("full", 8), busy("idle", 0))
    assert PrefixCostPolicy(pack_max_seqs=8).choose(inp(*views, prompt=256))[0] == "idle"
    views = (busy("full", 8), busy("open", 2), busy("idle", 0))
    assert PrefixCostPolicy(pack_max_seqs=8).choose(inp(*views, prompt=256))[0] == "open"


def test_pack_parameters_are_validated():
    with pytest.raises(ValueError, match="pack_max_seqs must be an integer >= 0"):
        PrefixCostPolicy(pack_max_seqs=-1)
    with pytest.raises(ValueError, match="pack_idle_tokens must be a finite number >= 0"):
        get_policy("prefix_cost", pack_idle_tokens=float("nan"))


def test_the_serve_router_reads_the_core_group():
    serve_common = pytest.importorskip("ray.serve._private.common")
    from router.serve_router import PrefixAwareRequestRouter
    from tests.unit.test_serve_router import FakeReplica

    router = PrefixAwareRequestRouter(serve_common.DeploymentID("d", "app"),
                                      serve_common.DeploymentHandleSource.UNKNOWN)
    router.initialize_state(redis_url=None, block_size=4, model_fingerprint="fp")
    replica = FakeReplica("r")
    for reported, read in (("127.0.0.1", "127.0.0.1"), ("", ""), (None, "")):
        replica.routing_stats = {"core_group": reported}
        assert router._view(replica, 0).core_group == read
    replica.routing_stats = {}  # a replica from before the field
    assert router._view(replica, 0).core_group == ""


def test_a_burst_decided_before_the_figures_move_packs_onto_the_first_choice():
    # Both members report idle, but this router just sent one of them a prompt (its
    # pending prefill tokens): that one counts as a batch of one, so the burst packs.
    views = (ReplicaView("sent", num_prefill_tokens=256, core_group="g"), ReplicaView("other", core_group="g"))
    for order in (views, views[::-1]):
        assert PrefixCostPolicy().choose(inp(*order, prompt=256))[0] == "sent"
