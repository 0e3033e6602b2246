"""Structured outputs on the default model: every kind of constraint holds,
greedy constrained outputs are the same whatever the batching, chunking,
preemption, speculation and jump-forward, and bad constraints fail alone."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest

from cluster.shared.structured import StructuredOutputsParams
from cluster.shared.types import FinishReason, GenerationRequest, SamplingParams
from tests.unit.engine_fakes import assert_all_blocks_free_or_cached
from workers.engine.async_engine import AsyncEngine
from workers.llm import LLM

KEYS = ["name", "age", "city", "country", "occupation", "email"]
PERSON = {"type": "object", "additionalProperties": False, "required": KEYS,
          "properties": {k: ({"type": "integer", "minimum": 0, "maximum": 130} if k == "age" else {"type": "string"})
                         for k in KEYS}}
PEOPLE = ["Ann, 34, a nurse from Lyon, France (ann@example.com)", "Bob, 51, a baker in Austin, USA",
          "Chen, 28, engineer, Shanghai, China", "Dana, 45, teacher in Oslo, Norway"]


@pytest.fixture(scope="module")
def smol():
    return LLM(block_size=16, max_model_len=512, max_num_seqs=8)


def chat(llm: LLM, text: str) -> list[int]:
    return llm.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)


def extraction_prompts(llm: LLM) -> list[list[int]]:
    return [chat(llm, f"Extract the person as JSON with keys {', '.join(KEYS)}: {p}") for p in PEOPLE]


def greedy(so: StructuredOutputsParams, max_tokens: int = 96) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=so)


def test_every_kind_of_constraint_holds(smol):
    prompt = chat(smol, "Tell me about a person named Ann who lives in Paris.")
    cases = {
        "json": (StructuredOutputsParams(json=PERSON), lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
        "json_object": (StructuredOutputsParams(json_object=True), lambda t: isinstance(json.loads(t), dict)),
        "regex": (StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2,4}"),
                  lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t)),
        "choice": (StructuredOutputsParams(choice=["yes", "no", "maybe so"]),
                   lambda t: t in ("yes", "no", "maybe so")),
        "grammar": (StructuredOutputsParams(grammar='root ::= "Answer: " ("A" | "B" "C") "."'),
                    lambda t: t in ("Answer: A.", "Answer: BC.")),
    }
    for kind, (so, check) in cases.items():
        out = smol.generate([prompt], greedy(so, 160))[0]
        assert out.finish_reason is FinishReason.STOP, (kind, out.text)
        assert check(out.text), (kind, out.text)
    assert_all_blocks_free_or_cached(smol.engine.scheduler)


def test_unconstrained_output_is_not_the_constrained_one(smol):
    """The test above would pass if the model wrote JSON anyway: it does not."""
    prompt = chat(smol, "Tell me about a person named Ann who lives in Paris.")
    free = smol.generate([prompt], SamplingParams(temperature=0, max_tokens=40))[0].text
    with pytest.raises(json.JSONDecodeError):
        json.loads(free)


def test_sampled_constrained_outputs_validate(smol):
    prompts = extraction_prompts(smol)
    params = [SamplingParams(temperature=1.0, top_p=0.95, seed=i, max_tokens=160,
                             structured_outputs=StructuredOutputsParams(json=PERSON)) for i in range(len(prompts))]
    for out in smol.generate(prompts, params):
        if out.finish_reason is FinishReason.STOP:
            jsonschema.validate(json.loads(out.text), PERSON)
        else:  # max_tokens ended an unfinished structure: OpenAI's "length"
            assert out.finish_reason is FinishReason.LENGTH


def test_max_tokens_ends_an_unfinished_structure_with_length(smol):
    out = smol.generate(extraction_prompts(smol)[:1], greedy(StructuredOutputsParams(json=PERSON), 5))[0]
    assert out.finish_reason is FinishReason.LENGTH and len(out.token_ids) == 5


def _texts(llm: LLM, prompts, so, batch: int) -> list[str]:
    texts = []
    for i in range(0, len(prompts), batch):
        texts += [o.text for o in llm.generate(prompts[i:i + batch], greedy(so))]
    return texts


@pytest.mark.slow
def test_greedy_constrained_outputs_are_the_same_whatever_runs_them(smol, tmp_path):
    so = StructuredOutputsParams(json=PERSON)
    prompts = extraction_prompts(smol)
    reference = _texts(smol, prompts, so, 1)
    for text in reference:
        jsonschema.validate(json.loads(text), PERSON)
    # Batch-mates: constrained ones and an unconstrained one in the same steps.
    mixed = smol.generate(prompts + [chat(smol, "Write a poem about the sea.")],
                          [greedy(so)] * len(prompts) + [SamplingParams(temperature=0, max_tokens=64)])
    assert [o.text for o in mixed[:-1]] == reference
    configs = {
        "no jump-forward": dict(structured_outputs_config={"jump_forward": False}),
        "chunked prefill": dict(max_num_batched_tokens=24, max_num_seqs=4),
        "swap preemption": dict(num_kv_blocks=14, preemption_mode="swap"),
        "recompute preemption": dict(num_kv_blocks=14, preemption_mode="recompute"),
        "n-gram speculation": dict(speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                       "adaptive": False}),
        "n-gram tree": dict(speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                "num_candidates": 3, "adaptive": False}),
    }
    from workers.model.medusa import MedusaHeads

    # Identity heads (zero blocks): each guesses the token it just saw again, read through the LM head.
    MedusaHeads(576, 49152, num_heads=3, num_layers=1).save(tmp_path / "heads")
    configs["medusa"] = dict(speculative_config={"method": "medusa", "model": str(tmp_path / "heads"),
                                                 "num_speculative_tokens": 3, "adaptive": False})
    configs["draft model"] = dict(speculative_config={"method": "draft_model", "draft_num_layers": 6,
                                                      "num_speculative_tokens": 3, "adaptive": False})
    for name, kwargs in configs.items():
        llm = LLM(block_size=16, max_model_len=512, **{"max_num_seqs": 8, **kwargs})
        assert _texts(llm, prompts, so, len(prompts)) == reference, name
        if "speculative_config" in kwargs:
            assert llm.engine.scheduler.speculator.stats.num_draft_tokens > 0, name
        if "preemption" in name:
            assert llm.engine.scheduler.num_preemptions_total > 0, name
        assert_all_blocks_free_or_cached(llm.engine.scheduler)


def test_jump_forward_proposes_the_forced_keys_and_keeps_the_output(smol):
    so = StructuredOutputsParams(json=PERSON)
    prompt = extraction_prompts(smol)[:1]
    speculator = smol.engine.scheduler.speculator
    before = speculator.stats.num_accepted_tokens
    out = smol.generate(prompt, greedy(so))[0]
    accepted = speculator.stats.num_accepted_tokens - before
    # Six fixed keys with their quotes, colons and separators are forced text.
    assert accepted >= 12, accepted
    plain = LLM(block_size=16, max_model_len=512, structured_outputs_config={"jump_forward": False})
    assert plain.engine.scheduler.speculator is None
    assert plain.generate(prompt, greedy(so))[0].token_ids == out.token_ids


def test_a_migrated_stream_resumes_inside_its_grammar(smol):
    so = StructuredOutputsParams(json=PERSON)
    prompt = extraction_prompts(smol)[0]
    whole = smol.generate([prompt], greedy(so))[0].token_ids
    cut = 9
    request = GenerationRequest("resumed", prompt + whole[:cut], greedy(so), num_resumed_output_tokens=cut)
    smol.engine.add_request(request)
    tail = [t for out in smol.stream_until_done() for t in out.new_token_ids]
    assert tail == whole[cut:]


@pytest.mark.parametrize("so, words", [
    (StructuredOutputsParams(regex="[a-z"), "regex does not compile"),
    (StructuredOutputsParams(grammar="root ::= missing_rule"), "grammar does not compile"),
    (StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "nonsense"}}}), "json"),
])
def test_a_constraint_that_does_not_compile_fails_alone(smol, so, words):
    prompt = chat(smol, "Hi")
    with pytest.raises(ValueError, match=words) as err:
        smol.generate([prompt, prompt], [SamplingParams(max_tokens=4), greedy(so)])
    assert ".cc:" not in str(err.value) and not re.search(r"\[\d\d:\d\d", str(err.value))  # no library log prefix
    assert not smol.engine.has_unfinished_requests()
    assert smol.generate([prompt], SamplingParams(temperature=0, max_tokens=4))[0].token_ids
    assert_all_blocks_free_or_cached(smol.engine.scheduler)


def test_ignore_eos_with_a_constraint_is_refused(smol):
    with pytest.raises(ValueError, match="ignore_eos"):
        smol.generate([chat(smol, "Hi")], SamplingParams(ignore_eos=True, structured_outputs=StructuredOutputsParams(
            choice=["a"])))


def test_a_compile_past_the_timeout_fails_that_request_only(smol):
    timeout = LLM(block_size=16, max_model_len=512, structured_outputs_config={"compile_timeout_s": 0.001})
    deep = {"type": "object", "properties": {
        f"k{i}": {"anyOf": [{"type": "string", "pattern": "[a-z]{3,9}[0-9]{2}"}, {"type": "integer", "minimum": i},
                            {"type": "array", "items": {"type": "number"}, "maxItems": 5}]} for i in range(80)}}

    async def run():
        front = AsyncEngine(timeout.engine)
        try:
            bad = GenerationRequest("slow", chat(timeout, "Hi"), greedy(StructuredOutputsParams(json=deep)))
            with pytest.raises(ValueError, match="took longer than"):
                async for _ in front.generate(bad):
                    pass
            good = GenerationRequest("fine", chat(timeout, "Hi"), SamplingParams(temperature=0, max_tokens=3))
            return [out async for out in front.generate(good)]
        finally:
            front.shutdown()

    outs = asyncio.run(run())
    assert outs[-1].finished and outs[-1].num_output_tokens == 3
    assert timeout.engine.structured.stats.num_failures >= 1
    assert_all_blocks_free_or_cached(timeout.engine.scheduler)


@pytest.mark.slow
def test_outputs_of_200_generated_schemas_that_stop_all_validate():
    """Nested objects, arrays with minItems / maxItems, enum, anyOf, pattern,
    format, ranges, required, additionalProperties false, $defs / $ref."""
    from cluster.bench.schemas import make_schemas, schema_prompt, validates

    llm = LLM(block_size=16, max_model_len=1024, max_num_seqs=32)
    schemas = make_schemas(200, seed=0)
    prompts = [chat(llm, schema_prompt(schema)) for _, schema in schemas]
    outs = llm.generate(prompts, [greedy(StructuredOutputsParams(json=schema), 160) for _, schema in schemas])
    stopped = [(shape, schema, out.text) for (shape, schema), out in zip(schemas, outs)
               if out.finish_reason is FinishReason.STOP]
    assert len(stopped) >= 150, len(stopped)  # most finish: the check below is about something
    invalid = [(shape, text) for shape, schema, text in stopped if not validates(schema, text)]
    assert invalid == []
    assert {shape for shape, _, _ in stopped} == {shape for shape, _ in schemas}
    assert_all_blocks_free_or_cached(llm.engine.scheduler)


@pytest.mark.parametrize("schema, feature", [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "not"),
    ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, "if"),
])
def test_a_schema_feature_that_cannot_be_enforced_is_named(smol, schema, feature):
    with pytest.raises(ValueError, match=f"{feature}.*cannot enforce"):
        smol.generate([chat(smol, "Hi")], greedy(StructuredOutputsParams(json=schema)))
    assert not smol.engine.has_unfinished_requests()


def test_dates_and_ipv4_are_as_strict_as_jsonschema_checks_them(smol):
    from cluster.bench.schemas import validates

    schema = {"type": "object", "required": ["day", "ip"], "additionalProperties": False,
              "properties": {"day": {"type": "string", "format": "date"}, "ip": {"type": "string", "format": "ipv4"}}}
    prompts = [chat(smol, f"Give a JSON object with a date and an IPv4 address, example {i}.") for i in range(6)]
    params = [SamplingParams(temperature=1.2, seed=i, max_tokens=60, structured_outputs=StructuredOutputsParams(
        json=schema)) for i in range(6)]
    for out in smol.generate(prompts, params):
        if out.finish_reason is FinishReason.STOP:
            assert validates(schema, out.text), out.text
