"""The cache hand-over's hit rate through Ray Serve, under load (issue 33's
scale-down figure; docs/KV_TRANSFER.md, "Hand-over on scale-down").

Three replicas of one Serve deployment (the project's replica class, its
request router with ``prefix_cost``, the Redis directory) serve N system
prompts of 256 tokens, each placed on one replica (the way a prefix-aware
router keeps a tenant on its holder; balanced so each replica holds about a
third of the traffic, since Serve picks the replica it stops), then 150 requests of the
mix (Zipf 1.2, a 32-token question each) routed by the policy. While four
clients keep sending, the deployment is scaled to 2 replicas (``num_replicas``
alone changed: Serve stops one). Once the directory lists two live replicas,
the next 100 requests (4 at a time) are counted: the share of their prompt
tokens served from cache, over all of them and over the stopped replica's
tenants alone. Runs with the hand-over (``kv_handover_bytes`` 64 MiB, the
default) and without (0) alternate, one deployment after the other,
``--rounds`` times each.

``--scale up`` is the warm start's figure the same way: two replicas, then
three while the clients send (the new replica pulls the directory's hottest
prefixes before it takes traffic, ``kv_warm_start_bytes`` 64 MiB, or not, 0);
of the next 100 requests, those the new replica served and their hit rate.

The tiny random-init model: a hit rate depends on the hashes and the
routing, not on the weights. Run (inside ``unshare --net``, loopback only)::

    .venv/bin/python scripts/kv_handover_serve.py --systems 24 [--scale up] --json out.json
"""
import argparse
import asyncio
import json
import logging
import random
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster.shared.types import GenerationRequest, SamplingParams  # noqa: E402
from tests.integration.test_kv_handover_serve import handover_replica, live, served_by  # noqa: E402

logger = logging.getLogger("kv_handover_serve")
APP = "kv-handover-bench"
BLOCK = 16


def zipf(num_systems: int, num: int, rng: random.Random) -> list[int]:
    weights = [1 / (i + 1) ** 1.2 for i in range(num_systems)]
    return rng.choices(range(num_systems), weights, k=num)


def balanced_homes(num_systems: int, replicas: list[str]) -> dict[int, str]:
    """Each system prompt's replica: the hottest first, each to the replica with the least
    Zipf weight so far, so whichever replica Serve stops held about a third of the traffic."""
    load = {r: 0.0 for r in replicas}
    home = {}
    for s in range(num_systems):
        home[s] = min(replicas, key=lambda r: (load[r], r))
        load[home[s]] += 1 / (s + 1) ** 1.2
    return home


async def routed(handle, request_id: str, prompt: list[int]) -> dict:
    """One request through the deployment's request router (the policy picks the replica);
    a call Serve still routes to the replica it is stopping is sent again."""
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    for _ in range(20):
        try:
            final = None
            stream = handle.options(stream=True, method_name="generate").remote(
                GenerationRequest(f"{request_id}-{uuid.uuid4().hex[:8]}", prompt, params))
            async for chunk in stream:
                final = chunk
            return {"cached": final.cached_prompt_tokens, "prompt": len(prompt), "replica": final.replica_id}
        except Exception as exc:  # noqa: BLE001 - the stopped replica, still in Serve's table for a moment
            logger.info("%s: sent again after %s", request_id, type(exc).__name__)
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{request_id}: no replica answered")


async def clients(handle, prompts: list[list[int]], tag: str, concurrency: int) -> list[dict]:
    queue = list(enumerate(prompts))
    out: list[dict] = [{} for _ in prompts]

    async def worker() -> None:
        while queue:
            i, prompt = queue.pop(0)
            out[i] = await routed(handle, f"{tag}{i}", prompt)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return out


