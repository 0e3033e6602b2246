"""KV transfers in ``prefixserve bench routing`` (issue 33): each policy run
without and with fetch pricing on the same workload, a skewed one on demand,
and the replicas' transfer figures in the table.

``--transfers off,on`` runs every policy once per setting, in that order, on
a fresh cluster each time (``on``: ``routing_policy_params`` gains
``fetch_bytes_per_s`` = ``--fetch-bytes-per-s``, so ``prefix_cost`` prices a
fetch from the holder and the chosen replica makes it; docs/KV_TRANSFER.md).
The run is labelled ``<policy>+fetch``. ``--tenant-zipf S`` draws each
request's tenant from a Zipf law of exponent S over the tenants (0: every
tenant gets ``--questions-per-tenant`` requests), so a few hot system prompts
take most requests and their holders most of the load. ``--warm-tenants``
sends each tenant's system prompt once, one at a time, before the timed
requests (routed by the policy, not measured): every tenant then has a holder
when the load starts, and no timed request pays its tenant's first prefill,
which is the same with and without fetches and, on a fresh cluster per round,
would otherwise be a few percent of the requests and set the P99.

The replicas' ``kv_transfer_*`` series are read from the directory (each
replica publishes its metrics text with its heartbeats) after the run:
fetches that imported, blocks and bytes in, prefix tokens served by
transfer, fallbacks by reason, exports refused, the mean fetch time.
"""

from __future__ import annotations

import argparse
import asyncio
import random
from typing import Any

from cluster.bench.datasets import Conversation, Turn, _token_sampler
from cluster.shared.metrics_format import METRIC_PREFIX

DEFAULT_FETCH_BYTES_PER_S = 1.5e9  # measured on loopback (docs/KV_TRANSFER.md)
METRICS_SETTLE_S = 3.0  # the replicas' heartbeats carry their metrics about every second
METRICS_WAIT_S = 20.0  # at most this long for the figures to settle


def add_transfer_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--transfers", default="off",
                        help="comma-separated off,on: each policy without and/or with KV fetches priced "
                             "(fetch_bytes_per_s), on a fresh cluster each, in this order; repeat them "
                             "(off,on,off,on) to alternate rounds, also reported pooled")
    parser.add_argument("--fetch-bytes-per-s", type=float, default=DEFAULT_FETCH_BYTES_PER_S,
                        help="the fetch bandwidth prefix_cost prices with transfers on (default 1.5e9)")
    parser.add_argument("--tenant-zipf", type=float, default=0.0,
                        help="draw each request's tenant from Zipf(S) over the tenants (0: uniform counts)")
    parser.add_argument("--warm-tenants", action="store_true",
                        help="before the timed requests, send each tenant's system prompt once, one at a "
                             "time (routed by the policy, not counted): the hot prompts have holders when "
                             "the skewed load starts, and no timed request pays a tenant's first prefill")


def transfer_settings(args: argparse.Namespace) -> list[bool]:
    """``--transfers`` as a list of booleans, in run order."""
    out = []
    for word in (w.strip() for w in str(getattr(args, "transfers", "off")).split(",")):
        if word not in ("off", "on"):
            raise ValueError(f"--transfers takes off, on or off,on; got {word!r}")
        out.append(word == "on")
    return out


def with_fetches(args: argparse.Namespace, on: bool = True) -> argparse.Namespace:
    """``args`` whose routing parameters price fetches at ``--fetch-bytes-per-s``
    (``on``) or not at all (a deployment's default may price them)."""
    params = list(getattr(args, "routing_param", None) or ())
    params.append(f"fetch_bytes_per_s={args.fetch_bytes_per_s if on else 0}")
    return argparse.Namespace(**{**vars(args), "routing_param": params})


def skewed_dataset(num_tenants: int, num_requests: int, system_prompt_len: int, question_len: int,
                   output_len: int, vocab_size: int, seed: int, zipf: float) -> list[Conversation]:
    """``num_requests`` single-turn requests whose tenant is drawn from Zipf(``zipf``)."""
    if zipf <= 0:
        raise ValueError(f"--tenant-zipf must be > 0 for a skewed workload, got {zipf}")
    rng = random.Random(seed)
    tokens = _token_sampler(rng, vocab_size)
    system_prompts = [tokens(system_prompt_len) for _ in range(num_tenants)]
    weights = [1.0 / (rank + 1) ** zipf for rank in range(num_tenants)]
    groups = rng.choices(range(num_tenants), weights=weights, k=num_requests)
    return [Conversation((Turn(system_prompts[g] + tokens(question_len), output_len),), group=g,
                         shared_prefix_len=system_prompt_len) for g in groups]


def read_transfer_figures(redis_url: str, namespace: str) -> dict[str, Any]:
    """The replicas' ``kv_transfer_*`` series summed over them (module doc), once two
    reads a heartbeat or more apart agree (a loaded machine delays the heartbeats)."""
    from cluster.bench.ttft_split import settled, texts
    from cluster.shared.directory import Directory

    async def figures(directories: Any) -> dict[str, Any]:
        return transfer_figures(await texts(directories))

    async def read() -> dict[str, Any]:
        directory = Directory.from_url(redis_url, namespace)
        try:
            return await settled([directory], METRICS_SETTLE_S, METRICS_WAIT_S, read=figures)
        finally:
            await directory.aclose()

    return asyncio.run(read())


