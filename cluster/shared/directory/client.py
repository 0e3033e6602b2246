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

Failure convention: Redis unreachable (refused, timed out, loading, read-only,
out of memory) raises ``DirectoryUnavailable`` within about one socket
timeout; after that, calls fail at once for ``unavailable_backoff_s`` so a
router falls back to load-only routing without waiting on every request.
Other Redis errors raise ``DirectoryError`` (its base class).

Defaults (documented in docs/DIRECTORY.md): heartbeat every 1 s, liveness
TTL 5 s, connect timeout 0.25 s, socket timeout 0.5 s, one immediate retry
(a pooled connection broken by a Redis restart reconnects once), backoff 1 s.
"""

from __future__ import annotations

import logging
import time
from typing import Awaitable, Callable, Iterable, Mapping, Optional, Sequence, TypeVar, Union

import redis.asyncio as aioredis
from redis import exceptions as rex
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from cluster.shared.directory import lua
from cluster.shared.directory.errors import (UNAVAILABLE_ERRORS, DirectoryAuthError, DirectoryError,
                                            DirectoryUnavailable, PublishStatus, auth_error_message,
                                            is_acl_denial)
from cluster.shared.hashing import DIGEST_BYTES

logger = logging.getLogger(__name__)

DEFAULT_HEARTBEAT_S = 1.0
DEFAULT_TTL_S = 5.0
DEFAULT_CONNECT_TIMEOUT_S = 0.25
DEFAULT_SOCKET_TIMEOUT_S = 0.5
DEFAULTUNAVAILABLE_ERRORS_BACKOFF_S = 1.0
RESYNC_CHUNK = 4096  # hashes per SADD command of a resync pipeline

T = TypeVar("T")

def check_block_hashes(block_hashes: Iterable[bytes]) -> list[bytes]:
    """Returns the hashes as a list, raising ``ValueError`` on a bad one.

    The directory stores raw 16-byte digests (``cluster.shared.hashing``); a hex
    string or a truncated digest would silently never match, so reject it.
    """
    out = list(block_hashes)
    for h in out:
        if not isinstance(h, (bytes, bytearray)) or len(h) != DIGEST_BYTES:
            raise ValueError(f"block hashes must be {DIGEST_BYTES}-byte digests from cluster.shared.hashing, got {h!r}")
    return out


def pairs_to_dict(flat: Sequence) -> dict[str, int]:
    """Turns a script's flat ``[id, count, id, count, ...]`` reply into a dict."""
    ids = [x.decode() if isinstance(x, bytes) else str(x) for x in flat[0::2]]
    return {rid: int(v) for rid, v in zip(ids, flat[1::2])}


def _number(raw: Union[bytes, str]) -> float:
    """A stats value from Redis: int when integral, float otherwise (nan if garbled)."""
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            return float("nan")


SENTINEL_SCHEME = "redis+sentinel://"


def sentinel_client(url: str, options: dict) -> aioredis.Redis:
    """A client of the master that Redis Sentinel names, from
    ``redis+sentinel://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...]/SERVICE[/DB][?sentinel_password=P]``.

    The user and password are the master's (the directory's ACL user); the
    sentinels take ``sentinel_password`` if they need one. After a failover
    the next connection asks the sentinels again, so calls fail (the
    directory is unavailable: routing on load, replicas retry) only until the
    new master is known.

    Raises:
        ValueError: The URL lacks a sentinel address or the service name.
    """
    from urllib.parse import parse_qs, unquote, urlsplit

    from redis.asyncio.sentinel import Sentinel

    parts = urlsplit(url)
    auth, _, hosts = parts.netloc.rpartition("@")
    user, _, password = auth.partition(":")
    sentinels = []
    for host in filter(None, hosts.split(",")):
        name, _, port = host.rpartition(":")
        if not name or not port.isdigit():
            raise ValueError(f"{url!r}: each sentinel is HOST:PORT, got {host!r}")
        sentinels.append((name.strip("[]"), int(port)))
    path = [p for p in parts.path.split("/") if p]
    if not sentinels or not path or len(path) > 2 or (len(path) == 2 and not path[1].isdigit()):
        raise ValueError(f"{url!r}: write redis+sentinel://[USER:PASSWORD@]HOST:PORT[,HOST:PORT]/SERVICE[/DB]")
    query = parse_qs(parts.query)
    sentinel_kwargs = {"socket_connect_timeout": options["socket_connect_timeout"],
                       "socket_timeout": options["socket_timeout"]}
    if "sentinel_password" in query:
        sentinel_kwargs["password"] = query["sentinel_password"][0]
    sentinel = Sentinel(sentinels, sentinel_kwargs=sentinel_kwargs)
    return sentinel.master_for(path[0], redis_class=aioredis.Redis, db=int(path[1]) if len(path) == 2 else 0,
                               username=unquote(user) or None, password=unquote(password) or None, **options)


