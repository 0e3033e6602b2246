"""The clients of ``scripts/fault_table.py``: one coroutine per fault, each
driving load through the gRPC router (``grpc.aio``), injecting its fault for
real and returning a ``Row`` of the table (see that script's doc).

A request is *lost* when it ended with neither exactly one finish reason nor
an error the scenario expects (``Call.lost``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Optional

import grpc

from cluster.shared.sizes import cdiv
from router.pb import generation_pb2 as pb
from router.pb import generation_pb2_grpc as pb_grpc
from router.server import RETRY_AFTER_KEY

logger = logging.getLogger("fault_table")

BLOCK_SIZE = 16
CAPTION = {
    "redis": "time to recover = restart of redis-server -> the first request with a repeated 64-token prefix "
             "routed to the replica holding it and served from its cache (probes start once the directory "
             "lists the holder again, so none of them seeds the prefix elsewhere)",
    "kill": "time to recover = SIGKILL -> every stream that was on the killed replica has streamed its next "
            "token from the other replica",
    "flood": "time to recover = first RESOURCE_EXHAUSTED -> the first retry (sent after retry-after-ms) "
             "that the replica admits",
    "kv": "time to recover = the longest gap between two tokens of one stream (how long a preempted "
          "stream waited to resume)",
}


# ------------------------------------------------------------------ requests
@dataclass
class Call:
    """What the client saw of one Generate call (times: ``time.monotonic()``)."""

    sent_at: float = 0.0
    ended_at: Optional[float] = None
    token_ids: list[int] = field(default_factory=list)
    chunk_times: list[float] = field(default_factory=list)  # per chunk that carried tokens
    chunk_replicas: list[str] = field(default_factory=list)
    replica_id: str = ""
    num_finishes: int = 0
    finish_reason: str = ""
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: Optional[str] = None  # gRPC status code name
    details: str = ""
    retry_after_ms: Optional[int] = None

    def lost(self, expected: tuple[str, ...] = ()) -> bool:
        """Ended with neither exactly one finish reason nor an expected error."""
        if self.error is not None:
            return self.error not in expected
        return self.num_finishes != 1


async def run_call(stub: Any, request: pb.GenerateRequest, call: Call, timeout: float = 300.0) -> Call:
    """Streams one request into ``call`` (filled as chunks arrive, so others can watch)."""
    call.sent_at = time.monotonic()
    try:
        async for chunk in stub.Generate(request, timeout=timeout):
            call.replica_id = chunk.replica_id
            if chunk.token_ids:
                call.token_ids.extend(chunk.token_ids)
                call.chunk_times.append(time.monotonic())
                call.chunk_replicas.append(chunk.replica_id)
            if chunk.finish_reason:
                call.num_finishes += 1
                call.finish_reason = chunk.finish_reason
                call.completion_tokens = chunk.usage.completion_tokens
                call.cached_tokens = chunk.usage.cached_prompt_tokens
    except grpc.aio.AioRpcError as exc:
        call.error, call.details = exc.code().name, exc.details() or ""
        hint = dict(exc.trailing_metadata() or ()).get(RETRY_AFTER_KEY)
        call.retry_after_ms = int(hint) if hint is not None else None
    call.ended_at = time.monotonic()
    return call


def ids_request(ids: list[int], max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


def text_request(prompt: str, max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


async def poll(probe: Callable[[], Awaitable[Any]], what: str, timeout: float, period: float = 0.1) -> Any:
    """Calls ``probe`` until it returns something truthy (errors count as not yet)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            result = await asyncio.wait_for(probe(), 10)
        except Exception as exc:  # noqa: BLE001 - not ready yet
            result = None
            logger.debug("%s: %r", what, exc)
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout:.0f} s")
        await asyncio.sleep(period)


@dataclass
class Row:
    """One line of the table (``details`` goes to the JSON only)."""

    scenario: str
    fault: str
    in_flight: str
    num_requests: int
    lost: int
    clear_errors: str
    recover_s: Optional[float]
    check: str
    passed: bool
    details: dict = field(default_factory=dict)


