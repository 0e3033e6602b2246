"""Speculation trees (SpecInfer) on the engine side: the accepted path, how
candidates merge into a tree, adaptive trees, n-gram candidates, and tree
verification's KV moves with the fake runner."""

from __future__ import annotations

import pytest

from cluster.shared.config import EngineConfig, SpeculativeConfig
from tests.unit.engine_fakes import (
    FakeRunner,
    assert_all_blocks_free_or_cached,
    expected_output,
    make_request,
    make_scheduler,
    next_token,
    run_to_completion,
)
from workers.engine.proposers import NgramProposer
from workers.engine.spec_decode import Speculator


class ModelTreeProposer:
    """Tree candidates for the fake model: a wrong first token then the right
    continuation, the right continuation, and one wrong at its second token;
    the samples walk the second candidate's branch, whose tokens sit away
    from their positions (so they are moved)."""

    def __init__(self, model) -> None:
        self.model = model

    def propose_candidates(self, request_id, token_ids, k, m):
        right, tokens = [], list(token_ids)
        for _ in range(k):
            right.append(self.model(tokens))
            tokens.append(right[-1])
        wrong_first = [(right[0] + 1) % 97, *right[1:]]
        candidates = [wrong_first, right] + ([[right[0], (right[1] + 1) % 97, *right[2:]]] if k > 1 else [])
        return candidates[:m]

    def propose(self, request_id, token_ids, k):
        return self.propose_candidates(request_id, token_ids, k, 1)[0]

    def drop(self, request_id):
        pass


def tree_speculator(model, k: int = 3, adaptive: bool = False) -> Speculator:
    config = SpeculativeConfig(num_speculative_tokens=k, num_candidates=3, adaptive=adaptive)
    return Speculator(config, proposer=ModelTreeProposer(model))


def test_accepted_path_walks_the_samples_through_the_tree():
    from workers.engine.spec_trees import accepted_path

    #            fed -> 5 -> 6 -> 7        indices 0 1 2
    #                \-> 8 -> 9            indices 3 4
    #                    \-> 6             index 5
    drafts, parents = [5, 6, 7, 8, 9, 6], [-1, 0, 1, -1, 3, 3]
    assert accepted_path(drafts, parents, [5, 6, 7, 1]) == ([0, 1, 2], 3, (0, 0))  # a leaf: nothing more to reach
    assert accepted_path(drafts, parents, [8, 6, 2]) == ([3, 5], 2, (2, 2))  # second branches, twice
    assert accepted_path(drafts, parents, [8, 9, 4]) == ([3, 4], 2, (1, 1))
    assert accepted_path(drafts, parents, [3]) == ([], 1, (1, 0))  # rejected at the root: a branch missed
    assert accepted_path([5, 6], [], [5, 2]) == ([0], 2, (0, 0))  # a chain


def test_build_tree_merges_candidates_depth_first_first_candidate_first():
    s = Speculator(SpeculativeConfig(num_speculative_tokens=4, num_candidates=3, adaptive=False),
                   proposer=NgramProposer(1, 3))
    tokens, parents = s.build_tree("r", [[1, 2, 3], [4, 5, 6], [1, 7, 3], [1, 2, 3]], 3, 16)
    assert tokens == [1, 2, 3, 7, 3, 4, 5, 6]
    assert parents == [-1, 0, 1, 0, 3, -1, 5, 6]
    assert s.build_tree("r", [[1, 2, 3], [4, 5, 6]], 3, 4) == ([1, 2, 3, 4], [-1, 0, 1, -1])  # room: 4 tokens
    assert s.build_tree("r", [[1, 2, 3], [1, 2]], 3, 16) == ([1, 2, 3], [])  # one chain: no parents
    assert s.build_tree("r", [[1, 2, 3, 4]], 2, 16) == ([1, 2], [])  # depth


def test_adaptive_trees_keep_other_candidates_only_while_they_pay():
    s = Speculator(SpeculativeConfig(num_speculative_tokens=4, num_candidates=3), proposer=NgramProposer(1, 3))
    for _ in range(50):  # a memory-bound step: drafts are cheap
        s.observe_step(1, 0, 1, 0.030)
        s.observe_step(1, 4, 1, 0.031)
    for _ in range(20):  # the first candidate is right half the time
        s.observe_result("r", 2, 1)
    cands = [[1, 2, 3], [4, 5, 6]]
    s._branch = (0.9, 1.0)  # another candidate is often right where the first is not
    wide = s.build_tree("r", cands, 3, 16)[0]
    s._branch = (0.001, 1.0)  # never
    narrow = s.build_tree("r", cands, 3, 16)[0]
    assert narrow == [1, 2, 3] and wide[:4] == [1, 2, 3, 4]


