"""The gRPC router on a real local cluster: Ray Serve with two tiny-model
replicas, the Redis directory, and a ``RouterServer`` on a loopback port,
spoken to through a real ``grpc.aio`` channel and the generated stub."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from cluster.shared.directory import Directory
from cluster.shared.types import GenerationRequest, SamplingParams
from router.backend import ModelInfo, RouterBackend
from router.pb import generation_pb2 as pb
from router.pb import generation_pb2_grpc as pb_grpc
from router.server import RouterServer
from router.tokenizer import RouterTokenizer
from tests.factories import make_tiny_model_dir
from tests.integration.router_cluster import assert_all_hit, burst_reaches_holders, distinct_prefixes, serve_app

APP = "grpc-router"
PREFIX = list(range(100, 164))  # 16 blocks of 4


@pytest.fixture(scope="module")
def cluster(ray_local, redis_server, tmp_path_factory):
    """A 2-replica app; yields (handle, model_dir, redis_url, namespace)."""
    model_dir = make_tiny_model_dir("llama", tmp_path_factory.mktemp("grpc-llama"))
    namespace = f"grpc-{uuid.uuid4().hex[:6]}"
    with serve_app(APP, model_dir, redis_server.url, namespace, block_size=4, num_kv_blocks=200) as handle:
        yield handle, model_dir, redis_server.url, namespace


def serve_grpc(cluster, body, **backend_kwargs):
    """Runs ``await body(stub, channel)`` against a fresh RouterServer."""
    handle, model_dir, redis_url, namespace = cluster
    max_len = json.loads((model_dir / "config.json").read_text())["max_position_embeddings"]

    async def main():
        backend = RouterBackend(handle, RouterTokenizer.from_model_dir(model_dir), ModelInfo("tiny", max_len),
                                **backend_kwargs)
        server = RouterServer(backend, Directory.from_url(redis_url, namespace), port=0)
        port = await server.start()
        assert port > 0 and server.address == f"127.0.0.1:{port}"
        try:
            async with grpc.aio.insecure_channel(server.address) as channel:
                return await body(pb_grpc.GenerationStub(channel), channel)
        finally:
            await server.stop(grace=1.0)

    return asyncio.run(main())


async def collect(stub, request, timeout=30.0):
    return [chunk async for chunk in stub.Generate(request, timeout=timeout)]


def ids_request(ids, max_tokens=2, **sampling):
    return pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=ids),
                              sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, **sampling))


def test_streams_text_and_routes_a_repeated_prefix_to_its_replica(cluster):
    async def body(stub, channel):
        request = pb.GenerateRequest(prompt="hello world",
                                     sampling=pb.SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
        chunks = await collect(stub, request)
        last = chunks[-1]
        assert last.finish_reason == "length"
        assert all(c.replica_id == last.replica_id != "" for c in chunks)
        assert all(c.finish_reason == "" for c in chunks[:-1])
        assert sum(len(c.token_ids) for c in chunks) == 5 == last.usage.completion_tokens
        assert last.usage.prompt_tokens > 0
        assert "".join(c.text for c in chunks)  # text deltas are streamed

        async def send(ids):
            last = (await collect(stub, ids_request(ids)))[-1]
            return last.replica_id, last.usage.cached_prompt_tokens

        # Concurrent requests with different prefixes each reach their holder
        # (routing on load alone would not: tests/integration/test_prefix_routing.py).
        assert_all_hit(await burst_reaches_holders(send, distinct_prefixes(3, 120, salt=3)), 120)

    serve_grpc(cluster, body)


def test_n_choices_stream_with_their_index_logprobs_and_prompt_logprobs(cluster):
    prompt = list(range(30, 51))

    async def body(stub, channel):
        request = ids_request(prompt, max_tokens=6, n=3, seed=11, logprobs=1, prompt_logprobs=0, ignore_eos=True)
        request.sampling.temperature = 1.0
        chunks = await collect(stub, request)
        tokens: dict[int, list[int]] = {}
        for chunk in chunks:
            tokens.setdefault(chunk.index, []).extend(chunk.token_ids)
            assert len(chunk.logprobs) == len(chunk.token_ids)
        assert sorted(tokens) == [0, 1, 2] and all(len(t) == 6 for t in tokens.values())
        ends = [c for c in chunks if c.finish_reason]
        assert sorted(c.index for c in ends) == [0, 1, 2] and all(c.usage.completion_tokens == 6 for c in ends)
        assert len([c for c in chunks if c.prompt_logprobs]) == 1
        assert len(next(c for c in chunks if c.prompt_logprobs).prompt_logprobs) == len(prompt) - 1
        for i in range(3):  # choice i is the single request with seed + i
            single = ids_request(prompt, max_tokens=6, seed=11 + i, ignore_eos=True)
            single.sampling.temperature = 1.0
            assert [t for c in await collect(stub, single) for t in c.token_ids] == tokens[i]

    serve_grpc(cluster, body)


def test_bad_inputs_get_invalid_argument_naming_the_field(cluster):
    cases = [
        (pb.GenerateRequest(prompt=""), "prompt"),
        (pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(top_p=0.0)), "sampling.top_p"),
        (ids_request([1, 10**6]), "prompt_token_ids.ids[1]"),
        (pb.GenerateRequest(), "prompt, prompt_token_ids or messages"),
        (ids_request([1, 2], n=17), "sampling.n = 17 exceeds this server's max_n of 16"),
        (ids_request([1, 2], logit_bias={3: -200.0}), "sampling.logit_bias[3]"),
    ]

    async def body(stub, channel):
        for request, field in cases:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await collect(stub, request)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
            assert field in info.value.details()
        # The server survives them all.
        assert (await collect(stub, ids_request([1, 2, 3])))[-1].finish_reason

    serve_grpc(cluster, body)


def wait_for_zero_used_blocks(redis_url, namespace, replica_id, timeout=30.0):
    """Polls ``replica_id``'s heartbeat stats in the directory (a Serve call
    cannot pick its replica) until it reports no used block and nothing running."""

    async def poll():
        directory = Directory.from_url(redis_url, namespace)
        try:
            deadline = time.monotonic() + timeout
            stats = {}
            while time.monotonic() < deadline:
                stats = (await directory.replica_stats()).get(replica_id, {})
                if stats and stats["kv_cache_usage"] == 0.0 and stats["num_running"] == 0:
                    return stats
                await asyncio.sleep(0.2)
            raise AssertionError(f"replica {replica_id} still holds blocks: {stats}")
        finally:
            await directory.aclose()

    return asyncio.run(poll())


def test_cancelled_stream_and_deadline_free_the_replicas_blocks(cluster):
    async def body(stub, channel):
        served = []
        call = stub.Generate(ids_request(list(range(300, 340)), max_tokens=400, ignore_eos=True), timeout=60)
        async for chunk in call:
            served.append(chunk)
            if len(served) == 2:
                call.cancel()
                break
        assert served[-1].finish_reason == ""  # stopped mid-stream
        # 460 tokens take this tiny model well over 0.1 s even on a fast machine (at 0.5 s they no longer did)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(stub, ids_request(list(range(340, 380)), max_tokens=460, ignore_eos=True), timeout=0.1)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        return served[-1].replica_id

    replica_id = serve_grpc(cluster, body)
    wait_for_zero_used_blocks(cluster[2], cluster[3], replica_id)


def test_both_replica_transports_stream_the_same_tokens(cluster):
    prompt = list(range(400, 437))
    seen = {}
    for kwargs in ({}, {"replica_transport": "actor", "same_loop": False}):
        async def body(stub, channel):
            return await collect(stub, ids_request(prompt, max_tokens=12, ignore_eos=True))

        chunks = serve_grpc(cluster, body, **kwargs)
        assert chunks[-1].finish_reason == "length"
        seen[kwargs.get("replica_transport", "grpc")] = [t for c in chunks for t in c.token_ids]
    assert len(seen["grpc"]) == 12 and seen["grpc"] == seen["actor"]


def test_the_default_backend_streams_over_grpc_from_a_handle_on_its_own_loop(cluster):
    handle, model_dir, _, _ = cluster

    async def main():
        backend = RouterBackend(handle, RouterTokenizer.from_model_dir(model_dir), ModelInfo("tiny", 512))
        chunks = [c async for c in backend.stream(GenerationRequest(
            "t-own-loop", list(range(300, 320)), SamplingParams(max_tokens=2, temperature=0.0)))]
        return backend._generate, chunks

    generate, chunks = asyncio.run(main())
    assert chunks[-1].finish_reason is not None
    assert generate is not handle and not generate.handle_options._by_reference  # Serve's gRPC channel
    assert not generate.init_options._run_router_in_separate_loop  # the front ends' loop, not Serve's thread


def test_health_reflection_and_list_replicas(cluster):
    async def body(stub, channel):
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "prefixserve.v1.Generation"):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING

        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = reflect.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = [s.name async for r in replies for s in r.list_services_response.service]
        assert "prefixserve.v1.Generation" in names and "grpc.health.v1.Health" in names

        await collect(stub, ids_request(list(range(20, 30))))  # two full blocks cached somewhere
        deadline = time.monotonic() + 10
        while True:  # stats arrive with the next heartbeat (every second)
            replicas = (await stub.ListReplicas(pb.ListReplicasRequest(), timeout=5)).replicas
            if len(replicas) == 2 and any(r.num_cached_blocks for r in replicas) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.3)
        assert len({r.replica_id for r in replicas}) == 2
        assert all(r.replica_id for r in replicas)
        assert any(r.num_cached_blocks > 0 for r in replicas)
        assert all(0.0 <= r.kv_cache_usage <= 1.0 for r in replicas)
        assert all(r.num_swapped == 0 and 0.0 <= r.prefix_cache_hit_rate <= 1.0 for r in replicas)

    serve_grpc(cluster, body)
