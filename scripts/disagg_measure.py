"""Disaggregated prefill measured in one process (docs/DISAGGREGATION.md): three
replicas of the default model (float32) - a prefill replica P, a decode replica D
and a single replica S - wired as under Serve but through ``LocalPrefiller`` /
``LocalHolder`` (no Ray). Rounds interleave the two modes, in an order rotated
per round, fresh random prompts each time:

- ``lone``: one request (``--prompt-len`` tokens in, 16 out) served whole on S
  (aggregated) against prefilled on P, pulled and decoded on D (disaggregated):
  TTFT, and for the latter the time P's prefill and D's pull took.
- ``interference``: a long decode (64 tokens) runs; after its 8th token a new
  request of ``--prompt-len`` tokens arrives. Aggregated: both on S (the new
  prompt's prefill shares S's steps with the decode); disaggregated: the decode
  on D, the newcomer prefilled on P, then decoded on D. The long decode's
  largest gap between two tokens and its mean inter-token latency, and the
  newcomer's TTFT.

All three replicas share this machine's cores (the forward threads of each
engine), so P's prefill still takes CPU from D: what disaggregation removes
here is D's step waiting for a prefill chunk, not the CPU it costs.

Run: ``.venv/bin/python scripts/disagg_measure.py --rounds 5 --out /tmp/disagg.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster.shared.types import GenerationRequest, SamplingParams  # noqa: E402
from workers.disagg import LocalPrefiller  # noqa: E402
from workers.kv_transfer import LocalHolder  # noqa: E402
from workers.replica import ReplicaServer  # noqa: E402


async def stream(replica: ReplicaServer, request_id: str, prompt: list[int], max_tokens: int, disagg: bool,
                 after: int = 0, arrived: asyncio.Event = None) -> dict:
    """Token arrival times (from the call) of one request; sets ``arrived`` after ``after`` tokens."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    request = GenerationRequest(request_id, prompt, params, kv_fetch_from={"D": "P"} if disagg else {},
                                kv_prefill_first=disagg)
    began = time.perf_counter()
    times, tokens, cached = [], [], 0
    async for chunk in replica.generate(request):
        now = time.perf_counter() - began
        times += [now] * len(chunk.token_ids)
        tokens += chunk.token_ids
        cached = chunk.cached_prompt_tokens
        if arrived is not None and len(tokens) >= after:
            arrived.set()
    return {"times": times, "tokens": tokens, "cached": cached}


def prompt_of(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 20000) for _ in range(n)]


async def lone(reps: dict, mode: str, prompt: list[int], tag: str) -> dict:
    disagg = mode == "disaggregated"
    replica = reps["D"] if disagg else reps["S"]
    got = await stream(replica, f"lone-{mode}-{tag}", prompt, 16, disagg)
    row = {"ttft_s": got["times"][0], "cached": got["cached"], "tokens": got["tokens"]}
    if disagg:
        row["pull_s"] = sum(reps["D"].kv_transfer.last_fetch.values())
        row["prefill_s"] = reps["D"].last_remote_prefill_s
    return row


async def interference(reps: dict, mode: str, rng: random.Random, prompt_len: int, tag: str) -> dict:
    disagg = mode == "disaggregated"
    replica = reps["D"] if disagg else reps["S"]
    arrived = asyncio.Event()
    # The long decode's own prompt is short (one block): nothing to hand over, it prefills where it runs.
    long = asyncio.ensure_future(stream(replica, f"long-{mode}-{tag}", prompt_of(rng, 16), 64, False, 8, arrived))
    await arrived.wait()
    newcomer = await stream(replica, f"new-{mode}-{tag}", prompt_of(rng, prompt_len), 4, disagg)
    long = await long
    gaps = [b - a for a, b in zip(long["times"][8:], long["times"][9:])]
    return {"long_max_gap_s": max(gaps), "long_itl_s": statistics.mean(gaps), "new_ttft_s": newcomer["times"][0]}


async def main(args) -> dict:
    config = {"num_kv_blocks": 256, "dtype": "float32"}
    reps = {name: ReplicaServer(config, replica_id=name) for name in ("P", "D", "S")}
    reps["D"].holder_of = lambda rid: LocalHolder(reps["P"].kv_transfer)
    reps["D"].prefiller_of = lambda rid: LocalPrefiller(reps["P"])
    rng = random.Random(args.seed)
    rows = {"lone": {"aggregated": [], "disaggregated": []}, "interference": {"aggregated": [], "disaggregated": []}}
    try:
        for _ in range(2):  # warm-up: page in the caches, start the thread pools
            prompt = prompt_of(rng, args.prompt_len)
            await lone(reps, "aggregated", prompt, "warm")
            await lone(reps, "disaggregated", prompt_of(rng, args.prompt_len), "warm")
        for r in range(args.rounds):
            modes = ["aggregated", "disaggregated"][:: 1 if r % 2 == 0 else -1]
            prompt = prompt_of(rng, args.prompt_len)
            got = {mode: await lone(reps, mode, prompt, str(r)) for mode in modes}
            assert got["aggregated"]["tokens"] == got["disaggregated"]["tokens"], "disaggregated tokens differ"
            for mode in modes:
                rows["lone"][mode].append({k: v for k, v in got[mode].items() if k != "tokens"})
            for mode in modes:
                rows["interference"][mode].append(await interference(reps, mode, rng, args.prompt_len, str(r)))
    finally:
        for replica in reps.values():
            replica.shutdown()
    return rows


def median(rows: list[dict], key: str) -> float:
    return statistics.median(row[key] for row in rows)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    rows = asyncio.run(main(args))
    lone_rows, inter = rows["lone"], rows["interference"]
    print(f"{args.rounds} rounds, prompt {args.prompt_len} tokens, medians")
    print("| mode | lone TTFT | pulled tokens | P prefill + pull | decode max gap | decode ITL | newcomer TTFT |")
    print("|---|---|---|---|---|---|---|")
    for mode in ("aggregated", "disaggregated"):
        split = (f"{median(lone_rows[mode], 'prefill_s'):.3f} + {median(lone_rows[mode], 'pull_s'):.3f} s"
                 if mode == "disaggregated" else "")
        print(f"| {mode} | {median(lone_rows[mode], 'ttft_s'):.3f} s | {median(lone_rows[mode], 'cached'):.0f} | "
              f"{split} | {median(inter[mode], 'long_max_gap_s'):.3f} s | {median(inter[mode], 'long_itl_s'):.3f} s | "
              f"{median(inter[mode], 'new_ttft_s'):.3f} s |")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
