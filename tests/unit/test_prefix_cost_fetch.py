"""prefix_cost's third option (router/policies/kv_fetch.py): a less-loaded
replica that fetches the prefix from its holder, against a local hit on the
loaded holder and a cold prefill. Exact choices on hand-built views."""

from __future__ import annotations

import pytest

from router.decision import RoutingCore
from router.policies import PrefixCostPolicy, ReplicaView, RoutingInput, get_policy
from router.policies.base import Ranking, rank
from router.policies.prefix_cost import rendezvous

B = 16
# Round figures: a token's KV is 1 MB, moved at 1 GB/s, 10 ms per fetch, 1000
# prefill tokens/s, no holder read and no penalty: fetching n tokens costs n + 10.
FAST = dict(fetch_bytes_per_s=1e9, fetch_overhead_s=0.01, fetch_holder_bytes_per_s=0.0, kv_bytes_per_token=1e6,
            prefill_tokens_per_s=1000.0, fetch_penalty_tokens=0.0)


def policy(**overrides):
    return PrefixCostPolicy(decode_token_weight=0, sequence_tokens=0, **{**FAST, **overrides})


def inp(*views, prompt=512, key=b"k", rate=0.0, adapter=""):
    return RoutingInput(num_blocks=prompt // B, num_prompt_tokens=prompt, replicas=tuple(views), block_size=B,
                        prefix_key=key, prefix_rate=rate, adapter=adapter)


def loaded_holder(queued, blocks=30, **fields):
    return ReplicaView("holder", matched_blocks=blocks, num_prefill_tokens=queued, **fields)


def test_a_loaded_holder_an_idle_replica_that_fetches_and_a_cold_prefill():
    # The holder has 30 of 32 blocks: it costs queued + 2 * 32. The idle
    # replica fetching them costs 2 * 32 + (480 + 10); recomputing, 2 * 512.
    idle = ReplicaView("idle", matched_blocks=0)
    assert policy().rank(inp(loaded_holder(480), idle)) == Ranking(["holder", "idle"], {"idle": "holder"})
    assert policy().rank(inp(loaded_holder(500), idle)) == Ranking(["idle", "holder"], {"idle": "holder"})
    # A slow link (100 MB/s: 4.8 s for 480 MB) costs more than recomputing:
    # the idle replica is priced cold, no hint, and the holder keeps the
    # request until its queue passes 2 * 480.
    slow = policy(fetch_bytes_per_s=1e8)
    assert slow.rank(inp(loaded_holder(500), idle)) == Ranking(["holder", "idle"], {})
    assert slow.rank(inp(loaded_holder(970), idle)) == Ranking(["idle", "holder"], {})


def test_each_term_of_the_transfer_flips_the_choice():
    idle = ReplicaView("idle", matched_blocks=0)
    views = (loaded_holder(600), idle)  # 664 against 554 for the fetch
    assert policy().choose(inp(*views))[0] == "idle"
    assert policy(fetch_penalty_tokens=120).choose(inp(*views))[0] == "holder"  # 674
    assert policy(fetch_overhead_s=0.12).choose(inp(*views))[0] == "holder"  # 64 + 480 + 120
    assert policy(fetch_holder_bytes_per_s=2e9).choose(inp(*views))[0] == "holder"  # + 240: the holder's read
    assert policy(prefill_tokens_per_s=1300).choose(inp(*views))[0] == "holder"  # 0.49 s = 637 tokens
    assert policy(kv_bytes_per_token=1.3e6).choose(inp(*views))[0] == "holder"  # 624 + 13
    # The replica's own figure beats the parameter: 1 byte per token moves in no time.
    light = ReplicaView("idle", matched_blocks=0, kv_bytes_per_token=1)
    assert policy(kv_bytes_per_token=1.3e6).choose(inp(loaded_holder(600), light))[0] == "idle"


def test_fetch_pricing_is_off_by_default():
    views = (loaded_holder(600), ReplicaView("idle", matched_blocks=0))
    assert PrefixCostPolicy(decode_token_weight=0, sequence_tokens=0).rank(inp(*views)) == Ranking(
        ["holder", "idle"], {})
    assert get_policy("prefix_cost").rank(inp(*views)).fetch_from == {}


