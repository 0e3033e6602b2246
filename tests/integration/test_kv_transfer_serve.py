"""KV fetches wired through Ray Serve (issue 33): two replicas under Serve
with the real Redis directory and the prefix-aware request router pricing
fetches. A request for a cached prefix whose holder is busy is routed to the
other replica with the holder named (``GenerationRequest.kv_fetch_from``);
that replica fetches the blocks from the holder through its own handle to
the deployment (the request router sends the ``export_kv`` call to the
holder) and hits them: same tokens as the holder's cold prefill, the cached
tokens counting the fetched prefix, the blocks then listed under it in the
directory. A holder killed while it exports costs the fetching request a
prefill, never the request, and leaves no block held on the survivors."""

from __future__ import annotations

import asyncio
import os
import random
import time
import uuid
from pathlib import Path

import pytest

from cluster.shared.config import ClusterConfig, EngineConfig
from cluster.shared.directory import Directory
from cluster.shared.hashing import hash_block_chain, root_hash
from cluster.shared.types import GenerationRequest, SamplingParams
from tests.factories import make_tiny_model_dir
from workers.model.loader import model_fingerprint
from workers.replica import ReplicaServer

BLOCK = 4
PREFIX = 200  # 50 blocks
APP = "kv-serve"


def serve_replica(stall_path: str, exporting_path: str) -> type:
    """The replica with a switch to stall its exports (the file at ``stall_path``:
    pin what is asked, say so in ``exporting_path``, never answer) and a report of
    its insides. Defined in a function: Serve pickles a local class by value."""

    class StallableReplica(ReplicaServer):
        async def export_kv(self, block_hashes, holder_id=""):
            if os.path.exists(stall_path):
                held = await self._front.call(lambda engine: self.kv_transfer.ledger.pin_prefix(list(block_hashes)))
                assert held is not None
                Path(exporting_path).write_text(self.replica_id)
                await asyncio.sleep(3600)
            return await super().export_kv(block_hashes, holder_id)

        async def report(self) -> dict:
            def check(engine) -> dict:
                self.kv_transfer.ledger.check_integrity(list(engine.scheduler.queue))
                return {"replica": self.replica_id, "used": engine.scheduler.kv_manager.device_pool.num_used_blocks,
                        "held": self.kv_transfer.ledger.num_held_blocks}

            got = await self._front.call(check)
            metrics = self.kv_transfer.metrics
            got.update(blocks_in=metrics.value("kv_transfer_blocks_total", direction="in"),
                       prefix_tokens=metrics.value("kv_transfer_prefix_tokens_total"),
                       errors=metrics.value("kv_transfer_fallbacks_total", reason="error"),
                       kv_bytes_per_token=self.record_routing_stats()["kv_bytes_per_token"])
            return got

    return StallableReplica


@pytest.fixture(scope="module")
def cluster(ray_local, redis_server, tmp_path_factory):
    from ray import serve

    from cluster.app.builder import replica_options

    model_dir = make_tiny_model_dir("llama", tmp_path_factory.mktemp("kv-serve-llama"))
    switches = tmp_path_factory.mktemp("kv-serve-switch")
    stall, exporting = str(switches / "stall"), str(switches / "exporting")
    # The holder's death, not the fetch's timeout, must end the stalled fetch.
    engine = EngineConfig.from_kwargs(model=str(model_dir), block_size=BLOCK, num_kv_blocks=600,
                                      kv_transfer_timeout_s=120.0)
    # fetch_penalty_tokens 0: one running sequence on the holder is enough to send a request past it.
    config = ClusterConfig(replicas=2, redis_url=redis_server.url, namespace=f"kvs-{uuid.uuid4().hex[:6]}",
                           engine=engine, replica_num_cpus=0.25, routing_policy="prefix_cost",
                           routing_policy_params={"fetch_bytes_per_s": 1.5e9, "fetch_penalty_tokens": 0})
    serve.start(proxy_location="Disabled")
    deployment = serve.deployment(serve_replica(stall, exporting)).options(**replica_options(config))
    handle = serve.run(deployment.bind(engine.flat(), config.redis_url, config.namespace), name=APP,
                       route_prefix=None)
    yield handle, model_dir, config, stall, exporting
    serve.delete(APP)


def request(request_id: str, prompt: list[int], max_tokens: int = 6) -> GenerationRequest:
    return GenerationRequest(request_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                ignore_eos=True, logprobs=2))


async def run(handle, req: GenerationRequest, transport: str = "actor", started: asyncio.Event = None) -> dict:
    """The whole stream through Serve (``actor``: by reference; ``grpc``: Serve's gRPC channel)."""
    tokens, logprobs, final = [], [], None
    stream = handle.options(stream=True, method_name="generate", _by_reference=transport == "actor").remote(req)
    async for chunk in stream:
        tokens += chunk.token_ids
        logprobs += [lp.logprob for lp in chunk.logprobs or []]
        final = chunk
        if started is not None:
            started.set()
    return {"tokens": tokens, "logprobs": logprobs, "cached": final.cached_prompt_tokens,
            "replica": final.replica_id}


