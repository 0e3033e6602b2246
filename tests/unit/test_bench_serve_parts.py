"""Unit tests of ``prefixserve bench serve``'s parts: the figures' math, the
runner (with a fake transport) and the status table's parsing (the datasets:
``test_bench_datasets.py``)."""

from __future__ import annotations

import asyncio
import itertools
import random
import statistics

import pytest

from cluster.bench import datasets as ds
from cluster.bench.clients import Delta, Usage
from cluster.bench.metrics import (
    RequestRecord,
    distribution,
    format_summary,
    meets_slos,
    parse_goodput,
    series_bin_seconds,
    summarize,
    tokens_per_second_series,
)
from cluster.bench.serve import run_requests
from cluster.client.status import ReplicaRow, format_status, merge_metrics, parse_metrics, token_rates

VOCAB = 1000


# ------------------------------------------------------------------ figures


def test_goodput_parsing_and_slo_checks():
    assert parse_goodput(["ttft:500", "tpot:50", "e2el:2000"]) == {"ttft": 0.5, "tpot": 0.05, "e2el": 2.0}
    for bad in ("ttft", "itl:5", "ttft:-1", "ttft:fast"):
        with pytest.raises(ValueError, match="--goodput takes NAME:MS"):
            parse_goodput([bad])
    rec = RequestRecord(0, 0, 10, 5, ttft=0.4, latency=0.8, completion_tokens=5)  # tpot = 0.1
    assert meets_slos(rec, {"ttft": 0.5}) and not meets_slos(rec, {"ttft": 0.3})
    assert meets_slos(rec, {"tpot": 0.1}) and not meets_slos(rec, {"tpot": 0.099})
    one = RequestRecord(0, 0, 10, 1, ttft=0.2, latency=0.2, completion_tokens=1)
    assert meets_slos(one, {"tpot": 0.001})  # no TPOT for a single token: not judged


def test_distribution_is_the_nearest_rank_percentile():
    values = [float(v) for v in range(1, 101)]  # 1..100
    d = distribution(values[::-1])
    assert d["mean"] == 50.5
    assert d["p50"] == 51.0 and d["p95"] == 95.0 and d["p99"] == 99.0  # index round(p/100 * 99)
    assert distribution([]) == {"mean": 0.0, "p50": 0.0, "p95": 0.0, "p99": 0.0}


def _record(i, ttft, latency, prompt, cached, out, shared=0, itl=(), error=""):
    return RequestRecord(i, 0, prompt, out, shared_prefix_len=shared, ttft=ttft, latency=latency, itl=list(itl),
                         token_times=[(latency, out)], prompt_tokens=prompt, completion_tokens=out,
                         cached_prompt_tokens=cached, replica_id=f"r{i % 2}", error=error)


def test_summarize_counts_tokens_hit_rates_and_goodput():
    records = [
        _record(0, 0.1, 0.5, prompt=100, cached=0, out=5, shared=64, itl=[0.1] * 4),
        _record(1, 0.2, 1.0, prompt=100, cached=64, out=5, shared=64, itl=[0.2] * 4),
        _record(2, 0.3, 2.0, prompt=100, cached=80, out=9, shared=64, itl=[0.2125] * 8),
        _record(3, 9.9, 9.9, prompt=0, cached=0, out=0, error="UNAVAILABLE: no replica"),
    ]
    s = summarize(records, duration=4.0, slos={"ttft": 0.25})
    assert (s["num_requests"], s["completed"], s["failed"]) == (4, 3, 1)
    assert s["total_input_tokens"] == 300 and s["total_output_tokens"] == 19
    assert s["request_throughput"] == 0.75 and s["output_throughput"] == 4.75 and s["input_throughput"] == 75.0
    assert s["prefix_hit_rate"] == round(144 / 300, 4)
    assert s["shared_prefix_hit_rate"] == round((0 + 64 + 64) / 192, 4)  # capped at the system prompt
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0) and s["ttft_ms"]["p99"] == pytest.approx(300.0)
    assert s["tpot_ms"]["p50"] == pytest.approx(200.0)  # (1.0 - 0.2) / 4
    assert s["e2el_ms"]["p99"] == pytest.approx(2000.0)
    assert s["itl_ms"]["mean"] == pytest.approx(1000 * statistics.fmean([0.1] * 4 + [0.2] * 4 + [0.2125] * 8))
    assert s["goodput"]["good_requests"] == 2 and s["goodput"]["request_goodput"] == 0.5
    assert s["requests_per_replica"] == {"r0": 2, "r1": 1}
    assert s["errors"] == ["UNAVAILABLE: no replica"]


