"""A fetch-priced decision moves blocks between replicas that share one
machine's cores (issue 33, item 2), through real Ray Serve, Redis and the
prefix-aware request router.

``bench routing`` deploys its replicas with a fraction of a CPU each, so they
form one core group (``workers/core_share.py``) and ``prefix_cost`` charges
each the group's queue. Priced with that queue a fetch never beat the holder
it copies from, and with fetch pricing on the bench made no fetch at all. Here
two such replicas (``packed_replicas=2``): one holds a prefix and is busy
decoding a request of it; the prefix's next request goes to its idle sibling,
which fetches the prefix's blocks from the holder (its fetch counter and
blocks in rise), and answers with the holder's cold run's greedy tokens.
"""

from __future__ import annotations

import asyncio
import random
import uuid

import pytest

from cluster.shared.config import ClusterConfig, EngineConfig
from cluster.shared.hashing import hash_block_chain, root_hash
from tests.factories import make_tiny_model_dir
from tests.integration.test_kv_transfer_serve import reports, request, run, until_held
from workers.model.loader import model_fingerprint
from workers.replica import ReplicaServer

BLOCK = 4
PREFIX = 200  # 50 blocks
APP = "kv-fetch-group"


def reporting_replica() -> type:
    """The replica with a report of its transfer counters. Defined in a function: Serve
    pickles a local class by value."""

    class ReportingReplica(ReplicaServer):
        async def report(self) -> dict:
            metrics = self.kv_transfer.metrics
            return {"replica": self.replica_id, "core_group": self.record_routing_stats()["core_group"],
                    "fetches": metrics.value("kv_transfer_seconds_count"),
                    "blocks_in": metrics.value("kv_transfer_blocks_total", direction="in"),
                    "blocks_out": metrics.value("kv_transfer_blocks_total", direction="out")}

    return ReportingReplica


@pytest.fixture(scope="module")
def cluster(ray_local, redis_server, tmp_path_factory):
    from ray import serve

    from cluster.app.builder import replica_options

    model_dir = make_tiny_model_dir("llama", tmp_path_factory.mktemp("kv-fetch-group-llama"))
    engine = EngineConfig.from_kwargs(model=str(model_dir), block_size=BLOCK, num_kv_blocks=600)
    # Packing on (its default), waking the idle sibling free and no copy penalty: the busy
    # holder's one decoding sequence (16 tokens of queue) is what sends the request past it.
    config = ClusterConfig(replicas=2, redis_url=redis_server.url, namespace=f"kvg-{uuid.uuid4().hex[:6]}",
                           engine=engine, replica_num_cpus=0.25, routing_policy="prefix_cost",
                           routing_policy_params={"fetch_bytes_per_s": 1.5e9, "fetch_penalty_tokens": 0,
                                                  "pack_idle_tokens": 0})
    serve.start(proxy_location="Disabled")
    deployment = serve.deployment(reporting_replica()).options(**replica_options(config))
    handle = serve.run(deployment.bind(engine.flat(), config.redis_url, config.namespace, packed_replicas=2),
                       name=APP, route_prefix=None)
    yield handle, model_dir, config
    serve.delete(APP)


def test_a_fetch_priced_past_a_busy_sibling_moves_the_blocks(cluster):
    handle, model_dir, config = cluster

    async def main():
        rng = random.Random(7)
        prefix = [rng.randrange(3, 500) for _ in range(PREFIX)]
        prompt = prefix + [rng.randrange(3, 500)]
        cold = await run(handle, request("cold", prompt), "grpc")
        chain = hash_block_chain(prefix, BLOCK, root_hash(model_fingerprint(model_dir)))
        await until_held(config, chain, cold["replica"])
        # Until the holder's routing stats (1 s period) postdate the cold request, the router
        # counts its prompt as queued there, which alone would send the next request past it.
        await asyncio.sleep(2.5)
        started = asyncio.Event()
        busy = asyncio.ensure_future(run(handle, request("busy", prefix + [7, 8, 9], max_tokens=250), "grpc",
                                         started))
        await asyncio.wait_for(started.wait(), 60)
        again = await run(handle, request("again", prompt), "grpc")
        busy = await busy
        assert busy["replica"] == cold["replica"] and busy["cached"] == PREFIX  # the holder, hit
        got = await reports(handle, {cold["replica"], again["replica"]})
        assert len({r["core_group"] for r in got.values()}) == 1 and got[cold["replica"]]["core_group"]
        assert again["replica"] != cold["replica"]  # past the busy holder, to its sibling ...
        receiver = got[again["replica"]]
        assert receiver["fetches"] >= 1 and receiver["blocks_in"] >= PREFIX // BLOCK  # ... which fetched
        assert got[cold["replica"]]["blocks_out"] >= PREFIX // BLOCK
        assert again["cached"] == PREFIX
        assert again["tokens"] == cold["tokens"]  # greedy: the holder's cold run's tokens
        assert again["logprobs"] == pytest.approx(cold["logprobs"], abs=1e-4)

    asyncio.run(main())
