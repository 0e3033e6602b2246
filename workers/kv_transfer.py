"""KV transfer between replicas: a replica fetches the cached blocks of a
prefix it lacks from the replica that holds them (issue 33, item 1).

Transport: Ray. The receiver calls the holder's ``export_kv(block_hashes)``
through a handle (a Ray actor handle, or anything whose
``export_kv.remote(...)`` is awaitable, as a Serve handle's is); the holder
returns a ``KVExport`` whose bytes are one NumPy array, which Ray puts in its
object store and the receiver reads without a pickle copy (zero-copy on the
same node). Nothing here waits on the engine thread or blocks an event loop::

    receiver (its event loop)             holder (its event loop)
    hashes of the prompt's full blocks,
    minus those cached here (a racy read;
    commit re-checks)
    export_kv.remote(missing) ----------> pool gate:      pin_prefix(hashes)
                                          worker thread:  read_blocks (a copy;
                                            pinned blocks are never written)
                                          pool gate:      release (posted, not awaited)
    await the KVExport (timeout_s) <----- KVExport(hashes sent, layout, bytes)
    pool gate:      reserve               fresh blocks, no hash: no lookup reaches them
    worker thread:  write_blocks          the step loop runs on meanwhile
    pool gate:      commit, events out    hashed and freed: cached prefix blocks
    generate(request)                     the admission hits them

"pool gate": a worker thread holding the engine's ``PoolGate``
(``workers/engine/pool_gate.py``), which the engine thread lends while its
forward runs and while it idles: a pin does not wait for the step in flight
(a busy holder's step of 2,048 prefill tokens takes seconds on CPU).

The write runs off the engine thread: into blocks nobody reads, it is a
memcpy of ~23 MB for the default model's 512 tokens, but the first write
into never-used cache pages faults them in (the cache is allocated lazily,
``workers/kv_memory.py``), 74-380 ms measured on a loaded 2-core machine
(docs/KV_TRANSFER.md). A failed write releases the blocks unhashed.

Tensor parallel: the ranks hold the cache, so each rank of the holder
copies its shard into the object store (``RankWorker.read_kv``) and the
export carries one object ref per rank; rank i of the receiver writes rank
i's shard (``write_kv``), read from the object store, never through either
replica's process.

Faults: any error, a timeout, a layout mismatch or a holder that holds
nothing makes ``fetch`` return 0 and count a fallback; the caller then sends
the request as it would have, and it prefills. At most
``max_concurrent_transfers`` fetches and as many exports run at once per
replica; one more is refused at once (a fetch falls back, an export returns
nothing), never queued.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import numpy as np

from cluster.shared.hashing import lora_fingerprint
from workers.engine.kv_transfer import HeldBlocks, TransferLedger
from workers.engine.sequence import Sequence as EngineSequence
from workers.kv_copy import KVLayout, layout_of, read_blocks, write_blocks
from workers.kv_transfer_metrics import TransferMetrics

logger = logging.getLogger(__name__)

DEFAULT_MAX_CONCURRENT_TRANSFERS = 2  # per direction; a third is refused, never queued
DEFAULT_TIMEOUT_S = 10.0  # a holder silent this long (stalled, dead) -> the request prefills


@dataclass(frozen=True)
class KVExport:
    """A holder's answer: the leading blocks it had of those asked.

    ``data`` is ``workers/kv_copy.py``'s array for ``block_hashes``; None
    (with ``reason``) when nothing is sent. A tensor-parallel holder sends
    instead one object ref per rank (``rank_data``, each rank's shard; the
    receiver's rank i reads rank i's straight from the object store) and
    rank 0's ``layout``.
    """

    block_hashes: tuple[bytes, ...]
    layout: Optional[KVLayout]
    data: Optional[np.ndarray]
    reason: str = ""
    rank_data: tuple[Any, ...] = ()


class KVTransfer:
    """Exports and fetches cached prefix blocks for one replica.

    Args:
        front: The replica's ``AsyncEngine`` (engine-thread calls go through it).
        runner: The engine's ``ModelRunner``, or its ``TensorParallelRunner``
            (the ranks then copy their shards, rank to rank); anything else
            (a test's fake) turns transfers off: exports send nothing,
            fetches import nothing.
        metrics: Where the ``kv_transfer_*`` series go.
        after_commit: Runs on the engine thread after an import committed
            (the replica drains the KV events there, so the directory learns
            of the blocks without waiting for a step).
        max_concurrent_transfers: Fetches, and exports, in flight at once.
        timeout_s: How long a fetch waits for the holder.
    """

    def __init__(self, front: Any, runner: Any, metrics: Optional[TransferMetrics] = None,
                 after_commit: Optional[Callable[[], None]] = None,
                 max_concurrent_transfers: int = DEFAULT_MAX_CONCURRENT_TRANSFERS,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if max_concurrent_transfers < 1:
            raise ValueError(f"max_concurrent_transfers must be >= 1, got {max_concurrent_transfers}")
        self.front = front
        self.engine = front.engine
        self.runner = runner if hasattr(runner, "kv_caches") else None
        self.ranks: Optional[list[Any]] = getattr(runner, "_ranks", None) if hasattr(runner, "call_ranks") else None
        self.layout: Optional[KVLayout] = layout_of(self.runner) if self.runner is not None else None
        if self.ranks:  # rank 0's shard; every rank's has the same shape
            self.layout = runner.call_ranks("kv_layout")[0]
        self.num_ranks = len(self.ranks) if self.ranks else 1
        self.ledger = TransferLedger(self.engine.scheduler.kv_manager)
        self.metrics = metrics if metrics is not None else TransferMetrics()
        self.after_commit = after_commit
        self.max_concurrent_transfers = max_concurrent_transfers
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._in_flight = {"in": 0, "out": 0}
        self._posted: set[asyncio.Task] = set()  # releases posted to the engine thread, not awaited
        # Seconds of the stages of the last export (pin, read) and fetch (ask, import): the bench reads them.
        self.last_export: dict[str, float] = {}
        self.last_fetch: dict[str, float] = {}

    # ---------------------------------------------------------------- holder
    async def export(self, block_hashes: Sequence[bytes], warm_blocks: int = 0) -> KVExport:
        """The leading blocks of ``block_hashes`` cached here, copied out
        while pinned (see the module doc). Never raises for a miss: an empty
        export says why. ``warm_blocks`` > 0 (a warm start): up to that many
        of them in any order, hottest first (``TransferLedger.pin_hottest``)."""
        if self.layout is None:
            return KVExport((), None, None, "this replica's runner exports no KV")
        if not self._try_enter("out"):
            self.metrics.refused.inc()
            return KVExport((), self.layout, None, "busy: the replica's concurrent-transfer limit is reached")
        # Run to the end even if the caller goes away (a Serve cancel): a pin must never be left behind.
        return await self._to_the_end(self._export([bytes(h) for h in block_hashes], warm_blocks))

    async def _export(self, hashes: list[bytes], warm_blocks: int = 0) -> KVExport:
        try:
            began = time.perf_counter()
            held = await self._pool_call(lambda engine: self.ledger.pin_hottest(hashes, warm_blocks) if warm_blocks
                                         else self.ledger.pin_prefix(hashes))
            if held is None:
                return KVExport((), self.layout, None, "none of the blocks is cached here")
            pinned = time.perf_counter()
            try:
                if self.ranks:
                    rank_data = await self._read_ranks(held.block_ids)
                else:
                    data = await asyncio.to_thread(read_blocks, self.runner, held.block_ids)
            finally:
                self._post(lambda engine: self.ledger.release(held.transfer_id))
            self.last_export = {"pin_s": pinned - began, "read_s": time.perf_counter() - pinned}
            self.metrics.moved("out", len(held.block_ids), len(held.block_ids) * self.block_bytes)
            if self.ranks:
                return KVExport(held.block_hashes, self.layout, None, rank_data=rank_data)
            return KVExport(held.block_hashes, self.layout, data)
        finally:
            self._leave("out")

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across the layers and the ranks."""
        return self.layout.block_bytes * self.num_ranks if self.layout is not None else 0

    async def _read_ranks(self, block_ids: list[int]) -> tuple[Any, ...]:
        """Each rank copies its shard into the object store; returns the refs
        once every copy is done (the pin lasts until then), without fetching them here."""
        import ray

        refs = [rank.read_kv.remote(block_ids) for rank in self.ranks]  # type: ignore[union-attr]
        await asyncio.to_thread(ray.wait, refs, num_returns=len(refs), fetch_local=False)
        return tuple(refs)

    def _to_the_end(self, coro: Any) -> Any:
        """``coro`` as a task that a cancel of the awaiting caller does not stop."""
        task = asyncio.ensure_future(coro)
        self._posted.add(task)
        task.add_done_callback(lambda t: (self._posted.discard(t), t.cancelled() or t.exception()))
        return asyncio.shield(task)

    async def _pool_call(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(engine)`` under the engine's pool gate (``workers/engine/pool_gate.py``): while
        its forward runs or it idles, not after the step in flight (seconds of prefill on
        CPU, which a fetch from a busy holder used to wait); on the engine thread when the
        front has no gate (a test's)."""
        gate = getattr(self.front, "pool_gate", None)
        if gate is None:
            return await self.front.call(fn)
        return await asyncio.to_thread(gate.run, lambda: fn(self.engine))

    def _post(self, fn: Callable[[Any], object]) -> None:
        """Runs ``fn`` under the pool gate without waiting for it."""
        task = asyncio.ensure_future(self._pool_call(fn))
        self._posted.add(task)
        task.add_done_callback(self._posted.discard)

    # -------------------------------------------------------------- receiver
    def prefix_hashes(self, prompt_token_ids: Sequence[int], cache_salt: str = "",
                      model_fingerprint: Optional[str] = None) -> tuple[list[bytes], bytes]:
        """The hashes of the prompt's full blocks that a request could hit
        (never the last token's block: one token is always computed), and
        the chain's root; ``model_fingerprint``: a LoRA adapter's
        (``fingerprint_for``; default the base model's). No engine state read."""
        seq = EngineSequence("kv-transfer", prompt_token_ids, block_size=self.ledger.pool.block_size,
                             model_fingerprint=model_fingerprint or self.engine.model_fingerprint,
                             cache_salt=cache_salt,
                             long_rope_after=self.engine.long_rope_after)
        max_blocks = (len(seq.prompt_token_ids) - 1) // seq.block_size
        return seq.block_hashes[:max_blocks], seq.hash_root

    def fingerprint_for(self, lora_request: Any) -> Optional[str]:
        """What the blocks of a request with ``lora_request`` hash on: the base
        model's fingerprint (None: no adapter), or the adapter's content's
        (``cluster.shared.hashing.lora_fingerprint``), known once the adapter
        is loaded or read ahead here; None when it is not (nothing to fetch
        by: the request prefills)."""
        if lora_request is None:
            return self.engine.model_fingerprint
        manager = getattr(self.engine, "lora", None)
        content = manager.content_hash(lora_request) if manager is not None else None
        return lora_fingerprint(self.engine.model_fingerprint, content) if content else None

    async def fetch(self, holder: Any, prompt_token_ids: Sequence[int], cache_salt: str = "",
                    lora_request: Any = None) -> int:
        """Imports from ``holder`` the cached blocks of the prompt's prefix
        that this replica lacks.

        Args:
            holder: Has ``export_kv.remote(block_hashes)`` returning an
                awaitable ``KVExport`` (a Ray actor handle of a replica).
            prompt_token_ids: The request's prompt.
            cache_salt: The request's cache salt (part of the hashes).
            lora_request: The request's LoRA adapter (its content is part
                of the hashes; ``fingerprint_for``).

        Returns:
            Prompt tokens whose KV was imported (0: the request prefills
            them; the fallback's reason is counted and logged).
        """
        started = time.perf_counter()
        if self.layout is None:
            return 0
        if not self._try_enter("in"):
            self.metrics.fallback("busy")
            return 0
        try:
            fingerprint = self.fingerprint_for(lora_request)
            if fingerprint is None:
                self.metrics.fallback("no_adapter")
                return 0
            hashes, root = self.prefix_hashes(prompt_token_ids, cache_salt, fingerprint)
            # Read off the engine thread (a dict lookup per hash): a stale answer costs a few blocks
            # fetched twice or not at all; reserve and commit re-check on the engine thread.
            start = self.ledger.num_cached_leading(hashes)
            if start == len(hashes):
                return 0
            asked = time.perf_counter()
            try:
                export = await asyncio.wait_for(_ask(holder, hashes[start:]), self.timeout_s)
            except asyncio.TimeoutError:
                logger.warning("KV fetch: the holder sent nothing in %.1fs; the request prefills", self.timeout_s)
                self.metrics.fallback("timeout")
                return 0
            reason = self._check(export, hashes[start:])
            if reason is not None:
                logger.warning("KV fetch: %s; the request prefills", export.reason or reason)
                self.metrics.fallback(reason)
                return 0
            answered = time.perf_counter()
            # Reserve, write and commit run to the end even if this fetch is cancelled (the client
            # left): a cancel between reserve and commit would leave the reserved blocks held.
            num = await self._to_the_end(self._import(export, hashes, start, root, prompt_token_ids))
            self.last_fetch = {"ask_s": answered - asked, "import_s": time.perf_counter() - answered}
            if num is None:
                self.metrics.fallback("no_room")
                return 0
            num_tokens = num * self.ledger.pool.block_size
            self.metrics.moved("in", num, num * self.block_bytes)
            self.metrics.prefix_tokens.inc(num_tokens)
            self.metrics.seconds.observe(time.perf_counter() - started)
            return num_tokens
        except Exception as exc:  # noqa: BLE001 - a holder that died or failed: prefill instead
            logger.warning("KV fetch failed (%r); the request prefills", exc)
            self.metrics.fallback("error")
            return 0
        finally:
            self._leave("in")

    def _check(self, export: KVExport, asked: list[bytes]) -> Optional[str]:
        """Why ``export`` cannot be imported (a fallback reason), or None."""
        if not isinstance(export, KVExport) or not export.block_hashes or (
                export.data is None and not export.rank_data):
            return "not_held"
        if export.layout != self.layout:
            logger.warning("KV fetch: the holder's cache layout %s differs from this one %s", export.layout,
                           self.layout)
            return "mismatch"
        num = len(export.block_hashes)
        if list(export.block_hashes) != asked[:num]:
            return "mismatch"
        if len(export.rank_data) != (self.num_ranks if self.ranks else 0):
            return "mismatch"  # another tensor_parallel_size (the ranks check their shard's shape)
        if not self.ranks and (tuple(export.data.shape) != self.layout.array_shape(num)  # type: ignore[union-attr]
                               or export.data.dtype != np.uint8):  # type: ignore[union-attr]
            return "mismatch"
        return None

    async def _import(self, export: KVExport, hashes: list[bytes], start: int, root: bytes,
                      prompt_token_ids: Sequence[int]) -> Optional[int]:
        """Reserve (engine thread), write (a worker thread: the reserved
        blocks are no sequence's and carry no hash, so no step reads them),
        commit (engine thread). Returns the blocks imported, or None when
        they do not fit."""
        reserved = await self._pool_call(lambda engine: self._reserve(export, hashes, start, root, prompt_token_ids))
        if reserved is None or reserved == 0:
            return reserved
        held, skip = reserved
        try:
            if self.ranks:  # each rank reads its peer rank's shard from the object store
                await asyncio.gather(*[rank.write_kv.remote(held.block_ids, ref, skip)
                                       for rank, ref in zip(self.ranks, export.rank_data)])
            else:
                await asyncio.to_thread(write_blocks, self.runner, held.block_ids, export.data[:, :, skip:])  # type: ignore[index]
        except Exception:
            await self._pool_call(lambda engine: self.ledger.release(held.transfer_id))  # never hashed: nothing read it
            raise
        except BaseException:  # cancelled: the release must not wait
            self._post(lambda engine: self.ledger.release(held.transfer_id))
            raise
        return await self._pool_call(lambda engine: self._commit(held))

    def _reserve(self, export: KVExport, hashes: list[bytes], start: int, root: bytes,
                 prompt_token_ids: Sequence[int]) -> Any:
        """Engine thread: ``(held, blocks of the export skipped)``, 0 when
        every block is cached here now, None when they do not fit."""
        bs = self.ledger.pool.block_size
        num = len(export.block_hashes)
        # Blocks cached here since the racy read are skipped: import only past the local run.
        skip = max(0, self.ledger.num_cached_leading(hashes[: start + num]) - start)
        if skip == num:
            return 0
        first = start + skip
        held = self.ledger.reserve(hashes[first : start + num], hashes[first - 1] if first else root,
                                   list(prompt_token_ids[first * bs : (start + num) * bs]))
        return None if held is None else (held, skip)

    def _commit(self, held: HeldBlocks) -> int:
        """Engine thread: the written blocks become cached prefix blocks; their events go out."""
        self.ledger.commit(held.transfer_id)
        if self.after_commit is not None:
            self.after_commit()
        return len(held.block_ids)

    # ----------------------------------------------------------------- limits
    def _try_enter(self, direction: str) -> bool:
        with self._lock:
            if self._in_flight[direction] >= self.max_concurrent_transfers:
                return False
            self._in_flight[direction] += 1
            return True

    def _leave(self, direction: str) -> None:
        with self._lock:
            self._in_flight[direction] -= 1


async def _ask(holder: Any, block_hashes: list[bytes]) -> KVExport:
    return await holder.export_kv.remote(block_hashes)


class LocalHolder:
    """A replica in this process behind the ``export_kv.remote(...)`` shape of
    a Ray actor handle (engine tests and the bench's in-process mode)."""

    def __init__(self, transfer: KVTransfer) -> None:
        self.export_kv = _Remote(transfer.export)


class _Remote:
    def __init__(self, fn: Callable[..., Any]) -> None:
        self._fn = fn

    def remote(self, *args: Any) -> Any:
        return self._fn(*args)
