"""``prefixserve simulate``: trace replay over simulated replicas, driven by
the real routing code.

What is real: the policies (``router/policies``), the decision core every
Serve router runs (``router/decision.py``: recent sends, per-prefix rates,
candidate sampling, pending tokens) and the router-local directory index
(``cluster/shared/directory/index.py``), fed with each replica's KV event
batches in order (stores and LRU evictions) exactly as a follower applies
them from the Redis stream. What is simulated: the replicas and the clock.

Replicas: a block-level LRU prefix cache of ``--blocks-per-replica`` blocks,
and a step-time model taken from ``prefixserve bench latency`` on the default
model (2 CPU cores): prefill at ``--prefill-tokens-per-s`` tokens/s served
first come first served, each decode step ``--decode-step-ms`` plus
``--decode-ms-per-seq`` per running sequence. A replica publishes its stats
every ``--stats-period-s`` (what Serve's routing stats do); routers see the
last published figures plus what they sent since, as in production. Each
request reaches one of ``--routers`` routers at random; each router has its
own decision core (its own recent sends and rates), and all share one index
(every router's index is the same copy of the same stream).

Trace (synthetic, seeded; the shapes of real services): tenants with
Zipf-popular long system prompts, multi-turn chat sessions whose prompts
grow with each turn, and RAG requests sharing documents across users. The
oracle hit rate assumes a cache with room for everything and perfect
routing: each request hits the longest prefix any earlier request had.

Printed per (policy, replicas, routers): hit rate and its ratio to the
oracle, simulated TTFT P50/P99, decision CPU time P50/P99 (index lookup +
decision, measured), index operations per decision, decisions/s, index
entries and bytes, KV event batches per second per replica; with
``--adapters`` (LoRA, ``cluster/bench/simulate_lora.py``) also adapter loads
and evictions per minute; with ``--transfers off,on`` (KV fetched from a
prefix's holder, ``cluster/bench/simulate_transfer.py``) each policy that
prices fetches runs without and with them on the same trace, and the rows
with them add fetches and bytes moved. JSON and a PNG.
"""

from __future__ import annotations

import argparse
import bisect
import hashlib
import heapq
import json
import logging
import random
import statistics
import time
import tracemalloc
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Optional

from cluster.bench import simulate_lora as lora
from cluster.bench import simulate_transfer as transfer
from cluster.bench.simulate_report import print_table, write
from cluster.shared.directory.index import PrefixIndex
from cluster.shared.hashing import hash_block_chain, root_hash
from router.decision import RoutingCore
from router.policies import ReplicaView, get_policy, policy_names
from router.policies.registry import BASELINE_POLICIES

logger = logging.getLogger(__name__)


