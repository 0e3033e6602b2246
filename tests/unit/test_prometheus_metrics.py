"""Prometheus metrics: the replica's series (``workers/metrics.py``), the
engine's queue time, the router's series and outcome counting, and the
cluster-wide exposition that merges replicas' texts (``router/metrics.py``).
Fakes only for the clock, the directory and streams."""

from __future__ import annotations

import asyncio
from typing import Optional

import httpx2 as httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.shared.directory import DirectoryUnavailable
from cluster.shared.metrics_format import sample_names
from cluster.shared.types import FinishReason, GenerationRequest, ReplicaStats, SamplingParams, StreamChunk
from router.errors import NoReplicaError, OverloadedError
from router.metrics import ClusterMetrics, RouterMetrics, merge_expositions, metered
from router.openai import build_openai_app
from tests.unit.engine_fakes import FINGERPRINT, VOCAB, FakeRunner, make_scheduler
from workers.engine.engine import LLMEngine
from workers.engine.outputs import RequestOutput
from workers.metrics import ReplicaMetrics

LABELS = {"replica": "r1", "model": "tiny"}


class Clock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def output(ids, finished=False, prompt=7, queue_time: Optional[float] = None) -> RequestOutput:
    return RequestOutput("a", list(ids), "", FinishReason.LENGTH if finished else None, prompt, 0, 0,
                         queue_time=queue_time)


def value(metrics: ReplicaMetrics, name: str, **extra) -> Optional[float]:
    return metrics.registry.get_sample_value(name, {**LABELS, **extra})


# ------------------------------------------------------------------ replica


def test_request_timer_records_ttft_itl_e2e_queue_time_and_tokens():
    metrics, clock = ReplicaMetrics("r1", "tiny"), Clock()
    timer = metrics.start_request(clock)
    clock.now += 0.3
    timer.on_output(output([], queue_time=0.2))  # a prompt chunk without a token yet
    clock.now += 0.2
    timer.on_output(output([5], queue_time=0.2))  # first token at +0.5
    clock.now += 0.05
    timer.on_output(output([6, 7], queue_time=0.2))
    clock.now += 0.1
    timer.on_output(output([8], finished=True, queue_time=0.2))  # last at +0.65

    assert value(metrics, "prefixserve:time_to_first_token_seconds_count") == 1
    assert value(metrics, "prefixserve:time_to_first_token_seconds_sum") == pytest.approx(0.5)
    # One per token after the first: a chunk of 2 tokens 0.05 s after the last is two gaps of 0.025 s.
    assert value(metrics, "prefixserve:inter_token_latency_seconds_count") == 3
    assert value(metrics, "prefixserve:inter_token_latency_seconds_sum") == pytest.approx(0.15)
    assert value(metrics, "prefixserve:inter_token_latency_seconds_bucket", le="0.025") == 2
    assert value(metrics, "prefixserve:e2e_request_latency_seconds_sum") == pytest.approx(0.65)
    assert value(metrics, "prefixserve:request_queue_time_seconds_count") == 1
    assert value(metrics, "prefixserve:request_queue_time_seconds_sum") == pytest.approx(0.2)
    assert value(metrics, "prefixserve:prompt_tokens_total") == 7  # once per request
    assert value(metrics, "prefixserve:generation_tokens_total") == 4
    assert value(metrics, "prefixserve:time_to_first_token_seconds_bucket", le="0.5") == 1
    assert value(metrics, "prefixserve:time_to_first_token_seconds_bucket", le="0.25") == 0


def test_a_request_aborted_before_its_first_token_counts_no_tokens():
    metrics = ReplicaMetrics("r1", "tiny")
    metrics.start_request(Clock()).on_output(output([], finished=True))
    assert value(metrics, "prefixserve:prompt_tokens_total") == 0
    assert value(metrics, "prefixserve:time_to_first_token_seconds_count") == 0
    assert value(metrics, "prefixserve:e2e_request_latency_seconds_count") == 1


