"""Disaggregated prefill through real Ray Serve and Redis (issue 33 item 4,
docs/DISAGGREGATION.md): two replicas, ``prefill_replicas: 1``. A request is
served by the decode replica (rank 1) after the prefill replica (rank 0)
prefilled its prompt and the decode replica pulled the blocks: the tokens of
one engine, every full block of the prompt reported cached. With the prefill
replica failing its prefills, the decode replica prefills the request itself:
same tokens, nothing held anywhere. With the prefill replica killed while it
prefills, the decode replica prefills the request itself: same tokens (calls
Serve still routes to the killed replica are tolerated)."""

from __future__ import annotations

import asyncio
import os
import random
import uuid

import pytest

from cluster.shared.config import ClusterConfig, EngineConfig
from cluster.shared.types import GenerationRequest, SamplingParams
from tests.factories import make_tiny_model_dir
from workers.replica import ReplicaServer

BLOCK = 4
PROMPT_LEN = 81  # 20 full blocks hand over; the decode replica computes the last token
APP = "disagg-serve"


def serve_replica(fail_path: str, stall_path: str, stalled_path: str) -> type:
    """The replica with switches that fail its prefills (the file at ``fail_path``) or stall
    them (``stall_path``: say so in ``stalled_path``, never answer), and a report of its
    insides. Defined in a function: Serve pickles a local class by value."""

    class SwitchableReplica(ReplicaServer):
        async def prefill_kv(self, prompt_token_ids, cache_salt="", holder_id=""):
            if os.path.exists(fail_path):
                raise RuntimeError("prefill switched off by the test")
            if os.path.exists(stall_path):
                with open(stalled_path, "w") as f:
                    f.write(self.replica_id)
                await asyncio.sleep(3600)
            return await super().prefill_kv(prompt_token_ids, cache_salt, holder_id)

        async def report(self) -> dict:
            def check(engine) -> dict:
                self.kv_transfer.ledger.check_integrity(list(engine.scheduler.queue))
                return {"used": engine.scheduler.kv_manager.device_pool.num_used_blocks,
                        "held": self.kv_transfer.ledger.num_held_blocks}

            got = await self._front.call(check)
            got.update(replica=self.replica_id, rank=self.record_replica_metadata().get("rank"),
                       **{outcome: self.disagg_prefill_count(outcome) for outcome in ("remote", "error", "served")},
                       prefix_tokens=self.kv_transfer.metrics.value("kv_transfer_prefix_tokens_total"))
            return got

    return SwitchableReplica


@pytest.fixture(scope="module")
def cluster(ray_local, redis_server, tmp_path_factory):
    from ray import serve

    from cluster.app.builder import replica_options

    model_dir = make_tiny_model_dir("llama", tmp_path_factory.mktemp("disagg-serve-llama"))
    switches = tmp_path_factory.mktemp("disagg-switch")
    fail, stall, stalled = (str(switches / name) for name in ("fail", "stall", "stalled"))
    engine = EngineConfig.from_kwargs(model=str(model_dir), block_size=BLOCK, num_kv_blocks=400, dtype="float32")
    config = ClusterConfig(replicas=2, prefill_replicas=1, redis_url=redis_server.url,
                           namespace=f"dis-{uuid.uuid4().hex[:6]}", engine=engine, replica_num_cpus=0.25)
    serve.start(proxy_location="Disabled")
    deployment = serve.deployment(serve_replica(fail, stall, stalled)).options(**replica_options(config))
    handle = serve.run(deployment.bind(engine.flat(), config.redis_url, config.namespace), name=APP,
                       route_prefix=None)
    yield handle, model_dir, fail, stall, stalled
    serve.delete(APP)


def prompt_of(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(PROMPT_LEN)]


def params() -> SamplingParams:
    return SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


async def run(handle, request_id: str, prompt: list[int]) -> dict:
    tokens, final = [], None
    stream = handle.options(stream=True, method_name="generate").remote(GenerationRequest(request_id, prompt,
                                                                                           params()))
    async for chunk in stream:
        tokens += chunk.token_ids
        final = chunk
    return {"tokens": tokens, "cached": final.cached_prompt_tokens, "replica": final.replica_id}


