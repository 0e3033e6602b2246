"""The Redis prefix directory: which replica caches which KV blocks.

Replicas publish their KV events (one script call per engine step); routers
ask, in one round trip, how many leading blocks of a request's hash chain
each live replica holds. Liveness comes from a registry with heartbeats and
epochs: entries of a replica that stopped heartbeating, or of an earlier
epoch of a restarted one, are never returned. The key schema and scripts are
in ``cluster/shared/directory/lua.py``; the design, consistency argument and memory
cost are in docs/DIRECTORY.md.

    router:   counts = await directory.lookup(block_hashes)   # {replica_id: n}
    replica:  DirectoryPublisher (cluster/shared/directory/publisher.py) wraps
              register / heartbeat / publish / resync below.

The connection, its defaults and its failure convention (``DirectoryUnavailable``
when Redis cannot answer, then fail-fast for a backoff) are in
``cluster/shared/directory/connection.py``.
"""

from __future__ import annotations

import logging
from typing import Iterable, Mapping, Optional, Sequence, Union

from cluster.shared.directory import lua
from cluster.shared.directory.connection import (DEFAULT_HEARTBEAT_S, DEFAULT_TTL_S, RESYNC_CHUNK,
                                                 DirectoryConnection, stats_number, check_block_hashes, pairs_to_dict)
from cluster.shared.directory.errors import DirectoryAuthError, DirectoryError, PublishStatus

logger = logging.getLogger(__name__)
# Stats kept as text (the rest are numbers): the Ray node IP a replica runs on.
TEXT_STATS = frozenset({"node", "lora_adapters"})

__all__ = ["DEFAULT_HEARTBEAT_S", "DEFAULT_TTL_S", "Directory", "check_block_hashes", "pairs_to_dict"]