# ---------------------------------------------------------- redis outage
class BackgroundLoad:
    """``concurrency`` clients sending short requests back to back until stopped.

    Prompts are 20 tokens (one full block, a distinct first token each), so
    every routing decision consults the directory and none matches the probes'
    prefixes."""

    def __init__(self, stub: Any, concurrency: int) -> None:
        self.stub, self.concurrency = stub, concurrency
        self.calls: list[Call] = []
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Future] = []

    def start(self) -> None:
        self._tasks = [asyncio.ensure_future(self._client(w)) for w in range(self.concurrency)]

    async def _client(self, i: int) -> None:
        while not self._stop.is_set():
            call = Call()
            self.calls.append(call)
            await run_call(self.stub, ids_request([300 + i % 200] + list(range(20, 39)), 4), call, timeout=120)
            i += self.concurrency

    @property
    def in_flight(self) -> int:
        return sum(1 for c in self.calls if c.ended_at is None)

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)


async def warm_on_two_replicas(stub: Any, prefix_a: list[int], prefix_b: list[int]) -> tuple[str, str]:
    """Caches ``prefix_a`` on one replica and ``prefix_b`` on the other: a long
    request with ``prefix_a`` still runs when ``prefix_b`` (cached nowhere)
    arrives, so it goes to the idle replica."""
    call = stub.Generate(ids_request(prefix_a + [5], 200), timeout=300)
    try:
        first = await anext(aiter(call))
        other = await run_call(stub, ids_request(prefix_b + [5], 2), Call())
    finally:
        call.cancel()  # its prompt's blocks stay cached
    return first.replica_id, other.replica_id


async def scenario_redis(address: str, redis: Any, namespace: str, fingerprint: str, args: Any) -> Row:
    from cluster.shared.directory import Directory
    from cluster.shared.hashing import hash_block_chain, root_hash
    from router.metrics import get_router_metrics

    prefixes = (list(range(100, 164)), list(range(200, 264)))  # 4 blocks each
    chains = [hash_block_chain(p, BLOCK_SIZE, root_hash(fingerprint, "")) for p in prefixes]
    registry = get_router_metrics(namespace, "cache_aware").registry  # the Serve handle's router, this process
    degraded_name = "prefixserve:router_directory_degraded_seconds_total"
    directory = Directory.from_url(redis.url, namespace)
    probes: list[tuple[str, Call]] = []

    async def listed(holders: tuple[str, str]) -> bool:
        counts = [await directory.lookup(chain) for chain in chains]
        return all(c.get(h) == len(chain) for c, h, chain in zip(counts, holders, chains))

    async def probe_round(holders: tuple[str, str], phase: str) -> Optional[float]:
        """A request per prefix; the end time of the first one served by its holder from cache."""
        for prefix, holder in zip(prefixes, holders):
            call = await run_call(stub, ids_request(prefix + [6, 7], 1), Call(), timeout=120)
            probes.append((phase, call))
            if call.error is None and call.replica_id == holder and call.cached_tokens >= len(prefix):
                return call.ended_at
        return None

    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        holders = await warm_on_two_replicas(stub, *prefixes)
        if holders[0] == holders[1]:
            raise RuntimeError(f"the warm-up left both prefixes on {holders[0]}; rerun")
        await poll(lambda: listed(holders), "the warm prefixes in the directory", 60)
        baseline = await probe_round(holders, "before")
        load = BackgroundLoad(stub, args.load_concurrency)
        load.start()
        await asyncio.sleep(2.0)
        degraded_before = registry.get_sample_value(degraded_name) or 0.0
        in_flight = load.in_flight
        os.kill(redis.pid, signal.SIGKILL)  # no shutdown, like a crashed pod
        killed_at = time.monotonic()
        await asyncio.sleep(args.outage_s)
        await asyncio.to_thread(redis.stop)  # reaps it, drops its data folder
        await asyncio.to_thread(redis.start)  # same port, empty
        restarted_at = time.monotonic()
        await poll(lambda: listed(holders), "the replicas' resync into the new redis-server", 120)
        resynced_at = time.monotonic()
        await poll(lambda: _directory_up(registry), "the router's lookups succeeding again", 60)
        recovered_at = None
        deadline = time.monotonic() + 60
        while recovered_at is None and time.monotonic() < deadline:
            recovered_at = await probe_round(holders, "after")
            if recovered_at is None:
                await asyncio.sleep(0.5)
        await asyncio.sleep(1.0)  # a little load after recovery too
        await load.stop()
        degraded = (registry.get_sample_value(degraded_name) or 0.0) - degraded_before
    await directory.aclose()

    calls = load.calls + [c for _, c in probes]
    lost = sum(c.lost() for c in calls)
    during = [c for c in load.calls if c.sent_at < restarted_at and (c.ended_at or 0) > killed_at]
    recover = None if recovered_at is None else recovered_at - restarted_at
    return Row(
        "redis", f"redis-server SIGKILLed for {args.outage_s:.0f} s under load, restarted empty on the same port",
        f"{in_flight} ({args.load_concurrency} clients of load; {len(during)} requests during the outage)",
        len(calls), lost, "0", recover,
        f"requests during the outage all answered: {all(not c.lost() for c in during)}; load-only routing "
        f"{degraded:.1f} s; directory resynced {resynced_at - restarted_at:.1f} s after the restart; prefix on "
        f"its holder before: {baseline is not None}, after: {recovered_at is not None}",
        passed=lost == 0 and baseline is not None and recovered_at is not None,
        details={"holders": holders, "resync_s": resynced_at - restarted_at, "degraded_s": degraded,
                 "requests_during_outage": len(during),
                 "probes": [(phase, c.replica_id, c.cached_tokens, c.error) for phase, c in probes]},
    )


