"""A pool of fixed-size KV blocks: ref counts, prefix cache, LRU eviction.

A pure data structure (no torch): it hands out block ids; the runner owns the
tensors they index. The device pool and the CPU swap pool are two instances
(the swap pool with caching off).

Every block is in exactly one of three states::

    used            ref_count > 0                    not in the free queue
    free, cached    ref_count == 0, has a hash       in the free queue, and in
                                                     the hash map: a prefix
                                                     lookup can still revive it
    free, empty     ref_count == 0, no hash          in the free queue

    free queue:  head [ empty ... empty | cached (LRU) ... cached (MRU) ] tail
                  ^ allocate() pops here; popping a cached block evicts it

Empty blocks sit at the head because nothing can hit them, so they are reused
before any cached block is evicted. A sequence frees its blocks tail first
(``free(reversed(block_ids))``): its last blocks are the least likely to be
shared, so they are evicted before its first ones.

KV events (``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``) record
every change of the set of cached hashes; ``take_events()`` drains them as one
batch numbered 1, 2, 3, ... per pool. A consumer that sees a gap asks for
``take_snapshot()``: every cached hash, numbered so the next batch follows it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence, Union


@dataclass(frozen=True)
class BlockStored:
    """Full blocks entered the prefix cache, in chain order.

    ``parent_block_hash`` is the hash the first block chains on (the root
    ``h_0`` for a sequence's first block). ``token_ids`` holds the blocks'
    tokens, ``block_size`` per block, when the caller passed them.
    """

    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes
    block_size: int
    token_ids: Optional[tuple[int, ...]] = None


@dataclass(frozen=True)
class BlockRemoved:
    """Cached blocks were evicted (their KV is gone)."""

    block_hashes: tuple[bytes, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    """The whole prefix cache was dropped."""


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


@dataclass(frozen=True)
class KVEventBatch:
    """Events since the previous batch; ``seq_no`` is 1, 2, 3, ... per pool."""

    seq_no: int
    events: tuple[KVEvent, ...]


@dataclass(frozen=True)
class KVCacheSnapshot:
    """Every cached hash as of batch ``seq_no``; the next batch is seq_no + 1."""

    seq_no: int
    block_hashes: tuple[bytes, ...]


class BlockPool:
    """Blocks ``0 .. num_blocks-1`` with ref counts and an optional prefix cache.

    Args:
        num_blocks: Blocks in the pool (0 is allowed: an absent swap space).
        block_size: Tokens per block (reported in events).
        enable_caching: Keep hashes of full blocks for prefix reuse and emit
            KV events. Off for the swap pool.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._ref_counts = [0] * num_blocks
        self._hashes: list[Optional[bytes]] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._hash_to_block: dict[bytes, int] = {}
        self._events: list[KVEvent] = []
        self._seq_no = 0

    # ---------------------------------------------------------------- figures
    @property
    def num_free_blocks(self) -> int:
        """Blocks allocate() can hand out (empty and cached-but-free)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks whose hash is in the cache, used or free."""
        return len(self._hash_to_block)

    @property
    def usage(self) -> float:
        """Used blocks / total, in [0, 1] (cached free blocks count as free)."""
        return self.num_used_blocks / self.num_blocks if self.num_blocks else 0.0

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def block_hash(self, block_id: int) -> Optional[bytes]:
        return self._hashes[block_id]

    def free_block_ids(self) -> list[int]:
        """Free queue from head (next to allocate / evict) to tail. Read-only."""
        return list(self._free)

    # ---------------------------------------------------------------- lookups
    def get_cached_block(self, block_hash: bytes) -> Optional[int]:
        """Returns the block holding ``block_hash``, or None. No mutation."""
        return self._hash_to_block.get(block_hash)

    def cached_block_hashes(self) -> list[bytes]:
        """Every hash in the cache (for a full resync). No mutation."""
        return list(self._hash_to_block)

    # --------------------------------------------------------------- mutation
    def allocate(self, num_blocks: int) -> Optional[list[int]]:
        """Takes ``num_blocks`` from the head of the free queue, evicting the
        cached ones it pops (mutates; emits ``BlockRemoved``).

        Returns:
            The block ids with ref count 1, or None (nothing changed) if fewer
            than ``num_blocks`` are free.
        """
        assert num_blocks >= 0
        if num_blocks > len(self._free):
            return None
        block_ids = []
        evicted = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            old_hash = self._hashes[block_id]
            if old_hash is not None:
                del self._hash_to_block[old_hash]
                self._hashes[block_id] = None
                evicted.append(old_hash)
            self._ref_counts[block_id] = 1
            block_ids.append(block_id)
        if evicted:
            self._events.append(BlockRemoved(tuple(evicted)))
        return block_ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """Adds a reference to each block; a free cached block leaves the
        free queue (a prefix hit). Mutates."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                assert self._hashes[block_id] is not None, f"touching free uncached block {block_id}"
                del self._free[block_id]
            self._ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drops a reference to each block (mutates).

        Blocks reaching ref count 0 join the free queue in the order given,
        so pass a sequence's blocks tail first: the first one given is evicted
        first. Cached blocks go to the tail (most recently used), empty ones
        to the head (reused before any cached block is evicted).
        """
        for block_id in block_ids:
            assert self._ref_counts[block_id] > 0, f"double free of block {block_id}"
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free[block_id] = None
                if self._hashes[block_id] is None:
                    self._free.move_to_end(block_id, last=False)

    def cache_full_blocks(
        self,
        block_ids: Sequence[int],
        block_hashes: Sequence[bytes],
        parent_block_hash: bytes,
        token_ids: Optional[Sequence[int]] = None,
    ) -> int:
        """Enters used, full blocks into the prefix cache (mutates; emits
        ``BlockStored``). A no-op when caching is off.

        A hash that another block already holds (two sequences computed the
        same block at once) is skipped: that block stays uncached and is
        reused first once free.

        Args:
            block_ids: Consecutive blocks of one sequence, in chain order.
            block_hashes: Their hashes.
            parent_block_hash: The hash ``block_hashes[0]`` chains on.
            token_ids: Optional tokens of these blocks, for the events.

        Returns:
            How many blocks were newly cached.
        """
        assert len(block_ids) == len(block_hashes)
        assert token_ids is None or len(token_ids) == len(block_ids) * self.block_size
        if not self.enable_caching:
            return 0
        run: list[int] = []  # indices of a contiguous run of newly cached blocks
        num_cached = 0
        for i, (block_id, block_hash) in enumerate(zip(block_ids, block_hashes)):
            assert self._ref_counts[block_id] > 0, f"caching free block {block_id}"
            assert self._hashes[block_id] is None, f"block {block_id} is cached already"
            if block_hash in self._hash_to_block:
                self._emit_stored(run, block_hashes, parent_block_hash, token_ids)
                run = []
                continue
            self._hashes[block_id] = block_hash
            self._hash_to_block[block_hash] = block_id
            run.append(i)
            num_cached += 1
        self._emit_stored(run, block_hashes, parent_block_hash, token_ids)
        return num_cached

    def _emit_stored(
        self,
        run: list[int],
        block_hashes: Sequence[bytes],
        parent_block_hash: bytes,
        token_ids: Optional[Sequence[int]],
    ) -> None:
        if not run:
            return
        first, last = run[0], run[-1]
        parent = block_hashes[first - 1] if first > 0 else parent_block_hash
        tokens = None
        if token_ids is not None:
            tokens = tuple(token_ids[first * self.block_size : (last + 1) * self.block_size])
        self._events.append(BlockStored(tuple(block_hashes[first : last + 1]), parent, self.block_size, tokens))

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached hash (mutates; emits ``AllBlocksCleared``).

        Returns:
            False (nothing changed) if any block is in use: running sequences
            would keep pointing at blocks the cache no longer knows.
        """
        if self.num_used_blocks:
            return False
        self._hash_to_block.clear()
        self._hashes = [None] * self.num_blocks
        if self.enable_caching:
            self._events.append(AllBlocksCleared())
        return True

    # ----------------------------------------------------------------- events
    def take_events(self) -> Optional[KVEventBatch]:
        """Drains pending events as the next numbered batch (mutates).

        Returns:
            None when nothing happened since the last batch (no number spent).
        """
        if not self._events:
            return None
        self._seq_no += 1
        batch = KVEventBatch(self._seq_no, tuple(self._events))
        self._events = []
        return batch

    def take_snapshot(self) -> KVCacheSnapshot:
        """Drops pending events and returns every cached hash, numbered as
        the next batch so later batches follow on (mutates the numbering).
        Use it for a full resync after a gap or a restart."""
        self._events = []
        self._seq_no += 1
        return KVCacheSnapshot(self._seq_no, tuple(self._hash_to_block))

    # -------------------------------------------------------------- integrity
    def check_integrity(self) -> None:
        """Asserts the pool's invariants. No mutation."""
        num_used = sum(1 for rc in self._ref_counts if rc > 0)
        assert num_used + len(self._free) == self.num_blocks, "free + used != total"
        for block_id in range(self.num_blocks):
            rc = self._ref_counts[block_id]
            assert rc >= 0, f"block {block_id} has ref count {rc}"
            assert (rc == 0) == (block_id in self._free), f"block {block_id}: ref count {rc} vs free queue"
            block_hash = self._hashes[block_id]
            if block_hash is not None:
                assert self._hash_to_block.get(block_hash) == block_id, f"block {block_id} hash not mapped"
        assert len(self._hash_to_block) == sum(h is not None for h in self._hashes), "stale hash map entries"
        if not self.enable_caching:
            assert not self._hash_to_block and not self._events, "caching off but hashes/events present"
        # Empty free blocks precede cached ones (see the module diagram).
        seen_cached = False
        for block_id in self._free:
            if self._hashes[block_id] is not None:
                seen_cached = True
            else:
                assert not seen_cached, f"empty block {block_id} behind a cached one in the free queue"
