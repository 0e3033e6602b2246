"""Warm start through Ray Serve and the Redis directory (issue 33, item 3):
one replica of two caches a prefix; the other is killed, and the replacement
Serve starts, in its constructor (before Serve routes it anything), pulls the
prefix's blocks from the holder through its handle to the deployment. Its
first request of that prefix hits them (same tokens as the cold run) and the
directory lists it as a holder. Killed again while every holder fails its
warm exports, its replacement starts all the same: nothing imported, nothing
held, its pool consistent, its request served."""

from __future__ import annotations

import asyncio
import os
import random
import time
import uuid

import pytest

from cluster.shared.config import ClusterConfig, EngineConfig
from cluster.shared.hashing import hash_block_chain, root_hash
from tests.factories import make_tiny_model_dir
from tests.integration.test_kv_transfer_serve import request, run, until_held
from workers.model.loader import model_fingerprint
from workers.replica import ReplicaServer

BLOCK = 4
PREFIX = 200  # 50 blocks
APP = "kv-warm"


def warm_replica(fail_path: str) -> type:
    """The replica with a switch (the file at ``fail_path``) that makes its warm exports
    raise, and a report of its insides. Defined in a function: Serve pickles it by value."""

    class WarmReplica(ReplicaServer):
        async def export_kv(self, block_hashes, holder_id="", warm_blocks=0):
            if warm_blocks and os.path.exists(fail_path):
                raise RuntimeError("this holder fails its warm exports")
            return await super().export_kv(block_hashes, holder_id, warm_blocks)

        async def report(self) -> dict:
            def check(engine) -> dict:
                self.kv_transfer.ledger.check_integrity(list(engine.scheduler.queue))
                pool = engine.scheduler.kv_manager.device_pool
                return {"replica": self.replica_id, "used": pool.num_used_blocks, "cached": pool.num_cached_blocks,
                        "held": self.kv_transfer.ledger.num_held_blocks}

            got = await self._front.call(check)
            result = self.warm_result
            got.update(outcome=result.outcome, blocks=result.blocks, bytes=result.bytes,
                       block_bytes=self.kv_transfer.block_bytes,
                       metric_blocks=self.warm_metrics.blocks._value.get())
            return got

        async def generate_here(self, only: str, req) -> dict:
            """``req`` served here if this is replica ``only``; None elsewhere."""
            if self.replica_id != only:
                return None
            tokens, final = [], None
            async for chunk in self.generate(req):
                tokens += chunk.token_ids
                final = chunk
            return {"tokens": tokens, "cached": final.cached_prompt_tokens}

    return WarmReplica


@pytest.fixture(scope="module")
def cluster(ray_local, redis_server, tmp_path_factory):
    from ray import serve

    from cluster.app.builder import replica_options

    model_dir = make_tiny_model_dir("llama", tmp_path_factory.mktemp("kv-warm-llama"))
    fail = str(tmp_path_factory.mktemp("kv-warm-switch") / "fail")
    engine = EngineConfig.from_kwargs(model=str(model_dir), block_size=BLOCK, num_kv_blocks=600)
    config = ClusterConfig(replicas=2, redis_url=redis_server.url, namespace=f"kvw-{uuid.uuid4().hex[:6]}",
                           engine=engine, replica_num_cpus=0.25, routing_policy="prefix_cost")
    serve.start(proxy_location="Disabled")
    deployment = serve.deployment(warm_replica(fail)).options(**replica_options(config))
    handle = serve.run(deployment.bind(engine.flat(), config.redis_url, config.namespace), name=APP,
                       route_prefix=None)
    yield handle, model_dir, config, fail
    serve.delete(APP)


async def reports(handle, want: int = 0, new_besides: frozenset = frozenset()) -> dict[str, dict]:
    """Live replicas' reports: until ``want`` answered, or one not in ``new_besides`` did
    (Serve starts a killed replica's replacement: up to a minute; until its controller
    notices the kill, a call may still be routed to the dead one)."""
    import ray

    got: dict[str, dict] = {}
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            answer = await handle.options(method_name="report").remote()
        except ray.exceptions.RayActorError:  # routed to the killed one before Serve dropped it
            await asyncio.sleep(0.05)
            continue
        got[answer["replica"]] = answer
        if (want and len(got) >= want) or (new_besides and set(got) - new_besides):
            return got
        await asyncio.sleep(0.05)
    raise AssertionError(f"only {sorted(got)} answered")


async def served_by(handle, replica_id: str, req) -> dict:
    import ray

    for _ in range(100):
        try:
            got = await handle.options(method_name="generate_here").remote(replica_id, req)
        except ray.exceptions.RayActorError:  # a killed replica Serve still routed to
            continue
        if got is not None:
            return got
    raise AssertionError(f"no call reached {replica_id}")


def kill(replica_id: str) -> None:
    import ray
    from ray.serve._private.common import DeploymentID, ReplicaID

    name = ReplicaID(replica_id, DeploymentID("replica", APP)).to_full_id_str()
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=False)


def test_a_restarted_replica_warms_from_the_holder_and_a_failing_holder_leaves_it_cold(cluster):
    handle, model_dir, config, fail = cluster
    rng = random.Random(11)
    prefix = [rng.randrange(3, 500) for _ in range(PREFIX)]
    prompt = prefix + [rng.randrange(3, 500)]
    chain = hash_block_chain(prefix, BLOCK, root_hash(model_fingerprint(model_dir)))

    async def main():
        cold = await run(handle, request("cold", prompt))
        await until_held(config, chain, cold["replica"])
        first = await reports(handle, want=2)
        other = next(rid for rid in first if rid != cold["replica"])
        assert first[other]["cached"] == 0
        kill(other)  # Serve replaces it; the replacement warms from the holder before it serves
        got = await reports(handle, new_besides=frozenset(first))
        new = next(r for rid, r in got.items() if rid not in first)
        assert new["outcome"] == "warmed" and new["blocks"] >= PREFIX // BLOCK, new
        assert new["bytes"] == new["blocks"] * new["block_bytes"] == new["metric_blocks"] * new["block_bytes"]
        assert new["bytes"] <= EngineConfig().cache.kv_warm_start_bytes and new["held"] == 0
        await until_held(config, chain, new["replica"])  # announced by its KV events
        here = await served_by(handle, new["replica"], request("warm", prompt))
        assert here["cached"] == PREFIX and here["tokens"] == cold["tokens"]  # its first request, hit

        open(fail, "w").close()  # every holder now fails its warm exports
        try:
            kill(new["replica"])
            got = await reports(handle, new_besides=frozenset({*first, new["replica"]}))
        finally:
            os.unlink(fail)
        last = next(r for rid, r in got.items() if rid not in first and rid != new["replica"])
        assert last["outcome"] == "error" and last["blocks"] == 0 and last["cached"] == 0, last
        assert last["held"] == 0 and last["used"] == 0, last  # check_integrity ran in report
        here = await served_by(handle, last["replica"], request("after-fail", prompt))
        assert here["cached"] == 0 and here["tokens"] == cold["tokens"]  # a cold prefill, same tokens

    asyncio.run(main())
