"""Disaggregated prefill between two real replicas in one process
(workers/disagg.py): a request sent to the decode replica with the prefill
replica hinted (``kv_fetch_from`` and ``kv_prefill_first``) is prefilled
there, its blocks pulled, and decoded here, with the greedy tokens and
logprobs of a single replica (float32); a prefill or a pull that fails costs a
local prefill, same tokens. Serve's wiring: tests/integration/test_disagg_serve.py."""

from __future__ import annotations

import asyncio
import random

import pytest

from cluster.shared.types import GenerationRequest, SamplingParams
from tests.factories import make_tiny_model_dir
from workers.disagg import LocalPrefiller
from workers.kv_transfer import LocalHolder
from workers.replica import ReplicaServer

BS = 4


class FailingPrefiller:
    """A prefill replica that raises (died) or never answers (stalled)."""

    def __init__(self, mode: str) -> None:
        self.prefill_kv = self
        self.mode = mode

    async def remote(self, *args):
        if self.mode == "stall":
            await asyncio.Event().wait()
        raise RuntimeError("the prefill replica died")


class FailingHolder:
    def __init__(self) -> None:
        self.export_kv = self

    async def remote(self, *args):
        raise RuntimeError("the holder died mid-export")


@pytest.fixture(scope="module")
def trio(tmp_path_factory):
    model_dir = make_tiny_model_dir("llama", tmp_path_factory.mktemp("disagg-llama"))
    config = {"model": str(model_dir), "block_size": BS, "num_kv_blocks": 64, "dtype": "float32"}
    prefill, decode, single = (ReplicaServer(config, replica_id=name) for name in ("prefill", "decode", "single"))
    decode.holder_of = lambda rid: LocalHolder(prefill.kv_transfer) if rid == "prefill" else None
    decode.prefiller_of = lambda rid: LocalPrefiller(prefill) if rid == "prefill" else None
    yield prefill, decode, single
    for replica in (prefill, decode, single):
        replica.shutdown()


async def run(replica: ReplicaServer, request_id: str, prompt: list[int], disagg: bool = False):
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
    request = GenerationRequest(request_id, prompt, params, kv_fetch_from={"decode": "prefill"} if disagg else {},
                                kv_prefill_first=disagg)
    tokens, logprobs, cached = [], [], None
    async for chunk in replica.generate(request):
        tokens += chunk.token_ids
        logprobs += [(lp.token_id, lp.logprob) for lp in chunk.logprobs or []]
        cached = chunk.cached_prompt_tokens
    return tokens, logprobs, cached


async def check_idle(*replicas: ReplicaServer) -> None:
    for replica in replicas:
        def check(engine, replica=replica) -> None:
            replica.kv_transfer.ledger.check_integrity(list(engine.scheduler.queue))
            assert not replica.kv_transfer.ledger.holdings()
            assert engine.scheduler.kv_manager.device_pool.num_used_blocks == 0

        await replica._front.call(check)


def prompt_of(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(27)]  # 6 full blocks can be handed over


def test_prefilled_on_one_replica_decoded_on_another_gives_the_single_replica_outputs(trio):
    prefill, decode, single = trio

    async def main():
        prompt = prompt_of(1)
        cold = await run(single, "cold", prompt)
        local_hit = await run(single, "hit", prompt)
        served = prefill.disagg_prefill_count("served")
        got = await run(decode, "disagg", prompt, disagg=True)
        assert cold[2] == 0 and local_hit[2] == 24
        assert got[0] == cold[0]  # the greedy tokens of one replica
        assert got == local_hit  # tokens, exact logprobs, and the 6 full blocks reported cached
        assert prefill.disagg_prefill_count("served") == served + 1
        assert decode.disagg_prefill_count("remote") >= 1
        assert decode.kv_transfer.metrics.value("kv_transfer_prefix_tokens_total") >= 24
        # The prefill replica ran the prompt once (1 token, dropped); the decode replica computed 3 tokens.
        hashes, _ = decode.kv_transfer.prefix_hashes(prompt)
        assert decode.kv_transfer.ledger.num_cached_leading(hashes) == 6
        await check_idle(prefill, decode)

    asyncio.run(main())


