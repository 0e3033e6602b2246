"""KV transfer across real Ray: two replicas as Ray actors, the receiver
fetching from the holder through the holder's actor handle (the bytes cross
Ray's object store), the imported blocks announced to the real Redis
directory; a holder killed mid-transfer costs a prefill, never a request."""

from __future__ import annotations

import asyncio
import random
import time
import uuid

import pytest

from cluster.shared.directory import Directory
from cluster.shared.hashing import hash_block_chain, root_hash
from cluster.shared.types import GenerationRequest, SamplingParams
from tests.factories import make_tiny_model_dir
from workers.model.loader import model_fingerprint
from workers.replica import ReplicaServer

BLOCK = 4


def checked_replica() -> type:
    """The replica with what these tests read of its insides (defined here, in a
    function: Ray pickles a local class by value, a test module is not importable on its workers)."""

    class CheckedReplica(ReplicaServer):
        """The replica with what this test reads of its insides, on its engine thread."""

        async def check_integrity(self) -> dict:
            def check(engine) -> dict:
                self.kv_transfer.ledger.check_integrity(list(engine.scheduler.queue))
                pool = engine.scheduler.kv_manager.device_pool
                return {"used": pool.num_used_blocks, "held": self.kv_transfer.ledger.num_held_blocks}

            return await self._front.call(check)

        async def run(self, request: GenerationRequest, holder=None) -> dict:
            """The whole stream of ``generate`` (or ``fetch_and_generate``) as one answer."""
            stream = self.generate(request) if holder is None else self.fetch_and_generate(request, holder)
            tokens, logprobs, cached = [], [], None
            async for chunk in stream:
                tokens += chunk.token_ids
                logprobs += chunk.logprobs or []
                cached = chunk.cached_prompt_tokens
            return {"tokens": tokens, "logprobs": logprobs, "cached": cached}

    return CheckedReplica


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir("llama", tmp_path_factory.mktemp("kv-ray-llama"))


@pytest.fixture(scope="module")
def replicas(ray_local, redis_server, model_dir):
    import ray

    namespace = f"kv-{uuid.uuid4().hex[:6]}"
    actor = ray.remote(num_cpus=0.5)(checked_replica())
    config = {"model": str(model_dir), "block_size": BLOCK, "num_kv_blocks": 64}
    holder = actor.remote(config, redis_server.url, namespace, replica_id="kv-holder")
    receiver = actor.remote(config, redis_server.url, namespace, replica_id="kv-receiver")
    ray.get([holder.check_integrity.remote(), receiver.check_integrity.remote()])
    yield holder, receiver, redis_server.url, namespace
    for handle in (holder, receiver):
        ray.kill(handle)


def request(request_id: str, prompt: list[int]) -> GenerationRequest:
    return GenerationRequest(request_id, prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                                                logprobs=2))


def lookup(url: str, namespace: str, chain: list[bytes]) -> dict[str, int]:
    async def run():
        directory = Directory.from_url(url, namespace)
        try:
            return await directory.lookup(chain)
        finally:
            await directory.aclose()

    return asyncio.run(run())


def test_fetched_over_ray_matches_a_local_hit_and_is_announced(replicas, model_dir):
    import ray

    holder, receiver, url, namespace = replicas
    rng = random.Random(7)
    prompt = [rng.randrange(3, 500) for _ in range(27)]  # 6 full blocks can hit
    cold = ray.get(holder.run.remote(request("h-cold", prompt)))
    local_hit = ray.get(holder.run.remote(request("h-hit", prompt)))
    assert local_hit["cached"] == 24 and cold["cached"] == 0
    got = ray.get(receiver.fetch_prefix.remote(holder, prompt))
    assert got == 24
    chain = hash_block_chain(prompt, BLOCK, root_hash(model_fingerprint(model_dir)))
    deadline = time.monotonic() + 20
    while lookup(url, namespace, chain[:6]).get("kv-receiver") != 6 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert lookup(url, namespace, chain[:6]).get("kv-receiver") == 6  # announced by the usual KV events
    fetched = ray.get(receiver.run.remote(request("r-fetched", prompt)))
    assert fetched == local_hit  # tokens, logprobs, 24 cached tokens
    assert fetched["tokens"] == cold["tokens"]
    text = ray.get(receiver.metrics_text.remote()).decode()
    assert 'prefixserve:kv_transfer_blocks_total{direction="in",model=' in text
    assert _sample(text, "prefixserve:kv_transfer_blocks_total", 'direction="in"') == 6
    assert _sample(text, "prefixserve:kv_transfer_prefix_tokens_total") == 24
    assert _sample(text, "prefixserve:kv_transfer_seconds_count") == 1
    assert _sample(ray.get(holder.metrics_text.remote()).decode(), "prefixserve:kv_transfer_bytes_total",
                   'direction="out"') > 0
    for handle in (holder, receiver):
        assert ray.get(handle.check_integrity.remote()) == {"used": 0, "held": 0}


def stalling_replica() -> type:
    """A holder that pins what it is asked for, then never answers: killed mid-transfer by the test."""
    base = checked_replica()

    class StallingReplica(base):  # type: ignore[misc, valid-type]
        exporting = False

        async def export_kv(self, block_hashes):
            held = await self._front.call(lambda engine: self.kv_transfer.ledger.pin_prefix(list(block_hashes)))
            assert held is not None
            StallingReplica.exporting = True
            await asyncio.sleep(3600)

        def is_exporting(self) -> bool:
            return StallingReplica.exporting

    return StallingReplica


def test_a_holder_killed_mid_transfer_costs_a_prefill_not_a_request(replicas, model_dir):
    import ray

    _, receiver, url, namespace = replicas
    doomed = ray.remote(num_cpus=0.25)(stalling_replica()).remote(
        {"model": str(model_dir), "block_size": BLOCK, "num_kv_blocks": 64}, url, namespace, replica_id="kv-doomed")
    rng = random.Random(8)
    prompt, other = [rng.randrange(3, 500) for _ in range(27)], [rng.randrange(3, 500) for _ in range(19)]
    expected = ray.get(doomed.run.remote(request("d-1", prompt)))
    fetching = receiver.run.remote(request("d-2", prompt), doomed)  # fetch_and_generate: asks the doomed holder
    deadline = time.monotonic() + 30
    while not ray.get(doomed.is_exporting.remote()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ray.get(doomed.is_exporting.remote()), "the holder never began the export"
    alongside = receiver.run.remote(request("d-3", other))  # served while the fetch waits
    ray.kill(doomed)  # mid-transfer: its blocks pinned, the receiver awaiting its answer
    got, beside = ray.get([fetching, alongside], timeout=60)
    assert got["tokens"] == expected["tokens"] and got["cached"] == 0  # prefilled, same tokens
    assert len(beside["tokens"]) == 6
    text = ray.get(receiver.metrics_text.remote()).decode()
    assert _sample(text, "prefixserve:kv_transfer_fallbacks_total", 'reason="error"') == 1
    assert ray.get(receiver.check_integrity.remote()) == {"used": 0, "held": 0}


def _sample(text: str, name: str, label: str = "") -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and label in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no sample {name} {label} in the metrics text")
