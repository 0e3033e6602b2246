"""``GET /metrics`` of a running local cluster: Ray Serve with two tiny-model
replicas (block_size 4), the Redis directory, and the router's HTTP API on a
loopback port. Known traffic goes in over HTTP; the scraped values must match
what was sent and received, not just exist.

Replicas publish their series with each directory heartbeat (1 s), so every
check polls the endpoint with a bounded wait. Counters are compared as
differences between two scrapes, so the tests do not depend on each other's
traffic (they share one app).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import defaultdict
from typing import Any, Callable

import httpx2 as httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.shared.directory import Directory
from cluster.shared.hashing import hash_block_chain, root_hash
from router.backend import ModelInfo, RouterBackend
from router.metrics import ClusterMetrics, get_router_metrics
from router.openai import serve_openai
from router.tokenizer import RouterTokenizer
from tests.factories import make_tiny_model_dir
from tests.integration.router_cluster import run_bounded, serve_app
from workers.model.loader import model_fingerprint

APP = "metrics-test"
POLICY = "cache_aware"
NUM_KV_BLOCKS = 64  # per replica: two 216-token requests (54 blocks each) cannot both fit
WAIT_S = 40.0

Samples = dict[tuple[str, frozenset], float]


@pytest.fixture(scope="module")
def cluster(ray_local, redis_server, tmp_path_factory):
    """A 2-replica app; yields (handle, model_dir, redis_url, namespace)."""
    model_dir = make_tiny_model_dir("llama", tmp_path_factory.mktemp("metrics-llama"))
    namespace = f"metrics-{uuid.uuid4().hex[:6]}"
    with serve_app(APP, model_dir, redis_server.url, namespace, routing_policy=POLICY, block_size=4,
                   num_kv_blocks=NUM_KV_BLOCKS) as handle:
        yield handle, model_dir, redis_server.url, namespace


class Client:
    """An HTTP client of the router's API and its ``/metrics``."""

    def __init__(self, http: httpx.AsyncClient, base: str) -> None:
        self.http, self.base = http, base

    async def complete(self, prompt: list[int], max_tokens: int, stream: bool = False) -> dict[str, Any]:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True}
        if not stream:
            reply = await self.http.post(self.base + "/v1/completions", json=body, timeout=120)
            assert reply.status_code == 200, reply.text
            return reply.json()["usage"]
        body.update(stream=True, stream_options={"include_usage": True})
        usage = None
        async with self.http.stream("POST", self.base + "/v1/completions", json=body, timeout=120) as reply:
            assert reply.status_code == 200
            async for line in reply.aiter_lines():
                if line.startswith("data: {") and '"usage": {' in line:
                    usage = json.loads(line[len("data: "):])["usage"]
        assert usage is not None
        return usage

    async def scrape(self) -> Samples:
        reply = await self.http.get(self.base + "/metrics", timeout=30)
        assert reply.status_code == 200
        return {(s.name, frozenset(s.labels.items())): s.value
                for family in text_string_to_metric_families(reply.text) for s in family.samples}

    async def wait_for(self, predicate: Callable[[Samples], bool], what: str) -> Samples:
        deadline = time.monotonic() + WAIT_S
        while True:
            samples = await self.scrape()
            if predicate(samples):
                return samples
            if time.monotonic() > deadline:
                raise AssertionError(f"{what} not seen in /metrics within {WAIT_S:.0f}s: {summary(samples)}")
            await asyncio.sleep(0.25)


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum of ``name`` over the series whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, lbl), v in samples.items() if n == name and want <= lbl)


def by_replica(samples: Samples, name: str) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for (n, lbl), v in samples.items():
        if n == name:
            out[dict(lbl)["replica"]] += v
    return dict(out)


def replicas_in(samples: Samples) -> set[str]:
    return {dict(lbl)["replica"] for (n, lbl) in samples if n.startswith("prefixserve:") and "replica" in dict(lbl)}


def summary(samples: Samples) -> dict:
    keep = ("prompt_tokens_total", "generation_tokens_total", "kv_cache_usage_perc", "num_requests_running",
            "time_to_first_token_seconds_count", "num_preemptions_total")
    return {n: v for (n, lbl), v in samples.items() if n.endswith(keep)} | {"replicas": sorted(replicas_in(samples))}


