#!/usr/bin/env python3
"""TTFT of a prefix fetched from another replica, against a local prefix hit
and a cold prefill, in one run (issue 33).

Starts a local Ray on loopback and two replicas of the model as Ray actors
(``ReplicaServer``, default model unless ``--model``): a holder and a
receiver. Each round uses fresh random prompts of ``--prefix`` tokens plus
``--suffix`` new ones and times, on the receiver, in an order rotated from
round to round (the CPU's speed drifts; only ratios within a run mean
anything):

    cold     a prompt no replica has seen: the whole prompt prefills
    fetched  its prefix cached on the holder only: fetch_and_generate (ask the
             holder through its actor handle, bytes through Ray's object
             store, import between two steps), then the suffix prefills
    local    its prefix cached on the receiver (warmed before): the suffix prefills

Both caches are written once before the rounds (``--fresh-pages`` skips
it): a replica that has served a while has touched every page, while a first
write into a page of the lazily allocated cache faults it in (a new replica).
TTFT is taken inside the receiver, from the call to the first token (one
token asked). Also measured: the receiver's kv_transfer_seconds (ask ->
hittable), and the copies alone on the receiver's cache (read: what the
holder does off its engine thread; write: the pause of the engine thread).
Prints a table and writes JSON. Run it inside a loopback-only namespace:

    unshare --net bash -c 'ip link set lo up; .venv/bin/python scripts/bench_kv_transfer.py --out /tmp/kv_transfer.json'
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster.shared.ray_local import init_local_ray  # noqa: E402
from cluster.shared.types import GenerationRequest, SamplingParams  # noqa: E402
from workers.replica import ReplicaServer  # noqa: E402

MODES = ("cold", "fetched", "local")


def bench_replica() -> type:
    """The replica with timing methods (a local class: Ray pickles it by value)."""

    class BenchReplica(ReplicaServer):
        async def first_token(self, request: GenerationRequest, holder: Any = None) -> dict:
            began = time.perf_counter()
            stream = self.generate(request) if holder is None else self.fetch_and_generate(request, holder)
            ttft, cached = None, None
            async for chunk in stream:
                if ttft is None and chunk.token_ids:
                    ttft = time.perf_counter() - began
                cached = chunk.cached_prompt_tokens
            return {"ttft_s": ttft, "cached": cached}

        async def time_copies(self, prompt: list[int], repeats: int = 5) -> dict:
            """Reads a cached prefix's blocks and writes the same bytes back (idle replica)."""
            from workers.kv_copy import read_blocks, write_blocks

            hashes, _ = self.kv_transfer.prefix_hashes(prompt)
            pool = self.kv_transfer.ledger.pool
            block_ids = [pool.get_cached_block(h) for h in hashes]
            assert None not in block_ids, "the prefix is not cached here"
            reads, writes = [], []
            for _ in range(repeats):
                began = time.perf_counter()
                data = read_blocks(self.kv_transfer.runner, block_ids)
                reads.append(time.perf_counter() - began)
                began = time.perf_counter()
                write_blocks(self.kv_transfer.runner, block_ids, data)
                writes.append(time.perf_counter() - began)
            return {"blocks": len(block_ids), "bytes": int(data.nbytes), "read_s": statistics.median(reads),
                    "write_s": statistics.median(writes)}

        def touch_cache(self) -> int:
            """Writes every page of the KV cache once (idle replica, before any request), as
            a replica that has served a while has: the cache is allocated lazily, and a
            first write into a page faults it in. Returns the bytes touched."""
            caches = self.kv_transfer.runner.kv_caches
            for cache in caches:
                cache.zero_()
            return sum(c.numel() * c.element_size() for c in caches)

        def stages(self) -> dict:
            """Seconds of the last fetch's stages (ask, import) and export's (pin, read)."""
            return {**self.kv_transfer.last_fetch, **self.kv_transfer.last_export}

        def transfer_seconds(self) -> dict:
            m = self.kv_transfer.metrics
            return {"count": m.value("kv_transfer_seconds_count"), "sum": m.value("kv_transfer_seconds_sum"),
                    "fallbacks": sum(m.value("kv_transfer_fallbacks_total", reason=r)
                                     for r in ("busy", "error", "timeout", "not_held", "no_room", "mismatch"))}

    return BenchReplica


def request(request_id: str, prompt: list[int]) -> GenerationRequest:
    return GenerationRequest(request_id, prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))


