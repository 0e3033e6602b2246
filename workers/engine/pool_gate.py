"""The engine thread's hold on the block pool, lent out while a forward runs
and while the thread idles, so that a KV export can pin cached blocks (and an
import reserve and commit) without waiting for the step in flight to end
(``workers/kv_transfer.py``; docs/KV_TRANSFER.md): a step of 2,048 prefill
tokens takes seconds on CPU, and a fetch that waited for the holder's step
cost more than the prefill it saved (``bench routing``).

Why the pool may change while a forward runs: the forward reads and writes
the KV of the blocks its schedule handed out (taken off the free queue, ref
count > 0) and nothing of the pool's bookkeeping; a pin takes a cached block
(committed, never written again until it is allocated afresh) and a release
gives one back, both under this lock, which the engine thread holds for
everything else it does (schedule, the step's bookkeeping, its calls)::

    engine thread:  [held: schedule] [lent: forward] [held: update, calls] [lent: idle wait] ...
    other thread:                     pin / release                        pin / release

A step that schedules nothing (a waiting request whose blocks are not free)
runs no forward, so it lends the gate for a moment instead (``pause``) when
another thread waits for it: the blocks it waits for may be the ones a
transfer pinned, whose release needs the gate (without this the engine
thread spun holding it, and the release, and so the request, waited for
ever).

No torch, no ray: a ``threading.Lock`` and the discipline above.
"""

from __future__ import annotations

import queue
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, TypeVar

T = TypeVar("T")

PAUSE_S = 0.001  # how long a step that scheduled nothing lends the gate


class PoolGate:
    """A lock the engine thread holds except while it lends it (``lent``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = threading.Lock()
        self._waiting = 0  # other threads in ``run``, not yet holding the gate

    def take(self, engine: Any) -> None:
        """Engine thread, before its loop: holds the gate and lends it around each forward."""
        self._lock.acquire()
        engine.forward_gate = self

    def give_back(self, engine: Any) -> None:
        """Engine thread, when its loop ends."""
        engine.forward_gate = None
        self._lock.release()

    @contextmanager
    def lent(self) -> Iterator[None]:
        """Engine thread: the gate is free for ``run`` inside this block."""
        self._lock.release()
        try:
            yield
        finally:
            self._lock.acquire()

    def pause(self) -> None:
        """Engine thread, after a step that scheduled nothing: lends the gate a moment
        when another thread waits for it. Only then: a sleep here costs the engine
        thread the GIL, and getting it back behind a busy thread took up to a switch
        interval (5 ms) per token when decoding at batch 1 made such steps."""
        if self._waiting:
            with self.lent():
                time.sleep(PAUSE_S)

    def get(self, inbox: "queue.Queue[T]", block: bool) -> T:
        """Engine thread: the inbox's next item, the gate lent while it waits idle
        (raises ``queue.Empty`` when not ``block`` and none is there)."""
        if not block:
            return inbox.get(block=False)
        with self.lent():
            return inbox.get()

    def run(self, fn: Callable[[], T]) -> T:
        """Another thread: ``fn()`` under the gate (waits for a forward, an idle wait or a pause)."""
        with self._count:
            self._waiting += 1
        try:
            self._lock.acquire()
        finally:
            with self._count:
                self._waiting -= 1
        try:
            return fn()
        finally:
            self._lock.release()
