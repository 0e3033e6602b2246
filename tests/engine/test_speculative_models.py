"""Speculative decoding on real models: seeded sampling gives the very tokens
(and logprobs) it gives without speculation, unseeded sampling the same
distribution (chi-square over 10,000 draws per mode), proposals made and
rejected leave the KV pool intact, and the default model reads a quoted text
with few steps. Greedy parity with Hugging Face under speculation, in every
scheduling scenario, is in ``test_parity.py``."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from cluster.shared.config import SpeculativeConfig
from cluster.shared.types import SamplingParams
from tests.factories import OracleProposer, TreeOracleProposer, make_tiny_model_dir
from tests.unit.engine_fakes import assert_all_blocks_free_or_cached
from workers.engine.spec_decode import Speculator
from workers.llm import LLM

ALWAYS = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
          "adaptive": False}
TREE = {**ALWAYS, "num_candidates": 3}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model_dir("llama", tmp_path_factory.mktemp("tiny-spec"))


def repetitive_prompts(n: int) -> list[list[int]]:
    """Prompts whose n-grams repeat, so lookup proposes from the first step."""
    return [[10 + i, 20, 30 + i, 40, 10 + i, 20, 30 + i, 40, 10 + i, 20] for i in range(n)]


@pytest.mark.parametrize("knobs", [
    dict(temperature=1.0, top_p=0.9, top_k=50),
    dict(temperature=0.7, min_p=0.05, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2),
    dict(temperature=0.0, repetition_penalty=1.2),  # greedy with penalties: the sampler's slow path
], ids=["top_p_top_k", "min_p_penalties", "greedy_penalties"])
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_seeded_sampling_gives_the_same_tokens_and_logprobs(tiny_dir, knobs, shape):
    prompts = repetitive_prompts(6)
    params = [SamplingParams(max_tokens=24, seed=100 + i, logprobs=2, ignore_eos=True, **knobs) for i in range(6)]
    plain = LLM(str(tiny_dir), block_size=4).generate(prompts, params)
    config = ALWAYS if shape == "chain" else TREE
    spec = LLM(str(tiny_dir), block_size=4, speculative_config=config)
    # Sampled text rarely repeats: propose what the plain run drew, one token in three wrong
    # (a tree: the drawn continuation as its second candidate).
    make = OracleProposer if shape == "chain" else TreeOracleProposer
    oracle = make({tuple(p): o.token_ids for p, o in zip(prompts, plain)})
    spec.engine.scheduler.speculator = Speculator(SpeculativeConfig(**config), proposer=oracle)
    got = spec.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    for a, b in zip(got, plain):
        assert [(lp.token_id, lp.top_logprobs) for lp in a.logprobs] == [
            (lp.token_id, lp.top_logprobs) for lp in b.logprobs]
        assert [lp.logprob for lp in a.logprobs] == pytest.approx([lp.logprob for lp in b.logprobs], abs=1e-5)
    stats = spec.engine.scheduler.speculator.stats
    assert stats.num_accepted_tokens > 0 and stats.num_accepted_tokens < stats.num_draft_tokens
    assert_all_blocks_free_or_cached(spec.engine.scheduler)


class FixedProposer:
    """Proposes the same tokens at every step (the target's likeliest ones)."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def propose(self, request_id: str, token_ids: list[int], k: int) -> list[int]:
        return self.tokens[:k]

    def drop(self, request_id: str) -> None:
        pass


class FixedTreeProposer(FixedProposer):
    """The same tree at every step: the first token changed, then the given
    tokens; the given tokens; the first given token, then the second changed."""

    def propose_candidates(self, request_id: str, token_ids: list[int], k: int, m: int) -> list[list[int]]:
        t = self.tokens[:k]
        candidates = [[(t[0] + 1) % 64 + 3, *t[1:]], t]
        if len(t) > 1:
            candidates.append([t[0], (t[1] + 1) % 64 + 3, *t[2:]])
        return candidates[:m]


def chi_square_p_value(a: Counter, b: Counter) -> tuple[float, int]:
    """Two-sample chi-square (equal sample sizes) over categories with at
    least 10 draws in all; rare ones pooled. Wilson-Hilferty p-value."""
    keys = sorted(set(a) | set(b))
    common = [k for k in keys if a[k] + b[k] >= 10]
    pooled = (sum(a[k] for k in keys if k not in common), sum(b[k] for k in keys if k not in common))
    pairs = [(a[k], b[k]) for k in common] + ([pooled] if sum(pooled) else [])
    stat = sum((x - y) ** 2 / (x + y) for x, y in pairs)
    df = len(pairs) - 1
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2)), df