def test_only_the_missing_blocks_are_priced_and_the_longest_holder_is_named():
    # "part" holds 10 blocks and fetches 20 (330); "empty" fetches 30 (490).
    views = (loaded_holder(1000), ReplicaView("part", matched_blocks=10), ReplicaView("empty", matched_blocks=0))
    assert policy().rank(inp(*views)) == Ranking(["part", "empty", "holder"], {"part": "holder", "empty": "holder"})
    # A longer match is named over a less loaded one; among equal matches the less loaded.
    busy = ReplicaView("busy", matched_blocks=30, num_running=5)
    calm = ReplicaView("calm", matched_blocks=30, num_running=1)
    short = ReplicaView("short", matched_blocks=20)
    idle = ReplicaView("idle", matched_blocks=0)
    assert policy().rank(inp(busy, calm, short, idle)).fetch_from["idle"] == "calm"
    assert policy().rank(inp(busy, short, idle)).fetch_from == {"short": "busy", "idle": "busy"}


def test_no_fetch_into_a_replica_without_room_to_import_it():
    # 30 blocks may take at most half of the receiver's free blocks.
    full = ReplicaView("idle", matched_blocks=0, num_kv_blocks=100, kv_cache_usage=0.5)  # 50 free
    roomy = ReplicaView("idle", matched_blocks=0, num_kv_blocks=100, kv_cache_usage=0.4)  # 60 free
    assert policy().rank(inp(loaded_holder(600), full)) == Ranking(["holder", "idle"], {})
    assert policy().rank(inp(loaded_holder(600), roomy)) == Ranking(["idle", "holder"], {"idle": "holder"})
    # Prefill queued there (its figures, or this router's sends since) takes blocks before the
    # fetch asks for room: 17 tokens, 2 blocks, leave 58 free, fewer than the 60 it needs.
    queued = ReplicaView("idle", matched_blocks=0, num_kv_blocks=100, kv_cache_usage=0.4, num_prefill_tokens=17)
    assert policy().rank(inp(loaded_holder(600), queued)).fetch_from == {}


def test_no_fetch_without_the_directory():
    views = (ReplicaView("holder", num_prefill_tokens=600), ReplicaView("idle"))  # matched None: Redis down
    assert policy().rank(inp(*views)) == Ranking(["idle", "holder"], {})


def test_an_adapted_request_is_fetched_as_a_base_one_and_a_missing_adapter_priced_on_top():
    # The replica hashes an adapted request's blocks on the adapter's content and fetches them
    # (workers/kv_transfer.py fingerprint_for): priced as any fetch, plus the adapter's load where
    # the fetching replica does not hold it.
    with_adapter = (loaded_holder(600, holds_adapter=True), ReplicaView("idle", matched_blocks=0, holds_adapter=True))
    assert policy().rank(inp(*with_adapter, adapter="a")) == Ranking(["idle", "holder"], {"idle": "holder"})
    lacking = (loaded_holder(600, holds_adapter=True),
               ReplicaView("idle", matched_blocks=0, holds_adapter=False, adapter_load_tokens=200.0))
    assert policy().rank(inp(*lacking, adapter="a")) == Ranking(["holder", "idle"], {"idle": "holder"})


def test_a_hot_prefix_is_replicated_by_copying():
    # 30 requests/s at 8 per replica: k = 4 replicas of the prefix's rendezvous order.
    views = [ReplicaView(f"r{i}", matched_blocks=0) for i in range(6)]
    order = sorted((v.replica_id for v in views), key=lambda rid: rendezvous(b"k", rid))
    holder_id = order[-1]  # outside the hot set
    views = [ReplicaView(v.replica_id, matched_blocks=30, num_prefill_tokens=1000) if v.replica_id == holder_id
             else ReplicaView(v.replica_id, matched_blocks=0) for v in views]
    hot = policy().rank(inp(*views, rate=30.0))
    # The hot set fetches (so does the sixth replica: a copy is cheaper than a prefill).
    assert set(order[:4]) <= set(hot.fetch_from) and set(hot.fetch_from.values()) == {holder_id}
    assert set(hot.replica_ids[:4]) == set(order[:4])  # credited the match, plus the small transfer
    # Where a copy costs more than recomputing, the hot set recomputes, as without fetches.
    slow = policy(fetch_bytes_per_s=1e8).rank(inp(*views, rate=30.0))
    off = PrefixCostPolicy(decode_token_weight=0, sequence_tokens=0).rank(inp(*views, rate=30.0))
    for ranking in (slow, off):
        assert ranking.fetch_from == {} and set(ranking.replica_ids[:4]) == set(order[:4])


