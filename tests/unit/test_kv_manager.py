"""KVCacheManager: allocation, prefix hits, caching after compute, swapping
(8 device blocks of 4 tokens)."""

from __future__ import annotations

import pytest

from workers.engine.block_pool import BlockPool, BlockStored
from workers.engine.kv_manager import KVCacheManager
from tests.unit.engine_fakes import make_kv_manager, make_request


def admit(kv, seq, num_new=None):
    """Admits ``seq`` as the scheduler does; returns the new block ids."""
    hits, num_hit = kv.get_computed_blocks(seq)
    num_new = seq.num_tokens - num_hit if num_new is None else num_new
    new = kv.allocate_slots(seq, num_new, hits)
    if new is not None:
        seq.num_computed_tokens = num_hit
    return new


def compute(kv, seq, num_tokens):
    """What update_from_output does once the runner computed ``num_tokens``."""
    seq.num_computed_tokens += num_tokens
    kv.cache_computed_blocks(seq)


def test_allocate_grows_block_by_block():
    kv = make_kv_manager(8)
    seq = make_request("a", 10)
    assert admit(kv, seq) == [0, 1, 2]
    compute(kv, seq, 10)
    seq.append_token(7)  # token 11 fits in block 2
    assert kv.allocate_slots(seq, 1) == []
    compute(kv, seq, 1)
    seq.append_token(8)
    compute(kv, seq, 0)
    assert kv.allocate_slots(seq, 1) == []  # token 12 fills block 2
    compute(kv, seq, 1)
    seq.append_token(9)
    assert kv.allocate_slots(seq, 1) == [3]  # token 13 needs a new block
    assert seq.block_ids == [0, 1, 2, 3]
    assert kv.num_free_blocks == 4 and kv.usage == 0.5
    kv.check_integrity([seq])


def test_does_not_fit_changes_nothing():
    kv = make_kv_manager(4)
    a = make_request("a", 12)
    assert admit(kv, a) == [0, 1, 2]
    b = make_request("b", list(range(500, 508)))
    assert admit(kv, b) is None
    assert b.block_ids == [] and kv.num_free_blocks == 1
    kv.check_integrity([a, b])


def test_prefix_hit_shares_blocks_with_ref_count_two():
    kv = make_kv_manager(8)
    a = make_request("a", 10)
    admit(kv, a)
    compute(kv, a, 10)  # blocks 0, 1 are full: cached now
    assert kv.num_cached_blocks == 2
    b = make_request("b", list(range(100, 109)) + [5, 6, 7])  # shares 9 tokens: 2 full blocks
    assert kv.get_computed_blocks(b) == ([0, 1], 8)
    assert admit(kv, b) == [3]
    assert b.block_ids == [0, 1, 3] and b.num_computed_tokens == 8
    assert [kv.device_pool.ref_count(i) for i in (0, 1, 2, 3)] == [2, 2, 1, 1]
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (10 + 12, 8)
    kv.free(a)
    assert [kv.device_pool.ref_count(i) for i in (0, 1, 2)] == [1, 1, 0]
    kv.check_integrity([b])


def test_hit_never_covers_the_whole_prompt():
    kv = make_kv_manager(8)
    a = make_request("a", 8)
    admit(kv, a)
    compute(kv, a, 8)
    twin = make_request("twin", 8)  # identical 8-token prompt: both blocks cached
    assert kv.get_computed_blocks(twin) == ([0], 4)  # one block kept to compute logits
    assert admit(kv, twin) == [2]
    compute(kv, twin, 4)  # its block 1 duplicates a's: stays uncached
    assert kv.device_pool.block_hash(2) is None
    kv.check_integrity([a, twin])


def test_blocks_are_cached_only_once_computed():
    kv = make_kv_manager(8)
    a = make_request("a", 12)
    admit(kv, a, num_new=6)  # first chunk: blocks 0..1 allocated, block 0 full after compute
    assert kv.num_cached_blocks == 0  # nothing computed yet
    compute(kv, a, 6)
    assert kv.num_cached_blocks == 1
    events = kv.take_events().events
    assert events == (BlockStored((a.block_hashes[0],), a.hash_root, 4, tuple(range(100, 104))),)
    assert kv.allocate_slots(a, 6) == [2]
    compute(kv, a, 6)
    assert kv.take_events().events == (BlockStored(tuple(a.block_hashes[1:3]), a.block_hashes[0], 4, tuple(range(104, 112))),)