async def _directory_up(registry: Any) -> bool:
    return registry.get_sample_value("prefixserve:router_directory_available") == 1.0


# -------------------------------------------------------- replica SIGKILL
def replica_pids(handle: Any, want: int, timeout: float = 120.0) -> dict[str, int]:
    """replica_id -> pid of the live replicas."""
    from cluster.launch.local import stats_of_every_replica

    return {rid: stats["pid"] for rid, stats in stats_of_every_replica(handle, want, timeout).items()}


async def scenario_kill(address: str, handle: Any, args: Any) -> Row:
    pids = await asyncio.to_thread(replica_pids, handle, 2)
    prompts = [f"Here is a short story about the number {i}. Once upon a time," for i in range(args.streams)]
    requests = [text_request(p, args.kill_tokens) for p in prompts]
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        reference = await asyncio.gather(*(run_call(stub, r, Call()) for r in requests))
        calls = [Call() for _ in requests]
        tasks = [asyncio.ensure_future(run_call(stub, r, c)) for r, c in zip(requests, calls)]
        try:
            while min(len(c.token_ids) for c in calls) < 3 and not any(t.done() for t in tasks):
                await asyncio.sleep(0.01)
            running = [i for i, c in enumerate(calls) if c.ended_at is None]
            victim, _ = Counter(calls[i].replica_id for i in running).most_common(1)[0]
            affected = [i for i in running if calls[i].replica_id == victim]
            if victim not in pids:
                raise RuntimeError(f"streams ran on {victim}, which stats() did not name: {pids}")
            os.kill(pids[victim], signal.SIGKILL)
            killed_at = time.monotonic()
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()

    def resumed_at(call: Call) -> Optional[float]:
        return next((t for t, r in zip(call.chunk_times, call.chunk_replicas) if t > killed_at and r != victim), None)

    resumed = [resumed_at(calls[i]) for i in affected]
    recover = None if None in resumed or not resumed else max(resumed) - killed_at
    identical = sum(c.token_ids == r.token_ids and c.error is None for c, r in zip(calls, reference))
    lost = sum(c.lost() for c in calls)
    complete = sum(c.completion_tokens == args.kill_tokens for c in calls)
    return Row(
        "kill", f"SIGKILL of a replica process ({len(affected)} streams on it)",
        f"{len(running)} ({len(affected)} on the killed replica)", len(calls), lost, "0", recover,
        f"{identical}/{len(calls)} streams token-identical to the undisturbed greedy run; "
        f"{complete}/{len(calls)} complete",
        passed=lost == 0 and identical == len(calls) and len(affected) >= 8 and recover is not None,
        details={"victim": victim, "pid": pids[victim], "affected": len(affected),
                 "reference_errors": [r.error for r in reference if r.error],
                 "mismatched_streams": [i for i, (c, r) in enumerate(zip(calls, reference))
                                        if c.token_ids != r.token_ids]},
    )


