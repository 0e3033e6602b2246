"""Fault injection on constrained streams: a replica of the default model is
SIGKILLed while greedy JSON-schema streams run on it; each stream continues
on the other replica (``router/migration.py``), which replays the streamed
tokens into a fresh grammar state (``num_resumed_output_tokens``), so the
client gets exactly the undisturbed run's tokens and text, and they validate.

Without the replay the new replica's grammar would start at the schema's
root in the middle of an object: the continuation could not match the
undisturbed text, and the whole would not be valid JSON.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import uuid
from collections import Counter

import grpc
import jsonschema
import pytest

from cluster.app import build_app, model_info
from cluster.launch.local import stats_of_every_replica
from cluster.shared.config import ClusterConfig, EngineConfig
from cluster.shared.directory import Directory
from router.backend import ModelInfo, RouterBackend
from router.pb import generation_pb2 as pb
from router.pb import generation_pb2_grpc as pb_grpc
from router.server import RouterServer
from router.tokenizer import RouterTokenizer

APP = "structured-migration"
NUM_STREAMS = 8
MAX_TOKENS = 400  # the schema's longest instance is well under this: every stream ends with stop
MIN_TOKENS_BEFORE_KILL = 24  # past the jump-forward opening and the first name: inside the structure

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 24},
                   "age": {"type": "integer", "minimum": 0, "maximum": 130},
                   "city": {"type": "string", "maxLength": 24},
                   "job": {"type": "string", "enum": ["engineer", "teacher", "doctor", "artist", "other"]}},
    "required": ["name", "age", "city", "job"], "additionalProperties": False,
}
# Four people: long enough (~100+ tokens) that every stream is mid-structure at the kill.
SCHEMA = {"type": "object", "properties": {"people": {"type": "array", "items": PERSON, "minItems": 4,
                                                      "maxItems": 4}},
          "required": ["people"], "additionalProperties": False}
TOWNS = ["Lisbon", "Quito", "Hanoi", "Perth", "Tunis", "Bergen", "Cusco", "Gdansk"]


@pytest.fixture(scope="module")
def cluster(ray_local, redis_server):
    """Two replicas of the default model behind least-load routing (the streams spread over both)."""
    from ray import serve

    namespace = f"som-{uuid.uuid4().hex[:6]}"
    engine = EngineConfig.from_kwargs(block_size=16, max_model_len=1024, num_kv_blocks=384, max_num_seqs=8)
    config = ClusterConfig(replicas=2, redis_url=redis_server.url, namespace=namespace, engine=engine,
                           replica_num_cpus=0.25, routing_policy="least_load")
    model_dir, name, max_len = model_info(config)
    serve.start(proxy_location="Disabled")
    handle = serve.run(build_app(config), name=APP, route_prefix=None)
    try:
        yield handle, model_dir, name, max_len, redis_server.url, namespace
    finally:
        serve.delete(APP)


def request(town: str) -> pb.GenerateRequest:
    prompt = f"Invent four people who live in {town} and list them as JSON."
    return pb.GenerateRequest(
        messages=pb.ChatMessages(items=[pb.ChatMessage(role="user", content=prompt)]),
        sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, structured_outputs=pb.StructuredOutputs(
            json_schema=json.dumps(SCHEMA))))


def test_killing_a_replica_mid_constrained_stream_keeps_the_greedy_valid_output(cluster):
    handle, model_dir, name, max_len, redis_url, namespace = cluster
    pids = {rid: stats["pid"] for rid, stats in stats_of_every_replica(handle, 2).items()}

    async def main():
        backend = RouterBackend(handle, RouterTokenizer.from_model_dir(model_dir), ModelInfo(name, max_len))
        server = RouterServer(backend, Directory.from_url(redis_url, namespace), port=0)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(server.address) as channel:
                stub = pb_grpc.GenerationStub(channel)

                async def run(town, progress=None, index=0):
                    tokens, replicas, finishes, text = [], [], [], []
                    async for chunk in stub.Generate(request(town), timeout=300):
                        tokens.extend(chunk.token_ids)
                        replicas.append(chunk.replica_id)
                        text.append(chunk.text)
                        if chunk.finish_reason:
                            finishes.append((chunk.finish_reason, chunk.usage.completion_tokens))
                        if progress is not None:
                            progress[index] = (len(tokens), chunk.replica_id)
                    return tokens, replicas, finishes, "".join(text)

                reference = await asyncio.wait_for(asyncio.gather(*(run(t) for t in TOWNS)), 300)
                progress: dict[int, tuple[int, str]] = {}
                tasks = [asyncio.ensure_future(run(t, progress, i)) for i, t in enumerate(TOWNS)]
                deadline = time.monotonic() + 120

                async def until(done):
                    while not done():
                        assert time.monotonic() < deadline, progress
                        assert not any(t.done() for t in tasks), "a stream ended before the fault"
                        await asyncio.sleep(0.01)

                await until(lambda: len(progress) == NUM_STREAMS)
                # The replica with the most streams; of two as busy, the one behind (on two
                # cores one replica often runs ahead), so that the kill lands early.
                on = Counter(replica for _, replica in progress.values())
                behind = {r: sum(n for n, rr in progress.values() if rr == r) for r in on}
                victim = max(on, key=lambda r: (on[r], -behind[r]))
                count = on[victim]
                mine = [t for i, t in enumerate(tasks) if progress[i][1] == victim]
                while min(n for n, r in progress.values() if r == victim) < MIN_TOKENS_BEFORE_KILL:
                    assert time.monotonic() < deadline, progress
                    assert not any(t.done() for t in mine), f"a stream of {victim} ended before the fault"
                    await asyncio.sleep(0.01)
                streamed = {i: n for i, (n, replica) in progress.items() if replica == victim}
                os.kill(pids[victim], signal.SIGKILL)
                results = await asyncio.wait_for(asyncio.gather(*tasks), 300)
                return reference, results, victim, count, streamed
        finally:
            await server.stop(1.0)

    reference, results, victim, count, streamed = asyncio.run(main())
    assert len(TOWNS) == NUM_STREAMS and count >= NUM_STREAMS // 2  # the victim ran at least half
    migrated = 0
    for i, ((ref_tokens, _, ref_finish, ref_text), (tokens, replicas, finishes, text)) in enumerate(
            zip(reference, results)):
        assert ref_finish == [("stop", len(ref_tokens))], ref_finish  # the grammar ended it, not max_tokens
        jsonschema.validate(json.loads(ref_text), SCHEMA)
        assert tokens == ref_tokens, (i, text, ref_text)
        assert text == ref_text
        assert finishes == ref_finish  # one finish, usage of the whole request
        if replicas[0] == victim:
            assert replicas[-1] != victim
            assert streamed[i] < len(tokens)  # it died mid-stream, inside the JSON
            migrated += 1
    assert migrated == count
