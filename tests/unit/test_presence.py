"""A model with no live replica in the directory: new requests fail fast with NoReplicaError."""

from __future__ import annotations

import asyncio

import pytest

from router.backend import ModelInfo, RouterBackend
from router.errors import NoReplicaError
from router.presence import ReplicaPresence


class FakeDirectory:
    def __init__(self) -> None:
        self.live: dict[str, dict] = {"r1": {}}
        self.down = False

    async def replica_stats(self) -> dict[str, dict]:
        if self.down:
            raise ConnectionError("redis is down")
        return dict(self.live)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_known_empty_only_after_a_fresh_read_that_saw_none():
    directory, clock = FakeDirectory(), Clock()
    presence = ReplicaPresence(directory, period_s=1.0, clock=clock)

    async def main():
        assert not presence.known_empty()  # no read yet: cannot tell
        await presence.refresh()
        assert presence.num_live == 1 and not presence.known_empty()
        directory.live = {}
        await presence.refresh()
        assert not presence.known_empty()  # within the grace: a restarted Redis, replicas registering again
        clock.now += 1.0
        await presence.refresh()
        directory.live = {"r1": {}}
        clock.now += 1.0
        await presence.refresh()
        assert not presence.known_empty()  # back: the run of empty reads starts over
        directory.live = {}
        for _ in range(4):
            await presence.refresh()
            clock.now += 1.0
        assert presence.known_empty()  # none for 3 s
        clock.now += 3.5  # the last read is stale (no newer one succeeded): cannot tell
        assert not presence.known_empty()
        directory.down = True
        await presence.refresh()  # Redis down: the old count ages, never "empty" on a guess
        assert not presence.known_empty()
        presence.stop()

    asyncio.run(main())


def test_polling_follows_the_directory():
    directory = FakeDirectory()
    presence = ReplicaPresence(directory, period_s=0.01, grace_s=0.03)

    async def main():
        presence.known_empty()  # starts polling on this loop
        directory.live = {}
        for _ in range(200):
            await asyncio.sleep(0.01)
            if presence.known_empty():
                break
        assert presence.known_empty()
        directory.live = {"r2": {}}
        for _ in range(200):
            await asyncio.sleep(0.01)
            if not presence.known_empty():
                break
        assert presence.num_live == 1 and not presence.known_empty()
        presence.stop()

    asyncio.run(main())


def test_a_model_without_live_replicas_is_refused_at_once():
    directory = FakeDirectory()
    directory.live = {}
    presence = ReplicaPresence(directory, grace_s=0.0)
    backend = RouterBackend(handle=None, tokenizer=None, model=ModelInfo("gemma", 64), presence=presence)

    async def main():
        await presence.refresh()
        with pytest.raises(NoReplicaError, match="'gemma' has no live replica"):
            async for _ in backend.stream(object()):
                pass
        assert backend.num_inflight == 0
        presence.stop()

    asyncio.run(main())
