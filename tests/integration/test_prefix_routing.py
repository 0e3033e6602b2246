"""Prefix-aware routing through Serve's request router with the real
directory: under a burst of concurrent requests with different prefixes,
each lands on the replica that holds its prefix; routing on load alone
misses under the same burst."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from cluster.app import build_app
from cluster.shared.config import ClusterConfig, EngineConfig
from cluster.shared.types import GenerationRequest, SamplingParams
from tests.factories import make_tiny_model_dir
from tests.integration.router_cluster import assert_all_hit, burst_reaches_holders, distinct_prefixes

PREFIX_LEN = 200


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir("llama", tmp_path_factory.mktemp("route-llama"))


async def send_via(handle, ids, request_id):
    final = None
    async for chunk in handle.options(stream=True, method_name="generate").remote(
            GenerationRequest(request_id, ids, SamplingParams(max_tokens=2))):
        final = chunk
    return final.replica_id, final.cached_prompt_tokens


def deploy(model_dir, redis_url, policy, name, directory_lookup="index"):
    from ray import serve

    engine = EngineConfig.from_kwargs(model=str(model_dir), block_size=4, num_kv_blocks=600)
    config = ClusterConfig(replicas=2, redis_url=redis_url, namespace=f"{name}-{uuid.uuid4().hex[:6]}",
                           engine=engine, replica_num_cpus=0.25, routing_policy=policy,
                           directory_lookup=directory_lookup)
    serve.start(proxy_location="Disabled")
    return serve.run(build_app(config), name=name, route_prefix=None)


def burst(handle, salt):
    """4 prefixes of 200 tokens (50 blocks), cached in turn, then 2 requests of
    each at once (router_cluster.burst_reaches_holders)."""
    async def main():
        counter = iter(range(10_000))
        return await burst_reaches_holders(lambda ids: send_via(handle, ids, f"b{salt}-{next(counter)}"),
                                           distinct_prefixes(4, PREFIX_LEN, salt))

    return asyncio.run(main())


@pytest.mark.parametrize("policy,lookup", [("cache_aware", "index"), ("prefix_cost", "index"),
                                           ("prefix_cost", "redis")])
def test_concurrent_requests_land_on_the_replicas_that_hold_their_prefixes(ray_local, redis_server, model_dir,
                                                                          policy, lookup):
    # "index": each router's local copy of the directory; "redis": one Lua lookup per request.
    from ray import serve

    name = f"route-{policy}-{lookup}"
    handle = deploy(model_dir, redis_server.url, policy, name, directory_lookup=lookup)
    try:
        assert_all_hit(burst(handle, salt=1), PREFIX_LEN)
    finally:
        serve.delete(name)


@pytest.mark.parametrize("policy", ["round_robin"])
def test_routing_on_load_alone_misses_under_the_same_burst(ray_local, redis_server, model_dir, policy):
    # The contrast that shows the test above measures routing, not luck.
    from ray import serve

    handle = deploy(model_dir, redis_server.url, policy, f"route-{policy}")
    try:
        outcomes = burst(handle, salt=2)
        assert len({reached for _, _, reached, _ in outcomes}) == 2
        assert any(reached != holder or cached < PREFIX_LEN for _, holder, reached, cached in outcomes)
    finally:
        serve.delete(f"route-{policy}")
