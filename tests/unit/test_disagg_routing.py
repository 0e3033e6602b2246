"""Disaggregated prefill's routing (router/policies/disagg.py and its use in
router/serve_router.py): roles from the replicas' Serve ranks, decode replicas
first with the prefill replica hinted, and a ``prefill_kv`` call routed to the
replica it names."""

from __future__ import annotations

import asyncio
import random

import pytest

from cluster.shared.types import GenerationRequest, SamplingParams, LoRARequest
from router.policies.base import Ranking
from router.policies.disagg import pair, role_of

serve_common = pytest.importorskip("ray.serve._private.common")
router_common = pytest.importorskip("ray.serve._private.request_router.common")

BLOCK = 4
PROMPT = list(range(10 * BLOCK + 1))  # 10 transferable blocks


def test_roles_from_ranks():
    assert [role_of(r, 0) for r in (0, 1, None)] == ["both"] * 3  # off: today's behaviour
    assert [role_of(r, 1) for r in (0, 1, 2, None)] == ["prefill", "decode", "decode", "decode"]
    assert [role_of(r, 2) for r in (0, 1, 2)] == ["prefill", "prefill", "decode"]


def test_decode_replicas_first_each_hinted_to_the_policys_best_prefill_replica():
    roles = {"p1": "prefill", "p2": "prefill", "d1": "decode", "d2": "decode"}
    got = pair(Ranking(["p2", "d1", "p1", "d2"]), roles, {"d2": 10}, len(PROMPT), BLOCK)
    assert got.replica_ids == ["d1", "d2", "p2", "p1"]
    # d2 holds all 10 transferable blocks: it hits locally, no hint.
    assert dict(got.fetch_from) == {"d1": "p2"} and got.prefill_first


def test_off_or_a_missing_role_leaves_the_ranking_as_it_is():
    ranking = Ranking(["a", "b"], {"b": "a"})
    for roles in ({"a": "prefill", "b": "prefill"}, {"a": "decode", "b": "decode"}, {}):
        got = pair(ranking, roles, {}, len(PROMPT), BLOCK)
        assert (got.replica_ids, dict(got.fetch_from), got.prefill_first) == (["a", "b"], {"b": "a"}, False)


def test_short_prompts_and_adapters_get_no_hint():
    roles = {"p": "prefill", "d": "decode"}
    short = pair(Ranking(["p", "d"]), roles, {}, BLOCK, BLOCK)  # one block: the last token's, computed on d
    lora = pair(Ranking(["p", "d"]), roles, {}, len(PROMPT), BLOCK, has_adapter=True)
    for got in (short, lora):
        assert got.replica_ids == ["d", "p"] and not got.fetch_from and not got.prefill_first


class FakeReplica:
    def __init__(self, name: str, rank=None) -> None:
        self.replica_id = serve_common.ReplicaID(name, serve_common.DeploymentID("d", "app"))
        self.max_ongoing_requests = 1000
        self.routing_stats = {"num_kv_blocks": 1000, "at": 1e12}
        self.replica_metadata = {} if rank is None else {"rank": rank}
        self.node_id = ""
        self.availability_zone = None
        self.multiplexed_model_ids: set = set()


class NoneHeld:
    async def lookup(self, chain, contract=""):
        return {"r0": 0, "r1": 0, "r2": 0}


def _router(prefill_replicas: int):
    from router.serve_router import PrefixAwareRequestRouter

    router = PrefixAwareRequestRouter(serve_common.DeploymentID("d", "app"),
                                      serve_common.DeploymentHandleSource.UNKNOWN)
    router.initialize_state(redis_url=None, block_size=BLOCK, namespace=f"disagg-{random.random()}",
                            policy="prefix_cost", prefill_replicas=prefill_replicas)
    router._directory = NoneHeld()
    return router


def _route(router, replicas, args, method="generate", kwargs=None):
    metadata = serve_common.RequestMetadata(request_id="x", internal_request_id="x", call_method=method)

    async def route():
        pending = router_common.PendingRequest(args=args, kwargs=kwargs or {}, metadata=metadata)
        return await router.choose_replicas(replicas, pending)

    return [r.replica_id.unique_id for rank in asyncio.run(route()) for r in rank]


def test_the_serve_router_sends_the_request_to_a_decode_replica_with_the_prefill_replica_named():
    replicas = [FakeReplica("r0", rank=0), FakeReplica("r1", rank=1), FakeReplica("r2", rank=2)]
    request = GenerationRequest("g", PROMPT, SamplingParams(max_tokens=4))
    ranked = _route(_router(prefill_replicas=1), replicas, [request])
    assert ranked[-1] == "r0" and set(ranked[:2]) == {"r1", "r2"}
    assert request.kv_fetch_from == {"r1": "r0", "r2": "r0"} and request.kv_prefill_first
    # Off (the default): the ranking is the policy's, no hint, no prefill first.
    plain = GenerationRequest("h", PROMPT, SamplingParams(max_tokens=4))
    _route(_router(prefill_replicas=0), replicas, [plain])
    assert plain.kv_fetch_from == {} and not plain.kv_prefill_first
    lora = GenerationRequest("l", PROMPT, SamplingParams(max_tokens=4), lora_request=LoRARequest("a", 1, "/x"))
    assert _route(_router(prefill_replicas=1), replicas, [lora])[-1] == "r0" and not lora.kv_prefill_first


def test_a_prefill_kv_call_goes_to_the_replica_it_names():
    replicas = [FakeReplica("r0", rank=0), FakeReplica("r1", rank=1)]
    for target in ("r0", "r1"):
        assert _route(_router(1), replicas, [[1, 2, 3], ""], method="prefill_kv",
                      kwargs={"holder_id": target}) == [target]


def test_prefill_replicas_in_the_config_must_leave_a_decode_replica_and_reach_the_router():
    from cluster.app.builder import request_router_config
    from cluster.shared.config import ClusterConfig

    config = ClusterConfig.from_dict({"replicas": 2, "prefill_replicas": 1})
    assert config.prefill_replicas == 1 and ClusterConfig().prefill_replicas == 0
    assert request_router_config(config).request_router_kwargs["prefill_replicas"] == 1
    with pytest.raises(ValueError, match="prefill_replicas"):
        ClusterConfig(replicas=2, prefill_replicas=2)
    with pytest.raises(ValueError, match="prefill_replicas"):
        ClusterConfig.from_dict({"replicas": 3, "prefill_replicas": 2,
                                 "autoscaling": {"min_replicas": 2, "max_replicas": 4}})
    multi = ClusterConfig.from_dict({"models": [{"name": "a", "replicas": 3, "prefill_replicas": 1}]})
    assert multi.models_by_name()["a"].prefill_replicas == 1


def test_up_takes_prefill_replicas_from_its_flag():
    from cluster.cli import build_parser, up_config

    parser = build_parser()
    assert up_config(parser.parse_args(["up"])).prefill_replicas == 0
    assert up_config(parser.parse_args(["up", "--replicas", "3", "--prefill-replicas", "1"])).prefill_replicas == 1
    with pytest.raises(ValueError, match="prefill_replicas"):
        up_config(parser.parse_args(["up", "--prefill-replicas", "1"]))  # one replica: none left to decode
