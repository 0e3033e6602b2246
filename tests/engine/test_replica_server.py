"""The replica class without Serve or Redis: streaming chunks, usage, stats,
and cancellation returning every block."""

from __future__ import annotations

import asyncio

import pytest

from cluster.shared.types import FinishReason, GenerationRequest, SamplingParams
from tests.factories import make_tiny_model_dir
from workers.replica import ReplicaServer


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    model_dir = make_tiny_model_dir("llama", tmp_path_factory.mktemp("replica-llama"))
    server = ReplicaServer({"model": str(model_dir), "block_size": 4}, replica_id="r-test")
    yield server
    server.shutdown()


def test_stream_has_usage_and_replica_id(replica):
    async def main():
        chunks = []
        request = GenerationRequest("s1", list(range(3, 30)), SamplingParams(max_tokens=6, temperature=0))
        async for chunk in replica.generate(request):
            chunks.append(chunk)
        return chunks

    chunks = asyncio.run(main())
    assert sum(len(c.token_ids) for c in chunks) == 6
    assert all(c.replica_id == "r-test" for c in chunks)
    last = chunks[-1]
    assert last.finish_reason == FinishReason.LENGTH
    assert (last.prompt_tokens, last.completion_tokens) == (27, 6)


def test_cancel_mid_stream_frees_every_block(replica):
    async def main():
        request = GenerationRequest("c1", list(range(5, 70)), SamplingParams(max_tokens=500, ignore_eos=True))
        stream = replica.generate(request)
        seen = 0
        async for chunk in stream:
            seen += len(chunk.token_ids)
            if seen >= 3:
                mid = await replica.stats()
                await stream.aclose()
                break
        for _ in range(200):
            after = await replica.stats()
            if after["num_running"] == 0 and after["num_used_blocks"] == 0:
                return mid, after
            await asyncio.sleep(0.01)
        return mid, after

    mid, after = asyncio.run(main())
    assert mid["num_used_blocks"] > 0
    assert after["num_used_blocks"] == 0 and after["num_running"] == 0
    assert after["num_free_blocks"] == after["num_device_blocks"]


def test_routing_and_autoscaling_stats(replica):
    stats = replica.record_routing_stats()
    assert stats["replica_id"] == "r-test"
    assert {"num_running", "num_waiting", "num_swapped", "kv_cache_usage", "num_cached_blocks"} <= set(stats)
    auto = asyncio.run(replica.record_autoscaling_stats())
    assert set(auto) == {"kv_cache_usage", "num_waiting", "num_running", "num_swapped", "ttft_s"}
    assert all(isinstance(v, float) for v in auto.values())
    assert auto["num_running"] == auto["num_waiting"] == 0.0 and auto["ttft_s"] >= 0.0  # idle replica