# ------------------------------------------------------------------ flood
async def scenario_flood(address: str, args: Any) -> Row:
    attempts: list[list[Call]] = [[] for _ in range(args.flood)]

    async def client(i: int) -> None:
        for _ in range(args.max_attempts):
            call = Call()
            attempts[i].append(call)
            await run_call(stub, ids_request([10 + i, 11, 12, 13, 14], args.flood_tokens), call)
            if call.error != "RESOURCE_EXHAUSTED":
                return
            await asyncio.sleep((call.retry_after_ms or 100) / 1000)

    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        await asyncio.gather(*(client(i) for i in range(args.flood)))

    calls = [c for tries in attempts for c in tries]
    refused = [c for c in calls if c.error == "RESOURCE_EXHAUSTED"]
    hinted = sum(1 for c in refused if (c.retry_after_ms or 0) > 0)
    lost = sum(c.lost(expected=("RESOURCE_EXHAUSTED",)) for c in calls)
    done = [tries[-1] for tries in attempts if tries[-1].error is None]
    complete = sum(c.completion_tokens == args.flood_tokens and c.finish_reason == "length" for c in done)
    first_refusal = min((c.ended_at for c in refused), default=None)
    admitted = [tries[-1] for tries in attempts if len(tries) > 1 and tries[-1].error != "RESOURCE_EXHAUSTED"]
    recover = min(c.sent_at for c in admitted) - first_refusal if admitted and first_refusal is not None else None
    first_token = min((c.chunk_times[0] for c in admitted if c.chunk_times), default=None)
    admitted_first = sum(1 for tries in attempts if tries[0].error != "RESOURCE_EXHAUSTED")
    return Row(
        "flood", f"flood of one replica (max_num_seqs 2, max_waiting_requests 2) with {args.flood} requests at once",
        f"{args.flood} ({admitted_first} admitted on the first try)", len(calls), lost,
        f"{len(refused)} RESOURCE_EXHAUSTED", recover,
        f"retry-after-ms on {hinted}/{len(refused)}; {complete}/{args.flood} clients complete "
        f"(retrying after the hint)",
        passed=lost == 0 and bool(refused) and hinted == len(refused) and complete == args.flood,
        details={"attempts_per_client": [len(t) for t in attempts],
                 "retry_after_ms": sorted({c.retry_after_ms for c in refused}, key=lambda v: v or 0),
                 "first_refusal_to_first_retried_token_s":
                     None if first_token is None or first_refusal is None else first_token - first_refusal,
                 "refusal_details": sorted({c.details for c in refused})},
    )


# --------------------------------------------------------------- tiny KV pool
async def scenario_kv(address: str, handle: Any, args: Any) -> Row:
    prompts = [[(37 * i + 5 * j) % 400 + 20 for j in range(args.kv_prompt)] for i in range(args.kv_streams)]

    async def stats() -> dict:
        return await asyncio.to_thread(lambda: handle.stats.remote().result(timeout_s=60))

    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        reference = [await run_call(stub, ids_request(p, args.kv_tokens), Call()) for p in prompts]  # no preemption
        before = (await stats())["num_preemptions"]
        calls = await asyncio.gather(*(run_call(stub, ids_request(p, args.kv_tokens), Call()) for p in prompts))
        after = await stats()
    preemptions = after["num_preemptions"] - before
    gaps = [b - a for c in calls for a, b in zip(c.chunk_times, c.chunk_times[1:])]
    recover = max(gaps) if gaps else None
    identical = sum(c.token_ids == r.token_ids and c.error is None for c, r in zip(calls, reference))
    lost = sum(c.lost() for c in calls)
    need = cdiv((args.kv_prompt + args.kv_tokens), BLOCK_SIZE)
    return Row(
        "kv", f"tiny KV pool: {args.kv_blocks} blocks for {args.kv_streams} requests of {need} blocks each",
        f"{len(calls)}", len(calls), lost, "0", recover,
        f"{preemptions} preemptions; {identical}/{len(calls)} token-identical to a one-at-a-time run",
        passed=lost == 0 and preemptions > 0 and identical == len(calls),
        details={"preemptions": preemptions, "median_gap_s": sorted(gaps)[len(gaps) // 2] if gaps else None,
                 "used_blocks_after": after.get("num_used_blocks")},
    )