class Directory(DirectoryConnection):
    """Async client of one namespace of the prefix directory: the registry
    (register, heartbeat, deregister, liveness), KV-event publishing and
    resync, and the lookups routers make. Build one with ``from_url``
    (``DirectoryConnection`` has the arguments)."""

    # ------------------------------------------------------------- registry
    async def register(self, replica_id: str, contract: str = "") -> int:
        """Starts a new epoch of ``replica_id`` with an empty block set.

        The replica must then ``resync`` (its ``seq`` is "needs resync") and
        heartbeat at least every TTL. Mutates the directory.

        Args:
            replica_id: The replica.
            contract: Its encoded ``cluster.shared.contract.CacheContract``
                (empty: not declared, never compared).

        Returns:
            The new epoch, larger than every earlier epoch of this id.
        """
        rid = lua.check_replica_id(replica_id)
        keys = [lua.rep_key(self.prefix, rid), lua.blk_key(self.prefix, rid), lua.replicas_key(self.prefix),
                lua.events_key(self.prefix)]
        epoch = await self._run("register", lambda: self._scripts["REGISTER"](keys, [rid, self.ttl_ms, contract]))
        logger.info("directory %s: replica %s registered epoch %d", self.namespace, rid, epoch)
        return int(epoch)

    async def heartbeat(
        self, replica_id: str, epoch: int, stats: Optional[Mapping[str, Union[int, float, str]]] = None
    ) -> PublishStatus:
        """Refreshes the liveness TTL of ``replica_id`` at ``epoch``.

        Args:
            replica_id: The replica.
            epoch: Its epoch from ``register``.
            stats: Small ``{name: number}`` load figures; when given they
                replace the replica's stats hash in the same round trip
                (read back with ``replica_stats``).

        Returns:
            OK, or UNKNOWN / SUPERSEDED: the caller must register again.
        """
        rid = lua.check_replica_id(replica_id)
        keys = self._replica_keys(rid) + [lua.replicas_key(self.prefix), lua.stats_key(self.prefix, rid)]
        args: list = [epoch, self.ttl_ms, rid]
        for name, value in (stats or {}).items():
            args += [str(name), value if isinstance(value, (int, float, str)) else str(value)]
        reply = await self._run("heartbeat", lambda: self._scripts["HEARTBEAT"](keys, args))
        return PublishStatus(reply.decode())

    async def deregister(self, replica_id: str, epoch: int) -> bool:
        """Removes the replica at once (graceful shutdown). Returns False if
        ``epoch`` is not its current one (nothing changed)."""
        rid = lua.check_replica_id(replica_id)
        keys = self._replica_keys(rid) + [lua.replicas_key(self.prefix), lua.stats_key(self.prefix, rid),
                                          lua.metrics_key(self.prefix, rid), lua.events_key(self.prefix)]
        return bool(await self._run("deregister", lambda: self._scripts["DEREGISTER"](keys, [epoch, replica_id])))

    async def check_read_access(self) -> bool:
        """One read (the live replicas), at a client's start-up.

        Returns:
            Whether Redis answered (False: unavailable now; callers carry on
            and retry as usual).

        Raises:
            DirectoryAuthError: Wrong credentials or a user without read access.
        """
        try:
            await self.live_replica_seqs()
        except DirectoryAuthError:
            raise
        except DirectoryError as exc:
            logger.warning("directory %s: not reachable at start-up (%s); carrying on", self.namespace, exc)
            return False
        return True

    async def live_replicas(self) -> dict[str, int]:
        """Returns ``{replica_id: epoch}`` of every replica with a live TTL."""
        return {rid: epoch for rid, (epoch, _) in (await self.live_replica_seqs()).items()}

    async def replica_stats(self) -> dict[str, dict[str, float]]:
        """Returns ``{replica_id: {name: number}}`` of every live replica.

        The figures are those of its last heartbeat with stats (``{}`` before
        the first one); values are parsed as int when integral, else float,
        except the text of ``TEXT_STATS`` (``node``: the replica's Ray node IP;
        ``lora_adapters``: its loaded adapters' names, comma-separated).
        One round trip; no mutation.
        """
        keys = [lua.replicas_key(self.prefix)]
        flat = await self._run("replica_stats", lambda: self._scripts["REPLICA_STATS"](keys, [self.prefix]))
        out: dict[str, dict[str, float]] = {}
        for rid, pairs in zip(self._decode_ids(flat[0::2]), flat[1::2]):
            names = self._decode_ids(pairs[0::2])
            out[rid] = {name: _text(raw) if name in TEXT_STATS else stats_number(raw)
                        for name, raw in zip(names, pairs[1::2])}
        return out

    async def publish_metrics(self, replica_id: str, epoch: int, text: Union[bytes, str]) -> PublishStatus:
        """Replaces the replica's Prometheus exposition text (expires with its liveness TTL).

        Returns:
            OK, or UNKNOWN / SUPERSEDED: the caller must register again.
        """
        rid = lua.check_replica_id(replica_id)
        keys = [lua.rep_key(self.prefix, rid), lua.metrics_key(self.prefix, rid)]
        reply = await self._run("publish_metrics",
                                lambda: self._scripts["PUBLISH_METRICS"](keys, [epoch, self.ttl_ms, text]))
        return PublishStatus(reply.decode())

    async def replica_metrics(self) -> dict[str, bytes]:
        """Returns ``{replica_id: exposition text}`` of every live replica
        that published metrics. One round trip; no mutation."""
        keys = [lua.replicas_key(self.prefix)]
        flat = await self._run("replica_metrics", lambda: self._scripts["REPLICA_METRICS"](keys, [self.prefix]))
        return dict(zip(self._decode_ids(flat[0::2]), flat[1::2]))

    async def claim_metrics_exporter(self, owner: str, ttl_s: float) -> bool:
        """Takes or renews the lease of exporting the replicas' series (one router
        of the namespace holds it; ``router/metrics.py``). Mutates only that key.

        Returns:
            Whether ``owner`` holds the lease for the next ``ttl_s`` seconds.
        """
        keys = [lua.exporter_key(self.prefix)]
        held = await self._run("claim_metrics_exporter",
                               lambda: self._scripts["CLAIM_EXPORTER"](keys, [owner, max(1, int(ttl_s * 1000))]))
        return bool(int(held))

    async def release_metrics_exporter(self, owner: str) -> bool:
        """Drops ``owner``'s exporter lease (if it holds it), so another router
        takes over at its next scrape instead of after the lease's TTL."""
        keys = [lua.exporter_key(self.prefix)]
        return bool(int(await self._run("release_metrics_exporter",
                                        lambda: self._scripts["RELEASE_EXPORTER"](keys, [owner]))))

    async def gc(self) -> list[str]:
        """Drops index entries and leftover sets of dead replicas.

        Returns:
            The replica ids dropped.
        """
        keys = [lua.replicas_key(self.prefix)]
        dropped = self._decode_ids(await self._run("gc", lambda: self._scripts["GC"](keys, [self.prefix])))
        if dropped:
            logger.info("directory %s: gc dropped dead replicas %s", self.namespace, dropped)
        return dropped

    # ------------------------------------------------------------ publishing
    async def publish(
        self,
        replica_id: str,
        epoch: int,
        seq_no: int,
        stored: Sequence[bytes] = (),
        removed: Sequence[bytes] = (),
        cleared: bool = False,
    ) -> PublishStatus:
        """Applies one batch of KV events atomically, in one round trip.

        Order of application: ``cleared`` empties the set, then ``removed``
        hashes leave it, then ``stored`` hashes join it. ``net_effect`` in
        ``cluster.shared.directory.publisher`` turns an ordered event list into such
        a batch.

        Args:
            replica_id: The publishing replica.
            epoch: Its epoch from ``register``.
            seq_no: The batch number; it must be the last applied + 1.
            stored: Hashes that entered its prefix cache.
            removed: Hashes that left it.
            cleared: Whether its whole prefix cache was dropped first.

        Returns:
            OK; GAP or NEEDS_RESYNC (call ``resync``); UNKNOWN or SUPERSEDED
            (call ``register`` then ``resync``).
        """
        removed = check_block_hashes(removed)
        stored = check_block_hashes(stored)
        keys = self._replica_keys(replica_id) + [lua.events_key(self.prefix)]
        args = [epoch, seq_no, self.ttl_ms, int(bool(cleared)), len(removed), replica_id, *removed, *stored]
        reply = await self._run("publish", lambda: self._scripts["PUBLISH"](keys, args))
        status = PublishStatus(reply.decode())
        if status is not PublishStatus.OK:
            logger.info("directory %s: publish of %s batch %d: %s", self.namespace, replica_id, seq_no, status.value)
        return status

    async def resync(self, replica_id: str, epoch: int, seq_no: int, block_hashes: Iterable[bytes]) -> PublishStatus:
        """Replaces the replica's whole set atomically (one pipeline).

        The hashes are staged in a temporary set in chunks (no single command
        blocks Redis for long), then a script checks the epoch and swaps the
        staged set in. The next ``publish`` must carry ``seq_no + 1``.

        Returns:
            OK, or UNKNOWN / SUPERSEDED (register again, then resync).
        """
        hashes = check_block_hashes(block_hashes)
        rid = lua.check_replica_id(replica_id)
        tmp = lua.tmp_key(self.prefix, rid, epoch)

        async def call():
            pipe = self._client.pipeline(transaction=False)
            pipe.unlink(tmp)
            for i in range(0, len(hashes), RESYNC_CHUNK):
                pipe.sadd(tmp, *hashes[i : i + RESYNC_CHUNK])
            pipe.pexpire(tmp, max(self.ttl_ms, 60_000))  # a crash mid-resync leaves no garbage
            # EVAL (not EVALSHA) keeps this to one round trip; resyncs are rare.
            pipe.eval(lua.FINISH_RESYNC, 4, *self._replica_keys(rid), tmp, lua.events_key(self.prefix), epoch, seq_no,
                      self.ttl_ms, rid)
            return (await pipe.execute())[-1]

        status = PublishStatus((await self._run("resync", call)).decode())
        logger.info(
            "directory %s: resync of %s epoch %d to batch %d with %d blocks: %s",
            self.namespace, rid, epoch, seq_no, len(hashes), status.value,
        )  # fmt: skip
        return status

    async def replica_block_hashes(self, replica_id: str) -> set[bytes]:
        """Returns the set the directory holds for a replica (tests, debugging)."""
        key = lua.blk_key(self.prefix, lua.check_replica_id(replica_id))
        return set(await self._run("smembers", lambda: self._client.smembers(key)))

    # --------------------------------------------------------------- lookup
    async def lookup(self, block_hashes: Sequence[bytes], contract: str = "") -> dict[str, int]:
        """For a request's hash chain, how many leading blocks each live
        replica caches. One round trip; no mutation.

        Args:
            block_hashes: The chain ``h_1 .. h_n`` of the request, in order.
            contract: The caller's encoded cache contract; a replica that
                declared a different one answers -1 (empty: no check).

        Returns:
            ``{replica_id: n_leading_blocks}`` for every live replica at its
            current epoch (0 included, so the caller also learns who is live).
            A replica waiting for a resync reports 0: its set is not trusted.
            A replica whose contract differs reports -1.

        Raises:
            DirectoryUnavailable: Redis cannot answer (fall back to load only).
        """
        hashes = check_block_hashes(block_hashes)
        keys = [lua.replicas_key(self.prefix)]
        flat = await self._run("lookup", lambda: self._scripts["LOOKUP"](keys, [self.prefix, contract, *hashes]))
        return pairs_to_dict(flat)

    async def snapshot(self, replica_id: str) -> tuple[Optional[int], int, str, bytes, list[bytes]]:
        """One replica's ``(epoch or None if not live, seq, contract, events
        stream id it includes, block hashes)``, read atomically."""
        rid = lua.check_replica_id(replica_id)
        keys = self._replica_keys(rid) + [lua.events_key(self.prefix)]
        epoch, seq, contract, last_id, blocks = await self._run(
            "snapshot", lambda: self._scripts["SNAPSHOT"](keys, []))
        contract = contract.decode() if isinstance(contract, bytes) else (contract or "")
        return (int(epoch) if epoch else None), int(seq), contract, last_id, list(blocks)

    async def read_events(self, after: bytes, count: int = 1000, block_ms: Optional[int] = None) -> list:
        """Events of the stream after id ``after`` (``b"0-0"``: from the
        oldest kept): ``[(id, {field: value})]`` in order, at most ``count``;
        ``block_ms`` waits that long for the first one."""
        key = lua.events_key(self.prefix)
        reply = await self._run("read_events", lambda: self._client.xread({key: after}, count=count, block=block_ms))
        if not reply:
            return []
        return list(reply[0][1])

    async def last_event_id(self) -> bytes:
        """Id of the newest event (``b"0-0"``: none yet)."""
        key = lua.events_key(self.prefix)
        reply = await self._run("last_event", lambda: self._client.xrevrange(key, count=1))
        return reply[0][0] if reply else b"0-0"

    async def live_replica_seqs(self) -> dict[str, tuple[int, int]]:
        """``{replica_id: (epoch, seq)}`` of every live replica (one call, O(replicas))."""
        keys = [lua.replicas_key(self.prefix)]
        flat = await self._run("live_replicas", lambda: self._scripts["LIVE_REPLICAS"](keys, [self.prefix]))
        return {rid: (int(e), int(s)) for rid, e, s in zip(self._decode_ids(flat[0::3]), flat[1::3], flat[2::3])}

    async def replica_contract(self, replica_id: str) -> str:
        """The contract ``replica_id`` registered ("" if none or not live)."""
        key = lua.rep_key(self.prefix, lua.check_replica_id(replica_id))
        raw = await self._run("contract", lambda: self._client.hget(key, "contract"))
        return raw.decode() if raw else ""


def _text(raw: Union[bytes, str]) -> str:
    return raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
