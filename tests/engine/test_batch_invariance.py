"""Batch invariance: a request's tokens *and logprobs* are bitwise the same
whatever else shares its steps.

Default engine (native GEMM, fused CPU ops, native decode attention): the same
request alone and among batch-mates that arrive with it or while it decodes,
with prefills that fit one step; on a CPU with AVX-512 (the native prefill
kernel) also when its prompt's prefill is cut into different chunks. With
``batch_invariant=True`` on any CPU for chunks, and when recomputed after a
preemption, for Llama and for Gemma 2 (soft-capped attention scores), with
the greedy tokens of transformers. Logprobs are floats straight from the logits, so any difference
in any kernel's arithmetic shows.
"""

from __future__ import annotations

import random

import pytest

from cluster.shared.types import SamplingParams
from tests.factories import hf_greedy, make_tiny_model_dir
from workers.llm import LLM

PROMPT = [5, 17, 42, 99, 7, 250, 3, 8, 64, 128, 11, 300, 45, 46, 47, 200, 199, 13, 77, 31]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir("llama", tmp_path_factory.mktemp("invariance"))


def params(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=2)


def fingerprint(out) -> list[tuple]:
    """Tokens and every logprob of the output, as exact floats."""
    return [(lp.token_id, lp.logprob, lp.top_logprobs) for lp in out.logprobs]


def mates(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(1, 60))] for _ in range(n)]


def run_with_mates(llm: LLM, others: list[list[int]], staggered: bool) -> list[tuple]:
    """The target request's fingerprint when ``others`` share the engine with it."""
    engine = llm.engine
    target = llm.make_request(PROMPT, params())
    if staggered:  # batch-mates are mid-decode when the target arrives
        for prompt in others:
            engine.add_request(llm.make_request(prompt, params(30)))
        for _ in range(3):
            engine.step()
        engine.add_request(target)
    else:
        engine.add_request(target)
        for prompt in others:
            engine.add_request(llm.make_request(prompt, params(random.Random(len(prompt)).randint(1, 20))))
    result = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == target.request_id and out.new_logprobs:
                result.extend((lp.token_id, lp.logprob, lp.top_logprobs) for lp in out.new_logprobs)
    return result


def test_default_engine_is_invariant_to_batch_mates(model_dir):
    llm = LLM(str(model_dir), block_size=4, max_num_batched_tokens=2048, max_num_seqs=16)
    alone = fingerprint(llm.generate([PROMPT], params())[0])
    assert len(alone) == MAX_TOKENS
    for seed, count in enumerate([1, 3, 7, 15]):
        for staggered in (False, True):
            assert run_with_mates(llm, mates(count, seed), staggered) == alone, (count, staggered)


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_head_norm_and_gemma_families_are_invariant_to_batch_mates(family, tmp_path):
    # Their q/k norms, Gemma's four norms, GeGLU and two RoPE tables in the native step driver.
    llm = LLM(str(make_tiny_model_dir(family, tmp_path)), block_size=4, max_num_batched_tokens=2048,
              max_num_seqs=16)
    assert llm.engine.runner.model.native_decoder is not None
    alone = fingerprint(llm.generate([PROMPT], params())[0])
    for seed, count in enumerate([3, 15]):
        for staggered in (False, True):
            assert run_with_mates(llm, mates(count, seed), staggered) == alone, (count, staggered)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_batch_invariant_mode_covers_chunked_prefill_and_recompute(family, model_dir, tmp_path):
    # Gemma 2: its soft-capped scores are capped in the per-query kernel, prefill rows included.
    if family != "llama":
        model_dir = make_tiny_model_dir(family, tmp_path)
    reference = LLM(str(model_dir), block_size=4, batch_invariant=True)
    alone = fingerprint(reference.generate([PROMPT], params())[0])
    assert [token for token, _, _ in alone] == hf_greedy(model_dir, [PROMPT], [MAX_TOKENS])[0]
    # Logprobs close to the default engine's: Gemma 2's cap left out moves them by ~3e-2, not its tokens.
    default = fingerprint(LLM(str(model_dir), block_size=4).generate([PROMPT], params())[0])
    assert [lp for _, lp, _ in alone] == pytest.approx([lp for _, lp, _ in default], abs=1e-4)
    for budget in (3, 7, 16):  # the prompt's prefill cut into chunks of different sizes
        chunked = LLM(str(model_dir), block_size=4, batch_invariant=True, max_num_batched_tokens=budget,
                      max_num_seqs=min(budget, 8))
        assert run_with_mates(chunked, mates(5, budget), staggered=False) == alone, budget
    # A pool so small that requests are preempted and recomputed.
    tight = LLM(str(model_dir), block_size=4, batch_invariant=True, num_kv_blocks=24, preemption_mode="recompute")
    assert run_with_mates(tight, mates(4, 99), staggered=True) == alone
    assert tight.engine.scheduler.num_preemptions_total > 0


@pytest.mark.parametrize("block_size,budget", [(4, 3), (16, 7)])
def test_chunked_prefill_without_batch_invariant(model_dir, block_size, budget):
    """Without the option a different prefill chunking keeps the tokens (those of
    transformers); where the native prefill kernel serves (AVX-512) the logprobs
    are bitwise the same too: its key tiles are cut at absolute positions, so a
    prompt row's arithmetic does not depend on the chunk that carries it."""
    from workers.model.attention import cpu_prefill

    whole = LLM(str(model_dir), block_size=block_size)
    chunked = LLM(str(model_dir), block_size=block_size, max_num_batched_tokens=budget, max_num_seqs=3)
    a, b = whole.generate([PROMPT], params())[0], chunked.generate([PROMPT], params())[0]
    assert a.token_ids == b.token_ids
    if cpu_prefill.load() is not None:
        assert fingerprint(a) == fingerprint(b)


def test_batch_invariant_refuses_what_it_cannot_guarantee(model_dir):
    with pytest.raises(ValueError, match="linear_backend native"):
        LLM(str(model_dir), batch_invariant=True, linear_backend="torch")
    with pytest.raises(ValueError, match="batch_invariant runs on CPU"):
        LLM(str(model_dir), batch_invariant=True, dtype="bfloat16")