def add_simulate_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", default="10,100,1000", help="comma-separated fleet sizes")
    parser.add_argument("--routers", default="1,100", help="comma-separated router counts")
    parser.add_argument("--policies", default="prefix_cost,cache_aware,round_robin")
    parser.add_argument("--policy-params", type=json.loads, default={}, metavar="JSON",
                        help='{"policy": {"param": value}}, e.g. {"prefix_cost": {"hot_prefix_rps": 0}}')
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--rate-per-replica", type=float, default=0.5, help="arrivals per second per replica")
    parser.add_argument("--tenants", type=int, default=2000)
    parser.add_argument("--zipf", type=float, default=1.1, help="popularity exponent of tenants and documents")
    parser.add_argument("--system-prompt-len", type=int, default=1024)
    parser.add_argument("--question-len", type=int, default=48)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--turns", type=int, default=4, help="most turns of a chat session")
    parser.add_argument("--rag-fraction", type=float, default=0.3)
    parser.add_argument("--documents", type=int, default=5000)
    parser.add_argument("--document-len", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--blocks-per-replica", type=int, default=8192, help="prefix cache size of one replica")
    parser.add_argument("--prefill-tokens-per-s", type=float, default=460.0)
    parser.add_argument("--decode-step-ms", type=float, default=30.0)
    parser.add_argument("--decode-ms-per-seq", type=float, default=2.0)
    parser.add_argument("--stats-period-s", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    lora.add_adapter_args(parser)
    transfer.add_transfer_args(parser)
    parser.add_argument("--json", default="bench-results/simulate.json")
    parser.add_argument("--plot", default="bench-results/simulate.png", help="PNG ('' to skip)")


# ---------------------------------------------------------------- the trace
@dataclass
class TraceRequest:
    arrival: float
    chain: list[bytes]
    num_prompt_tokens: int
    output_len: int
    adapter: str = ""  # LoRA adapter ("": the base model)


def zipf_sampler(n: int, s: float, rng: random.Random):
    weights = [1.0 / (i + 1) ** s for i in range(n)]
    cumulative, total = [], 0.0
    for w in weights:
        total += w
        cumulative.append(total)

    def draw() -> int:
        return bisect.bisect_left(cumulative, rng.random() * total)

    return draw


def synthetic_trace(args: argparse.Namespace, rate: float) -> list[TraceRequest]:
    """Seeded requests (see module doc); block chains are computed once per shared part."""
    rng = random.Random(args.seed)
    block = args.block_size
    root = root_hash("simulated-model")
    tenant_of, doc_of = zipf_sampler(args.tenants, args.zipf, rng), zipf_sampler(args.documents, args.zipf, rng)
    adapters = lora.AdapterDraw(args, zipf_sampler) if getattr(args, "adapters", 0) else None

    def tokens(tag: str, n: int) -> list[int]:
        seed = int.from_bytes(hashlib.blake2b(tag.encode(), digest_size=8).digest(), "little")
        r = random.Random(seed)
        return [r.randrange(32000) for _ in range(n)]

    sessions: list[dict] = []  # open chat sessions: tokens so far, turns left
    out, now = [], 0.0
    for i in range(args.requests):
        now += rng.expovariate(rate)
        adapter = adapters.draw() if adapters else ""
        if rng.random() < args.rag_fraction:
            doc = doc_of()
            prompt = tokens(f"doc{doc}", args.document_len) + tokens(f"q{i}", args.question_len)
        elif sessions and rng.random() < 0.5:
            session = sessions.pop(rng.randrange(len(sessions)))
            adapter = session.get("adapter", "")  # a conversation keeps its model
            prompt = session["tokens"] + tokens(f"q{i}", args.question_len)
            session["tokens"] = prompt + tokens(f"a{i}", args.output_len)
            session["left"] -= 1
            if session["left"] > 0:
                sessions.append(session)
        else:
            tenant = tenant_of()
            prompt = tokens(f"sys{tenant}", args.system_prompt_len) + tokens(f"q{i}", args.question_len)
            if args.turns > 1:
                sessions.append({"tokens": prompt + tokens(f"a{i}", args.output_len),
                                 "left": rng.randrange(1, args.turns), "adapter": adapter})
                if len(sessions) > 4 * args.tenants:
                    sessions.pop(0)
        chain = hash_block_chain(prompt, block, adapters.root(adapter) if adapter else root)
        out.append(TraceRequest(now, chain, len(prompt), args.output_len, adapter))
    return out


def oracle_hit_rate(trace: list[TraceRequest], block_size: int) -> float:
    seen: set[bytes] = set()
    hit = total = 0
    for request in trace:
        n = 0
        while n < len(request.chain) and request.chain[n] in seen:
            n += 1
        hit += n * block_size
        total += request.num_prompt_tokens
        seen.update(request.chain)
    return hit / max(total, 1)


# ------------------------------------------------------------- the replicas
@dataclass
class SimReplica:
    replica_id: str
    capacity: int
    cache: "OrderedDict[bytes, None]" = field(default_factory=OrderedDict)
    busy_until: float = 0.0  # end of the queued prefill work
    decoding: list = field(default_factory=list)  # heap of finish times
    seq: int = 0
    stats: dict = field(default_factory=dict)
    batches: int = 0

    def running(self, now: float) -> int:
        while self.decoding and self.decoding[0] <= now:
            heapq.heappop(self.decoding)
        return len(self.decoding)


class Fleet:
    """Simulated replicas publishing into one ``PrefixIndex``."""

    def __init__(self, args: argparse.Namespace, num_replicas: int) -> None:
        self.args = args
        self.index = PrefixIndex()
        self.replicas = {f"replica-{i:04d}": SimReplica(f"replica-{i:04d}", args.blocks_per_replica)
                         for i in range(num_replicas)}
        self.ids = list(self.replicas)
        for rid in self.ids:
            self.index.load_snapshot(rid, epoch=1, seq=0, blocks=[])
        self.next_stats = 0.0
        self.lora = lora.AdapterCaches(args, self.ids) if getattr(args, "adapters", 0) else None

    def publish_stats(self, now: float) -> None:
        for r in self.replicas.values():
            queued = max(0.0, r.busy_until - now) * self.args.prefill_tokens_per_s
            running = r.running(now)
            r.stats = {"num_running": running, "num_prefill_tokens": int(queued), "at": now,
                       "num_decode_tokens": running * 1000, "num_kv_blocks": r.capacity,
                       "kv_cache_usage": min(0.99, running * 100 / r.capacity),
                       "num_cached_blocks": len(r.cache)}
        if self.lora is not None:
            self.lora.publish()

    def view(self, core: RoutingCore, rid: str, matched: Optional[int], adapter: str = "") -> ReplicaView:
        s, adapter_fields = self.replicas[rid].stats, self.lora.view_fields(rid, adapter) if self.lora else {}
        return ReplicaView(rid, num_running=s.get("num_running", 0), kv_cache_usage=s.get("kv_cache_usage", 0.0),
                           num_cached_blocks=s.get("num_cached_blocks", 0), matched_blocks=matched,
                           num_prefill_tokens=s.get("num_prefill_tokens", 0)
                           + core.pending_tokens(rid, s.get("at", 0.0)),
                           num_decode_tokens=s.get("num_decode_tokens", 0), num_kv_blocks=s.get("num_kv_blocks", 0),
                           num_exports=core.exports_in_flight(rid), **adapter_fields)

    def adapter_holders(self, adapter: str) -> list[str]:
        return self.lora.holders.get(adapter, []) if self.lora is not None and adapter else []

    def store(self, rid: str, blocks: list[bytes]) -> None:
        """Enters ``blocks`` at the recent end of the replica's LRU, evicts past its
        capacity, and publishes both as one KV event batch."""
        r = self.replicas[rid]
        for block in blocks:
            r.cache[block] = None
        removed = []
        while len(r.cache) > r.capacity:
            block, _ = r.cache.popitem(last=False)
            removed.append(block)
        stored_set = set(blocks)
        removed = [b for b in removed if b not in stored_set] if stored_set else removed
        still = [b for b in blocks if b in r.cache]
        r.seq += 1
        r.batches += 1
        self.index.apply(rid, 1, r.seq, False, removed, still)

    def serve(self, rid: str, request: TraceRequest, ready: float = 0.0) -> tuple[int, float]:
        """Runs the request on a replica, its prefill starting no earlier than ``ready``
        (a fetch's end): (cached tokens, TTFT)."""
        r, args = self.replicas[rid], self.args
        hits = 0
        while hits < len(request.chain) and request.chain[hits] in r.cache:
            r.cache.move_to_end(request.chain[hits])
            hits += 1
        self.store(rid, request.chain[hits:])
        cached = hits * args.block_size
        start = max(request.arrival, r.busy_until, ready) + (self.lora.use(rid, request.adapter) if self.lora else 0.0)
        r.busy_until = start + (request.num_prompt_tokens - cached) / args.prefill_tokens_per_s
        ttft = r.busy_until - request.arrival
        running = r.running(request.arrival)
        step = (args.decode_step_ms + args.decode_ms_per_seq * running) / 1000
        heapq.heappush(r.decoding, r.busy_until + request.output_len * step)
        return cached, ttft


# -------------------------------------------------------------------- runs
def run_one(args: argparse.Namespace, trace: list[TraceRequest], policy: str, num_replicas: int,
            num_routers: int, transfers: bool = False) -> dict[str, Any]:
    fleet = Fleet(args, num_replicas)
    fetches = transfer.Transfers(args) if transfers else None
    clock = [0.0]
    rng = random.Random(args.seed + 1)
    params = {**lora.policy_defaults(args, policy), **transfer.policy_params(args, policy, transfers),
              **args.policy_params.get(policy, {})}
    cores = [RoutingCore(get_policy(policy, **params),
                         args.block_size, num_routers=num_routers, clock=lambda: clock[0],
                         rng=random.Random(args.seed + 100 + i)) for i in range(num_routers)]
    decision_s, ops, ttfts = [], [], []
    cached_tokens = prompt_tokens = 0
    for request in trace:
        clock[0] = request.arrival
        if request.arrival >= fleet.next_stats:
            fleet.publish_stats(request.arrival)
            fleet.next_stats = request.arrival + args.stats_period_s
        core = cores[rng.randrange(num_routers)]
        before = fleet.index.lookup_ops
        began = time.perf_counter()
        counts = fleet.index.lookup(request.chain)
        ranking = core.decide_ranking(request.chain, request.num_prompt_tokens, fleet.ids, counts,
                                      lambda rid, matched: fleet.view(core, rid, matched, request.adapter),
                                      adapter=request.adapter, adapter_holders=fleet.adapter_holders(request.adapter))
        decision_s.append(time.perf_counter() - began)
        ops.append(fleet.index.lookup_ops - before)
        chosen, ready = ranking.replica_ids[0], 0.0
        holder = ranking.fetch_from.get(chosen) if fetches is not None else None
        if holder is not None:
            ready = fetches.fetch(fleet, chosen, holder, request.chain, request.arrival)
        cached, ttft = fleet.serve(chosen, request, ready)
        cached_tokens += cached
        prompt_tokens += request.num_prompt_tokens
        ttfts.append(ttft)
    duration = trace[-1].arrival - trace[0].arrival if len(trace) > 1 else 1.0
    q = statistics.quantiles
    return {
        "policy": policy, "replicas": num_replicas, "routers": num_routers, "transfers": "on" if transfers else "off",
        "hit_rate": round(cached_tokens / max(prompt_tokens, 1), 4),
        "ttft_p50_s": round(q(ttfts, n=100)[49], 3), "ttft_p99_s": round(q(ttfts, n=100)[98], 3),
        "decision_p50_us": round(q(decision_s, n=100)[49] * 1e6, 1),
        "decision_p99_us": round(q(decision_s, n=100)[98] * 1e6, 1),
        "decisions_per_s": round(len(decision_s) / max(sum(decision_s), 1e-9)),
        "index_ops_per_decision": round(statistics.fmean(ops), 1),
        "index_ops_p99": q(ops, n=100)[98],
        "index_entries": fleet.index.num_entries,
        "event_batches_per_s_per_replica": round(sum(r.batches for r in fleet.replicas.values())
                                                 / num_replicas / max(duration, 1e-9), 3),
        **(fleet.lora.results(duration) if fleet.lora else {}),
        **(fetches.results(len(trace)) if fetches is not None else {})}


def index_bytes_per_entry(num_replicas: int = 100, blocks_each: int = 2000) -> float:
    """Python memory of a ``PrefixIndex`` per (block, replica) entry, measured."""
    rng = random.Random(0)
    shared = [rng.randbytes(16) for _ in range(blocks_each)]
    tracemalloc.start()
    index = PrefixIndex()
    for i in range(num_replicas):
        own = shared[: blocks_each // 2] + [rng.randbytes(16) for _ in range(blocks_each // 2)]
        index.load_snapshot(f"replica-{i:04d}", 1, 0, own)
    size, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return size / max(index.num_entries, 1)


def run_simulate(args: argparse.Namespace) -> int:
    fleets = [int(x) for x in str(args.replicas).split(",") if x.strip()]
    routers = [int(x) for x in str(args.routers).split(",") if x.strip()]
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in policy_names() and p not in BASELINE_POLICIES]
    if not isinstance(args.policy_params, dict) or not all(isinstance(v, dict) for v in args.policy_params.values()):
        logger.error('--policy-params must map policy names to parameter mappings, got %r', args.policy_params)
        return 2
    for name, params in args.policy_params.items():
        get_policy(name, **params)  # unknown names or parameters fail here, named
    if not lora.check_adapter_args(args):
        return 2
    try:
        modes = transfer.transfer_modes(args)
    except ValueError as exc:
        logger.error("bad arguments: %s", exc)
        return 2
    if unknown or not fleets or not routers or min(fleets + routers) < 1 or args.requests < 2:
        logger.error("bad arguments: policies must be among %s (got %s); --replicas and --routers positive "
                     "integers; --requests >= 2", ", ".join(policy_names()), ", ".join(unknown) or "ok")
        return 2
    runs, oracles = [], {}
    for num_replicas in fleets:
        began = time.perf_counter()
        trace = synthetic_trace(args, args.rate_per_replica * num_replicas)
        oracles[num_replicas] = round(oracle_hit_rate(trace, args.block_size), 4)
        logger.info("trace for %d replicas: %d requests over %.0f s (built in %.1f s), oracle hit rate %.1f%%",
                    num_replicas, len(trace), trace[-1].arrival, time.perf_counter() - began,
                    100 * oracles[num_replicas])
        for num_routers in routers:
            for policy, on in [(p, on) for p in policies for on in modes
                               if not on or p in transfer.FETCHING_POLICIES]:
                began = time.perf_counter()
                result = run_one(args, trace, policy, num_replicas, num_routers, transfers=on)
                result["hit_rate_over_oracle"] = round(result["hit_rate"] / max(oracles[num_replicas], 1e-9), 3)
                runs.append(result)
                logger.info("%s (transfers %s), %d replicas, %d routers: hit %.1f%% (%.2f of oracle), decision "
                            "p99 %.0f us [%.1f s]", policy, result["transfers"], num_replicas, num_routers, 100 * result["hit_rate"],
                            result["hit_rate_over_oracle"], result["decision_p99_us"], time.perf_counter() - began)
    per_entry = index_bytes_per_entry()
    report = {"args": {k: v for k, v in vars(args).items() if k not in ("func",) and not callable(v)},
              "oracle_hit_rate": oracles, "index_bytes_per_entry": round(per_entry, 1), "runs": runs}
    print_table(report)
    write(report, args)
    return 0
