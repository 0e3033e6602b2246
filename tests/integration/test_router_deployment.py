"""The router as a Serve deployment (what a RayService runs): replicas plus a
router replica whose gRPC and HTTP front ends bind their ports inside the Serve
actor; clients talk to those ports, never to Serve."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
import uuid

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.app import ROUTER_DEPLOYMENT, app_builder, build_app
from cluster.shared.config import ClusterConfig, EngineConfig, RouterConfig
from cluster.shared.directory import Directory
from cluster.shared.hashing import hash_block_chain, root_hash
from router.pb import generation_pb2 as pb
from router.pb import generation_pb2_grpc as pb_grpc
from tests.factories import make_tiny_model_dir
from tests.integration.router_cluster import assert_all_hit, burst_reaches_holders, distinct_prefixes
from workers.model.loader import model_fingerprint

APP = "router-deployment"
PREFIX = list(range(200, 248))  # 12 blocks of 4


@pytest.fixture(scope="module")
def deployed(ray_local, redis_server, tmp_path_factory):
    """Replicas + one router replica; yields the router's addresses."""
    from ray import serve

    model_dir = make_tiny_model_dir("llama", tmp_path_factory.mktemp("router-dep"))
    engine = EngineConfig.from_kwargs(model=str(model_dir), block_size=4, num_kv_blocks=200)
    config = ClusterConfig(
        replicas=2, replica_num_cpus=0.25, redis_url=redis_server.url, namespace=f"rd-{uuid.uuid4().hex[:6]}",
        engine=engine, router=RouterConfig(grpc_port=0, http_port=0, router_num_cpus=0.25),
    )
    serve.start(proxy_location="Disabled")
    serve.run(build_app(config, with_router=True), name=APP, route_prefix=None)
    try:
        router = serve.get_deployment_handle(ROUTER_DEPLOYMENT, app_name=APP)
        yield {**router.addresses.remote().result(timeout_s=30), "config": config, "model_dir": model_dir}
    finally:
        serve.delete(APP)


async def _generate(address: str, request: pb.GenerateRequest) -> list:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        return [chunk async for chunk in stub.Generate(request, timeout=60)]


def _ids(ids: list[int], max_tokens: int = 3) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=ids),
                              sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


def test_router_replica_serves_grpc_with_prefix_routing(deployed):
    address = deployed["grpc"]

    async def main():
        async with grpc.aio.insecure_channel(address) as channel:
            health = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="prefixserve.v1.Generation"), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
        first = (await _generate(address, _ids(PREFIX + [1])))[-1]
        assert first.finish_reason == "length" and first.usage.completion_tokens == 3

        async def send(ids):
            last = (await _generate(address, _ids(ids)))[-1]
            return last.replica_id, last.usage.cached_prompt_tokens

        # Concurrent requests with different prefixes each reach their holder.
        assert_all_hit(await burst_reaches_holders(send, distinct_prefixes(3, 120, salt=4)), 120)

    asyncio.run(main())


