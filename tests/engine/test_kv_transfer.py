"""KV transfer between two engines in one process (workers/kv_transfer.py):
real models, real runners, the holder reached through ``LocalHolder``
(tests/integration/test_kv_transfer_ray.py crosses Ray for real).

A request whose prefix was imported gets the tokens and logprobs of the same
request served from a local prefix hit, bit for bit; every fault makes the
fetch import nothing, and the request still completes."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

import numpy as np
import pytest

from cluster.shared.types import GenerationRequest, SamplingParams
from tests.factories import make_tiny_model_dir
from workers import kv_transfer as kv_transfer_module
from workers.engine.async_engine import AsyncEngine
from workers.kv_transfer import KVExport, KVTransfer, LocalHolder
from workers.llm import LLM

BS = 4


@dataclass
class Side:
    llm: LLM
    front: AsyncEngine
    transfer: KVTransfer

    @property
    def pool(self):
        return self.llm.engine.scheduler.kv_manager.device_pool

    def close(self) -> None:
        self.front.shutdown()


def make_side(model_dir, **engine_args) -> Side:
    llm = LLM(str(model_dir) if model_dir is not None else None, **engine_args)
    front = AsyncEngine(llm.engine)
    front.start()
    return Side(llm, front, KVTransfer(front, llm.runner))


async def run(side: Side, request_id: str, prompt: list[int], max_tokens: int = 6):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=2)
    tokens, logprobs, cached = [], [], None
    async for out in side.front.generate(GenerationRequest(request_id, prompt, params)):
        tokens += out.new_token_ids
        logprobs += out.new_logprobs or []
        cached = out.num_cached_tokens
    return tokens, logprobs, cached


async def check_idle(side: Side) -> None:
    """Every block free or cached, the ledger empty, the pool consistent (engine thread)."""
    def check(engine) -> None:
        side.transfer.ledger.check_integrity(list(engine.scheduler.queue))
        assert not side.transfer.ledger.holdings()
        assert side.pool.num_used_blocks == 0

    await side.front.call(check)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model_dir("llama", tmp_path_factory.mktemp("kv-transfer-llama"))


@pytest.fixture(scope="module", params=["auto", "int8"])
def pair(request, tiny_dir):
    kw = dict(block_size=BS, num_kv_blocks=64, kv_cache_dtype=request.param)
    holder, receiver = make_side(tiny_dir, **kw), make_side(tiny_dir, **kw)
    yield holder, receiver
    holder.close()
    receiver.close()


def prompt_of(seed: int, n: int = 27) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def test_imported_prefix_gives_the_outputs_of_a_local_hit(pair):
    holder, receiver = pair

    async def main():
        prompt = prompt_of(1)  # 27 tokens: 6 full blocks can hit
        cold = await run(holder, "cold", prompt)
        local_hit = await run(holder, "hit", prompt)
        assert local_hit[2] == 24 and cold[2] == 0
        hashes, _ = receiver.transfer.prefix_hashes(prompt)
        held_ids = [holder.pool.get_cached_block(h) for h in hashes]
        assert len(hashes) == 6 and None not in held_ids
        free_before = receiver.pool.free_block_ids()
        assert await receiver.transfer.fetch(LocalHolder(holder.transfer), prompt) == 24
        # The blocks landed in the receiver's first free blocks, cached under the same hashes.
        got = [receiver.pool.get_cached_block(h) for h in hashes]
        assert sorted(got) == sorted(free_before[:6])
        assert receiver.pool.num_used_blocks == 0 and receiver.pool.num_cached_blocks == 6
        events = await receiver.front.call(lambda e: e.scheduler.kv_manager.take_events())
        assert [h for ev in events.events for h in ev.block_hashes] == hashes
        fetched = await run(receiver, "fetched", prompt)
        assert fetched == local_hit  # tokens, logprobs (exact floats) and 24 cached tokens
        assert fetched[0] == cold[0]
        assert receiver.transfer.metrics.value("kv_transfer_blocks_total", direction="in") >= 6
        assert holder.transfer.metrics.value("kv_transfer_blocks_total", direction="out") >= 6
        assert receiver.transfer.metrics.value("kv_transfer_prefix_tokens_total") >= 24
        await check_idle(holder)
        await check_idle(receiver)

    asyncio.run(main())


def test_only_the_missing_tail_is_fetched(pair):
    holder, receiver = pair

    async def main():
        prompt = prompt_of(2)
        await run(holder, "h2", prompt)
        await run(receiver, "r2", prompt[:13])  # the receiver computed the first 3 blocks itself
        before = receiver.transfer.metrics.value("kv_transfer_blocks_total", direction="in")
        assert await receiver.transfer.fetch(LocalHolder(holder.transfer), prompt) == 12
        assert receiver.transfer.metrics.value("kv_transfer_blocks_total", direction="in") == before + 3
        assert await receiver.transfer.fetch(LocalHolder(holder.transfer), prompt) == 0  # all here now
        assert (await run(receiver, "r2b", prompt))[2] == 24
        await check_idle(receiver)

    asyncio.run(main())


class FailingHolder:
    """A holder whose export raises (it died: Ray raises RayActorError), stalls, or answers wrongly."""

    def __init__(self, mode: str, real: KVTransfer) -> None:
        self.mode, self.real = mode, real
        self.export_kv = self

    async def remote(self, hashes):
        if self.mode == "dies":
            raise RuntimeError("The actor died unexpectedly before finishing this task.")
        if self.mode == "stalls":
            await asyncio.sleep(3600)
        export = await self.real.export(hashes)
        if self.mode == "wrong_hashes":
            return KVExport(tuple(reversed(export.block_hashes)), export.layout, export.data)
        if self.mode == "short_data":
            return KVExport(export.block_hashes, export.layout, export.data[:, :, :1])
        return export


@pytest.mark.parametrize("mode,reason", [("dies", "error"), ("stalls", "timeout"), ("wrong_hashes", "mismatch"),
                                         ("short_data", "mismatch")])
def test_a_failed_fetch_imports_nothing_and_the_request_prefills(pair, mode, reason):
    holder, receiver = pair

    async def main():
        prompt = prompt_of(10 + len(mode))
        expected = await run(holder, f"x-{mode}", prompt)
        receiver.transfer.timeout_s = 0.5
        before = receiver.transfer.metrics.value("kv_transfer_fallbacks_total", reason=reason)
        try:
            assert await receiver.transfer.fetch(FailingHolder(mode, holder.transfer), prompt) == 0
        finally:
            receiver.transfer.timeout_s = 10.0
        assert receiver.transfer.metrics.value("kv_transfer_fallbacks_total", reason=reason) == before + 1
        hashes, _ = receiver.transfer.prefix_hashes(prompt)
        assert all(receiver.pool.get_cached_block(h) is None for h in hashes)
        got = await run(receiver, f"y-{mode}", prompt)
        assert got[0] == expected[0] and got[2] == 0
        await asyncio.sleep(0.05)  # the holder's release is posted, not awaited
        await check_idle(holder)
        await check_idle(receiver)

    asyncio.run(main())


def test_a_write_that_fails_half_way_leaves_no_readable_block(pair, monkeypatch):
    holder, receiver = pair

    def fails_half_way(runner, block_ids, data):
        real_write(runner, block_ids[:1], np.ascontiguousarray(data[:, :, :1]))  # first block written, then
        raise MemoryError("copy interrupted")

    real_write = kv_transfer_module.write_blocks
    monkeypatch.setattr(kv_transfer_module, "write_blocks", fails_half_way)

    async def main():
        prompt = prompt_of(30)
        await run(holder, "w1", prompt)
        assert await receiver.transfer.fetch(LocalHolder(holder.transfer), prompt) == 0
        hashes, _ = receiver.transfer.prefix_hashes(prompt)
        assert all(receiver.pool.get_cached_block(h) is None for h in hashes)
        assert receiver.transfer.metrics.value("kv_transfer_fallbacks_total", reason="error") >= 1
        await check_idle(receiver)

    asyncio.run(main())


def test_layouts_that_differ_are_refused(tiny_dir, pair):
    holder, _ = pair
    other = make_side(tiny_dir, block_size=BS, num_kv_blocks=64,
                      kv_cache_dtype="int8" if holder.transfer.layout.dtype != "int8" else "auto")
    try:
        async def main():
            prompt = prompt_of(40)
            await run(holder, "l1", prompt)
            assert await other.transfer.fetch(LocalHolder(holder.transfer), prompt) == 0
            assert other.transfer.metrics.value("kv_transfer_fallbacks_total", reason="mismatch") == 1
            await check_idle(other)

        asyncio.run(main())
    finally:
        other.close()


def test_concurrent_transfers_past_the_limit_are_refused(pair):
    holder, receiver = pair

    async def main():
        prompt = prompt_of(50)
        await run(holder, "c1", prompt)
        receiver.transfer.max_concurrent_transfers = 1
        slow = FailingHolder("stalls", holder.transfer)
        receiver.transfer.timeout_s = 0.5
        try:
            first = asyncio.ensure_future(receiver.transfer.fetch(slow, prompt))
            await asyncio.sleep(0.05)
            assert await receiver.transfer.fetch(LocalHolder(holder.transfer), prompt) == 0  # refused: busy
            assert receiver.transfer.metrics.value("kv_transfer_fallbacks_total", reason="busy") == 1
            assert await first == 0
        finally:
            receiver.transfer.max_concurrent_transfers = 2
            receiver.transfer.timeout_s = 10.0
        holder.transfer.max_concurrent_transfers = 0  # every export refused at once
        try:
            export = await holder.transfer.export(receiver.transfer.prefix_hashes(prompt)[0])
        finally:
            holder.transfer.max_concurrent_transfers = 2
        assert export.data is None and "busy" in export.reason
        assert holder.transfer.metrics.value("kv_transfer_refused_total") == 1

    asyncio.run(main())


def test_default_model_512_token_prefix_fetched_equals_local_hit():
    """The packaged model (30 layers, float32 KV, 16-token blocks): a 512-token
    prefix fetched from another engine, then 8 new tokens of question."""
    holder, receiver = make_side(None), make_side(None)
    try:
        tok = holder.llm.engine.tokenizer
        text = " ".join(f"Section {i}: the replica keeps its cache in blocks of sixteen tokens." for i in range(60))
        prefix = tok.encode(text).ids[:512]
        prompt = prefix + tok.encode(" What does the replica keep?").ids[:8]

        async def main():
            cold = await run(holder, "d-cold", prompt, max_tokens=8)
            local_hit = await run(holder, "d-hit", prompt, max_tokens=8)
            assert local_hit[2] == 512
            assert await receiver.transfer.fetch(LocalHolder(holder.transfer), prompt) == 512
            hashes, _ = receiver.transfer.prefix_hashes(prompt)
            assert len(hashes) == 32 and all(receiver.pool.get_cached_block(h) is not None for h in hashes)
            fetched = await run(receiver, "d-fetched", prompt, max_tokens=8)
            assert fetched == local_hit
            assert fetched[0] == cold[0]
            assert receiver.transfer.metrics.value("kv_transfer_bytes_total", direction="in") == 32 * 737280
            await check_idle(holder)
            await check_idle(receiver)

        asyncio.run(main())
    finally:
        holder.close()
        receiver.close()


def test_the_step_loop_runs_while_the_blocks_are_written(pair, monkeypatch):
    """The write waits until another request finished on the receiver: it
    can only finish if the engine keeps stepping during the copy."""
    import threading

    holder, receiver = pair
    other_done = threading.Event()
    real_write = kv_transfer_module.write_blocks

    def write_after_other_request(runner, block_ids, data):
        assert other_done.wait(60), "the engine did not step while the blocks were written"
        real_write(runner, block_ids, data)

    monkeypatch.setattr(kv_transfer_module, "write_blocks", write_after_other_request)

    async def main():
        prompt = prompt_of(60)
        expected = await run(holder, "s1", prompt)
        fetch = asyncio.ensure_future(receiver.transfer.fetch(LocalHolder(holder.transfer), prompt))
        while not receiver.transfer.ledger.holdings():  # reserved: the write has begun
            await asyncio.sleep(0.01)
        other = await run(receiver, "s-other", prompt_of(61), max_tokens=4)
        assert len(other[0]) == 4
        other_done.set()
        assert await fetch == 24
        assert (await run(receiver, "s2", prompt))[0] == expected[0]
        await check_idle(receiver)

    asyncio.run(main())


def test_the_replica_takes_its_limits_from_the_engine_config(tiny_dir):
    from cluster.shared.config import EngineConfig
    from workers.replica import ReplicaServer

    with pytest.raises(ValueError, match="kv_transfer_max_concurrent"):
        EngineConfig.from_kwargs(kv_transfer_max_concurrent=0)
    server = ReplicaServer({"model": str(tiny_dir), "block_size": BS, "num_kv_blocks": 32,
                            "kv_transfer_max_concurrent": 3, "kv_transfer_timeout_s": 2.5}, replica_id="kv-config")
    try:
        assert (server.kv_transfer.max_concurrent_transfers, server.kv_transfer.timeout_s) == (3, 2.5)
        assert b"prefixserve:kv_transfer_seconds_count" in server.metrics_text()
    finally:
        server.shutdown()


def test_a_fetch_cancelled_while_reserving_leaves_nothing_held(pair, monkeypatch):
    """The client goes away while the engine thread reserves the blocks: the
    import still runs to its end (committed), nothing stays reserved."""
    import threading

    holder, receiver = pair
    entered, go_on = threading.Event(), threading.Event()
    real_reserve = receiver.transfer._reserve

    def held_reserve(*args):
        entered.set()
        assert go_on.wait(60)
        return real_reserve(*args)

    monkeypatch.setattr(receiver.transfer, "_reserve", held_reserve)

    async def main():
        prompt = prompt_of(70)
        await run(holder, "k1", prompt)
        fetch = asyncio.ensure_future(receiver.transfer.fetch(LocalHolder(holder.transfer), prompt))
        while not entered.is_set():
            await asyncio.sleep(0.01)
        fetch.cancel()
        with pytest.raises(asyncio.CancelledError):
            await fetch
        go_on.set()
        hashes, _ = receiver.transfer.prefix_hashes(prompt)
        for _ in range(500):
            if receiver.pool.get_cached_block(hashes[-1]) is not None:
                break
            await asyncio.sleep(0.01)
        await check_idle(receiver)  # nothing held: the reservation was committed, not forgotten
        assert all(receiver.pool.get_cached_block(h) is not None for h in hashes)

    asyncio.run(main())
