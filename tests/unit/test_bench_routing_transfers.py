"""``bench routing``'s transfer pieces (cluster/bench/routing_transfers.py):
the skewed workload, the off/on settings, the replicas' transfer series
summed from their metrics text, and the TTFT ratios."""

from __future__ import annotations

import argparse
from collections import Counter

import pytest

from cluster.bench.metrics import RequestRecord
from cluster.bench.routing_transfers import (pooled_rounds, round_label, skewed_dataset, transfer_figures,
                                             transfer_ratios, transfer_settings, with_fetches)
from workers.kv_transfer_metrics import TransferMetrics


def test_a_skewed_workload_gives_the_first_tenants_most_requests():
    conversations = skewed_dataset(6, 600, 32, 4, 2, 1000, seed=1, zipf=1.2)
    counts = Counter(c.group for c in conversations)
    assert len(conversations) == 600 and counts[0] > counts[1] > counts[5] > 0
    assert counts[0] + counts[1] > 300  # Zipf 1.2 over 6: the two hottest take ~60%
    prompts = {c.group: c.turns[0].new_token_ids[:32] for c in conversations}
    assert all(c.turns[0].new_token_ids[:32] == prompts[c.group] and c.shared_prefix_len == 32
               for c in conversations)
    with pytest.raises(ValueError, match="tenant-zipf"):
        skewed_dataset(6, 10, 32, 4, 2, 1000, seed=1, zipf=0.0)


def test_settings_and_the_fetch_parameter():
    assert transfer_settings(argparse.Namespace(transfers="off,on")) == [False, True]
    with pytest.raises(ValueError, match="--transfers"):
        transfer_settings(argparse.Namespace(transfers="yes"))
    args = argparse.Namespace(routing_param=["pack_max_seqs=8"], fetch_bytes_per_s=1.5e9)
    assert with_fetches(args).routing_param == ["pack_max_seqs=8", "fetch_bytes_per_s=1500000000.0"]
    assert args.routing_param == ["pack_max_seqs=8"]  # the caller's args untouched


def test_the_replicas_series_are_summed():
    texts = []
    for replica, (blocks, seconds) in {"a": (6, [0.02, 0.04]), "b": (10, [0.03])}.items():
        metrics = TransferMetrics(labels={"replica": replica, "model": "m"})
        metrics.moved("in", blocks, blocks * 1_000_000)
        metrics.prefix_tokens.inc(blocks * 16)
        for s in seconds:
            metrics.seconds.observe(s)
        metrics.fallback("not_held")
        texts.append(_render(metrics))
    got = transfer_figures(texts)
    assert got["fetches"] == 3 and got["blocks_in"] == 16 and got["mb_in"] == 16.0
    assert got["prefix_tokens_fetched"] == 256 and got["fetch_ms_mean"] == 30.0
    assert got["fallbacks"] == {"not_held": 2} and got["exports_refused"] == 0


def _render(metrics: TransferMetrics) -> str:
    from prometheus_client import generate_latest

    return generate_latest(metrics.registry).decode()


def test_ttft_ratios_pair_each_policy_with_its_fetch_run():
    runs = [{"policy": "prefix_cost", "ttft_ms": {"p50": 300.0, "p99": 3000.0}},
            {"policy": "prefix_cost+fetch", "ttft_ms": {"p50": 200.0, "p99": 1000.0}},
            {"policy": "round_robin", "ttft_ms": {"p50": 1.0, "p99": 1.0}}]
    assert transfer_ratios(runs) == {"ttft_p50_prefix_cost_without_over_with_fetch": 1.5,
                                     "ttft_p99_prefix_cost_without_over_with_fetch": 3.0}


def test_rounds_are_labelled_paired_and_pooled():
    # --transfers off,on,off,on: the second round of each setting is "#2".
    taken: list[str] = []
    for label in ("prefix_cost", "prefix_cost+fetch", "prefix_cost", "prefix_cost+fetch"):
        taken.append(round_label(label, taken))
    assert taken == ["prefix_cost", "prefix_cost+fetch", "prefix_cost #2", "prefix_cost+fetch #2"]

    def records(*ttfts, cached=0):
        return [RequestRecord(0, 0, 10, 1, ttft=t, prompt_tokens=10, cached_prompt_tokens=cached) for t in ttfts]

    runs = [("prefix_cost", {}, records(1.0, 3.0)), ("prefix_cost+fetch", {}, records(1.0, 1.0, cached=10)),
            ("prefix_cost #2", {}, records(2.0, 4.0)), ("prefix_cost+fetch #2", {}, records(2.0, 2.0, cached=5)),
            ("round_robin", {}, records(9.0))]
    pooled = pooled_rounds(runs)
    assert [(p["policy"], p["rounds"], p["completed"], p["prefix_hit_rate"]) for p in pooled] == [
        ("prefix_cost pooled", 2, 4, 0.0), ("prefix_cost+fetch pooled", 2, 4, 0.75)]
    assert pooled[0]["ttft_ms"]["mean"] == pytest.approx(2500.0)  # of 1, 2, 3 and 4 s
    summaries = [{"policy": label, "ttft_ms": {"p50": 1000.0 * r[0].ttft, "p99": 1000.0 * r[-1].ttft}}
                 for label, _, r in runs]
    ratios = transfer_ratios(summaries + pooled)
    assert ratios["ttft_p99_prefix_cost_without_over_with_fetch"] == 3.0
    assert ratios["ttft_p99_prefix_cost_round2_without_over_with_fetch"] == 2.0
    assert ratios["ttft_p99_prefix_cost_pooled_without_over_with_fetch"] == pytest.approx(
        pooled[0]["ttft_ms"]["p99"] / pooled[1]["ttft_ms"]["p99"], abs=0.01)
    assert not any("round_robin" in key for key in ratios)


def test_warm_tenants_sends_each_system_prompt_once_in_first_seen_order(monkeypatch):
    import asyncio

    import cluster.bench.routing_transfers as rt

    monkeypatch.setattr(rt, "WARM_SETTLE_S", 0.0)
    sent = []

    class Client:
        async def stream(self, prompt_token_ids, max_tokens):
            sent.append((list(prompt_token_ids), max_tokens))
            yield None

    conversations = skewed_dataset(3, 40, 32, 4, 2, 1000, seed=2, zipf=1.5)
    order = list(dict.fromkeys(c.group for c in conversations))
    assert asyncio.run(rt.warm_tenants(Client(), conversations)) == 3
    prompts = {c.group: list(c.turns[0].new_token_ids[:32]) for c in conversations}
    # The system prompt alone (no question: every timed request still has its own), once per tenant.
    assert sent == [(prompts[g], 1) for g in order]


def test_the_oracle_of_warmed_tenants_hits_every_request():
    from cluster.bench.routing import oracle_hit_rates

    conversations = skewed_dataset(3, 10, 32, 8, 2, 1000, seed=3, zipf=1.5)  # 40-token prompts
    assert oracle_hit_rates(conversations, 16, warm=True) == {"prefix_hit_rate": 0.8, "shared_prefix_hit_rate": 1.0}
    cold = oracle_hit_rates(conversations, 16)
    tenants = len({c.group for c in conversations})
    assert cold["shared_prefix_hit_rate"] == pytest.approx((10 - tenants) / 10)
