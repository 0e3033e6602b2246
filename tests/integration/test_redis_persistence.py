"""Stored responses survive a restart of the launcher's redis-server when it
persists (``redis_data_dir`` / ``--redis-data-dir``: an append-only file in a
folder that outlives the server), whether it stopped cleanly or was killed;
without it, a restart empties Redis as before."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from cluster.cli.main import build_parser
from cluster.cli.up import up_config
from cluster.launch.local import LocalCluster
from cluster.launch.redis_server import RedisServer
from cluster.shared.config import ClusterConfig
from router.openai.response_store import RedisResponseStore

RECORD = {"response": {"id": "resp_1", "status": "completed"}, "input_items": [], "conversation": []}


def _put(url: str) -> None:
    async def main():
        store = RedisResponseStore.from_url(url, "default")
        await store.put("default", "resp_1", RECORD)
        await store.aclose()
    asyncio.run(main())


def _get(url: str):
    async def main():
        store = RedisResponseStore.from_url(url, "default")
        try:
            return await store.get("default", "resp_1")
        finally:
            await store.aclose()
    return asyncio.run(main())


def test_a_persisting_server_keeps_stored_responses_over_a_stop_and_a_kill(tmp_path):
    data_dir = tmp_path / "redis-data"
    server = RedisServer(data_dir=data_dir).start()
    try:
        _put(server.url)
        server.restart()  # SIGTERM: Redis flushes its append-only file before it exits
        assert _get(server.url) == RECORD
        os.kill(server.pid, signal.SIGKILL)  # a crash: at most the last second is lost
        server._proc.wait(5)
        server.start()
        assert _get(server.url) == RECORD
        _put(server.url)
        time.sleep(1.5)  # appendfsync everysec
        os.kill(server.pid, signal.SIGKILL)
        server._proc.wait(5)
        server.start()
        assert _get(server.url) == RECORD
    finally:
        server.stop()
    assert any(data_dir.rglob("*.aof"))  # stop() keeps the folder
    with RedisServer(data_dir=data_dir) as again:  # the next launch finds them too
        assert _get(again.url) == RECORD


def test_without_a_data_dir_a_restart_empties_redis():
    with RedisServer() as server:
        _put(server.url)
        server.restart()
        assert _get(server.url) is None


def test_the_launcher_starts_a_persisting_server_from_the_config(tmp_path):
    args = build_parser().parse_args(["up", "--redis-data-dir", str(tmp_path / "d")])
    config = up_config(args)
    assert config.redis_data_dir == str(tmp_path / "d")
    cluster = LocalCluster(config)
    cluster._start_redis("127.0.0.1")
    try:
        assert cluster.redis.persist_dir == tmp_path / "d"
        _put(cluster.redis_url)
        cluster.redis.restart()
        assert _get(cluster.redis_url) == RECORD
    finally:
        cluster.redis.stop()
    with pytest.raises(ValueError, match="redis_data_dir is the folder of the redis-server the launcher starts"):
        ClusterConfig(redis_url="redis://127.0.0.1:1/0", redis_data_dir=str(tmp_path))
