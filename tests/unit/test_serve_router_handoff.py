"""Each routing decision goes to the request it was computed for.

Serve runs several routing tasks at once; each awaits its own directory
lookup. Here the lookups answer in a different order than the requests
arrived (the directory is a fake with per-call delays; the router is the
real ``PrefixAwareRequestRouter`` on Serve's real ``RequestRouter``), so a
router that hands a decision to the oldest pending request (Serve's
``FIFOMixin``) sends requests to the replica that holds another request's
prefix.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from cluster.shared.hashing import hash_block_chain, root_hash
from cluster.shared.types import GenerationRequest, SamplingParams

serve_common = pytest.importorskip("ray.serve._private.common")
router_common = pytest.importorskip("ray.serve._private.request_router.common")

BLOCK = 4


class FakeReplica:
    """The part of Serve's ``RunningReplica`` the routing loop reads."""

    def __init__(self, name: str) -> None:
        self.replica_id = serve_common.ReplicaID(name, serve_common.DeploymentID("d", "app"))
        self.max_ongoing_requests = 1000
        self.routing_stats: dict = {}
        self.node_id = ""
        self.availability_zone = None
        self.multiplexed_model_ids: set = set()

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return 0


class OutOfOrderDirectory:
    """Answers the i-th lookup after ``delays[i]`` seconds: the holder of the
    chain's first block holds the whole chain, nobody else anything."""

    def __init__(self, holders: dict[bytes, str], delays: list[float]) -> None:
        self.holders = holders
        self.delays = delays
        self.calls = 0

    async def lookup(self, chain: list[bytes]) -> dict[str, int]:
        delay = self.delays[self.calls % len(self.delays)]
        self.calls += 1
        await asyncio.sleep(delay)
        return {self.holders[chain[0]]: len(chain)}


def _pending(request_id: str, prompt: list[int]):
    metadata = serve_common.RequestMetadata(request_id=request_id, internal_request_id=request_id)
    request = GenerationRequest(request_id, prompt, SamplingParams(max_tokens=1))
    return router_common.PendingRequest(args=[request], kwargs={}, metadata=metadata)


async def _route_concurrently(num_replicas: int, num_requests: int, seed: int) -> list[tuple[str, str]]:
    from router.serve_router import PrefixAwareRequestRouter

    router = PrefixAwareRequestRouter(serve_common.DeploymentID("d", "app"),
                                      serve_common.DeploymentHandleSource.UNKNOWN)
    router.initialize_state(redis_url=None, block_size=BLOCK)
    replicas = [FakeReplica(f"r{i}") for i in range(num_replicas)]
    router.update_replicas(replicas)
    rng = random.Random(seed)
    root = root_hash("", "")
    prompts, holders, expected = [], {}, []
    for i in range(num_requests):
        prompt = [1000 * (i + 1) + t for t in range(4 * BLOCK)]
        holder = replicas[rng.randrange(num_replicas)].replica_id.unique_id
        holders[hash_block_chain(prompt, BLOCK, root)[0]] = holder
        prompts.append(prompt)
        expected.append(holder)
    # Later requests answer sooner: the reverse of arrival order, plus jitter.
    delays = [0.02 * (num_requests - i) + rng.uniform(0, 0.01) for i in range(num_requests)]
    router._directory = OutOfOrderDirectory(holders, delays)
    tasks = []
    for i, prompt in enumerate(prompts):
        tasks.append(asyncio.create_task(router._choose_replica_for_request(_pending(f"q{i}", prompt))))
        await asyncio.sleep(0)
    chosen = await asyncio.gather(*tasks)
    return [(want, got.replica_id.unique_id) for want, got in zip(expected, chosen)]


@pytest.mark.parametrize("num_replicas,num_requests,seed", [(2, 2, 0), (3, 12, 1), (4, 24, 2)])
def test_each_decision_goes_to_the_request_it_was_made_for(num_replicas, num_requests, seed):
    pairs = asyncio.run(_route_concurrently(num_replicas, num_requests, seed))
    wrong = [i for i, (want, got) in enumerate(pairs) if want != got]
    assert not wrong, f"requests {wrong} went to another request's replica: {pairs}"