def _structured(i, finish, valid=None, text="", error=""):
    rec = _record(i, 0.1, 0.5, prompt=30, cached=0, out=6, error=error)
    rec.structured, rec.finish_reason, rec.structured_valid, rec.output_text = True, finish, valid, text
    return rec


def test_summarize_counts_valid_structured_outputs_of_stop_finishes_only():
    records = [
        _structured(0, "stop", True, "Positive"),
        _structured(1, "stop", True, "Negative"),
        _structured(2, "stop", False, "Posit" + "x" * 300),
        _structured(3, "length", None, "Posi"),  # truncated: counted apart, not judged
        _structured(4, "", None, error="UNAVAILABLE: no replica"),  # failed: neither
        _record(5, 0.1, 0.5, prompt=30, cached=0, out=6),  # unconstrained (--structured-output-ratio < 1)
    ]
    s = summarize(records, duration=1.0)
    assert (s["structured_requests"], s["structured_stop"], s["structured_length"]) == (5, 3, 1)
    assert s["structured_valid"] == 2 and s["structured_valid_share"] == round(2 / 3, 4)
    assert s["structured_invalid_examples"] == ["Posit" + "x" * 195]  # cut to 200 characters
    text = "\n".join(format_summary("t", s))
    assert "Constrained requests:" in text and "2 / 3 (66.7%)" in text
    none_stopped = summarize([_structured(0, "length", None, "{")], duration=1.0)
    assert none_stopped["structured_valid_share"] is None and none_stopped["structured_length"] == 1
    assert "0 / 0 (-)" in "\n".join(format_summary("t", none_stopped))
    plain = summarize([_record(0, 0.1, 0.5, prompt=30, cached=0, out=6)], duration=1.0)
    assert "structured_requests" not in plain and "Constrained" not in "\n".join(format_summary("t", plain))
    ratio_zero = summarize([_record(0, 0.1, 0.5, prompt=30, cached=0, out=6)], duration=1.0, structured=True)
    assert (ratio_zero["structured_requests"], ratio_zero["structured_valid_share"]) == (0, None)


def test_tokens_per_second_series_bins_tokens_by_arrival():
    recs = [RequestRecord(0, 0, 1, 1, token_times=[(0.1, 1), (0.9, 2), (1.5, 4)]),
            RequestRecord(1, 0, 1, 1, token_times=[(2.2, 1)])]
    assert tokens_per_second_series(recs, 1.0) == ([0.0, 1.0, 2.0], [3.0, 4.0, 1.0])
    assert tokens_per_second_series(recs, 0.5) == ([0.0, 0.5, 1.0, 1.5, 2.0], [2.0, 4.0, 0.0, 8.0, 2.0])
    assert series_bin_seconds(3.0) == 0.1 and series_bin_seconds(100.0) == 2.0


# ------------------------------------------------------------------ runner


