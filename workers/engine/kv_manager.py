"""Block tables of sequences over a device pool and a CPU swap pool.

The scheduler asks; this class answers with block ids and edits only the
block fields of a ``Sequence`` (``block_ids``, ``cpu_block_ids``,
``num_registered_blocks``). ``None`` means "does not fit, nothing changed":
the scheduler then preempts or waits.

Prefix reuse at admission (block_size 4, 11-token prompt; blocks A and B are
cached from an earlier request with the same first 8 tokens)::

    tokens      t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9 t10
    hashes      h1          | h2          |             (full blocks only)
    hit         A (ref+1)   | B (ref+1)   |
    allocate                                new block C
    block_ids   [A, B, C]   num_computed_tokens 8, prefill computes t8..t10

At most ``(num_tokens - 1) // block_size`` blocks are reused, so at least one
token is always computed and there are logits to sample from. Blocks are
registered in the cache only once their KV has been computed
(``cache_computed_blocks``, after the step), so a sequence admitted in the
same step can never hit a block whose KV is still being written.

Swap order within one step (the runner copies out, then in, then runs)::

    swap_out: device -> CPU   device blocks are free at once: anything that
                              reuses them writes only in this step's forward,
                              after the copy
    swap_in:  CPU -> device   the CPU blocks are freed only at the next step
                              (``release_swap_in_sources``): a swap-out in the
                              same step would otherwise overwrite them before
                              the swap-in copy reads them

(The scheduler never swaps out and in during one step today -- it resumes
swapped sequences only in steps without preemption -- but the manager does
not rely on that.)

Sliding windows (every layer attends to the last W positions only): once a
block lies wholly before every position the sequence will still attend from,
``release_outside_window`` returns it to the pool (a full block stays in the
prefix cache for others) and points its table entry at the first block still
held, so positions keep their table index (block 5, window 8)::

    block_ids   [A, B, C, D, E]  ->  [C, C, C, D, E]   num_released_blocks 2
    owned                               ^^^^ only C, D, E are referenced

A sequence with released blocks is never swapped (its prefix is gone): it is
preempted for recompute.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Optional, Sequence as Seq

from cluster.shared.sizes import cdiv
from workers.engine.block_pool import BlockPool, KVCacheSnapshot, KVEventBatch
from workers.engine.sequence import Sequence


class KVCacheManager:
    """Allocates, caches, swaps and frees the blocks of sequences.

    Args:
        device_pool: Blocks of the device KV cache; its ``enable_caching``
            turns prefix caching on or off.
        swap_pool: CPU blocks for swapped-out sequences (same block size,
            caching off); None disables swapping.
    """

    def __init__(self, device_pool: BlockPool, swap_pool: Optional[BlockPool] = None) -> None:
        if swap_pool is not None and swap_pool.block_size != device_pool.block_size:
            raise ValueError(
                f"swap pool block_size {swap_pool.block_size} != device block_size {device_pool.block_size}"
            )
        if swap_pool is not None and swap_pool.enable_caching:
            raise ValueError("the swap pool must be built with enable_caching=False")
        self.device_pool = device_pool
        self.swap_pool = swap_pool
        self.block_size = device_pool.block_size
        self.enable_prefix_caching = device_pool.enable_caching
        self.prefix_cache_queries = 0  # tokens looked up at each admission (re-admissions too)
        self.prefix_cache_hits = 0  # of which served from the cache
        self._swap_in_sources: list[int] = []  # CPU blocks read by this step's swap-ins

    # ---------------------------------------------------------------- figures
    @property
    def num_device_blocks(self) -> int:
        return self.device_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.device_pool.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return self.device_pool.num_cached_blocks

    @property
    def usage(self) -> float:
        """Used device blocks / total, in [0, 1]."""
        return self.device_pool.usage

    kv_cache_usage = usage

    @property
    def num_free_swap_blocks(self) -> int:
        return self.swap_pool.num_free_blocks if self.swap_pool is not None else 0

    @property
    def swap_usage(self) -> float:
        return self.swap_pool.usage if self.swap_pool is not None else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens of KV."""
        return cdiv(num_tokens, self.block_size)

    # -------------------------------------------------------------- admission
    def get_computed_blocks(self, seq: Sequence) -> tuple[list[int], int]:
        """Finds the longest cached prefix of ``seq``'s full blocks. No mutation.

        Returns:
            ``(block_ids, num_computed_tokens)``; never the whole sequence.
        """
        if not self.enable_prefix_caching:
            return [], 0
        max_blocks = (seq.num_tokens - 1) // self.block_size
        block_ids = []
        for block_hash in seq.block_hashes[:max_blocks]:
            block_id = self.device_pool.get_cached_block(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids, len(block_ids) * self.block_size

    def allocate_slots(
        self, seq: Sequence, num_new_tokens: int, computed_blocks: Seq[int] = ()
    ) -> Optional[list[int]]:
        """Grows ``seq``'s block table so ``num_new_tokens`` more tokens fit
        (mutates the pool and ``seq.block_ids``).

        Args:
            seq: A sequence holding no CPU blocks.
            num_new_tokens: Tokens past ``num_computed_tokens`` (and past the
                computed blocks) whose KV this step writes.
            computed_blocks: Prefix hits from ``get_computed_blocks``; only
                for a sequence with no blocks and nothing computed yet. The
                caller then adds their tokens to ``num_computed_tokens``.

        Returns:
            The newly allocated block ids (maybe empty), or None when they do
            not fit (nothing changed).
        """
        assert not seq.cpu_block_ids, f"{seq.request_id} is swapped out"
        assert num_new_tokens >= 0
        if computed_blocks:
            assert not seq.block_ids and seq.num_computed_tokens == 0
        num_computed = seq.num_computed_tokens + len(computed_blocks) * self.block_size
        num_held = len(seq.block_ids) + len(computed_blocks)
        num_needed = max(0, self.num_blocks_for(num_computed + num_new_tokens) - num_held)
        new_blocks = self._try_take(computed_blocks, num_needed)
        if new_blocks is None:
            return None
        if not seq.block_ids and seq.num_computed_tokens == 0 and self.enable_prefix_caching:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += len(computed_blocks) * self.block_size
        if computed_blocks:
            seq.num_registered_blocks = len(computed_blocks)
        seq.block_ids.extend(computed_blocks)
        seq.block_ids.extend(new_blocks)
        return new_blocks

    def _try_take(self, hit_blocks: Seq[int], num_new: int) -> Optional[list[int]]:
        """Takes a reference on ``hit_blocks`` and allocates ``num_new``
        blocks, all or nothing (mutates the device pool)."""
        pool = self.device_pool
        # A hit on a free cached block takes it out of the free queue.
        num_revived = sum(1 for b in hit_blocks if pool.ref_count(b) == 0)
        if num_new > pool.num_free_blocks - num_revived:
            return None
        pool.touch(hit_blocks)
        new_blocks = pool.allocate(num_new)
        assert new_blocks is not None
        return new_blocks

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Enters ``seq``'s full blocks whose KV is now computed into the
        prefix cache (mutates; the pool emits ``BlockStored``). Call it after
        a step advanced ``num_computed_tokens``."""
        if not self.enable_prefix_caching:
            return
        start = seq.num_registered_blocks
        end = min(seq.num_computed_tokens // self.block_size, len(seq.block_hashes))
        if end <= start:
            return
        bs = self.block_size
        parent = seq.block_hashes[start - 1] if start else seq.hash_root
        self.device_pool.cache_full_blocks(
            seq.block_ids[start:end], seq.block_hashes[start:end], parent, seq.all_token_ids[start * bs : end * bs]
        )
        seq.num_registered_blocks = end

    def release_outside_window(self, seq: Sequence, window: int) -> int:
        """Releases the leading blocks no sliding window of ``window``
        positions reaches any more (mutates; see the module doc).

        The next position to compute is ``num_computed_tokens`` and it attends
        from ``num_computed_tokens - window + 1`` on: blocks wholly before that
        are never read again by this sequence.

        Returns:
            The number of blocks released now.
        """
        first_needed = max(0, seq.num_computed_tokens - window + 1) // self.block_size
        first_needed = min(first_needed, len(seq.block_ids) - 1)
        start = seq.num_released_blocks
        if first_needed <= start:
            return 0
        self.device_pool.free(reversed(seq.block_ids[start:first_needed]))
        keep = seq.block_ids[first_needed]
        seq.block_ids[:first_needed] = [keep] * first_needed
        seq.num_released_blocks = first_needed
        return first_needed - start

    def trim(self, seq: Sequence) -> int:
        """Frees the blocks past those ``seq``'s tokens need (mutates): after a
        step whose speculated tokens were rejected. Returns how many."""
        keep = max(self.num_blocks_for(seq.num_tokens), seq.num_released_blocks + 1)
        extra = seq.block_ids[keep:]
        if not extra:
            return 0
        assert seq.num_registered_blocks <= keep, seq
        self.device_pool.free(reversed(extra))
        del seq.block_ids[keep:]
        return len(extra)

    def free(self, seq: Sequence) -> None:
        """Returns all of ``seq``'s device and CPU blocks (mutates). Its full
        cached blocks stay hittable until evicted, tail blocks first."""
        self.device_pool.free(reversed(seq.block_ids[seq.num_released_blocks :]))
        seq.block_ids = []
        seq.num_released_blocks = 0
        if seq.cpu_block_ids:
            assert self.swap_pool is not None
            self.swap_pool.free(seq.cpu_block_ids)
            seq.cpu_block_ids = []
        seq.num_registered_blocks = 0

    def fork(self, parent: Sequence, child: Sequence) -> Optional[list[tuple[int, int]]]:
        """Gives ``child`` (a fork of ``parent`` holding no blocks) the
        parent's computed KV (mutates the pool and ``child``'s block fields).

        The parent's full blocks are shared by reference count; a partly
        filled last block is copied into a new block of the child (copy on
        write: the child's next token goes into it, the parent's into its
        own). Block size 4, 6 computed tokens::

            parent   [A, B]   A full (shared), B holds 2 tokens
            child    [A, C]   C: B's 2 tokens copied, then the child's own

        Returns:
            ``(from_slot, to_slot)`` KV rows to copy before the next forward
            (maybe empty), or None when no block is free or the parent
            released blocks outside its sliding window (nothing changed:
            the child is then recomputed).
        """
        assert not child.block_ids and not child.cpu_block_ids and not parent.cpu_block_ids
        if parent.num_released_blocks:
            return None
        bs = self.block_size
        num_computed = parent.num_computed_tokens
        num_full, num_partial = divmod(num_computed, bs)
        shared = parent.block_ids[:num_full]
        new_blocks = self._try_take(shared, 1 if num_partial else 0)
        if new_blocks is None:
            return None
        moves = []
        if num_partial:
            src, dst = parent.block_ids[num_full], new_blocks[0]
            moves = [(src * bs + j, dst * bs + j) for j in range(num_partial)]
        child.block_ids = list(shared) + new_blocks
        child.num_computed_tokens = num_computed
        child.num_registered_blocks = min(parent.num_registered_blocks, num_full)
        return moves

    # ---------------------------------------------------------------- swapping
    def swap_out(self, seq: Sequence) -> Optional[list[tuple[int, int]]]:
        """Moves the blocks holding ``seq``'s computed KV to the swap pool and
        frees all its device blocks (mutates).

        Returns:
            ``[(device_block, cpu_block), ...]`` to copy, or None (nothing
            changed) without a swap pool or room in it, or when the sequence
            released blocks outside its sliding window.
        """
        if self.swap_pool is None or seq.num_released_blocks:
            return None
        num_blocks = self.num_blocks_for(seq.num_computed_tokens)
        assert num_blocks <= len(seq.block_ids)
        cpu_blocks = self.swap_pool.allocate(num_blocks)
        if cpu_blocks is None:
            return None
        mapping = list(zip(seq.block_ids[:num_blocks], cpu_blocks))
        self.device_pool.free(reversed(seq.block_ids))
        seq.block_ids = []
        seq.cpu_block_ids = cpu_blocks
        seq.num_registered_blocks = 0
        return mapping

    def swap_in(self, seq: Sequence, num_new_tokens: int = 0) -> Optional[list[tuple[int, int]]]:
        """Brings a swapped-out ``seq`` back to device blocks, with room for
        ``num_new_tokens`` more tokens (mutates).

        Leading full blocks whose hashes are still cached on the device are
        shared instead of copied.

        Returns:
            ``[(cpu_block, device_block), ...]`` to copy, or None (nothing
            changed) when the device blocks do not fit.
        """
        assert not seq.block_ids, f"{seq.request_id} holds device blocks"
        num_cpu = len(seq.cpu_block_ids)
        hits: list[int] = []
        if self.enable_prefix_caching:
            for block_hash in seq.block_hashes[: min(num_cpu, seq.num_computed_tokens // self.block_size)]:
                block_id = self.device_pool.get_cached_block(block_hash)
                if block_id is None:
                    break
                hits.append(block_id)
        num_total = max(num_cpu, self.num_blocks_for(seq.num_computed_tokens + num_new_tokens))
        new_blocks = self._try_take(hits, num_total - len(hits))
        if new_blocks is None:
            return None
        mapping = list(zip(seq.cpu_block_ids[len(hits) :], new_blocks))
        seq.block_ids = hits + new_blocks
        seq.num_registered_blocks = len(hits)
        self._swap_in_sources.extend(seq.cpu_block_ids)
        seq.cpu_block_ids = []
        return mapping

    def release_swap_in_sources(self) -> None:
        """Frees the CPU blocks of the last step's swap-ins (mutates). Call
        it once the runner has executed that step."""
        if self._swap_in_sources:
            assert self.swap_pool is not None
            self.swap_pool.free(self._swap_in_sources)
            self._swap_in_sources = []

    # ------------------------------------------------------ events and cache
    def take_events(self) -> Optional[KVEventBatch]:
        """Drains the device pool's KV events (see ``BlockPool.take_events``)."""
        return self.device_pool.take_events()

    def take_snapshot(self) -> KVCacheSnapshot:
        """Every cached device hash, for a full resync (``BlockPool.take_snapshot``)."""
        return self.device_pool.take_snapshot()

    def reset_prefix_cache(self) -> bool:
        """Drops the device prefix cache; False when blocks are in use."""
        return self.device_pool.reset_prefix_cache()

    def check_integrity(self, seqs: Optional[Iterable[Sequence]] = None) -> None:
        """Asserts both pools' invariants and, given every unfinished
        sequence, that each block's ref count equals the tables naming it.
        No mutation."""
        self.device_pool.check_integrity()
        if self.swap_pool is not None:
            self.swap_pool.check_integrity()
        if seqs is None:
            return
        device_refs: Counter[int] = Counter()
        cpu_refs: Counter[int] = Counter(self._swap_in_sources)
        for seq in seqs:
            device_refs.update(seq.block_ids[seq.num_released_blocks :])
            cpu_refs.update(seq.cpu_block_ids)
            assert seq.num_registered_blocks <= len(seq.block_ids)
        for block_id in range(self.device_pool.num_blocks):
            got = self.device_pool.ref_count(block_id)
            assert got == device_refs[block_id], f"device block {block_id}: ref {got}, tables {device_refs[block_id]}"
        if self.swap_pool is not None:
            for block_id in range(self.swap_pool.num_blocks):
                got = self.swap_pool.ref_count(block_id)
                assert got == cpu_refs[block_id], f"cpu block {block_id}: ref {got}, tables {cpu_refs[block_id]}"
        else:
            assert not cpu_refs