def test_ngram_candidates_are_distinct_continuations_latest_first():
    p = NgramProposer(1, 2)
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 1, 5, 6, 2, 5, 6, 3, 9, 5, 6]
    assert p.propose_candidates("r", tokens, 2, 3) == [[3, 9], [2, 5], [1, 5]]
    assert p.propose("r", tokens, 2) == [3, 9]
    assert p.propose_candidates("r", tokens, 1, 8) == [[3], [2], [1]]
    q = NgramProposer(1, 2)
    #          0  1  2  3  4  5  6  7  8  9
    other = [5, 6, 1, 5, 6, 2, 7, 6, 4, 5, 6]
    assert q.propose_candidates("r", other, 1, 8) == [[2], [1], [4]]  # the 2-gram's, then the 1-gram's


@pytest.mark.parametrize("preemption_mode,num_blocks", [("swap", 24), ("recompute", 24), ("swap", 200)])
def test_tree_verification_keeps_outputs_and_moves_accepted_kv(preemption_mode, num_blocks):
    """Outputs equal an unpressured run's with trees whose accepted branch is
    never the first: the fake runner checks every cached position holds its
    own token (moved KV included) before each step."""
    sched = make_scheduler(num_blocks, 16, preemption_mode=preemption_mode, speculator=tree_speculator(next_token))
    runner = FakeRunner.for_scheduler(sched)
    prompts = {f"r{i}": [7 + i, 3, 9, 7 + i, 3] * 2 for i in range(6)}
    for rid, prompt in prompts.items():
        sched.add_request(make_request(rid, prompt, max_tokens=17))
    done = run_to_completion(sched, runner)
    for rid, prompt in prompts.items():
        assert done[rid].output_token_ids == expected_output(prompt, 17)
    assert sum(len(s.kv_moves) for s in runner.steps) > 0
    assert any(len(r.spec_parents) for s in runner.steps for r in s.scheduled)
    stats = sched.speculator.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert sched.speculator.branch_rate > 0.5
    if num_blocks == 24:
        assert sched.num_preemptions_total > 0
    assert_all_blocks_free_or_cached(sched)


def test_tree_moves_reach_the_runner_after_the_last_sequence_finished():
    sched = make_scheduler(64, 0, speculator=tree_speculator(next_token))
    runner = FakeRunner.for_scheduler(sched)
    stop = expected_output([4, 5, 6], 12)[4]  # reached by the first tree step, on its second branch
    sched.add_request(make_request("a", [4, 5, 6], max_tokens=12, stop_token_ids=[stop]))
    run_to_completion(sched, runner)
    out = sched.schedule()  # nothing to run, but the finished request's accepted branch still moves
    assert out.kv_moves and not out.scheduled and not out.is_empty  # the engine runs it (cached blocks)
    runner.execute(out)
    assert sched.schedule().kv_moves == []


def test_trees_need_the_torch_attention_backend():
    tree = {"method": "ngram", "num_candidates": 3}
    with pytest.raises(ValueError, match="needs attention_backend 'torch'"):
        EngineConfig.from_kwargs(speculative_config=tree, attention_backend="flash_attn")
    with pytest.raises(ValueError, match="needs attention_backend 'torch'"):
        EngineConfig.from_kwargs(speculative_config=tree, device="cuda")  # auto on a GPU: flash-attn
    assert EngineConfig.from_kwargs(speculative_config=tree, attention_backend="torch").speculative.num_candidates == 3


def test_bench_spec_table_shows_tree_and_chain_and_what_scheduling_costs():
    from cluster.bench.spec import format_report

    def entry(tps, **extra):
        return {"decode_tokens_per_s": tps, "schedule_ms_per_step": 0.1, "step_ms": 20.0, **extra}

    spec = {"acceptance_rate": 0.5, "mean_acceptance_length": 2.0, "draft_tokens": 10, "identical_to_off": True}
    report = {"speculative_config": {"num_candidates": 3}, "output_len": 8, "rounds": 1, "cases": [{
        "workload": "grounded", "batch_size": 1, "off": entry(50.0),
        "adaptive-tree": entry(110.0, branch_trials=4, branch_win_rate=0.25, **spec),
        "adaptive-chain": entry(100.0, branch_trials=0, branch_win_rate=0.0, **spec)}]}
    lines = format_report(report, ["off", "adaptive-tree", "adaptive-chain"])
    assert "other branch won" in lines[0] and lines[0].count("other branch won") == 1  # the tree's column only
    assert "2.20x" in lines[1] and "2.00x" in lines[1] and "25% of 4" in lines[1]
    assert any("schedule() ms per step" in line and "adaptive-tree 0.10" in line for line in lines)