class FakeClient:
    """Answers every request at once with ``max_tokens`` tokens, one per chunk,
    and caches nothing; remembers the prompts it was sent."""

    name = "fake"

    def __init__(self, fail_prompt_len: int = -1) -> None:
        self.prompts: list[list[int]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.fail_prompt_len = fail_prompt_len

    async def stream(self, prompt, max_tokens):
        self.prompts.append(list(prompt))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(0.001)
            if len(prompt) == self.fail_prompt_len:
                raise RuntimeError("boom")
            for i in range(max_tokens):
                await asyncio.sleep(0)
                yield Delta(1, [10_000 + len(prompt) + i], replica_id="fake-0")
            yield Delta(0, usage=Usage(len(prompt), max_tokens, 0), replica_id="fake-0")
        finally:
            self.in_flight -= 1

    def answer_ids(self, deltas):
        return [t for d in deltas for t in d.token_ids]

    async def aclose(self):
        pass


class FakeChatClient:
    """Answers a question in two text chunks: ``Positive`` (stop) when
    constrained, else ``maybe`` cut at ``length``; remembers what it was asked."""

    name = "fake-chat"

    def __init__(self) -> None:
        self.asked: list[tuple[str, object]] = []

    async def stream(self, prompt, max_tokens, *, question="", structured_outputs=None):
        assert prompt == [] and question
        self.asked.append((question, structured_outputs))
        text, finish = ("Positive", "stop") if structured_outputs else ("maybe", "length")
        await asyncio.sleep(0)
        yield Delta(1, text=text[:3])
        yield Delta(1, text=text[3:], finish_reason=finish)
        yield Delta(0, usage=Usage(17, 2, 0))

    async def aclose(self):
        pass


def test_runner_extends_each_turn_with_the_previous_prompt_and_answer():
    convs = ds.multi_turn_dataset(9, 3, 20, 5, 4, VOCAB, seed=3)
    client = FakeClient()
    records, duration = asyncio.run(run_requests(client, convs, max_concurrency=2, progress=False))
    assert len(records) == 9 and all(r.ok for r in records) and duration > 0
    by_conv: dict[int, list[list[int]]] = {}
    for prompt in client.prompts:  # a conversation's turns are sent in order
        first = next(i for i, c in enumerate(convs) if list(c.turns[0].new_token_ids) == prompt[:20])
        by_conv.setdefault(first, []).append(prompt)
    assert sorted(by_conv) == [0, 1, 2]
    for i, prompts in by_conv.items():
        assert len(prompts) == 3
        for turn in (1, 2):
            prev, cur = prompts[turn - 1], prompts[turn]
            answer = [10_000 + len(prev) + k for k in range(4)]
            assert cur == prev + answer + list(convs[i].turns[turn].new_token_ids)
    assert client.max_in_flight <= 2
    for r in records:
        assert r.prompt_tokens == r.prompt_len and r.completion_tokens == 4 and len(r.itl) == 3
        assert r.ttft is not None and r.latency >= r.ttft


def test_runner_respects_max_concurrency_and_a_failed_turn_ends_its_conversation():
    convs = ds.multi_turn_dataset(6, 3, 20, 5, 4, VOCAB, seed=4)
    client = FakeClient(fail_prompt_len=20 + 4 + 5)  # every second turn fails
    records, _ = asyncio.run(run_requests(client, convs, max_concurrency=1, progress=False))
    assert client.max_in_flight == 1
    assert len(records) == 4  # two conversations: turn 1 ok, turn 2 failed, turn 3 never sent
    assert sorted(r.turn for r in records if r.ok) == [0, 0]
    assert [r.error for r in records if not r.ok] == ["RuntimeError: boom"] * 2


def test_runner_sends_questions_as_chat_and_judges_only_constrained_answers():
    convs = ds.structured_output_dataset("choice", 10, 0.4, 8, seed=6)
    client = FakeChatClient()
    records, _ = asyncio.run(run_requests(client, convs, progress=False))
    constrained = ds.constrained_indices(10, 0.4, seed=6)
    assert sorted(r.conversation for r in records if r.structured) == sorted(constrained)
    assert sum(so is not None for _, so in client.asked) == 4
    for r in records:
        assert r.ok and r.prompt_len == 17  # the server's count of the rendered chat prompt
        if r.structured:
            assert (r.finish_reason, r.structured_valid, r.output_text) == ("stop", True, "Positive")
        else:
            assert (r.finish_reason, r.structured_valid, r.output_text) == ("length", None, "")  # text not kept
    s = summarize(records, duration=1.0)
    assert (s["structured_requests"], s["structured_valid"], s["structured_valid_share"]) == (4, 4, 1.0)


def test_runner_sends_at_the_poisson_rate():
    convs = ds.random_dataset(20, 8, 1, 0.0, VOCAB, seed=5)
    records, duration = asyncio.run(run_requests(FakeClient(), convs, request_rate=200.0, progress=False))
    sent = sorted(r.sent_at for r in records)
    gaps = random.Random(0 + 1)  # run_requests draws the gaps from seed + 1
    due = list(itertools.accumulate(gaps.expovariate(200.0) for _ in range(20)))
    assert len(sent) == 20
    assert all(s >= d - 0.005 for s, d in zip(sent, due))  # never before its Poisson arrival time
    with pytest.raises(ValueError, match="--request-rate must be > 0"):
        asyncio.run(run_requests(FakeClient(), convs, request_rate=0.0, progress=False))


# ------------------------------------------------------------------ status

EXPOSITION = """\
# TYPE prefixserve:num_requests_swapped gauge
prefixserve:num_requests_swapped{model="m",replica="a"} 2.0
prefixserve:num_requests_swapped{model="m",replica="b"} 0.0
# TYPE prefixserve:prefix_cache_queries counter
prefixserve:prefix_cache_queries_total{model="m",replica="a"} 400.0
prefixserve:prefix_cache_queries_total{model="m",replica="b"} 0.0
# TYPE prefixserve:prefix_cache_hits counter
prefixserve:prefix_cache_hits_total{model="m",replica="a"} 100.0
# TYPE prefixserve:generation_tokens counter
prefixserve:generation_tokens_total{model="m",replica="a"} 50.0
# TYPE prefixserve:router_requests counter
prefixserve:router_requests_total{outcome="ok",policy="cache_aware"} 7.0
# TYPE prefixserve:model_info gauge
prefixserve:model_info{kv_cache_dtype="auto",model="m",quantization="gguf:q4_1+q8_0",replica="a"} 1.0
# TYPE prefixserve:model_weight_bytes gauge
prefixserve:model_weight_bytes{model="m",replica="a"} 1.2582912e+08
# TYPE prefixserve:spec_decode_num_draft_tokens counter
prefixserve:spec_decode_num_draft_tokens_total{model="m",replica="a"} 80.0
# TYPE prefixserve:spec_decode_num_accepted_tokens counter
prefixserve:spec_decode_num_accepted_tokens_total{model="m",replica="a"} 60.0
"""


def test_status_reads_metrics_per_replica_and_rates_between_scrapes():
    metrics = parse_metrics(EXPOSITION)
    assert metrics == {"a": {"swapped": 2.0, "queries": 400.0, "hits": 100.0, "generation_tokens": 50.0,
                             "quantization": "gguf:q4_1+q8_0", "weight_bytes": 125829120.0,
                             "spec_draft_tokens": 80.0, "spec_accepted_tokens": 60.0},
                       "b": {"swapped": 0.0, "queries": 0.0}}
    rows = {"a": ReplicaRow("a", kv_use=0.5, running=3, waiting=1, cached_blocks=12)}
    merge_metrics(rows, metrics)
    assert rows["a"].swapped == 2.0 and rows["b"].kv_use is None  # only in /metrics: a row of its own
    later = {"a": {**metrics["a"], "generation_tokens": 80.0, "prompt_tokens": 20.0}}
    assert token_rates(None, (1.0, metrics)) == {}
    assert token_rates((1.0, metrics), (3.0, later)) == {"a": (10.0, 15.0)}
    text = "\n".join(format_status(rows, {"a": (10.0, 15.0)}, show_metrics=True))
    assert "50.0%" in text and "25.0%" in text and "15.0" in text  # KV use, hit rate, gen tok/s
    assert "gguf:q4_1+q8_0" in text and "120 MiB" in text  # quantization, weights
    assert text.splitlines()[0].split()[-2:] == ["spec", "accept"] and "75.0%" in text  # 60 of 80 accepted
    assert text.splitlines()[-1].startswith("2 replica(s), 3 running, 1 waiting")
    assert format_status({}, {}, show_metrics=False) == ["no live replicas"]


def test_the_cluster_against_the_engine_alone():
    from cluster.bench.metrics import format_summary as fmt
    from cluster.bench.serve_baseline import against_baseline

    summary = {"itl_ms": {"p50": 22.0}, "ttft_ms": {"p50": 440.0}, "output_throughput": 90.0}
    runs = [{"step_ms": 19.0, "prefill_ms": 380.0, "output_throughput": 110.0, "max_num_seqs": 4},
            {"step_ms": 21.0, "prefill_ms": 420.0, "output_throughput": 90.0, "max_num_seqs": 4}]
    base = against_baseline(summary, runs)  # the mean of the runs before and after
    assert base["step_ms"] == 20.0 and base["prefill_ms"] == 400.0 and base["output_throughput"] == 100.0
    assert base["itl_p50_over_step"] == pytest.approx(1.1)
    assert base["ttft_p50_over_prefill_and_step"] == pytest.approx(440.0 / 420.0)
    assert base["output_throughput_over_engine"] == pytest.approx(0.9)
    assert base["runs"] == runs
    rows = "\n".join(fmt("t", {**_summary_for_table(), "engine_baseline": base}))
    assert "ITL p50 / engine step:" in rows and "1.10x" in rows and "(max_num_seqs 4)" in rows


def test_rounds_alternate_with_the_engine_and_report_the_median_round():
    from cluster.bench.metrics import format_summary as fmt
    from cluster.bench.serve_baseline import against_rounds

    def run(itl: float, ttft: float, tput: float) -> dict:
        return {"itl_ms": {"p50": itl}, "ttft_ms": {"p50": ttft}, "output_throughput": tput}

    def engine(step: float, prefill: float, tput: float) -> dict:
        return {"step_ms": step, "prefill_ms": prefill, "output_throughput": tput, "max_num_seqs": 1}

    # The machine slows down and speeds up again: each round is set against the engine runs around it.
    engines = [engine(10.0, 190.0, 100.0), engine(20.0, 380.0, 50.0), engine(20.0, 380.0, 50.0),
               engine(10.0, 190.0, 100.0)]
    rounds = [run(16.5, 330.0, 67.5), run(22.0, 400.0, 45.0), run(15.0, 300.0, 72.0)]
    base = against_rounds(rounds, engines)
    assert [r["itl_p50_over_step"] for r in base["rounds"]] == pytest.approx([1.1, 1.1, 1.0])
    assert base["itl_p50_over_step"] == pytest.approx(1.1) and base["itl_p50_over_step_range"] == pytest.approx(
        [1.0, 1.1])
    assert [r["ttft_p50_over_prefill_and_step"] for r in base["rounds"]] == pytest.approx(
        [330 / 300, 1.0, 300 / 300])
    assert [r["output_throughput_over_engine"] for r in base["rounds"]] == pytest.approx([0.9, 0.9, 0.96])
    assert base["step_ms"] == 15.0 and len(base["runs"]) == 4  # the engine's figures: every run's mean
    rows = "\n".join(fmt("t", {**_summary_for_table(), "engine_baseline": base}))
    assert "1.10x [1.00-1.10] (3 rounds)" in rows
    with pytest.raises(ValueError, match="3 rounds need 4 runs of the engine alone"):
        against_rounds(rounds, engines[:3])


def test_rounds_need_a_local_cluster_and_the_baseline():
    import argparse

    from cluster.bench.serve import _check_rounds

    args = argparse.Namespace(engine_baseline=True)
    _check_rounds(args, 3, None)
    with pytest.raises(ValueError, match="--rounds must be >= 1"):
        _check_rounds(args, 0, None)
    with pytest.raises(ValueError, match="drop --url"):
        _check_rounds(args, 2, "127.0.0.1:50051")
    with pytest.raises(ValueError, match="add --engine-baseline"):
        _check_rounds(argparse.Namespace(engine_baseline=False), 2, None)


def test_ttft_splits_of_rounds_merge_by_requests():
    from cluster.bench.ttft_split import merge

    merged = merge([{"requests": 1, "replica_ttft_mean_ms": 100.0, "path_mean_ms": 10.0},
                    {"requests": 3, "replica_ttft_mean_ms": 200.0, "path_mean_ms": 6.0}])
    assert merged == {"requests": 4, "replica_ttft_mean_ms": 175.0, "path_mean_ms": 7.0}


def _summary_for_table() -> dict:
    latency = {"mean": 1.0, "p50": 1.0, "p95": 1.0, "p99": 1.0}
    return {"completed": 1, "failed": 0, "duration_s": 1.0, "total_input_tokens": 1, "total_output_tokens": 1,
            "request_throughput": 1.0, "input_throughput": 1.0, "output_throughput": 1.0, "prefix_hit_rate": 0.0,
            "requests_per_replica": {}, "ttft_ms": latency, "tpot_ms": latency, "itl_ms": latency,
            "e2el_ms": latency}
