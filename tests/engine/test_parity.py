"""End to end: the engine's greedy outputs are token-identical to Hugging Face
transformers (float32, same weights) whatever the batching: one mixed batch,
forced chunked prefill, prefix-cache hits, preemption by swap and by
recompute, and requests arriving while others decode. The block pool is
intact and empty after every run."""

from __future__ import annotations

import random

import pytest

from cluster.types import SamplingParams
from tests.factories import hf_greedy, make_tiny_model_dir
from tests.unit.engine_fakes import assert_all_blocks_free_or_cached
from workers.llm import LLM

FAMILIES = ["llama", "mistral", "qwen2"]
PROMPT_LENS = [3, 9, 17, 24, 33, 40, 6, 50, 29]
MAX_TOKENS = [12, 8, 16, 10, 6, 14, 20, 9, 11]

# Engine settings per scenario (tiny model: block_size 4 crosses many blocks).
SCENARIOS = {
    "one_batch": dict(block_size=4),
    "chunked_prefill": dict(block_size=4, max_num_batched_tokens=16, max_num_seqs=8),
    "swap": dict(block_size=4, num_kv_blocks=24, preemption_mode="swap", swap_space=0.01),
    "recompute": dict(block_size=4, num_kv_blocks=24, preemption_mode="recompute"),
    "no_chunking": dict(block_size=4, enable_chunked_prefill=False, max_num_batched_tokens=64),
}


def make_prompts(vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENS]
    prompts[-1] = prompts[5][:24] + prompts[-1][24:]  # shares 6 blocks with prompt 5
    return prompts


@pytest.fixture(scope="module", params=FAMILIES)
def family_case(request, tmp_path_factory):
    model_dir = make_tiny_model_dir(request.param, tmp_path_factory.mktemp(request.param))
    prompts = make_prompts(512, seed=FAMILIES.index(request.param))
    return model_dir, prompts, hf_greedy(model_dir, prompts, MAX_TOKENS)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def check_pool(llm: LLM) -> None:
    assert_all_blocks_free_or_cached(llm.engine.scheduler)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_matches_hf(family_case, scenario):
    model_dir, prompts, expected = family_case
    llm = LLM(str(model_dir), **SCENARIOS[scenario])
    outs = llm.generate(prompts, [greedy(n) for n in MAX_TOKENS])
    assert [o.token_ids for o in outs] == expected
    if scenario in ("swap", "recompute"):
        assert llm.engine.scheduler.num_preemptions_total > 0
    check_pool(llm)


def test_prefix_cache_hits_keep_outputs_exact(family_case):
    model_dir, prompts, expected = family_case
    llm = LLM(str(model_dir), block_size=4)
    first = llm.generate(prompts, [greedy(n) for n in MAX_TOKENS])
    assert [o.token_ids for o in first] == expected
    again = llm.generate(prompts, [greedy(n) for n in MAX_TOKENS])
    assert [o.token_ids for o in again] == expected
    for prompt, out in zip(prompts, again):
        # Every full prompt block is cached, but one token is always recomputed.
        assert out.num_cached_tokens == ((len(prompt) - 1) // 4) * 4
    check_pool(llm)


def test_requests_arriving_while_others_decode(family_case):
    model_dir, prompts, expected = family_case
    llm = LLM(str(model_dir), block_size=4, max_num_batched_tokens=32, max_num_seqs=8)
    reqs = [llm.make_request(p, greedy(n)) for p, n in zip(prompts, MAX_TOKENS)]
    got = {r.request_id: [] for r in reqs}
    for r in reqs[:4]:
        llm.engine.add_request(r)
    pending = reqs[4:]
    while llm.engine.has_unfinished_requests() or pending:
        for out in llm.engine.step():
            got[out.request_id] += out.new_token_ids
        if pending and llm.engine.num_steps % 3 == 0:
            llm.engine.add_request(pending.pop(0))
    assert [got[r.request_id] for r in reqs] == expected
    check_pool(llm)
