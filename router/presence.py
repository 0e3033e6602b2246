"""Whether a model has any live replica, so that its requests fail fast
when none is up instead of waiting in Serve's queue for one that may never
come back.

Serve's handle queues a request until a replica of the deployment can take
it: a model whose replicas all died (or never start: a crash loop, no room
on any node) would hold every request until the client gives up. The
replicas register in the prefix directory and renew their registration with
each heartbeat (``DEFAULT_HEARTBEAT_S``, expiring after ``DEFAULT_TTL_S``), so
the directory knows which are alive. ``ReplicaPresence`` reads that count
every ``period_s`` on the front ends' loop::

    presence.known_empty()  True only when every read for ``grace_s`` (3 s)
                            saw no live replica, the last within 3 periods:
                            new requests get NoReplicaError (UNAVAILABLE /
                            HTTP 503) at once
                            False when replicas are up, or when it cannot
                            tell (no read yet, Redis down): the request goes
                            to Serve as before

The grace covers a Redis that restarted empty: its replicas register again
with their next heartbeat (1 s), and no request is refused meanwhile.

Streams already running are not affected: a stream whose replica dies
migrates (``router/migration.py``) and waits for a replica as before. A
crashed replica is seen as gone once its registration expires (the TTL),
and as back when it registers again after its restart.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Optional

logger = logging.getLogger(__name__)

DEFAULT_PERIOD_S = 1.0
DEFAULT_GRACE_S = 3.0


class ReplicaPresence:
    """Follows how many replicas of one model are live in the directory.

    Args:
        directory: The model's ``Directory`` (its namespace).
        period_s: Seconds between reads.
        grace_s: How long every read must see none before requests are refused.
        clock: Monotonic clock (tests pass a fake).
    """

    def __init__(self, directory: Any, period_s: float = DEFAULT_PERIOD_S, grace_s: float = DEFAULT_GRACE_S,
                 clock: Any = time.monotonic) -> None:
        self.directory = directory
        self.period_s = period_s
        self.grace_s = grace_s
        self.clock = clock
        self.num_live: Optional[int] = None
        self.read_at = float("-inf")
        self.empty_since: Optional[float] = None  # first read of the current run of reads that saw none
        self._task: Optional[asyncio.Task] = None

    def known_empty(self) -> bool:
        """True when every read for ``grace_s`` found no live replica, the last one recent."""
        self._ensure_polling()
        now = self.clock()
        return (self.empty_since is not None and now - self.empty_since >= self.grace_s
                and now - self.read_at <= 3 * self.period_s)

    async def refresh(self) -> None:
        """One read of the directory (failures leave the last count to age out)."""
        try:
            self.num_live = len(await self.directory.replica_stats())
            self.read_at = self.clock()
            if self.num_live:
                self.empty_since = None
            elif self.empty_since is None:
                self.empty_since = self.read_at
        except Exception as exc:  # noqa: BLE001 - Redis trouble: cannot tell, requests go to Serve
            logger.debug("replica presence: directory unavailable: %s", exc)

    def _ensure_polling(self) -> None:
        if self._task is not None and not self._task.done():
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._task = loop.create_task(self._poll())

    async def _poll(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.period_s)

    def stop(self) -> None:
        """Stops polling."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
