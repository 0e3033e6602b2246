"""Keeps a router-local ``PrefixIndex`` equal to the Redis directory.

The replicas' writes (``REGISTER``, ``PUBLISH``, ``FINISH_RESYNC``,
``DEREGISTER``) each append an event to the namespace's stream in the same
script that changes the sets, so the stream is the directory's change log in
the order applied. A follower

1. on start (and after any Redis error) takes a snapshot of every live
   replica (``Directory.snapshot``: its epoch, batch number, contract, blocks
   and the stream position they include) and follows the stream from there,
   skipping each replica's events its snapshot already holds;
2. applies ``pub`` events (a batch that does not follow the last applied one
   unsyncs the replica and triggers a snapshot), drops a replica on ``leave``,
   unsyncs on ``gap`` and ``reg``, and snapshots on ``sync`` (a resync's
   events carry no hashes);
3. every ``poll_s`` reads the live replicas' ``(epoch, seq)`` (one call,
   O(replicas), off the request path): a replica whose liveness expired is
   dropped, one with another epoch is snapshotted, and one whose directory
   batch number stays ahead of the index's for two polls in a row (its event
   was trimmed from the stream before this router read it) is snapshotted.

Routing decisions then cost no Redis call: ``lookup`` answers from memory,
or returns None while the follower is not in sync (Redis unreachable, first
sync not done), which routers treat like a failed lookup (load only).

Bound on staleness: the index credits a replica with a block it evicted only
until the event that removed it is read (milliseconds, the stream is read
with a blocking XREAD), or -- if that event was lost to trimming -- for at
most two ``poll_s`` periods.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Optional, Sequence

from cluster.shared.directory.client import Directory
from cluster.shared.directory.errors import DirectoryError
from cluster.shared.directory.index import PrefixIndex
from cluster.shared.hashing import DIGEST_BYTES

logger = logging.getLogger(__name__)


def stream_id(raw: bytes | str) -> tuple[int, int]:
    """A stream entry id ``b"ms-seq"`` as a comparable tuple."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


def split_hashes(packed: bytes) -> list[bytes]:
    """The concatenated 16-byte hashes of an event field."""
    return [packed[i: i + DIGEST_BYTES] for i in range(0, len(packed), DIGEST_BYTES)]


