"""Speculative decoding's engine-side parts: n-gram lookup, the step-cost fit,
how many tokens are proposed, the config, and the scheduler's bookkeeping of
proposed, accepted and rejected tokens (with the fake runner)."""

from __future__ import annotations

import random

import pytest

from cluster.cli.flags import engine_kwargs
from cluster.cli.main import build_parser
from cluster.shared.config import EngineConfig, SpeculativeConfig
from tests.unit.engine_fakes import (
    FakeRunner,
    assert_all_blocks_free_or_cached,
    echo_token,
    expected_output,
    fixed_speculator,
    make_request,
    make_scheduler,
    run_to_completion,
    step,
)
from workers.engine.proposers import NgramProposer, RunnerProposer
from workers.engine.spec_cost import StepCostModel
from workers.engine.spec_decode import Speculator


def brute_force_lookup(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # latest earlier occurrence
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_ngram_prefers_the_longest_match_and_the_latest_occurrence():
    p = NgramProposer(1, 3)
    #            0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 9, 6, 7, 1, 2, 6, 7]
    # "6 7" occurs at 1 and 5; the trigram "2 6 7" nowhere: the bigram's latest occurrence wins.
    assert p.propose("a", tokens, 2) == [1, 2]
    tokens += [8]  # now "6 7 8" (trigram) occurs at 1..3: it beats the bigram "7 8"
    assert p.propose("a", tokens, 3) == [9, 6, 7]
    assert p.propose("b", [1, 2, 3], 4) == []  # nothing repeats
    assert p.propose("c", [4, 4], 0) == []


def test_ngram_incremental_index_equals_a_full_search():
    rng = random.Random(0)
    p = NgramProposer(2, 4)
    tokens = [rng.randrange(6) for _ in range(10)]
    for _ in range(300):
        assert p.propose("r", tokens, 3) == brute_force_lookup(tokens, 3, 2, 4)
        tokens.extend(rng.randrange(6) for _ in range(rng.randrange(1, 4)))
    p.drop("r")
    assert "r" not in p._index


def test_cost_model_separates_draft_tokens_and_keeps_priors_where_steps_did_not_vary():
    cost = StepCostModel()
    assert cost.fit() is None
    for _ in range(5):
        cost.observe(8, 0, 0.1)
    base, a, b = cost.fit()  # one size, no drafts: the step is the base, a draft costs 2% of it
    assert base + 8 * a == pytest.approx(0.1, rel=1e-3) and b == pytest.approx(0.002, rel=1e-3)
    measured = StepCostModel()
    rng = random.Random(0)
    for _ in range(60):  # prefills and decodes of any size, with and without drafts
        x1, x2 = rng.choice([1, 8, 32, 200]), rng.choice([0, 0, 4, 16, 32])
        measured.observe(x1, x2, 0.02 + 0.0015 * x1 + 0.0025 * x2)
    assert measured.fit() == pytest.approx((0.02, 0.0015, 0.0025), rel=0.02)
    # A window: old steps leave the sums (the machine got twice as slow).
    windowed, fresh = StepCostModel(window=32), StepCostModel(window=32)
    for i in range(100):
        x1, x2 = rng.choice([1, 8, 32, 200]), rng.choice([0, 4, 16])
        y = (0.02 + 0.0015 * x1 + 0.0025 * x2) * (2 if i >= 68 else 1)
        windowed.observe(x1, x2, y)
        if i >= 68:
            fresh.observe(x1, x2, y)
    assert windowed.num_steps == 32 and windowed.fit() == pytest.approx(fresh.fit(), rel=1e-6)
    assert windowed.fit() == pytest.approx((0.04, 0.003, 0.005), rel=0.02)


def test_three_uneven_first_steps_do_not_make_drafts_free():
    """EAGLE at batch 8, as measured: a prefill with the runner's first
    guesses, the other prefills with more, one decode. The unfloored fit put
    the drafts' cost on the tokens and solved b to zero, so the next step asked
    every sequence for its longest draft."""
    cost = StepCostModel()
    for step in [(39, 4, 0.0543), (155, 27, 0.137), (8, 0, 0.0158)]:
        cost.observe(*step)
    base, a, b = cost.fit()
    assert b >= 0.005 * (0.0543 + 0.137 + 0.0158) / 3
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=4), RunnerProposer())
    for step in [(39, 4, 1, 0.0543, 4), (155, 27, 8, 0.137, 24), (8, 0, 8, 0.0158, 0)]:
        spec.observe_step(*step[:4], num_guesses=step[4])
    spec.observe_result("r", 3, 0)  # its one draft: nothing accepted
    assert spec._threshold() is not None and spec.runner_proposals_wanted("r") == 0


