"""``prefixserve bench router``: what the router itself costs.

Replicas here answer at once (``EchoReplica``: one chunk, no model), so
everything measured is router work. Four measurements, in one run:

1. **Decision** (in this process): what routing costs one request --
   tokenizing the text prompt (``router.tokenizer``), its block-hash chain,
   the directory lookup in the router's local index (and, for comparison,
   one Lua lookup in real Redis) and the decision core's ranking, as
   ``router.server`` and ``router.serve_router`` do them -- P50/P99 over
   ``--decisions`` requests. The directory holds
   ``--cached-blocks`` entries per replica, and the requests' system
   prompts are among them, so lookups walk real matches.
2. **Routed requests** through the whole gRPC router (``RouterServer`` +
   ``RouterBackend`` + Serve handle with our ``RequestRouter`` +
   ``EchoReplica``), run in a child process pinned to one core; the client
   drives ``--concurrency`` streams from the other core (with Ray's
   processes). Requests/s and client-side latency P50/P99.
3. **Baselines**: the same client load against the same gRPC front end in
   the same kind of child process (a) whose backend answers at once without
   Serve or routing (tokenization and validation still run), and (b) whose
   Serve handle uses Serve's default request router (power of two choices,
   no directory) in front of the same echo replicas. routed / (a) is the
   price of routing plus the Serve hop; routed / (b) the price of our
   prefix-aware routing alone.
4. **Before**: the routed front end as it was before Serve's gRPC transport
   (``replica_transport="actor"``, Serve's router on its own thread) and the
   tokenizer's segment cache, for the ratio of router CPU per request.

Each front end's own CPU time (all its threads, from ``psutil``) over the
timed requests gives **router CPU ms per request** and requests per router
CPU-second: what one core of router buys, whatever the client and Ray do on
the other core. The decision is also split into tokenizing and the rest.

Prints a table and writes JSON (``--json``). On a 2-core machine the client,
Ray and the router share the cores: read the ratio, not the absolute rates.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import statistics
import time
import uuid
from pathlib import Path
from typing import Any, AsyncIterator

from cluster.client.table import format_table, percentile
from cluster.shared.types import FinishReason, GenerationRequest, StreamChunk
from cluster.bench.router_front import APP, run_front_end

logger = logging.getLogger(__name__)

FINGERPRINT = "bench-router"


def add_router_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", type=int, default=2, help="echo replicas behind the router")
    parser.add_argument("--policy", default="prefix_cost")
    parser.add_argument("--requests", type=int, default=1500, help="routed requests (and as many baseline ones)")
    parser.add_argument("--concurrency", type=int, default=16, help="client streams in flight")
    parser.add_argument("--decisions", type=int, default=2000, help="isolated routing decisions to time")
    parser.add_argument("--tenants", type=int, default=16, help="distinct system prompts")
    parser.add_argument("--prefix-words", type=int, default=400, help="words of each system prompt (~1.3 tokens each)")
    parser.add_argument("--cached-blocks", type=int, default=4096, help="directory entries per replica")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default="bench-results/router.json")


class EchoReplica:
    """A replica that answers every request at once with one token.

    It registers in the directory like a real replica and publishes a
    "cache" of ``num_blocks`` hashes: the chains of a random
    ``1 / num_replicas`` of the tenants, plus random filler, so the router's
    lookups find real matches.
    """

    def __init__(self, redis_url: str, namespace: str, chains: list[list[bytes]], num_blocks: int,
                 num_replicas: int, seed: int) -> None:
        from ray import serve

        self.replica_id = serve.get_replica_context().replica_id.unique_id
        rng = random.Random(f"{seed}-{self.replica_id}")
        held = [chain for chain in chains if rng.random() < 1.0 / num_replicas]
        self._hashes = [h for chain in held for h in chain]
        self._hashes += [rng.randbytes(16) for _ in range(max(0, num_blocks - len(self._hashes)))]
        self._redis_url, self._namespace = redis_url, namespace
        self._publisher: Any = None
        self._started = False

    async def _ensure_published(self) -> None:
        if self._started:
            return
        from cluster.shared.directory import Directory
        from cluster.shared.directory.publisher import DirectoryPublisher

        self._started = True
        directory = Directory.from_url(self._redis_url, self._namespace)
        self._publisher = DirectoryPublisher(directory, self.replica_id, lambda: (0, self._hashes))
        await self._publisher.start()

    async def publish(self) -> str:
        """Registers and publishes this replica's block hashes; returns its id."""
        await self._ensure_published()
        return self.replica_id

    async def generate(self, request: GenerationRequest) -> AsyncIterator[StreamChunk]:
        yield StreamChunk(request.request_id, [1], "x", FinishReason.LENGTH, prompt_tokens=len(request.prompt_token_ids),
                          completion_tokens=1, replica_id=self.replica_id)

    def record_routing_stats(self) -> dict[str, Any]:
        return {"replica_id": self.replica_id, "num_running": 0, "num_waiting": 0, "num_swapped": 0,
                "kv_cache_usage": 0.0, "num_cached_blocks": len(self._hashes)}


