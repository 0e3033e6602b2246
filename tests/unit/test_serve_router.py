"""The Serve request router (router/serve_router.py) with a fake directory.

Each routing decision goes to the request it was computed for.

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

    async def lookup(self, chain: list[bytes], contract: str = "") -> dict[str, int]:
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


class ContractDirectory:
    """Every replica holds the whole chain; ``refused`` ones differ in contract."""

    def __init__(self, replica_ids: list[str], refused: set[str], theirs: str) -> None:
        self.replica_ids, self.refused, self.theirs = replica_ids, refused, theirs
        self.contracts_asked: list[str] = []

    async def lookup(self, chain, contract=""):
        return {rid: -1 if rid in self.refused else len(chain) for rid in self.replica_ids}

    async def replica_contract(self, replica_id):
        self.contracts_asked.append(replica_id)
        return self.theirs


def test_replica_with_another_cache_contract_is_refused(caplog):
    from cluster.shared.contract import CacheContract
    from router.serve_router import PrefixAwareRequestRouter

    ours = CacheContract(BLOCK, "model", "tok-a")
    router = PrefixAwareRequestRouter(serve_common.DeploymentID("d", "app"),
                                      serve_common.DeploymentHandleSource.UNKNOWN)
    router.initialize_state(redis_url=None, block_size=BLOCK, namespace=f"contract-{random.random()}",
                            cache_contract=ours.encode())
    replicas = [FakeReplica(f"c{i}") for i in range(3)]
    ids = [r.replica_id.unique_id for r in replicas]
    theirs = CacheContract(BLOCK, "model", "tok-b").encode()
    router._directory = ContractDirectory(ids, {ids[0], ids[2]}, theirs)
    prompt = list(range(4 * BLOCK))

    async def route_all():
        return [await router.choose_replicas(replicas, _pending(f"k{i}", prompt)) for i in range(3)]

    with caplog.at_level("WARNING", logger="router.serve_router"):
        rankings = asyncio.run(route_all())
    # Only the compatible replica is ranked, every time; the refused ones are
    # named once each with the field that differs, and the gauge counts them.
    assert all([[r.replica_id.unique_id for r in rank] for rank in ranking] == [[ids[1]]] for ranking in rankings)
    warnings = [r.getMessage() for r in caplog.records if "refusing replica" in r.getMessage()]
    assert len(warnings) == 2 and all("tokenizer: tok-a != tok-b" in w for w in warnings)
    assert sorted(router._directory.contracts_asked) == sorted([ids[0], ids[2]])
    assert router._metrics.refused_replicas._value.get() == 2

    # All refused: the router still routes (on load) rather than drop requests.
    router._directory.refused = set(ids)
    async def route_one():
        return await router.choose_replicas(replicas, _pending("all", prompt))

    ranking = asyncio.run(route_one())
    assert sorted(r.replica_id.unique_id for rank in ranking for r in rank) == sorted(ids)


class BrokenDirectory:
    async def lookup(self, chain, contract=""):
        raise RuntimeError("a bug, not an outage")


def test_a_failing_decision_falls_back_to_load_instead_of_hanging():
    from router.serve_router import PrefixAwareRequestRouter

    router = PrefixAwareRequestRouter(serve_common.DeploymentID("d", "app"),
                                      serve_common.DeploymentHandleSource.UNKNOWN)
    router.initialize_state(redis_url=None, block_size=BLOCK)
    replicas = [FakeReplica("x"), FakeReplica("y")]
    router._directory = BrokenDirectory()

    async def route():
        router.update_replicas(replicas)
        return await asyncio.wait_for(router._choose_replica_for_request(_pending("b", list(range(16)))), 10)

    assert asyncio.run(route()).replica_id.unique_id in {"x", "y"}


class LiveDirectory:
    """Redis-mode lookups: every live replica named, the holder with the whole chain."""

    def __init__(self, live: list[str], holder: str) -> None:
        self.live, self.holder = live, holder

    async def lookup(self, chain, contract=""):
        return {rid: len(chain) if rid == self.holder else 0 for rid in self.live}


def test_replicas_the_directory_lists_as_dead_are_routed_around(caplog):
    from router.serve_router import PrefixAwareRequestRouter

    router = PrefixAwareRequestRouter(serve_common.DeploymentID("d", "app"),
                                      serve_common.DeploymentHandleSource.UNKNOWN)
    router.initialize_state(redis_url=None, block_size=BLOCK, namespace=f"live-{random.random()}")
    replicas = [FakeReplica(f"l{i}") for i in range(3)]
    ids = [r.replica_id.unique_id for r in replicas]
    prompt = list(range(4 * BLOCK))

    async def ranked():
        return [r.replica_id.unique_id for rank in await router.choose_replicas(replicas, _pending("x", prompt))
                for r in rank]

    # ids[0] holds the prefix but stopped heartbeating (a stalled node): Serve still offers it.
    router._directory = LiveDirectory(ids[1:], holder=ids[0])
    with caplog.at_level("WARNING", logger="router.serve_router"):
        assert sorted(asyncio.run(ranked())) == sorted(ids[1:])
    assert any("no longer lists as live: " + ids[0] in r.getMessage() for r in caplog.records)
    router._directory = LiveDirectory([], holder=ids[0])  # lists none: cannot tell, route to every candidate
    assert sorted(asyncio.run(ranked())) == sorted(ids)
    router._directory = LiveDirectory(ids, holder=ids[0])  # back: the holder first again
    assert asyncio.run(ranked())[0] == ids[0]


def test_a_continuation_avoids_the_replica_it_left_for_silence():
    """A stream that migrated because its replica went silent names that replica;
    the directory still lists it live (its TTL has not lapsed), the router skips it."""
    import dataclasses

    from router.serve_router import PrefixAwareRequestRouter

    router = PrefixAwareRequestRouter(serve_common.DeploymentID("d", "app"),
                                      serve_common.DeploymentHandleSource.UNKNOWN)
    router.initialize_state(redis_url=None, block_size=BLOCK, namespace=f"avoid-{random.random()}")
    replicas = [FakeReplica(f"a{i}") for i in range(2)]
    ids = [r.replica_id.unique_id for r in replicas]
    router._directory = LiveDirectory(ids, holder=ids[0])

    async def ranked(avoid):
        pending = _pending("x", list(range(4 * BLOCK)))
        pending.args[0] = dataclasses.replace(pending.args[0], avoid_replica_ids=avoid)
        return [r.replica_id.unique_id for rank in await router.choose_replicas(replicas, pending) for r in rank]

    assert asyncio.run(ranked(()))[0] == ids[0]  # the holder first
    assert asyncio.run(ranked((ids[0],))) == [ids[1]]
    assert sorted(asyncio.run(ranked(tuple(ids)))) == sorted(ids)  # none left: every candidate
