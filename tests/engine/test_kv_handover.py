"""Cache hand-over on scale-down between engines in one process
(workers/kv_handover.py): real models and runners, the receivers called in
process, the directory a dict.

After the hand-over the receiver's first request hits the prefix with the
holder's tokens and logprobs bit for bit; the byte budget caps the blocks and
keeps the hottest (the chain's leading ones); a receiver that raises, fails its
write, stalls, has another layout or little room leaves both sides consistent
(``check_integrity``), and the next receiver is tried."""

from __future__ import annotations

import asyncio
import random

import pytest

import workers.kv_handover as kv_handover
from tests.engine.test_kv_transfer import BS, check_idle, make_side, run
from tests.factories import make_tiny_model_dir
from workers.kv_handover import hand_over, import_pushed


class FakeDirectory:
    """Live replicas ``me`` and ``usage``'s, each with its KV use (lowest first)."""

    def __init__(self, usage: dict[str, float], held: dict[str, set[bytes]] | None = None) -> None:
        self.usage = usage
        self.held = held or {}

    async def live_replicas(self) -> dict[str, int]:
        return {rid: 1 for rid in [*self.usage, "me"]}

    contract = ""

    async def replica_contract(self, rid: str) -> str:
        return self.contract

    async def replica_block_hashes(self, rid: str) -> set[bytes]:
        return set(self.held.get(rid, ()))

    async def replica_stats(self) -> dict[str, dict[str, float]]:
        return {rid: {"kv_cache_usage": u, "num_running": 0} for rid, u in self.usage.items()}


class LocalReceiver:
    def __init__(self, side) -> None:
        transfer = side.transfer

        class import_kv:  # noqa: N801 - a handle's shape
            @staticmethod
            async def remote(export, sender_id):
                return await import_pushed(transfer, export)

        self.import_kv = import_kv


class Failing:
    class import_kv:  # noqa: N801 - a handle's shape
        @staticmethod
        async def remote(*args):
            raise RuntimeError("receiver died")


class Stalling:
    class import_kv:  # noqa: N801 - a handle's shape
        @staticmethod
        async def remote(*args):
            await asyncio.sleep(3600)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model_dir("llama", tmp_path_factory.mktemp("kv-handover-llama"))


def test_hand_over_pushes_the_hottest_blocks_and_survives_failing_receivers(tiny_dir, monkeypatch):
    kw = dict(block_size=BS, num_kv_blocks=128)
    holder, receiver, capped, victim = (make_side(tiny_dir, **kw) for _ in range(4))
    small = make_side(tiny_dir, block_size=BS, num_kv_blocks=16)
    int8 = make_side(tiny_dir, block_size=BS, num_kv_blocks=128, kv_cache_dtype="int8")
    sides = (holder, receiver, capped, victim, small, int8)
    rng = random.Random(7)
    prompt = [rng.randrange(3, 500) for _ in range(41)]  # 10 full blocks of prefix

    def to(mapping):
        return lambda rid: mapping[rid]

    async def main():
        assert (await hand_over(holder.transfer, FakeDirectory({"r": 0.0}), to({"r": LocalReceiver(receiver)}),
                                "me", "", 10**9, 10.0)).outcome == "empty"  # nothing cached yet
        cold = await run(holder, "cold", prompt)
        held = set(holder.pool.cached_block_hashes())
        block_bytes = holder.transfer.block_bytes
        # The first receiver (least KV use) raises: the next one gets the blocks.
        directory = FakeDirectory({"bad": 0.0, "r": 0.5})
        got = await hand_over(holder.transfer, directory, to({"bad": Failing(), "r": LocalReceiver(receiver)}),
                              "me", "", 10**9, 10.0)
        assert got.outcome == "partial" and got.blocks == len(held) and got.receivers == 1
        assert got.bytes == len(held) * block_bytes and set(receiver.pool.cached_block_hashes()) == held
        after, hit = await run(receiver, "after", prompt), await run(holder, "hit", prompt)
        assert after[2] == 40 and after[0] == cold[0] and after[1] == hit[1]  # a local hit's tokens, logprobs
        # What the directory lists on the receiver already is not sent again.
        again = await hand_over(holder.transfer, FakeDirectory({"r": 0.0}, {"r": held}),
                                to({"r": LocalReceiver(receiver)}), "me", "", 10**9, 10.0)
        assert again.outcome == "empty" and again.blocks == 0
        # The budget caps the blocks; the hottest go first (the chain's leading blocks).
        got = await hand_over(holder.transfer, FakeDirectory({"c": 0.0}), to({"c": LocalReceiver(capped)}),
                              "me", "", 3 * block_bytes + 1, 10.0)
        assert got.outcome == "handed_over" and got.blocks == 3 and capped.pool.num_cached_blocks == 3
        first = await run(capped, "capped", prompt)
        assert first[2] == 3 * BS and first[0] == cold[0]
        # A receiver whose write fails: reserved blocks released unhashed, nothing readable.
        with monkeypatch.context() as patch:
            patch.setattr(kv_handover, "write_blocks", _raise)
            got = await hand_over(holder.transfer, FakeDirectory({"v": 0.0}), to({"v": LocalReceiver(victim)}),
                                  "me", "", 10**9, 10.0)
        assert got.outcome == "error" and got.blocks == 0 and victim.pool.num_cached_blocks == 0
        got = await hand_over(holder.transfer, FakeDirectory({"s": 0.0}), to({"s": Stalling()}), "me", "", 10**9,
                              0.5)
        assert got.outcome == "timeout" and got.blocks == 0  # ended by the time bound
        got = await hand_over(holder.transfer, FakeDirectory({"i": 0.0}), to({"i": LocalReceiver(int8)}),
                              "me", "", 10**9, 10.0)
        assert got.outcome == "mismatch" and int8.pool.num_cached_blocks == 0
        # Room for 8 imported blocks (half of 16 free): the 8 hottest.
        got = await hand_over(holder.transfer, FakeDirectory({"m": 0.0}), to({"m": LocalReceiver(small)}),
                              "me", "", 10**9, 10.0)
        assert got.blocks == 8 and small.pool.num_cached_blocks == 8
        assert (await run(small, "small", prompt))[2] == 8 * BS
        assert (await hand_over(holder.transfer, FakeDirectory({}), to({}), "me", "", 10**9,
                                10.0)).outcome == "no_receiver"
        assert (await hand_over(holder.transfer, directory, to({"r": LocalReceiver(receiver)}), "me", "", 0,
                                10.0)).outcome == "off"
        for side in sides:
            await check_idle(side)

    try:
        asyncio.run(main())
    finally:
        for side in sides:
            side.close()


