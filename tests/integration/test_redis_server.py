"""RedisServer: a real redis-server on loopback, stopped and restarted in place."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from cluster.shared.directory import Directory, DirectoryUnavailable
from cluster.launch.redis_server import RedisServer, find_free_port


def test_start_stop_restart_on_the_same_port_with_a_password():
    with RedisServer(password="s3cret") as server:
        port, pid = server.port, server.pid
        assert server.url == f"redis://:s3cret@127.0.0.1:{port}/0"
        client = redis.Redis.from_url(server.url)
        client.set("k", "v")
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host="127.0.0.1", port=port, retry=Retry(NoBackoff(), 0)).set("k", "v")
        assert client.config_get("save") == {"save": ""}
        assert client.config_get("appendonly") == {"appendonly": "no"}
        server.restart()
        assert server.port == port and server.pid != pid and server.is_running
        assert redis.Redis.from_url(server.url).get("k") is None  # nothing persisted
        server.stop()
        assert not server.is_running
        server.stop()  # twice is fine
        with pytest.raises(redis.ConnectionError):
            redis.Redis.from_url(server.url, retry=Retry(NoBackoff(), 0)).ping()
        client.close()


def test_directory_fails_fast_then_backs_off():
    url = f"redis://127.0.0.1:{find_free_port()}/0"  # nothing listens there

    async def main():
        directory = Directory.from_url(url, "t", unavailable_backoff_s=30.0)
        try:
            start = time.monotonic()
            with pytest.raises(DirectoryUnavailable, match="Redis unavailable"):
                await directory.lookup([b"\0" * 16])
            with pytest.raises(DirectoryUnavailable, match="next try in"):
                await directory.register("r")  # no Redis call during the backoff
            assert time.monotonic() - start < 0.5
        finally:
            await directory.aclose()

    asyncio.run(main())


def test_redis_server_dies_with_a_killed_owner(tmp_path):
    # The owner is SIGKILLed (no cleanup runs): its redis-server must not linger.
    import os
    import signal
    import subprocess
    import sys

    import psutil

    code = (
        "import time\n"
        "from cluster.launch.redis_server import RedisServer\n"
        "server = RedisServer().start()\n"
        "print(server.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    redis_pid = int(owner.stdout.readline())
    assert psutil.pid_exists(redis_pid)
    os.kill(owner.pid, signal.SIGKILL)
    owner.wait()
    assert_exits_within(redis_pid, 10)


def test_redis_server_started_from_a_worker_thread_outlives_the_thread_but_not_its_owner():
    # PR_SET_PDEATHSIG fires when the forking *thread* exits; a server started
    # through asyncio.to_thread must keep running after that thread is gone.
    import os
    import signal
    import subprocess
    import sys


    code = (
        "import asyncio, threading, time\n"
        "import redis\n"
        "from cluster.launch.redis_server import RedisServer\n"
        "server = RedisServer()\n"
        "asyncio.run(asyncio.to_thread(server.start))  # the executor's thread exits with the loop\n"
        "worker = threading.Thread(target=server.restart)\n"
        "worker.start(); worker.join()\n"
        "time.sleep(1.0)\n"
        "print(server.pid, server.is_running, redis.Redis.from_url(server.url).ping(), flush=True)\n"
        "time.sleep(60)\n"
    )
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        line = owner.stdout.readline().split()
        assert line[1:] == ["True", "True"], line
        redis_pid = int(line[0])
    finally:
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait()
    assert_exits_within(redis_pid, 10)


def assert_exits_within(pid: int, timeout_s: float) -> None:
    """Fails unless process ``pid`` is gone (or a zombie) within ``timeout_s``."""
    import psutil

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.1)
    raise AssertionError(f"redis-server {pid} outlived its killed owner")
