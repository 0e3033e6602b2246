"""LoRA adapters added at run time (``POST /v1/load_lora_adapter``), shared
by every router of a model through Redis, or kept in this router's memory
when the cluster has none::

    ps:lora:<namespace>   HASH  adapter name -> {"path": ..., "generation": ...}

``generation`` (milliseconds since the epoch at the load) travels as the
request's ``LoRARequest.lora_int_id``: replicas key loaded adapters by
``(name, path, id)``, so a name unloaded and loaded again, even from the same
folder with new files, is read afresh (and its prefix cache is keyed by its
new content, ``workers/lora/adapter.py``).

Routers read the hash at most every ``refresh_s`` (``maybe_refresh``, from
the front ends before they resolve a request's ``model``), and at once after
their own loads and unloads. Redis unreachable: the last copy stands, and
loads and unloads fail with ``RegistryUnavailable`` (503).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Optional

logger = logging.getLogger(__name__)

KEY_PREFIX = "ps:lora:"  # under the directory's key space: the routers' ACL user may set and delete these


class RegistryUnavailable(RuntimeError):
    """The shared registry cannot be read or written now (Redis down or refusing)."""


class RuntimeAdapters:
    """The run-time adapters of one model.

    Args:
        client: A ``redis.asyncio.Redis`` (decoded responses), or None to keep
            them in this process.
        namespace: The model's directory namespace (part of the key).
        refresh_s: Longest time a router serves from its copy.
    """

    def __init__(self, client: Any = None, namespace: str = "default", refresh_s: float = 1.0,
                 clock: Any = time.monotonic) -> None:
        self._client = client
        self.key = KEY_PREFIX + namespace
        self.refresh_s = refresh_s
        self._clock = clock
        self._adapters: dict[str, tuple[str, int]] = {}
        self._read_at = float("-inf")

    @classmethod
    def from_url(cls, url: Optional[str], namespace: str) -> "RuntimeAdapters":
        """Over Redis at ``url`` (its own pool, the response store's options), or in memory for None."""
        if not url:
            return cls(None, namespace)
        from cluster.shared.directory.connection import async_client

        return cls(async_client(url, "the LoRA registry's redis_url"), namespace)

    def get(self, name: str) -> Optional[tuple[str, int]]:
        """``(path, generation)`` of a run-time adapter, from this router's copy."""
        return self._adapters.get(name)

    def names(self) -> dict[str, str]:
        """Every run-time adapter, name -> path."""
        return {name: path for name, (path, _) in self._adapters.items()}

    async def maybe_refresh(self) -> None:
        """Reads the shared hash when the copy is older than ``refresh_s`` (never raises)."""
        if self._client is None or self._clock() - self._read_at < self.refresh_s:
            return
        self._read_at = self._clock()
        try:
            await self._read()
        except RegistryUnavailable as exc:
            logger.warning("LoRA registry %s: %s; serving from the last copy", self.key, exc)

    @staticmethod
    def next_generation() -> int:
        """A new generation number (milliseconds since the epoch)."""
        return time.time_ns() // 1_000_000

    async def add(self, name: str, path: str, generation: int) -> None:
        """Adds (or replaces) ``name`` at ``generation`` (``next_generation``)."""
        if self._client is not None:
            await self._call("hset", self._client.hset(self.key, name, json.dumps({"path": path,
                                                                                   "generation": generation})))
            await self._read()
        else:
            self._adapters[name] = (path, generation)

    async def remove(self, name: str) -> bool:
        """Removes ``name``; False when it was not there."""
        if self._client is not None:
            removed = await self._call("hdel", self._client.hdel(self.key, name))
            await self._read()
            return bool(removed)
        return self._adapters.pop(name, None) is not None

    async def _read(self) -> None:
        raw = await self._call("hgetall", self._client.hgetall(self.key))
        adapters = {}
        for name, text in raw.items():
            try:
                record = json.loads(text)
                adapters[name] = (str(record["path"]), int(record["generation"]))
            except (ValueError, KeyError, TypeError):
                logger.warning("LoRA registry %s: ignoring a malformed entry for %r", self.key, name)
        self._adapters = adapters
        self._read_at = self._clock()

    async def _call(self, what: str, awaitable: Any) -> Any:
        from redis.exceptions import RedisError

        try:
            return await awaitable
        except RedisError as exc:
            raise RegistryUnavailable(f"{what} on the LoRA registry failed: {exc}") from exc

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
