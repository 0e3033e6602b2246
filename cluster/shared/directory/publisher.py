"""The replica's side of the prefix directory: epoch, heartbeats, resyncs.

A replica builds one ``DirectoryPublisher`` and, after each engine step,
hands it the drained KV events::

    publisher = DirectoryPublisher(directory, replica_id, snapshot_fn)
    await publisher.start()                       # register + resync + heartbeats
    ...
    batch = engine.take_kv_events()               # KVEventBatch or None
    if batch is not None:
        await publisher.publish_events(batch)     # never raises for Redis trouble
    ...
    await publisher.stop()                        # deregister: routers drop it now

``snapshot_fn()`` returns ``(seq_no, all_block_hashes)`` -- the engine's
``take_snapshot()`` -- and may be sync or async. It is called on the event
loop whenever the directory must be rebuilt (after a gap, a Redis outage or
restart, an expired registration), also from the heartbeat task while the
engine is idle; it must therefore not race with the engine draining events
(call both from the same thread, or make snapshot_fn hop to the engine's).

Nothing here blocks the engine: Redis trouble marks the publisher
``needs_resync`` and the next batch or heartbeat repairs the directory with
a snapshot. Batches numbered at or below the last snapshot are dropped: the
snapshot already contains them.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from typing import Any, Awaitable, Callable, Iterable, Mapping, Optional, Sequence, Union

from cluster.shared.directory.client import DEFAULT_HEARTBEAT_S, Directory
from cluster.shared.directory.errors import DirectoryAuthError, DirectoryError, PublishStatus

logger = logging.getLogger(__name__)

Snapshot = tuple[int, Sequence[bytes]]
SnapshotFn = Callable[[], Union[Snapshot, Awaitable[Snapshot]]]
StatsFn = Callable[[], Mapping[str, Union[int, float]]]
MetricsFn = Callable[[], Union[bytes, str]]

# KV event class names of workers.engine.block_pool, matched by name because
# the cluster package must not import workers.
_STORED, _REMOVED, _CLEARED = "BlockStored", "BlockRemoved", "AllBlocksCleared"


def net_effect(events: Iterable[Any]) -> tuple[list[bytes], list[bytes], bool]:
    """Collapses an ordered list of KV events into one directory batch.

    Events carry order (a block evicted and stored again in one step must end
    up present); ``Directory.publish`` applies cleared, then removed, then
    stored. The last event about a hash wins, an ``AllBlocksCleared`` forgets
    everything before it, and the returned lists are disjoint.

    Args:
        events: Objects named ``BlockStored`` / ``BlockRemoved`` (with
            ``block_hashes``) or ``AllBlocksCleared``, in order.

    Returns:
        ``(stored, removed, cleared)``.
    """
    present: dict[bytes, bool] = {}  # insertion order kept: stored in chain order
    cleared = False
    for event in events:
        kind = type(event).__name__
        if kind == _CLEARED:
            present.clear()
            cleared = True
        elif kind in (_STORED, _REMOVED):
            for block_hash in event.block_hashes:
                present.pop(block_hash, None)
                present[block_hash] = kind == _STORED
        else:
            raise ValueError(f"unknown KV event {kind!r}; expected {_STORED}, {_REMOVED} or {_CLEARED}")
    stored = [h for h, is_present in present.items() if is_present]
    removed = [h for h, is_present in present.items() if not is_present]
    return stored, removed, cleared


class DirectoryPublisher:
    """Keeps one replica's entries in the directory equal to its prefix cache.

    Args:
        directory: The directory client (its TTL must exceed a few
            ``heartbeat_s``).
        replica_id: Unique id of this replica (Serve's replica id).
        snapshot_fn: Returns ``(seq_no, all_block_hashes)`` for a resync; see
            the module docstring for when it runs.
        heartbeat_s: Period of heartbeats (and of repair attempts).
        gc_every: Run ``Directory.gc`` every this many heartbeats (0: never).
        stats_fn: Optional; returns a small ``{name: number}`` dict of the
            replica's load, sent with every heartbeat (``Directory.replica_stats``
            reads it back). Called on the event loop; it must be cheap.
        metrics_fn: Optional; returns the replica's Prometheus exposition
            text, published after every heartbeat (and once at start) for
            the router's cluster-wide ``/metrics``
            (``Directory.replica_metrics``). Called on the event loop.
        contract: The replica's encoded cache contract, registered with
            every epoch (``cluster.shared.contract``; empty: not declared).
    """

    def __init__(
        self,
        directory: Directory,
        replica_id: str,
        snapshot_fn: SnapshotFn,
        heartbeat_s: float = DEFAULT_HEARTBEAT_S,
        gc_every: int = 5,
        stats_fn: Optional[StatsFn] = None,
        metrics_fn: Optional[MetricsFn] = None,
        contract: str = "",
    ) -> None:
        if heartbeat_s * 2 > directory.ttl_ms / 1000:
            raise ValueError(
                f"heartbeat_s={heartbeat_s} must be at most half the directory TTL "
                f"({directory.ttl_ms / 1000} s), or a replica flaps between live and dead"
            )
        self.directory = directory
        self.replica_id = replica_id
        self.heartbeat_s = heartbeat_s
        self.gc_every = gc_every
        self._snapshot_fn = snapshot_fn
        self._stats_fn = stats_fn
        self._metrics_fn = metrics_fn
        self.contract = contract
        self.epoch: Optional[int] = None  # None: must register (again)
        self.needs_resync = True
        self._synced_seq_no = 0  # batches at or below it are in the last snapshot
        self._lock = asyncio.Lock()  # one directory write at a time, in batch order
        self._heartbeat_task: Optional[asyncio.Task] = None
        self.num_resyncs = 0
        self.num_failures = 0

    # -------------------------------------------------------------- lifecycle
    async def start(self) -> bool:
        """Registers, resyncs and starts heartbeating. Never raises for Redis
        trouble: the heartbeat task retries.

        Returns:
            Whether the directory is in sync now.

        Raises:
            DirectoryAuthError: Redis refused the credentials or the ACL user
                may not write (a configuration error: nothing would ever be published).
        """
        async with self._lock:
            in_sync = await self._repair_locked(raise_auth=True)
            await self._publish_metrics_locked()
        if self._heartbeat_task is None:
            name = f"directory-heartbeat-{self.replica_id}"
            self._heartbeat_task = asyncio.create_task(self._heartbeat_loop(), name=name)
        return in_sync

    async def stop(self, deregister: bool = True) -> None:
        """Stops heartbeating; with ``deregister`` the entries go at once
        (otherwise they expire after the TTL)."""
        task, self._heartbeat_task = self._heartbeat_task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        async with self._lock:
            if deregister and self.epoch is not None:
                try:
                    await self.directory.deregister(self.replica_id, self.epoch)
                except DirectoryError as exc:
                    logger.warning("replica %s: deregister failed (entries expire by TTL): %s", self.replica_id, exc)
            self.epoch = None
            self.needs_resync = True

    # ------------------------------------------------------------- publishing
    async def publish_events(self, batch: Any) -> bool:
        """Publishes a ``KVEventBatch``-like object (``seq_no``, ``events``).

        Returns:
            Whether the directory is in sync after this call.
        """
        stored, removed, cleared = net_effect(batch.events)
        return await self.publish_batch(batch.seq_no, stored, removed, cleared)

    async def publish_batch(
        self, seq_no: int, stored: Sequence[bytes], removed: Sequence[bytes], cleared: bool = False
    ) -> bool:
        """Publishes one engine step's net changes (see ``Directory.publish``).

        Call it once per drained batch, in batch order (concurrent calls are
        serialized first come, first served). On a gap, an unknown or
        superseded epoch, or while out of sync, it repairs with a snapshot
        instead; on Redis trouble it returns False and leaves the repair to
        the next call or heartbeat.

        Returns:
            Whether the directory is in sync after this call.
        """
        async with self._lock:
            if seq_no <= self._synced_seq_no:
                return not self.needs_resync  # already in the last snapshot
            if self.epoch is None or self.needs_resync:
                return await self._repair_locked()
            try:
                status = await self.directory.publish(self.replica_id, self.epoch, seq_no, stored, removed, cleared)
            except DirectoryError as exc:
                self._mark_failed("publish", exc)
                return False
            if status is PublishStatus.OK:
                return True
            self._handle_rejection(status)
            return await self._repair_locked()

    # ---------------------------------------------------------------- helpers
    def _handle_rejection(self, status: PublishStatus) -> None:
        self.needs_resync = True
        if status in (PublishStatus.UNKNOWN, PublishStatus.SUPERSEDED):
            if status is PublishStatus.SUPERSEDED:
                # Only a second process with our id (or a register whose reply
                # was lost) gets here; taking over keeps this one correct.
                logger.warning("replica %s: epoch %s superseded; registering again", self.replica_id, self.epoch)
            self.epoch = None

    def _mark_failed(self, what: str, exc: Exception) -> None:
        if not self.needs_resync:
            logger.warning("replica %s: directory %s failed, will resync: %s", self.replica_id, what, exc)
        self.needs_resync = True
        self.num_failures += 1

    async def _repair_locked(self, raise_auth: bool = False) -> bool:
        """(Re)registers if needed and resyncs from a snapshot. Lock held."""
        for _ in range(2):  # a second round if the epoch expired meanwhile
            try:
                if self.epoch is None:
                    self.epoch = await self.directory.register(self.replica_id, self.contract)
                seq_no, hashes = await self._take_snapshot()
                self._synced_seq_no = seq_no
                status = await self.directory.resync(self.replica_id, self.epoch, seq_no, hashes)
            except DirectoryError as exc:
                if raise_auth and isinstance(exc, DirectoryAuthError):
                    raise
                self._mark_failed("resync", exc)
                return False
            if status is PublishStatus.OK:
                self.needs_resync = False
                self.num_resyncs += 1
                return True
            self._handle_rejection(status)
        return False

    async def _take_snapshot(self) -> Snapshot:
        result = self._snapshot_fn()
        if inspect.isawaitable(result):
            result = await result
        seq_no, hashes = result
        return int(seq_no), list(hashes)

    async def _heartbeat_loop(self) -> None:
        """Heartbeats, repairs when out of sync, and runs gc now and then.
        Runs until cancelled; never dies of an error."""
        beats = 0
        while True:
            await asyncio.sleep(self.heartbeat_s)
            try:
                async with self._lock:
                    await self._beat_locked()
                beats += 1
                if self.gc_every and beats % self.gc_every == 0:
                    await self.directory.gc()
            except DirectoryError as exc:
                self._mark_failed("heartbeat", exc)
            except Exception:  # a bug must not silently stop heartbeats
                logger.exception("replica %s: directory heartbeat failed", self.replica_id)

    async def _beat_locked(self) -> None:
        if self.epoch is None or self.needs_resync:
            await self._repair_locked()
            return
        stats = self._read_stats()
        if stats is None:
            status = await self.directory.heartbeat(self.replica_id, self.epoch)
        else:
            status = await self.directory.heartbeat(self.replica_id, self.epoch, stats=stats)
        if status is not PublishStatus.OK:
            logger.warning("replica %s: heartbeat says %s; registering again", self.replica_id, status.value)
            self._handle_rejection(status)
            await self._repair_locked()
        await self._publish_metrics_locked()

    async def _publish_metrics_locked(self) -> None:
        """Publishes ``metrics_fn()``'s text. Lock held; never raises: metrics
        are best effort and must not disturb the KV directory's repair logic."""
        if self._metrics_fn is None or self.epoch is None:
            return
        try:
            text = self._metrics_fn()
        except Exception:  # noqa: BLE001 - metrics must never stop heartbeats
            logger.exception("replica %s: metrics_fn failed; metrics not published", self.replica_id)
            return
        try:
            await self.directory.publish_metrics(self.replica_id, self.epoch, text)
        except DirectoryError as exc:
            logger.debug("replica %s: publishing metrics failed: %s", self.replica_id, exc)

    def _read_stats(self) -> Optional[Mapping[str, Union[int, float]]]:
        """The stats to send with a heartbeat, or None (no ``stats_fn``, or it failed)."""
        if self._stats_fn is None:
            return None
        try:
            return dict(self._stats_fn())
        except Exception:  # noqa: BLE001 - stats must never stop heartbeats
            logger.exception("replica %s: stats_fn failed; heartbeat without stats", self.replica_id)
            return None
