"""The KV-aware autoscaling policy on a real local Ray Serve: load that fills
the replicas' KV caches makes the replica deployment grow from 1 to 2
replicas (the queue and TTFT signals are switched off, so KV use alone must
do it); after the load stops it shrinks back to 1 while a trickle of
requests keeps flowing, every request (during growth, the drain of the
removed replica and after) ends with its full output, and the removed
replica's entries leave the prefix directory.

Short delays and windows keep it quick; every wait is bounded, and nothing
asserts how long scaling took.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from typing import Any

import pytest

from cluster.app import REPLICA_DEPLOYMENT, build_app
from cluster.shared.config import AutoscalingConfig, ClusterConfig, EngineConfig
from cluster.shared.directory import Directory
from cluster.shared.types import FinishReason, GenerationRequest, SamplingParams
from tests.factories import make_tiny_model_dir

APP = "autoscaling-test"
MAX_TOKENS = 24
PROMPT_LEN = 20  # 5 full blocks of 4; with the output a request holds 11 blocks
SCALE_TIMEOUT_S = 240.0


def running_replicas() -> int:
    from ray import serve

    app = serve.status().applications.get(APP)
    if app is None or REPLICA_DEPLOYMENT not in app.deployments:
        return 0
    return int(app.deployments[REPLICA_DEPLOYMENT].replica_states.get("RUNNING", 0))


@pytest.fixture(scope="module")
def scaled_app(ray_local, redis_server, tmp_path_factory):
    from ray import serve

    model_dir = make_tiny_model_dir("llama", tmp_path_factory.mktemp("autoscale-llama"))
    engine = EngineConfig.from_kwargs(model=str(model_dir), block_size=4, num_kv_blocks=48, max_num_seqs=8,
                                      max_num_batched_tokens=64)
    scaling = AutoscalingConfig(
        min_replicas=1, max_replicas=2, target_kv_cache_usage=0.3, target_num_waiting=1e6, target_ttft_s=None,
        upscale_delay_s=1.0, downscale_delay_s=3.0, look_back_period_s=2.0, metrics_interval_s=0.5,
    )
    config = ClusterConfig(replicas=1, replica_num_cpus=0.25, redis_url=redis_server.url,
                           namespace=f"as-{uuid.uuid4().hex[:6]}", engine=engine, autoscaling=scaling)
    serve.start(proxy_location="Disabled")
    handle = serve.run(build_app(config), name=APP, route_prefix=None)
    yield handle, config
    serve.delete(APP)


def prompt_for(request_id: str) -> list[int]:
    """A prompt no other request shares a block with (no prefix-cache sharing)."""
    first = 3 + sum(map(ord, request_id)) % 500
    return [first] + list(range(3, 3 + PROMPT_LEN - 1))


async def one_request(handle: Any, request_id: str) -> dict[str, Any]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    request = GenerationRequest(request_id, prompt_for(request_id), params)
    tokens: list[int] = []
    last = None
    async for chunk in handle.options(stream=True, method_name="generate").remote(request):
        tokens.extend(chunk.token_ids)
        last = chunk
    return {"id": request_id, "tokens": tokens, "finish": last.finish_reason if last else None,
            "replica": last.replica_id if last else ""}


async def clients(handle: Any, stop: asyncio.Event, concurrency: int, results: list, tag: str) -> None:
    async def client(index: int) -> None:
        sent = 0
        while not stop.is_set():
            results.append(await one_request(handle, f"{tag}-{index}-{sent}"))
            sent += 1

    await asyncio.gather(*(client(i) for i in range(concurrency)))


async def run_until(handle: Any, concurrency: int, done, tag: str) -> tuple[list, bool]:
    """Runs ``concurrency`` request loops until ``done()`` holds (or the timeout)."""
    stop, results = asyncio.Event(), []
    load = asyncio.create_task(clients(handle, stop, concurrency, results, tag))
    deadline = time.monotonic() + SCALE_TIMEOUT_S
    reached = False
    while time.monotonic() < deadline and not load.done():
        if await asyncio.to_thread(done):
            reached = True
            break
        await asyncio.sleep(0.5)
    stop.set()
    await asyncio.wait_for(load, timeout=120)  # in-flight requests finish
    return results, reached


def assert_all_complete(results: list[dict[str, Any]]) -> None:
    assert results
    for result in results:
        assert result["finish"] == FinishReason.LENGTH, result
        assert len(result["tokens"]) == MAX_TOKENS, result


def live_in_directory(config: ClusterConfig) -> set[str]:
    async def run() -> set[str]:
        directory = Directory.from_url(config.redis_url, config.namespace)
        try:
            return set(await directory.live_replicas())
        finally:
            await directory.aclose()

    return asyncio.run(run())


def test_load_grows_the_deployment_and_it_shrinks_back_losing_nothing(scaled_app):
    handle, config = scaled_app
    assert running_replicas() == 1
    # KV load: 5 concurrent streams of 11 blocks each on 48 blocks.
    grow, grew = asyncio.run(run_until(handle, 5, lambda: running_replicas() >= 2, "load"))
    assert grew, f"the deployment did not grow to 2 replicas under KV pressure: {running_replicas()} running"
    assert_all_complete(grow)
    # A trickle (one request at a time) while the policy removes a replica:
    # requests in flight on the removed replica drain, new ones go elsewhere.
    trickle, shrank = asyncio.run(run_until(handle, 1, lambda: running_replicas() == 1, "trickle"))
    assert shrank, f"the deployment did not shrink back to 1 replica: {running_replicas()} running"
    assert_all_complete(trickle)
    replicas_used = Counter(r["replica"] for r in grow + trickle)
    assert len(replicas_used) >= 2, replicas_used  # both replicas served
    # The remaining replica still serves, and is the only one in the directory
    # (the removed one deregistered when Serve stopped it after its drain).
    after = asyncio.run(one_request(handle, "after"))
    assert_all_complete([after])
    deadline = time.monotonic() + 60
    while live_in_directory(config) != {after["replica"]} and time.monotonic() < deadline:
        time.sleep(0.5)
    assert live_in_directory(config) == {after["replica"]}