def test_gauges_and_engine_counters():
    metrics = ReplicaMetrics("r1", "tiny")
    metrics.set_load(ReplicaStats("r1", num_running=3, num_waiting=2, num_swapped=1, kv_cache_usage=0.85,
                                  num_cached_blocks=4))
    assert value(metrics, "prefixserve:num_requests_running") == 3
    assert value(metrics, "prefixserve:num_requests_waiting") == 2
    assert value(metrics, "prefixserve:num_requests_swapped") == 1
    assert value(metrics, "prefixserve:kv_cache_usage_perc") == 0.85
    metrics.record_engine_counters(num_preemptions=2, prefix_cache_queries=40, prefix_cache_hits=16)
    metrics.record_engine_counters(num_preemptions=5, prefix_cache_queries=40, prefix_cache_hits=24,
                                   model_compilations=2)
    assert value(metrics, "prefixserve:num_preemptions_total") == 5
    assert value(metrics, "prefixserve:prefix_cache_queries_total") == 40
    assert value(metrics, "prefixserve:prefix_cache_hits_total") == 24
    assert value(metrics, "prefixserve:model_compilations_total") == 2
    metrics.set_model_info("int4-g32", "auto", weight_bytes=123, kv_cache_bytes=456)
    metrics.set_model_info("gguf:q4_1+q8_0", "auto", weight_bytes=100, kv_cache_bytes=400)  # replaces, never adds
    assert value(metrics, "prefixserve:model_weight_bytes") == 100
    assert value(metrics, "prefixserve:kv_cache_bytes") == 400
    info = [s for s in metrics.registry.collect() if s.name == "prefixserve:model_info"][0].samples
    assert [(s.labels["quantization"], s.labels["kv_cache_dtype"], s.value) for s in info] == [
        ("gguf:q4_1+q8_0", "auto", 1.0)]


