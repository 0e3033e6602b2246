"""Prefix-aware routing through Serve's request router with the real
directory: a repeated long prefix lands on the replica that holds it."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from cluster.app import build_app
from cluster.shared.config import ClusterConfig, EngineConfig
from cluster.shared.types import GenerationRequest, SamplingParams
from tests.factories import make_tiny_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir("llama", tmp_path_factory.mktemp("route-llama"))


def run(handle, request):
    async def go():
        chunks = []
        async for chunk in handle.options(stream=True, method_name="generate").remote(request):
            chunks.append(chunk)
        return chunks[-1]

    return asyncio.run(go())


def deploy(model_dir, redis_url, policy, name):
    from ray import serve

    engine = EngineConfig.from_kwargs(model=str(model_dir), block_size=4, num_kv_blocks=200)
    config = ClusterConfig(replicas=2, redis_url=redis_url, namespace=f"{name}-{uuid.uuid4().hex[:6]}",
                           engine=engine, replica_num_cpus=0.25, routing_policy=policy)
    serve.start(proxy_location="Disabled")
    return serve.run(build_app(config), name=name, route_prefix=None)


def test_repeated_prefix_lands_on_the_replica_that_holds_it(ray_local, redis_server, model_dir):
    from ray import serve

    handle = deploy(model_dir, redis_server.url, "cache_aware", "route-ca")
    try:
        prefix = list(range(100, 164))  # 16 blocks
        first = run(handle, GenerationRequest("warm", prefix + [5], SamplingParams(max_tokens=2)))
        time.sleep(1.5)  # the directory learns the blocks after the step
        finals = [run(handle, GenerationRequest(f"q{i}", prefix + [6 + i, 7], SamplingParams(max_tokens=2)))
                  for i in range(6)]
        assert {f.replica_id for f in finals} == {first.replica_id}
        assert all(f.cached_prompt_tokens == 64 for f in finals)
    finally:
        serve.delete("route-ca")


def test_round_robin_ignores_the_cache(ray_local, redis_server, model_dir):
    # The contrast: without the directory, requests alternate replicas.
    from ray import serve

    handle = deploy(model_dir, redis_server.url, "round_robin", "route-rr")
    try:
        prefix = list(range(200, 264))
        finals = [run(handle, GenerationRequest(f"r{i}", prefix + [6 + i, 7], SamplingParams(max_tokens=2)))
                  for i in range(6)]
        assert len({f.replica_id for f in finals}) == 2
    finally:
        serve.delete("route-rr")