def test_prefill_kv_caches_the_prompts_full_blocks(trio):
    prefill, _, _ = trio

    async def main():
        prompt = prompt_of(2)
        assert await prefill.prefill_kv(prompt) == 24  # 27 tokens: 6 full blocks but the last token's
        assert await prefill.prefill_kv(prompt, "another-tenant") == 24  # another salt, other blocks
        with pytest.raises(ValueError):
            await prefill.prefill_kv([])
        await check_idle(prefill)

    asyncio.run(main())


@pytest.mark.parametrize("failure", ["prefill_error", "prefill_stall", "pull_error", "unreachable"])
def test_a_failed_prefill_or_pull_falls_back_to_a_local_prefill(trio, failure):
    prefill, decode, single = trio

    async def main():
        prompt = prompt_of(10 + ["prefill_error", "prefill_stall", "pull_error", "unreachable"].index(failure))
        cold = await run(single, "cold", prompt)
        prefiller_of, holder_of, timeout = decode.prefiller_of, decode.holder_of, decode.prefill_timeout_s
        if failure in ("prefill_error", "prefill_stall"):
            decode.prefiller_of = lambda rid: FailingPrefiller(failure.removeprefix("prefill_"))
            decode.prefill_timeout_s = 0.2
        elif failure == "pull_error":
            decode.holder_of = lambda rid: FailingHolder()
        else:
            decode.prefiller_of = lambda rid: None
        try:
            got = await run(decode, f"disagg-{failure}", prompt, disagg=True)
        finally:
            decode.prefiller_of, decode.holder_of, decode.prefill_timeout_s = prefiller_of, holder_of, timeout
        assert got[0] == cold[0]  # nothing lost: the same greedy tokens
        assert got[2] == 0  # prefilled here
        outcome = {"prefill_error": "error", "prefill_stall": "timeout", "pull_error": "remote",
                   "unreachable": "unreachable"}[failure]
        assert decode.disagg_prefill_count(outcome) >= 1
        await check_idle(prefill, decode)

    asyncio.run(main())


def test_without_the_prefill_first_flag_a_hint_is_an_ordinary_fetch(trio):
    prefill, decode, _ = trio

    async def main():
        prompt = prompt_of(3)
        served = prefill.disagg_prefill_count("served")
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        request = GenerationRequest("plain-hint", prompt, params, kv_fetch_from={"decode": "prefill"})
        chunks = [c async for c in decode.generate(request)]
        assert chunks[-1].cached_prompt_tokens == 0  # the prefill replica held nothing: nothing fetched
        assert prefill.disagg_prefill_count("served") == served  # and it was not asked to prefill

    asyncio.run(main())


def test_concurrent_pulls_after_remote_prefills_wait_for_a_slot_instead_of_prefilling_again(trio):
    prefill, decode, single = trio

    async def main():
        prompts = [prompt_of(20 + i) for i in range(2 * decode.kv_transfer.max_concurrent_transfers + 1)]
        busy = decode.kv_transfer.metrics.value("kv_transfer_fallbacks_total", reason="busy")
        got = await asyncio.gather(*[run(decode, f"many-{i}", p, disagg=True) for i, p in enumerate(prompts)])
        cold = [await run(single, f"many-cold-{i}", p) for i, p in enumerate(prompts)]
        assert [g[0] for g in got] == [c[0] for c in cold]
        assert [g[2] for g in got] == [24] * len(prompts)  # every one pulled: none refused at the limit
        assert decode.kv_transfer.metrics.value("kv_transfer_fallbacks_total", reason="busy") == busy
        await check_idle(prefill, decode)

    asyncio.run(main())
