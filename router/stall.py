"""Stall detection for one stream attempt: a replica that sends nothing for
``timeout_s`` while the router waits for its next chunk has stalled.

One timer per attempt, not one per chunk: ``asyncio.timeout`` around each
``__anext__`` costs ~5 µs a chunk (a Timeout object, a timer handle armed
and cancelled), a few hundred µs of router CPU per 160-token stream. Here a
chunk costs a few attribute writes; the timer fires at most once per
``timeout_s`` and re-arms itself from when the current wait began::

    wait ──chunk──wait ──chunk── ... wait ───────────── timeout_s ──▶ cancel
                                 ^ waiting_since       timer fires: expired

On expiry it cancels the waiting task (the cancel lands inside the Serve
call, whose ``cancel()`` then aborts the sequence should the replica wake
up) and ``next`` raises ``ReplicaStalledError`` instead of the cancel. A
cancel of the task from elsewhere (the client's deadline) stays a cancel.
A chunk that arrived in the same instant as the expiry is dropped with
the attempt; the caller's continuation recomputes it (``router/migration.py``).
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Optional

from cluster.shared.types import StreamChunk


class ReplicaStalledError(RuntimeError):
    """A replica sent nothing for the stall timeout while a chunk was awaited (its call was cancelled)."""


class StallWatch:
    """Times the waits for an attempt's chunks; create it on the task that iterates.

    Args:
        timeout_s: Most seconds one wait may take.
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.loop = asyncio.get_running_loop()
        self.task = asyncio.current_task()
        self.waiting_since: Optional[float] = None
        self.expired = False
        self._timer: Optional[asyncio.TimerHandle] = None

    def _check(self) -> None:
        self._timer = None
        if self.waiting_since is None:
            return  # between waits: the next wait arms the timer again
        due = self.waiting_since + self.timeout_s
        if self.loop.time() >= due:
            self.expired = True
            self.task.cancel()
        else:
            self._timer = self.loop.call_at(due, self._check)

    async def next(self, stream: AsyncIterator[Any]) -> Any:
        """The next item of ``stream``.

        Raises:
            ReplicaStalledError: None came within ``timeout_s``.
            StopAsyncIteration: The stream ended.
        """
        self.task = asyncio.current_task()  # whoever drives the stream now is the one to cancel
        self.waiting_since = self.loop.time()
        if self._timer is None:
            self._timer = self.loop.call_at(self.waiting_since + self.timeout_s, self._check)
        try:
            return await stream.__anext__()
        except asyncio.CancelledError:
            if self.expired and self.task.uncancel() == 0:
                raise ReplicaStalledError(f"no chunk for {self.timeout_s:g}s (stall_timeout_s)") from None
            raise
        finally:
            self.waiting_since = None

    def close(self) -> None:
        """Stops the timer (the attempt ended)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class WatchedAttempt:
    """One attempt's chunks: from its first chunk on, a wait longer than
    ``timeout_s`` raises ``ReplicaStalledError`` (None: never), so queueing
    and the prefill are never timed. Iterate it on one task; ``aclose`` ends it.

    Attributes:
        replica_id: The replica of the last chunk (None before the first).
    """

    def __init__(self, stream: AsyncIterator[StreamChunk], timeout_s: Optional[float]) -> None:
        self.stream = stream
        self.timeout_s = timeout_s
        self.replica_id: Optional[str] = None
        self._watch: Optional[StallWatch] = None

    def __aiter__(self) -> "WatchedAttempt":
        return self

    async def __anext__(self) -> StreamChunk:
        if self._watch is None:
            chunk = await self.stream.__anext__()
            if self.timeout_s is not None:
                self._watch = StallWatch(self.timeout_s)
        else:
            chunk = await self._watch.next(self.stream)
        self.replica_id = chunk.replica_id
        return chunk

    def stalled_replica(self, exc: BaseException) -> Optional[str]:
        """The replica that stalled when ``exc`` is this attempt's stall, else None."""
        return self.replica_id if isinstance(exc, ReplicaStalledError) and self.replica_id else None

    async def aclose(self) -> None:
        if self._watch is not None:
            self._watch.close()
        await self.stream.aclose()