def test_revived_hits_count_against_free_blocks():
    kv = make_kv_manager(4)
    a = make_request("a", 13)
    admit(kv, a)
    compute(kv, a, 13)
    kv.free(a)  # blocks 0..2 cached and free, block 3 empty
    big = make_request("big", list(range(100, 108)) + list(range(600, 610)))  # 2 hits + 3 new > 4 blocks
    assert admit(kv, big) is None
    fits = make_request("fits", list(range(100, 108)) + list(range(600, 606)))  # 2 hits + 2 new
    assert admit(kv, fits) == [3, 2]  # the empty block first, then the LRU cached one (a's tail)
    assert fits.block_ids == [0, 1, 3, 2]
    kv.check_integrity([fits])


def test_cache_salt_isolates_tenants():
    kv = make_kv_manager(8)
    a = make_request("a", 9, cache_salt="x")
    admit(kv, a)
    compute(kv, a, 9)
    assert kv.get_computed_blocks(make_request("b", 9, cache_salt="y")) == ([], 0)
    assert kv.get_computed_blocks(make_request("c", 9, cache_salt="x")) == ([0, 1], 8)


def test_prefix_caching_off():
    kv = make_kv_manager(8, enable_caching=False)
    a = make_request("a", 9)
    admit(kv, a)
    compute(kv, a, 9)
    assert kv.num_cached_blocks == 0 and kv.get_computed_blocks(make_request("b", 9)) == ([], 0)
    assert kv.take_events() is None


def test_swap_out_and_in_copy_computed_blocks():
    kv = make_kv_manager(8, num_cpu_blocks=4, enable_caching=False)
    a = make_request("a", 6)
    admit(kv, a)
    compute(kv, a, 6)
    a.append_token(1)
    kv.allocate_slots(a, 1)  # scheduled, then preempted before running
    other = make_request("o", 4)
    admit(kv, other)  # block 2
    assert kv.swap_out(a) == [(0, 0), (1, 1)]
    assert a.block_ids == [] and a.cpu_block_ids == [0, 1] and kv.swap_usage == 0.5
    assert kv.num_free_blocks == 7
    assert kv.swap_in(a, num_new_tokens=1) == [(0, 0), (1, 1)]  # freed empty blocks are reused first
    assert a.block_ids == [0, 1] and a.cpu_block_ids == []
    # The CPU blocks stay taken until the runner has copied them.
    assert kv.num_free_swap_blocks == 2
    kv.check_integrity([a, other])
    kv.release_swap_in_sources()
    assert kv.num_free_swap_blocks == 4
    kv.check_integrity([a, other])


def test_swap_in_shares_blocks_still_cached_on_device():
    kv = make_kv_manager(8, num_cpu_blocks=4)
    a = make_request("a", 10)
    admit(kv, a)
    compute(kv, a, 10)  # blocks 0, 1 cached
    b = make_request("b", 10)  # same prompt, running: keeps 0, 1 alive
    admit(kv, b)
    assert kv.swap_out(a) == [(0, 0), (1, 1), (2, 2)]
    mapping = kv.swap_in(a, num_new_tokens=0)
    assert mapping == [(2, 2)]  # only the partial block is copied
    assert a.block_ids == [0, 1, 2] and a.num_registered_blocks == 2
    assert kv.device_pool.ref_count(0) == 2
    kv.check_integrity([a, b])


def test_swap_refusals_change_nothing():
    no_swap = make_kv_manager(8)
    a = make_request("a", 6)
    admit(no_swap, a)
    compute(no_swap, a, 6)
    assert no_swap.swap_out(a) is None and a.block_ids == [0, 1]

    kv = make_kv_manager(2, num_cpu_blocks=1)
    b = make_request("b", 6)
    admit(kv, b)
    compute(kv, b, 6)
    assert kv.swap_out(b) is None and b.block_ids == [0, 1]  # 2 blocks, 1 CPU block
    c = make_request("c", 4)
    kv2 = make_kv_manager(2, num_cpu_blocks=2, enable_caching=False)
    admit(kv2, c)
    compute(kv2, c, 4)
    assert kv2.swap_out(c) == [(0, 0)]
    kv2.allocate_slots(make_request("d", 8), 8)  # device now full
    assert kv2.swap_in(c, num_new_tokens=1) is None and c.cpu_block_ids == [0]


def test_reset_prefix_cache_needs_an_idle_pool():
    kv = make_kv_manager(8)
    a = make_request("a", 9)
    admit(kv, a)
    compute(kv, a, 9)
    assert kv.reset_prefix_cache() is False
    kv.free(a)
    assert kv.reset_prefix_cache() is True and kv.num_cached_blocks == 0
    snap = kv.take_snapshot()
    assert snap.block_hashes == ()


def test_pools_must_agree():
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(BlockPool(4, 4), BlockPool(4, 8, enable_caching=False))
    with pytest.raises(ValueError, match="enable_caching=False"):
        KVCacheManager(BlockPool(4, 4), BlockPool(4, 4))