def with_router(cluster, body: Callable[[Client], Any]) -> Any:
    """Runs ``await body(client)`` against a fresh HTTP router with ``/metrics``."""
    handle, model_dir, redis_url, namespace = cluster

    async def main() -> Any:
        router_metrics = get_router_metrics(namespace, POLICY)
        backend = RouterBackend(handle, RouterTokenizer.from_model_dir(model_dir), ModelInfo("tiny", 512),
                                metrics=router_metrics)
        directory = Directory.from_url(redis_url, namespace)
        server = await serve_openai(backend, port=0, metrics=ClusterMetrics(router_metrics, directory))
        try:
            async with httpx.AsyncClient() as http:
                base = server.url.removesuffix("/v1")
                client = Client(http, base)
                await client.wait_for(lambda s: len(replicas_in(s)) == 2, "both replicas' series")
                return await body(client)
        finally:
            await server.stop()
            await directory.aclose()

    # Serve's handle leaves tasks on this loop; one once ignored its cancellation after a replica was killed.
    return run_bounded(main())


def test_token_request_and_latency_counters_match_the_traffic(cluster):
    handle = cluster[0]
    shared = list(range(10, 30))  # 20 tokens: 4 full blocks reusable by the second request
    prompts = [(shared, 5, False), (shared, 3, False), (list(range(40, 51)), 7, True),
               (list(range(60, 66)), 1, False), (list(range(70, 99)), 9, True)]

    _, model_dir, redis_url, namespace = cluster
    chain = hash_block_chain(shared, 4, root_hash(model_fingerprint(model_dir)))

    async def listed() -> None:
        # The second shared-prefix request is routed on what the directory lists: wait for the
        # first one's blocks (KV events reach Redis a moment after its last token; on a loaded
        # machine the second request used to overtake them, miss, and land on the other replica).
        directory = Directory.from_url(redis_url, namespace)
        try:
            deadline = time.monotonic() + WAIT_S
            while max((await directory.lookup(chain)).values(), default=0) < len(chain):
                assert time.monotonic() < deadline, "the directory never listed the shared prefix"
                await asyncio.sleep(0.1)
        finally:
            await directory.aclose()

    async def body(client: Client) -> None:
        before = await client.scrape()
        usages = []
        for i, (p, n, stream) in enumerate(prompts):
            if i == 1:
                await listed()
            usages.append(await client.complete(p, n, stream))
        sent = sum(u["prompt_tokens"] for u in usages)
        received = sum(u["completion_tokens"] for u in usages)
        cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
        assert sent == sum(len(p) for p, _, _ in prompts) and received == sum(n for _, n, _ in prompts)
        assert cached > 0  # the shared prefix was hit (so the hit counter is tested with a non-zero value)

        def delta(samples: Samples, name: str, **labels: str) -> float:
            return total(samples, name, **labels) - total(before, name, **labels)

        after = await client.wait_for(
            lambda s: delta(s, "prefixserve:time_to_first_token_seconds_count") >= len(prompts)
            and delta(s, "prefixserve:generation_tokens_total") >= received,
            "the requests' token counters")
        assert delta(after, "prefixserve:time_to_first_token_seconds_count") == len(prompts)
        assert delta(after, "prefixserve:e2e_request_latency_seconds_count") == len(prompts)
        assert delta(after, "prefixserve:request_queue_time_seconds_count") == len(prompts)
        assert delta(after, "prefixserve:prompt_tokens_total") == sent
        assert delta(after, "prefixserve:generation_tokens_total") == received
        # Each request decodes (completion - 1) times after its first token.
        assert delta(after, "prefixserve:inter_token_latency_seconds_count") == received - len(prompts)
        # No preemption at this load: each prompt is looked up once.
        assert delta(after, "prefixserve:prefix_cache_queries_total") == sent
        assert delta(after, "prefixserve:prefix_cache_hits_total") == cached
        assert delta(after, "prefixserve:router_requests_total", policy=POLICY, outcome="ok") == len(prompts)
        for outcome in ("invalid", "overloaded", "unavailable", "error"):
            assert delta(after, "prefixserve:router_requests_total", outcome=outcome) == 0
        assert delta(after, "prefixserve:router_decision_seconds_count", policy=POLICY) >= len(prompts)
        ratio_sum = delta(after, "prefixserve:router_prefix_match_ratio_sum", policy=POLICY)
        assert ratio_sum > 0  # the second shared-prefix request matched its blocks

        # Idle again, prefix caches reset: no KV block in use anywhere.
        for _ in range(4):
            await handle.reset_prefix_cache.remote()
        idle = await client.wait_for(
            lambda s: set(by_replica(s, "prefixserve:kv_cache_usage_perc").values()) == {0.0}
            and total(s, "prefixserve:num_requests_running") == 0,
            "idle replicas")
        assert total(idle, "prefixserve:num_requests_waiting") == 0
        assert all(dict(lbl)["model"] == cluster[1].name for (n, lbl) in idle if n == "prefixserve:prompt_tokens_total")

    with_router(cluster, body)