def test_parameters_are_validated():
    with pytest.raises(ValueError, match="fetch_bytes_per_s"):
        PrefixCostPolicy(fetch_bytes_per_s=-1)
    with pytest.raises(ValueError, match="kv_bytes_per_token"):
        get_policy("prefix_cost", fetch_bytes_per_s=1e9, kv_bytes_per_token=0)
    with pytest.raises(ValueError, match="fetch_penalty_tokens"):
        get_policy("prefix_cost", fetch_penalty_tokens=float("inf"))


def test_the_decision_core_returns_the_hint_and_counts_the_prefill_past_the_holders_match():
    now = [100.0]
    core = RoutingCore(policy(), B, clock=lambda: now[0])
    chain = [bytes([i]) * 16 for i in range(32)]

    def view_of(rid, matched):
        queued = 600 if rid == "holder" else 0
        return ReplicaView(rid, matched_blocks=matched, num_prefill_tokens=queued + core.pending_tokens(rid, 99.0))

    ranking = core.decide_ranking(chain, 512, ["holder", "idle"], {"holder": 30}, view_of)
    assert ranking == Ranking(["idle", "holder"], {"idle": "holder"})
    assert core.pending_tokens("idle", 99.0) == 512 - 30 * B  # not the whole prompt: it fetches the rest
    assert core.decide(chain, 512, ["holder", "idle"], {"holder": 30}, view_of)[0] in ("holder", "idle")
    # Policies without hints still rank through the same call.
    plain = rank(get_policy("round_robin"), inp(loaded_holder(0), ReplicaView("idle", matched_blocks=0)))
    assert plain.fetch_from == {} and sorted(plain.replica_ids) == ["holder", "idle"]


def test_a_holder_at_its_export_limit_is_not_named():
    # Two holders of the same 30 blocks: the one with fewer fetches in flight is
    # named; at fetch_max_exports (2) a holder is skipped, even with the longer match.
    a = ReplicaView("a", matched_blocks=30, num_prefill_tokens=1000, num_exports=1)
    b = ReplicaView("b", matched_blocks=30, num_prefill_tokens=1000, num_running=3)
    idle = ReplicaView("idle", matched_blocks=0)
    assert policy().rank(inp(a, b, idle)).fetch_from["idle"] == "b"
    longer = ReplicaView("a", matched_blocks=31, num_prefill_tokens=1000, num_exports=2)
    assert policy().rank(inp(longer, b, idle)).fetch_from["idle"] == "b"
    assert policy(fetch_max_exports=3).rank(inp(longer, b, idle)).fetch_from["idle"] == "a"
    only = ReplicaView("a", matched_blocks=30, num_prefill_tokens=1000, num_exports=2)
    assert policy().rank(inp(only, idle)) == Ranking(["idle", "a"], {})  # nobody to fetch from: priced cold
    with pytest.raises(ValueError, match="fetch_max_exports"):
        PrefixCostPolicy(fetch_max_exports=0)