def _raise(*args):
    raise RuntimeError("write failed")


class ServerReceiver:
    """A ``ReplicaServer``'s ``import_kv`` behind a handle's shape (Serve's, in production)."""

    def __init__(self, server, receiver_id: str) -> None:
        class import_kv:  # noqa: N801 - a handle's shape
            @staticmethod
            async def remote(export, sender_id):
                return await server.import_kv(export, holder_id=receiver_id, sender_id=sender_id)

        self.import_kv = import_kv


def test_a_stopping_replica_server_hands_its_cache_over_in_shutdown(tiny_dir, monkeypatch):
    from cluster.shared.directory import Directory
    from cluster.shared.types import GenerationRequest, SamplingParams
    from workers.replica import ReplicaServer

    config = {"model": str(tiny_dir), "block_size": BS, "num_kv_blocks": 128}
    stopping, survivor, plain = (ReplicaServer(config, replica_id=rid) for rid in ("stopping", "survivor", "plain"))
    directory = FakeDirectory({"survivor": 0.0})
    directory.aclose = lambda: asyncio.sleep(0)
    monkeypatch.setattr(Directory, "from_url", staticmethod(lambda url, namespace: directory))
    stopping._redis_url = "redis://127.0.0.1:1/0"  # the fake directory above answers instead
    stopping.receiver_of = lambda rid: ServerReceiver(survivor, rid)
    prompt = [random.Random(9).randrange(3, 500) for _ in range(41)]

    async def serve(server, request_id):
        tokens, final = [], None
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        async for chunk in server.generate(GenerationRequest(request_id, prompt, params)):
            tokens, final = tokens + chunk.token_ids, chunk
        return tokens, final.cached_prompt_tokens

    try:
        cold = asyncio.run(serve(stopping, "cold"))
        directory.contract = "another model"
        stopping._hand_over_cache(stopping._redis_url, "ns", stopping._contract)
        assert stopping.handover_result.outcome == "no_receiver"  # no live replica of its contract
        stopping.handover_result, directory.contract = None, stopping._contract
        stopping.shutdown()  # Serve's __del__ calls it
        stopping.shutdown()  # once only
        result = stopping.handover_result
        assert result.outcome == "handed_over" and result.blocks >= 10, result
        assert stopping.handover_metrics.blocks._value.get() == result.blocks
        assert survivor.handover_metrics.received_blocks._value.get() == result.blocks
        after = asyncio.run(serve(survivor, "after"))
        assert after == (cold[0], 40)
        # A call routed back to the sender itself imports nothing.
        export = asyncio.run(survivor.kv_transfer.export(list(survivor.kv_transfer.ledger.pool.cached_block_hashes()),
                                                         warm_blocks=4))
        assert asyncio.run(survivor.import_kv(export, "survivor", sender_id="survivor")) == ("error", 0)
        plain.shutdown()  # no directory: no hand-over
        assert plain.handover_result.outcome == "off"
    finally:
        for server in (stopping, survivor, plain):
            server.shutdown()


def test_a_negative_hand_over_budget_is_refused_by_name():
    from cluster.shared.config import EngineConfig

    with pytest.raises(ValueError, match="kv_handover_bytes"):
        EngineConfig.from_kwargs(kv_handover_bytes=-1)
    assert EngineConfig.from_kwargs(kv_handover_bytes=0).cache.kv_handover_bytes == 0