def test_a_tiny_pool_forces_preemptions_and_they_are_counted(cluster):
    # 216 tokens = 54 blocks per request, 64 blocks per replica: any two that
    # run together on one replica cannot both grow to the end.
    # Twenty of them keep both replicas busy for seconds (several publish periods of 1 s: ten
    # finished within about one on this 2-core machine, and the gauges' peaks were then missed).
    prompts = [[(100 + 37 * i + j) % 500 + 3 for j in range(16)] for i in range(20)]

    async def body(client: Client) -> None:
        before = await client.scrape()
        peak = {"kv": 0.0, "running": 0.0}
        done = asyncio.Event()

        async def watch() -> None:
            while not done.is_set():
                samples = await client.scrape()
                peak["kv"] = max([peak["kv"], *by_replica(samples, "prefixserve:kv_cache_usage_perc").values()])
                peak["running"] = max(peak["running"], total(samples, "prefixserve:num_requests_running"))
                await asyncio.sleep(0.2)

        watcher = asyncio.ensure_future(watch())
        try:
            usages = await asyncio.gather(*(client.complete(p, 200) for p in prompts))
        finally:
            done.set()
            await watcher
        received = sum(u["completion_tokens"] for u in usages)
        assert received == 200 * len(prompts)

        after = await client.wait_for(
            lambda s: total(s, "prefixserve:generation_tokens_total")
            - total(before, "prefixserve:generation_tokens_total") >= received,
            "the preempted requests' tokens")
        preempted = (total(after, "prefixserve:num_preemptions_total")
                     - total(before, "prefixserve:num_preemptions_total"))
        assert preempted > 0, summary(after)
        assert (total(after, "prefixserve:generation_tokens_total")
                - total(before, "prefixserve:generation_tokens_total")) == received  # no token counted twice
        assert peak["kv"] > 0 and peak["running"] > 0, peak  # the gauges moved while the requests ran

    with_router(cluster, body)


def test_a_dead_replicas_series_disappear(cluster):
    import ray

    async def body(client: Client) -> str:
        await client.complete(list(range(5, 14)), 2)
        samples = await client.scrape()
        victim = sorted(replicas_in(samples))[0]
        actor_name = next(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                          if victim in a["name"])
        ray.kill(ray.get_actor(actor_name, namespace="serve"), no_restart=True)
        after = await client.wait_for(lambda s: victim not in replicas_in(s), f"the end of {victim}'s series")
        assert replicas_in(after)  # the survivor (and later the replacement) still report
        return victim

    with_router(cluster, body)