class IndexFollower:
    """Follows one directory namespace into a ``PrefixIndex`` (module doc).

    Args:
        directory: The namespace's client (its own connection pool: the
            follower's blocking reads must not hold the router's connections).
        poll_s: Period of the liveness poll.
        block_ms: How long one stream read waits for new events.
        batch: Most events read per call.
    """

    def __init__(self, directory: Directory, poll_s: float = 1.0, block_ms: int = 200, batch: int = 1000) -> None:
        self.directory = directory
        self.index = PrefixIndex()
        self.poll_s = poll_s
        self.block_ms = block_ms
        self.batch = batch
        self.in_sync = False
        self.num_full_syncs = 0
        self.num_snapshots = 0
        self.num_events = 0
        self._last_id: bytes = b"0-0"
        self._skip_until: dict[str, tuple[int, int]] = {}
        self._behind: set[str] = set()
        self._next_poll = 0.0
        self._task: Optional[asyncio.Task] = None
        self._stopping = False
        self._synced: Optional[asyncio.Event] = None  # set by each full sync (made on the follower's loop)

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Starts following on the running event loop (idempotent)."""
        if self._task is None or self._task.done():
            self._stopping = False
            self._synced = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run(), name="directory-follower")

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - stopping anyway
                pass
            self._task = None

    async def wait_in_sync(self, timeout_s: float) -> bool:
        """Waits up to ``timeout_s`` for the first full sync after ``start``."""
        if self.in_sync or self._synced is None:
            return self.in_sync
        try:
            await asyncio.wait_for(self._synced.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass
        return self.in_sync

    # --------------------------------------------------------------- query
    def lookup(self, chain: Sequence[bytes], contract: str = "") -> Optional[dict[str, int]]:
        """``Directory.lookup``'s answer from memory, or None while not in sync."""
        if not self.in_sync:
            return None
        return self.index.lookup(chain, contract)

    # ---------------------------------------------------------------- loop
    async def _run(self) -> None:
        backoff = 0.1
        while not self._stopping:
            try:
                if not self.in_sync:
                    await self.full_sync()
                    backoff = 0.1
                await self.step()
            except asyncio.CancelledError:
                raise
            except DirectoryError as exc:
                if self.in_sync:
                    logger.warning("directory follower %s: out of sync (%s); routing on load until it resyncs",
                                   self.directory.namespace, exc)
                self.in_sync = False
                await asyncio.sleep(backoff)
                backoff = min(2.0, backoff * 2)
            except Exception:  # noqa: BLE001 - never let the follower die silently
                logger.exception("directory follower %s failed; resyncing", self.directory.namespace)
                self.in_sync = False
                await asyncio.sleep(backoff)
                backoff = min(2.0, backoff * 2)

    async def full_sync(self) -> None:
        """Snapshots every live replica and follows the stream from there."""
        began = time.perf_counter()
        live = await self.directory.live_replica_seqs()
        self.index = PrefixIndex()
        self._skip_until.clear()
        self._behind.clear()
        first: Optional[tuple[int, int]] = None
        self._last_id = b"0-0"
        for replica_id in live:
            last = await self.snapshot(replica_id)
            first = last if first is None or last < first else first
        if first is None:
            first = stream_id(await self.directory.last_event_id())
        self._last_id = f"{first[0]}-{first[1]}".encode()
        self.num_full_syncs += 1
        self._next_poll = time.monotonic() + self.poll_s
        self.in_sync = True
        if self._synced is not None:
            self._synced.set()
        logger.info("directory follower %s: in sync with %d replicas, %d blocks, in %.3f s",
                    self.directory.namespace, len(live), self.index.num_entries, time.perf_counter() - began)

    async def snapshot(self, replica_id: str) -> tuple[int, int]:
        """Replaces one replica's entry from Redis; returns the stream position it includes."""
        epoch, seq, contract, last_id, blocks = await self.directory.snapshot(replica_id)
        position = stream_id(last_id)
        self._skip_until[replica_id] = position
        self._behind.discard(replica_id)
        if epoch is None:
            self.index.drop(replica_id)
        else:
            self.index.load_snapshot(replica_id, epoch, seq, blocks, contract)
        self.num_snapshots += 1
        return position

    async def step(self) -> None:
        """Reads and applies one batch of events, then polls liveness when due."""
        events = await self.directory.read_events(self._last_id, self.batch, self.block_ms)
        to_snapshot: list[str] = []
        for event_id, fields in events:
            self._last_id = event_id
            self.num_events += 1
            replica_id = self.apply_event(event_id, fields)
            if replica_id is not None and replica_id not in to_snapshot:
                to_snapshot.append(replica_id)
        for replica_id in to_snapshot:
            await self.snapshot(replica_id)
        if time.monotonic() >= self._next_poll:
            await self.poll()

    def apply_event(self, event_id: bytes, fields: dict) -> Optional[str]:
        """Applies one stream event; returns a replica id that needs a snapshot."""
        kind = fields.get(b"t", b"").decode()
        replica_id = fields.get(b"r", b"").decode()
        if not replica_id:
            return None
        skip = self._skip_until.get(replica_id)
        if skip is not None and stream_id(event_id) <= skip:
            return None
        epoch = int(fields.get(b"e", b"0"))
        if kind == "pub":
            applied = self.index.apply(replica_id, epoch, int(fields[b"s"]), fields.get(b"c") == b"1",
                                       split_hashes(fields.get(b"rm", b"")), split_hashes(fields.get(b"st", b"")))
            entry = self.index.replica(replica_id)
            if not applied and (entry is None or entry.epoch <= epoch):
                return replica_id  # unknown replica, or a batch we cannot place: read its state
        elif kind == "reg":
            self.index.register(replica_id, epoch, fields.get(b"c", b"").decode())
        elif kind == "gap":
            self.index.unsync(replica_id)
        elif kind == "sync":
            return replica_id
        elif kind == "leave":
            entry = self.index.replica(replica_id)
            if entry is not None and entry.epoch <= epoch:
                self.index.drop(replica_id)
        return None

    async def poll(self) -> None:
        """Reconciles the index with the live replicas' (epoch, seq) (module doc, 3)."""
        self._next_poll = time.monotonic() + self.poll_s
        live = await self.directory.live_replica_seqs()
        for replica_id in self.index.replica_ids():
            if replica_id not in live:
                self.index.drop(replica_id)
                self._behind.discard(replica_id)
        for replica_id, (epoch, seq) in live.items():
            entry = self.index.replica(replica_id)
            if entry is None or entry.epoch != epoch:
                await self.snapshot(replica_id)
            elif seq > entry.seq:
                if replica_id in self._behind:
                    logger.info("directory follower %s: %s stayed behind (%d < %d); snapshotting",
                                self.directory.namespace, replica_id, entry.seq, seq)
                    await self.snapshot(replica_id)
                else:
                    self._behind.add(replica_id)
            else:
                self._behind.discard(replica_id)
