"""A replica follows the routers' registry of run-time LoRA adapters, so an
adapter unloaded at run time (``POST /v1/unload_lora_adapter``) leaves every
replica's memory within a few seconds, not when the LRU next needs the room.

The routers keep the registry in Redis (``router/lora_registry.py``)::

    ps:lora:<namespace>   HASH  adapter name -> {"path": ..., "generation": ...}

Every ``SYNC_INTERVAL_S``, while the replica holds a run-time adapter, it
reads the hash (one ``HGETALL``; the replica's ACL reads every ``ps:*`` key)
and has the engine thread drop the run-time adapters it no longer lists at
their generation (``LoRAManager.drop_unregistered``: never one a request
uses). Redis unreachable: nothing is dropped, the next round tries again.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Callable

from workers.engine.lora_slots import slots_in_use

logger = logging.getLogger(__name__)

KEY_PREFIX = "ps:lora:"  # router/lora_registry.py's (the router's package is not the replica's to import)
SYNC_INTERVAL_S = 2.0


def registered_generations(raw: dict) -> dict[str, int]:
    """``name -> generation`` of the registry hash's entries (malformed ones skipped)."""
    out = {}
    for name, text in raw.items():
        try:
            out[str(name)] = int(json.loads(text)["generation"])
        except (ValueError, KeyError, TypeError):
            continue
    return out


async def follow_unloads(redis_url: str, namespace: str, engine: Any, front: Any, closing: Callable[[], bool],
                         interval_s: float = SYNC_INTERVAL_S) -> None:
    """Runs until ``closing()`` (or cancelled): drops what the registry unloaded (module doc).

    Args:
        engine: The replica's ``LLMEngine`` (its ``lora`` is read from this thread only
            to see whether a run-time adapter is loaded).
        front: Its ``AsyncEngine``: the drop runs on the engine thread.
    """
    from redis.exceptions import RedisError

    from cluster.shared.directory.connection import async_client

    client = async_client(redis_url, "the LoRA registry's redis_url")
    key = KEY_PREFIX + namespace
    try:
        while not closing():
            await asyncio.sleep(interval_s)
            if not engine.lora.has_runtime_adapters():
                continue
            try:
                registered = registered_generations(await client.hgetall(key))
            except (RedisError, OSError) as exc:
                logger.debug("LoRA registry %s unreadable (%s); dropping nothing this round", key, exc)
                continue
            dropped = await front.call(
                lambda eng: eng.lora.drop_unregistered(registered, slots_in_use(eng.scheduler.queue)))
            if dropped:
                logger.info("LoRA adapters %s were unloaded at run time: their weights are freed", dropped)
    finally:
        await client.aclose()