def test_directory_returns_metrics_of_live_replicas_only(redis_server):
    # Publish, read back, stale epochs refused, deregister and expiry remove
    # the text, gc leaves no key behind; the publisher sends metrics_fn's text.
    from cluster.shared.directory import PublishStatus
    from cluster.shared.directory.publisher import DirectoryPublisher

    async def main() -> None:
        directory = Directory.from_url(redis_server.url, f"m-{uuid.uuid4().hex[:6]}", ttl_s=1.0,
                                       unavailable_backoff_s=0)
        try:
            a, b = await directory.register("a"), await directory.register("b")
            assert await directory.publish_metrics("a", a, b"# a\n") is PublishStatus.OK
            assert await directory.publish_metrics("b", b, "# b\n") is PublishStatus.OK
            assert await directory.replica_metrics() == {"a": b"# a\n", "b": b"# b\n"}
            assert await directory.publish_metrics("a", a - 1, b"stale") is PublishStatus.SUPERSEDED
            assert await directory.deregister("a", a)
            assert await directory.publish_metrics("a", a, b"late") is PublishStatus.UNKNOWN
            assert await directory.replica_metrics() == {"b": b"# b\n"}
            await asyncio.sleep(1.5)  # b stops heartbeating: its liveness TTL (1 s) passes
            assert await directory.replica_metrics() == {}
            assert await directory.gc() == ["b"]
            assert [k async for k in directory._client.scan_iter(match=f"{directory.prefix}*")] == []

            publisher = DirectoryPublisher(directory, "c", lambda: (0, []), heartbeat_s=0.2,
                                           metrics_fn=lambda: b"# c\n")
            await publisher.start()  # publishes once at start, then with each heartbeat
            assert await directory.replica_metrics() == {"c": b"# c\n"}
            await publisher.stop()
            assert await directory.replica_metrics() == {}
        finally:
            await directory.aclose()

    asyncio.run(main())


def test_with_two_routers_each_replica_series_is_exported_once(cluster):
    """Prometheus scrapes every router: the replicas' series must come from one
    of them only, so ``sum()`` over a replica counter across the scrapes equals
    the replica's own count; when that router stops, another takes over."""
    from router.metrics import RouterMetrics

    async def traffic(client: Client) -> None:
        await client.complete([5, 6, 7, 8, 9], 4)

    with_router(cluster, traffic)  # its router released the lease when it stopped
    _, _, redis_url, namespace = cluster

    def per_replica(text: bytes, name: str = "prefixserve:generation_tokens_total") -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for family in text_string_to_metric_families(text.decode() if isinstance(text, bytes) else text):
            for s in family.samples:
                if s.name == name and "replica" in s.labels:
                    out[s.labels["replica"]] += s.value
        return dict(out)

    def exporter_flag(text: bytes) -> float:
        return per_replica(text, "prefixserve:router_metrics_exporter").get("", 0.0) or next(
            (s.value for f in text_string_to_metric_families(text.decode()) for s in f.samples
             if s.name == "prefixserve:router_metrics_exporter"), 0.0)

    async def main() -> None:
        own_dir = Directory.from_url(redis_url, namespace)
        routers = [ClusterMetrics(RouterMetrics(POLICY), Directory.from_url(redis_url, namespace)) for _ in range(2)]
        try:
            async def own_counts() -> dict[str, float]:
                own: dict[str, float] = {}
                for text in (await own_dir.replica_metrics()).values():
                    own.update(per_replica(text))
                return own

            # Read the replicas' own counts before and after the two scrapes: the last
            # request's tokens reach the directory with a heartbeat (1 s), so retry until
            # nothing moved over more than a heartbeat (a shorter window let a late one land
            # after it and change the counts the new lease holder exports below).
            deadline = time.monotonic() + WAIT_S
            while True:
                own = await own_counts()
                texts = [await r.render() for r in routers]
                await asyncio.sleep(1.5)
                if own == await own_counts() or time.monotonic() > deadline:
                    break
            assert len(own) == 2 and sum(own.values()) > 0
            summed: dict[str, float] = defaultdict(float)
            for text in texts:
                for replica, value in per_replica(text).items():
                    summed[replica] += value
            assert dict(summed) == own  # each replica once: the dashboard's sum() is the replica's own count
            flags = [exporter_flag(t) for t in texts]
            assert sorted(flags) == [0.0, 1.0]
            holder = flags.index(1.0)
            await routers[holder].release()  # that router stops
            other = routers[1 - holder]
            again = await other.render()
            assert per_replica(again) == own and exporter_flag(again) == 1.0
            assert per_replica(await routers[holder].render()) == {}  # the lease stays with the new holder
        finally:
            for r in routers:
                await r.release()
                await r.directory.aclose()
            await own_dir.aclose()

    asyncio.run(main())