def test_spec_decode_counters_follow_the_speculator():
    metrics = ReplicaMetrics("r1", "tiny")
    metrics.record_spec_decode(num_drafts=2, num_draft_tokens=7, num_accepted_tokens=5,
                               accepted_per_position=[2, 2, 1, 0])
    metrics.record_spec_decode(num_drafts=3, num_draft_tokens=11, num_accepted_tokens=6,
                               accepted_per_position=[3, 2, 1, 0])
    assert value(metrics, "prefixserve:spec_decode_num_drafts_total") == 3
    assert value(metrics, "prefixserve:spec_decode_num_draft_tokens_total") == 11
    assert value(metrics, "prefixserve:spec_decode_num_accepted_tokens_total") == 6
    per_pos = [value(metrics, "prefixserve:spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
               for i in range(4)]
    assert per_pos == [3, 2, 1, 0]


def test_rendered_text_has_every_series_with_labels_and_no_created_samples():
    metrics = ReplicaMetrics("r1", "tiny")
    text = metrics.render().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert "_created" not in text
    expected = {"num_requests_running", "num_requests_waiting", "num_requests_swapped", "kv_cache_usage_perc",
                "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "model_compilations", "prompt_tokens",
                "generation_tokens", "time_to_first_token_seconds", "inter_token_latency_seconds",
                "e2e_request_latency_seconds", "request_queue_time_seconds", "model_weight_bytes", "kv_cache_bytes",
                "model_info", "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                "spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens_per_pos",
                "structured_output_requests", "structured_output_grammar_cache_hits",
                "structured_output_grammar_failures", "structured_output_jump_forward_tokens",
                "structured_output_compile_seconds", "lora_loaded_adapters", "lora_active_adapters", "lora_loads",
                "lora_evictions", "lora_load_seconds", "lora_requests", "lora_generation_tokens"}
    assert set(families) == {"prefixserve:" + name for name in expected}
    for family in families.values():
        assert all(s.labels["replica"] == "r1" and s.labels["model"] == "tiny" for s in family.samples)
    assert "prefixserve:prompt_tokens_total" in sample_names(metrics.registry)


def test_two_replicas_in_one_process_do_not_share_series():
    a, b = ReplicaMetrics("a", "m"), ReplicaMetrics("b", "m")
    a.generation_tokens.inc(3)
    assert b.registry.get_sample_value("prefixserve:generation_tokens_total", {"replica": "b", "model": "m"}) == 0


def test_engine_reports_queue_time_on_its_clock():
    # One sequence at a time: b waits while a runs.
    clock = Clock(10.0)
    scheduler = make_scheduler(32, 16, max_num_seqs=1)
    engine = LLMEngine(scheduler, FakeRunner.for_scheduler(scheduler), None, vocab_size=VOCAB,
                       max_model_len=64, model_fingerprint=FINGERPRINT, clock=clock)
    for rid in ("a", "b"):
        engine.add_request(GenerationRequest(rid, [1, 2, 3], SamplingParams(max_tokens=2)))
    clock.now = 12.0
    first = engine.step()
    assert [(o.request_id, o.queue_time) for o in first] == [("a", 2.0)]
    queue_times = {}
    while engine.has_unfinished_requests():
        clock.now += 1.0
        for out in engine.step():
            queue_times.setdefault(out.request_id, out.queue_time)
    assert queue_times["b"] == 14.0 - 10.0  # a finished at its 2nd step (t=13), b ran at t=14


# ------------------------------------------------------------------- router


def chunk(finished=False) -> StreamChunk:
    return StreamChunk("a", [1], "x", FinishReason.STOP if finished else None)


async def gen(items, closed: list):
    try:
        for item in items:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        closed.append(True)


def outcomes(metrics: RouterMetrics) -> dict[str, float]:
    return {o: metrics.registry.get_sample_value("prefixserve:router_requests_total",
                                                 {"policy": "cache_aware", "outcome": o})
            for o in ("ok", "invalid", "overloaded", "unavailable", "cancelled", "error")}


def test_metered_counts_each_outcome_once():
    metrics = RouterMetrics("cache_aware")

    async def drain(items):
        closed: list = []
        try:
            async for _ in metered(gen(items, closed), metrics):
                pass
        except Exception:  # noqa: BLE001 - the outcome is what is checked
            pass
        assert closed == [True]

    async def leave_early():
        closed: list = []
        stream = metered(gen([chunk(), chunk(), chunk(True)], closed), metrics)
        await stream.__anext__()
        await stream.aclose()
        assert closed == [True]  # closing the metered stream closes the backend's

    async def main():
        await drain([chunk(), chunk(True)])
        await drain([chunk(True)])
        await drain([ValueError("bad")])
        await drain([chunk(), OverloadedError("full")])
        await drain([NoReplicaError("none")])
        await drain([chunk(), RuntimeError("boom")])
        await drain([chunk()])  # ended without a finish reason
        await leave_early()

    asyncio.run(main())
    assert outcomes(metrics) == {"ok": 2, "invalid": 1, "overloaded": 1, "unavailable": 1, "cancelled": 1,
                                 "error": 2}
    with pytest.raises(ValueError, match="unknown outcome"):
        metrics.record_request("fine")


def test_decisions_and_match_ratio():
    metrics = RouterMetrics("least_load")
    metrics.record_decision(0.002, matched_blocks=3, num_blocks=4)
    metrics.record_decision(0.001, matched_blocks=None, num_blocks=4)  # no directory answer
    metrics.record_decision(0.001, matched_blocks=0, num_blocks=0)  # prompt shorter than a block
    get = metrics.registry.get_sample_value
    assert get("prefixserve:router_decision_seconds_count", {"policy": "least_load"}) == 3
    assert get("prefixserve:router_prefix_match_ratio_count", {"policy": "least_load"}) == 1
    assert get("prefixserve:router_prefix_match_ratio_sum", {"policy": "least_load"}) == 0.75


def replica_text(replica: str, tokens: int) -> bytes:
    metrics = ReplicaMetrics(replica, "tiny")
    metrics.generation_tokens.inc(tokens)
    metrics.time_to_first_token.observe(0.1)
    return metrics.render()


def test_merge_keeps_one_header_per_family_and_every_replica():
    merged = merge_expositions({"a": replica_text("a", 3), "b": replica_text("b", 5).decode(),
                                "bad": b"this is { not exposition"}).decode()
    assert merged.count("# TYPE prefixserve:generation_tokens_total counter") == 1
    assert merged.count("# TYPE prefixserve:time_to_first_token_seconds histogram") == 1
    samples = {(s.name, s.labels.get("replica")): s.value
               for f in text_string_to_metric_families(merged) for s in f.samples}
    assert samples[("prefixserve:generation_tokens_total", "a")] == 3
    assert samples[("prefixserve:generation_tokens_total", "b")] == 5
    assert samples[("prefixserve:time_to_first_token_seconds_count", "b")] == 1
    assert merge_expositions({}) == b""


class FakeDirectory:
    def __init__(self, texts=None, error: Optional[Exception] = None) -> None:
        self.texts, self.error = texts or {}, error

    async def replica_metrics(self):
        if self.error is not None:
            raise self.error
        return self.texts

    async def claim_metrics_exporter(self, owner: str, ttl_s: float) -> bool:
        if self.error is not None:
            raise self.error
        return True


def test_cluster_metrics_over_http_and_a_directory_outage():
    router = RouterMetrics("cache_aware")
    router.record_request("ok")
    directory = FakeDirectory({"a": replica_text("a", 3)})
    app = build_openai_app(backend=None, metrics=ClusterMetrics(router, directory))  # type: ignore[arg-type]

    async def scrape() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.get("/metrics")

    reply = asyncio.run(scrape())
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/plain")
    names = {s.name: s.value for f in text_string_to_metric_families(reply.text) for s in f.samples
             if s.labels.get("outcome") in (None, "ok")}
    assert names["prefixserve:router_requests_total"] == 1
    assert names["prefixserve:generation_tokens_total"] == 3

    directory.error = DirectoryUnavailable("redis down")
    reply = asyncio.run(scrape())
    assert reply.status_code == 200 and "prefixserve:generation_tokens_total" not in reply.text
    assert router.registry.get_sample_value("prefixserve:router_directory_errors_total") == 1


def test_directory_degraded_period_is_counted_and_ends():
    from router.metrics import RouterMetrics

    metrics = RouterMetrics("cache_aware")

    def value(name):
        return metrics.registry.get_sample_value(name)

    metrics.record_directory_ok(now=1.0)  # healthy: nothing to count
    assert value("prefixserve:router_directory_available") == 1
    metrics.record_directory_error(now=10.0)
    assert value("prefixserve:router_directory_available") == 0
    metrics.record_directory_error(now=13.0)  # counted while the outage lasts
    assert value("prefixserve:router_directory_degraded_seconds_total") == 3.0
    metrics.record_directory_ok(now=15.5)
    assert value("prefixserve:router_directory_degraded_seconds_total") == 5.5
    assert value("prefixserve:router_directory_available") == 1
    assert value("prefixserve:router_directory_errors_total") == 2


def test_structured_output_counters_follow_the_backend_and_never_go_back():
    metrics = ReplicaMetrics("r1", "tiny")
    metrics.record_structured(num_requests=3, num_cache_hits=2, num_failures=1, num_jump_forward_tokens=40,
                              compile_seconds=[0.004, 0.02])
    metrics.record_structured(num_requests=3, num_cache_hits=1, num_failures=1, num_jump_forward_tokens=45,
                              compile_seconds=[])
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples}
    labels = (("model", "tiny"), ("replica", "r1"))
    assert samples[("prefixserve:structured_output_requests_total", labels)] == 3
    assert samples[("prefixserve:structured_output_grammar_cache_hits_total", labels)] == 2
    assert samples[("prefixserve:structured_output_jump_forward_tokens_total", labels)] == 45
    assert samples[("prefixserve:structured_output_compile_seconds_count", labels)] == 2
