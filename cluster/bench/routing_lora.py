"""``prefixserve bench routing-lora``: LoRA adapter placement on real
replicas, one policy after another on the same workload (issue 51's
``bench routing`` with adapters; ``simulate --adapters`` is the same question
at fleet scale, simulated).

Workload (seeded): ``--adapters`` LoRA adapters (rank ``--adapter-rank`` on
every linear layer of the default model, random A and B, stored in bfloat16
as a fine-tune saves them) in one folder, served by name from it
(``dynamic_lora_loading_path``: a replica loads one on its first request).
Each request draws its adapter from a Zipf law (``--adapter-zipf``: a few hot
adapters, many cold), and its prompt is that adapter's own system prompt
(``--prefix-len`` tokens; an adapter's prefix blocks are its own, hashed with
its content) plus a unique question; arrivals are Poisson at
``--request-rate``. Each replica keeps ``--max-cpu-loras`` adapters loaded
(the engine flag; 3 here unless given: least recently used evicted) and runs
``--max-loras`` (2 here) in one step, so where a
request lands decides whether its adapter must be loaded and whether its
prefix is cached.

Policies (``--policies``), each on a fresh local cluster (Ray on loopback,
redis-server, the gRPC router; empty caches, no adapter loaded):

    prefix_cost        our placement (router/policies/lora_placement.py): a
                       load priced in prefill tokens, adapter homes that
                       follow the request rate
    adapter_affinity   Ray Serve LLM's rule: "stick to a holder" with room
    random             a uniform draw

Per policy: TTFT P50 / P99 and end-to-end P50 (from the client), the prefix
hit rate (cached / prompt tokens, the servers' Usage), and adapter loads and
evictions per minute of the run (the replicas' ``lora_loads_total`` and
``lora_evictions_total``, read from the directory's metrics). Prints a table,
writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from cluster.client.table import format_table

logger = logging.getLogger(__name__)

POLICIES = ("prefix_cost", "adapter_affinity", "random")
TARGETS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
DEFAULT_ENGINE = {"max_loras": 2, "max_cpu_loras": 3}  # per replica, unless the engine flags say otherwise
METRICS_SETTLE_S = 3.0  # the replicas' heartbeats carry their metrics about every second


def add_routing_lora_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated, in run order")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--adapters", type=int, default=12, help="adapters in the folder")
    parser.add_argument("--adapter-zipf", type=float, default=1.1, help="popularity exponent of the adapters")
    parser.add_argument("--adapter-rank", type=int, default=8, help="rank of every adapter (every linear layer)")
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--request-rate", type=float, default=0.8, help="Poisson arrivals per second")
    parser.add_argument("--prefix-len", type=int, default=128, help="tokens of each adapter's system prompt")
    parser.add_argument("--question-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--workload-seed", type=int, default=0)
    parser.add_argument("--replica-num-cpus", type=float, default=0.5)
    parser.add_argument("--json", default="bench-results/routing_lora.json")


def zipf_weights(n: int, exponent: float) -> list[float]:
    """Request shares of ``n`` adapters, hottest first."""
    raw = [1.0 / (i + 1) ** exponent for i in range(n)]
    return [w / sum(raw) for w in raw]


def make_workload(args: argparse.Namespace, vocab_size: int) -> list[tuple[float, str, list[int]]]:
    """``(arrival s, adapter name, prompt token ids)`` per request, in arrival order."""
    if args.adapters < 1 or args.requests < 1 or args.request_rate <= 0 or args.adapter_zipf <= 0:
        raise ValueError("--adapters, --requests, --request-rate and --adapter-zipf must be > 0")
    rng = random.Random(args.workload_seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, vocab_size) for _ in range(n)]  # clear of the special and chat tokens

    prefixes = [tokens(args.prefix_len) for _ in range(args.adapters)]
    weights = zipf_weights(args.adapters, args.adapter_zipf)
    out, at = [], 0.0
    for _ in range(args.requests):
        at += rng.expovariate(args.request_rate)
        adapter = rng.choices(range(args.adapters), weights)[0]
        out.append((at, adapter_name(adapter), prefixes[adapter] + tokens(args.question_len)))
    return out


def adapter_name(index: int) -> str:
    return f"adapter-{index:03d}"


def write_adapters(folder: Path, model_dir: Path, num: int, rank: int) -> None:
    """``num`` PEFT adapters (every linear layer, bfloat16) in ``folder/<name>``, shaped for ``model_dir``."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((model_dir / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
              "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    for i in range(num):
        gen = torch.Generator().manual_seed(1000 + i)
        tensors = {}
        for layer in range(config["num_hidden_layers"]):
            for target, (fan_in, fan_out) in shapes.items():
                stem = f"base_model.model.model.layers.{layer}.{TARGETS[target]}.{target}"
                scale = 0.1 / rank ** 0.5
                tensors[f"{stem}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=gen) * scale).bfloat16()
                tensors[f"{stem}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=gen) * scale).bfloat16()
        out = folder / adapter_name(i)
        out.mkdir(parents=True)
        (out / "adapter_config.json").write_text(json.dumps(
            {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": sorted(TARGETS)}))
        save_file(tensors, str(out / "adapter_model.safetensors"))


def run_routing_lora(args: argparse.Namespace, engine_args: dict[str, Any]) -> int:
    import ray

    from cluster.bench.serve_setup import model_vocab
    from cluster.launch.redis_server import RedisServer
    from cluster.shared.config import EngineConfig
    from cluster.shared.ray_local import init_local_ray
    from workers.model.loader import resolve_model

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise ValueError(f"unknown policies {unknown}: choose from {', '.join(POLICIES)}")
    if engine_args.get("model"):
        raise ValueError("bench routing-lora runs the default model (its adapters are shaped for it): drop --model")
    vocab_size, _ = model_vocab(None)
    workload = make_workload(args, vocab_size)
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-routing-lora-") as folder:
        logger.info("writing %d rank-%d bfloat16 adapters to %s", args.adapters, args.adapter_rank, folder)
        write_adapters(Path(folder), resolve_model(None), args.adapters, args.adapter_rank)
        engine = EngineConfig.from_kwargs(**{**DEFAULT_ENGINE, "max_lora_rank": args.adapter_rank, **engine_args,
                                             "enable_lora": True, "dynamic_lora_loading_path": folder})
        with RedisServer() as redis_server:
            init_local_ray(num_cpus=max(2.0, args.replicas * args.replica_num_cpus))
            try:
                for policy in policies:
                    runs.append(_run_policy(args, engine, policy, redis_server.url, workload))
            finally:
                ray.shutdown()
    shares = zipf_weights(args.adapters, args.adapter_zipf)
    report = {"workload": {**{k: getattr(args, k) for k in (
        "replicas", "adapters", "adapter_zipf", "adapter_rank", "requests", "request_rate", "prefix_len",
        "question_len", "output_len", "workload_seed")}, "max_loras": engine.lora.max_loras,
        "max_cpu_loras": engine.lora.max_cpu_loras},
        "hottest_adapter_share": round(shares[0], 3), "runs": runs}
    _print_table(report)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))
        logger.info("wrote %s", args.json)
    return 0


def _run_policy(args: argparse.Namespace, engine: Any, policy: str, redis_url: str,
                workload: list[tuple[float, str, list[int]]]) -> dict[str, Any]:
    """One policy on a fresh cluster: its summary."""
    from cluster.bench.serve_setup import start_local_cluster

    namespace = f"bench-lora-{policy}-{uuid.uuid4().hex[:8]}"
    args.routing_policy = policy
    cluster = start_local_cluster(args, engine, http=False, routing_policy=policy, redis_url=redis_url,
                                  namespace=namespace)
    try:
        logger.info("policy %s: %d replicas up, sending %d requests", policy, args.replicas, len(workload))
        records, duration = asyncio.run(_replay(cluster.grpc_address, workload, args.output_len))
        time.sleep(METRICS_SETTLE_S)
        counts = asyncio.run(_lora_counts(redis_url, namespace))
    finally:
        cluster.stop()
    return {"policy": policy, **summarize(records, duration, counts)}


async def _replay(address: str, workload: list[tuple[float, str, list[int]]], output_len: int
                  ) -> tuple[list[dict[str, Any]], float]:
    """Sends each request at its arrival time over gRPC; one record per request."""
    import grpc

    from cluster.bench.clients import grpc_request
    from router.pb import generation_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        await _send(stub, grpc_request([1, 2, 3, 4], 2), "")  # warm-up, no adapter
        start = time.perf_counter()

        async def one(at: float, adapter: str, prompt: list[int]) -> dict[str, Any]:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - start)))
            request = grpc_request(prompt, output_len)
            request.lora_adapter = adapter
            return {"adapter": adapter, **await _send(stub, request, adapter)}

        records = await asyncio.gather(*(one(*item) for item in workload))
        return list(records), time.perf_counter() - start


