#!/usr/bin/env python3
"""Measures the Redis prefix directory: memory per entry and call latencies.

Starts its own ``redis-server`` on a loopback port, loads ``--blocks`` distinct
block hashes into each of ``--replicas`` replicas (via ``resync``), reads
``INFO memory`` and ``MEMORY USAGE``, then times lookups of a long chain
against many replicas and per-step publishes. Prints a table and writes JSON.

    python3 scripts/bench_directory.py --out /tmp/directory_bench.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster.shared.directory import Directory  # noqa: E402
from cluster.launch.redis_server import RedisServer  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def measure_memory(directory: Directory, num_replicas: int, num_blocks: int) -> dict:
    client = directory._client
    before = (await client.info("memory"))["used_memory"]
    for r in range(num_replicas):
        epoch = await directory.register(f"mem{r}")
        await directory.resync(f"mem{r}", epoch, 1, [os.urandom(16) for _ in range(num_blocks)])
    after = (await client.info("memory"))["used_memory"]
    key_usage = await client.memory_usage(f"{directory.prefix}blk:mem0", samples=0)
    entries = num_replicas * num_blocks
    for r in range(num_replicas):
        await directory.deregister(f"mem{r}", (await directory.live_replicas())[f"mem{r}"])
    return {
        "entries": entries,
        "used_memory_delta_bytes": after - before,
        "bytes_per_entry_info": (after - before) / entries,
        "bytes_per_entry_memory_usage": key_usage / num_blocks,
    }


async def measure_lookup(directory: Directory, num_replicas: int, chain_len: int, repeats: int) -> dict:
    chain = [os.urandom(16) for _ in range(chain_len)]
    for r in range(num_replicas):
        held = chain[: (r * chain_len) // max(1, num_replicas - 1)]  # 0 .. whole chain
        epoch = await directory.register(f"look{r}")
        await directory.resync(f"look{r}", epoch, 1, held + [os.urandom(16) for _ in range(5000)])
    timings = []
    for _ in range(repeats):
        start = time.perf_counter()
        counts = await directory.lookup(chain)
        timings.append((time.perf_counter() - start) * 1e3)
    assert len(counts) == num_replicas
    return {
        "replicas": num_replicas,
        "chain_blocks": chain_len,
        "lookup_ms_p50": statistics.median(timings),
        "lookup_ms_p99": percentile(timings, 0.99),
    }


async def measure_publish(directory: Directory, blocks_per_step: int, repeats: int) -> dict:
    epoch = await directory.register("pub")
    await directory.resync("pub", epoch, 1, [])
    timings = []
    for seq_no in range(2, repeats + 2):
        stored = [os.urandom(16) for _ in range(blocks_per_step)]
        start = time.perf_counter()
        await directory.publish("pub", epoch, seq_no, stored=stored)
        timings.append((time.perf_counter() - start) * 1e3)
    return {
        "blocks_per_step": blocks_per_step,
        "publish_ms_p50": statistics.median(timings),
        "publish_ms_p99": percentile(timings, 0.99),
    }


async def measure_follower(url: str, num_replicas: int, num_blocks: int, repeats: int) -> dict:
    """A router's local index: catch-up (full sync) time, events applied per
    second, and an in-memory lookup's time, all against the real stream."""
    from cluster.shared.directory.follower import IndexFollower

    directory = Directory.from_url(url, "follow", ttl_s=600.0, socket_timeout_s=10.0)
    epochs = {}
    for r in range(num_replicas):
        epochs[r] = await directory.register(f"f{r}")
        await directory.resync(f"f{r}", epochs[r], 1, [os.urandom(16) for _ in range(num_blocks)])
    follower = IndexFollower(Directory.from_url(url, "follow", ttl_s=600.0, socket_timeout_s=10.0))
    start = time.perf_counter()
    await follower.full_sync()
    catch_up_s = time.perf_counter() - start
    seqs = {r: 1 for r in range(num_replicas)}
    for i in range(repeats):  # 32 new blocks per batch, round robin over the replicas
        r = i % num_replicas
        seqs[r] += 1
        status = await directory.publish(f"f{r}", epochs[r], seqs[r], stored=[os.urandom(16) for _ in range(32)])
        assert status.value == "ok", status
    start = time.perf_counter()
    applied = follower.num_events
    while follower.num_events < applied + repeats:  # stop before a read that would wait for more
        await follower.step()
    apply_s = time.perf_counter() - start
    chain = [os.urandom(16) for _ in range(512)]
    follower.index.load_snapshot("hot", 1, 0, chain)
    timings = []
    for _ in range(repeats):
        began = time.perf_counter()
        follower.lookup(chain)
        timings.append((time.perf_counter() - began) * 1e6)
    await follower.directory.aclose()
    await directory.aclose()
    return {
        "replicas": num_replicas, "blocks_per_replica": num_blocks, "catch_up_s": catch_up_s,
        "events_applied": follower.num_events - applied,
        "events_per_s": (follower.num_events - applied) / max(apply_s, 1e-9),
        "lookup_512_us_p50": statistics.median(timings), "lookup_512_us_p99": percentile(timings, 0.99),
    }


