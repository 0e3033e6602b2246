"""Fault injection: a replica process is SIGKILLed while many streams run on
it; every stream continues on the other replica (``router/migration.py``)
and ends with exactly the tokens of an undisturbed greedy run."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from collections import Counter

import grpc
import pytest

from cluster.shared.directory import Directory
from cluster.launch.local import stats_of_every_replica
from router.backend import ModelInfo, RouterBackend
from router.pb import generation_pb2 as pb
from router.pb import generation_pb2_grpc as pb_grpc
from router.server import RouterServer
from router.tokenizer import RouterTokenizer
from tests.factories import make_tiny_model_dir
from tests.integration.router_cluster import serve_app

APP = "migration"
NUM_STREAMS = 16
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def cluster(ray_local, redis_server, tmp_path_factory):
    model_dir = make_tiny_model_dir("llama", tmp_path_factory.mktemp("migration"))
    namespace = f"mig-{uuid.uuid4().hex[:6]}"
    with serve_app(APP, model_dir, redis_server.url, namespace, routing_policy="least_load", block_size=4,
                   num_kv_blocks=1200) as handle:
        yield handle, model_dir, redis_server.url, namespace


def replica_pids(handle, want: int = 2) -> dict[str, int]:
    """replica_id -> pid of the live replicas."""
    return {rid: stats["pid"] for rid, stats in stats_of_every_replica(handle, want).items()}


def prompts() -> list[list[int]]:
    return [[7 + i, 11, 13 + 2 * i, 17, 19, 23 + i] for i in range(NUM_STREAMS)]


def request(ids: list[int]) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))


def test_killing_a_replica_mid_stream_loses_no_token(cluster):
    handle, model_dir, redis_url, namespace = cluster
    import json

    max_len = json.loads((model_dir / "config.json").read_text())["max_position_embeddings"]
    pids = replica_pids(handle)

    async def main():
        backend = RouterBackend(handle, RouterTokenizer.from_model_dir(model_dir), ModelInfo("tiny", max_len))
        server = RouterServer(backend, Directory.from_url(redis_url, namespace), port=0)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(server.address) as channel:
                stub = pb_grpc.GenerationStub(channel)

                async def run(ids, progress=None, index=0):
                    tokens, replicas, finishes, text = [], [], [], []
                    async for chunk in stub.Generate(request(ids), timeout=300):
                        tokens.extend(chunk.token_ids)
                        replicas.append(chunk.replica_id)
                        text.append(chunk.text)
                        if chunk.finish_reason:
                            finishes.append((chunk.finish_reason, chunk.usage.completion_tokens,
                                             chunk.usage.prompt_tokens))
                        if progress is not None:
                            progress[index] = (len(tokens), chunk.replica_id)
                    return tokens, replicas, finishes, "".join(text)

                reference = await asyncio.wait_for(asyncio.gather(*(run(p) for p in prompts())), 300)
                progress: dict[int, tuple[int, str]] = {}
                tasks = [asyncio.ensure_future(run(p, progress, i)) for i, p in enumerate(prompts())]
                deadline = time.monotonic() + 120
                while len(progress) < NUM_STREAMS or min(n for n, _ in progress.values()) < 3:
                    assert time.monotonic() < deadline, progress
                    assert not any(t.done() for t in tasks), "a stream ended before the fault"
                    await asyncio.sleep(0.01)
                on = Counter(replica for _, replica in progress.values())
                victim, count = on.most_common(1)[0]
                streamed = sum(n for n, _ in progress.values())
                os.kill(pids[victim], signal.SIGKILL)
                results = await asyncio.wait_for(asyncio.gather(*tasks), 300)
                return reference, results, victim, count, streamed
        finally:
            await server.stop(1.0)

    reference, results, victim, count, streamed = asyncio.run(main())
    assert count >= NUM_STREAMS // 2  # the victim ran at least half of the streams
    assert streamed < NUM_STREAMS * MAX_TOKENS  # it died mid-stream
    migrated = 0
    for (ref_tokens, _, ref_finish, ref_text), (tokens, replicas, finishes, text) in zip(reference, results):
        assert tokens == ref_tokens and len(tokens) == MAX_TOKENS
        assert text == ref_text
        assert finishes == ref_finish and finishes[0][0] == "length"  # one finish, usage of the whole request
        if replicas[0] == victim:
            assert replicas[-1] != victim
            migrated += 1
    assert migrated == count
