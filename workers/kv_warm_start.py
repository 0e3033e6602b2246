"""Warm start: a replica that joins (scale-up, a restart) pulls the fleet's
hottest cached prefix blocks from the replicas that hold them before it takes
traffic, within a byte budget and a time bound (issue 33, item 3;
docs/KV_TRANSFER.md)::

    joining replica (its constructor, after it registered with the directory;
    Serve routes nothing to it until the constructor returns)
      directory: live replicas, each one's contract and block set
      holders visited by how many blocks they hold (most first)
      holder.export_kv(its blocks not cached here, warm_blocks=budget left)
    holder: pin_hottest -> blocks in use, then free cached blocks from the most
            recently used (a parent before its children), up to warm_blocks;
            copied out, released
    joining replica: reserve (no hash), write, commit (hashed, KV events out:
            the directory lists it as a holder), until the budget or the time is spent

"Hottest" is the holder's own recency: the directory holds sets (no hit counts,
no order), while a holder's pool knows which blocks run now and which were
used last, and a chain's blocks are freed tail first, so a prefix's leading
blocks (those every request of it reuses) rank above its tail.

Faults: a holder that raises, dies, stalls past the time left or sends what
was not asked imports nothing from it (its reservation, if any, is released
unhashed: never readable); the replica starts all the same, counting the
outcome. Nothing here raises.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
from workers.kv_copy import write_blocks
from workers.kv_transfer import KVExport, KVTransfer
from workers.kv_transfer_metrics import MoveMetrics

logger = logging.getLogger(__name__)

DEFAULT_WARM_START_BYTES = 64 * 2**20  # cluster/shared/config/engine.py: kv_warm_start_bytes
# off: budget 0 or no KV to import; empty: no other replica holds a block; warmed: imported, no holder
# failed; partial: imported, some holder failed; error/timeout/mismatch/no_room: imported nothing, why.
WARM_OUTCOMES = ("off", "empty", "warmed", "partial", "error", "timeout", "mismatch", "no_room", "unreachable")


@dataclass
class WarmResult:
    outcome: str
    blocks: int = 0
    bytes: int = 0
    seconds: float = 0.0
    holders: int = 0


class WarmStartMetrics(MoveMetrics):
    """``prefixserve:kv_warm_start_total{outcome}``, ``..._blocks_total``,
    ``..._bytes_total`` and ``..._seconds`` (a gauge: the last warm start)."""

    def __init__(self, registry: Any, labels: dict[str, str]) -> None:
        super().__init__(registry, labels, "kv_warm_start", WARM_OUTCOMES,
                         ("Warm starts by outcome.", "KV blocks imported by warm start.",
                          "KV bytes imported by warm start.", "Seconds the last warm start took."))


async def warm_start(transfer: KVTransfer, directory: Any, holder_of: Optional[Callable[[str], Any]],
                     replica_id: str, contract: str, max_bytes: int, timeout_s: float) -> WarmResult:
    """Imports up to ``max_bytes`` of the hottest blocks other live replicas hold
    (see the module doc) within ``timeout_s``. Never raises."""
    began = time.monotonic()
    result = WarmResult("off")
    if max_bytes > 0 and transfer.layout is not None and transfer.block_bytes > 0:
        if holder_of is None:
            result.outcome = "unreachable"
        else:
            try:
                await _warm(transfer, directory, holder_of, replica_id, contract, max_bytes // transfer.block_bytes,
                            began + timeout_s, result)
            except Exception as exc:  # noqa: BLE001 - the directory failed: start cold
                logger.warning("warm start failed (%r); the replica starts cold", exc)
                result.outcome = "partial" if result.blocks else "error"
    result.bytes = result.blocks * transfer.block_bytes
    result.seconds = time.monotonic() - began
    logger.info("warm start: %s, %d blocks (%d bytes) from %d holders in %.2fs", result.outcome, result.blocks,
                result.bytes, result.holders, result.seconds)
    return result


async def _warm(transfer: KVTransfer, directory: Any, holder_of: Callable[[str], Any], replica_id: str,
                contract: str, budget: int, deadline: float, result: WarmResult) -> None:
    # An import takes at most half of the free blocks (TransferLedger.reserve): ask for no more, or a
    # small pool (the whole of it cached on the holder) would be sent everything and import nothing.
    budget = min(budget, transfer.ledger.max_reservable)
    held: dict[str, set[bytes]] = {}
    for rid in await directory.live_replicas():
        if rid != replica_id and (not contract or await directory.replica_contract(rid) == contract):
            held[rid] = await directory.replica_block_hashes(rid)
    failures: list[str] = []
    wanted = set().union(*held.values()) if held else set()
    for rid in sorted(held, key=lambda r: -len(held[r])):
        ask = [h for h in held[rid] if h in wanted and transfer.ledger.pool.get_cached_block(h) is None]
        left = deadline - time.monotonic()
        if budget <= 0 or left <= 0:
            if left <= 0 and ask:
                failures.append("timeout")
            break
        if not ask:
            continue
        reason, num = await _from_holder(transfer, holder_of(rid), ask, budget, left)
        if reason:
            logger.warning("warm start: holder %s: %s", rid, reason)
            failures.append(reason)
        if num:
            result.holders += 1
            result.blocks += num
            budget -= num
        wanted -= set(ask)  # asked once: what a holder did not send, another is not asked for
    if not wanted and not result.blocks and not failures:
        result.outcome = "empty"
    elif failures:
        result.outcome = "partial" if result.blocks else failures[0]
    else:
        result.outcome = "warmed" if result.blocks else "empty"


async def _from_holder(transfer: KVTransfer, holder: Any, ask: list[bytes], budget: int,
                       left: float) -> tuple[str, int]:
    """``(failure reason or "", blocks imported)`` from one holder."""
    try:
        export = await asyncio.wait_for(_ask(holder, ask, budget), left)
    except asyncio.TimeoutError:
        return "timeout", 0
    except Exception as exc:  # noqa: BLE001 - the holder raised or died
        logger.warning("warm start: the holder failed (%r)", exc)
        return "error", 0
    if not isinstance(export, KVExport) or not export.block_hashes:
        return "", 0  # it holds none of them now (evicted since): nothing to import, nothing failed
    num = len(export.block_hashes)
    shape_ok = (export.data is not None and tuple(export.data.shape) == transfer.layout.array_shape(num)  # type: ignore[union-attr]
                and export.data.dtype == np.uint8) if not transfer.ranks else len(export.rank_data) == transfer.num_ranks
    if export.layout != transfer.layout or num > budget or not set(export.block_hashes) <= set(ask) or not shape_ok:
        return "mismatch", 0
    if not transfer._try_enter("in"):
        return "error", 0
    try:
        got = await transfer._to_the_end(_import(transfer, export))
    except Exception as exc:  # noqa: BLE001 - the write failed: released unhashed
        logger.warning("warm start: import failed (%r)", exc)
        return "error", 0
    finally:
        transfer._leave("in")
    if got is None:
        return "no_room", 0
    transfer.metrics.moved("in", got, got * transfer.block_bytes)
    return "", got


async def _ask(holder: Any, ask: list[bytes], budget: int) -> Any:
    return await holder.export_kv.remote(ask, budget)


async def _import(transfer: KVTransfer, export: KVExport) -> Optional[int]:
    """Reserve (no hash), write, commit; None when the blocks do not fit (more than
    half of the free blocks). The blocks are no chain's run here: their events carry
    no parent and no tokens (the directory keeps sets)."""
    ledger = transfer.ledger
    held = await transfer._pool_call(lambda engine: ledger.reserve(export.block_hashes, b""))
    if held is None:
        return None
    try:
        if transfer.ranks:
            await asyncio.gather(*[rank.write_kv.remote(held.block_ids, ref, 0)
                                   for rank, ref in zip(transfer.ranks, export.rank_data)])
        else:
            await asyncio.to_thread(write_blocks, transfer.runner, held.block_ids, export.data)
    except BaseException:
        await transfer._pool_call(lambda engine: ledger.release(held.transfer_id))
        raise
    return await transfer._pool_call(lambda engine: transfer._commit(held))