def run(args: argparse.Namespace) -> dict:
    import ray

    init_local_ray(num_cpus=2, object_store_mb=256)
    actor = ray.remote(num_cpus=0.5)(bench_replica())
    config: dict[str, Any] = {"num_kv_blocks": args.num_kv_blocks}
    if args.model:
        config["model"] = args.model
    if args.kv_cache_dtype:
        config["kv_cache_dtype"] = args.kv_cache_dtype
    holder = actor.remote(config, replica_id="holder")
    receiver = actor.remote(config, replica_id="receiver")
    if not args.fresh_pages:
        ray.get([holder.touch_cache.remote(), receiver.touch_cache.remote()])
    rng = random.Random(args.seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(1000, 40000) for _ in range(n)]

    # Warm-up: first steps of each shape, the transfer path once.
    warm = prompt(args.prefix + args.suffix)
    ray.get(holder.first_token.remote(request("w-h", warm)))
    ray.get(receiver.first_token.remote(request("w-r", prompt(args.prefix + args.suffix))))
    ray.get(receiver.first_token.remote(request("w-f", warm), holder))
    times: dict[str, list[float]] = {m: [] for m in MODES}
    stages: dict[str, list[float]] = {"ask_s": [], "import_s": [], "pin_s": [], "read_s": []}
    for r in range(args.rounds):
        shared, local = prompt(args.prefix), prompt(args.prefix)
        ray.get(holder.first_token.remote(request(f"h{r}", shared + prompt(args.suffix))))
        ray.get(receiver.first_token.remote(request(f"l{r}", local + prompt(args.suffix))))
        prompts = {"cold": prompt(args.prefix + args.suffix), "fetched": shared + prompt(args.suffix),
                   "local": local + prompt(args.suffix)}
        order = MODES[r % 3:] + MODES[: r % 3]
        for mode in order:
            out = ray.get(receiver.first_token.remote(request(f"{mode}{r}", prompts[mode]),
                                                      holder if mode == "fetched" else None))
            expected = 0 if mode == "cold" else args.prefix
            assert out["cached"] == expected, (mode, out)  # a fetch that fell back would show here
            times[mode].append(out["ttft_s"])
            if mode == "fetched":
                for name, value in {**ray.get(receiver.stages.remote()), **ray.get(holder.stages.remote())}.items():
                    stages[name].append(value)
    copies = ray.get(receiver.time_copies.remote(warm))
    transfer = ray.get(receiver.transfer_seconds.remote())
    for handle in (holder, receiver):
        ray.kill(handle)
    med = {m: statistics.median(v) for m, v in times.items()}
    return {
        "prefix_tokens": args.prefix, "suffix_tokens": args.suffix, "rounds": args.rounds,
        "kv_cache_dtype": args.kv_cache_dtype or "auto", "fresh_pages": args.fresh_pages,
        "ttft_s": times, "median_ttft_s": med,
        "fetched_over_local": med["fetched"] / med["local"], "cold_over_local": med["cold"] / med["local"],
        "cold_over_fetched": med["cold"] / med["fetched"],
        "transfer_mean_s": transfer["sum"] / transfer["count"] if transfer["count"] else None,
        "transfers": transfer["count"], "fallbacks": transfer["fallbacks"], "copies": copies,
        "median_stage_s": {name: statistics.median(v) for name, v in stages.items() if v},
    }


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder or .gguf (default: the packaged model)")
    parser.add_argument("--prefix", type=int, default=512, help="tokens of the shared prefix")
    parser.add_argument("--suffix", type=int, default=8, help="new tokens after it")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--kv-cache-dtype", default="", help="auto (the model's dtype) or int8")
    parser.add_argument("--num-kv-blocks", type=int, default=1024, help="KV blocks per replica")
    parser.add_argument("--fresh-pages", action="store_true",
                        help="leave the caches' pages untouched (a new replica) instead of writing them all first")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("kv_transfer_bench.json"))
    args = parser.parse_args(argv)
    results = run(args)
    print(f"{'mode':<10}{'median TTFT':>14}{'all rounds (s)':>40}")
    for mode in MODES:
        rounds = " ".join(f"{t:.3f}" for t in results["ttft_s"][mode])
        print(f"{mode:<10}{results['median_ttft_s'][mode]:>13.3f}s   {rounds}")
    print(f"fetched / local {results['fetched_over_local']:.2f}x   cold / local {results['cold_over_local']:.1f}x   "
          f"cold / fetched {results['cold_over_fetched']:.1f}x")
    c = results["copies"]
    print(f"transfer (ask -> hittable) mean {results['transfer_mean_s'] * 1e3:.1f} ms over {results['transfers']:.0f}, "
          f"{results['fallbacks']:.0f} fallbacks; {c['blocks']} blocks = {c['bytes'] / 1e6:.1f} MB: read "
          f"{c['read_s'] * 1e3:.1f} ms, write {c['write_s'] * 1e3:.1f} ms")
    st = results["median_stage_s"]
    print("fetch stages (median): ask the holder " + f"{st['ask_s'] * 1e3:.1f} ms (its pin {st['pin_s'] * 1e3:.1f}, "
          f"read {st['read_s'] * 1e3:.1f}), import (reserve, write off the engine thread, commit) {st['import_s'] * 1e3:.1f} ms")
    args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