def _make_prompts(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    rng = random.Random(args.seed)
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet",
             "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango"]
    systems = [" ".join(rng.choice(words) for _ in range(args.prefix_words)) for _ in range(args.tenants)]
    questions = [f"{systems[rng.randrange(args.tenants)]}\nQuestion {i}: {rng.choice(words)} {rng.choice(words)}?"
                 for i in range(args.requests)]
    return systems, questions


def _time_decisions(args: argparse.Namespace, tokenizer: Any, redis_url: str, namespace: str,
                    prompts: list[str]) -> dict[str, Any]:
    """Tokenize + hash chain + directory lookup + the decision core, as a request's
    routing does it: with the router's local index (the default) and with one
    Lua lookup per request (``directory_lookup="redis"``).

    With the index, a decision is timed in this thread's CPU time
    (``time.thread_time``): Ray's processes share this core, and being
    preempted by them is not the decision's cost. The Lua lookup waits for
    Redis, so it is timed on the wall clock."""
    from cluster.shared.directory import Directory
    from cluster.shared.directory.follower import IndexFollower
    from router.decision import RoutingCore
    from router.policies import ReplicaView, get_policy

    async def main() -> dict[str, list[float]]:
        directory = Directory.from_url(redis_url, namespace)
        follower = IndexFollower(Directory.from_url(redis_url, namespace, socket_timeout_s=5.0))
        await follower.full_sync()
        ids = sorted(await directory.live_replicas())
        samples: dict[str, list[float]] = {"index": [], "redis": [], "tokenize": [], "routing": [], "wall": []}
        try:
            for mode in ("index", "redis"):
                core = RoutingCore(get_policy(args.policy), args.block_size)
                clock = time.thread_time if mode == "index" else time.perf_counter
                for prompt in prompts:
                    wall = time.perf_counter()
                    began = clock()
                    token_ids = tokenizer.encode(prompt)
                    tokenized = clock()
                    chain = tokenizer.block_hashes(token_ids, FINGERPRINT, "", args.block_size)
                    counts = follower.lookup(chain) if mode == "index" else await directory.lookup(chain)
                    core.decide(chain, len(token_ids), ids, counts, lambda rid, m: ReplicaView(rid, matched_blocks=m))
                    done = clock()
                    samples[mode].append(done - began)
                    if mode == "index":
                        samples["tokenize"].append(tokenized - began)
                        samples["routing"].append(done - tokenized)
                        samples["wall"].append(time.perf_counter() - wall)
        finally:
            await follower.directory.aclose()
            await directory.aclose()
        return samples

    out = {}
    for mode, data in asyncio.run(main()).items():
        data.sort()
        out[mode] = {"count": len(data), "p50_ms": round(percentile(data, 50) * 1e3, 3),
                     "p99_ms": round(percentile(data, 99) * 1e3, 3), "mean_ms": round(statistics.fmean(data) * 1e3, 3)}
    return {**out["index"], "clock": "thread CPU", "redis_lookup": out["redis"], "tokenize": out["tokenize"],
            "routing_only": out["routing"], "wall_clock": out["wall"]}


