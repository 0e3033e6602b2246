"""Reasoning split end to end: ``prefixserve up --reasoning-parser deepseek_r1``
on the default model, whose chat output therefore starts in a think block. A
grammar holds only the content after ``</think>`` (``router/reasoning.py``),
so the think block is the model's free greedy text: it continues the raw
greedy text of the same prompt without a grammar (a completions request, never
split), which stops where the model wrote EOS (under the grammar an output may
not end inside its think block). The chat answer, whole and streamed, and the
gRPC stream split it alike and count all of it as reasoning tokens."""

from __future__ import annotations

import re

import grpc
import httpx2 as httpx
import openai
import pytest

from router.pb import generation_pb2 as pb
from router.pb import generation_pb2_grpc as pb_grpc
from router.reasoning import ReasoningMode, split_reasoning
from tests.integration.up_process import start_up, stop_up, wait_for_log

CONTENT = "[A-Za-z ]{3,16}"  # what the answer after the think block must be
GRAMMAR = {"structured_outputs": {"regex": CONTENT}}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 24  # the model does not close the block within these: all of them are reasoning


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """``(openai client, model name, gRPC address)``."""
    log_path = tmp_path_factory.mktemp("reasoning-up") / "up.log"
    proc, log = start_up(log_path, "--replica-num-cpus", "0.5", "--grpc-port", "0", "--http-port", "0",
                         "--reasoning-parser", "deepseek_r1")
    try:
        text = wait_for_log(proc, log, "ready: gRPC on")
        base = re.search(r"OpenAI HTTP on (http://127\.0\.0\.1:\d+/v1)", text).group(1)
        address = re.search(r"ready: gRPC on (\S+?:\d+)", text).group(1)
        with openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120) as api:
            yield api, api.models.list().data[0].id, address
    finally:
        stop_up(proc, log)


def test_a_grammar_leaves_the_think_block_free(cluster):
    api, model, address = cluster
    answer = api.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=MAX_TOKENS,
                                         extra_body=GRAMMAR)
    message = answer.choices[0].message
    reasoning, content = message.model_extra["reasoning"], message.content
    assert reasoning and message.model_extra["reasoning_content"] == reasoning
    assert answer.usage.completion_tokens == MAX_TOKENS
    assert answer.usage.completion_tokens_details.reasoning_tokens == MAX_TOKENS
    # The raw text of the same prompt without a grammar (completions are never split), split
    # offline, is the same: the grammar did not touch the think block.
    tokens = httpx.post(str(api.base_url).rstrip("/").removesuffix("/v1") + "/tokenize", timeout=60,
                        json={"model": model, "messages": QUESTION}).json()["tokens"]
    raw = api.completions.create(model=model, prompt=tokens, temperature=0, max_tokens=MAX_TOKENS)
    assert not re.fullmatch(CONTENT, raw.choices[0].text)  # the grammar would have changed it
    # The raw output stops where the model wrote EOS; under the grammar an output may not end inside
    # its think block (the constraint after it must hold), so the chat answer goes on from there.
    raw_reasoning, raw_content = split_reasoning(ReasoningMode("deepseek_r1", start_in_reasoning=True),
                                                 raw.choices[0].text)
    assert raw.choices[0].finish_reason == "stop" and raw_content == content == ""
    assert reasoning.startswith(raw_reasoning) and len(reasoning) > len(raw_reasoning)
    # Streamed: the deltas of each field add up to the whole answer's.
    pieces = {"reasoning": "", "reasoning_content": "", "content": ""}
    for chunk in api.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=MAX_TOKENS,
                                             extra_body=GRAMMAR, stream=True):
        delta = chunk.choices[0].delta
        extra = delta.model_extra or {}
        pieces["reasoning"] += extra.get("reasoning") or ""
        pieces["reasoning_content"] += extra.get("reasoning_content") or ""
        pieces["content"] += delta.content or ""
    assert pieces == {"reasoning": reasoning, "reasoning_content": reasoning, "content": content}
    # gRPC: the same split, chunk by chunk.
    request = pb.GenerateRequest(sampling=pb.SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0, structured_outputs=pb.StructuredOutputs(regex=CONTENT)))
    request.messages.items.add(role="user", content=QUESTION[0]["content"])
    with grpc.insecure_channel(address) as channel:
        responses = list(pb_grpc.GenerationStub(channel).Generate(request, timeout=120))
    assert "".join(r.reasoning for r in responses) == reasoning
    assert responses[-1].usage.reasoning_tokens == MAX_TOKENS  # as the HTTP usage counts them
    assert "".join(r.text for r in responses) == content


def _shot(country: str, city: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"What is the capital of {country}?"},
            {"role": "assistant", "content": f"<think>{country} is a country in Europe.</think>{city}"}]


# Three answered turns, each a think block and then the answer: the model writes its own
# think block and closes it ("<think>France is a country in Europe.</think>Paris" greedy).
FEW_SHOT = [*_shot("Spain", "Madrid"), *_shot("Italy", "Rome"), *_shot("Germany", "Berlin"),
            {"role": "user", "content": "What is the capital of France?"}]
