"""BlockPool: ref counts, LRU free queue, hash map, KV events (8 blocks)."""

from __future__ import annotations

import pytest

from cluster.shared.hashing import hash_block_chain, root_hash
from workers.engine.block_pool import AllBlocksCleared, BlockRemoved, BlockStored
from tests.unit.engine_fakes import make_block_pool

ROOT = root_hash("m")
TOKENS = list(range(32))
HASHES = hash_block_chain(TOKENS, 4, ROOT)  # 8 chained hashes


@pytest.fixture
def pool():
    p = make_block_pool(8)
    yield p
    p.check_integrity()


def test_fresh_pool_allocates_in_order(pool):
    assert pool.allocate(3) == [0, 1, 2]
    assert (pool.num_free_blocks, pool.num_used_blocks, pool.usage) == (5, 3, 3 / 8)
    assert pool.allocate(6) is None  # does not fit: nothing changed
    assert pool.num_free_blocks == 5
    assert pool.allocate(5) == [3, 4, 5, 6, 7]
    assert pool.usage == 1.0 and pool.allocate(1) is None


def test_ref_counts_and_sharing(pool):
    blocks = pool.allocate(2)
    pool.cache_full_blocks(blocks, HASHES[:2], ROOT)
    pool.touch(blocks)  # a second sequence shares them
    assert [pool.ref_count(b) for b in blocks] == [2, 2]
    pool.free(reversed(blocks))
    assert [pool.ref_count(b) for b in blocks] == [1, 1] and pool.num_used_blocks == 2
    pool.free(reversed(blocks))
    assert pool.num_used_blocks == 0
    assert pool.num_cached_blocks == 2  # still hittable
    with pytest.raises(AssertionError, match="double free"):
        pool.free([0])


def test_empty_freed_blocks_are_reused_first(pool):
    a = pool.allocate(2)  # [0, 1]
    pool.free(reversed(a))
    assert pool.free_block_ids() == [0, 1, 2, 3, 4, 5, 6, 7]
    assert pool.allocate(2) == [0, 1]


def test_lru_eviction_tail_blocks_first_then_least_recent(pool):
    # Sequence A: 4 full cached blocks [0..3]; sequence B: 2 blocks [4, 5].
    a = pool.allocate(4)
    pool.cache_full_blocks(a, HASHES[:4], ROOT)
    b = pool.allocate(2)
    other = hash_block_chain([9] * 8, 4, ROOT)
    pool.cache_full_blocks(b, other, ROOT)
    pool.free(reversed(a))  # A ends first: its tail (3) is least recent
    pool.free(reversed(b))
    assert pool.free_block_ids() == [6, 7, 3, 2, 1, 0, 5, 4]
    pool.take_events()

    assert pool.allocate(2) == [6, 7]  # empty blocks: no eviction
    assert pool.take_events() is None
    assert pool.allocate(1) == [3]  # A's tail block goes first
    assert pool.take_events().events == (BlockRemoved((HASHES[3],)),)
    assert pool.get_cached_block(HASHES[3]) is None

    pool.touch([1])  # prefix hit on A's second block revives it ...
    pool.free([1])  # ... and its next release makes it most recent
    assert pool.free_block_ids() == [2, 0, 5, 4, 1]
    assert pool.allocate(3) == [2, 0, 5]
    assert pool.take_events().events == (BlockRemoved((HASHES[2], HASHES[0], other[1])),)
    assert pool.get_cached_block(HASHES[1]) == 1


def test_touch_of_free_uncached_block_is_a_bug(pool):
    with pytest.raises(AssertionError, match="uncached"):
        pool.touch([0])


def test_block_stored_events_and_sequence_numbers(pool):
    blocks = pool.allocate(3)
    assert pool.cache_full_blocks(blocks[:2], HASHES[:2], ROOT, TOKENS[:8]) == 2
    pool.cache_full_blocks(blocks[2:], HASHES[2:3], HASHES[1])
    first = pool.take_events()
    assert first.seq_no == 1
    assert first.events == (
        BlockStored((HASHES[0], HASHES[1]), ROOT, 4, tuple(range(8))),
        BlockStored((HASHES[2],), HASHES[1], 4, None),
    )
    assert pool.take_events() is None  # nothing new: no number spent
    pool.free(reversed(blocks))
    assert pool.take_events() is None  # freeing keeps blocks cached: no event
    pool.allocate(8)
    second = pool.take_events()
    assert second.seq_no == 2
    assert second.events == (BlockRemoved((HASHES[2], HASHES[1], HASHES[0])),)


def test_duplicate_hash_is_skipped_and_splits_the_event(pool):
    first = pool.allocate(1)
    pool.cache_full_blocks(first, HASHES[1:2], HASHES[0])  # someone else holds block 1 of the chain
    pool.take_events()
    mine = pool.allocate(3)  # [1, 2, 3]
    assert pool.cache_full_blocks(mine, HASHES[:3], ROOT, TOKENS[:12]) == 2
    assert pool.block_hash(2) is None  # the duplicate stays uncached
    assert pool.take_events().events == (
        BlockStored((HASHES[0],), ROOT, 4, tuple(range(4))),
        BlockStored((HASHES[2],), HASHES[1], 4, tuple(range(8, 12))),
    )
    pool.free(reversed(mine))
    assert pool.free_block_ids()[0] == 2  # uncached: reused first


def test_snapshot_for_resync(pool):
    blocks = pool.allocate(2)
    pool.cache_full_blocks(blocks, HASHES[:2], ROOT)
    snap = pool.take_snapshot()  # pending events are superseded
    assert snap.seq_no == 1 and snap.block_hashes == (HASHES[0], HASHES[1])
    assert pool.take_events() is None
    pool.free(blocks)
    pool.allocate(8)
    assert pool.take_events().seq_no == 2
    assert pool.cached_block_hashes() == []


def test_reset_prefix_cache(pool):
    blocks = pool.allocate(2)
    pool.cache_full_blocks(blocks, HASHES[:2], ROOT)
    pool.take_events()
    assert pool.reset_prefix_cache() is False  # blocks in use: refused, unchanged
    assert pool.num_cached_blocks == 2
    pool.free(reversed(blocks))
    assert pool.reset_prefix_cache() is True
    assert pool.num_cached_blocks == 0 and pool.get_cached_block(HASHES[0]) is None
    assert pool.take_events().events == (AllBlocksCleared(),)


def test_caching_off_is_a_plain_allocator():
    pool = make_block_pool(4, enable_caching=False)
    blocks = pool.allocate(2)
    assert pool.cache_full_blocks(blocks, HASHES[:2], ROOT) == 0
    assert pool.get_cached_block(HASHES[0]) is None
    assert pool.take_events() is None
    pool.free(blocks)
    pool.check_integrity()


def test_empty_pool_and_bad_arguments():
    empty = make_block_pool(0)
    assert empty.allocate(0) == [] and empty.allocate(1) is None and empty.usage == 0.0
    empty.check_integrity()
    with pytest.raises(ValueError, match="num_blocks"):
        make_block_pool(-1)
    with pytest.raises(ValueError, match="block_size"):
        make_block_pool(4, block_size=0)
