"""The replica's streaming path: outputs merged where they queued up,
``stream_interval``, the engine built and stepped on one thread, and the
forward's CPU threads."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from cluster.shared.config import EngineConfig, ParallelConfig, SchedulerConfig
from cluster.shared.types import FinishReason, GenerationRequest, SamplingParams, TokenLogprob
from tests.unit.engine_fakes import FINGERPRINT, VOCAB, FakeRunner, make_scheduler
from workers.engine.async_engine import AsyncEngine
from workers.engine.engine import LLMEngine
from workers.engine.outputs import RequestOutput, merge_outputs
from workers.placement import threads_per_rank


def make_engine(max_num_seqs: int = 4, step_s: float = 0.0) -> LLMEngine:
    scheduler = make_scheduler(64, 0, max_num_seqs=max_num_seqs, max_model_len=256)
    runner = FakeRunner.for_scheduler(scheduler)
    if step_s:  # steps that take as long as a model's: a ready consumer reads each one's output alone
        execute = runner.execute

        def slow(sched):
            time.sleep(step_s)
            return execute(sched)

        runner.execute = slow
    return LLMEngine(scheduler, runner, None, vocab_size=VOCAB, max_model_len=256, model_fingerprint=FINGERPRINT)


def req(rid: str, max_tokens: int, **params) -> GenerationRequest:
    return GenerationRequest(rid, [5, 6, 7, 8, 9], SamplingParams(max_tokens=max_tokens, temperature=0, **params))


def run_streams(front: AsyncEngine, requests: list[GenerationRequest], consumer_delay_s: float = 0.0):
    async def one(request):
        outs = []
        async for out in front.generate(request):
            outs.append(out)
            if consumer_delay_s:
                await asyncio.sleep(consumer_delay_s)  # a busy consumer: outputs queue up meanwhile
        return outs

    async def main():
        return await asyncio.gather(*(one(r) for r in requests))

    return asyncio.run(main())


def reference(requests: list[GenerationRequest]) -> dict[str, list[int]]:
    """Each request's tokens, one output per step (the engine stepped directly)."""
    engine = make_engine()
    for r in requests:
        engine.add_request(r)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    return tokens


def test_merge_outputs_concatenates_in_order_and_keeps_the_later_totals():
    lp = [TokenLogprob(token_id=1, logprob=-0.5)]
    first = RequestOutput("r", [1], "a", None, 5, 1, 2, new_logprobs=lp, queue_time=0.25)
    later = RequestOutput("r", [2, 3], "bc", FinishReason.LENGTH, 5, 3, 2, new_logprobs=lp * 2,
                          finish_message=None)
    merged = merge_outputs(first, later)
    assert merged.new_token_ids == [1, 2, 3] and merged.new_text == "abc"
    assert merged.new_logprobs == lp * 3
    assert merged.finish_reason is FinishReason.LENGTH and merged.finished
    assert merged.num_output_tokens == 3 and merged.queue_time == 0.25
    assert merge_outputs(RequestOutput("r", [1], "a", None, 5, 1, 0), RequestOutput("r", [2], "b", None, 5, 2, 0)
                         ).new_logprobs is None


@pytest.mark.parametrize("interval", [1, 3, 7])
def test_stream_interval_sends_the_first_token_alone_then_chunks_of_n(interval):
    requests = [req(f"s{i}", 10) for i in range(3)]
    expected = reference(requests)
    front = AsyncEngine(make_engine(step_s=0.01), stream_interval=interval)
    front.start()
    try:
        results = run_streams(front, requests)
    finally:
        front.shutdown()
    for r, outs in zip(requests, results):
        assert [t for o in outs for t in o.new_token_ids] == expected[r.request_id]
        sizes = [len(o.new_token_ids) for o in outs]
        assert sizes[0] == 1  # the first token leaves at once
        assert all(s == interval for s in sizes[1:-1])  # then N at a time
        assert 1 <= sizes[-1] <= interval
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        assert outs[-1].num_output_tokens == 10


def test_outputs_queued_behind_a_busy_consumer_go_out_merged_with_nothing_lost():
    requests = [req(f"b{i}", 12) for i in range(2)]
    expected = reference(requests)
    front = AsyncEngine(make_engine())
    front.start()
    try:
        results = run_streams(front, requests, consumer_delay_s=0.02)
    finally:
        front.shutdown()
    for r, outs in zip(requests, results):
        assert [t for o in outs for t in o.new_token_ids] == expected[r.request_id]
        assert "".join(o.new_text for o in outs) == "".join(o.new_text for o in outs)  # text concatenates
        assert outs[-1].finished
        assert len(outs) < 12  # the busy consumer got several steps' tokens per output


def test_stream_interval_validation():
    assert SchedulerConfig().stream_interval == 1
    with pytest.raises(ValueError, match="stream_interval must be >= 1"):
        SchedulerConfig(stream_interval=0)
    assert EngineConfig.from_kwargs(stream_interval=4).scheduler.stream_interval == 4
    with pytest.raises(ValueError, match="stream_interval must be >= 1"):
        AsyncEngine(make_engine(), stream_interval=0)


def test_engine_built_and_stepped_on_its_own_thread():
    built_on = []

    def factory():
        built_on.append(threading.current_thread())
        return make_engine()

    front = AsyncEngine.on_own_thread(factory)
    try:
        stepped_on = asyncio.run(front.call(lambda engine: threading.current_thread()))
        assert built_on == [stepped_on] and stepped_on is not threading.main_thread()
        outs = run_streams(front, [req("t", 4)])[0]
        assert outs[-1].finished
    finally:
        front.shutdown()

    def failing():
        raise ValueError("no model here")

    with pytest.raises(ValueError, match="no model here"):
        AsyncEngine.on_own_thread(failing)


def test_cpu_threads_knob_and_the_share_of_a_fractional_reservation():
    assert ParallelConfig().cpu_threads is None
    assert EngineConfig.from_kwargs(cpu_threads=3).parallel.cpu_threads == 3
    with pytest.raises(ValueError, match="cpu_threads must be >= 1"):
        ParallelConfig(cpu_threads=0)
    assert threads_per_rank(4.0, 2, cores=16) == 4  # whole CPUs: as many threads
    assert threads_per_rank(0.5, 1, cores=2) == 2  # one fractional replica: the machine's cores
    assert threads_per_rank(0.5, 2, cores=2) == 1  # two sharing 2 cores: one each
    assert threads_per_rank(0.5, 3, cores=16) == 5


@pytest.mark.parametrize("engine_args, expected", [({"cpu_threads": 1}, [1]), ({}, [])])
def test_the_offline_llm_runs_its_forward_on_cpu_threads(monkeypatch, tmp_path, engine_args, expected):
    """``LLM(cpu_threads=N)`` sets the forward's threads in its own process
    (it was read only by Serve replicas and tensor-parallel ranks)."""
    import types

    import workers.llm as llm_module
    import workers.placement as placement

    calls: list[int] = []
    monkeypatch.setattr(placement, "set_cpu_threads", calls.append)
    monkeypatch.setattr(llm_module, "build_engine", lambda config: types.SimpleNamespace(
        engine=None, runner=None, tokenizer=None, model_dir=tmp_path))
    llm = llm_module.LLM(**engine_args)
    assert calls == expected
    assert llm.config.parallel.cpu_threads == engine_args.get("cpu_threads")
