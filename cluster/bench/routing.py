"""``prefixserve bench routing``: the same multi-tenant workload once per
routing policy, each on a fresh local cluster (Ray on loopback + redis-server
+ the gRPC router), measured by ``bench serve``'s runner.

Workload (seeded, ``bench serve``'s shared-prefix dataset): ``--tenants``
tenants, each with its own long system prompt (``--prefix-len`` tokens) and
``--questions-per-tenant`` short unique questions, in a seeded random order;
arrivals are Poisson at ``--request-rate`` requests/s. Each replica's KV pool
(``--num-kv-blocks``, default ``DEFAULT_PREFIXES_PER_REPLICA`` system prompts'
worth plus room for the requests in flight) holds fewer than half of the
tenants' prefixes, so where a request lands decides whether its prefix is
still cached: a policy that keeps each tenant on one replica turns the two
pools into one cache twice as big, one that spreads tenants over both keeps
two copies of each and pays every tenant's first miss on each replica.

For each policy the cluster is started afresh (empty caches, its own
directory namespace) and the workload is sent over gRPC by
``cluster.bench.serve.run_requests`` (the one code path that sends and
measures requests). Per policy we report the prefix-cache hit rate (cached /
prompt tokens, from each request's Usage), the hit rate over the system
prompts alone, TTFT and end-to-end latency P50/P95/P99, throughput and
requests per replica; and the ratios of cache_aware to round_robin. Prints a
table, writes JSON and a PNG (latency CDFs, tokens/s over time).

KV transfers (``cluster/bench/routing_transfers.py``): ``--transfers off,on``
runs each policy without and with fetch pricing (``<policy>+fetch``) and
reports the replicas' transfer figures and the TTFT ratios; ``--tenant-zipf``
skews the tenants' shares (a few hot system prompts). ``--transfers
off,on,off,on`` alternates the settings in rounds (labelled ``#2``, ...): the
ratios are then also taken over every round's requests pooled. ``--warm-tenants``
sends each system prompt once before the timed requests, so the hot prompts
have holders when the skewed load starts.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import uuid
from typing import Any

from cluster.bench.routing_transfers import (add_transfer_args, pooled_rounds, read_transfer_figures, round_label,
                                             skewed_dataset, transfer_ratios, transfer_settings, warm_tenants,
                                             with_fetches)
from cluster.client.table import format_table
from cluster.shared.sizes import cdiv

logger = logging.getLogger(__name__)

POLICIES = ("cache_aware", "prefix_cost", "round_robin", "least_load", "power_of_two")
DEFAULT_PREFIXES_PER_REPLICA = 0.4  # of --tenants: a pool that holds fewer than half of the prefixes
DEFAULT_IN_FLIGHT_BLOCKS = 16  # room for the questions and answers of the requests in flight


def add_routing_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--policies", default="cache_aware,prefix_cost,round_robin",
                        help="comma-separated, in run order")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--tenants", type=int, default=12)
    parser.add_argument("--questions-per-tenant", type=int, default=4)
    parser.add_argument("--prefix-len", type=int, default=512, help="tokens of each tenant's system prompt")
    parser.add_argument("--question-len", type=int, default=24)
    parser.add_argument("--output-len", type=int, default=8)
    # 0.15/s keeps 2 CPU-only replicas of the default model unsaturated (a 512-token
    # prefill takes ~1.5 s there), so the figures compare caching, not queueing.
    parser.add_argument("--request-rate", type=float, default=0.15,
                        help="Poisson arrivals per second (inf: all at once; default 0.15)")
    parser.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (default: no cap)")
    parser.add_argument("--prefixes-per-replica", type=float, default=DEFAULT_PREFIXES_PER_REPLICA,
                        help="KV pool per replica, in tenants' system prompts as a fraction of --tenants "
                             "(default 0.4: fewer than half fit; >= 1: all fit in every pool); "
                             "--num-kv-blocks overrides it")
    parser.add_argument("--workload-seed", type=int, default=0)
    parser.add_argument("--replica-num-cpus", type=float, default=0.5)
    parser.add_argument("--json", default="bench-results/routing.json")
    parser.add_argument("--plot", default="bench-results/routing.png", help="PNG of latency CDFs ('' to skip)")
    add_transfer_args(parser)


def default_num_kv_blocks(args: argparse.Namespace, block_size: int) -> int:
    """Blocks per replica for ``--prefixes-per-replica`` of the tenants' prefixes, plus the in-flight room."""
    per_prefix = cdiv(args.prefix_len, block_size)
    fraction = getattr(args, "prefixes_per_replica", DEFAULT_PREFIXES_PER_REPLICA)
    return int(fraction * args.tenants * per_prefix) + DEFAULT_IN_FLIGHT_BLOCKS


