"""``prefixserve soak``: a bounded mixed workload against a cluster's gRPC
router, counting every outcome, then checking that nothing leaked.

Each request is drawn (seeded) from a mix a production router sees:

    normal      random prompt (``--min-prompt``..``--max-prompt`` tokens) and
                output length; must finish with ``length`` or ``stop``
    chat        a short conversation rendered with the chat template
    cancel      the client cancels after a few chunks
    deadline    a deadline too short to finish: DEADLINE_EXCEEDED
    bad         an invalid request (empty prompt, top_p 0, out-of-range
                token id, max_tokens past the context): INVALID_ARGUMENT

Anything else -- an error on a valid request, a stream without a finish
reason, a bad request that is accepted -- is *unexpected*. The run lasts
``--duration`` seconds with ``--concurrency`` clients and stops by itself.
At the end every replica must hold zero used KV blocks (all free or cached)
and no running or waiting sequence; RSS of the router process and of each
replica is reported at the start and the end.

Without ``--url`` it starts a local cluster (``--replicas``, the default
model unless ``--model``), runs, and stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

KINDS = {"normal": 0.55, "chat": 0.1, "cancel": 0.15, "deadline": 0.08, "bad": 0.12}


def add_soak_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--duration", type=float, default=300.0, help="seconds of load (the run stops by itself)")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--replicas", type=int, default=2, help="replicas of the local cluster")
    parser.add_argument("--min-prompt", type=int, default=8)
    parser.add_argument("--max-prompt", type=int, default=400)
    parser.add_argument("--max-output", type=int, default=64)
    parser.add_argument("--workload-seed", type=int, default=0)
    parser.add_argument("--json", default="bench-results/soak.json")


def _draw_kind(rng: random.Random) -> str:
    x, acc = rng.random(), 0.0
    for kind, weight in KINDS.items():
        acc += weight
        if x < acc:
            return kind
    return "normal"


def _bad_request(rng: random.Random, pb: Any, vocab: int, max_len: int) -> Any:
    choice = rng.randrange(4)
    if choice == 0:
        return pb.GenerateRequest(prompt="")
    if choice == 1:
        return pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(top_p=0.0))
    if choice == 2:
        return pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[1, vocab + 5]))
    return pb.GenerateRequest(prompt="hello", sampling=pb.SamplingParams(max_tokens=max_len * 4))


async def run_soak(address: str, args: argparse.Namespace, vocab: int, max_len: int) -> dict[str, Any]:
    """Drives the mix for ``args.duration`` seconds; returns outcome counts."""
    import grpc

    from router.pb import generation_pb2 as pb
    from router.pb import generation_pb2_grpc as pb_grpc

    outcomes: Counter = Counter()
    unexpected: list[str] = []
    tokens = 0
    stop_at = time.monotonic() + args.duration

    async def one(stub: Any, rng: random.Random) -> None:
        nonlocal tokens
        kind = _draw_kind(rng)
        max_tokens = rng.randint(1, args.max_output)
        sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=rng.choice([0.0, 0.8]), seed=rng.randrange(99))
        if kind == "bad":
            request = _bad_request(rng, pb, vocab, max_len)
        elif kind == "chat":
            request = pb.GenerateRequest(messages=pb.ChatMessages(items=[
                pb.ChatMessage(role="system", content="You are terse."),
                pb.ChatMessage(role="user", content=f"Name {rng.randint(2, 9)} colours.")]), sampling=sampling)
        else:
            n = rng.randint(args.min_prompt, args.max_prompt)
            ids = [rng.randrange(3, vocab) for _ in range(n)]
            request = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=ids), sampling=sampling)
        timeout = 0.05 if kind == "deadline" else 120.0
        cancel_after = rng.randint(1, 3) if kind == "cancel" else None
        finish = ""
        chunks = 0
        call = stub.Generate(request, timeout=timeout)
        try:
            async for chunk in call:
                chunks += 1
                tokens += len(chunk.token_ids)
                finish = chunk.finish_reason or finish
                if cancel_after is not None and chunks >= cancel_after:
                    call.cancel()
                    break
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            expected = {"bad": grpc.StatusCode.INVALID_ARGUMENT, "deadline": grpc.StatusCode.DEADLINE_EXCEEDED}
            if expected.get(kind) == code or (kind == "cancel" and code == grpc.StatusCode.CANCELLED):
                outcomes[f"{kind}:{code.name}"] += 1
                return
            outcomes[f"{kind}:unexpected"] += 1
            unexpected.append(f"{kind}: {code.name}: {exc.details()}")
            return
        if kind == "cancel" and cancel_after is not None and chunks >= cancel_after:
            outcomes["cancel:CANCELLED"] += 1
        elif kind == "bad":
            outcomes["bad:unexpected"] += 1
            unexpected.append(f"bad request accepted: {request}")
        elif finish in ("length", "stop") or (kind == "deadline" and finish):
            outcomes[f"{kind}:{finish}"] += 1
        else:
            outcomes[f"{kind}:unexpected"] += 1
            unexpected.append(f"{kind}: stream ended without a finish reason after {chunks} chunks")

    async def client(index: int, stub: Any) -> None:
        rng = random.Random(f"{args.workload_seed}-{index}")
        while time.monotonic() < stop_at:
            await one(stub, rng)

    began = time.monotonic()
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        await asyncio.gather(*(client(i, stub) for i in range(args.concurrency)))
    return {"seconds": round(time.monotonic() - began, 1), "requests": sum(outcomes.values()),
            "outcomes": dict(sorted(outcomes.items())), "unexpected": unexpected[:20],
            "num_unexpected": len(unexpected), "tokens_streamed": tokens}


def replica_snapshot(handle: Any, replicas: int, timeout: float = 60.0) -> dict[str, dict[str, Any]]:
    """Stats and RSS of every replica."""
    import psutil

    from cluster.launch.local import stats_of_every_replica

    seen = stats_of_every_replica(handle, replicas, timeout)
    for stats in seen.values():
        try:
            stats["rss_mib"] = round(psutil.Process(stats["pid"]).memory_info().rss / 2**20, 1)
        except (psutil.Error, KeyError):
            stats["rss_mib"] = None
    return seen


def wait_idle(handle: Any, replicas: int, timeout: float = 60.0) -> dict[str, dict[str, Any]]:
    """Replica snapshots once no replica holds a used block or a sequence (or the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        snap = replica_snapshot(handle, replicas)
        busy = [s for s in snap.values() if s["num_used_blocks"] or s["num_running"] or s["num_waiting"]]
        if not busy or time.monotonic() > deadline:
            return snap
        time.sleep(0.5)


def run_soak_command(args: argparse.Namespace, engine_args: dict[str, Any]) -> int:
    import dataclasses

    import psutil

    from cluster.app import model_info
    from cluster.shared.config import ClusterConfig, EngineConfig
    from cluster.launch.local import LocalCluster

    engine = EngineConfig.from_kwargs(**engine_args)
    config = ClusterConfig(replicas=args.replicas, engine=engine)
    config = dataclasses.replace(config, router=dataclasses.replace(config.router, http_port=None, grpc_port=0))
    model_dir, _, max_len = model_info(config)
    vocab = int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])
    me = psutil.Process()
    with LocalCluster(config, grpc_port=0) as cluster:
        before = replica_snapshot(cluster.handle, args.replicas)
        router_before = me.memory_info().rss / 2**20
        logger.info("soak: %d clients for %.0fs against %s", args.concurrency, args.duration, cluster.grpc_address)
        result = asyncio.run(run_soak(cluster.grpc_address, args, vocab, max_len))
        after = wait_idle(cluster.handle, args.replicas)
        router_after = me.memory_info().rss / 2**20
    result["router_rss_mib"] = {"start": round(router_before, 1), "end": round(router_after, 1)}
    result["replicas"] = {
        rid: {"rss_mib_start": before.get(rid, {}).get("rss_mib"), "rss_mib_end": s["rss_mib"],
              "num_used_blocks_end": s["num_used_blocks"], "num_free_blocks_end": s["num_free_blocks"],
              "num_device_blocks": s["num_device_blocks"], "num_running_end": s["num_running"],
              "num_waiting_end": s["num_waiting"]}
        for rid, s in after.items()}
    leaked = sum(r["num_used_blocks_end"] for r in result["replicas"].values())
    result["leaked_blocks"] = leaked
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "unexpected"}, indent=2))  # the report is the output
    for line in result["unexpected"]:
        logger.error("unexpected: %s", line)
    return 0 if result["num_unexpected"] == 0 and leaked == 0 else 1

