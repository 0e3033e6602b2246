"""The sampler: greedy, truncation, seeds, frequencies, penalties, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from cluster.shared.types import SamplingParams
from workers.engine.outputs import ScheduledRequest
from workers.model.sampler import Sampler, mix_seed
from workers.model.logits_ops import apply_penalties, apply_top_k, apply_top_p

VOCAB = 64


def make_request(prompt=(1, 2, 3), output=(), **params) -> ScheduledRequest:
    return ScheduledRequest(
        request_id="r",
        input_token_ids=[0],
        num_computed_tokens=len(prompt) + len(output) - 1,
        block_ids=[0],
        num_sample_tokens=1,
        sampling_params=SamplingParams(**params),
        prompt_token_ids=list(prompt),
        output_token_ids=list(output),
    )


def make_logits(num_rows: int, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_equals_argmax_with_ties_to_lowest_id():
    logits = make_logits(6)
    logits[2, 5] = logits[2, 9] = logits[2].max() + 1.0  # a tie
    requests = [make_request(temperature=0.0) for _ in range(6)]
    token_ids, logprobs = Sampler(seed=0)(logits, requests)
    assert token_ids == logits.argmax(dim=-1).tolist()
    assert token_ids[2] == 5
    assert logprobs == [None] * 6


def test_greedy_rows_in_a_mixed_batch_are_exact():
    logits = make_logits(4)
    requests = [make_request(temperature=0.0), make_request(temperature=1.0, seed=3)] * 2
    token_ids, _ = Sampler(seed=0)(logits, requests)
    assert token_ids[0] == logits[0].argmax().item()
    assert token_ids[2] == logits[2].argmax().item()


def test_logits_are_not_modified():
    logits = make_logits(3)
    before = logits.clone()
    requests = [
        make_request(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, repetition_penalty=1.3,
                     presence_penalty=0.5, frequency_penalty=0.5, seed=1, logprobs=2),
        make_request(temperature=0.0, repetition_penalty=2.0),
        make_request(temperature=1.0),
    ]
    Sampler(seed=0)(logits, requests)
    assert torch.equal(logits, before)


@pytest.mark.parametrize("knob", [{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}])
def test_extreme_truncation_equals_greedy(knob):
    logits = make_logits(16, seed=4)
    requests = [make_request(temperature=1.5, seed=i, **knob) for i in range(8)]
    requests += [make_request(temperature=1.5, **knob) for _ in range(8)]
    token_ids, _ = Sampler(seed=0)(logits, requests)
    assert token_ids == logits.argmax(dim=-1).tolist()


def test_min_p_draws_only_tokens_above_the_threshold():
    probs = torch.tensor([0.5, 0.3, 0.12, 0.05, 0.03])
    logits = probs.log().expand(4000, -1).contiguous()
    requests = [make_request(min_p=0.2, temperature=1.0)] * 4000  # keeps p >= 0.1
    token_ids, _ = Sampler(seed=0)(logits, requests)
    counts = torch.bincount(torch.tensor(token_ids), minlength=5).tolist()
    assert counts[3] == counts[4] == 0
    assert all(c > 0 for c in counts[:3])


def test_seeded_request_is_independent_of_batch_and_order():
    target = make_request(temperature=1.0, top_p=0.95, seed=1234, output=(4, 5))
    logits = make_logits(6, seed=7)
    others = [make_request(temperature=t, seed=s) for t, s in ((1.0, None), (0.5, 9), (0.0, None), (2.0, 11), (1.0, 5))]
    sampler = Sampler(seed=0)
    alone, _ = sampler(logits[:1], [target])
    in_batch, _ = sampler(logits, [target] + others)
    order = [3, 5, 0, 1, 4, 2]
    reordered, _ = Sampler(seed=99)(logits[order], [([target] + others)[i] for i in order])
    assert alone[0] == in_batch[0] == reordered[order.index(0)]
    # The seeded neighbours agree across orderings too.
    assert in_batch[2] == reordered[order.index(2)]
    assert in_batch[4] == reordered[order.index(4)]


def test_seeded_sequence_reproduces_step_by_step():
    """A recomputed sequence (fresh sampler) draws the same tokens at each step."""
    logits = make_logits(10, seed=2)
    def run(sampler_seed):
        sampler, output = Sampler(seed=sampler_seed), []
        for step in range(10):
            request = make_request(temperature=1.0, seed=42, output=tuple(output))
            output.append(sampler(logits[step : step + 1], [request])[0][0])
        return output
    assert run(0) == run(1)


def test_different_seeds_differ():
    logits = make_logits(1, seed=3).expand(20, -1).contiguous()
    draws = {
        seed: tuple(Sampler(0)(logits, [make_request(temperature=1.0, seed=seed, output=(0,) * i) for i in range(20)])[0])
        for seed in (1, 2)
    }
    assert draws[1] != draws[2]


def test_unseeded_rows_follow_the_sampler_seed():
    logits = make_logits(1, seed=3).expand(30, -1).contiguous()
    requests = [make_request(temperature=1.0)] * 30
    assert Sampler(5)(logits, requests)[0] == Sampler(5)(logits, requests)[0]
    assert Sampler(5)(logits, requests)[0] != Sampler(6)(logits, requests)[0]


def test_mix_seed_is_fixed_and_spreads():
    assert mix_seed(0, 0) == mix_seed(0, 0)
    assert 0 <= mix_seed(-1, 3) < 2**63
    assert len({mix_seed(s, t) for s in range(50) for t in range(50)}) == 2500


def chi_square(counts: list[int], probs: list[float]) -> float:
    total = sum(counts)
    return sum((c - total * p) ** 2 / (total * p) for c, p in zip(counts, probs) if p > 0)


# 99.9th percentile of chi-square with 4 degrees of freedom is 18.47; the
# draws are seeded, so the test is deterministic and far from the bound.
CHI2_4DOF_999 = 18.47


@pytest.mark.parametrize(
    "params, expected",
    [
        ({"temperature": 1.0}, [0.4, 0.3, 0.15, 0.1, 0.05]),
        ({"temperature": 0.5}, [x * x / 0.285 for x in (0.4, 0.3, 0.15, 0.1, 0.05)]),
        ({"temperature": 1.0, "top_k": 2}, [4 / 7, 3 / 7, 0, 0, 0]),
        ({"temperature": 1.0, "top_p": 0.8}, [0.4 / 0.85, 0.3 / 0.85, 0.15 / 0.85, 0, 0]),
    ],
)
def test_sampled_frequencies_match_probabilities(params, expected):
    num_draws = 20000
    logits = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05]).log().expand(num_draws, -1).contiguous()
    token_ids, _ = Sampler(seed=123)(logits, [make_request(**params)] * num_draws)
    counts = torch.bincount(torch.tensor(token_ids), minlength=5).tolist()
    assert all(c == 0 for c, p in zip(counts, expected) if p == 0)
    assert chi_square(counts, expected) < CHI2_4DOF_999


def test_seeded_frequencies_match_probabilities():
    probs = [0.4, 0.3, 0.15, 0.1, 0.05]
    logits = torch.tensor(probs).log().expand(5000, -1).contiguous()
    requests = [make_request(temperature=1.0, seed=s) for s in range(5000)]
    token_ids, _ = Sampler(seed=0)(logits, requests)
    counts = torch.bincount(torch.tensor(token_ids), minlength=5).tolist()
    assert chi_square(counts, probs) < CHI2_4DOF_999


def test_repetition_penalty_matches_transformers():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    logits = make_logits(3, seed=5)
    prompts = [(1, 2, 3, 3), (10, 20), (7,)]
    outputs = [(4, 1), (), (7, 8, 8, 9)]
    penalties = [1.3, 0.7, 2.0]
    requests = [make_request(p, o, repetition_penalty=r) for p, o, r in zip(prompts, outputs, penalties)]
    ours = apply_penalties(logits, requests)
    for row, (prompt, output, penalty) in enumerate(zip(prompts, outputs, penalties)):
        input_ids = torch.tensor([list(prompt) + list(output)])
        theirs = RepetitionPenaltyLogitsProcessor(penalty)(input_ids, logits[row : row + 1].clone())
        torch.testing.assert_close(ours[row : row + 1], theirs, rtol=0, atol=0)


def test_frequency_and_presence_penalties_follow_openai():
    logits = make_logits(1, seed=6)
    request = make_request(prompt=(5, 6), output=(1, 1, 1, 2), frequency_penalty=0.5, presence_penalty=0.25)
    ours = apply_penalties(logits, [request])
    expected = logits.clone()
    expected[0, 1] -= 3 * 0.5 + 0.25
    expected[0, 2] -= 1 * 0.5 + 0.25
    torch.testing.assert_close(ours, expected)  # prompt tokens 5, 6 untouched


def test_penalties_steer_greedy_decoding():
    logits = torch.zeros(1, VOCAB)
    logits[0, 3], logits[0, 4] = 2.0, 1.5
    request = make_request(prompt=(3,), temperature=0.0, repetition_penalty=2.0)
    assert Sampler(0)(logits, [request])[0] == [4]  # 2.0 / 2 = 1.0 < 1.5


def test_logprobs_equal_log_softmax_of_raw_logits():
    logits = make_logits(3, seed=8)
    requests = [
        make_request(temperature=0.0, logprobs=5),
        make_request(temperature=0.8, top_k=3, repetition_penalty=1.5, seed=1, logprobs=0),
        make_request(temperature=1.0, seed=2),
    ]
    token_ids, logprobs = Sampler(seed=0)(logits, requests)
    reference = logits.log_softmax(dim=-1)
    first = logprobs[0][0]
    assert first.token_id == token_ids[0]
    assert math.isclose(first.logprob, reference[0, token_ids[0]].item(), rel_tol=1e-6)
    assert [t for t, _ in first.top_logprobs] == reference[0].topk(5).indices.tolist()
    values = [v for _, v in first.top_logprobs]
    assert values == sorted(values, reverse=True)
    torch.testing.assert_close(torch.tensor(values), reference[0].topk(5).values)
    second = logprobs[1][0]
    assert second.top_logprobs == ()
    assert math.isclose(second.logprob, reference[1, token_ids[1]].item(), rel_tol=1e-6)
    assert logprobs[2] is None


@pytest.mark.parametrize("scale", [8.0, 0.05])  # peaked: nucleus among candidates; flat: full sort
@pytest.mark.parametrize("top_p", [0.5, 0.9])
def test_top_p_matches_transformers(scale, top_p):
    from transformers.generation.logits_process import TopPLogitsWarper

    logits = make_logits(4, seed=9, vocab=1000) * scale
    ours = apply_top_p(logits, torch.full((4,), top_p))
    theirs = TopPLogitsWarper(top_p)(None, logits.clone())
    assert torch.equal(ours.isinf(), theirs.isinf())
    assert torch.equal(ours[~ours.isinf()], logits[~ours.isinf()])


def test_top_k_matches_transformers():
    from transformers.generation.logits_process import TopKLogitsWarper

    logits = make_logits(3, seed=10, vocab=1000)
    logits[1, :10] = 50.0  # ties at the k-th value are kept
    ks = [1, 5, 300]
    ours = apply_top_k(logits, torch.tensor(ks))
    for row, k in enumerate(ks):
        theirs = TopKLogitsWarper(k)(None, logits[row : row + 1].clone())
        assert torch.equal(ours[row : row + 1], theirs)


def test_logit_processors_equal_their_dense_definition():
    """logit_bias, allowed_token_ids, bad_words and min_tokens, applied sparsely in place,
    give the logprobs of the dense edit (bias added, the rest -inf), row by row."""
    logits = make_logits(5)
    dense = logits.clone()
    requests = [
        make_request(temperature=0.0, logprobs=3, logit_bias={4: 2.5, 9: -100}),
        make_request(temperature=0.0, logprobs=3, allowed_token_ids=[7, 8, 40]),
        make_request(output=(5, 6), temperature=0.0, logprobs=3, bad_words_token_ids=[(6, 11), (12,), (5, 13)]),
        make_request(output=(1,), temperature=0.0, logprobs=3, min_tokens=3, stop_token_ids=[20]),
        make_request(temperature=0.0, logprobs=3),
    ]
    requests[3].min_tokens_banned_ids = (2, 20)  # the scheduler names EOS and the stop ids
    dense[0, 4] += 2.5
    dense[0, 9] += -100
    keep = torch.full((VOCAB,), float("-inf"))
    keep[[7, 8, 40]] = 0
    dense[1] += keep
    dense[2, [11, 12]] = float("-inf")  # (5, 13): the output does not end with 5
    dense[3, [2, 20]] = float("-inf")
    token_ids, logprobs = Sampler(seed=0)(logits, requests)
    assert token_ids == dense.argmax(dim=-1).tolist()
    expected = dense.log_softmax(dim=-1)
    for row, entry in enumerate(logprobs):
        assert entry[0].logprob == pytest.approx(expected[row, token_ids[row]].item(), abs=1e-5)
    assert token_ids[1] in (7, 8, 40)


def test_fork_rows_sample_as_their_own_requests():
    """A forked choice samples from its parent's row with its own seed: the same token as a
    request with that seed alone."""
    logits = make_logits(1)
    alone = [Sampler(seed=0)(logits.clone(), [make_request(temperature=1.0, seed=s)])[0][0] for s in (7, 8, 9)]
    rows = logits.expand(3, VOCAB).contiguous()
    together, _ = Sampler(seed=0)(rows, [make_request(temperature=1.0, seed=s) for s in (7, 8, 9)])
    assert together == alone