def speculator(adaptive: bool = True) -> Speculator:
    return Speculator(SpeculativeConfig(num_speculative_tokens=4, adaptive=adaptive))


def test_a_runner_proposers_draft_is_priced_with_the_guess_it_was():
    # Medusa heads guess a step before their guesses are verified: a draft
    # costs its guess (in that earlier step) and its row, both units of the
    # cost model. With a guess per draft its threshold is twice an n-gram
    # draft's, on the same steps, and a draft that pays for n-gram
    # lookup (acceptance ~0.4 against ~0.27) does not pay for the heads (~0.53).
    from workers.engine.proposers import RunnerProposer

    ngram = speculator()
    heads = Speculator(SpeculativeConfig(method="medusa", model="h", num_speculative_tokens=4),
                       proposer=RunnerProposer())
    for _ in range(30):  # batch 8, 24 ms, a unit (guess or draft) 0.8 ms
        for s, guesses in ((ngram, 0), (heads, 4)):
            s.observe_step(8, 0, 8, 0.024)
            s.observe_step(8, 4 + guesses, 8, 0.024 + 0.0008 * (4 + guesses), num_guesses=guesses)
    assert heads._threshold() == pytest.approx(2 * ngram._threshold(), rel=0.05)
    assert ngram._threshold() == pytest.approx(0.0008 * 8 / 0.024, rel=0.05)
    for s in (ngram, heads):
        for i in range(30):
            s.observe_result("r", 1, int(i % 5 in (0, 2)))  # 2 of 5 accepted
        assert 0.3 < s.acceptance("r") < 0.5
    assert ngram.depth_limit("r") >= 1 and heads.depth_limit("r") == 0


def test_depth_follows_acceptance_and_step_cost():
    s = speculator()
    assert s.depth_limit("r") == 4  # nothing measured yet: try
    for _ in range(20):  # memory-bound steps: a draft token costs 3% of a step
        s.observe_step(1, 0, 1, 0.030)
        s.observe_step(1, 4, 1, 0.0336)
    s.observe_step(1, 0, 1, 0.030)
    for _ in range(20):
        s.observe_result("good", 4, 4)
        s.observe_result("bad", 4, 0)
    assert s.depth_limit("good") == 4
    assert s.depth_limit("bad") == 0  # its drafts are always rejected: propose none
    assert 0.9 < s.acceptance("good") <= 1.0 and s.acceptance("bad") < 0.03
    # Compute-bound steps (a draft costs what a sequence's token does): 75% acceptance does not pay.
    t = speculator()
    for drafts in (0, 8, 16, 24, 32, 0):
        t.observe_step(8, drafts, 8, 0.004 * (8 + drafts))
    for _ in range(10):
        t.observe_result("r", 4, 3)
    assert t.depth_limit("r") == 0
    assert speculator(adaptive=False).depth_limit("bad") == 4
    s.drop("good")
    # Forgotten: back to the prior, the rate over all requests' draft positions (good: 80 of 80,
    # bad: 0 of 20).
    assert s.acceptance("good") == pytest.approx(s.acceptance("new")) and 0.7 < s.acceptance("new") < 0.85
    u = speculator()
    for _ in range(40):
        u.observe_result("old", 4, 0)  # this proposer fails on this traffic
    assert u.acceptance("new") < 0.1


def test_stats_count_per_position():
    s = speculator()
    s.observe_result("r", 4, 2)
    s.observe_result("r", 3, 3)
    s.observe_result("r", 0, 0)  # proposed nothing: not a draft
    assert s.stats.num_drafts == 2 and s.stats.num_draft_tokens == 7 and s.stats.num_accepted_tokens == 5
    assert s.stats.proposed_per_position == [2, 2, 2, 1]
    assert s.stats.accepted_per_position == [2, 2, 1, 0]
    assert s.stats.mean_acceptance_length == pytest.approx(3.5)


