"""Redis dies mid-run: the gRPC router loses no request (routing falls back to
load only), and prefix routing comes back by itself once a Redis listens on
the same port again (the replicas resync their block sets into it).

The cluster runs on its own ``RedisServer``: the session's must never stop."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
import uuid

import grpc
import pytest

from cluster.shared.directory import Directory, DirectoryUnavailable
from cluster.launch.redis_server import RedisServer
from router.pb import generation_pb2 as pb
from tests.integration.router_cluster import (
    BLOCK_SIZE,
    WARM_POLICY_PARAMS,
    serve_app,
    directory_holders,
    final,
    ids_request,
    make_backend,
    make_chat_model_dir,
    new_handle,
    running_router,
    wait_until,
    warm_on_two_replicas,
)

pytestmark = pytest.mark.timeout(900)

logger = logging.getLogger(__name__)

APP = "router-redis-outage"


@pytest.fixture(scope="module")
def own_redis():
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def cluster(ray_local, own_redis, tmp_path_factory):
    """Yields (model_dir, namespace) of a 2-replica app on ``own_redis``."""
    model_dir = make_chat_model_dir(tmp_path_factory.mktemp("outage-llama"))
    namespace = f"outage-{uuid.uuid4().hex[:6]}"
    with serve_app(APP, model_dir, own_redis.url, namespace, block_size=BLOCK_SIZE, num_kv_blocks=400,
                   routing_policy_params=WARM_POLICY_PARAMS):
        yield model_dir, namespace


async def run_stream(stub, num_requests: int, concurrency: int, on_progress) -> list[pb.GenerateResponse]:
    """``num_requests`` short requests, ``concurrency`` at a time; calls
    ``on_progress(num_done)`` after each one finishes."""
    gate = asyncio.Semaphore(concurrency)
    done = 0

    async def one(i: int) -> pb.GenerateResponse:
        nonlocal done
        async with gate:
            last = await final(stub, ids_request([20 + i % 400, 21, 22, 23, 24, 25, 26], max_tokens=4,
                                                 ignore_eos=True), timeout=120)
        done += 1
        await on_progress(done)
        return last

    return await asyncio.gather(*(one(i) for i in range(num_requests)))


def test_killing_redis_mid_run_loses_no_request_and_routing_recovers(cluster, own_redis):
    model_dir, namespace = cluster
    url = own_redis.url
    prefix_a, prefix_b = list(range(100, 164)), list(range(200, 264))  # 16 blocks each
    num_requests, kill_after = 40, 8

    async def main():
        backend = make_backend(new_handle(APP), model_dir)
        probe = Directory.from_url(url, namespace)
        async with running_router(backend, url, namespace) as (_, stub):
            holders = await warm_on_two_replicas(stub, prefix_a, prefix_b)
            for prefix in (prefix_a, prefix_b):
                await wait_until(lambda p=prefix: directory_holders(url, namespace, backend.tokenizer, p),
                                 "the warm prefixes in the directory")

            killed = asyncio.Event()

            async def kill_redis(num_done: int) -> None:
                if num_done == kill_after and not killed.is_set():
                    os.kill(own_redis.pid, signal.SIGKILL)  # no shutdown, like a crashed pod
                    killed.set()

            async with asyncio.timeout(300):
                finals = await run_stream(stub, num_requests, 4, kill_redis)
            assert killed.is_set()

            # Redis is really down: calls fail fast, ListReplicas says UNAVAILABLE.
            with pytest.raises(DirectoryUnavailable):
                async with asyncio.timeout(5):
                    await probe.live_replicas()
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.ListReplicas(pb.ListReplicasRequest(), timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            # Long prompts too (their blocks do not touch the warm prefixes).
            during = [await final(stub, ids_request(list(range(300 + 64 * i, 364 + 64 * i)))) for i in range(2)]

            # A new Redis on the same port, empty: the replicas register and resync.
            await asyncio.to_thread(own_redis.stop)
            await asyncio.to_thread(own_redis.start)
            restarted = time.monotonic()
            for prefix, holder in zip((prefix_a, prefix_b), holders):
                async def resynced(prefix=prefix, holder=holder):
                    return await directory_holders(url, namespace, backend.tokenizer, prefix) == {holder: 16}

                await wait_until(resynced, f"the resync of {holder}'s blocks", timeout=60)
            logger.info("directory resynced %.1f s after the Redis restart", time.monotonic() - restarted)
            await asyncio.sleep(1.5)  # past the routers' fail-fast window (unavailable_backoff_s)
            after = [await final(stub, ids_request(p + [6, 7])) for p in (prefix_a, prefix_b, prefix_a, prefix_b)]
            replicas = (await stub.ListReplicas(pb.ListReplicasRequest(), timeout=10)).replicas
        await probe.aclose()
        return holders, finals, during, after, replicas

    holders, finals, during, after, replicas = asyncio.run(main())
    assert holders[0] != holders[1], "the warm-up must leave each prefix on its own replica"
    assert len(finals) == num_requests
    assert all(f.finish_reason == "length" and f.usage.completion_tokens == 4 for f in finals)
    assert all(f.finish_reason == "length" for f in during)
    # Prefix routing is back: each prefix lands on its holder, from its cache.
    assert [f.replica_id for f in after] == [holders[0], holders[1]] * 2
    assert all(f.usage.cached_prompt_tokens == 64 for f in after)
    assert sorted(r.replica_id for r in replicas) == sorted(holders)


def test_a_hung_redis_costs_no_request(cluster, own_redis):
    # SIGSTOP: connections open but nothing answers, so only the directory's
    # socket timeouts (and its fail-fast window) keep routing moving.
    model_dir, namespace = cluster
    url = own_redis.url
    num_requests = 16

    async def main():
        backend = make_backend(new_handle(APP), model_dir)
        async with running_router(backend, url, namespace) as (_, stub):
            await final(stub, ids_request(list(range(40, 60))))  # the connection pools are warm
            os.kill(own_redis.pid, signal.SIGSTOP)
            try:
                async def noop(num_done: int) -> None:
                    return None

                began = time.monotonic()
                async with asyncio.timeout(300):
                    finals = await run_stream(stub, num_requests, 4, noop)
                logger.info("%d requests with Redis hung took %.1f s", num_requests, time.monotonic() - began)
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.ListReplicas(pb.ListReplicasRequest(), timeout=30)
            finally:
                os.kill(own_redis.pid, signal.SIGCONT)
            probe = Directory.from_url(url, namespace)
            try:
                live = await wait_until(lambda: probe.live_replicas(), "both replicas live again", timeout=60)
            finally:
                await probe.aclose()
        return finals, info.value, live

    finals, error, live = asyncio.run(main())
    assert len(finals) == num_requests
    assert all(f.finish_reason == "length" and f.usage.completion_tokens == 4 for f in finals)
    assert error.code() == grpc.StatusCode.UNAVAILABLE, error
    assert len(live) == 2
