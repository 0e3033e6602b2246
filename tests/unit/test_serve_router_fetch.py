"""The Serve request router's KV-fetch wiring (router/serve_router.py, issue 33):
the ranking's fetch hint is written into the request Serve is about to send,
a replica's ``export_kv`` call is routed to the holder it names, and the
replicas' reported KV bytes per token reach the policy."""

from __future__ import annotations

import asyncio
import random

import pytest

from cluster.shared.types import GenerationRequest, SamplingParams

serve_common = pytest.importorskip("ray.serve._private.common")
router_common = pytest.importorskip("ray.serve._private.request_router.common")

BLOCK = 4
PROMPT = list(range(50 * BLOCK + 1))  # 50 full blocks and a last token


class FakeReplica:
    """The part of Serve's ``RunningReplica`` the routing loop reads."""

    def __init__(self, name: str, stats: dict) -> None:
        self.replica_id = serve_common.ReplicaID(name, serve_common.DeploymentID("d", "app"))
        self.max_ongoing_requests = 1000
        self.routing_stats = stats
        self.node_id = ""
        self.availability_zone = None
        self.multiplexed_model_ids: set = set()

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return 0


class HolderDirectory:
    """Redis-mode lookups: the holder has the whole chain, the others nothing."""

    def __init__(self, live: list[str], holder: str) -> None:
        self.live, self.holder = live, holder

    async def lookup(self, chain, contract=""):
        return {rid: len(chain) if rid == self.holder else 0 for rid in self.live}


def _router(**policy_params):
    from router.serve_router import PrefixAwareRequestRouter

    router = PrefixAwareRequestRouter(serve_common.DeploymentID("d", "app"),
                                      serve_common.DeploymentHandleSource.UNKNOWN)
    router.initialize_state(redis_url=None, block_size=BLOCK, namespace=f"fetch-{random.random()}",
                            policy="prefix_cost", policy_params=policy_params)
    return router


def _replicas(holder_prefill_tokens: int, kv_bytes_per_token: int = 0):
    """A holder with ``holder_prefill_tokens`` of prefill queued, an idle receiver."""
    busy = {"num_running": 1, "num_prefill_tokens": holder_prefill_tokens, "num_kv_blocks": 1000,
            "kv_bytes_per_token": kv_bytes_per_token, "at": 1e12}
    idle = {"num_kv_blocks": 1000, "kv_bytes_per_token": kv_bytes_per_token, "at": 1e12}
    return [FakeReplica("holder", busy), FakeReplica("receiver", idle)]


def _pending(request: GenerationRequest, method: str = "generate", kwargs=None):
    metadata = serve_common.RequestMetadata(request_id=request.request_id, internal_request_id=request.request_id,
                                            call_method=method)
    return router_common.PendingRequest(args=[request], kwargs=kwargs or {}, metadata=metadata)


def _route(router, replicas, request):
    """The ranking's ids (PendingRequest makes a future: built on the loop)."""
    router._directory = HolderDirectory([r.replica_id.unique_id for r in replicas], "holder")

    async def route():
        return await router.choose_replicas(replicas, _pending(request))

    return [r.replica_id.unique_id for rank in asyncio.run(route()) for r in rank]


def test_a_request_sent_past_a_loaded_holder_carries_the_holder_to_fetch_from():
    router = _router(fetch_bytes_per_s=1.5e9)
    request = GenerationRequest("f1", PROMPT, SamplingParams(max_tokens=1))
    request.kv_fetch_from = {"stale": "hint"}  # a previous decision's: replaced
    ranked = _route(router, _replicas(holder_prefill_tokens=2000), request)
    assert ranked[0] == "receiver"
    assert request.kv_fetch_from == {"receiver": "holder"}


def test_without_fetch_pricing_no_hint_is_written():
    router = _router()  # fetch_bytes_per_s 0: the default
    request = GenerationRequest("f2", PROMPT, SamplingParams(max_tokens=1))
    request.kv_fetch_from = {"stale": "hint"}
    _route(router, _replicas(holder_prefill_tokens=2000), request)
    assert request.kv_fetch_from == {}


def test_the_reported_kv_bytes_per_token_price_the_fetch():
    # At 1 MB per token the 200-token transfer costs ~0.13 s at 1.5 GB/s plus the holder's read:
    # ~100 prefill tokens more than at the parameter's 46 KB; a queue between the two prices flips.
    def first(kv_bytes_per_token):
        request = GenerationRequest("f3", PROMPT, SamplingParams(max_tokens=1))
        return _route(_router(fetch_bytes_per_s=1.5e9, fetch_penalty_tokens=0, fetch_overhead_s=0),
                      _replicas(holder_prefill_tokens=40, kv_bytes_per_token=kv_bytes_per_token),
                      request)[0], request.kv_fetch_from

    assert first(0) == ("receiver", {"receiver": "holder"})  # 0: not reported, the 46,080 parameter
    # The holder first; the receiver, second, keeps its hint (Serve falls back to it on a rejection).
    assert first(1_000_000) == ("holder", {"receiver": "holder"})


def test_an_export_call_goes_to_the_replica_it_names():
    router = _router()
    replicas = _replicas(holder_prefill_tokens=2000)

    async def route(holder_id, method="export_kv"):
        call = router_common.PendingRequest(
            args=[[b"h" * 16]], kwargs={"holder_id": holder_id},
            metadata=serve_common.RequestMetadata(request_id="e", internal_request_id="e", call_method=method))
        return [r.replica_id.unique_id for rank in await router.choose_replicas(replicas, call) for r in rank]

    for _ in range(5):  # by load alone the idle receiver would come first
        assert asyncio.run(route("holder")) == ["holder"]
        # A hand-over's import (workers/kv_handover.py) reaches the survivor it names too.
        assert asyncio.run(route("holder", "import_kv")) == ["holder"]
    # The holder left: any replica answers with what it holds (checked by hash), least loaded first.
    assert asyncio.run(route("gone")) == ["receiver", "holder"]