def transfer_figures(texts: list[str]) -> dict[str, Any]:
    """Sums the ``kv_transfer_*`` samples of the replicas' exposition texts."""
    sums: dict[str, float] = {}
    fallbacks: dict[str, float] = {}
    for text in texts:
        for line in text.splitlines():
            if not line.startswith(METRIC_PREFIX + "kv_transfer_"):
                continue
            name_labels, _, value = line.rpartition(" ")
            name, _, labels = name_labels.partition("{")
            name = name[len(METRIC_PREFIX):]
            key = name + ("/" + _label(labels, "direction") if "direction=" in labels else "")
            if name == "kv_transfer_fallbacks_total":
                reason = _label(labels, "reason")
                fallbacks[reason] = fallbacks.get(reason, 0.0) + float(value)
            sums[key] = sums.get(key, 0.0) + float(value)
    fetches = sums.get("kv_transfer_seconds_count", 0.0)
    return {
        "fetches": int(fetches),
        "blocks_in": int(sums.get("kv_transfer_blocks_total/in", 0.0)),
        "mb_in": round(sums.get("kv_transfer_bytes_total/in", 0.0) / 1e6, 1),
        "prefix_tokens_fetched": int(sums.get("kv_transfer_prefix_tokens_total", 0.0)),
        "fetch_ms_mean": round(1000 * sums.get("kv_transfer_seconds_sum", 0.0) / fetches, 1) if fetches else 0.0,
        "fallbacks": {reason: int(n) for reason, n in sorted(fallbacks.items()) if n},
        "exports_refused": int(sums.get("kv_transfer_refused_total", 0.0)),
    }


def _label(labels: str, name: str) -> str:
    for part in labels.rstrip("}").split(","):
        key, _, value = part.partition("=")
        if key.strip() == name:
            return value.strip().strip('"')
    return ""


def round_label(label: str, taken: list[str]) -> str:
    """``label``, or ``label #n`` for its n-th round (``--transfers off,on,off,on``)."""
    n = 1 + sum(1 for t in taken if t == label or t.startswith(label + " #"))
    return label if n == 1 else f"{label} #{n}"


def pooled_rounds(runs: list[tuple[str, dict[str, Any], list]]) -> list[dict[str, Any]]:
    """For each label run in several rounds, ``(label, summary, records)`` of every round
    pooled: the policy ``<label> pooled`` with the TTFT distribution (ms) and the hit rate of
    all its rounds' requests together."""
    from cluster.bench.metrics import distribution

    rounds: dict[str, list] = {}
    for label, _, records in runs:
        rounds.setdefault(label.split(" #")[0], []).append(records)
    out = []
    for label, lists in rounds.items():
        if len(lists) < 2:
            continue
        done = [r for records in lists for r in records if r.ok]
        prompt = sum(r.prompt_tokens for r in done)
        out.append({"policy": f"{label} pooled", "rounds": len(lists), "completed": len(done),
                    "prefix_hit_rate": round(sum(r.cached_prompt_tokens for r in done) / prompt, 4) if prompt else 0.0,
                    "ttft_ms": {k: round(v * 1000.0, 3) for k, v in distribution(
                        [r.ttft for r in done if r.ttft is not None]).items()}})
    return out


def transfer_ratios(runs: list[dict[str, Any]]) -> dict[str, float]:
    """For each policy run both ways (per round, and pooled over rounds): TTFT P50 and
    P99 without fetches over with."""
    by = {r["policy"]: r for r in runs}
    out: dict[str, float] = {}
    for label, run in by.items():
        policy, _, suffix = label.partition("+fetch")
        if label.partition(" ")[0].endswith("+fetch") and policy + suffix in by:
            base = by[policy + suffix]
            name = policy + suffix.replace(" #", "_round").replace(" ", "_")
            for q in ("p50", "p99"):
                out[f"ttft_{q}_{name}_without_over_with_fetch"] = round(
                    base["ttft_ms"][q] / max(run["ttft_ms"][q], 1e-9), 2)
    return out


WARM_SETTLE_S = 2.0  # the holders' KV events reach the directory and the router's index


async def warm_tenants(client, conversations: list[Conversation]) -> int:
    """Sends each tenant's system prompt once, one after the other, in the order its tenant
    first appears (``--warm-tenants``); returns how many. Nothing is measured."""
    prompts: dict[int, list[int]] = {}
    for conversation in conversations:
        if conversation.group >= 0 and conversation.shared_prefix_len and conversation.group not in prompts:
            prompts[conversation.group] = list(conversation.turns[0].new_token_ids[:conversation.shared_prefix_len])
    for prompt in prompts.values():
        async for _ in client.stream(prompt, 1):
            pass
    await asyncio.sleep(WARM_SETTLE_S)
    return len(prompts)
