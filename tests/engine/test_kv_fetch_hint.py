"""The replica's side of a routed KV fetch (workers/kv_transfer_endpoints.py):
a request whose ``kv_fetch_from`` names a holder for this replica is served
after fetching its prefix from that holder (reached through ``holder_of``),
inside ``generate``; without a hint for this replica, or with no way to reach
the holder, it prefills. Two real replicas in one process (Serve's wiring:
tests/integration/test_kv_transfer_serve.py)."""

from __future__ import annotations

import asyncio
import random

import pytest

from cluster.shared.types import GenerationRequest, SamplingParams
from tests.factories import make_tiny_model_dir
from workers.kv_transfer import LocalHolder
from workers.replica import ReplicaServer

BS = 4


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    model_dir = make_tiny_model_dir("llama", tmp_path_factory.mktemp("kv-hint-llama"))
    config = {"model": str(model_dir), "block_size": BS, "num_kv_blocks": 64}
    holder = ReplicaServer(config, replica_id="holder")
    receiver = ReplicaServer(config, replica_id="receiver")
    asked: list[str] = []

    def holder_of(holder_id: str):
        asked.append(holder_id)
        return LocalHolder(holder.kv_transfer) if holder_id == "holder" else None

    receiver.holder_of = holder_of
    yield holder, receiver, asked
    holder.shutdown()
    receiver.shutdown()


async def run(replica: ReplicaServer, request_id: str, prompt: list[int], hints=None):
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=2)
    request = GenerationRequest(request_id, prompt, params, kv_fetch_from=dict(hints or {}))
    tokens, logprobs, cached = [], [], None
    async for chunk in replica.generate(request):
        tokens += chunk.token_ids
        logprobs += [(lp.token_id, lp.logprob) for lp in chunk.logprobs or []]
        cached = chunk.cached_prompt_tokens
    return tokens, logprobs, cached


def prompt_of(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(27)]  # 6 full blocks can hit


def test_a_hinted_request_is_served_from_the_fetched_prefix(pair):
    holder, receiver, asked = pair

    async def main():
        prompt = prompt_of(1)
        await run(holder, "cold", prompt)
        local_hit = await run(holder, "hit", prompt)
        fetched = await run(receiver, "fetched", prompt, {"receiver": "holder"})
        assert local_hit[2] == 24 and fetched == local_hit  # tokens, logprobs, 24 cached tokens
        assert asked[-1] == "holder"
        assert receiver.kv_transfer.metrics.value("kv_transfer_prefix_tokens_total") == 24

    asyncio.run(main())


def test_a_hint_for_another_replica_or_an_unreachable_holder_prefills(pair):
    holder, receiver, asked = pair

    async def main():
        prompt = prompt_of(2)
        await run(holder, "cold2", prompt)
        num_asked = len(asked)
        other = await run(receiver, "other", prompt, {"someone-else": "holder"})
        assert other[2] == 0 and len(asked) == num_asked  # not this replica's hint: nobody asked
        before = receiver.kv_transfer.metrics.value("kv_transfer_fallbacks_total", reason="unreachable")
        prompt = prompt_of(3)
        await run(holder, "cold3", prompt)
        gone = await run(receiver, "gone", prompt, {"receiver": "left"})
        assert gone[2] == 0 and len(gone[0]) == 5 and asked[-1] == "left"
        assert receiver.kv_transfer.metrics.value("kv_transfer_fallbacks_total", reason="unreachable") == before + 1

    asyncio.run(main())


def test_the_routing_stats_carry_the_kv_bytes_per_token(pair):
    _, receiver, _ = pair
    stats = receiver.record_routing_stats()
    layout = receiver.kv_transfer.layout
    assert stats["kv_bytes_per_token"] == layout.block_bytes // BS > 0
