"""The directory's connection to Redis and its failure convention.

Redis unreachable (refused, timed out, loading, read-only, out of memory)
raises ``DirectoryUnavailable`` within about one socket timeout; after that,
calls fail at once for ``unavailable_backoff_s`` so a router falls back to
load-only routing without waiting on every request. Wrong credentials or a
user without a needed permission raise ``DirectoryAuthError``; other Redis
errors raise ``DirectoryError`` (their base class).

Defaults (documented in docs/DIRECTORY.md): heartbeat every 1 s, liveness
TTL 5 s, connect timeout 0.25 s, socket timeout 0.5 s, one immediate retry
(a pooled connection broken by a Redis restart reconnects once), backoff 1 s.
The URL is ``redis://``, ``rediss://`` or ``redis+sentinel://``
(``sentinel_client``), or ``env:NAME`` to read it from a variable.
"""

from __future__ import annotations

import logging
import time
from typing import Awaitable, Callable, Iterable, Sequence, TypeVar, Union

import redis.asyncio as aioredis
from redis import exceptions as rex
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from cluster.shared.directory import lua
from cluster.shared.directory.errors import (UNAVAILABLE_ERRORS, DirectoryAuthError, DirectoryError,
                                            DirectoryUnavailable, auth_error_message, is_acl_denial)
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


def stats_number(raw: Union[bytes, str]) -> float:
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


class DirectoryConnection:
    """The Redis connection of one namespace of the prefix directory, its
    scripts and its error translation (``Directory`` adds the operations).

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
    ) -> "DirectoryConnection":
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


def async_client(url: str, what: str) -> aioredis.Redis:
    """A ``redis.asyncio`` client with short timeouts and decoded replies, over its
    own pool (``env:NAME`` and Sentinel URLs as the directory's); ``what`` names
    the setting in errors. For the routers' small stores (responses, LoRA registry)."""
    from cluster.shared.config.loading import from_env

    url = from_env(url, what)
    options = dict(socket_connect_timeout=1.0, socket_timeout=2.0, retry=Retry(NoBackoff(), 1),
                   decode_responses=True)
    return sentinel_client(url, options) if url.startswith(SENTINEL_SCHEME) else aioredis.Redis.from_url(url, **options)
