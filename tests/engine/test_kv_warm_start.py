"""Warm start between two engines in one process (workers/kv_warm_start.py):
real models and runners, the holder through ``LocalHolder``, the directory a
dict (tests/integration/test_kv_warm_start_serve.py runs Serve and Redis).

A receiver that warmed from a holder hits the prefix on its first request with
the holder's tokens; the byte budget caps the blocks; a failing holder leaves
the receiver empty and consistent, and a stalling one costs the time bound."""

from __future__ import annotations

import asyncio
import random

import pytest

from tests.engine.test_kv_transfer import BS, check_idle, make_side, run
from tests.factories import make_tiny_model_dir
from workers.kv_transfer import LocalHolder
from workers.kv_warm_start import warm_start


class FakeDirectory:
    def __init__(self, held: dict[str, set[bytes]]) -> None:
        self.held = held

    async def live_replicas(self) -> dict[str, int]:
        return {rid: 1 for rid in [*self.held, "me"]}

    async def replica_contract(self, rid: str) -> str:
        return ""

    async def replica_block_hashes(self, rid: str) -> set[bytes]:
        return set(self.held.get(rid, ()))


class Failing:
    class export_kv:  # noqa: N801 - a handle's shape
        @staticmethod
        async def remote(*args):
            raise RuntimeError("holder died")


class Stalling:
    class export_kv:  # noqa: N801 - a handle's shape
        @staticmethod
        async def remote(*args):
            await asyncio.sleep(3600)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model_dir("llama", tmp_path_factory.mktemp("kv-warm-llama"))


def test_warm_start_imports_the_hottest_blocks_within_the_budget(tiny_dir):
    kw = dict(block_size=BS, num_kv_blocks=128)
    holder, full, capped, failed = (make_side(tiny_dir, **kw) for _ in range(4))
    rng = random.Random(5)
    prompt = [rng.randrange(3, 500) for _ in range(41)]  # 10 full blocks of prefix

    async def main():
        cold = await run(holder, "cold", prompt)
        held = set(holder.pool.cached_block_hashes())
        directory = FakeDirectory({"h": held})
        block_bytes = full.transfer.block_bytes
        got = await warm_start(full.transfer, directory, lambda rid: LocalHolder(holder.transfer), "me", "",
                               10**9, 10.0)
        assert got.outcome == "warmed" and got.blocks == len(held) and got.bytes == len(held) * block_bytes
        warm, hit = await run(full, "warm", prompt), await run(holder, "hit", prompt)
        assert warm[2] == 40 and warm[0] == cold[0] and warm[1] == hit[1]  # hit: a local hit's tokens, logprobs
        got = await warm_start(capped.transfer, directory, lambda rid: LocalHolder(holder.transfer), "me", "",
                               3 * block_bytes + 1, 10.0)
        assert got.outcome == "warmed" and got.blocks == 3 and capped.pool.num_cached_blocks == 3
        again = await run(capped, "capped", prompt)
        assert again[2] == 3 * BS and again[0] == cold[0]  # the chain's leading blocks ranked first
        got = await warm_start(failed.transfer, directory, lambda rid: Failing(), "me", "", 10**9, 10.0)
        assert got.outcome == "error" and got.blocks == 0 and failed.pool.num_cached_blocks == 0
        got = await warm_start(failed.transfer, directory, lambda rid: Stalling(), "me", "", 10**9, 0.5)
        assert got.outcome == "timeout" and got.blocks == 0  # the stall ended by the time bound
        off = await warm_start(failed.transfer, directory, lambda rid: LocalHolder(holder.transfer), "me", "",
                               0, 10.0)
        assert off.outcome == "off" and off.blocks == 0
        # A pool with room for 8 imported blocks (half its 16 free ones) asks for 8, not for all 10.
        got = await warm_start(small.transfer, directory, lambda rid: LocalHolder(holder.transfer), "me", "",
                               10**9, 10.0)
        assert got.outcome == "warmed" and got.blocks == 8 and small.pool.num_cached_blocks == 8
        for side in (holder, full, capped, failed, small):
            await check_idle(side)

    small = make_side(tiny_dir, block_size=BS, num_kv_blocks=16)
    try:
        asyncio.run(main())
    finally:
        for side in (holder, full, capped, failed, small):
            side.close()
