"""``prefixserve bench routing``: the same multi-tenant workload once per
routing policy, on one local cluster (Ray on loopback + redis-server).

Workload (seeded): ``--tenants`` tenants, each with its own long system
prompt (``--prefix-len`` tokens) and ``--questions-per-tenant`` short unique
questions; arrivals are Poisson at ``--request-rate`` requests/s in a seeded
random tenant order. Each replica's KV pool (``--num-kv-blocks``) is too
small to hold every tenant's prefix, so where a request lands decides
whether its prefix is still cached.

For each policy the replica deployment is deployed afresh (empty caches,
its own directory namespace), the workload is replayed through Serve's
request router, and per policy we report: prefix-cache hit rate (cached /
prompt tokens), TTFT and end-to-end latency P50/P95/P99, throughput and
requests per replica. Prints a table, writes JSON and a PNG (TTFT CDFs).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import statistics
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from cluster.bench import format_table, percentile

logger = logging.getLogger(__name__)

POLICIES = ("cache_aware", "round_robin", "least_load", "power_of_two")
DEFAULT_NUM_KV_BLOCKS = 160  # 5 prefixes of 512 tokens at block_size 16, for 8 tenants


def add_routing_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--policies", default="cache_aware,round_robin", help="comma-separated, in run order")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--questions-per-tenant", type=int, default=10)
    parser.add_argument("--prefix-len", type=int, default=512, help="tokens of each tenant's system prompt")
    parser.add_argument("--question-len", type=int, default=24)
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--request-rate", type=float, default=2.0, help="Poisson arrivals per second (inf: all at once)")
    parser.add_argument("--workload-seed", type=int, default=0)
    parser.add_argument("--replica-num-cpus", type=float, default=0.5)
    parser.add_argument("--json", default="bench-results/routing.json")
    parser.add_argument("--plot", default="bench-results/routing.png", help="PNG of TTFT CDFs ('' to skip)")


@dataclass
class Arrival:
    at: float
    tenant: int
    prompt: list[int]


@dataclass
class Result:
    policy: str
    ttft: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    per_replica: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    def summary(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "requests": len(self.e2e),
            "hit_rate": round(self.cached_tokens / max(1, self.prompt_tokens), 4),
            "ttft_s": _percentiles(self.ttft),
            "e2e_s": _percentiles(self.e2e),
            "requests_per_s": round(len(self.e2e) / self.seconds, 3),
            "output_tokens_per_s": round(self.output_tokens / self.seconds, 2),
            "requests_per_replica": dict(sorted(self.per_replica.items())),
        }


def make_workload(args: argparse.Namespace, vocab: int) -> list[Arrival]:
    rng = random.Random(args.workload_seed)
    usable = range(3, min(vocab, 32000))
    prefixes = [[rng.choice(usable) for _ in range(args.prefix_len)] for _ in range(args.tenants)]
    order = [t for t in range(args.tenants) for _ in range(args.questions_per_tenant)]
    rng.shuffle(order)
    at, arrivals = 0.0, []
    for tenant in order:
        question = [rng.choice(usable) for _ in range(args.question_len)]
        arrivals.append(Arrival(at, tenant, prefixes[tenant] + question))
        if args.request_rate != float("inf"):
            at += rng.expovariate(args.request_rate)
    return arrivals


async def replay(handle: Any, arrivals: list[Arrival], output_len: int, policy: str) -> Result:
    from cluster.types import GenerationRequest, SamplingParams

    result = Result(policy)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()

    async def one(i: int, arrival: Arrival) -> None:
        await asyncio.sleep(max(0.0, start + arrival.at - time.perf_counter()))
        sent = time.perf_counter()
        first: Optional[float] = None
        request = GenerationRequest(f"{policy}-{i}", arrival.prompt, params)
        async for chunk in handle.options(stream=True, method_name="generate").remote(request):
            if first is None and chunk.token_ids:
                first = time.perf_counter() - sent
            if chunk.finished:
                result.ttft.append(first if first is not None else time.perf_counter() - sent)
                result.e2e.append(time.perf_counter() - sent)
                result.prompt_tokens += chunk.prompt_tokens
                result.cached_tokens += chunk.cached_prompt_tokens
                result.output_tokens += chunk.completion_tokens
                result.per_replica[chunk.replica_id] = result.per_replica.get(chunk.replica_id, 0) + 1

    from tqdm import tqdm

    tasks = [asyncio.create_task(one(i, a)) for i, a in enumerate(arrivals)]
    with tqdm(total=len(tasks), desc=policy, unit="req") as bar:
        for task in asyncio.as_completed(tasks):
            await task
            bar.update(1)
    result.seconds = time.perf_counter() - start
    return result


def run_routing(args: argparse.Namespace, engine_args: dict[str, Any]) -> int:
    from ray import serve

    from cluster.app import build_app
    from cluster.config import ClusterConfig, EngineConfig
    from cluster.ray_local import init_local_ray
    from cluster.redis_server import RedisServer

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise ValueError(f"unknown policies {unknown}: choose from {', '.join(POLICIES)}")
    # Per replica; the default is too few blocks for every tenant's prefix.
    engine = EngineConfig.from_kwargs(**{"num_kv_blocks": DEFAULT_NUM_KV_BLOCKS, **engine_args})
    results = []
    with RedisServer() as redis_server:
        init_local_ray(num_cpus=max(2.0, args.replicas * args.replica_num_cpus))
        serve.start(proxy_location="Disabled")
        vocab = _vocab_size(engine)
        arrivals = make_workload(args, vocab)
        for policy in policies:
            config = ClusterConfig(replicas=args.replicas, replica_num_cpus=args.replica_num_cpus,
                                   redis_url=redis_server.url, namespace=f"bench-{uuid.uuid4().hex[:8]}",
                                   routing_policy=policy, engine=engine)
            name = f"bench-{policy}"
            handle = serve.run(build_app(config), name=name, route_prefix=None)
            logger.info("policy %s: %d replicas up, replaying %d requests", policy, args.replicas, len(arrivals))
            results.append(asyncio.run(replay(handle, arrivals, args.output_len, policy)))
            serve.delete(name)
        serve.shutdown()
    report = {"workload": {k: getattr(args, k) for k in (
        "replicas", "tenants", "questions_per_tenant", "prefix_len", "question_len", "output_len",
        "request_rate", "workload_seed")}, "runs": [r.summary() for r in results]}
    report["workload"]["num_kv_blocks"] = engine.cache.num_kv_blocks
    report["ratios"] = _ratios(report["runs"])
    _print_table(report)
    _write(report, results, args)
    return 0


def _vocab_size(engine: Any) -> int:
    from workers.model.loader import resolve_model

    config = json.loads((resolve_model(engine.model) / "config.json").read_text())
    return int(config["vocab_size"])


def _ratios(runs: list[dict[str, Any]]) -> dict[str, Any]:
    by = {r["policy"]: r for r in runs}
    if "cache_aware" not in by or "round_robin" not in by:
        return {}
    ca, rr = by["cache_aware"], by["round_robin"]
    return {
        "hit_rate_cache_aware_over_round_robin": round(ca["hit_rate"] / max(rr["hit_rate"], 1e-9), 2),
        "ttft_p50_round_robin_over_cache_aware": round(rr["ttft_s"]["p50"] / max(ca["ttft_s"]["p50"], 1e-9), 2),
    }


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": 0.0, "p95": 0.0, "p99": 0.0, "mean": 0.0}
    data = sorted(values)
    return {"p50": round(percentile(data, 50), 4), "p95": round(percentile(data, 95), 4),
            "p99": round(percentile(data, 99), 4), "mean": round(statistics.fmean(data), 4)}


def _print_table(report: dict[str, Any]) -> None:
    rows = [("policy", "hit rate", "TTFT p50", "p95", "p99", "e2e p50", "p99", "req/s", "per replica")]
    for r in report["runs"]:
        rows.append((r["policy"], f"{r['hit_rate']:.1%}", f"{r['ttft_s']['p50']:.3f}", f"{r['ttft_s']['p95']:.3f}",
                     f"{r['ttft_s']['p99']:.3f}", f"{r['e2e_s']['p50']:.3f}", f"{r['e2e_s']['p99']:.3f}",
                     f"{r['requests_per_s']:.2f}", " ".join(str(v) for v in r["requests_per_replica"].values())))
    lines = format_table(rows)
    for key, value in report.get("ratios", {}).items():
        lines.append(f"{key}: {value:.2f}x")
    print("\n".join(lines))  # the table is the program's output, not a log


def _write(report: dict[str, Any], results: list[Result], args: argparse.Namespace) -> None:
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    logger.info("wrote %s", path)
    if not args.plot:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for r in results:
        for ax, values, label in ((axes[0], r.ttft, "TTFT (s)"), (axes[1], r.e2e, "end-to-end (s)")):
            data = sorted(values)
            ax.plot(data, [(i + 1) / len(data) for i in range(len(data))], label=r.policy)
            ax.set_xlabel(label)
            ax.set_ylabel("fraction of requests")
    axes[0].legend()
    fig.suptitle("prefixserve bench routing: latency CDFs per policy")
    fig.tight_layout()
    Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.plot, dpi=100)
    logger.info("wrote %s", args.plot)