def test_router_replica_serves_the_openai_api(deployed):
    base = deployed["http"]
    with urllib.request.urlopen(f"{base}/models", timeout=60) as response:
        models = json.load(response)
    assert models["object"] == "list" and [m["id"] for m in models["data"]]
    payload = {"model": models["data"][0]["id"], "prompt": "hello", "max_tokens": 4, "temperature": 0,
               "ignore_eos": True}
    request = urllib.request.Request(f"{base}/completions", data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        body = json.load(response)
    assert body["usage"]["completion_tokens"] == 4, body


def test_app_builder_rejects_bad_args():
    with pytest.raises(ValueError, match="exactly one of 'config'"):
        app_builder({"conifg": {}})
    with pytest.raises(ValueError, match="exactly one of 'config'"):
        app_builder({})


def test_cache_salt_isolates_tenants_end_to_end(deployed):
    """Tenant b sending tenant a's exact prompt gets no cache hit (no side channel
    on a's prompts), on whichever replica it lands; its own repeat does hit."""
    address = deployed["grpc"]
    prompt = list(range(300, 340))  # 10 blocks of 4

    def salted(salt: str, tail: list[int]) -> pb.GenerateRequest:
        request = _ids(prompt + tail)
        request.cache_salt = salt
        return request

    config, fingerprint = deployed["config"], model_fingerprint(deployed["model_dir"])

    async def listed(salt: str) -> None:
        # A repeat is routed on what the directory lists: wait for the first one's blocks (a fixed
        # 1.5 s was not always enough while the suite ran, and the repeat went to the other replica).
        chain = hash_block_chain(prompt, 4, root_hash(fingerprint, salt))
        directory = Directory.from_url(config.redis_url, config.namespace)
        try:
            deadline = time.monotonic() + 30
            while max((await directory.lookup(chain)).values(), default=0) < len(chain):
                assert time.monotonic() < deadline, f"the directory never listed {salt}'s prompt"
                await asyncio.sleep(0.1)
        finally:
            await directory.aclose()
        await asyncio.sleep(0.5)  # the router's own index follows the directory's stream

    async def main():
        first = (await _generate(address, salted("tenant-a", [1])))[-1]
        await listed("tenant-a")
        assert (await _generate(address, salted("tenant-a", [2])))[-1].usage.cached_prompt_tokens == len(prompt)
        other = (await _generate(address, salted("tenant-b", [3])))[-1]
        assert other.usage.cached_prompt_tokens == 0
        await listed("tenant-b")
        again = (await _generate(address, salted("tenant-b", [4])))[-1]
        assert again.usage.cached_prompt_tokens == len(prompt)
        return first

    asyncio.run(main())


def test_a_misspelled_router_limit_fails_at_build_time():
    config = ClusterConfig(redis_url="redis://127.0.0.1:1", router=RouterConfig(limits={"max_prompt_tokns": 10}))
    with pytest.raises(ValueError, match="max_prompt_tokns"):
        build_app(config, with_router=True)


def test_routing_policy_params_reach_the_policy_and_typos_are_named():
    from cluster.app import request_router_config

    config = ClusterConfig(routing_policy_params={"new_prefill_weight": 3.0})
    # and fetch pricing's default for replicas that share cores (off: replica_num_cpus 0.5)
    assert request_router_config(config).request_router_kwargs["policy_params"] == {"new_prefill_weight": 3.0,
                                                                                    "fetch_bytes_per_s": 0.0}
    with pytest.raises(ValueError, match="new_prefil_weight"):
        request_router_config(ClusterConfig(routing_policy_params={"new_prefil_weight": 3.0}))
    cache_aware = ClusterConfig(routing_policy="cache_aware", routing_policy_params={"balance_abs_threshold": 2},
                                directory_lookup="redis")
    kwargs = request_router_config(cache_aware).request_router_kwargs
    assert kwargs["policy_params"] == {"balance_abs_threshold": 2} and kwargs["directory_lookup"] == "redis"
    assert request_router_config(config).request_router_kwargs["directory_lookup"] == "index"


def test_two_models_behind_one_router_deployment(ray_local, redis_server, tmp_path_factory):
    """The RayService shape with models: one app, a replica deployment per model,
    the router routing by model (what app_builder builds from serveConfigV2)."""
    from ray import serve

    folders = {name: make_tiny_model_dir("llama", tmp_path_factory.mktemp(f"rd-{name}"), seed=seed)
               for name, seed in (("alpha", 3), ("beta", 4))}
    app = app_builder({"config": {
        "redis_url": redis_server.url, "namespace": f"rd2-{uuid.uuid4().hex[:6]}",
        "router": {"grpc_port": 0, "http_port": 0, "router_num_cpus": 0.25},
        "models": [{"name": name, "replica_num_cpus": 0.25,
                    "engine": {"model": str(folder), "block_size": 4, "num_kv_blocks": 64}}
                   for name, folder in folders.items()],
    }})
    serve.start(proxy_location="Disabled")
    serve.run(app, name=f"{APP}-two", route_prefix=None)
    try:
        status = serve.status().applications[f"{APP}-two"].deployments
        assert {"replica-alpha", "replica-beta", ROUTER_DEPLOYMENT} <= set(status)
        addresses = serve.get_deployment_handle(ROUTER_DEPLOYMENT, app_name=f"{APP}-two").addresses.remote().result(
            timeout_s=30)
        with urllib.request.urlopen(f"{addresses['http']}/models", timeout=60) as response:
            assert [m["id"] for m in json.load(response)["data"]] == ["alpha", "beta"]
        texts = {}
        for name in folders:
            request = _ids(PREFIX[:8], max_tokens=6)
            request.model = name
            chunks = asyncio.run(_generate(addresses["grpc"], request))
            texts[name] = [t for c in chunks for t in c.token_ids]
        assert texts["alpha"] != texts["beta"]  # different weights: each model answered its own requests
    finally:
        serve.delete(f"{APP}-two")