async def _send(stub: Any, request: Any, adapter: str) -> dict[str, Any]:
    import grpc

    sent = time.perf_counter()
    out: dict[str, Any] = {"ttft": None, "error": ""}
    try:
        async for chunk in stub.Generate(request, timeout=600):
            if out["ttft"] is None and chunk.token_ids:
                out["ttft"] = time.perf_counter() - sent
            if chunk.finish_reason:
                out.update(prompt=chunk.usage.prompt_tokens, cached=chunk.usage.cached_prompt_tokens,
                           replica=chunk.replica_id)
    except grpc.aio.AioRpcError as exc:
        out["error"] = f"{exc.code().name}: {exc.details()}"
        logger.warning("request on %s failed: %s", adapter or "the base model", out["error"])
    out["latency"] = time.perf_counter() - sent
    return out


async def _lora_counts(redis_url: str, namespace: str) -> dict[str, float]:
    """The replicas' ``lora_loads_total`` and ``lora_evictions_total``, summed."""
    from cluster.shared.directory import Directory
    from cluster.shared.metrics_format import METRIC_PREFIX

    directory = Directory.from_url(redis_url, namespace)
    try:
        texts = await directory.replica_metrics()
    finally:
        await directory.aclose()
    sums = {"lora_loads_total": 0.0, "lora_evictions_total": 0.0}
    for text in texts.values():
        for line in (text.decode() if isinstance(text, bytes) else text).splitlines():
            name = line.partition("{")[0].partition(" ")[0].removeprefix(METRIC_PREFIX)
            if name in sums:
                sums[name] += float(line.rpartition(" ")[2])
    return sums


