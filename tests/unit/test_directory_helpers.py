"""Pure parts of the prefix directory, without Redis: key schema, input
checks, event folding, and the publisher's state machine over a fake."""

from __future__ import annotations

import asyncio

import pytest

from cluster.shared.directory import lua
from cluster.shared.directory import DirectoryUnavailable, PublishStatus, check_block_hashes, pairs_to_dict
from cluster.shared.directory.publisher import DirectoryPublisher, net_effect
from cluster.launch.redis_server import RedisServer, RedisServerNotFound
from workers.engine.block_pool import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

H = [bytes([i]) * 16 for i in range(8)]


def stored(*hashes):
    return BlockStored(tuple(hashes), b"\0" * 16, 4)


def test_key_schema_uses_one_hash_tag_per_namespace():
    prefix = lua.key_prefix("llama-3b")
    assert prefix == "ps:{llama-3b}:"
    assert lua.rep_key(prefix, "r1") == "ps:{llama-3b}:rep:r1"
    assert lua.blk_key(prefix, "r1") == "ps:{llama-3b}:blk:r1"
    assert lua.replicas_key(prefix) == "ps:{llama-3b}:replicas"
    assert lua.tmp_key(prefix, "r1", 7) == "ps:{llama-3b}:tmp:r1:7"
    for bad in ("", "a{b", "a}b", "a b"):
        with pytest.raises(ValueError, match="namespace"):
            lua.key_prefix(bad)
    for bad in ("", "a\nb", None):
        with pytest.raises(ValueError, match="replica_id"):
            lua.check_replica_id(bad)


def test_block_hashes_must_be_raw_16_byte_digests():
    assert check_block_hashes(iter(H[:2])) == H[:2]
    with pytest.raises(ValueError, match="16-byte"):
        check_block_hashes([H[0].hex()])
    with pytest.raises(ValueError, match="16-byte"):
        check_block_hashes([H[0][:8]])


def test_pairs_to_dict():
    assert pairs_to_dict([b"a", 3, b"b", 0]) == {"a": 3, "b": 0}
    assert pairs_to_dict([]) == {}


def test_net_effect_keeps_the_last_event_per_hash():
    events = [
        stored(H[0], H[1], H[2]),
        BlockRemoved((H[1], H[3])),
        stored(H[3]),  # evicted then stored again in one step: present
        BlockRemoved((H[2],)),  # stored then evicted: absent
    ]
    assert net_effect(events) == ([H[0], H[3]], [H[1], H[2]], False)


def test_net_effect_clear_forgets_what_came_before():
    events = [stored(H[0]), BlockRemoved((H[5],)), AllBlocksCleared(), stored(H[1]), BlockRemoved((H[4],))]
    assert net_effect(events) == ([H[1]], [H[4]], True)
    assert net_effect([]) == ([], [], False)
    with pytest.raises(ValueError, match="unknown KV event"):
        net_effect([object()])


def test_missing_redis_binary_says_how_to_install_it():
    with pytest.raises(RedisServerNotFound, match=r"apt-get install -y redis-server.*--redis-url"):
        RedisServer(binary="no-such-redis-server")


# ------------------------------------------------------- publisher over a fake
class FakeDirectory:
    """Records calls; ``replies`` scripts the status of the next publishes."""

    ttl_ms = 5000

    def __init__(self):
        self.calls = []
        self.replies = []
        self.down = False
        self.epochs = 0

    async def _call(self, *call):
        self.calls.append(call)
        if self.down:
            raise DirectoryUnavailable("down")

    async def register(self, replica_id, contract=""):
        await self._call("register")
        self.epochs += 1
        return self.epochs

    async def resync(self, replica_id, epoch, seq_no, hashes):
        await self._call("resync", epoch, seq_no, tuple(hashes))
        return PublishStatus.OK

    async def publish(self, replica_id, epoch, seq_no, stored, removed, cleared):
        await self._call("publish", epoch, seq_no)
        return self.replies.pop(0) if self.replies else PublishStatus.OK

    async def deregister(self, replica_id, epoch):
        await self._call("deregister", epoch)
        return True


def make_publisher(snapshots):
    fake = FakeDirectory()
    publisher = DirectoryPublisher(fake, "r", lambda: snapshots.pop(0), heartbeat_s=1.0)
    return fake, publisher


def test_publisher_resyncs_on_gap_and_drops_batches_in_the_snapshot():
    async def main():
        fake, publisher = make_publisher([(1, [H[0]]), (5, [H[1]])])
        await publisher._repair_locked()  # what start() does, without the heartbeat task
        assert fake.calls == [("register",), ("resync", 1, 1, (H[0],))]
        assert await publisher.publish_batch(2, [H[2]], [])
        fake.replies = [PublishStatus.GAP]
        assert await publisher.publish_batch(3, [H[3]], [])  # gap -> snapshot 5
        assert fake.calls[-2:] == [("publish", 1, 3), ("resync", 1, 5, (H[1],))]
        fake.calls.clear()
        assert await publisher.publish_batch(4, [H[4]], [])  # drained before snapshot 5
        assert fake.calls == []
        assert await publisher.publish_batch(6, [H[4]], [])
        assert fake.calls == [("publish", 1, 6)]

    asyncio.run(main())


def test_publisher_survives_redis_trouble_and_re_registers_unknown_epochs():
    async def main():
        fake, publisher = make_publisher([(1, []), (4, [H[2]])])
        await publisher._repair_locked()
        fake.down = True
        assert not await publisher.publish_batch(2, [H[1]], [])  # no raise
        assert publisher.needs_resync and publisher.num_failures == 1
        fake.down = False
        fake.calls.clear()
        await publisher._beat_locked()  # the heartbeat repairs an idle replica
        assert fake.calls == [("resync", 1, 4, (H[2],))] and not publisher.needs_resync
        fake.replies = [PublishStatus.UNKNOWN]  # Redis restarted empty
        publisher._snapshot_fn = lambda: (9, [H[3]])
        assert await publisher.publish_batch(5, [], [H[2]])
        assert fake.calls[-2:] == [("register",), ("resync", 2, 9, (H[3],))]
        assert publisher.epoch == 2

    asyncio.run(main())


def test_publisher_takes_event_batches_and_async_snapshots():
    async def snapshot():
        return 1, [H[0]]

    async def main():
        fake = FakeDirectory()
        publisher = DirectoryPublisher(fake, "r", snapshot, heartbeat_s=1.0)
        await publisher._repair_locked()
        assert await publisher.publish_events(KVEventBatch(2, (stored(H[1]),)))
        await publisher.stop()
        assert fake.calls[-1] == ("deregister", 1) and publisher.epoch is None

    asyncio.run(main())


def test_publisher_rejects_a_heartbeat_too_slow_for_the_ttl():
    with pytest.raises(ValueError, match="half the directory TTL"):
        DirectoryPublisher(FakeDirectory(), "r", lambda: (1, []), heartbeat_s=3.0)
