"""The transfer ledger over tiny pools (workers/engine/kv_transfer.py): what an
export pins, where an import's blocks land, the events it emits, and that a
block being written is never reachable by a prefix lookup."""

from __future__ import annotations

import pytest

from cluster.shared.hashing import hash_block_chain, root_hash
from workers.engine.block_pool import BlockPool, BlockRemoved, BlockStored
from workers.engine.kv_manager import KVCacheManager
from workers.engine.kv_transfer import TransferLedger

BS = 4
ROOT = root_hash("test-model")
TOKENS = list(range(10, 10 + 5 * BS))  # 5 full blocks
HASHES = hash_block_chain(TOKENS, BS, ROOT)


def make_ledger(num_blocks: int = 8) -> TransferLedger:
    return TransferLedger(KVCacheManager(BlockPool(num_blocks, BS)))


def cache_prefix(ledger: TransferLedger, num: int) -> list[int]:
    """Blocks computed and cached the way a finished sequence leaves them (free, cached)."""
    pool = ledger.pool
    block_ids = pool.allocate(num)
    pool.cache_full_blocks(block_ids, HASHES[:num], ROOT, TOKENS[: num * BS])
    pool.free(reversed(block_ids))
    pool.take_events()
    return block_ids


def test_export_pins_the_leading_cached_run_and_release_returns_it():
    ledger = make_ledger()
    assert cache_prefix(ledger, 3) == [0, 1, 2]
    pool = ledger.pool
    held = ledger.pin_prefix(HASHES)  # 5 asked, 3 held: the leading run
    assert held is not None and held.block_ids == [0, 1, 2] and held.block_hashes == tuple(HASHES[:3])
    assert [pool.ref_count(b) for b in range(3)] == [1, 1, 1]
    assert pool.num_free_blocks == 5  # pinned cached blocks left the free queue: not evictable
    assert pool.allocate(5) == [3, 4, 5, 6, 7]  # empty blocks only; the pinned ones survive
    assert all(pool.get_cached_block(h) == i for i, h in enumerate(HASHES[:3]))
    ledger.check_integrity([_Table([3, 4, 5, 6, 7])])
    ledger.release(held.transfer_id)
    assert [pool.ref_count(b) for b in range(3)] == [0, 0, 0]
    assert pool.free_block_ids() == [2, 1, 0]  # back at the tail, cached, in the order a sequence frees
    assert pool.take_events() is None  # pinning changes no cached hash
    pool.free([7, 6, 5, 4, 3])
    ledger.check_integrity([])


def test_export_of_a_missing_first_block_pins_nothing():
    ledger = make_ledger()
    cache_prefix(ledger, 2)
    assert ledger.pin_prefix(HASHES[2:]) is None
    assert ledger.pin_prefix([]) is None
    assert ledger.pool.num_used_blocks == 0 and not ledger.holdings()


def test_import_lands_as_cached_prefix_blocks_with_events():
    ledger = make_ledger()
    pool = ledger.pool
    held = ledger.reserve(HASHES[:3], ROOT, TOKENS[: 3 * BS])
    assert held is not None and held.block_ids == [0, 1, 2]
    # While written: owned by the transfer, and no lookup reaches them.
    assert all(pool.get_cached_block(h) is None for h in HASHES)
    assert ledger.num_cached_leading(HASHES) == 0
    ledger.check_integrity([])
    assert ledger.commit(held.transfer_id) == 3
    assert [pool.get_cached_block(h) for h in HASHES[:3]] == [0, 1, 2]
    assert pool.num_used_blocks == 0 and pool.free_block_ids()[-3:] == [2, 1, 0]
    batch = pool.take_events()
    assert batch is not None and batch.events == (
        BlockStored(tuple(HASHES[:3]), ROOT, BS, tuple(TOKENS[: 3 * BS])),)
    # An admission of the prompt now hits them (at most (n - 1) // bs blocks).
    seq = _seq(TOKENS[: 3 * BS + 1])
    assert ledger.kv_manager.get_computed_blocks(seq) == ([0, 1, 2], 3 * BS)
    ledger.check_integrity([])


