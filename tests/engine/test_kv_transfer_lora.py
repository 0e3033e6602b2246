"""KV transfer for LoRA requests (issues 33 and 51): an adapted request's
blocks hash on its adapter's content, so the receiver computes the same
hashes once it has read the adapter, fetches the holder's blocks and gets the
tokens and logprobs of a local hit, bit for bit. Base requests never import
an adapter's blocks, and an adapter the receiver has not read falls back."""

from __future__ import annotations

import asyncio
import random

import pytest

from cluster.shared.types import GenerationRequest, LoRARequest, SamplingParams
from tests.engine.test_lora import ADAPTERS, save_adapter
from tests.factories import make_tiny_model_dir
from workers.engine.async_engine import AsyncEngine
from workers.kv_transfer import KVTransfer, LocalHolder
from workers.llm import LLM


class Side:
    def __init__(self, base: str) -> None:
        self.llm = LLM(base, enable_lora=True, max_loras=2, max_lora_rank=16, block_size=4, num_kv_blocks=64)
        self.front = AsyncEngine(self.llm.engine)
        self.front.start()
        self.transfer = KVTransfer(self.front, self.llm.runner)

    async def run(self, request_id: str, prompt: list[int], lora: LoRARequest | None):
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
        tokens, logprobs, cached = [], [], None
        async for out in self.front.generate(GenerationRequest(request_id, prompt, params, lora_request=lora)):
            tokens += out.new_token_ids
            logprobs += out.new_logprobs or []
            cached = out.num_cached_tokens
        return tokens, logprobs, cached

    async def check_idle(self) -> None:
        def check(engine) -> None:
            self.transfer.ledger.check_integrity(list(engine.scheduler.queue))
            assert not self.transfer.ledger.holdings()

        await self.front.call(check)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv-transfer-lora")
    base = make_tiny_model_dir("llama", root / "base")
    adapters = {name: save_adapter(base, root / name, *ADAPTERS[name], seed=i)
                for i, name in enumerate(("all8", "qv4"))}
    holder, receiver = Side(str(base)), Side(str(base))
    yield adapters, holder, receiver
    holder.front.shutdown()
    receiver.front.shutdown()


def test_an_adapted_prefix_fetched_gives_the_outputs_of_a_local_hit(case):
    adapters, holder, receiver = case
    lora = LoRARequest("all8", 1, str(adapters["all8"]))
    rng = random.Random(5)
    prompt = [rng.randrange(3, 500) for _ in range(27)]  # 6 full blocks can hit

    async def main():
        cold = await holder.run("cold", prompt, lora)
        local_hit = await holder.run("hit", prompt, lora)
        assert local_hit[2] == 24 and cold[2] == 0
        # The base model's hashes of this prompt: the holder holds none of them (the adapter's differ).
        assert await receiver.transfer.fetch(LocalHolder(holder.transfer), prompt) == 0
        assert receiver.transfer.metrics.value("kv_transfer_fallbacks_total", reason="not_held") >= 1
        # The receiver has not read the adapter: nothing to hash the blocks with, so nothing is fetched.
        assert await receiver.transfer.fetch(LocalHolder(holder.transfer), prompt, "", lora) == 0
        assert receiver.transfer.metrics.value("kv_transfer_fallbacks_total", reason="no_adapter") == 1
        await asyncio.to_thread(receiver.llm.engine.lora.prefetch, lora)  # as the replica does first
        assert await receiver.transfer.fetch(LocalHolder(holder.transfer), prompt, "", lora) == 24
        fetched = await receiver.run("fetched", prompt, lora)
        assert fetched == local_hit  # tokens, logprobs (exact floats), 24 cached tokens
        # Another adapter, or the base model, on the same prompt never reads those blocks.
        other = LoRARequest("qv4", 2, str(adapters["qv4"]))
        assert (await receiver.run("other", prompt, other))[2] == 0
        base = await receiver.run("base", prompt, None)
        assert base[2] == 0
        assert base[0] != fetched[0]  # the adapter changes the output: the test is about something
        await holder.check_idle()
        await receiver.check_idle()

    asyncio.run(main())
