"""Parallel sampling and the request's own logit edits on a real (tiny,
random-init) model: n / best_of choices equal the single requests they
stand for, whatever the batch and through preemption; logit_bias,
allowed_token_ids, bad_words and min_tokens do what OpenAI and vLLM say."""

from __future__ import annotations

import asyncio

import pytest

from cluster.shared.types import FinishReason, GenerationRequest, SamplingParams
from tests.factories import make_tiny_model_dir
from tests.unit.engine_fakes import assert_all_blocks_free_or_cached
from workers.engine.async_engine import AsyncEngine
from workers.llm import LLM, select_best

PROMPT = list(range(10, 31))  # 21 tokens: 5 full blocks of 4 and a partial one


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model_dir("llama", tmp_path_factory.mktemp("tiny-llama-n"))


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return LLM(str(tiny_dir), block_size=4)


def sampled(seed, n=1, max_tokens=12, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, top_p=0.95, seed=seed, ignore_eos=True, n=n, **kw)


def choices(out) -> list[list[int]]:
    return [c.token_ids for c in out.outputs]


def test_seeded_n_equals_the_single_requests_with_their_seeds_in_any_batch(tiny):
    singles = [tiny.generate([PROMPT], sampled(5 + i))[0].token_ids for i in range(4)]
    assert len({tuple(s) for s in singles}) == 4
    alone = tiny.generate([PROMPT], sampled(5, n=4))[0]
    assert choices(alone) == singles and [c.index for c in alone.outputs] == [0, 1, 2, 3]
    mates = [list(range(40 + i, 52 + 3 * i)) for i in range(3)]
    batch = tiny.generate(mates[:2] + [PROMPT] + mates[2:], [sampled(1), sampled(2, n=3), sampled(5, n=4),
                                                              SamplingParams(max_tokens=7, temperature=0.7)])
    assert choices(batch[2]) == singles
    assert tiny.generate([PROMPT], sampled(5, n=4))[0].outputs[2].token_ids == singles[2]  # reproducible
    assert_all_blocks_free_or_cached(tiny.engine.scheduler)


def test_greedy_n_returns_identical_choices(tiny):
    out = tiny.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0.0, n=2, ignore_eos=True))[0]
    single = tiny.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0]
    assert choices(out) == [single.token_ids, single.token_ids]
    assert_all_blocks_free_or_cached(tiny.engine.scheduler)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preempting_forked_groups_changes_no_token(tiny_dir, mode):
    prompts = [list(range(5 + i, 27 + i)) for i in range(4)]
    params = [sampled(100 + i, n=3, max_tokens=20) for i in range(4)]
    roomy = LLM(str(tiny_dir), block_size=4).generate(prompts, params)
    tight = LLM(str(tiny_dir), block_size=4, num_kv_blocks=24, preemption_mode=mode, swap_space=0.01)
    engine = tight.engine
    requests = [tight.make_request(p, sp) for p, sp in zip(prompts, params)]
    got = {r.request_id: [[], [], []] for r in requests}
    for request in requests:
        engine.add_request(request)
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id][out.index].extend(out.new_token_ids)
        engine.scheduler.check_integrity()
    assert engine.scheduler.num_preemptions_total > 0
    assert [got[r.request_id] for r in requests] == [choices(o) for o in roomy]
    assert_all_blocks_free_or_cached(engine.scheduler)


def test_best_of_keeps_the_n_best_by_cumulative_logprob(tiny):
    out = tiny.generate([PROMPT], SamplingParams(max_tokens=8, temperature=1.0, seed=3, n=2, best_of=5))[0]
    all_five = tiny.generate([PROMPT], SamplingParams(max_tokens=8, temperature=1.0, seed=3, n=5, logprobs=0))[0]
    scores = [c.cumulative_logprob for c in all_five.outputs]
    best = select_best(scores, 2)
    assert choices(out) == [all_five.outputs[i].token_ids for i in best]
    assert scores[best[0]] >= scores[best[1]] >= max(s for i, s in enumerate(scores) if i not in best)
    assert all(c.logprobs is None for c in out.outputs) and [c.index for c in out.outputs] == [0, 1]


def test_logit_bias_bans_and_forces(tiny):
    greedy = tiny.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0].token_ids
    banned = tiny.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                    logit_bias={greedy[0]: -100}))[0].token_ids
    assert greedy[0] not in banned
    sampled_out = tiny.generate([PROMPT], sampled(9, n=4, max_tokens=16, logit_bias={t: -100 for t in greedy[:3]}))[0]
    assert not any(t in greedy[:3] for c in sampled_out.outputs for t in c.token_ids)
    forced = tiny.generate([PROMPT], sampled(9, max_tokens=8, logit_bias={77: 100}))[0].token_ids
    assert forced == [77] * 8


