"""Cache hand-over on scale-down through Ray Serve and the Redis directory
(issue 33, item 3; workers/kv_handover.py): each of two replicas caches a
prefix of its own; the deployment is scaled to one replica (num_replicas
alone changed: Serve stops one and keeps the other). The stopping replica, in its
graceful shutdown, pushes its blocks to the survivor, which the directory then
lists as a holder of both prefixes; the survivor's next request of the
stopped replica's prefix hits every block with the cold run's tokens, and its
pool passes ``check_integrity``. Whichever replica Serve stops, the test holds."""

from __future__ import annotations

import asyncio
import random
import time
import uuid

import pytest

from cluster.shared.config import ClusterConfig, EngineConfig
from cluster.shared.directory import Directory
from cluster.shared.hashing import hash_block_chain, root_hash
from tests.factories import make_tiny_model_dir
from tests.integration.test_kv_transfer_serve import until_held
from workers.model.loader import model_fingerprint
from workers.replica import ReplicaServer

BLOCK = 4
PREFIX = 200  # 50 blocks
APP = "kv-handover"


def handover_replica() -> type:
    """The replica with a report of its insides and a way to serve a request on a
    named replica. Defined in a function: Serve pickles it by value."""

    class HandoverReplica(ReplicaServer):
        async def report(self) -> dict:
            def check(engine) -> dict:
                self.kv_transfer.ledger.check_integrity(list(engine.scheduler.queue))
                pool = engine.scheduler.kv_manager.device_pool
                return {"replica": self.replica_id, "used": pool.num_used_blocks, "cached": pool.num_cached_blocks,
                        "held": self.kv_transfer.ledger.num_held_blocks,
                        "blocks_in": self.kv_transfer.metrics.value("kv_transfer_blocks_total", direction="in"),
                        "received": self.handover_metrics.received_blocks._value.get()}

            return await self._front.call(check)

        async def generate_here(self, only: str, request_id: str, prompt: list[int]):
            """The prompt served here if this is replica ``only``; None elsewhere. Takes no
            ``GenerationRequest``: the request router routes the call on load, ties at random,
            not by the prefix policy (which may keep choosing one replica of a core group)."""
            from cluster.shared.types import GenerationRequest, SamplingParams

            if self.replica_id != only:
                return None
            tokens, final = [], None
            params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
            async for chunk in self.generate(GenerationRequest(request_id, prompt, params)):
                tokens += chunk.token_ids
                final = chunk
            return {"tokens": tokens, "cached": final.cached_prompt_tokens}

    return HandoverReplica


@pytest.fixture(scope="module")
def cluster(ray_local, redis_server, tmp_path_factory):
    from ray import serve

    from cluster.app.builder import replica_options

    model_dir = make_tiny_model_dir("llama", tmp_path_factory.mktemp("kv-handover-llama"))
    engine = EngineConfig.from_kwargs(model=str(model_dir), block_size=BLOCK, num_kv_blocks=600,
                                      kv_warm_start_bytes=0)  # the survivor's blocks come from the hand-over alone
    config = ClusterConfig(replicas=2, redis_url=redis_server.url, namespace=f"kvh-{uuid.uuid4().hex[:6]}",
                           engine=engine, replica_num_cpus=0.25, routing_policy="prefix_cost")
    serve.start(proxy_location="Disabled")
    # A fixed code version, so the later serve.run that changes num_replicas alone stops one replica and
    # restarts none (without one, serve.run draws a new version: a rolling restart). Serve's public
    # options() no longer take a version; its own callers pass _internal.
    deployment = serve.deployment(handover_replica()).options(**replica_options(config), version="handover-1",
                                                               _internal=True)
    args = (engine.flat(), config.redis_url, config.namespace)
    handle = serve.run(deployment.bind(*args), name=APP, route_prefix=None)
    yield handle, deployment, args, model_dir, config
    serve.delete(APP)


async def live(config) -> dict[str, int]:
    directory = Directory.from_url(config.redis_url, config.namespace)
    try:
        return await directory.live_replicas()
    finally:
        await directory.aclose()


async def served_by(handle, replica_id: str, request_id: str, prompt: list[int]) -> dict:
    """The prompt served on ``replica_id`` (calls routed elsewhere, or to a replica Serve is
    stopping or has stopped, are asked again)."""
    for _ in range(400):
        try:
            got = await handle.options(method_name="generate_here").remote(replica_id, request_id, prompt)
        except Exception:  # noqa: BLE001 - a stopped replica Serve still routed to
            got = None
        if got is not None:
            return got
        await asyncio.sleep(0.05)  # the routing stats refresh every second
    raise AssertionError(f"no call reached {replica_id}")


async def report_of(handle, replica_id: str) -> dict:
    for _ in range(400):
        try:
            got = await handle.options(method_name="report").remote()
        except Exception:  # noqa: BLE001 - as in served_by
            got = None
        if got is not None and got["replica"] == replica_id:
            return got
        await asyncio.sleep(0.05)
    raise AssertionError(f"no report from {replica_id}")


def test_scale_down_hands_the_stopping_replicas_cache_to_the_survivor(cluster):
    from ray import serve

    handle, deployment, args, model_dir, config = cluster
    rng = random.Random(23)
    root = root_hash(model_fingerprint(model_dir))

    async def main():
        replicas = sorted(await live(config))
        assert len(replicas) == 2, replicas
        prompts, colds, chains = {}, {}, {}
        for i, rid in enumerate(replicas):  # a prefix of its own on each replica
            prefix = [rng.randrange(3, 500) for _ in range(PREFIX)]
            prompts[rid] = prefix + [rng.randrange(3, 500)]
            chains[rid] = hash_block_chain(prefix, BLOCK, root)
            colds[rid] = await served_by(handle, rid, f"cold-{i}", prompts[rid])
            assert colds[rid]["cached"] == 0
            await until_held(config, chains[rid], rid)
        await asyncio.to_thread(serve.run, deployment.options(num_replicas=1).bind(*args), name=APP,
                                route_prefix=None)
        deadline = time.monotonic() + 120  # Serve drains the stopping one, then it hands over and leaves
        while len(left := await live(config)) > 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert len(left) == 1, left
        survivor = next(iter(left))
        assert survivor in replicas, (survivor, replicas)  # scaled down, not restarted
        stopped = next(rid for rid in replicas if rid != survivor)
        await until_held(config, chains[stopped], survivor)  # the survivor's KV events listed them
        got = await report_of(handle, survivor)  # check_integrity ran there
        assert got["held"] == 0 and got["used"] == 0 and got["blocks_in"] >= got["received"] >= PREFIX // BLOCK, got
        here = await served_by(handle, survivor, "after", prompts[stopped])
        assert here["cached"] == PREFIX and here["tokens"] == colds[stopped]["tokens"]

    asyncio.run(main())
