"""KV transfer between tensor-parallel engines over real Ray: each rank of
the holder copies its heads' shard into the object store, the receiver's rank
i writes rank i's (rank to rank); the receiver's outputs equal the holder's
local hit. Engines of another tensor_parallel_size are refused."""

from __future__ import annotations

import asyncio
import random

import pytest

from cluster.shared.types import GenerationRequest, SamplingParams
from tests.factories import make_tiny_model_dir
from workers.engine.async_engine import AsyncEngine
from workers.kv_transfer import KVTransfer, LocalHolder
from workers.llm import LLM

pytestmark = pytest.mark.usefixtures("ray_local")
BS = 4


class Side:
    def __init__(self, model_dir, tp: int) -> None:
        self.llm = LLM(str(model_dir), block_size=BS, num_kv_blocks=64, tensor_parallel_size=tp)
        self.front = AsyncEngine(self.llm.engine)
        self.front.start()
        self.transfer = KVTransfer(self.front, self.llm.runner)

    @property
    def pool(self):
        return self.llm.engine.scheduler.kv_manager.device_pool

    async def run(self, request_id: str, prompt: list[int]):
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
        tokens, logprobs, cached = [], [], None
        async for out in self.front.generate(GenerationRequest(request_id, prompt, params)):
            tokens += out.new_token_ids
            logprobs += out.new_logprobs or []
            cached = out.num_cached_tokens
        return tokens, logprobs, cached

    def close(self) -> None:
        self.front.shutdown()
        self.llm.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir("llama", tmp_path_factory.mktemp("kv-tp-llama"))


def test_tensor_parallel_replicas_transfer_rank_to_rank(model_dir):
    holder, receiver = Side(model_dir, 2), Side(model_dir, 2)
    try:
        assert holder.transfer.num_ranks == 2 and holder.transfer.layout.num_kv_heads == 1  # 2 KV heads / 2 ranks
        rng = random.Random(3)
        prompt = [rng.randrange(3, 500) for _ in range(27)]

        async def main():
            cold = await holder.run("c", prompt)
            local_hit = await holder.run("h", prompt)
            assert local_hit[2] == 24
            assert await receiver.transfer.fetch(LocalHolder(holder.transfer), prompt) == 24
            hashes, _ = receiver.transfer.prefix_hashes(prompt)
            assert all(receiver.pool.get_cached_block(h) is not None for h in hashes)
            fetched = await receiver.run("f", prompt)
            assert fetched == local_hit and fetched[0] == cold[0]
            assert receiver.transfer.metrics.value("kv_transfer_bytes_total", direction="in") == \
                6 * 2 * holder.transfer.layout.block_bytes
            for side in (holder, receiver):
                await asyncio.sleep(0.05)  # the holder's release is posted
                await side.front.call(lambda e, s=side: s.transfer.ledger.check_integrity(list(e.scheduler.queue)))
                assert side.pool.num_used_blocks == 0

        asyncio.run(main())
        single = Side(model_dir, 1)
        try:
            async def refused():
                assert await single.transfer.fetch(LocalHolder(holder.transfer), prompt) == 0
                assert single.transfer.metrics.value("kv_transfer_fallbacks_total", reason="mismatch") == 1

            asyncio.run(refused())
        finally:
            single.close()
    finally:
        holder.close()
        receiver.close()


def test_tensor_parallel_warm_start_and_hand_over_move_rank_to_rank(model_dir):
    """A joining TP replica's warm start pulls the holder's blocks rank to rank, and a
    stopping TP replica's hand-over pushes them: each receiver then serves the prompt
    as a local hit (tokens and logprobs), and every pool stays consistent."""
    from tests.engine.test_kv_handover import FakeDirectory as Survivors
    from tests.engine.test_kv_handover import LocalReceiver
    from tests.engine.test_kv_warm_start import FakeDirectory as Holders
    from workers.kv_handover import hand_over
    from workers.kv_warm_start import warm_start

    holder, joining, survivor = Side(model_dir, 2), Side(model_dir, 2), Side(model_dir, 2)
    try:
        rng = random.Random(8)
        prompt = [rng.randrange(3, 500) for _ in range(27)]

        async def main():
            cold = await holder.run("c", prompt)
            local_hit = await holder.run("h", prompt)
            held = set(holder.pool.cached_block_hashes())
            assert local_hit[2] == 24 and len(held) >= 6
            warmed = await warm_start(joining.transfer, Holders({"h": held}), lambda rid: LocalHolder(holder.transfer),
                                      "me", "", 10**9, 30.0)
            assert warmed.outcome == "warmed" and warmed.blocks == len(held), warmed
            handed = await hand_over(holder.transfer, Survivors({"s": 0.0}), lambda rid: LocalReceiver(survivor),
                                     "me", "", 10**9, 30.0)
            assert handed.outcome == "handed_over" and handed.blocks == len(held), handed
            for side in (joining, survivor):
                got = await side.run(f"after-{id(side)}", prompt)
                assert got == local_hit and got[0] == cold[0]  # 24 cached tokens, the local hit's logprobs
            for side in (holder, joining, survivor):
                await asyncio.sleep(0.05)  # the holder's release is posted
                await side.front.call(lambda e, s=side: s.transfer.ledger.check_integrity(list(e.scheduler.queue)))
                assert side.pool.num_used_blocks == 0

        asyncio.run(main())
    finally:
        for side in (holder, joining, survivor):
            side.close()
