"""``prefixserve bench serve``'s datasets: random, shared-prefix, multi-turn and
the structured-output ones, deterministic with their seed, and their flags."""

from __future__ import annotations

import argparse
import json

import pytest

from cluster.bench import datasets as ds
from cluster.bench.clients import grpc_request

VOCAB = 1000



def test_random_dataset_is_deterministic_with_its_seed_and_lengths_stay_in_range():
    a = ds.random_dataset(50, 100, 20, 0.25, VOCAB, seed=7)
    assert a == ds.random_dataset(50, 100, 20, 0.25, VOCAB, seed=7)
    assert a != ds.random_dataset(50, 100, 20, 0.25, VOCAB, seed=8)
    ins = [len(c.turns[0].new_token_ids) for c in a]
    outs = [c.turns[0].output_len for c in a]
    assert all(75 <= n <= 125 for n in ins) and all(15 <= n <= 25 for n in outs)
    assert len(set(ins)) > 5  # the range is used, not one length
    assert all(ds.FIRST_USABLE_ID <= t < VOCAB for c in a for t in c.turns[0].new_token_ids)
    fixed = ds.random_dataset(10, 64, 8, 0.0, VOCAB, seed=0)
    assert {len(c.turns[0].new_token_ids) for c in fixed} == {64} and {c.turns[0].output_len for c in fixed} == {8}


def test_shared_prefix_dataset_groups_share_exactly_their_system_prompt():
    convs = ds.shared_prefix_dataset(3, 4, 32, 6, 5, VOCAB, seed=1)
    assert convs == ds.shared_prefix_dataset(3, 4, 32, 6, 5, VOCAB, seed=1)
    assert len(convs) == 12 and sorted(c.group for c in convs) == [0] * 4 + [1] * 4 + [2] * 4
    assert [c.group for c in convs] != sorted(c.group for c in convs)  # shuffled: groups interleave
    by_group: dict[int, list[tuple[int, ...]]] = {}
    for c in convs:
        assert c.shared_prefix_len == 32 and len(c.turns) == 1 and c.turns[0].output_len == 5
        assert len(c.turns[0].new_token_ids) == 38
        by_group.setdefault(c.group, []).append(c.turns[0].new_token_ids)
    prefixes = {g: {p[:32] for p in prompts} for g, prompts in by_group.items()}
    assert all(len(p) == 1 for p in prefixes.values())  # one system prompt per group
    assert len({next(iter(p)) for p in prefixes.values()}) == 3  # and different ones across groups
    assert len({p for prompts in by_group.values() for p in prompts}) == 12  # unique questions


def test_multi_turn_dataset_splits_requests_into_conversations():
    convs = ds.multi_turn_dataset(10, 4, 50, 7, 3, VOCAB, seed=2)
    assert [c.num_requests for c in convs] == [4, 4, 2]
    assert convs == ds.multi_turn_dataset(10, 4, 50, 7, 3, VOCAB, seed=2)
    for c in convs:
        assert len(c.turns[0].new_token_ids) == 50 and all(len(t.new_token_ids) == 7 for t in c.turns[1:])
        assert ds.max_prompt_len(c) == 50 + 7 * (c.num_requests - 1) + 3 * (c.num_requests - 1)


def test_make_dataset_reads_the_flags_and_rejects_a_mismatched_num_prompts():
    parser = argparse.ArgumentParser()
    ds.add_dataset_args(parser)
    args = parser.parse_args(["--dataset-name", "shared-prefix", "--gsp-num-groups", "2",
                              "--gsp-prompts-per-group", "3", "--gsp-system-prompt-len", "16"])
    assert len(ds.make_dataset(args, VOCAB)) == 6
    args.num_prompts = 5
    with pytest.raises(ValueError, match="--gsp-num-groups x --gsp-prompts-per-group = 6"):
        ds.make_dataset(args, VOCAB)
    with pytest.raises(ValueError, match="--random-range-ratio must be in"):
        ds.random_dataset(4, 10, 10, 1.0, VOCAB, 0)
    with pytest.raises(ValueError, match="--multi-turn-turns must be >= 1"):
        ds.multi_turn_dataset(4, 0, 10, 10, 10, VOCAB, 0)


