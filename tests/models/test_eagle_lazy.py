"""EAGLE's lazy catch-up: a sequence that asks for no proposals this step
(adaptive speculation turned them off) has its rows kept, not run through
the draft; they are written when it asks again (or once too many wait), so
every proposal still equals the draft run from scratch over the whole
sequence."""

from __future__ import annotations

import torch

from cluster.shared.types import SamplingParams
from tests.models.test_eagle import reference_proposal, tiny_dir, write_vllm_eagle  # noqa: F401 (fixture)
from workers import spec_eagle
from workers.llm import LLM
from workers.model.eagle import EagleDraft
from workers.model.loader import read_arch


def run_asking_sometimes(tiny_dir, folder, asks, prefix_caching=False):
    """Three staggered requests (chunked prefill, batched); the speculator asks
    request r for proposals on its n-th ask iff ``asks(r, n)``. Returns the
    engine, the proposals seen ``(rid, num_tokens, guess)`` and the tokens."""
    config = {"method": "eagle", "model": str(folder), "num_speculative_tokens": 3, "adaptive": False}
    llm = LLM(str(tiny_dir), block_size=4, max_num_batched_tokens=8, max_num_seqs=4,
              enable_prefix_caching=prefix_caching, speculative_config=config)
    engine = llm.engine
    speculator = engine.scheduler.speculator
    calls: dict[str, int] = {}

    def wanted(rid: str) -> int:
        calls[rid] = calls.get(rid, 0) + 1
        return 3 if asks(rid, calls[rid]) else 0

    speculator.runner_proposals_wanted = wanted
    seen: list[tuple[str, int, list[int]]] = []
    receive = speculator.proposer.receive
    speculator.proposer.receive = lambda rid, n, cands: (seen.append((rid, n, cands[0])), receive(rid, n, cands))[1]
    prompts = [[5 + i, 17, 33, 9 + i, 61, 12, 40, 8, 90 + i, 3, 44, 7][: 5 + 3 * i] for i in range(3)]
    reqs = [llm.make_request(p, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)) for p in prompts]
    tokens = {r.request_id: list(p) for r, p in zip(reqs, prompts)}
    engine.add_request(reqs[0])
    pending = reqs[1:]
    while engine.has_unfinished_requests() or pending:
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        if pending:
            engine.add_request(pending.pop(0))
    return engine, seen, tokens


def check_against_scratch(tiny_dir, folder, seen, tokens):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_dir), torch_dtype=torch.float32).eval()
    draft = EagleDraft.load(folder, read_arch(tiny_dir))
    embed, lm_head = hf.get_input_embeddings(), hf.get_output_embeddings()
    with torch.no_grad():
        for rid, n, guess in seen:
            full = tokens[rid][:n]
            hidden = hf(torch.tensor([full]), output_hidden_states=True).hidden_states[-1][0]
            assert guess == reference_proposal(draft, embed, lm_head, hidden, full, len(guess)), (rid, n)


def test_proposals_after_steps_that_asked_nothing_equal_the_draft_from_scratch(tmp_path, tiny_dir, monkeypatch):
    folder = write_vllm_eagle(tmp_path / "eagle", seed=3)
    monkeypatch.setattr(spec_eagle, "MAX_BACKLOG_ROWS", 5)  # some backlogs are written before their request asks
    # Each request asks on a pattern of its own: runs of silent steps of 1 to 6, verified steps between.
    pattern = [True, False, True, False, False, False, True, True, False, False, False, False, False, False, True]
    engine, seen, tokens = run_asking_sometimes(tiny_dir, folder, lambda rid, n: pattern[(n + len(rid)) % 15])
    assert len(seen) >= 12
    check_against_scratch(tiny_dir, folder, seen, tokens)
    assert engine.scheduler.speculator.stats.num_draft_tokens > 0


def test_a_sequence_that_never_asks_runs_no_draft_row(tmp_path, tiny_dir):
    folder = write_vllm_eagle(tmp_path / "eagle", seed=4)
    engine, seen, _ = run_asking_sometimes(tiny_dir, folder, lambda rid, n: False)
    proposer = engine.runner.medusa
    assert not seen and engine.scheduler.speculator.stats.num_drafts == 0
    # Three requests of 5-11 prompt and 24 answer tokens: no backlog reached 64 rows, so no draft row ran.
    assert float(proposer.kv.abs().sum()) == 0.0
    assert proposer._backlog.num_rows == (5 + 8 + 11) + 3 * 23


def test_backlogs_of_requests_gone_for_long_are_dropped(tmp_path):
    backlog = spec_eagle.CatchUpBacklog()
    row = {"h": torch.zeros(2, 4), "positions": [0, 1], "next": [7, 8]}
    assert backlog.add("a", row, step=1) == 2
    assert backlog.add("b", row, step=5) == 2
    # A recompute from position 1 drops the waiting row at 1 before adding the new ones.
    assert backlog.add("a", {"h": torch.ones(3, 4), "positions": [1, 2, 3], "next": [8, 9, 10]}, step=6) == 4
    taken = backlog.take("a", {"index": 0, "k": 2})
    assert taken["positions"] == [0, 1, 2, 3] and taken["next"] == [7, 8, 9, 10]
    assert taken["h"].sum() == 3 * 4 and taken["k"] == 2
    backlog.prune(before=6)
    assert backlog.num_rows == 0