def test_unseeded_sampling_keeps_the_target_distribution(tiny_dir):
    """10,000 draws of three tokens per mode; from the second token on each is
    sampled by verification of proposed tokens (accepted or resampled)."""
    draws = 10_000
    prompt = [5, 17, 33, 9, 61, 12, 40, 8]
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=4, ignore_eos=True)
    llm = LLM(str(tiny_dir), block_size=4, max_num_seqs=256, max_num_batched_tokens=2048)
    greedy = llm.generate(prompt, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))[0].token_ids
    results = {}
    for mode in ("off", "on", "tree"):
        speculator = None
        if mode == "on":
            speculator = Speculator(SpeculativeConfig(**ALWAYS), proposer=FixedProposer(greedy[1:]))
        elif mode == "tree":
            speculator = Speculator(SpeculativeConfig(**TREE), proposer=FixedTreeProposer(greedy[1:]))
        llm.engine.scheduler.speculator = speculator
        outs = llm.generate([prompt] * draws, params)
        results[mode] = [tuple(o.token_ids) for o in outs]
        if mode == "tree":
            assert speculator.branch_rate > 0.05  # the samples took the other branches too
        if mode != "off":
            stats = speculator.stats
            assert stats.num_draft_tokens >= draws and 0.1 < stats.acceptance_rate < 0.9  # both outcomes common
    for mode in ("on", "tree"):
        for position in (1, 2):  # the tokens verification chose
            off = Counter(t[position] for t in results["off"])
            on = Counter(t[position] for t in results[mode])
            p, df = chi_square_p_value(off, on)
            assert df >= 3 and p > 1e-3, (mode, position, p, off.most_common(6), on.most_common(6))
        joint_p, _ = chi_square_p_value(Counter(results["off"]), Counter(results[mode]))
        assert joint_p > 1e-3, mode
    # The test can fail: a verifier that always accepted would put every draw on the proposals.
    skewed = Counter([tuple([t[0], *greedy[1:]]) for t in results["on"][: draws // 2]] + results["on"][draws // 2 :])
    assert chi_square_p_value(Counter(results["off"]), skewed)[0] < 1e-6
    llm.engine.scheduler.speculator = None
    assert_all_blocks_free_or_cached(llm.engine.scheduler)


@pytest.mark.parametrize("config", [ALWAYS, TREE], ids=["chain", "tree"])
def test_aborts_and_stops_inside_drafts_leave_the_pool_intact(tiny_dir, config):
    llm = LLM(str(tiny_dir), block_size=4, num_kv_blocks=40, preemption_mode="recompute",
              speculative_config=config)
    prompts = repetitive_prompts(8)
    plain = LLM(str(tiny_dir), block_size=4).generate(
        prompts, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    stop_at = plain[0].token_ids[7]
    engine = llm.engine
    reqs = [llm.make_request(p, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True,
                                               stop_token_ids=[stop_at] if i == 0 else []))
            for i, p in enumerate(prompts)]
    for r in reqs:
        engine.add_request(r)
    got = {r.request_id: [] for r in reqs}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id].extend(out.new_token_ids)
        steps += 1
        if steps == 4:
            engine.abort_request(reqs[5].request_id)
        engine.scheduler.check_integrity()
    first = plain[0].token_ids
    assert got[reqs[0].request_id] == first[: first.index(stop_at) + 1]  # stopped inside accepted drafts or not
    for i in (1, 2, 3, 4, 6, 7):
        assert got[reqs[i].request_id] == plain[i].token_ids
    assert engine.scheduler.num_preemptions_total > 0
    assert engine.scheduler.speculator.stats.num_accepted_tokens > 0
    assert_all_blocks_free_or_cached(engine.scheduler)


def test_default_model_quotes_a_text_in_fewer_steps():
    from cluster.bench.spec import grounded_prompts

    llm = LLM(block_size=16, max_model_len=1024)
    prompts = grounded_prompts(llm, 2, 160)
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    before = llm.engine.num_steps
    plain = llm.generate(prompts, params)
    plain_steps = llm.engine.num_steps - before
    llm.engine.scheduler.speculator = Speculator(SpeculativeConfig(num_speculative_tokens=4))
    before = llm.engine.num_steps
    spec = llm.generate(prompts, params)
    spec_steps = llm.engine.num_steps - before
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    stats = llm.engine.scheduler.speculator.stats
    assert stats.acceptance_rate > 0.5, stats
    assert spec_steps < 0.6 * plain_steps, (spec_steps, plain_steps)
    assert_all_blocks_free_or_cached(llm.engine.scheduler)


@pytest.mark.parametrize("draft", ["itself", "one_layer", "other_model"])
def test_draft_model_proposals_keep_tokens_and_free_their_cache(tiny_dir, tmp_path, monkeypatch, draft):
    """The target as its own draft (all accepted), its first layer (some),
    another random model (almost none): tokens never change, greedy or seeded,
    and the draft's own KV pool is empty once the requests end."""
    monkeypatch.setenv("PREFIXSERVE_CACHE_DIR", str(tmp_path / "cache"))  # the truncated copy goes there
    config = {"method": "draft_model", "num_speculative_tokens": 3, "adaptive": False}
    if draft == "itself":
        config["model"] = str(tiny_dir)
    elif draft == "one_layer":
        config["draft_num_layers"] = 1
    else:
        config["model"] = str(make_tiny_model_dir("llama", tmp_path / "other", seed=5, num_hidden_layers=1))
    prompts = repetitive_prompts(5) + [[7, 99, 3, 250, 41, 77]]
    params = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)] * 3 + [
        SamplingParams(max_tokens=20, temperature=0.8, top_k=20, seed=i, ignore_eos=True) for i in range(3)]
    plain = LLM(str(tiny_dir), block_size=4).generate(prompts, params)
    spec = LLM(str(tiny_dir), block_size=4, num_kv_blocks=64, speculative_config=config)
    got = spec.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    speculator = spec.engine.scheduler.speculator
    stats = speculator.stats
    assert stats.num_draft_tokens > 0
    proposer = speculator.proposer
    if draft == "itself":  # greedy requests accept every guess of the model itself
        spec.engine.scheduler.speculator = Speculator(SpeculativeConfig(**config), proposer=proposer)
        again = spec.generate(prompts[:3], params[:3])
        assert [o.token_ids for o in again] == [o.token_ids for o in plain[:3]]
        stats = spec.engine.scheduler.speculator.stats
        assert 0 < stats.num_accepted_tokens == stats.num_draft_tokens
    assert proposer.num_free_blocks == proposer.pool.num_blocks  # every request's draft blocks returned
    assert_all_blocks_free_or_cached(spec.engine.scheduler)