def test_structured_datasets_are_chat_questions_deterministic_with_their_seed():
    for name in ds.STRUCTURED_DATASETS:
        convs = ds.structured_output_dataset(name, 12, 1.0, 64, seed=3)
        assert convs == ds.structured_output_dataset(name, 12, 1.0, 64, seed=3), name
        assert convs != ds.structured_output_dataset(name, 12, 1.0, 64, seed=4), name
        turns = [c.turns[0] for c in convs]
        assert len(convs) == 12 and all(c.num_requests == 1 for c in convs)
        assert all(t.question and t.new_token_ids == () and t.output_len == 64 for t in turns)
        assert all(t.structured_outputs is not None and t.validator is not None for t in turns)
    schemas = lambda convs: {json.dumps(c.turns[0].structured_outputs["json"], sort_keys=True) for c in convs}
    assert len(schemas(ds.structured_output_dataset("json", 12, 1.0, 64, seed=3))) == 1  # the grammar cache helps
    assert len(schemas(ds.structured_output_dataset("json-unique", 12, 1.0, 64, seed=3))) == 12  # it cannot


def test_structured_dataset_validators_judge_the_answer_text():
    choice = ds.structured_output_dataset("choice", 1, 1.0, 8, seed=0)[0].turns[0]
    assert choice.structured_outputs == {"choice": ["Positive", "Negative"]}
    assert choice.validator("Positive") and not choice.validator("positive") and not choice.validator("Positive.")
    regex = ds.structured_output_dataset("regex", 1, 1.0, 8, seed=0)[0].turns[0]
    assert regex.validator("alan_turing@enigma.com\n") and not regex.validator("alan@enigma.org\n")
    unique = ds.structured_output_dataset("json-unique", 2, 1.0, 8, seed=5)[1].turns[0]
    profile = {"name": "A", "email": "a@b.com", "street": "s", "city": "c", "state": "st", "zip": "12345",
               "phone": "555-123-4567", "website": "w", "company": "co", "age": 30}
    assert not unique.validator(json.dumps(profile))  # its own required id is missing
    assert unique.validator(json.dumps({**profile, "id_5_1": 7}))
    assert not unique.validator(json.dumps({**profile, "id_5_1": 7})[:-1])  # cut short: not JSON


def test_structured_output_ratio_constrains_a_seeded_int_n_times_ratio_requests():
    assert len(ds.constrained_indices(10, 0.3, seed=0)) == 3
    assert len(ds.constrained_indices(100, 0.29, seed=0)) == 29  # not 28 from 28.999...
    assert len(ds.constrained_indices(7, 0.5, seed=0)) == 3  # vLLM's int(): rounds down
    assert ds.constrained_indices(9, 0.0, seed=0) == frozenset()
    assert ds.constrained_indices(9, 1.0, seed=0) == frozenset(range(9))
    assert ds.constrained_indices(20, 0.5, seed=1) == ds.constrained_indices(20, 0.5, seed=1)
    assert ds.constrained_indices(20, 0.5, seed=1) != ds.constrained_indices(20, 0.5, seed=2)
    with pytest.raises(ValueError, match=r"--structured-output-ratio must be in \[0, 1\], got 1.5"):
        ds.constrained_indices(4, 1.5, seed=0)
    parser = argparse.ArgumentParser()
    ds.add_dataset_args(parser)
    args = parser.parse_args(["--dataset-name", "json-unique", "--num-prompts", "20", "--seed", "1",
                              "--structured-output-ratio", "0.5", "--structured-output-len", "32"])
    convs = ds.make_dataset(args, VOCAB)
    constrained = {i for i, c in enumerate(convs) if c.turns[0].structured_outputs is not None}
    assert constrained == ds.constrained_indices(20, 0.5, seed=1)
    assert all(c.turns[0].validator is None for i, c in enumerate(convs) if i not in constrained)
    assert all(c.turns[0].question and c.turns[0].output_len == 32 for c in convs)  # all questions still asked
    assert [c.turns[0].question for c in convs] == [
        c.turns[0].question for c in ds.structured_output_dataset("json-unique", 20, 1.0, 32, seed=1)]


def test_grpc_request_sends_a_question_as_chat_with_its_constraint_in_the_proto():
    from router.convert import sampling_params_from_proto
    from cluster.shared.structured import StructuredOutputsParams

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    request = grpc_request([], 16, "Give me a.", {"json": schema})
    assert request.WhichOneof("input") == "messages"
    assert [(m.role, m.content) for m in request.messages.items] == [("user", "Give me a.")]
    params = sampling_params_from_proto(request.sampling)
    assert params.structured_outputs == StructuredOutputsParams(json=schema)
    assert params.max_tokens == 16 and params.temperature == 0.0 and not params.ignore_eos  # may end at EOS
    plain = grpc_request([5, 6, 7], 4)
    assert list(plain.prompt_token_ids.ids) == [5, 6, 7] and plain.sampling.ignore_eos
    assert not plain.sampling.HasField("structured_outputs")
