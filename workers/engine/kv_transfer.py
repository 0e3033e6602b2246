"""Cached prefix blocks moving between two engines' pools: the bookkeeping.

Pure Python, like the pool: the ledger decides which blocks move and holds
them while their bytes move; the runner's copies (``workers/kv_copy.py``)
and the transport (``workers/kv_transfer.py``) do the rest. Every call
mutates the pool and runs on the engine thread, between steps.

Holder (export)::

    pin_prefix(hashes)   the leading run of ``hashes`` cached here -> their
                         blocks, ref count + 1 each (a free cached block leaves
                         the free queue: it can be neither evicted nor reused)
    ... the runner copies them out; a full cached block is never written
        again, so the copy may run off the engine thread while it steps ...
    release(id)          ref count - 1: free cached blocks rejoin the free
                         queue's tail (most recently used)

Receiver (import)::

    num_cached_leading(hashes)   what is here already (not fetched)
    reserve(hashes)      fresh blocks, ref count 1, *no hash*: no prefix
                         lookup can reach them, so a block being written is
                         never readable
    ... the runner writes the fetched KV into them ...
    commit(id)           hashes entered (``BlockStored`` events, as for a
                         computed block), then freed: free, cached, at the
                         MRU tail, hit by the next admission of the prefix
    release(id)          (instead of commit: the copy failed) freed without
                         hashes: free, empty, reused first

States of a block the ledger holds::

    transfer          ref count      hash       a prefix lookup finds it
    export pinned     +1             yes        yes (reading is safe)
    import reserved   1              no         no
    import committed  0 (released)   yes        yes
    import released   0              no         no

A reservation never takes more than half of the free blocks (``reserve``):
a transfer must not starve the requests that are running.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence as Seq

from workers.engine.kv_manager import KVCacheManager


@dataclass
class HeldBlocks:
    """Blocks a transfer holds. Shaped like a sequence's block table
    (``block_ids``, ``cpu_block_ids``, ``num_released_blocks``,
    ``num_registered_blocks``) so ``KVCacheManager.check_integrity`` counts
    its references with those of the sequences."""

    transfer_id: int
    block_ids: list[int]
    block_hashes: tuple[bytes, ...]
    is_import: bool
    parent_block_hash: bytes = b""
    token_ids: Optional[tuple[int, ...]] = None
    cpu_block_ids: list[int] = field(default_factory=list)
    num_released_blocks: int = 0
    num_registered_blocks: int = 0


class TransferLedger:
    """Pins exported blocks and reserves imported ones (see the module doc).

    Args:
        kv_manager: The engine's KV manager; its device pool is the one
            blocks move out of and into.
    """

    def __init__(self, kv_manager: KVCacheManager) -> None:
        self.kv_manager = kv_manager
        self.pool = kv_manager.device_pool
        self._held: dict[int, HeldBlocks] = {}
        self._ids = itertools.count(1)

    @property
    def num_held_blocks(self) -> int:
        return sum(len(h.block_ids) for h in self._held.values())

    def holdings(self) -> list[HeldBlocks]:
        """The transfers in progress. No mutation."""
        return list(self._held.values())

    # ---------------------------------------------------------------- holder
    def num_cached_leading(self, block_hashes: Seq[bytes]) -> int:
        """How many leading hashes are cached in the pool. No mutation."""
        num = 0
        for block_hash in block_hashes:
            if self.pool.get_cached_block(block_hash) is None:
                break
            num += 1
        return num

    def pin_prefix(self, block_hashes: Seq[bytes]) -> Optional[HeldBlocks]:
        """Pins the leading run of ``block_hashes`` cached here (mutates:
        ref count + 1 each).

        Returns:
            The pinned blocks, or None when the first hash is not cached (or
            caching is off): nothing to send.
        """
        if not self.pool.enable_caching:
            return None
        num = self.num_cached_leading(block_hashes)
        if num == 0:
            return None
        block_ids = [self.pool.get_cached_block(h) for h in block_hashes[:num]]
        self.pool.touch(block_ids)  # type: ignore[arg-type]
        held = HeldBlocks(next(self._ids), block_ids, tuple(block_hashes[:num]), is_import=False)  # type: ignore[arg-type]
        self._held[held.transfer_id] = held
        return held

    def pin_hottest(self, block_hashes: Seq[bytes], max_blocks: int) -> Optional[HeldBlocks]:
        """Pins up to ``max_blocks`` of ``block_hashes`` cached here, in any
        order, hottest first (a warm start, ``workers/kv_warm_start.py``):
        blocks in use by a running sequence, then free cached blocks from the
        most recently used (a chain's blocks are freed tail first, so a
        parent comes before its children). Mutates: ref count + 1 each.

        Returns:
            The pinned blocks, or None when none is cached here.
        """
        if not self.pool.enable_caching or max_blocks < 1:
            return None
        asked = {h for h in block_hashes if self.pool.get_cached_block(h) is not None}
        if not asked:
            return None
        by_block = {self.pool.get_cached_block(h): h for h in asked}
        in_use = [b for b in by_block if self.pool.ref_count(b) > 0]  # type: ignore[arg-type]
        free = [b for b in reversed(self.pool.free_block_ids()) if b in by_block]
        block_ids = (in_use + free)[:max_blocks]
        self.pool.touch(block_ids)  # type: ignore[arg-type]
        held = HeldBlocks(next(self._ids), block_ids, tuple(by_block[b] for b in block_ids), is_import=False)  # type: ignore[arg-type]
        self._held[held.transfer_id] = held
        return held

    # -------------------------------------------------------------- receiver
    @property
    def max_reservable(self) -> int:
        """The most blocks one reservation may take now: half of the free blocks
        (a transfer must not starve the requests that are running). No mutation."""
        return self.pool.num_free_blocks // 2

    def reserve(self, block_hashes: Seq[bytes], parent_block_hash: bytes,
                token_ids: Optional[Seq[int]] = None) -> Optional[HeldBlocks]:
        """Takes fresh, uncached blocks for ``block_hashes`` (mutates).

        Args:
            block_hashes: Consecutive blocks of one chain, in order.
            parent_block_hash: The hash ``block_hashes[0]`` chains on.
            token_ids: Their tokens (``block_size`` each), for the events.

        Returns:
            The reserved blocks, or None (nothing changed) when caching is off,
            nothing is asked, or they would take more than half of the free
            blocks.
        """
        num = len(block_hashes)
        if not self.pool.enable_caching or num == 0 or num > self.max_reservable:
            return None
        assert token_ids is None or len(token_ids) == num * self.pool.block_size
        block_ids = self.pool.allocate(num)
        assert block_ids is not None
        held = HeldBlocks(next(self._ids), block_ids, tuple(block_hashes), is_import=True,
                          parent_block_hash=parent_block_hash,
                          token_ids=tuple(token_ids) if token_ids is not None else None)
        self._held[held.transfer_id] = held
        return held

    def commit(self, transfer_id: int) -> int:
        """Enters a reservation's written blocks into the prefix cache and
        lets go of them (mutates; emits ``BlockStored``). A hash cached here
        meanwhile is skipped (its block stays empty, reused first).

        Returns:
            How many blocks were newly cached.
        """
        held = self._held.pop(transfer_id)
        assert held.is_import, f"transfer {transfer_id} is an export: release it"
        num = self.pool.cache_full_blocks(held.block_ids, held.block_hashes, held.parent_block_hash,
                                          held.token_ids)
        self.pool.free(reversed(held.block_ids))  # tail first, as a sequence frees
        return num

    def release(self, transfer_id: int) -> None:
        """Ends a transfer without caching anything new (mutates): unpins an
        export, or frees a reservation whose copy failed (its blocks never
        got a hash: nothing ever read them). Unknown ids are a no-op."""
        held = self._held.pop(transfer_id, None)
        if held is not None:
            self.pool.free(reversed(held.block_ids))

    def release_all(self) -> None:
        """Releases every transfer in progress (mutates): the replica stops."""
        for transfer_id in list(self._held):
            self.release(transfer_id)

    # ------------------------------------------------------------- integrity
    def check_integrity(self, seqs: Optional[Iterable[object]] = None) -> None:
        """``KVCacheManager.check_integrity`` with the held blocks counted as
        references beside ``seqs`` (every unfinished sequence). No mutation."""
        for held in self._held.values():
            if held.is_import:
                assert all(self.pool.block_hash(b) is None for b in held.block_ids), \
                    f"reserved block of transfer {held.transfer_id} is readable"
        if seqs is None:
            self.kv_manager.check_integrity()
            return
        self.kv_manager.check_integrity([*seqs, *self._held.values()])  # type: ignore[list-item]