def test_import_of_a_later_segment_chains_on_its_parent():
    ledger = make_ledger()
    cache_prefix(ledger, 2)
    held = ledger.reserve(HASHES[2:4], HASHES[1], TOKENS[2 * BS : 4 * BS])
    assert held is not None and held.block_ids == [2, 3]  # empty blocks first: the cached 0, 1 survive
    ledger.commit(held.transfer_id)
    assert ledger.num_cached_leading(HASHES) == 4
    batch = ledger.pool.take_events()
    assert batch.events == (BlockStored(tuple(HASHES[2:4]), HASHES[1], BS, tuple(TOKENS[2 * BS : 4 * BS])),)


def test_failed_copy_leaves_empty_blocks_and_no_event():
    ledger = make_ledger()
    pool = ledger.pool
    held = ledger.reserve(HASHES[:2], ROOT)
    ledger.release(held.transfer_id)  # the copy failed half way
    assert pool.num_cached_blocks == 0 and pool.take_events() is None
    assert pool.free_block_ids()[:2] == [0, 1]  # empty: at the head, reused first
    ledger.check_integrity([])


def test_a_hash_cached_meanwhile_is_skipped_at_commit():
    ledger = make_ledger()
    pool = ledger.pool
    held = ledger.reserve(HASHES[:2], ROOT)
    cached = pool.allocate(1)  # a local prefill computed block 0 while the copy ran
    pool.cache_full_blocks(cached, HASHES[:1], ROOT)
    pool.take_events()
    assert ledger.commit(held.transfer_id) == 1
    assert pool.get_cached_block(HASHES[0]) == cached[0] and pool.get_cached_block(HASHES[1]) == 1
    assert pool.block_hash(0) is None  # the duplicate stays empty
    batch = pool.take_events()
    assert batch.events == (BlockStored((HASHES[1],), HASHES[0], BS, None),)
    pool.free(cached)
    ledger.check_integrity([])


def test_reserve_takes_at_most_half_the_free_blocks_and_evicts_lru():
    ledger = make_ledger(8)
    pool = ledger.pool
    assert ledger.reserve(HASHES[:5], ROOT) is None  # 5 of 8 free: refused, nothing changed
    assert pool.num_used_blocks == 0
    cache_prefix(ledger, 4)  # blocks 0..3 cached; 4..7 empty
    other = hash_block_chain(list(range(500, 500 + 4 * BS)), BS, ROOT)
    held = ledger.reserve(other, ROOT)
    assert held.block_ids == [4, 5, 6, 7]
    ledger.commit(held.transfer_id)
    held = ledger.reserve(HASHES[4:5], HASHES[3])
    assert held.block_ids == [3]  # the LRU cached block (a sequence's tail) is evicted first
    batch = pool.take_events()
    assert BlockRemoved((HASHES[3],)) in batch.events
    ledger.release(held.transfer_id)
    ledger.check_integrity([])


def test_integrity_counts_held_blocks_and_release_all():
    ledger = make_ledger()
    cache_prefix(ledger, 2)
    pin = ledger.pin_prefix(HASHES)
    rsv = ledger.reserve(HASHES[2:3], HASHES[1])
    assert ledger.num_held_blocks == 3 and {h.transfer_id for h in ledger.holdings()} == {pin.transfer_id,
                                                                                           rsv.transfer_id}
    ledger.check_integrity([])
    with pytest.raises(AssertionError, match="ref"):  # without the ledger the references look leaked
        ledger.kv_manager.check_integrity([])
    ledger.release_all()
    assert ledger.pool.num_used_blocks == 0 and not ledger.holdings()
    ledger.check_integrity([])


def test_caching_off_moves_nothing():
    ledger = TransferLedger(KVCacheManager(BlockPool(8, BS, enable_caching=False)))
    assert ledger.pin_prefix(HASHES) is None
    assert ledger.reserve(HASHES[:1], ROOT) is None


class _Table:
    """A sequence's block fields only (what check_integrity reads)."""

    def __init__(self, block_ids: list[int]) -> None:
        self.block_ids = block_ids
        self.cpu_block_ids: list[int] = []
        self.num_released_blocks = 0
        self.num_registered_blocks = 0


def _seq(tokens: list[int]):
    from workers.engine.sequence import Sequence

    return Sequence("s", tokens, block_size=BS, model_fingerprint="test-model")