async def reports(handle) -> dict[int, dict]:
    """Both replicas' reports by rank (routed on load, ties at random: asked until both answered)."""
    got: dict[int, dict] = {}
    for _ in range(60):
        answer = await handle.options(method_name="report").remote()
        got[answer["rank"]] = answer
        if len(got) == 2:
            break
    assert set(got) == {0, 1}, got
    return got


def one_engine_tokens(model_dir, prompts: list[list[int]]) -> list[list[int]]:
    from workers.llm import LLM

    llm = LLM(str(model_dir), block_size=BLOCK, num_kv_blocks=200, dtype="float32")
    return [out.token_ids for out in llm.generate(prompts, params())]


def test_prefilled_on_the_prefill_replica_decoded_on_the_decode_replica(cluster):
    handle, model_dir, *_ = cluster
    prompts = [prompt_of(1), prompt_of(2)]
    expected = one_engine_tokens(model_dir, prompts)

    async def main():
        before = await reports(handle)
        got = [await run(handle, f"disagg-{i}", prompt) for i, prompt in enumerate(prompts)]
        after = await reports(handle)
        decode_id = after[1]["replica"]
        for out, want in zip(got, expected):
            assert out["tokens"] == want  # one engine's greedy tokens
            assert out["replica"] == decode_id  # decoded on the decode replica ...
            assert out["cached"] == PROMPT_LEN - 1  # ... from the 20 blocks it pulled
        assert after[0]["served"] - before[0]["served"] == 2  # prefilled on the prefill replica
        assert after[1]["remote"] - before[1]["remote"] == 2
        assert after[1]["prefix_tokens"] - before[1]["prefix_tokens"] == 2 * (PROMPT_LEN - 1)
        assert all(r["held"] == 0 for r in after.values())

    asyncio.run(main())


def test_a_prefill_replica_that_fails_costs_a_local_prefill_not_the_request(cluster):
    handle, model_dir, fail, *_ = cluster
    prompt = prompt_of(3)
    expected = one_engine_tokens(model_dir, [prompt])[0]

    async def main():
        before = await reports(handle)
        open(fail, "w").close()
        try:
            got = await run(handle, "disagg-fail", prompt)
        finally:
            os.unlink(fail)
        after = await reports(handle)
        assert got["tokens"] == expected and got["cached"] == 0  # prefilled on the decode replica
        assert got["replica"] == after[1]["replica"]
        assert after[1]["error"] - before[1]["error"] == 1
        for report in after.values():  # check_integrity ran on each; nothing held or leaked
            assert report["held"] == 0 and report["used"] == 0, report

    asyncio.run(main())


async def report_of_rank(handle, rank: int) -> dict:
    """One replica's report, asked until it answers; a call Serve still routes to a killed
    replica (or to its replacement, still starting) fails and is asked again."""
    for _ in range(60):
        try:
            answer = await asyncio.wait_for(handle.options(method_name="report").remote(), 30)
        except Exception:  # noqa: BLE001 - routed to the killed replica
            await asyncio.sleep(0.5)
            continue
        if answer["rank"] == rank:
            return answer
    raise AssertionError(f"rank {rank} never answered")


def test_a_prefill_replica_killed_mid_prefill_costs_a_local_prefill_not_the_request(cluster):
    import ray
    from ray.serve._private.common import DeploymentID, ReplicaID

    handle, model_dir, _, stall, stalled = cluster
    prompt = prompt_of(4)
    expected = one_engine_tokens(model_dir, [prompt])[0]

    async def main():
        ranks = await reports(handle)
        open(stall, "w").close()
        try:
            request = asyncio.ensure_future(run(handle, "disagg-kill", prompt))
            for _ in range(600):  # the prefill replica has entered its stalled prefill
                if os.path.exists(stalled) or request.done():
                    break
                await asyncio.sleep(0.1)
            with open(stalled) as f:
                assert f.read() == ranks[0]["replica"]
            name = ReplicaID(ranks[0]["replica"], DeploymentID("replica", APP)).to_full_id_str()
            ray.kill(ray.get_actor(name, namespace="serve"), no_restart=False)
        finally:
            os.unlink(stall)
        got = await asyncio.wait_for(request, 120)
        assert got["tokens"] == expected and got["cached"] == 0  # prefilled on the decode replica
        assert got["replica"] == ranks[1]["replica"]
        decode = await report_of_rank(handle, 1)
        assert decode["error"] - ranks[1]["error"] == 1
        assert decode["held"] == 0 and decode["used"] == 0, decode

    asyncio.run(main())