def test_allowed_token_ids_and_bad_words(tiny):
    allowed = tiny.generate([PROMPT], sampled(4, n=2, max_tokens=10, allowed_token_ids=[3, 9, 11]))[0]
    assert all(t in (3, 9, 11) for c in allowed.outputs for t in c.token_ids)
    greedy = tiny.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0].token_ids
    two = tiny.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                                 bad_words_token_ids=[greedy[:2]]))[0].token_ids
    assert two[0] == greedy[0] and two[1] != greedy[1]  # the word's last token is banned after its prefix
    words = [tiny.tokenizer.decode([t]).strip() for t in greedy]
    word = next(w for w in words if w.isalnum())
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, bad_words=[word])
    resolved = tiny.engine._engine_params(params).bad_words_token_ids  # the word, and after a space
    singles = {w[0] for w in resolved if len(w) == 1}
    assert singles and singles & set(greedy)
    by_text = tiny.generate([PROMPT], params)[0].token_ids
    assert not singles & set(by_text)


def test_min_tokens_holds_back_eos_and_stop_ids(tiny):
    eos = 2  # the tiny config's eos_token_id; +100 makes it the only choice once allowed
    out = tiny.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0.0, min_tokens=5,
                                                 logit_bias={eos: 100}))[0]
    assert out.token_ids[:5].count(eos) == 0 and out.token_ids[5] == eos and len(out.token_ids) == 6
    assert out.finish_reason == FinishReason.STOP
    stop = tiny.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0.0, min_tokens=3, ignore_eos=True,
                                                  stop_token_ids=[77], logit_bias={77: 100}))[0]
    assert 77 not in stop.token_ids[:3] and stop.token_ids[3:] == [77] and stop.finish_reason == FinishReason.STOP


def test_choices_beyond_max_num_seqs_are_refused(tiny_dir):
    llm = LLM(str(tiny_dir), block_size=4, max_num_seqs=4)
    with pytest.raises(ValueError, match="n is 5 but this replica runs at most max_num_seqs = 4"):
        llm.generate([PROMPT], sampled(1, n=5))
    with pytest.raises(ValueError, match="logit_bias names token 9999"):
        llm.generate([PROMPT], sampled(1, logit_bias={9999: 1}))
    assert not llm.engine.has_unfinished_requests()


def test_async_streams_every_choice_and_cancel_frees_the_group(tiny):
    singles = [tiny.generate([PROMPT], sampled(5 + i, max_tokens=6))[0].token_ids for i in range(3)]
    front = AsyncEngine(tiny.engine)

    async def whole():
        got = {}
        async for out in front.generate(GenerationRequest("g1", PROMPT, sampled(5, n=3, max_tokens=6))):
            got.setdefault(out.index, []).extend(out.new_token_ids)
            finished = out.finished
        return got, finished

    async def cancelled():
        stream = front.generate(GenerationRequest("g2", PROMPT, sampled(5, n=3, max_tokens=200)))
        seen = 0
        async for out in stream:
            seen += len(out.new_token_ids)
            if seen >= 8:
                await stream.aclose()
                return

    try:
        got, finished = asyncio.run(whole())
        assert finished and [got[i] for i in range(3)] == singles
        asyncio.run(cancelled())
        for _ in range(200):
            if not tiny.engine.has_unfinished_requests():
                break
            asyncio.run(asyncio.sleep(0.01))
    finally:
        front.shutdown()
    assert_all_blocks_free_or_cached(tiny.engine.scheduler)


def test_bench_parallel_holds_one_prompt_and_the_outputs(tiny_dir, tmp_path):
    import argparse
    import json

    from cluster.bench.parallel import run_parallel

    path = tmp_path / "parallel.json"
    args = argparse.Namespace(input_len=42, n=4, output_len=9, temperature=0.8, rounds=1, json=str(path))
    assert run_parallel(args, {"model": str(tiny_dir), "block_size": 4}) == 0
    report = json.loads(path.read_text())
    ways = report["ways"]
    assert report["peak_blocks_bound"] == 11 + 4 * 3  # 42 tokens: 11 blocks; each output 2 + 9 tokens from a partial
    assert ways["n=N"]["peak_blocks"] <= report["peak_blocks_bound"] < ways["separate, cache off"]["peak_blocks"]
    assert all(way["identical"] for way in ways.values())