LOWER = "[a-z]{3,12}"  # the answer after the block: lower case only, so not the model's free "Paris"


def test_a_think_block_then_constrained_content(cluster):
    """The model's output holds a closed think block and then content: the grammar holds the
    content only (lower-case letters, where the free answer is "Paris"), the think block is the
    model's free text (upper case and a full stop, which the grammar forbids), split from it in
    the whole answer, the streamed deltas and over gRPC."""
    api, model, address = cluster
    free = api.chat.completions.create(model=model, messages=FEW_SHOT, temperature=0, max_tokens=40)
    message = free.choices[0].message
    assert message.model_extra["reasoning"] == "France is a country in Europe."
    assert message.content.strip() == "Paris" and free.choices[0].finish_reason == "stop"
    held = api.chat.completions.create(model=model, messages=FEW_SHOT, temperature=0, max_tokens=40,
                                       extra_body={"structured_outputs": {"regex": LOWER}})
    answer = held.choices[0].message
    assert answer.model_extra["reasoning"] == message.model_extra["reasoning"]  # the block was free
    assert re.fullmatch(LOWER, answer.content.strip()) and answer.content.strip() != "Paris"
    assert held.choices[0].finish_reason == "stop"
    assert 0 < held.usage.completion_tokens_details.reasoning_tokens < held.usage.completion_tokens
    pieces = {"reasoning": "", "content": ""}
    for chunk in api.chat.completions.create(model=model, messages=FEW_SHOT, temperature=0, max_tokens=40,
                                             extra_body={"structured_outputs": {"regex": LOWER}}, stream=True):
        delta = chunk.choices[0].delta
        pieces["reasoning"] += (delta.model_extra or {}).get("reasoning") or ""
        pieces["content"] += delta.content or ""
    assert pieces == {"reasoning": answer.model_extra["reasoning"], "content": answer.content}
    request = pb.GenerateRequest(sampling=pb.SamplingParams(
        max_tokens=40, temperature=0, structured_outputs=pb.StructuredOutputs(regex=LOWER)))
    for m in FEW_SHOT:
        request.messages.items.add(role=m["role"], content=m["content"])
    with grpc.insecure_channel(address) as channel:
        responses = list(pb_grpc.GenerationStub(channel).Generate(request, timeout=120))
    assert "".join(r.reasoning for r in responses) == answer.model_extra["reasoning"]
    assert "".join(r.text for r in responses) == answer.content


# The answer after the think block as JSON under a schema; the free answer is "Paris", so the
# schema's pattern (lower case) is what the model writes only because the grammar holds it.
SCHEMA = {"type": "object", "properties": {"capital": {"type": "string", "pattern": "^[a-z]{3,12}$"}},
          "required": ["capital"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "name": "capital", "schema": SCHEMA, "strict": True}


def test_a_think_block_then_json_under_a_schema_in_chat_and_responses(cluster):
    """A closed think block, then JSON valid under a json_schema: chat completions split it into
    reasoning / reasoning_content and content, /v1/responses into a reasoning item and a message
    (whole and streamed). The think block is the model's free text, the JSON is not."""
    import json

    import jsonschema

    api, model, _ = cluster
    free = api.chat.completions.create(model=model, messages=FEW_SHOT, temperature=0, max_tokens=40)
    thought = free.choices[0].message.model_extra["reasoning"]
    assert thought == "France is a country in Europe."
    chat = api.chat.completions.create(model=model, messages=FEW_SHOT, temperature=0, max_tokens=40,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "capital", "schema": SCHEMA, "strict": True}})
    message = chat.choices[0].message
    assert message.model_extra["reasoning"] == message.model_extra["reasoning_content"] == thought
    assert chat.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(message.content), SCHEMA)
    assert "<think>" not in message.content and "</think>" not in message.content
    held = api.responses.create(model=model, input=FEW_SHOT, temperature=0, max_output_tokens=40,
                                text={"format": FORMAT}, store=False)
    assert [item.type for item in held.output] == ["reasoning", "message"], held.output
    assert held.status == "completed" and held.output[0].content[0].text == thought
    assert held.output_text == message.content  # the same greedy JSON as the chat answer
    jsonschema.validate(json.loads(held.output_text), SCHEMA)
    assert 0 < held.usage.output_tokens_details.reasoning_tokens < held.usage.output_tokens
    events = list(api.responses.create(model=model, input=FEW_SHOT, temperature=0, max_output_tokens=40,
                                       text={"format": FORMAT}, store=False, stream=True))
    by_kind = lambda kind: [e for e in events if e.type == kind]  # noqa: E731
    assert "".join(e.delta for e in by_kind("response.reasoning_text.delta")) == thought
    assert "".join(e.delta for e in by_kind("response.output_text.delta")) == held.output_text
    assert all(e.output_index == 0 for e in by_kind("response.reasoning_text.delta"))
    assert all(e.output_index == 1 for e in by_kind("response.output_text.delta"))
    assert events[-1].type == "response.completed"
    assert [item.type for item in events[-1].response.output] == ["reasoning", "message"]