def run_routing(args: argparse.Namespace, engine_args: dict[str, Any]) -> int:
    import ray

    from cluster.bench.datasets import shared_prefix_dataset
    from cluster.bench.serve_setup import model_vocab, write_outputs
    from cluster.shared.config import EngineConfig
    from cluster.shared.ray_local import init_local_ray
    from cluster.launch.redis_server import RedisServer

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise ValueError(f"unknown policies {unknown}: choose from {', '.join(POLICIES)}")
    block_size = EngineConfig.from_kwargs(**engine_args).cache.block_size
    engine = EngineConfig.from_kwargs(**{"num_kv_blocks": default_num_kv_blocks(args, block_size), **engine_args})
    vocab_size, _ = model_vocab(engine.model)
    if getattr(args, "tenant_zipf", 0.0) > 0:
        conversations = skewed_dataset(args.tenants, args.tenants * args.questions_per_tenant, args.prefix_len,
                                       args.question_len, args.output_len, vocab_size, args.workload_seed,
                                       args.tenant_zipf)
    else:
        conversations = shared_prefix_dataset(args.tenants, args.questions_per_tenant, args.prefix_len,
                                              args.question_len, args.output_len, vocab_size, args.workload_seed)
    settings = transfer_settings(args)
    runs = []
    with RedisServer() as redis_server:
        init_local_ray(num_cpus=max(2.0, args.replicas * args.replica_num_cpus))
        try:
            for policy in policies:
                for fetch in settings:
                    label = round_label(f"{policy}+fetch" if fetch else policy, [label for label, _, _ in runs])
                    # off is off: prefix_cost's deployment default prices fetches where replicas own cores
                    run_args = with_fetches(args, fetch) if fetch or policy == "prefix_cost" else args
                    runs.append((label, *_run_policy(run_args, engine, policy, redis_server.url, conversations,
                                                     label)))
        finally:
            ray.shutdown()
    report = {"workload": {k: getattr(args, k) for k in (
        "replicas", "tenants", "questions_per_tenant", "prefix_len", "question_len", "output_len",
        "request_rate", "max_concurrency", "workload_seed", "prefixes_per_replica", "transfers", "tenant_zipf",
        "fetch_bytes_per_s", "warm_tenants")}, "runs": [{"policy": p, **s} for p, s, _ in runs]}
    report["workload"]["request_rate"] = str(args.request_rate)
    report["workload"]["num_kv_blocks"] = engine.cache.num_kv_blocks
    report["oracle"] = oracle_hit_rates(conversations, block_size, warm=getattr(args, "warm_tenants", False))
    report["pooled"] = pooled_rounds(runs)
    report["ratios"] = {**_ratios(report["runs"], report["oracle"]),
                        **transfer_ratios(report["runs"] + report["pooled"])}
    _print_table(report)
    write_outputs(args.json, report, args.plot or None, [(p, records) for p, _, records in runs],
                  f"prefixserve bench routing: {args.tenants} tenants x {args.questions_per_tenant} questions, "
                  f"{args.replicas} replicas, {engine.cache.num_kv_blocks} KV blocks each")
    return 0


def _run_policy(args: argparse.Namespace, engine: Any, policy: str, redis_url: str,
                conversations: list, label: str = "") -> tuple[dict[str, Any], list]:
    """One policy on a fresh cluster: (summary, records)."""
    from cluster.bench.metrics import summarize
    from cluster.bench.serve_setup import start_local_cluster

    label = label or policy
    namespace = f"bench-{policy}-{uuid.uuid4().hex[:8]}"
    cluster = start_local_cluster(args, engine, http=False, routing_policy=policy, redis_url=redis_url,
                                  namespace=namespace)
    try:
        logger.info("%s: %d replicas up, sending %d requests", label, args.replicas, len(conversations))
        records, duration = asyncio.run(_replay(cluster.grpc_address, conversations, args, label))
        transfers = read_transfer_figures(redis_url, namespace)
    finally:
        cluster.stop()
    summary = {**summarize(records, duration), "kv_transfers": transfers}
    if summary["failed"]:
        logger.warning("policy %s: %d requests failed: %s", policy, summary["failed"], summary.get("errors"))
    return summary, records


