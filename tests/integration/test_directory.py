"""The Redis prefix directory against a real redis-server (loopback).

Every test uses its own namespace on the session's server; the fault tests
(Redis stopped and restarted) start a private server so the shared one stays up.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster.shared.directory import Directory, DirectoryUnavailable, PublishStatus
from cluster.shared.directory.publisher import DirectoryPublisher
from cluster.shared.hashing import hash_block_chain, root_hash
from cluster.launch.redis_server import RedisServer
from workers.engine.block_pool import BlockPool

BLOCK = 4


def chain(tokens, fingerprint="model-a", salt=""):
    return hash_block_chain(tokens, BLOCK, root_hash(fingerprint, salt))


def make_directory(url, ttl_s=5.0, **kwargs) -> Directory:
    return Directory.from_url(url, f"test-{uuid.uuid4().hex[:8]}", ttl_s=ttl_s, unavailable_backoff_s=0, **kwargs)


def run(scenario, url, **kwargs):
    """Runs ``scenario(directory)`` on a fresh namespace in a fresh loop."""

    async def main():
        directory = make_directory(url, **kwargs)
        try:
            return await scenario(directory)
        finally:
            await directory.aclose()

    return asyncio.run(main())


async def registered(directory, replica_id, blocks=(), seq_no=1):
    """Registers a replica and resyncs it to ``blocks``; returns its epoch."""
    epoch = await directory.register(replica_id)
    assert await directory.resync(replica_id, epoch, seq_no, list(blocks)) is PublishStatus.OK
    return epoch


async def keys_naming(directory, text):
    client = directory._client
    return [k async for k in client.scan_iter(match=f"{directory.prefix}*") if text.encode() in k]


def test_lookup_counts_leading_blocks_per_replica(redis_server):
    prompt = chain(list(range(40)))  # 10 blocks
    other_branch = chain(list(range(24)) + [999] * 16)  # shares the first 6 blocks

    async def scenario(d: Directory):
        await registered(d, "full", prompt)
        await registered(d, "short", prompt[:4])
        await registered(d, "holey", prompt[:2] + prompt[3:6])  # block 2 evicted
        await registered(d, "cold")
        assert await d.lookup(prompt) == {"full": 10, "short": 4, "holey": 2, "cold": 0}
        assert await d.lookup(other_branch) == {"full": 6, "short": 4, "holey": 2, "cold": 0}
        assert await d.lookup(chain([7] + list(range(1, 40)))) == {"full": 0, "short": 0, "holey": 0, "cold": 0}
        assert await d.lookup([]) == {"full": 0, "short": 0, "holey": 0, "cold": 0}
        assert set(await d.live_replicas()) == {"full", "short", "holey", "cold"}

    run(scenario, redis_server.url)


def test_publish_store_remove_clear(redis_server):
    blocks = chain(list(range(32)))  # 8 blocks

    async def scenario(d: Directory):
        epoch = await registered(d, "r", seq_no=1)
        assert await d.publish("r", epoch, 2, stored=blocks[:5]) is PublishStatus.OK
        assert await d.lookup(blocks) == {"r": 5}
        assert await d.publish("r", epoch, 3, stored=blocks[5:], removed=[blocks[3]]) is PublishStatus.OK
        assert await d.lookup(blocks) == {"r": 3}
        assert await d.replica_block_hashes("r") == set(blocks) - {blocks[3]}
        assert await d.publish("r", epoch, 4, stored=blocks[:2], cleared=True) is PublishStatus.OK
        assert await d.replica_block_hashes("r") == set(blocks[:2])
        assert await d.publish("r", epoch, 5, removed=blocks[:2]) is PublishStatus.OK
        assert await d.lookup(blocks) == {"r": 0}
        assert await keys_naming(d, "blk:r") == []  # an empty set is no key

    run(scenario, redis_server.url)


def test_long_chains_and_many_replicas(redis_server):
    # 2,500 blocks: past every chunk limit of the scripts (Lua unpack, CHUNK).
    blocks = chain(list(range(2500 * BLOCK)))

    async def scenario(d: Directory):
        expected = {}
        for i in range(24):
            n = (i * 397) % 2501
            await registered(d, f"r{i}", blocks[:n])
            expected[f"r{i}"] = n
        assert await d.lookup(blocks) == expected
        epoch = await d.register("r0")
        assert await d.resync("r0", epoch, 1, blocks) is PublishStatus.OK
        assert await d.publish("r0", epoch, 2, removed=[blocks[1999]]) is PublishStatus.OK
        assert (await d.lookup(blocks))["r0"] == 1999

    run(scenario, redis_server.url)


def test_dead_replica_leaves_within_ttl_and_gc_removes_it(redis_server):
    blocks = chain(list(range(16)))

    async def scenario(d: Directory):
        alive = DirectoryPublisher(d, "alive", lambda: (1, blocks), heartbeat_s=0.05, gc_every=0)
        await alive.start()
        await registered(d, "dead", blocks)  # never heartbeats
        assert await d.lookup(blocks) == {"alive": 4, "dead": 4}
        start = time.monotonic()
        while "dead" in await d.lookup(blocks):
            assert time.monotonic() - start < d.ttl_ms / 1000 + 0.5, "dead replica still named after its TTL"
            await asyncio.sleep(0.02)
        assert await d.lookup(blocks) == {"alive": 4}
        assert await d.gc() == ["dead"]
        assert await keys_naming(d, "dead") == []
        assert await d.gc() == []
        await alive.stop()
        assert await d.lookup(blocks) == {}
        assert await keys_naming(d, "alive") == []  # deregistered at once

    run(scenario, redis_server.url, ttl_s=1.0)


def test_restarted_replica_never_serves_old_epoch(redis_server):
    old_blocks = chain(list(range(20)))
    new_blocks = chain(list(range(100, 112)))

    async def scenario(d: Directory):
        old_epoch = await registered(d, "r", old_blocks)
        new_epoch = await d.register("r")  # the process restarted
        assert new_epoch > old_epoch
        assert await d.lookup(old_blocks) == {"r": 0}
        # The old process, still running somewhere, cannot write or heartbeat.
        assert await d.publish("r", old_epoch, 2, stored=old_blocks) is PublishStatus.SUPERSEDED
        assert await d.resync("r", old_epoch, 9, old_blocks) is PublishStatus.SUPERSEDED
        assert await d.heartbeat("r", old_epoch) is PublishStatus.SUPERSEDED
        assert not await d.deregister("r", old_epoch)
        assert await d.lookup(old_blocks) == {"r": 0}
        # Until the new epoch resyncs, its (empty) set is not even consulted.
        assert await d.publish("r", new_epoch, 1, stored=new_blocks) is PublishStatus.NEEDS_RESYNC
        assert await d.resync("r", new_epoch, 1, new_blocks) is PublishStatus.OK
        assert await d.lookup(new_blocks) == {"r": 3}
        assert await d.lookup(old_blocks) == {"r": 0}
        assert await d.live_replicas() == {"r": new_epoch}

    run(scenario, redis_server.url)


def test_heartbeat_heals_a_lost_index(redis_server):
    blocks = chain(list(range(8)))

    async def scenario(d: Directory):
        epoch = await registered(d, "r", blocks)
        await d._client.delete(f"{d.prefix}replicas")  # e.g. evicted under maxmemory
        assert await d.lookup(blocks) == {}  # unseen, never wrongly seen
        assert await d.heartbeat("r", epoch) is PublishStatus.OK
        assert await d.lookup(blocks) == {"r": 2}

    run(scenario, redis_server.url)


def test_heartbeat_stats_are_listed_for_live_replicas_only(redis_server):
    blocks = chain(list(range(8)))

    async def scenario(d: Directory):
        epoch = await registered(d, "r", blocks)
        other = await registered(d, "s", [])
        assert await d.replica_stats() == {"r": {}, "s": {}}  # live, no stats yet
        # Numbers come back as numbers, the node IP (TEXT_STATS) as text.
        stats = {"num_running": 2, "num_waiting": 0, "kv_cache_usage": 0.25, "num_cached_blocks": 2, "node": "10.0.0.2"}
        assert await d.heartbeat("r", epoch, stats=stats) is PublishStatus.OK
        assert (await d.replica_stats())["r"] == stats
        assert await d.heartbeat("r", epoch + 1, stats={"num_running": 9}) is PublishStatus.SUPERSEDED
        assert (await d.replica_stats())["r"] == stats  # a stale process writes nothing
        ttl = await d._client.pttl(f"{d.prefix}stats:r")
        assert 0 < ttl <= d.ttl_ms  # expires with the replica
        await d.deregister("s", other)
        assert await d.deregister("r", epoch)
        assert await d.replica_stats() == {}
        assert not await d._client.exists(f"{d.prefix}stats:r")

    run(scenario, redis_server.url)


def test_publisher_sends_stats_with_heartbeats(redis_server):
    async def scenario(d: Directory):
        calls = []

        def stats_fn():
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("boom")  # a failing stats_fn never stops heartbeats
            return {"num_running": 1, "kv_cache_usage": 0.5}

        publisher = DirectoryPublisher(d, "p", lambda: (1, []), heartbeat_s=0.05, gc_every=0, stats_fn=stats_fn)
        await publisher.start()
        try:
            deadline = time.monotonic() + 5
            while (await d.replica_stats()).get("p") != {"num_running": 1, "kv_cache_usage": 0.5}:
                assert time.monotonic() < deadline, await d.replica_stats()
                await asyncio.sleep(0.05)
        finally:
            await publisher.stop()
        assert await d.replica_stats() == {}

    run(scenario, redis_server.url)


def fill_pool(pool: BlockPool, tokens: list[int]) -> list[int]:
    """Caches every full block of ``tokens`` in ``pool`` and frees them."""
    hashes = chain(tokens)
    block_ids = pool.allocate(len(hashes))
    assert block_ids is not None
    pool.cache_full_blocks(block_ids, hashes, root_hash("model-a"))
    pool.free(reversed(block_ids))
    return block_ids


def pool_snapshot(pool: BlockPool):
    snapshot = pool.take_snapshot()
    return snapshot.seq_no, snapshot.block_hashes


def test_lost_batch_is_detected_and_repaired_by_resync(redis_server):
    pool = BlockPool(num_blocks=8, block_size=BLOCK)

    async def scenario(d: Directory):
        publisher = DirectoryPublisher(d, "r", lambda: pool_snapshot(pool), heartbeat_s=1.0)
        assert await publisher.start()
        fill_pool(pool, list(range(16)))
        assert await publisher.publish_events(pool.take_events())
        fill_pool(pool, list(range(50, 70)))  # evicts some of the first blocks
        lost = pool.take_events()
        assert lost is not None  # ... and never published
        fill_pool(pool, list(range(200, 212)))
        resyncs = publisher.num_resyncs
        assert await publisher.publish_events(pool.take_events())  # gap -> repaired
        assert publisher.num_resyncs == resyncs + 1 and not publisher.needs_resync
        assert await d.replica_block_hashes("r") == set(pool.cached_block_hashes())
        fill_pool(pool, list(range(300, 308)))
        assert await publisher.publish_events(pool.take_events())  # numbering goes on
        assert await d.replica_block_hashes("r") == set(pool.cached_block_hashes())
        assert publisher.num_resyncs == resyncs + 1
        await publisher.stop()

    run(scenario, redis_server.url)


def test_redis_down_fails_fast_and_publisher_recovers_after_restart():
    pool = BlockPool(num_blocks=16, block_size=BLOCK)
    prompt = list(range(24))

    async def scenario(server: RedisServer, d: Directory):
        publisher = DirectoryPublisher(d, "r", lambda: pool_snapshot(pool), heartbeat_s=0.1)
        await publisher.start()
        fill_pool(pool, prompt)
        assert await publisher.publish_events(pool.take_events())
        assert await d.lookup(chain(prompt)) == {"r": 6}

        await asyncio.to_thread(server.stop)
        start = time.monotonic()
        with pytest.raises(DirectoryUnavailable):
            await d.lookup(chain(prompt))
        assert time.monotonic() - start < 0.5
        fill_pool(pool, list(range(100, 108)))
        assert not await publisher.publish_events(pool.take_events())  # no raise, no block
        assert publisher.needs_resync

        await asyncio.to_thread(server.start)  # same port, empty: a Redis restart
        deadline = time.monotonic() + 3.0
        while publisher.needs_resync:  # the heartbeat task repairs an idle replica
            assert time.monotonic() < deadline, "publisher did not resync after Redis came back"
            await asyncio.sleep(0.05)
        assert await d.replica_block_hashes("r") == set(pool.cached_block_hashes())
        assert await d.lookup(chain(prompt)) == {"r": 6}
        fill_pool(pool, list(range(200, 204)))
        assert await publisher.publish_events(pool.take_events())
        await publisher.stop()

    async def main(server):
        d = make_directory(server.url, ttl_s=2.0, socket_timeout_s=0.2)
        try:
            await scenario(server, d)
        finally:
            await d.aclose()

    with RedisServer() as server:
        asyncio.run(main(server))


def test_salts_and_models_give_disjoint_chains(redis_server):
    tokens = list(range(32))
    chains = {
        ("model-a", ""): chain(tokens, "model-a", ""),
        ("model-a", "tenant-1"): chain(tokens, "model-a", "tenant-1"),
        ("model-b", ""): chain(tokens, "model-b", ""),
    }
    all_hashes = [h for c in chains.values() for h in c]
    assert len(set(all_hashes)) == len(all_hashes)

    async def scenario(d: Directory):
        await registered(d, "r", chains[("model-a", "")])
        assert await d.lookup(chains[("model-a", "")]) == {"r": 8}
        assert await d.lookup(chains[("model-a", "tenant-1")]) == {"r": 0}
        assert await d.lookup(chains[("model-b", "")]) == {"r": 0}

    run(scenario, redis_server.url)


# ------------------------------------------------------ property-style check
TREE = [chain(list(range(32))), chain(list(range(16)) + [7] * 16), chain([5] * 24)]
UNIVERSE = sorted({h for c in TREE for h in c})
REPLICAS = ["a", "b", "c"]

ops = st.lists(
    st.tuples(
        st.sampled_from(REPLICAS),
        st.sampled_from(["store", "remove", "clear", "resync"]),
        st.lists(st.sampled_from(UNIVERSE), max_size=10),
    ),
    max_size=25,
)


def leading(held: set, hashes: list) -> int:
    n = 0
    while n < len(hashes) and hashes[n] in held:
        n += 1
    return n


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=ops)
def test_directory_matches_a_set_model(redis_server, ops):
    async def scenario(d: Directory):
        model = {rid: set() for rid in REPLICAS}
        epochs, seqs = {}, {}
        for rid in REPLICAS:
            epochs[rid], seqs[rid] = await registered(d, rid), 1
        for rid, op, hashes in ops:
            seqs[rid] += 1
            if op == "resync":
                model[rid] = set(hashes)
                status = await d.resync(rid, epochs[rid], seqs[rid], hashes)
            elif op == "clear":
                model[rid] = set(hashes)
                status = await d.publish(rid, epochs[rid], seqs[rid], stored=hashes, cleared=True)
            elif op == "store":
                model[rid] |= set(hashes)
                status = await d.publish(rid, epochs[rid], seqs[rid], stored=hashes)
            else:
                model[rid] -= set(hashes)
                status = await d.publish(rid, epochs[rid], seqs[rid], removed=hashes)
            assert status is PublishStatus.OK
            for query in TREE:
                assert await d.lookup(query) == {r: leading(model[r], query) for r in REPLICAS}
        for rid in REPLICAS:
            assert await d.replica_block_hashes(rid) == model[rid]

    run(scenario, redis_server.url)


def test_replica_with_another_cache_contract_answers_minus_one(redis_server):
    from cluster.shared.contract import CacheContract

    ours = CacheContract(BLOCK, "model-a", "tok-1").encode()
    other_tokenizer = CacheContract(BLOCK, "model-a", "tok-2").encode()
    other_block = CacheContract(8, "model-a", "tok-1").encode()
    prompt = chain(list(range(16)))

    async def scenario(d):
        for rid, contract in (("same", ours), ("tok", other_tokenizer), ("blk", other_block), ("undeclared", "")):
            epoch = await d.register(rid, contract)
            assert await d.resync(rid, epoch, 1, prompt) is PublishStatus.OK
        checked = await d.lookup(prompt, ours)
        unchecked = await d.lookup(prompt)
        theirs = await d.replica_contract("tok")
        return checked, unchecked, theirs

    checked, unchecked, theirs = run(scenario, redis_server.url)
    # Contract mismatches are flagged, never reported as a plain miss; an
    # undeclared contract is not compared.
    assert checked == {"same": 4, "tok": -1, "blk": -1, "undeclared": 4}
    assert unchecked == {"same": 4, "tok": 4, "blk": 4, "undeclared": 4}
    assert CacheContract.decode(ours).differences(theirs) == ["tokenizer: tok-1 != tok-2"]