def run_router_bench(args: argparse.Namespace) -> int:
    import ray
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from cluster.shared.ray_local import init_local_ray
    from cluster.launch.redis_server import RedisServer
    from router.serve_router import PrefixAwareRequestRouter
    from router.tokenizer import RouterTokenizer
    from workers.model.loader import resolve_model

    model_dir = str(resolve_model(None))
    tokenizer = RouterTokenizer.from_model_dir(model_dir)
    systems, prompts = _make_prompts(args)
    chains = [tokenizer.block_hashes(tokenizer.encode(s), FINGERPRINT, "", args.block_size) for s in systems]
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) > 1:  # the client, Ray and the echo replicas on the other cores; the router gets cpus[0]
        os.sched_setaffinity(0, set(cpus[1:]))
    namespace = f"bench-router-{uuid.uuid4().hex[:6]}"
    with RedisServer() as redis_server:
        init_local_ray(num_cpus=4)
        try:
            serve.start(proxy_location="Disabled")
            router_config = RequestRouterConfig(
                request_router_class=PrefixAwareRequestRouter,
                request_router_kwargs={"redis_url": redis_server.url, "namespace": namespace, "policy": args.policy,
                                       "block_size": args.block_size, "model_fingerprint": FINGERPRINT},
                request_routing_stats_period_s=1.0,
            )
            options = {"num_replicas": args.replicas, "ray_actor_options": {"num_cpus": 0.1},
                       "max_ongoing_requests": 1024, "logging_config": {"enable_access_log": False}}
            bound = (redis_server.url, namespace, chains, args.cached_blocks, args.replicas, args.seed)
            echo = serve.deployment(EchoReplica).options(name="echo", request_router_config=router_config, **options)
            plain = serve.deployment(EchoReplica).options(name="echo-default", **options)
            # The plain one (Serve's default router) shares the directory namespace; it never publishes.
            serve.run(serve.deployment(_Pair).options(name="pair").bind(echo.bind(*bound), plain.bind(*bound)), name=APP, route_prefix=None)
            _publish_all(serve.get_deployment_handle("echo", app_name=APP), args.replicas)
            logger.info("timing %d routing decisions", args.decisions)
            decision = _time_decisions(args, tokenizer, redis_server.url, namespace,
                                       [prompts[i % len(prompts)] for i in range(args.decisions)])
            gcs = ray.get_runtime_context().gcs_address
            warmup = prompts[: min(100, len(prompts))]
            baseline = run_front_end(None, model_dir, None, prompts, args.concurrency, warmup)
            serve_default = run_front_end("echo-default", model_dir, gcs, prompts, args.concurrency, warmup)
            routed = run_front_end("echo", model_dir, gcs, prompts, args.concurrency, warmup)
            # The router as it was before the gRPC transport, its own loop and the segment cache, for the ratio.
            before = run_front_end("echo", model_dir, gcs, prompts, args.concurrency, warmup,
                                    transport="actor", segment_cache=False, same_loop=False)
            serve.delete(APP)
        finally:
            serve.shutdown()
            ray.shutdown()
    report = {"settings": {k: getattr(args, k) for k in ("replicas", "policy", "requests", "concurrency", "tenants",
                                                         "prefix_words", "cached_blocks", "block_size", "seed")},
              "prompt_tokens_mean": round(statistics.fmean(len(tokenizer.encode(p)) for p in prompts[:200]), 1),
              "decision": decision, "routed": routed, "baseline": baseline, "serve_default_router": serve_default,
              "routed_before": before,
              "router_cpu_before_over_routed": round(
                  before["router_cpu_ms_per_request"] / max(routed["router_cpu_ms_per_request"], 1e-9), 3),
              "routed_over_baseline_throughput": round(routed["requests_per_s"] / max(baseline["requests_per_s"], 1e-9), 3),
              "routed_over_serve_default_throughput": round(
                  routed["requests_per_s"] / max(serve_default["requests_per_s"], 1e-9), 3)}
    _print(report)
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    logger.info("wrote %s", path)
    return 0 if routed["errors"] == baseline["errors"] == serve_default["errors"] == before["errors"] == 0 else 1


class _Pair:
    """Ingress that only holds both echo deployments in one application."""

    def __init__(self, routed: Any, plain: Any) -> None:
        self.routed, self.plain = routed, plain

    async def ping(self) -> bool:
        return True


def _publish_all(handle: Any, replicas: int, timeout: float = 60.0) -> None:
    """Makes every echo replica register and publish (Serve picks replicas; ask until all did)."""
    seen: set[str] = set()
    deadline = time.monotonic() + timeout
    while len(seen) < replicas and time.monotonic() < deadline:
        seen.update(handle.publish.remote().result(timeout_s=30) for _ in range(replicas * 2))
    if len(seen) < replicas:
        raise TimeoutError(f"only {len(seen)} of {replicas} echo replicas published their blocks")
    time.sleep(1.5)  # routing stats reach the request router every second


def _print(report: dict[str, Any]) -> None:
    d, r, b, p = report["decision"], report["routed"], report["baseline"], report["serve_default_router"]

    def front(label: str, m: dict[str, Any]) -> tuple[str, ...]:
        return (label, f"{m['requests_per_s']:.0f}", f"{m['router_cpu_ms_per_request']:.2f}",
                f"{m['requests_per_router_cpu_s']:.0f}", f"{m['latency_ms']['p50']:.2f}",
                f"{m['latency_ms']['p99']:.2f}", str(m["errors"]))

    def timing(label: str, m: dict[str, Any]) -> tuple[str, ...]:
        return (label, "", "", "", f"{m['p50_ms']:.3f}", f"{m['p99_ms']:.3f}", "")

    rows = [("measurement", "req/s", "router CPU ms/req", "req/router CPU-s", "P50 ms", "P99 ms", "errors"),
            timing("routing decision, CPU (tokenize + hash + local index + policy)", d),
            timing("  of which tokenizing the prompt (segment cache)", d["tokenize"]),
            timing("  of which hash chain + local index + policy", d["routing_only"]),
            timing("  the same on the wall clock (Ray shares this core)", d["wall_clock"]),
            timing("routing decision, one Lua lookup instead of the index (wall)", d["redis_lookup"]),
            front("gRPC front end, answers at once (baseline)", b),
            front("gRPC -> Serve (its default router) -> echo", p),
            front("gRPC router -> Serve -> echo replica", r),
            front("the same as before: actor tasks, Serve's thread, no segment cache", report["routed_before"])]
    lines = format_table(rows)
    lines.append(f"routed / baseline throughput: {report['routed_over_baseline_throughput']:.2f}x "
                 f"(prompts ~{report['prompt_tokens_mean']:.0f} tokens)")
    lines.append(f"routed / Serve's default router: {report['routed_over_serve_default_throughput']:.2f}x")
    lines.append(f"requests per router CPU-second, routed / before: {report['router_cpu_before_over_routed']:.2f}x")
    print("\n".join(lines))  # the table is the program's output, not a log
