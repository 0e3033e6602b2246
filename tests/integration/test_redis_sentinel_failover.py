"""The prefix directory on Redis Sentinel (``redis+sentinel://``): the master
is killed mid-load, the sentinel promotes its replica, and no request is lost
(routing falls back to load while no master answers); then prefix routing
resumes on the new master: each warm prefix lands on its holder, from cache.

Real processes: a master and a replica ``redis-server``, one sentinel
(``redis-server --sentinel``, quorum 1), a 2-replica Serve app and the gRPC
router, all on loopback."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import pytest
import redis

from cluster.launch.redis_server import RedisServer, find_free_port
from router.pb import generation_pb2 as pb
from tests.integration.router_cluster import (
    BLOCK_SIZE,
    WARM_POLICY_PARAMS,
    directory_holders,
    final,
    ids_request,
    make_backend,
    make_chat_model_dir,
    new_handle,
    run_bounded,
    running_router,
    serve_app,
    wait_until,
    warm_on_two_replicas,
)
from tests.integration.test_router_redis_outage import run_stream

pytestmark = pytest.mark.timeout(900)

APP = "router-sentinel"
SERVICE = "psmaster"


class Sentinel:
    """One ``redis-server --sentinel`` watching ``master_port`` (quorum 1, fast failover)."""

    def __init__(self, master_port: int) -> None:
        self.port = find_free_port("127.0.0.1")
        self.dir = Path(tempfile.mkdtemp(prefix="prefixserve-sentinel-"))
        conf = self.dir / "sentinel.conf"
        conf.write_text(
            f"port {self.port}\nbind 127.0.0.1\ndir {self.dir}\n"
            f"sentinel monitor {SERVICE} 127.0.0.1 {master_port} 1\n"
            f"sentinel down-after-milliseconds {SERVICE} 1000\n"
            f"sentinel failover-timeout {SERVICE} 5000\n"
            f"sentinel parallel-syncs {SERVICE} 1\n")
        self.proc = subprocess.Popen(["redis-server", str(conf), "--sentinel"], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_timeout=1)
        deadline = time.monotonic() + 15
        while True:
            try:
                if client.ping():
                    break
            except redis.ConnectionError:
                pass
            assert time.monotonic() < deadline and self.proc.poll() is None, "the sentinel did not start"
            time.sleep(0.05)

    def master_port(self) -> int:
        return int(redis.Redis(port=self.port).sentinel_get_master_addr_by_name(SERVICE)[1])

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


@pytest.fixture(scope="module")
def sentinel_redis():
    """(master, replica, sentinel): a replicated pair under one sentinel."""
    with RedisServer() as master:
        with RedisServer(extra_args=["--replicaof", "127.0.0.1", str(master.port)]) as replica:
            client = redis.Redis(port=replica.port)
            deadline = time.monotonic() + 15
            while client.info("replication").get("master_link_status") != "up":
                assert time.monotonic() < deadline, "the replica did not sync"
                time.sleep(0.05)
            sentinel = Sentinel(master.port)
            try:
                yield master, replica, sentinel
            finally:
                sentinel.stop()


@pytest.fixture(scope="module")
def cluster(ray_local, sentinel_redis, tmp_path_factory):
    master, replica, sentinel = sentinel_redis
    url = f"redis+sentinel://127.0.0.1:{sentinel.port}/{SERVICE}/0"
    model_dir = make_chat_model_dir(tmp_path_factory.mktemp("sentinel-llama"))
    namespace = f"sentinel-{uuid.uuid4().hex[:6]}"
    with serve_app(APP, model_dir, url, namespace, block_size=BLOCK_SIZE, num_kv_blocks=400,
                   routing_policy_params=WARM_POLICY_PARAMS):
        yield model_dir, namespace, url


def test_a_sentinel_failover_mid_load_loses_nothing_and_routing_resumes(cluster, sentinel_redis):
    master, replica, sentinel = sentinel_redis
    model_dir, namespace, url = cluster
    prefix_a, prefix_b = list(range(100, 164)), list(range(200, 264))  # 16 blocks each
    num_requests, kill_after = 40, 8

    async def main():
        backend = make_backend(new_handle(APP), model_dir)
        async with running_router(backend, url, namespace) as (_, stub):
            holders = await warm_on_two_replicas(stub, prefix_a, prefix_b)
            for prefix in (prefix_a, prefix_b):
                await wait_until(lambda p=prefix: directory_holders(url, namespace, backend.tokenizer, p),
                                 "the warm prefixes in the directory")
            killed = asyncio.Event()

            async def kill_master(num_done: int) -> None:
                if num_done == kill_after and not killed.is_set():
                    os.kill(master.pid, signal.SIGKILL)
                    killed.set()

            async with asyncio.timeout(300):
                finals = await run_stream(stub, num_requests, 4, kill_master)
            await wait_until(lambda: asyncio.to_thread(lambda: sentinel.master_port() == replica.port or None),
                             "the sentinel's failover to the replica", timeout=60)
            for prefix, holder in zip((prefix_a, prefix_b), holders):
                async def on_new_master(prefix=prefix, holder=holder):
                    return await directory_holders(url, namespace, backend.tokenizer, prefix) == {holder: 16}

                await wait_until(on_new_master, f"{holder}'s blocks on the new master", timeout=60)
            await asyncio.sleep(1.5)  # past the routers' fail-fast window (unavailable_backoff_s)
            after = [await final(stub, ids_request(p + [6, 7])) for p in (prefix_a, prefix_b, prefix_a, prefix_b)]
            replicas = (await stub.ListReplicas(pb.ListReplicasRequest(), timeout=10)).replicas
        return holders, finals, after, replicas

    holders, finals, after, replicas = run_bounded(main())
    assert holders[0] != holders[1]
    assert len(finals) == num_requests
    assert all(f.finish_reason == "length" and f.usage.completion_tokens == 4 for f in finals)
    assert [f.replica_id for f in after] == [holders[0], holders[1]] * 2
    assert all(f.usage.cached_prompt_tokens == 64 for f in after)
    assert sorted(r.replica_id for r in replicas) == sorted(holders)
    assert sentinel.master_port() == replica.port


def test_sentinel_urls_are_checked():
    from cluster.shared.directory import Directory

    for bad in ("redis+sentinel:///psmaster", "redis+sentinel://host/", "redis+sentinel://host:x/svc",
                "redis+sentinel://h:1/svc/db"):
        with pytest.raises(ValueError, match="redis\\+sentinel://"):
            Directory.from_url(bad, "ns")