class Directory:
    """Async client of one namespace of the prefix directory.

    Args:
        client: A ``redis.asyncio.Redis`` with ``decode_responses=False``
            (hashes are raw bytes). ``from_url`` builds one with the
            directory's timeouts.
        namespace: Key namespace (one per model / cluster).
        ttl_s: Liveness TTL: a replica whose last heartbeat or publish is
            older than this is dead for lookups. Several heartbeat periods.
        unavailable_backoff_s: After an unavailable error, calls fail fast
            for this long instead of waiting on Redis again (0: never).
    """

    def __init__(
        self,
        client: aioredis.Redis,
        namespace: str = "default",
        ttl_s: float = DEFAULT_TTL_S,
        unavailable_backoff_s: float = DEFAULTUNAVAILABLE_ERRORS_BACKOFF_S,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self._client = client
        self.namespace = namespace
        self.prefix = lua.key_prefix(namespace)
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.unavailable_backoff_s = unavailable_backoff_s
        self._down_until = 0.0
        self._down_reason = ""
        self._scripts = {
            name: client.register_script(getattr(lua, name))
            for name in ("REGISTER", "HEARTBEAT", "PUBLISH", "DEREGISTER", "LIVE_REPLICAS", "LOOKUP", "GC",
                         "REPLICA_STATS", "PUBLISH_METRICS", "REPLICA_METRICS", "SNAPSHOT", "CLAIM_EXPORTER",
                         "RELEASE_EXPORTER")
        }

    @classmethod
    def from_url(
        cls,
        url: str,
        namespace: str = "default",
        ttl_s: float = DEFAULT_TTL_S,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        socket_timeout_s: float = DEFAULT_SOCKET_TIMEOUT_S,
        unavailable_backoff_s: float = DEFAULTUNAVAILABLE_ERRORS_BACKOFF_S,
    ) -> "Directory":
        """Builds a directory with its own connection pool (no I/O yet).

        Timeouts bound how long a call waits before ``DirectoryUnavailable``:
        a refused connection fails in milliseconds, a hung Redis after about
        2 x ``socket_timeout_s`` (one immediate retry). ``url`` may be
        ``env:NAME``: the URL is then this process's variable ``NAME``.

        Raises:
            ValueError: ``env:NAME`` with NAME unset.
        """
        from cluster.shared.config.loading import from_env

        url = from_env(url, "the directory's redis_url")
        options = dict(socket_connect_timeout=connect_timeout_s, socket_timeout=socket_timeout_s,
                       retry=Retry(NoBackoff(), 1), decode_responses=False)
        if url.startswith(SENTINEL_SCHEME):
            client = sentinel_client(url, options)
        else:
            client = aioredis.Redis.from_url(url, **options)
        return cls(client, namespace, ttl_s=ttl_s, unavailable_backoff_s=unavailable_backoff_s)

    async def aclose(self) -> None:
        """Closes the connection pool."""
        await self._client.aclose()

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
        the first one); values are parsed as int when integral, else float.
        One round trip; no mutation.
        """
        keys = [lua.replicas_key(self.prefix)]
        flat = await self._run("replica_stats", lambda: self._scripts["REPLICA_STATS"](keys, [self.prefix]))
        out: dict[str, dict[str, float]] = {}
        for rid, pairs in zip(self._decode_ids(flat[0::2]), flat[1::2]):
            names = self._decode_ids(pairs[0::2])
            out[rid] = {name: _number(raw) for name, raw in zip(names, pairs[1::2])}
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

    # --------------------------------------------------------------- helpers
    def _replica_keys(self, replica_id: str) -> list[str]:
        rid = lua.check_replica_id(replica_id)
        return [lua.rep_key(self.prefix, rid), lua.blk_key(self.prefix, rid)]

    @staticmethod
    def _decode_ids(raw: Sequence) -> list[str]:
        return [x.decode() if isinstance(x, bytes) else str(x) for x in raw]

    async def _run(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        """Runs one Redis call, translating errors (see the module docstring)."""
        now = time.monotonic()
        if now < self._down_until:
            raise DirectoryUnavailable(
                f"directory {what}: Redis unavailable ({self._down_reason}); "
                f"next try in {self._down_until - now:.2f} s"
            )
        try:
            result = await call()
        except (rex.AuthenticationError, rex.NoPermissionError) as exc:  # before ConnectionError, its base
            raise DirectoryAuthError(auth_error_message(what, exc)) from None
        except UNAVAILABLE_ERRORS as exc:
            if not self._down_reason:
                logger.warning("directory %s: Redis unavailable during %s: %s", self.namespace, what, exc)
            self._down_reason = f"{type(exc).__name__}: {exc}"
            self._down_until = time.monotonic() + self.unavailable_backoff_s
            raise DirectoryUnavailable(f"directory {what}: Redis unavailable ({self._down_reason})") from exc
        except rex.RedisError as exc:
            if is_acl_denial(exc):  # a command inside a script: a plain ResponseError
                raise DirectoryAuthError(auth_error_message(what, exc)) from None
            raise DirectoryError(f"directory {what} failed: {type(exc).__name__}: {exc}") from exc
        if self._down_reason:
            logger.info("directory %s: Redis reachable again", self.namespace)
            self._down_reason = ""
        return result
