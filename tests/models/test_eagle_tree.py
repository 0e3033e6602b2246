"""EAGLE-2 dynamic trees (``num_candidates`` > 1 with an EAGLE draft): the
candidates the runner hands over are the beam of the draft's confidence
recomputed from scratch (every node's draft row rerun over the whole
sequence), and greedy and seeded tokens never change with trees on, through
chunked prefill, batching, swaps and recomputes."""

from __future__ import annotations

import pytest
import torch

from cluster.shared.types import SamplingParams
from tests.models.test_eagle import draft_features, tiny_dir, write_vllm_eagle  # noqa: F401 (fixture)
from tests.unit.engine_fakes import assert_all_blocks_free_or_cached
from workers.llm import LLM
from workers.model.eagle import EagleDraft
from workers.model.loader import read_arch


def reference_tree(draft, embed, lm_head, hidden, tokens, width, depth) -> list[list[int]]:
    """EAGLE-2's beam from scratch: the ``width`` likeliest first guesses;
    per depth, every frontier node's draft row (the path's features and
    tokens appended, the whole sequence rerun) proposes its ``width`` best
    children, and the ``width`` best path scores go on."""
    feats, nexts = hidden[: len(tokens) - 1], list(tokens[1:])

    def row(path, path_feats):
        f = draft_features(draft, embed(torch.tensor(nexts + path)), torch.cat([feats, *path_feats]))[-1:]
        return f, torch.log_softmax(lm_head(f)[0].float(), dim=-1)

    f, logp = row([], [])
    scores, ids = logp.topk(width)
    frontier = [([int(t)], [f], float(s)) for t, s in zip(ids, scores)]
    for _ in range(1, depth):
        children = []
        for path, path_feats, score in frontier:
            f, logp = row(path, path_feats)
            scores, ids = logp.topk(width)
            children += [(path + [int(t)], path_feats + [f], score + float(s)) for t, s in zip(ids, scores)]
        frontier = sorted(children, key=lambda c: -c[2])[:width]
    return [path for path, _, _ in sorted(frontier, key=lambda c: -c[2])]


def test_tree_candidates_are_the_drafts_beam_from_scratch(tmp_path, tiny_dir):
    from transformers import AutoModelForCausalLM

    folder = write_vllm_eagle(tmp_path / "eagle", seed=5, scale=0.5)
    config = {"method": "eagle", "model": str(folder), "num_speculative_tokens": 3, "num_candidates": 3,
              "adaptive": False}
    llm = LLM(str(tiny_dir), block_size=4, max_num_batched_tokens=8, max_num_seqs=4, enable_prefix_caching=False,
              speculative_config=config)
    engine = llm.engine
    seen: list[tuple[str, int, list[list[int]]]] = []
    proposer = engine.scheduler.speculator.proposer
    receive = proposer.receive
    proposer.receive = lambda rid, n, cands: (seen.append((rid, n, cands)), receive(rid, n, cands))[1]
    prompts = [[5 + i, 17, 33, 9 + i, 61, 12, 40, 8, 90 + i, 3, 44, 7][: 5 + 3 * i] for i in range(3)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    reqs = [llm.make_request(p, params) for p in prompts]
    tokens = {r.request_id: list(p) for r, p in zip(reqs, prompts)}
    for r in reqs:
        engine.add_request(r)
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_dir), torch_dtype=torch.float32).eval()
    draft = EagleDraft.load(folder, read_arch(tiny_dir))
    embed, lm_head = hf.get_input_embeddings(), hf.get_output_embeddings()
    assert len(seen) >= 6
    with torch.no_grad():
        for rid, n, cands in seen:
            full = tokens[rid][:n]
            hidden = hf(torch.tensor([full]), output_hidden_states=True).hidden_states[-1][0]
            assert len(cands) == 3 and len({tuple(c) for c in cands}) == 3
            assert cands == reference_tree(draft, embed, lm_head, hidden, full, 3, len(cands[0])), (rid, n)
    stats = engine.scheduler.speculator.stats
    assert stats.num_draft_tokens > stats.num_drafts * 3  # trees: more nodes than a chain's depth


@pytest.mark.parametrize("scenario", ["chunked_prefill", "swap", "recompute"])
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_tokens_never_change_with_eagle_trees(tmp_path, tiny_dir, scenario, sampling):
    folder = write_vllm_eagle(tmp_path / "eagle", seed=1, scale=0.5)
    config = {"method": "eagle", "model": str(folder), "num_speculative_tokens": 3, "num_candidates": 4,
              "adaptive": False}
    prompts = [[10 + i, 20, 30 + i, 40, 10 + i, 20, 30 + i, 40, 10 + i, 20] for i in range(4)] + [[7, 99, 3, 250]]
    if sampling == "greedy":
        params = [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)] * 5
    else:
        params = [SamplingParams(max_tokens=16, temperature=0.8, top_k=20, seed=i, logprobs=1, ignore_eos=True)
                  for i in range(5)]
    plain = LLM(str(tiny_dir), block_size=4).generate(prompts, params)
    engine_args = {"chunked_prefill": dict(max_num_batched_tokens=8, max_num_seqs=4),
                   "swap": dict(num_kv_blocks=24, preemption_mode="swap"),
                   "recompute": dict(num_kv_blocks=24, preemption_mode="recompute")}[scenario]
    spec = LLM(str(tiny_dir), block_size=4, speculative_config=config, **engine_args)
    got = spec.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    stats = spec.engine.scheduler.speculator.stats
    assert stats.num_drafts >= 10 and stats.num_draft_tokens > 3 * stats.num_drafts
    assert_all_blocks_free_or_cached(spec.engine.scheduler)
