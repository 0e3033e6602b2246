"""Admission control on a real cluster: one tiny-model replica on Ray Serve
with a small waiting queue (``max_num_seqs 2 + max_waiting_requests 2``),
flooded through a real gRPC ``RouterServer``. The excess gets
RESOURCE_EXHAUSTED with a ``retry-after-ms`` hint at once; every admitted
request completes; no KV block is left in use. Also: the prefix directory
through a Redis that requires a password, over plaintext and TLS
(``rediss://``)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import grpc
import pytest

from router.backend import ModelInfo, RouterBackend
from router.pb import generation_pb2 as pb
from router.pb import generation_pb2_grpc as pb_grpc
from router.server import RETRY_AFTER_KEY, RouterServer
from router.tokenizer import RouterTokenizer
from tests.factories import make_test_certs, make_tiny_model_dir
from tests.integration.router_cluster import serve_app

APP = "admission"
NUM_REQUESTS = 16
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def flooded_cluster(ray_local, redis_server, tmp_path_factory):
    """A 1-replica app with admission bound 2 + 2; yields (handle, model_dir)."""
    model_dir = make_tiny_model_dir("llama", tmp_path_factory.mktemp("admission-llama"))
    with serve_app(APP, model_dir, redis_server.url, f"adm-{uuid.uuid4().hex[:6]}", replicas=1,
                   routing_policy="least_load", block_size=4, num_kv_blocks=128, max_num_seqs=2,
                   max_num_batched_tokens=64, max_waiting_requests=2) as handle:
        yield handle, model_dir


async def _one(stub, i: int):
    """('ok', tokens) or ('overloaded', retry-after-ms) or ('error', code, details)."""
    request = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[10 + i, 11, 12, 13, 14]),
                                 sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    try:
        chunks = [c async for c in stub.Generate(request, timeout=300)]
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return "overloaded", dict(exc.trailing_metadata() or ()).get(RETRY_AFTER_KEY), exc.details()
        return "error", exc.code(), exc.details()
    return "ok", sum(len(c.token_ids) for c in chunks), chunks[-1].finish_reason


def test_flood_past_the_queue_bound(flooded_cluster):
    handle, model_dir = flooded_cluster
    max_len = json.loads((model_dir / "config.json").read_text())["max_position_embeddings"]

    async def main():
        backend = RouterBackend(handle, RouterTokenizer.from_model_dir(model_dir), ModelInfo("tiny", max_len))
        server = RouterServer(backend, port=0)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(server.address) as channel:
                stub = pb_grpc.GenerationStub(channel)
                return await asyncio.gather(*(_one(stub, i) for i in range(NUM_REQUESTS)))
        finally:
            await server.stop(grace=1.0)

    results = asyncio.run(main())
    errors = [r for r in results if r[0] == "error"]
    overloaded = [r for r in results if r[0] == "overloaded"]
    done = [r for r in results if r[0] == "ok"]
    assert not errors, errors
    assert overloaded, f"no request was refused: {results}"
    assert len(done) >= 4, results  # at least max_num_seqs + max_waiting_requests were admitted
    assert all(r[1:] == (MAX_TOKENS, "length") for r in done), done
    for _, retry_ms, details in overloaded:
        assert retry_ms is not None and int(retry_ms) > 0
        assert "max_waiting_requests 2" in details
    # Every block is back: poll the replica (its last aborts/finishes may still be landing).
    deadline = time.monotonic() + 60
    while True:
        stats = handle.stats.remote().result(timeout_s=30)
        if stats["num_used_blocks"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert stats["num_used_blocks"] == 0, stats
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0, stats


# ------------------------------------------------------------------- Redis
def _directory_roundtrip(url: str) -> dict:
    from cluster.shared.directory import Directory

    async def main():
        directory = Directory.from_url(url, f"auth-{uuid.uuid4().hex[:6]}")
        try:
            epoch = await directory.register("r-auth")
            await directory.heartbeat("r-auth", epoch, {"num_running": 3})
            return await directory.replica_stats()
        finally:
            await directory.aclose()

    return asyncio.run(main())


def test_directory_through_a_password_protected_redis_over_plaintext_and_tls(tmp_path):
    from cluster.launch.redis_server import RedisServer, find_free_port

    certs = make_test_certs(tmp_path)
    tls_port = find_free_port("127.0.0.1")
    tls_args = ["--tls-port", str(tls_port), "--tls-cert-file", certs["server"] + ".crt",
                "--tls-key-file", certs["server"] + ".key", "--tls-ca-cert-file", certs["ca"] + ".crt",
                "--tls-auth-clients", "no"]
    with RedisServer(password="s3cret-pw", extra_args=tls_args) as server:
        assert server.url.startswith("redis://:s3cret-pw@")
        assert _directory_roundtrip(server.url)["r-auth"]["num_running"] == 3
        rediss = f"rediss://:s3cret-pw@127.0.0.1:{tls_port}/0?ssl_ca_certs={certs['ca']}.crt"
        assert _directory_roundtrip(rediss)["r-auth"]["num_running"] == 3
        with pytest.raises(Exception, match="(?i)auth"):
            _directory_roundtrip(f"redis://127.0.0.1:{server.port}/0")  # no password