async def _replay(address: str, conversations: list, args: argparse.Namespace, policy: str) -> tuple[list, float]:
    from cluster.bench.serve import run_requests
    from cluster.bench.serve_setup import make_client, warm_up

    client = make_client("grpc", address)
    try:
        await warm_up(client)
        if getattr(args, "warm_tenants", False):
            logger.info("%s: %d tenants' system prompts sent once", policy, await warm_tenants(client, conversations))
        return await run_requests(client, conversations, args.request_rate, args.max_concurrency,
                                  args.workload_seed, desc=policy)
    finally:
        await client.aclose()


def oracle_hit_rates(conversations: list, block_size: int, warm: bool = False) -> dict[str, float]:
    """The hit rates of a router that knows the future and has room for
    everything: every request after its tenant's first (every request, with
    the tenants warmed: ``--warm-tenants``) reuses the whole shared prefix
    (its full blocks); nothing else hits."""
    seen: set = {c.group for c in conversations} if warm else set()
    cached = prompt = shared_hit = shared_total = 0
    for conversation in conversations:
        turn = conversation.turns[0]
        prompt += len(turn.new_token_ids)
        shared = conversation.shared_prefix_len
        shared_total += shared
        if conversation.group in seen:
            hit = shared // block_size * block_size
            cached += hit
            shared_hit += hit
        seen.add(conversation.group)
    return {"prefix_hit_rate": round(cached / max(prompt, 1), 4),
            "shared_prefix_hit_rate": round(shared_hit / max(shared_total, 1), 4)}


def _ratios(runs: list[dict[str, Any]], oracle: dict[str, float]) -> dict[str, Any]:
    """Each policy's hit rate over the oracle's, and round_robin's TTFT P50 over each policy's."""
    by = {r["policy"]: r for r in runs}
    out: dict[str, Any] = {}
    for policy, run in by.items():
        out[f"hit_rate_{policy}_over_oracle"] = round(run["prefix_hit_rate"] / max(oracle["prefix_hit_rate"], 1e-9), 3)
    rr = by.get("round_robin")
    if rr is not None:
        for policy, run in by.items():
            if policy != "round_robin":
                out[f"ttft_p50_round_robin_over_{policy}"] = round(
                    rr["ttft_ms"]["p50"] / max(run["ttft_ms"]["p50"], 1e-9), 2)
                out[f"hit_rate_{policy}_over_round_robin"] = round(
                    run["prefix_hit_rate"] / max(rr["prefix_hit_rate"], 1e-9), 2)
    return out


def _print_table(report: dict[str, Any]) -> None:
    rows = [("policy", "hit rate", "sys-prompt hit", "TTFT p50 ms", "p95", "p99", "e2e p50 ms", "p99", "req/s",
             "failed", "per replica", "fetches", "MB in", "fetch ms", "fallbacks")]
    for r in report["runs"]:
        ttft, e2e, kv = r["ttft_ms"], r["e2el_ms"], r.get("kv_transfers") or {}
        rows.append((r["policy"], f"{r['prefix_hit_rate']:.1%}", f"{r.get('shared_prefix_hit_rate', 0.0):.1%}",
                     f"{ttft['p50']:.0f}", f"{ttft['p95']:.0f}", f"{ttft['p99']:.0f}", f"{e2e['p50']:.0f}",
                     f"{e2e['p99']:.0f}", f"{r['request_throughput']:.2f}", str(r["failed"]),
                     " ".join(str(v) for v in r["requests_per_replica"].values()),
                     str(kv.get("fetches", 0)), f"{kv.get('mb_in', 0.0):.1f}", f"{kv.get('fetch_ms_mean', 0.0):.0f}",
                     " ".join(f"{k}={v}" for k, v in (kv.get("fallbacks") or {}).items()) or "0"))
    for r in report.get("pooled", ()):
        ttft = r["ttft_ms"]
        rows.append((r["policy"], f"{r['prefix_hit_rate']:.1%}", "", f"{ttft['p50']:.0f}", f"{ttft['p95']:.0f}",
                     f"{ttft['p99']:.0f}", *[""] * 9))
    oracle = report.get("oracle")
    if oracle:
        rows.append(("oracle", f"{oracle['prefix_hit_rate']:.1%}", f"{oracle['shared_prefix_hit_rate']:.1%}",
                     *[""] * 12))
    lines = format_table(rows)
    for key, value in report.get("ratios", {}).items():
        lines.append(f"{key}: {value:.2f}x")
    print("\n".join(lines))  # the table is the program's output, not a log