def test_the_decision_core_counts_its_fetch_hints_per_holder_for_a_while():
    now = [100.0]
    core = RoutingCore(policy(), B, clock=lambda: now[0])
    shared = [bytes([i]) * 16 for i in range(30)]  # a system prompt the holder has; questions differ

    def chain(n):
        return shared + [bytes([100 + n, i]) * 8 for i in range(2)]

    def view_of(rid, matched):
        queued = 5000 if rid == "holder" else core.pending_tokens(rid, 99.0)
        return ReplicaView(rid, matched_blocks=matched, num_prefill_tokens=queued,
                           num_exports=core.exports_in_flight(rid))

    fleet = ["holder", "r1", "r2", "r3"]
    first = core.decide_ranking(chain(1), 512, fleet, {"holder": 30}, view_of)
    assert first.fetch_from[first.replica_ids[0]] == "holder" and core.exports_in_flight("holder") == 1
    now[0] += 0.01
    second = core.decide_ranking(chain(2), 512, fleet, {"holder": 30}, view_of)
    assert second.fetch_from[second.replica_ids[0]] == "holder" and core.exports_in_flight("holder") == 2
    # At the limit the holder is not named: the next request is priced cold elsewhere.
    now[0] += 0.01
    third = core.decide_ranking(chain(3), 512, fleet, {"holder": 30}, view_of)
    assert third.fetch_from == {} and third.replica_ids[0] != "holder" and core.exports_in_flight("holder") == 2
    now[0] += 0.2  # past FETCH_HORIZON_S
    assert core.exports_in_flight("holder") == 0


def test_a_fetch_into_a_core_group_sibling_waits_for_the_siblings_own_queue():
    # Two replicas sharing one machine's cores (one core group, packing on): both are
    # charged the group's queue, so a fetch priced with it could never beat the holder
    # it copies from (the same queue and prefill, plus the transfer); bench routing made
    # no fetch at all. The receiver waits for its own steps only: charged its own queue.
    group = dict(core_group="node-1")
    holder = loaded_holder(700, num_running=3, **group)
    sibling = ReplicaView("idle", matched_blocks=0, **group)
    packed = policy(pack_max_seqs=32, pack_idle_tokens=128)
    # Holder: 700 queued + 2 * 32; the idle sibling fetching: 2 * 32 + 490 + 128 to wake it.
    assert packed.rank(inp(holder, sibling)) == Ranking(["idle", "holder"], {"idle": "holder"})
    # With little queued on the holder it keeps the request (the transfer and the wake cost more).
    assert packed.rank(inp(loaded_holder(400, num_running=3, **group), sibling)).replica_ids == ["holder", "idle"]
    # A cold prefill on the sibling is still charged the group's queue: without fetch pricing
    # the holder keeps the request however long its queue.
    cold = PrefixCostPolicy(decode_token_weight=0, sequence_tokens=0, pack_max_seqs=32, pack_idle_tokens=128)
    assert cold.rank(inp(loaded_holder(5000, num_running=3, **group), sibling)) == Ranking(["holder", "idle"], {})


def test_a_core_group_sibling_that_holds_the_prefix_costs_no_more_than_fetching_it():
    # After a fetch the sibling holds the hot prefix. Charged the group's queue as a holder
    # (where as a receiver it was charged its own), the next request of the prefix went back
    # behind the busy holder's prefill and the copy was never used. With fetch pricing on, a
    # holder of the longest match is charged its own queue, as its fetching self was.
    group = dict(core_group="node-1")
    busy = loaded_holder(700, blocks=32, num_running=3, **group)
    packed = policy(pack_max_seqs=32, pack_idle_tokens=128)
    lacking = ReplicaView("idle", matched_blocks=0, **group)
    holding = ReplicaView("idle", matched_blocks=32, **group)
    assert packed.rank(inp(busy, lacking)) == Ranking(["idle", "holder"], {"idle": "holder"})
    assert packed.rank(inp(busy, holding)) == Ranking(["idle", "holder"], {})
    # Busy too (open, two sequences), the sibling still waits only for its own 100 queued tokens.
    open_sibling = ReplicaView("idle", matched_blocks=32, num_running=2, num_prefill_tokens=100, **group)
    assert packed.rank(inp(busy, open_sibling)).replica_ids == ["idle", "holder"]
    # A short queue on the holder: the idle sibling's wake cost keeps the batch packed.
    assert packed.rank(inp(loaded_holder(100, blocks=32, num_running=3, **group), holding)).replica_ids == [
        "holder", "idle"]
    # Fetch pricing off: packing alone, the fuller member first, as before.
    off = PrefixCostPolicy(decode_token_weight=0, sequence_tokens=0, pack_max_seqs=32, pack_idle_tokens=128)
    assert off.rank(inp(busy, holding)).replica_ids == ["holder", "idle"]
    assert off.rank(inp(busy, open_sibling)).replica_ids == ["holder", "idle"]
