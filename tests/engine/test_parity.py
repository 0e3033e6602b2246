"""End to end: the engine's greedy outputs are token-identical to Hugging Face
transformers (float32, same weights) whatever the batching: one mixed batch,
forced chunked prefill, prefix-cache hits, preemption by swap and by
recompute, and requests arriving while others decode; each of those with
n-gram speculative decoding too. The block pool is intact and empty after
every run."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from cluster.shared.chat_template import ChatTemplate
from cluster.shared.types import SamplingParams
from cluster.shared.config import SpeculativeConfig
from tests.factories import OracleProposer, TreeOracleProposer, hf_greedy, make_tiny_model_dir
from tests.unit.engine_fakes import assert_all_blocks_free_or_cached
from workers.engine.spec_decode import Speculator
from workers.llm import LLM
from workers.model.loader import read_arch, resolve_model
from workers.model.eagle import EagleDraft
from workers.model.medusa import MedusaHeads

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3", "mixtral", "qwen2_moe", "qwen3_moe", "gemma2",
            "phi3_longrope"]
PROMPT_LENS = [3, 9, 17, 24, 33, 40, 6, 50, 29]
MAX_TOKENS = [12, 8, 16, 10, 6, 14, 20, 9, 11]

TEXTS = [
    "Hi",
    "The capital of France is",
    "Write a haiku about the sea and the wind that moves over it at night.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "List three reasons why continuous batching improves the throughput of an LLM server. " * 2,
    "Once upon a time, in a village at the edge of a great forest, there lived an old clockmaker who "
    "repaired every clock in the valley except his own, which had stopped at a quarter past three on "
    "the night his daughter left for the city.",
    "1, 2, 3, 4, 5, 6, 7, 8,",
    "Translate to French: The weather is nice today and we are going to the beach with our friends.",
    "Explain paged attention in one paragraph. " * 5,
]


@dataclass
class Case:
    """A model, its prompts and the HF greedy continuations."""

    model_dir: Path
    prompts: list[list[int]]
    max_tokens: list[int]
    expected: list[list[int]]
    block_size: int
    tight_blocks: int  # a pool small enough to force preemption

    def scenario(self, name: str) -> dict:
        bs = self.block_size
        return {
            "one_batch": dict(block_size=bs),
            "chunked_prefill": dict(block_size=bs, max_num_batched_tokens=16, max_num_seqs=8),
            "swap": dict(block_size=bs, num_kv_blocks=self.tight_blocks, preemption_mode="swap", swap_space=0.05),
            "recompute": dict(block_size=bs, num_kv_blocks=self.tight_blocks, preemption_mode="recompute"),
            "no_chunking": dict(block_size=bs, enable_chunked_prefill=False, max_num_batched_tokens=256),
        }[name]


SCENARIOS = ["one_batch", "chunked_prefill", "swap", "recompute", "no_chunking"]


def make_prompts(vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENS]
    prompts[-1] = prompts[5][:24] + prompts[-1][24:]  # shares 6 blocks with prompt 5
    return prompts


def default_model_case() -> Case:
    from tokenizers import Tokenizer

    model_dir = resolve_model(None)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    template = ChatTemplate.from_model_dir(model_dir)
    texts = [template.render([{"role": "user", "content": t}]) if i % 3 == 1 else t for i, t in enumerate(TEXTS)]
    prompts = [tok.encode(t).ids for t in texts]
    prompts[-1] = prompts[5][:32] + prompts[-1]  # shares 2 blocks of 16 with prompt 5
    max_tokens = [16, 12, 20, 8, 14, 10, 18, 9, 13]
    return Case(model_dir, prompts, max_tokens, hf_greedy(model_dir, prompts, max_tokens), 16, 11)


@pytest.fixture(scope="module", params=FAMILIES + ["default_model"])
def case(request, tmp_path_factory) -> Case:
    if request.param == "default_model":
        return default_model_case()
    model_dir = make_tiny_model_dir(request.param, tmp_path_factory.mktemp(request.param))
    prompts = make_prompts(512, seed=FAMILIES.index(request.param))
    return Case(model_dir, prompts, MAX_TOKENS, hf_greedy(model_dir, prompts, MAX_TOKENS), 4, 24)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def check_pool(llm: LLM) -> None:
    assert_all_blocks_free_or_cached(llm.engine.scheduler)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_greedy_matches_hf(case, scenario):
    llm = LLM(str(case.model_dir), **case.scenario(scenario))
    outs = llm.generate(case.prompts, [greedy(n) for n in case.max_tokens])
    assert [o.token_ids for o in outs] == case.expected
    scheduler = llm.engine.scheduler
    if scenario in ("swap", "recompute") and scheduler.sliding_window is None:
        # Mistral's sequences release the blocks outside their window (8 tokens) and
        # fit the tight pool without preemption; tests/unit/test_sliding_window_blocks.py
        # preempts windowed sequences on purpose.
        assert scheduler.num_preemptions_total > 0
    check_pool(llm)


# Always propose when any n-gram (down to one token) repeats: the most drafts to verify and roll back.
SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
               "adaptive": False}


@pytest.mark.parametrize("proposer", ["ngram", "draft", "oracle", "tree", "eagle"])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_greedy_matches_hf_with_speculation(case, scenario, proposer, tmp_path, monkeypatch):
    """Speculation changes how many tokens a step computes and which slots
    are rolled back, never the tokens. ``ngram`` is the real proposer (random
    prompts rarely repeat, the default model's texts do); ``draft`` a
    layer-truncated copy of the model (its first layer; the default model's
    first 6); ``medusa`` identity heads (each guesses the next token again);
    ``oracle`` proposes the expected continuation with every third proposal
    wrong, so every scenario verifies accepted and rejected drafts; ``tree``
    verifies three candidates at once as a tree, the expected one second, so
    accepted tokens are moved from their tree slots to their positions;
    ``eagle`` a random EAGLE-1 draft layer (Llama-family targets: not Gemma)."""
    config = SPECULATIVE
    if proposer == "eagle":
        arch = read_arch(case.model_dir)
        if arch.embed_scale != 1.0:
            pytest.skip("EAGLE drafts for Llama-family targets; Gemma scales its embeddings")
        torch.manual_seed(0)
        draft = EagleDraft(arch)
        for p in draft.parameters():
            p.data.normal_(0, 0.05)
        draft.save(tmp_path / "eagle")
        config = {"method": "eagle", "model": str(tmp_path / "eagle"), "num_speculative_tokens": 3,
                  "adaptive": False}
    if proposer == "medusa":
        arch = read_arch(case.model_dir)
        MedusaHeads(arch.hidden_size, arch.vocab_size, num_heads=3).save(tmp_path / "heads")
        config = {"method": "medusa", "model": str(tmp_path / "heads"), "num_speculative_tokens": 3,
                  "adaptive": False}
    if proposer == "draft":
        default = case.model_dir == resolve_model(None)
        if not default:  # tiny copies go to a temporary cache; the default model's stays cached
            monkeypatch.setenv("PREFIXSERVE_CACHE_DIR", str(tmp_path))
        config = {"method": "draft_model", "draft_num_layers": 6 if default else 1, "num_speculative_tokens": 3,
                  "adaptive": False}
    llm = LLM(str(case.model_dir), speculative_config=config, **case.scenario(scenario))
    if proposer == "oracle":
        continuations = {tuple(p): e for p, e in zip(case.prompts, case.expected)}
        llm.engine.scheduler.speculator = Speculator(SpeculativeConfig(**SPECULATIVE),
                                                     proposer=OracleProposer(continuations))
    if proposer == "tree":
        continuations = {tuple(p): e for p, e in zip(case.prompts, case.expected)}
        llm.engine.scheduler.speculator = Speculator(SpeculativeConfig(**SPECULATIVE, num_candidates=3),
                                                     proposer=TreeOracleProposer(continuations))
    outs = llm.generate(case.prompts, [greedy(n) for n in case.max_tokens])
    assert [o.token_ids for o in outs] == case.expected
    stats = llm.engine.scheduler.speculator.stats
    if proposer in ("oracle", "tree") or (proposer == "ngram" and case.model_dir == resolve_model(None)):
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats  # accepted and rejected drafts
    assert stats.num_draft_tokens > 0
    if proposer == "draft":
        draft = llm.engine.scheduler.speculator.proposer
        assert draft.num_free_blocks == draft.pool.num_blocks
    check_pool(llm)


def test_prefix_cache_hits_keep_outputs_exact(case):
    bs = case.block_size
    llm = LLM(str(case.model_dir), block_size=bs)
    params = [greedy(n) for n in case.max_tokens]
    first = llm.generate(case.prompts, params)
    assert [o.token_ids for o in first] == case.expected
    again = llm.generate(case.prompts, params)
    assert [o.token_ids for o in again] == case.expected
    for prompt, out in zip(case.prompts, again):
        # Every full prompt block is cached, but one token is always recomputed.
        assert out.num_cached_tokens == ((len(prompt) - 1) // bs) * bs
    assert any(o.num_cached_tokens > 0 for o in again)
    check_pool(llm)


def test_requests_arriving_while_others_decode(case):
    llm = LLM(str(case.model_dir), block_size=case.block_size, max_num_batched_tokens=32, max_num_seqs=8)
    reqs = [llm.make_request(p, greedy(n)) for p, n in zip(case.prompts, case.max_tokens)]
    got = {r.request_id: [] for r in reqs}
    for r in reqs[:4]:
        llm.engine.add_request(r)
    pending = reqs[4:]
    while llm.engine.has_unfinished_requests() or pending:
        for out in llm.engine.step():
            got[out.request_id] += out.new_token_ids
        if pending and llm.engine.num_steps % 3 == 0:
            llm.engine.add_request(pending.pop(0))
    assert [got[r.request_id] for r in reqs] == case.expected
    check_pool(llm)
