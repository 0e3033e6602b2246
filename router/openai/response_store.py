"""Where ``/v1/responses`` keeps stored responses: Redis, shared by every
router of the cluster (any router answers a ``previous_response_id`` or a
retrieve), or this process's memory when the cluster has no Redis.

One record per response, a JSON object under the caller's tenant::

    ps:responses:<namespace>:<tenant>:<response id>   (TTL ttl_s, default 7 days)
        {"response": {...the Response object...},
         "input_items": [...the items of its input, ids assigned...],
         "conversation": [...chat messages up to and including its output...]}

Background responses add two short-lived flags beside a record:
``…:<id>:lease`` (the running router renews it every few seconds) and
``…:<id>:cancel`` (a cancel asked on any router).

Another tenant's id is simply another key: it is not found (404). A record
is refused over ``max_record_bytes`` (a 400 that says the size). Redis down,
or an ACL that forbids these keys: ``StoreUnavailable``, which the API turns
into a 503 that says so; requests with ``store: false`` and no
``previous_response_id`` never touch the store and keep answering.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Optional

logger = logging.getLogger(__name__)

# Under the directory's key space (``ps:*``), which the routers' ACL user reaches
# (cluster/shared/directory/acl.py: read, and set / delete on these keys only).
KEY_PREFIX = "ps:responses:"
DEFAULT_TTL_S = 7 * 24 * 3600.0
DEFAULT_MAX_RECORD_BYTES = 8 * 2**20


class StoreUnavailable(RuntimeError):
    """The response store cannot be read or written now (Redis down or refusing)."""


class MemoryResponseStore:
    """Stored responses in this process (a cluster without Redis, and tests).

    Args:
        ttl_s: Seconds a record lives after its last write.
        max_record_bytes: Largest record (its JSON).
        clock: Monotonic clock.
    """

    def __init__(self, ttl_s: float = DEFAULT_TTL_S, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
                 clock: Any = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.max_record_bytes = max_record_bytes
        self.clock = clock
        self._records: dict[tuple[str, str], tuple[float, str]] = {}

    async def put(self, tenant: str, response_id: str, record: dict) -> None:
        text = _encode(record, self.max_record_bytes)
        self._records[(tenant, response_id)] = (self.clock() + self.ttl_s, text)

    async def get(self, tenant: str, response_id: str) -> Optional[dict]:
        entry = self._records.get((tenant, response_id))
        if entry is None or entry[0] < self.clock():
            self._records.pop((tenant, response_id), None)
            return None
        return json.loads(entry[1])

    async def delete(self, tenant: str, response_id: str) -> bool:
        return self._records.pop((tenant, response_id), None) is not None

    async def set_flag(self, tenant: str, response_id: str, flag: str, ttl_s: float) -> None:
        self._records[(tenant, f"{response_id}:{flag}")] = (self.clock() + ttl_s, "1")

    async def has_flag(self, tenant: str, response_id: str, flag: str) -> bool:
        entry = self._records.get((tenant, f"{response_id}:{flag}"))
        return entry is not None and entry[0] >= self.clock()

    async def drop_flag(self, tenant: str, response_id: str, flag: str) -> None:
        self._records.pop((tenant, f"{response_id}:{flag}"), None)

    async def aclose(self) -> None:
        self._records.clear()


class RedisResponseStore:
    """Stored responses in Redis (see the module doc).

    Args:
        client: A ``redis.asyncio.Redis`` (``from_url`` builds one with short timeouts).
        namespace: The cluster's namespace (part of every key).
        ttl_s: Seconds a record lives after its last write.
        max_record_bytes: Largest record (its JSON).
    """

    def __init__(self, client: Any, namespace: str, ttl_s: float = DEFAULT_TTL_S,
                 max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> None:
        self._client = client
        self.namespace = namespace
        self.ttl_s = ttl_s
        self.max_record_bytes = max_record_bytes

    @classmethod
    def from_url(cls, url: str, namespace: str, **kwargs: Any) -> "RedisResponseStore":
        """A store over its own connection pool (``env:NAME`` and Sentinel URLs as the directory's)."""
        from cluster.shared.directory.connection import async_client

        return cls(async_client(url, "the response store's redis_url"), namespace, **kwargs)

    def _key(self, tenant: str, response_id: str) -> str:
        return f"{KEY_PREFIX}{self.namespace}:{tenant}:{response_id}"

    async def put(self, tenant: str, response_id: str, record: dict) -> None:
        text = _encode(record, self.max_record_bytes)
        await self._call("store", self._client.set(self._key(tenant, response_id), text,
                                                   px=max(1, int(self.ttl_s * 1000))))

    async def get(self, tenant: str, response_id: str) -> Optional[dict]:
        text = await self._call("read", self._client.get(self._key(tenant, response_id)))
        return json.loads(text) if text is not None else None

    async def delete(self, tenant: str, response_id: str) -> bool:
        return bool(await self._call("delete", self._client.delete(self._key(tenant, response_id))))

    async def set_flag(self, tenant: str, response_id: str, flag: str, ttl_s: float) -> None:
        key = f"{self._key(tenant, response_id)}:{flag}"
        await self._call("store", self._client.set(key, "1", px=max(1, int(ttl_s * 1000))))

    async def has_flag(self, tenant: str, response_id: str, flag: str) -> bool:
        return bool(await self._call("read", self._client.exists(f"{self._key(tenant, response_id)}:{flag}")))

    async def drop_flag(self, tenant: str, response_id: str, flag: str) -> None:
        await self._call("delete", self._client.delete(f"{self._key(tenant, response_id)}:{flag}"))

    async def aclose(self) -> None:
        await self._client.aclose()

    async def _call(self, what: str, pending: Any) -> Any:
        from redis import exceptions as rex

        try:
            return await pending
        except (rex.AuthenticationError, rex.NoPermissionError) as exc:
            raise StoreUnavailable(f"the response store refused to {what} ({exc}): its Redis user needs "
                                   f"read and write on {KEY_PREFIX}* keys (cluster/shared/directory/acl.py)") from None
        except (rex.ConnectionError, rex.TimeoutError, OSError) as exc:
            raise StoreUnavailable(f"the response store is unavailable, cannot {what} the response "
                                   f"({type(exc).__name__}): retry later, or send store: false without "
                                   "previous_response_id") from None


def open_response_store(redis_url: Optional[str], namespace: str, ttl_s: float = DEFAULT_TTL_S,
                        max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> Any:
    """The routers' store: in the cluster's Redis (shared by every router), or this
    process's memory without one; the TTL and size cap are the config's
    (``router.responses_ttl_s``, ``router.responses_max_record_bytes``)."""
    if redis_url:
        return RedisResponseStore.from_url(redis_url, namespace, ttl_s=ttl_s, max_record_bytes=max_record_bytes)
    return MemoryResponseStore(ttl_s=ttl_s, max_record_bytes=max_record_bytes)


def _encode(record: dict, limit: int) -> str:
    text = json.dumps(record, separators=(",", ":"))
    if len(text) > limit:
        raise ValueError(f"the response and its input take {len(text)} bytes stored, over the store's limit of "
                         f"{limit}: send a shorter input or store: false")
    return text