async def holders(config: ClusterConfig, chain: list[bytes]) -> dict[str, int]:
    directory = Directory.from_url(config.redis_url, config.namespace)
    try:
        return await directory.lookup(chain)
    finally:
        await directory.aclose()


async def until_held(config, chain, replica_id) -> None:
    deadline = time.monotonic() + 20
    while (await holders(config, chain)).get(replica_id, 0) < len(chain) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert (await holders(config, chain)).get(replica_id, 0) == len(chain), "the directory never listed it"


async def reports(handle, want: set[str]) -> dict[str, dict]:
    """Each live replica's report (routed on load, ties at random: asked until ``want`` answered)."""
    got: dict[str, dict] = {}
    for _ in range(40):
        answer = await handle.options(method_name="report").remote()
        got[answer["replica"]] = answer
        if want <= set(got):
            break
    return got


async def past_a_busy_holder(handle, config, model_dir, seed: int, transport: str):
    """Caches a prefix on one replica (cold), keeps that holder busy with a long request on the
    same prefix, and sends the cold request's prompt again while it runs; returns
    ``(cold, long-running, again)``."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 500) for _ in range(PREFIX)]
    prompt = prefix + [rng.randrange(3, 500)]
    cold = await run(handle, request(f"cold-{seed}", prompt), transport)
    chain = hash_block_chain(prefix, BLOCK, root_hash(model_fingerprint(model_dir)))
    await until_held(config, chain, cold["replica"])
    # Until the holder's routing stats (1 s period) postdate the cold request, the router counts its
    # prompt as queued there (pending_tokens), and the next request would go past it to fetch.
    await asyncio.sleep(2.5)
    started = asyncio.Event()
    busy = asyncio.ensure_future(run(handle, request(f"busy-{seed}", prefix + [7, 8, 9], max_tokens=150),
                                     transport, started))
    await asyncio.wait_for(started.wait(), 60)
    again = asyncio.ensure_future(run(handle, request(f"again-{seed}", prompt), transport))
    return cold, busy, again, chain


@pytest.mark.parametrize("transport", ["actor", "grpc"])
def test_a_request_routed_past_a_busy_holder_fetches_its_prefix(cluster, transport):
    handle, model_dir, config, _, _ = cluster

    async def main():
        cold, busy, again, chain = await past_a_busy_holder(handle, config, model_dir,
                                                            seed=1 if transport == "actor" else 2,
                                                            transport=transport)
        busy, again = await busy, await again
        assert busy["replica"] == cold["replica"] and busy["cached"] == PREFIX  # the holder, hit
        assert again["replica"] != cold["replica"]  # routed past the busy holder ...
        assert again["cached"] == PREFIX  # ... where the fetched prefix is hit
        assert again["tokens"] == cold["tokens"]
        assert again["logprobs"] == pytest.approx(cold["logprobs"], abs=1e-4)
        await until_held(config, chain, again["replica"])  # announced by the receiver's KV events
        got = await reports(handle, {again["replica"], cold["replica"]})
        receiver = got[again["replica"]]
        assert receiver["blocks_in"] >= PREFIX // BLOCK and receiver["prefix_tokens"] >= PREFIX
        assert receiver["kv_bytes_per_token"] > 0
        assert all(r["held"] == 0 for r in got.values())

    asyncio.run(main())


def test_a_holder_killed_mid_export_costs_a_prefill_not_a_request(cluster):
    import ray
    from ray.serve._private.common import DeploymentID, ReplicaID

    handle, model_dir, config, stall, exporting = cluster

    async def main():
        Path(stall).write_text("")
        try:
            cold, busy, again, _ = await past_a_busy_holder(handle, config, model_dir, seed=3, transport="actor")
            deadline = time.monotonic() + 60
            while not os.path.exists(exporting) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert Path(exporting).read_text() == cold["replica"], "the holder never began the export"
            busy = await busy  # the holder's own request ends before it dies
            before = (await reports(handle, {cold["replica"]}))
            errors_before = {rid: r["errors"] for rid, r in before.items()}
            name = ReplicaID(cold["replica"], DeploymentID("replica", APP)).to_full_id_str()
            ray.kill(ray.get_actor(name, namespace="serve"), no_restart=False)
        finally:
            os.unlink(stall)
        got = await asyncio.wait_for(again, 120)
        assert got["tokens"] == cold["tokens"] and got["cached"] == 0  # prefilled, the same tokens
        survivors = await reports(handle, {got["replica"]})
        receiver = survivors[got["replica"]]
        assert receiver["errors"] == errors_before.get(got["replica"], 0) + 1
        for report in survivors.values():  # check_integrity ran on each; nothing held or leaked
            assert report["held"] == 0 and report["used"] == 0, report

    asyncio.run(main())