def test_tree_stats_count_depths_and_learn_from_the_positions_reached():
    from workers.engine.spec_trees import accepted_path, tree_depth

    # fed -> 5 -> 6 -> 7 and fed -> 8: four tokens, three deep; the samples take 8, a leaf.
    drafts, parents = [5, 6, 7, 8], [-1, 0, 1, -1]
    path, reached, branches = accepted_path(drafts, parents, [8, 2])
    assert (path, reached, branches, tree_depth(parents, 4), tree_depth([], 4)) == ([3], 1, (1, 1), 3, 4)
    s = speculator()
    s.observe_result("r", tree_depth(parents, 4), len(path), 4, branches, reached=reached)
    assert s.stats.num_draft_tokens == 4 and s.stats.num_accepted_tokens == 1
    assert s.stats.proposed_per_position == [1, 1, 1, 0] and s.stats.accepted_per_position == [1, 0, 0, 0]
    assert (s.stats.num_branch_trials, s.stats.num_branch_hits) == (1, 1)
    # A leaf ended the walk: every position the samples could reach was accepted (no failed trial).
    t = speculator()
    t.observe_result("r", 3, 1, 4, branches, reached=1)
    t.observe_result("q", 3, 1)  # a chain of 3 with 1 accepted: one failed trial
    assert t.acceptance("r") > t.acceptance("q")


@pytest.mark.parametrize("value, match", [
    ({"method": "mlp_speculator", "model": "x"}, "not supported yet"),
    ({"method": "eagle"}, "needs model: the EAGLE draft's folder"),
    ({"method": "eagle3"}, "'eagle3' needs model: .* train-heads --method eagle3"),
    ({"method": "eagle3", "model": "e", "__tp": 2}, "'eagle3' runs with tensor_parallel_size 1"),
    ({"method": "eagle", "model": "e", "__tp": 2}, "'eagle' runs with tensor_parallel_size 1"),
    ({"method": "medusa"}, "needs model: the heads' folder"),
    ({"method": "medusa", "model": "h", "__tp": 2}, "runs with tensor_parallel_size 1"),
    ({"method": "draft_model"}, "needs model .* or draft_num_layers"),
    ({"method": "ngram", "draft_num_layers": 4}, "are for method 'draft_model'"),
    ({"method": "draft_model", "draft_num_layers": 0}, "draft_num_layers must be >= 1"),
    ({"method": "lookahead"}, "must be one of"),
    ({"method": "ngram", "num_speculative_token": 3}, "did you mean 'num_speculative_tokens'"),
    ({"num_speculative_tokens": 0}, "1..16"),
    ({"num_candidates": 0}, "num_candidates must be in 1..8"),
    ({"method": "draft_model", "draft_num_layers": 2, "num_candidates": 2}, "'draft_model' proposes one chain"),
    ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min <= prompt_lookup_max"),
    ("{not json", "not valid JSON"),
    ([1, 2], "must be a mapping"),
])
def test_bad_speculative_config_says_what_to_change(value, match):
    tp = value.pop("__tp", 1) if isinstance(value, dict) else 1
    with pytest.raises(ValueError, match=match):
        EngineConfig.from_kwargs(speculative_config=value, tensor_parallel_size=tp)


def test_speculative_config_from_the_cli_and_as_json():
    args = build_parser().parse_args(["generate", "hi", "--speculative-config",
                                      '{"method": "ngram", "num_speculative_tokens": 2}'])
    config = EngineConfig.from_kwargs(**engine_kwargs(args))
    assert config.speculative == SpeculativeConfig(num_speculative_tokens=2)
    assert config.speculative_config["prompt_lookup_max"] == 4  # stored whole
    assert EngineConfig.from_kwargs(**config.flat()) == config
    assert EngineConfig().speculative is None


def test_drafts_respect_max_tokens_max_model_len_and_budget():
    sched = make_scheduler(32, 0, max_num_batched_tokens=16, max_model_len=40, speculator=fixed_speculator(8))
    runner = FakeRunner.for_scheduler(sched, echo_token)
    sched.add_request(make_request("a", [1, 2, 3, 1, 2, 3, 1, 2], max_tokens=5))
    seen = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        for req in out.scheduled:  # (output_token_ids is a live view: read it before the update)
            seen.append(len(req.spec_token_ids))
            assert len(req.output_token_ids) + 1 + len(req.spec_token_ids) <= 5  # never past max_tokens
        sched.update_from_output(out, runner.execute(out))
        sched.check_integrity()
    assert max(seen) > 0
    sched2 = make_scheduler(32, 0, max_num_batched_tokens=16, max_model_len=12, speculator=fixed_speculator(8))
    runner2 = FakeRunner.for_scheduler(sched2, echo_token)
    sched2.add_request(make_request("b", [1, 2, 3, 1, 2, 3, 1, 2], max_tokens=20))
    done = run_to_completion(sched2, runner2)
    assert done["b"].num_tokens == 12  # stopped at max_model_len, drafts never past it
    assert done["b"].output_token_ids == expected_output([1, 2, 3, 1, 2, 3, 1, 2], 4, echo_token)