def test_draft_model_config_errors_name_the_fix(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("PREFIXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    other = make_tiny_model_dir("llama", tmp_path / "wide", vocab_size=600)
    with pytest.raises(ValueError, match="must share the target's tokenizer"):
        LLM(str(tiny_dir), speculative_config={"method": "draft_model", "model": str(other)})
    with pytest.raises(ValueError, match="draft_num_layers must be below the model's 2 layers"):
        LLM(str(tiny_dir), speculative_config={"method": "draft_model", "draft_num_layers": 2})


@pytest.mark.parametrize("heads", ["identity", "random", "random_token_conditioned"])
def test_medusa_heads_keep_tokens(tiny_dir, tmp_path, heads):
    """Identity heads (zero blocks: each guesses the next token again) and
    random ones: proposals are made every step and the tokens never change."""
    from workers.model.medusa import MedusaHeads

    medusa = MedusaHeads(64, 512, num_heads=3, num_layers=1, token_conditioned=heads.endswith("conditioned"))
    if heads.startswith("random"):
        torch.manual_seed(3)
        for p in medusa.parameters():
            p.data.normal_(0, 0.2)
    medusa.save(tmp_path / "heads")
    config = {"method": "medusa", "model": str(tmp_path / "heads"), "num_speculative_tokens": 3, "adaptive": False}
    prompts = repetitive_prompts(4) + [[7, 99, 3, 250, 41, 77]]
    params = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)] * 3 + [
        SamplingParams(max_tokens=20, temperature=0.8, top_k=20, seed=i, ignore_eos=True) for i in range(2)]
    plain = LLM(str(tiny_dir), block_size=4).generate(prompts, params)
    spec = LLM(str(tiny_dir), block_size=4, speculative_config=config)
    got = spec.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    stats = spec.engine.scheduler.speculator.stats
    assert stats.num_drafts >= 10 and stats.num_draft_tokens > 0
    assert_all_blocks_free_or_cached(spec.engine.scheduler)