async def run(url: str, args: argparse.Namespace) -> dict:
    def fresh(namespace: str) -> Directory:  # one namespace per measurement
        return Directory.from_url(url, namespace, ttl_s=600.0, socket_timeout_s=10.0)

    results = {}
    directory = fresh("memory")
    results["memory"] = await measure_memory(directory, args.replicas, args.blocks)
    start = time.perf_counter()
    epoch = await directory.register("resync")
    await directory.resync("resync", epoch, 1, [os.urandom(16) for _ in range(args.blocks)])
    results["resync_ms"] = {"blocks": args.blocks, "ms": (time.perf_counter() - start) * 1e3}
    await directory.aclose()
    results["lookup"] = []
    for num_replicas, chain_len in ((4, 128), (32, 512)):
        directory = fresh(f"lookup-{num_replicas}")
        results["lookup"].append(await measure_lookup(directory, num_replicas, chain_len, args.repeats))
        await directory.aclose()
    directory = fresh("publish")
    results["publish"] = await measure_publish(directory, 32, args.repeats)
    await directory.aclose()
    results["follower"] = await measure_follower(url, args.replicas, args.blocks, args.repeats)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=100_000, help="distinct blocks per replica")
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--out", type=Path, default=Path("directory_bench.json"))
    args = parser.parse_args()
    with RedisServer() as server:
        results = asyncio.run(run(server.url, args))
    mem = results["memory"]
    print(f"{'measure':<44}{'value':>12}")
    print(f"{'entries (block, replica)':<44}{mem['entries']:>12,}")
    print(f"{'bytes/entry (INFO used_memory delta)':<44}{mem['bytes_per_entry_info']:>12.1f}")
    print(f"{'bytes/entry (MEMORY USAGE of one set)':<44}{mem['bytes_per_entry_memory_usage']:>12.1f}")
    print(f"{'resync of ' + str(args.blocks) + ' blocks (ms)':<44}{results['resync_ms']['ms']:>12.1f}")
    for row in results["lookup"]:
        label = f"lookup {row['chain_blocks']} blocks x {row['replicas']} replicas p50/p99 (ms)"
        print(f"{label:<44}{row['lookup_ms_p50']:>6.2f}/{row['lookup_ms_p99']:<5.2f}")
    fol = results["follower"]
    print(f"{'router index catch-up, ' + str(fol['replicas'] * fol['blocks_per_replica']) + ' entries (s)':<44}"
          f"{fol['catch_up_s']:>12.2f}")
    print(f"{'router index events applied per s':<44}{fol['events_per_s']:>12.0f}")
    print(f"{'router index lookup, 512 blocks p50/p99 (us)':<44}{fol['lookup_512_us_p50']:>6.1f}/"
          f"{fol['lookup_512_us_p99']:<5.1f}")
    pub = results["publish"]
    label = f"publish {pub['blocks_per_step']} blocks/step p50/p99 (ms)"
    print(f"{label:<44}{pub['publish_ms_p50']:>6.2f}/{pub['publish_ms_p99']:<5.2f}")
    args.out.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