async def one_run(handle, deployment, args_, config, systems: list[list[int]], seed: int, start: int,
                  end: int) -> dict:
    from ray import serve

    rng = random.Random(seed)
    question = lambda: [rng.randrange(3, 500) for _ in range(32)]  # noqa: E731
    deadline = time.monotonic() + 120
    while len(replicas := sorted(await live(config))) < start and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    assert len(replicas) == start, replicas
    home = balanced_homes(len(systems), replicas)
    for s, system in enumerate(systems):  # each tenant's first request on its home
        await served_by(handle, home[s], f"place{s}", system + question())
    logger.info("placed %d system prompts on %d replicas", len(systems), start)
    await clients(handle, [systems[s] + question() for s in zipf(len(systems), 150, rng)], "warm", 4)
    stop_load = asyncio.Event()

    async def load() -> None:
        n = 0
        while not stop_load.is_set():
            s = zipf(len(systems), 1, rng)[0]
            await routed(handle, f"load{n}", systems[s] + question())
            n += 1

    loaders = [asyncio.ensure_future(load()) for _ in range(4)]
    began = time.monotonic()
    # Scale-up: serve.run returns once the new replica runs (its warm start is in its start-up).
    await asyncio.to_thread(serve.run, deployment.options(num_replicas=end).bind(*args_), name=APP,
                            route_prefix=None)
    while len(now := await live(config)) != end and time.monotonic() - began < 180:
        await asyncio.sleep(0.2)
    scaled_s = time.monotonic() - began
    stop_load.set()
    await asyncio.gather(*loaders)
    assert len(now) == end, now
    changed = next(iter(set(replicas) ^ set(now)))
    logger.info("scaled %d -> %d in %.1f s under load; %s %s", start, end, scaled_s, changed,
                "stopped" if end < start else "joined")
    picks = zipf(len(systems), 100, rng)
    got = await clients(handle, [systems[s] + question() for s in picks], "after", 4)
    # Scale-down: the stopped replica's tenants; scale-up: the requests the new replica served.
    mine = [g for s, g in zip(picks, got) if home.get(s) == changed or g["replica"] == changed]
    share = lambda rows: sum(r["cached"] for r in rows) / max(1, sum(r["prompt"] for r in rows))  # noqa: E731
    return {"hit_rate": share(got), "changed_hit_rate": share(mine), "changed_requests": len(mine),
            "scale_s": scaled_s}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--systems", type=int, default=24, help="system prompts (tenants)")
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2, help="runs of each mode, alternated")
    parser.add_argument("--scale", choices=["down", "up"], default="down",
                        help="down: 3 -> 2, hand-over on and off; up: 2 -> 3, warm start on and off")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    from ray import serve

    from cluster.app.builder import replica_options
    from cluster.launch.redis_server import RedisServer
    from cluster.shared.config import ClusterConfig, EngineConfig
    from cluster.shared.ray_local import init_local_ray
    from tests.factories import make_tiny_model_dir

    rng = random.Random(args.seed)
    systems = [[rng.randrange(3, 500) for _ in range(256)] for _ in range(args.systems)]
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp, RedisServer() as redis:
        model_dir = make_tiny_model_dir("llama", Path(tmp) / "tiny")
        init_local_ray(num_cpus=4)
        serve.start(proxy_location="Disabled")
        start, end, name, knob = (3, 2, "hand-over", "kv_handover_bytes") if args.scale == "down" else (
            2, 3, "warm-start", "kv_warm_start_bytes")
        for key, budget in [(f"{m} {i + 1}", b) for i in range(args.rounds)
                            for m, b in ((name, 64 * 2**20), ("none", 0))]:
            mode = key.split()[0]
            engine = EngineConfig.from_kwargs(model=str(model_dir), block_size=BLOCK, num_kv_blocks=2048, **{
                "kv_warm_start_bytes": 0, "kv_handover_bytes": 0, knob: budget})
            config = ClusterConfig(replicas=start, redis_url=redis.url, namespace=f"kvhb-{uuid.uuid4().hex[:6]}",
                                   engine=engine, replica_num_cpus=0.25, routing_policy="prefix_cost")
            deployment = serve.deployment(handover_replica()).options(
                **replica_options(config), version=f"bench-{mode}", _internal=True)
            args_ = (engine.flat(), config.redis_url, config.namespace)
            handle = serve.run(deployment.bind(*args_), name=APP, route_prefix=None)
            try:
                results[key] = asyncio.run(one_run(handle, deployment, args_, config, systems,
                                                   args.seed + len(results), start, end))
            finally:
                serve.delete(APP)
            logger.info("%s: %s", key, results[key])
    which = "stopped tenants" if args.scale == "down" else "new replica"
    print(f"{'run':<13} {'hit rate, next 100':>20} {which:>16} {'its requests':>13} {'scaling s':>10}")
    for mode, r in results.items():
        print(f"{mode:<13} {r['hit_rate']:>20.3f} {r['changed_hit_rate']:>16.3f} "
              f"{r['changed_requests']:>13d} {r['scale_s']:>10.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"systems": args.systems, "scale": args.scale, "runs": results},
                                              indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
