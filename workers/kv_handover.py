"""Cache hand-over on scale-down: a replica that Serve stops pushes its hottest
cached prefix blocks to a surviving replica before it exits, within a byte
budget and a time bound (issue 33, item 3; docs/KV_TRANSFER.md)::

    stopping replica (its graceful shutdown: Serve drained its requests and
    stopped routing to it; ReplicaServer.shutdown, before the engine stops)
      directory: live replicas but this one, same contract -> receivers,
                 most room first (lowest KV use, then fewest running)
      free cached blocks here, most recently used first, minus those the
                 receiver already lists
      export: pin_hottest (up to the budget), copied out, released
      receiver.import_kv(export) ------------------------------------+
                                                                     v
    receiver: keep the blocks not cached there, hottest first, at most half of
              its free blocks; reserve (no hash), write, commit (hashed, KV
              events out: the directory lists the receiver as a holder)

The push goes from the stopping replica because Serve stops routing to a
replica before its destructor runs: a survivor could not reach it to pull.
Blocks in use by the requests being drained are not the point (there are none
once Serve drained it); free cached blocks are what the replica would take
with it.

Faults: a receiver that raises, dies, stalls past the time left or has no
room imports nothing it did not commit (a reservation whose write failed is
released unhashed: never readable); the next receiver is tried while time is
left. The stop never waits past the time bound and never fails: nothing here
raises.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
from prometheus_client import Counter

from cluster.shared.metrics_format import METRIC_PREFIX as PREFIX
from workers.kv_copy import write_blocks
from workers.kv_transfer import KVExport, KVTransfer
from workers.kv_transfer_metrics import MoveMetrics

logger = logging.getLogger(__name__)

DEFAULT_HANDOVER_BYTES = 64 * 2**20  # cluster/shared/config/engine.py: kv_handover_bytes
# off: budget 0, no KV or not reachable by Serve; skipped: the whole application is being deleted (no
# survivor); empty: nothing cached here; no_receiver: no other live replica of the same contract;
# handed_over: every block sent was imported; partial: some blocks imported, some receiver failed or
# lacked room; error/timeout/mismatch/no_room: nothing imported, why.
HANDOVER_OUTCOMES = ("off", "skipped", "empty", "no_receiver", "handed_over", "partial", "error", "timeout",
                     "mismatch", "no_room")


@dataclass
class HandoverResult:
    outcome: str
    blocks: int = 0
    bytes: int = 0
    seconds: float = 0.0
    receivers: int = 0


class HandoverMetrics(MoveMetrics):
    """The sender's ``prefixserve:kv_handover_total{outcome}``, ``..._blocks_total``,
    ``..._bytes_total`` (blocks its receivers committed) and ``..._seconds`` (a
    gauge: the last hand-over); the receiver's ``..._received_blocks_total`` and
    ``..._received_bytes_total``. A stopping replica's series leave with it (the
    router's ``/metrics`` lists live replicas): its outcome is also logged, and
    the survivors' received counts stay."""

    def __init__(self, registry: Any, labels: dict[str, str]) -> None:
        super().__init__(registry, labels, "kv_handover", HANDOVER_OUTCOMES,
                         ("Cache hand-overs on scale-down by outcome.", "KV blocks handed over to survivors.",
                          "KV bytes handed over to survivors.", "Seconds the last hand-over took."))
        names = tuple(labels)
        self.received_blocks = Counter(PREFIX + "kv_handover_received_blocks",
                                       "KV blocks imported from stopping replicas' hand-overs.", names,
                                       registry=registry).labels(**labels)
        self.received_bytes = Counter(PREFIX + "kv_handover_received_bytes",
                                      "KV bytes imported from stopping replicas' hand-overs.", names,
                                      registry=registry).labels(**labels)


