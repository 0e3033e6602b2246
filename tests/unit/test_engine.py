"""LLMEngine and AsyncEngine over the fake runner: validation, stops, aborts,
streaming and cancellation (no torch)."""

from __future__ import annotations

import asyncio
import time

import pytest

from cluster.shared.types import FinishReason, GenerationRequest, SamplingParams
from tests.unit.engine_fakes import FINGERPRINT, VOCAB, FakeRunner, assert_all_blocks_free_or_cached
from tests.unit.engine_fakes import expected_output, make_scheduler
from workers.engine.async_engine import AsyncEngine
from workers.engine.engine import LLMEngine


class DigitDecoder:
    """Token t decodes to chr(ord('a') + t % 26): a stop string is predictable."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + t % 26) for t in ids)


def make_engine(num_blocks=32, max_model_len=64, **sched_kwargs) -> LLMEngine:
    scheduler = make_scheduler(num_blocks, 16, max_model_len=max_model_len, **sched_kwargs)
    runner = FakeRunner.for_scheduler(scheduler)
    return LLMEngine(scheduler, runner, DigitDecoder(), vocab_size=VOCAB, max_model_len=max_model_len,
                     model_fingerprint=FINGERPRINT)


def req(rid, prompt, **params) -> GenerationRequest:
    return GenerationRequest(rid, list(prompt), SamplingParams(**params))


def run(engine: LLMEngine, first_outputs=()) -> dict:
    results: dict = {}
    pending = list(first_outputs)
    while pending or engine.has_unfinished_requests():
        for out in pending or engine.step():
            entry = results.setdefault(out.request_id, {"ids": [], "text": "", "reason": None})
            entry["ids"] += out.new_token_ids
            entry["text"] += out.new_text
            entry["reason"] = out.finish_reason
        pending = []
    return results


@pytest.mark.parametrize(
    "request_,match",
    [
        (req("a", []), "prompt is empty"),
        (req("a", range(100, 164)), "max_model_len is 64"),
        (req("a", [5, VOCAB + 3]), "outside the vocabulary"),
        (req("a", [5, -1]), "outside the vocabulary"),
    ],
)
def test_bad_requests_raise_and_the_engine_keeps_serving(request_, match):
    engine = make_engine()
    engine.add_request(req("good", [10, 11, 12], max_tokens=5))
    first = engine.step()
    with pytest.raises(ValueError, match=match):
        engine.add_request(request_)
    out = run(engine, first)
    assert out["good"]["ids"] == expected_output([10, 11, 12], 5)
    assert_all_blocks_free_or_cached(engine.scheduler)


@pytest.mark.parametrize("kwargs,match", [({"max_tokens": 0}, "max_tokens"), ({"top_p": 0.0}, "top_p"),
                                          ({"top_p": 1.5}, "top_p"), ({"temperature": -1}, "temperature")])
def test_bad_sampling_params_say_what_to_change(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_duplicate_request_id_is_rejected():
    engine = make_engine()
    engine.add_request(req("x", [1, 2, 3]))
    with pytest.raises(ValueError, match="unique id"):
        engine.add_request(req("x", [4, 5]))


def test_stop_string_finishes_and_frees_blocks():
    prompt = [10, 11, 12]
    tokens = expected_output(prompt, 12)
    text = DigitDecoder().decode(tokens)
    stop = text[4:6]
    engine = make_engine()
    engine.add_request(req("s", prompt, max_tokens=12, stop=[stop]))
    out = run(engine)["s"]
    assert out["reason"] == FinishReason.STOP
    assert out["text"] == text[: text.index(stop)]
    assert_all_blocks_free_or_cached(engine.scheduler)


def test_abort_mid_decode_returns_blocks():
    engine = make_engine()
    engine.add_request(req("a", range(20, 40), max_tokens=30))
    engine.add_request(req("b", range(50, 60), max_tokens=4))
    first = [out for _ in range(3) for out in engine.step()]
    assert engine.stats().kv_cache_usage > 0
    final = engine.abort_request("a")
    assert final is not None and final.finish_reason == FinishReason.ABORT
    assert run(engine, first)["b"]["ids"] == expected_output(range(50, 60), 4)
    assert engine.abort_request("a") is None
    assert_all_blocks_free_or_cached(engine.scheduler)


def test_async_engine_streams_and_cancellation_frees_blocks():
    engine = make_engine()
    execute = engine.runner.execute

    def model_paced(sched):  # steps as long as a model's, so the stream is read mid-way
        time.sleep(0.005)
        return execute(sched)

    engine.runner.execute = model_paced
    front = AsyncEngine(engine)

    async def main():
        async def collect(request):
            ids = []
            async for out in front.generate(request):
                ids += out.new_token_ids
            return ids

        full = asyncio.create_task(collect(req("full", [3, 4, 5], max_tokens=6)))
        gen = front.generate(req("cancel", range(30, 50), max_tokens=40))
        first = await gen.__anext__()
        await gen.aclose()  # the client goes away mid-stream
        with pytest.raises(ValueError, match="prompt is empty"):
            await front.generate(req("bad", [])).__anext__()
        return first, await full

    try:
        first, full_ids = asyncio.run(main())
        assert full_ids == expected_output([3, 4, 5], 6)
        # Mid-stream: outputs that queued up before the first read come merged (async_engine.py).
        assert not first.finished and 1 <= len(first.new_token_ids) < 40
        for _ in range(100):  # the abort is applied by the engine thread
            if not engine.has_unfinished_requests() and front.stats.num_running == 0:
                break
            asyncio.run(asyncio.sleep(0.02))
    finally:
        front.shutdown()
    assert_all_blocks_free_or_cached(engine.scheduler)


def test_stats_count_the_work_in_tokens():
    # A 10-token budget per step: the 30-token prompt prefills in chunks.
    engine = make_engine(max_num_batched_tokens=10)
    engine.add_request(req("long", range(100, 130), max_tokens=4))
    engine.add_request(req("short", range(200, 205), max_tokens=4))
    stats = engine.stats()
    assert (stats.num_prefill_tokens, stats.num_decode_tokens, stats.num_kv_blocks) == (35, 0, 32)
    engine.step()  # 10 tokens of "long"
    assert engine.stats().num_prefill_tokens == 25
    while engine.stats().num_prefill_tokens:
        engine.step()
    # Both decode now; their context (prompt + outputs so far) is the decode load.
    running = engine.scheduler.queue.running
    assert engine.stats().num_decode_tokens == sum(seq.num_tokens for seq in running) > 35
    run(engine)
    assert (engine.stats().num_prefill_tokens, engine.stats().num_decode_tokens) == (0, 0)
    # A waiting request whose first 16 tokens (one block) are cached queues only the rest.
    engine.add_request(req("again", list(range(100, 116)) + [7, 8, 9], max_tokens=2))
    assert engine.stats().num_prefill_tokens == 3


def test_runner_guesses_are_priced_like_the_drafts_they_become():
    # A proposer inside the runner (Medusa heads) costs a pass per step whenever
    # guesses are asked for: the step-cost model sees them as draft tokens, so
    # heads that cost more than they bring get asked for nothing.
    from cluster.shared.config import SpeculativeConfig
    from workers.engine.proposers import RunnerProposer
    from workers.engine.spec_decode import Speculator

    speculator = Speculator(SpeculativeConfig(method="medusa", model="heads", num_speculative_tokens=3),
                            proposer=RunnerProposer())
    engine = make_engine(speculator=speculator)
    seen = []
    observe = speculator.observe_step
    speculator.observe_step = lambda tokens, drafts, seqs, seconds, num_guesses: (
        seen.append((tokens, drafts, seqs, num_guesses)), observe(tokens, drafts, seqs, seconds, num_guesses))
    asked = []
    execute = engine.runner.execute
    engine.runner.execute = lambda sched: (asked.append(sum(r.num_proposals for r in sched.scheduled)),
                                           execute(sched))[1]
    engine.add_request(req("a", [1, 2, 3], max_tokens=4))
    engine.add_request(req("b", [4, 5], max_tokens=4))
    run(engine)
    assert [drafts for _, drafts, _, _ in seen] == asked  # no drafts verified here: the guesses asked, step by step
    assert [guesses for *_, guesses in seen] == asked  # told apart, for the price of a draft (next test file)
    assert asked[0] == 2 * 3  # at first, 3 guesses per sequence
