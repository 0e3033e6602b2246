"""The router-local index follower (cluster/shared/directory/follower.py)
against a real redis-server: it answers like the directory's LOOKUP through
publishes, lost batches, resyncs, restarts, deregistration, expiry, a stream
trimmed under it, and a Redis restart."""

from __future__ import annotations

import asyncio
import time
import uuid

from cluster.launch.redis_server import RedisServer
from cluster.shared.directory import Directory, PublishStatus
from cluster.shared.directory.follower import IndexFollower
from cluster.shared.hashing import hash_block_chain, root_hash

BLOCK = 4


def chain(tokens, salt=""):
    return hash_block_chain(tokens, BLOCK, root_hash("model-a", salt))


PROMPTS = [chain(list(range(i * 100, i * 100 + 40))) for i in range(4)]  # 10 blocks each


async def converged(follower: IndexFollower, directory: Directory, timeout: float = 5.0) -> None:
    """Waits until the follower answers every prompt like the directory does."""
    deadline = time.monotonic() + timeout
    while True:
        want = [{r: n for r, n in (await directory.lookup(p)).items() if n} for p in PROMPTS]
        got = [follower.lookup(p) for p in PROMPTS]
        if got == want:
            return
        assert time.monotonic() < deadline, f"follower {got} != directory {want}"
        await asyncio.sleep(0.05)


def run(scenario, url, ttl_s=5.0):
    async def main():
        namespace = f"follow-{uuid.uuid4().hex[:8]}"
        writer = Directory.from_url(url, namespace, ttl_s=ttl_s, unavailable_backoff_s=0)
        follower = IndexFollower(Directory.from_url(url, namespace, ttl_s=ttl_s, socket_timeout_s=2.0,
                                                    unavailable_backoff_s=0), poll_s=0.2)
        try:
            return await scenario(writer, follower)
        finally:
            await follower.stop()
            await follower.directory.aclose()
            await writer.aclose()

    return asyncio.run(main())


def test_follower_answers_like_the_directory_through_every_kind_of_change(redis_server):
    async def scenario(d: Directory, follower: IndexFollower):
        ea = await d.register("a")
        assert await d.resync("a", ea, 0, PROMPTS[0][:6]) is PublishStatus.OK
        follower.start()  # starts on a directory that already has a replica
        await converged(follower, d)
        assert follower.lookup(PROMPTS[0]) == {"a": 6}

        eb = await d.register("b")
        assert await d.resync("b", eb, 0, []) is PublishStatus.OK
        assert await d.publish("b", eb, 1, stored=PROMPTS[1]) is PublishStatus.OK
        assert await d.publish("a", ea, 1, stored=PROMPTS[0][6:], removed=PROMPTS[0][:1]) is PublishStatus.OK
        await converged(follower, d)
        assert follower.lookup(PROMPTS[1]) == {"b": 10}

        # A lost batch: the directory (and so the follower) stops crediting b ...
        assert await d.publish("b", eb, 3, stored=PROMPTS[2]) is PublishStatus.GAP
        await converged(follower, d)
        assert follower.lookup(PROMPTS[1]) == {}
        # ... until its resync, whose blocks the follower reads from a snapshot.
        assert await d.resync("b", eb, 3, PROMPTS[2][:4]) is PublishStatus.OK
        await converged(follower, d)
        assert follower.lookup(PROMPTS[2]) == {"b": 4}

        # A restart (new epoch) drops the old blocks at once; a cleared batch too.
        ea2 = await d.register("a")
        await converged(follower, d)
        assert "a" not in follower.lookup(PROMPTS[0])
        assert await d.resync("a", ea2, 0, PROMPTS[3]) is PublishStatus.OK
        assert await d.publish("a", ea2, 1, cleared=True, stored=PROMPTS[3][:2]) is PublishStatus.OK
        await converged(follower, d)
        assert follower.lookup(PROMPTS[3]) == {"a": 2}

        assert await d.deregister("b", eb)
        await converged(follower, d)
        assert follower.lookup(PROMPTS[2]) == {}
        assert follower.num_full_syncs == 1

    run(scenario, redis_server.url)


def test_follower_recovers_events_trimmed_before_it_read_them(redis_server):
    async def scenario(d: Directory, follower: IndexFollower):
        ea = await d.register("a")
        assert await d.resync("a", ea, 0, []) is PublishStatus.OK
        follower.start()
        await converged(follower, d)
        await follower.stop()  # the router stalls ...
        assert await d.publish("a", ea, 1, stored=PROMPTS[0]) is PublishStatus.OK
        assert await d.publish("a", ea, 2, removed=PROMPTS[0][5:]) is PublishStatus.OK
        await d._client.xtrim(f"{d.prefix}events", maxlen=0)  # ... and its events are trimmed away
        follower.start()
        await converged(follower, d)  # the liveness poll sees a's batch number ahead: snapshot
        assert follower.lookup(PROMPTS[0]) == {"a": 5}

    run(scenario, redis_server.url)


def test_expired_replica_leaves_the_index_and_redis_restart_resyncs_it():
    async def scenario(server, d: Directory, follower: IndexFollower):
        ea = await d.register("a")
        assert await d.resync("a", ea, 0, PROMPTS[0]) is PublishStatus.OK
        follower.start()
        await converged(follower, d)
        eb = await d.register("b")
        assert await d.resync("b", eb, 0, PROMPTS[1]) is PublishStatus.OK
        await converged(follower, d)
        deadline = time.monotonic() + 15
        while (found := follower.lookup(PROMPTS[1])) is None or "b" in found:  # b never heartbeats: its TTL (1 s)
            assert time.monotonic() < deadline
            await d.heartbeat("a", ea)
            await asyncio.sleep(0.1)

        await asyncio.to_thread(server.stop)
        deadline = time.monotonic() + 15
        while follower.in_sync:  # a follower that cannot read must not be trusted
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        assert follower.lookup(PROMPTS[0]) is None
        await asyncio.to_thread(server.start)  # empty: the replica registers again
        ea = await d.register("a")
        assert await d.resync("a", ea, 0, PROMPTS[0][:3]) is PublishStatus.OK
        await converged(follower, d)
        assert follower.lookup(PROMPTS[0]) == {"a": 3} and follower.num_full_syncs >= 2

    async def main(server):
        namespace = f"follow-{uuid.uuid4().hex[:8]}"
        d = Directory.from_url(server.url, namespace, ttl_s=1.0, unavailable_backoff_s=0)
        follower = IndexFollower(Directory.from_url(server.url, namespace, ttl_s=1.0, socket_timeout_s=2.0,
                                                    unavailable_backoff_s=0), poll_s=0.2)
        try:
            await scenario(server, d, follower)
        finally:
            await follower.stop()
            await follower.directory.aclose()
            await d.aclose()

    with RedisServer() as server:
        asyncio.run(main(server))