def summarize(records: list[dict[str, Any]], duration: float, counts: dict[str, float]) -> dict[str, Any]:
    """One policy's figures (module doc); latencies in ms."""
    from cluster.client.table import percentile

    done = [r for r in records if not r["error"] and r["ttft"] is not None]
    ttfts = sorted(r["ttft"] * 1000 for r in done)
    minutes = max(duration, 1e-9) / 60
    prompt = sum(r.get("prompt", 0) for r in done)
    per_replica: dict[str, int] = {}
    for r in done:
        per_replica[r.get("replica", "")] = per_replica.get(r.get("replica", ""), 0) + 1
    return {
        "completed": len(done), "failed": len(records) - len(done), "duration_s": round(duration, 1),
        "ttft_ms": {"p50": round(percentile(ttfts, 50), 1), "p99": round(percentile(ttfts, 99), 1)} if ttfts else {},
        "e2el_ms_p50": round(percentile(sorted(r["latency"] * 1000 for r in done), 50), 1) if done else 0.0,
        "prefix_hit_rate": round(sum(r.get("cached", 0) for r in done) / prompt, 4) if prompt else 0.0,
        "adapter_loads": int(counts["lora_loads_total"]),
        "adapter_evictions": int(counts["lora_evictions_total"]),
        "adapter_loads_per_min": round(counts["lora_loads_total"] / minutes, 1),
        "adapter_evictions_per_min": round(counts["lora_evictions_total"] / minutes, 1),
        "requests_per_replica": dict(sorted(per_replica.items())),
    }


def _print_table(report: dict[str, Any]) -> None:
    rows = [("policy", "TTFT p50 ms", "p99", "e2e p50 ms", "hit rate", "loads/min", "evictions/min", "loads",
             "failed", "per replica")]
    for r in report["runs"]:
        ttft = r["ttft_ms"] or {"p50": 0.0, "p99": 0.0}
        rows.append((r["policy"], f"{ttft['p50']:.0f}", f"{ttft['p99']:.0f}", f"{r['e2el_ms_p50']:.0f}",
                     f"{r['prefix_hit_rate']:.1%}", f"{r['adapter_loads_per_min']:.1f}",
                     f"{r['adapter_evictions_per_min']:.1f}", str(r["adapter_loads"]), str(r["failed"]),
                     " ".join(str(v) for v in r["requests_per_replica"].values())))
    w = report["workload"]
    lines = format_table(rows)
    lines.append(f"{w['adapters']} adapters (Zipf {w['adapter_zipf']}: the hottest {report['hottest_adapter_share']:.0%} "
                 f"of requests), {w['replicas']} replicas keeping {w['max_cpu_loras']} each, {w['requests']} requests "
                 f"at {w['request_rate']}/s")
    print("\n".join(lines))  # the table is the program's output, not a log