async def hand_over(transfer: KVTransfer, directory: Any, receiver_of: Callable[[str], Any], replica_id: str,
                    contract: str, max_bytes: int, timeout_s: float) -> HandoverResult:
    """Pushes up to ``max_bytes`` of this replica's hottest free cached blocks to
    live replicas of the same contract (see the module doc) within ``timeout_s``.
    ``receiver_of(replica id)``: a handle whose ``import_kv.remote(export)`` returns
    ``(failure reason or "", blocks imported)``. Never raises."""
    began = time.monotonic()
    result = HandoverResult("off")
    if max_bytes > 0 and transfer.layout is not None and transfer.block_bytes > 0:
        try:
            await asyncio.wait_for(_hand_over(transfer, directory, receiver_of, replica_id, contract,
                                              max_bytes // transfer.block_bytes, began + timeout_s, result),
                                   timeout_s)
        except asyncio.TimeoutError:
            result.outcome = "partial" if result.blocks else "timeout"
        except Exception as exc:  # noqa: BLE001 - the directory or the export failed: the stop goes on
            logger.warning("cache hand-over failed (%r)", exc)
            result.outcome = "partial" if result.blocks else "error"
    result.bytes = result.blocks * transfer.block_bytes
    result.seconds = time.monotonic() - began
    logger.info("cache hand-over: %s, %d blocks (%d bytes) to %d receivers in %.2fs", result.outcome,
                result.blocks, result.bytes, result.receivers, result.seconds)
    return result


async def _hand_over(transfer: KVTransfer, directory: Any, receiver_of: Callable[[str], Any], replica_id: str,
                     contract: str, budget: int, deadline: float, result: HandoverResult) -> None:
    receivers = await _receivers(directory, replica_id, contract)
    hottest = await transfer._pool_call(lambda engine: _free_cached_hashes(transfer))
    if not hottest:
        result.outcome = "empty"
        return
    if not receivers:
        result.outcome = "no_receiver"
        return
    failures: list[str] = []
    sent: set[bytes] = set()
    for rid in receivers:
        if budget <= 0 or deadline - time.monotonic() <= 0:
            break
        listed = await directory.replica_block_hashes(rid)
        offer = [h for h in hottest if h not in listed and h not in sent]
        if not offer:
            continue
        export = await transfer.export(offer, warm_blocks=budget)
        if not export.block_hashes:
            failures.append("error")  # busy, or evicted since: nothing to send
            break
        reason, num = await _push(receiver_of(rid), export, replica_id, deadline - time.monotonic())
        if reason:
            logger.warning("cache hand-over: receiver %s: %s", rid, reason)
            failures.append(reason)
        if num:
            result.receivers += 1
            result.blocks += num
            budget -= num
        if not reason:  # kept or held already there; a failed receiver's blocks go to the next one
            sent.update(export.block_hashes)
    if failures:
        result.outcome = "partial" if result.blocks else failures[0]
    else:
        result.outcome = "handed_over" if result.blocks else "empty"


async def _receivers(directory: Any, replica_id: str, contract: str) -> list[str]:
    """Live replicas but this one whose contract is ``contract`` (any, when empty), most room first."""
    live = [rid for rid in await directory.live_replicas() if rid != replica_id]
    if contract:
        live = [rid for rid in live if await directory.replica_contract(rid) == contract]
    stats = await directory.replica_stats()
    return sorted(live, key=lambda rid: (float(stats.get(rid, {}).get("kv_cache_usage", 1.0)),
                                         float(stats.get(rid, {}).get("num_running", 0.0)), rid))


def _free_cached_hashes(transfer: KVTransfer) -> list[bytes]:
    """Engine thread: the hashes of the free cached blocks, most recently used first."""
    pool = transfer.ledger.pool
    hashes = [pool.block_hash(b) for b in reversed(pool.free_block_ids())]
    return [h for h in hashes if h is not None]


async def _push(receiver: Any, export: KVExport, replica_id: str, left: float) -> tuple[str, int]:
    """``(failure reason or "", blocks imported)`` from one receiver."""
    if left <= 0:
        return "timeout", 0
    try:
        answer = await asyncio.wait_for(receiver.import_kv.remote(export, replica_id), left)
        reason, num = str(answer[0]), int(answer[1])
    except asyncio.TimeoutError:
        return "timeout", 0
    except Exception as exc:  # noqa: BLE001 - the receiver raised, died or answered nonsense
        logger.warning("cache hand-over: the receiver failed (%r)", exc)
        return "error", 0
    return reason, max(0, min(num, len(export.block_hashes)))


# ------------------------------------------------------------------- receiver
async def import_pushed(transfer: KVTransfer, export: KVExport) -> tuple[str, int]:
    """A survivor's side of a hand-over (``import_kv``): imports the blocks of
    ``export`` not cached here, in its order (hottest first), at most half of
    the free blocks. Returns ``(failure reason or "", blocks imported)``: the
    reason is ``mismatch`` (another layout or shape), ``no_room`` (nothing fits),
    or ``error`` (the write failed; the reserved blocks were released
    unhashed). A tensor-parallel receiver imports the export whole or not at
    all (each rank writes its shard's run of blocks). Never raises."""
    num = len(export.block_hashes) if isinstance(export, KVExport) else 0
    if transfer.layout is None or num == 0:
        return ("", 0) if transfer.layout is not None else ("mismatch", 0)
    if export.layout != transfer.layout or not _shape_ok(transfer, export, num):
        return "mismatch", 0
    if not transfer._try_enter("in"):
        return "no_room", 0  # the replica's concurrent-transfer limit: busy, as a fetch would be
    try:
        return await transfer._to_the_end(_import(transfer, export))
    except Exception as exc:  # noqa: BLE001 - the write failed: released unhashed
        logger.warning("cache hand-over: import failed (%r)", exc)
        return "error", 0
    finally:
        transfer._leave("in")


def _shape_ok(transfer: KVTransfer, export: KVExport, num: int) -> bool:
    if transfer.ranks:
        return len(export.rank_data) == transfer.num_ranks
    data = export.data
    return data is not None and data.dtype == np.uint8 and tuple(data.shape) == transfer.layout.array_shape(num)  # type: ignore[union-attr]


async def _import(transfer: KVTransfer, export: KVExport) -> tuple[str, int]:
    ledger = transfer.ledger

    def reserve(engine: Any) -> Any:
        pool = ledger.pool
        missing = [i for i, h in enumerate(export.block_hashes) if pool.get_cached_block(h) is None]
        if not missing:
            return ()  # every block is cached here already
        keep = missing[: ledger.max_reservable]  # reserve's bound: a transfer never starves the requests
        if not keep or (transfer.ranks and keep != list(range(len(export.block_hashes)))):
            return None  # no room (a rank writes its whole shard)
        held = ledger.reserve([export.block_hashes[i] for i in keep], b"")
        return None if held is None else (keep, held)

    reserved = await transfer._pool_call(reserve)
    if reserved is None:
        return "no_room", 0
    if not reserved:
        return "", 0
    keep, held = reserved
    try:
        if transfer.ranks:
            await asyncio.gather(*[rank.write_kv.remote(held.block_ids, ref, 0)
                                   for rank, ref in zip(transfer.ranks, export.rank_data)])
        else:
            data = export.data if len(keep) == len(export.block_hashes) else export.data[:, :, keep]  # type: ignore[index]
            await asyncio.to_thread(write_blocks, transfer.runner, held.block_ids, data)
    except BaseException:
        await transfer._pool_call(lambda engine: ledger.release(held.transfer_id))
        raise
    got = await transfer._pool_call(lambda engine: transfer._commit(held))
    transfer.metrics.moved("in", got, got * transfer.block_bytes)
    return "", got