def test_train_heads_on_a_tiny_model(tiny_dir, tmp_path):
    from workers.medusa_train import train_heads
    from workers.model.medusa import MedusaHeads

    llm = LLM(str(tiny_dir), block_size=4, max_model_len=256)
    summary = train_heads(llm, tmp_path / "heads", num_heads=2, num_prompts=12, prompt_len=16, gen_len=24,
                          epochs=3, lr=3e-3)
    assert summary["num_sequences"] == 12 and summary["num_positions"] >= 12 * 20
    assert len(summary["held_out_top1_accuracy"]) == 2
    heads = MedusaHeads.load(tmp_path / "heads", 64, 512)
    assert heads.token_conditioned  # the default: the heads read the sampled token too
    assert any(float(w.abs().sum()) > 0 for w in heads.weights)  # trained away from the zero start
    spec = LLM(str(tiny_dir), block_size=4, speculative_config={"method": "medusa", "model": str(tmp_path / "heads")})
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    assert spec.generate(repetitive_prompts(2), params)[0].token_ids == llm.generate(
        repetitive_prompts(2), params)[0].token_ids


def test_trees_are_refused_at_load_when_the_backend_cannot_verify_them(tiny_dir, monkeypatch):
    # The config cannot always know which backend "auto" picks (a GPU machine):
    # loading checks the backend it built.
    from workers.model.attention.torch_backend import TorchAttentionBackend

    monkeypatch.setattr(TorchAttentionBackend, "name", "flash_attn")  # what auto picks on a GPU with flash-attn
    with pytest.raises(ValueError, match="num_candidates > 1 .* needs the torch attention backend"):
        LLM(str(tiny_dir), block_size=4, speculative_config=TREE)
    LLM(str(tiny_dir), block_size=4, speculative_config=ALWAYS)  # a chain verifies on any backend


def test_token_conditioned_heads_read_each_request_last_sampled_token(tiny_dir, tmp_path):
    # The runner hands the heads, with each row, the token that row sampled:
    # after every step, the token the heads saw is the request's last output
    # token so far (a chain step or a verified step alike).
    from workers.model.medusa import MedusaHeads

    MedusaHeads(64, 512, num_heads=3, num_layers=1, token_conditioned=True).save(tmp_path / "heads")
    config = {"method": "medusa", "model": str(tmp_path / "heads"), "num_speculative_tokens": 3, "adaptive": False}
    llm = LLM(str(tiny_dir), block_size=4, speculative_config=config)
    heads = llm.runner.medusa
    seen: list[list[int]] = []
    propose = heads.propose_candidates
    heads.propose_candidates = lambda hidden, k, m, lm_head, tokens=None: (
        seen.append(tokens.tolist()), propose(hidden, k, m, lm_head, tokens))[1]
    engine = llm.engine
    for i, prompt in enumerate(repetitive_prompts(2)):
        engine.add_request(llm.make_request(prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)))
    outputs: dict[str, list[int]] = {}
    checked = 0
    while engine.has_unfinished_requests():
        seen.clear()
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        running = [ids for rid, ids in outputs.items() if len(ids) < 24]
        if seen and len(running) == 2:  # both asked (adaptive off): one token each, in batch order
            assert sorted(seen[0]) == sorted(ids[-1] for ids in running)
            checked += 1
    assert checked >= 3 and engine.scheduler.speculator.stats.num_drafts >= 3


def test_bench_spec_decodes_groups_one_after_another(tiny_dir):
    # bench spec's batch-1 chat and grounded cases decode several prompts one
    # group after another and count them together (cluster/bench/spec.py).
    from cluster.bench.spec import decode_run

    llm = LLM(str(tiny_dir), block_size=4)
    prompts = repetitive_prompts(4)
    together = decode_run(llm, prompts, 8)
    oracle = OracleProposer({tuple(p): out for p, out in zip(prompts, together["outputs"])})
    llm.engine.scheduler.speculator = Speculator(SpeculativeConfig(num_speculative_tokens=3, adaptive=False), oracle)
    grouped = decode_run(llm, prompts, 8, group_size=1)
    assert grouped["outputs"] == together["outputs"] and len(grouped["outputs"]) == 4
    assert grouped["steps"] > together["steps"] and grouped["draft_tokens"] > 0  # every group counted
    assert grouped["acceptance_rate"] == grouped["accepted_tokens"] / grouped["draft_tokens"]
    assert sum(len(o) for o in grouped["outputs"]) == 4 * 8