def test_rejected_drafts_give_their_blocks_back():
    sched = make_scheduler(16, 0, speculator=fixed_speculator(6))
    runner = FakeRunner.for_scheduler(sched, echo_token)
    prompt = [9, 8, 7, 6, 5, 9, 8, 7, 6, 5, 9]
    sched.add_request(make_request("a", prompt, max_tokens=12))
    trimmed = False
    while sched.has_unfinished_requests():
        out, results = step(sched, runner)
        for seq, new_ids, _ in results:
            if not seq.is_finished:  # blocks held: no more than its tokens need
                kv = sched.kv_manager
                assert kv.num_blocks_for(seq.num_computed_tokens) <= len(seq.block_ids) <= kv.num_blocks_for(
                    seq.num_tokens)
                drafted = out.scheduled[0].spec_token_ids
                trimmed |= bool(drafted) and len(new_ids) < len(drafted) + 1
    assert trimmed  # some step rejected a draft
    stats = sched.speculator.stats
    assert stats.num_accepted_tokens > 0
    assert_all_blocks_free_or_cached(sched)


def test_cluster_config_carries_speculative_config():
    from cluster.shared.config import ClusterConfig
    from cluster.shared.config.loading import build_strict

    config = build_strict(ClusterConfig, {"engine": {"speculative_config": {"num_speculative_tokens": 2}}})
    assert config.engine.speculative == SpeculativeConfig(num_speculative_tokens=2)
    with pytest.raises(ValueError, match="engine: speculative_config method 'mlp_speculator' is not supported yet"):
        build_strict(ClusterConfig, {"engine": {"speculative_config": {"method": "mlp_speculator"}}})


def test_drafts_never_take_a_later_decode_s_token():
    """A budget of 8 and four decoding sequences: every one decodes each step,
    drafts take only what is left."""
    sched = make_scheduler(64, 0, max_num_batched_tokens=8, max_num_seqs=4, speculator=fixed_speculator(6))
    runner = FakeRunner.for_scheduler(sched, echo_token)
    for i in range(4):
        sched.add_request(make_request(f"r{i}", [5 + i, 6], max_tokens=16))  # all admitted at once
    drafted = 0
    while sched.has_unfinished_requests():
        decoding = {s.request_id for s in sched.queue.running if s.num_uncomputed_tokens == 1}
        out = sched.schedule()
        assert decoding <= {r.request_id for r in out.scheduled}  # no decode crowded out by another's drafts
        assert out.num_batched_tokens <= 8
        drafted += sum(len(r.spec_token_ids) for r in out.scheduled)
        sched.update_from_output(out, runner.execute(out))
        sched.check_integrity()
    assert drafted > 0
    assert_all_blocks_free_or_cached(sched)


def test_a_request_that_stopped_drafting_probes_and_resumes_when_drafts_pay_again():
    # A request whose drafts all failed proposes nothing; without probes nothing would measure it
    # again. It drafts one token each PROBE_EVERY tokens; once those are accepted it drafts again.
    s = speculator()
    for _ in range(20):  # memory-bound steps: a draft token costs 3% of a step
        s.observe_step(1, 0, 1, 0.030)
        s.observe_step(1, 4, 1, 0.0336)
    for _ in range(20):
        s.observe_result("r", 4, 0)
    every = Speculator.PROBE_EVERY
    assert s.depth_limit("r") == 0
    lengths = range(100, 100 + 4 * every)
    probes = [n for n in lengths if s.depth_limit("r", n) > 0]
    assert probes == [n for n in lengths if n % every == 0] and len(probes) == 4
    assert all(s.depth_limit("r", n) == 1 for n in probes)
    drafts = s.propose_batch([("r", [7] * (every - 1), 4), ("r", [7] * every, 4)])
    assert [len(d[0]) for d in drafts] == [0, 1]  # the probe's one token, from the n-gram match
    resumed = None
    for i in range(1, 12):  # the text turned predictable: each probe's draft is accepted
        s.observe_result("r", 1, 1)
        if s.depth_limit("r") > 0:
            resumed = i
            break
    assert resumed is not None and resumed <= 3
    assert speculator(adaptive=False).depth_limit("r", every) == 4  # not adaptive: always the most
