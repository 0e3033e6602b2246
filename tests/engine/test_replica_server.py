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


def test_speculating_replica_streams_the_same_tokens_and_exports_spec_metrics(tmp_path):
    """A replica built from a config with speculative_config: the stream is
    token-identical to a plain replica's, and /metrics counts the drafts."""
    model_dir = make_tiny_model_dir("llama", tmp_path / "m")
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "adaptive": False}
    plain = ReplicaServer({"model": str(model_dir), "block_size": 4}, replica_id="plain")
    fast = ReplicaServer({"model": str(model_dir), "block_size": 4, "speculative_config": spec}, replica_id="spec")
    prompt = [10, 20, 30, 40, 10, 20, 30, 40, 10, 20]

    async def tokens(server):
        out = []
        request = GenerationRequest("q", prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
        async for chunk in server.generate(request):
            out.extend(chunk.token_ids)
        return out

    try:
        assert asyncio.run(tokens(fast)) == asyncio.run(tokens(plain))
        text = fast.metrics.render().decode()
        drafted = [line for line in text.splitlines()
                   if line.startswith("prefixserve:spec_decode_num_draft_tokens_total")]
        assert drafted and float(drafted[0].split()[-1]) > 0
    finally:
        plain.shutdown()
        fast.shutdown()
