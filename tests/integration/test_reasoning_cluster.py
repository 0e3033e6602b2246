"""Reasoning split end to end: ``prefixserve up --reasoning-parser qwen3`` on the
default model, whose output a regex grammar makes start with a think block.
The chat answer (whole and streamed) and the gRPC stream split it exactly as
``router/reasoning.py`` splits the raw greedy text of the same prompt, which a
completions request (never split) returns."""

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

THINK = r"<think>[a-z ]{3,16}</think>\n\n[A-Za-z ]{3,16}"
GRAMMAR = {"structured_outputs": {"regex": THINK}}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """``(openai client, model name, gRPC address)``."""
    log_path = tmp_path_factory.mktemp("reasoning-up") / "up.log"
    proc, log = start_up(log_path, "--replica-num-cpus", "0.5", "--grpc-port", "0", "--http-port", "0",
                         "--reasoning-parser", "qwen3")
    try:
        text = wait_for_log(proc, log, "ready: gRPC on")
        base = re.search(r"OpenAI HTTP on (http://127\.0\.0\.1:\d+/v1)", text).group(1)
        address = re.search(r"ready: gRPC on (\S+?:\d+)", text).group(1)
        with openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120) as api:
            yield api, api.models.list().data[0].id, address
    finally:
        stop_up(proc, log)


def test_a_think_block_is_split_from_the_answer(cluster):
    api, model, address = cluster
    message = api.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=64,
                                          extra_body=GRAMMAR).choices[0].message
    reasoning, content = message.model_extra["reasoning"], message.content
    assert reasoning and content and message.model_extra["reasoning_content"] == reasoning
    # The raw text of the same prompt (completions are never split), split offline, is the same.
    tokens = httpx.post(str(api.base_url).rstrip("/").removesuffix("/v1") + "/tokenize", timeout=60,
                        json={"model": model, "messages": QUESTION}).json()["tokens"]
    raw = api.completions.create(model=model, prompt=tokens, temperature=0, max_tokens=64, extra_body=GRAMMAR)
    assert raw.choices[0].text.startswith("<think>")
    assert split_reasoning(ReasoningMode("qwen3"), raw.choices[0].text) == (reasoning, content)
    # Streamed: the deltas of each field add up to the whole answer's.
    pieces = {"reasoning": "", "reasoning_content": "", "content": ""}
    for chunk in api.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=64,
                                             extra_body=GRAMMAR, stream=True):
        delta = chunk.choices[0].delta
        extra = delta.model_extra or {}
        pieces["reasoning"] += extra.get("reasoning") or ""
        pieces["reasoning_content"] += extra.get("reasoning_content") or ""
        pieces["content"] += delta.content or ""
    assert pieces == {"reasoning": reasoning, "reasoning_content": reasoning, "content": content}
    # gRPC: the same split, chunk by chunk.
    request = pb.GenerateRequest(sampling=pb.SamplingParams(
        max_tokens=64, temperature=0, structured_outputs=pb.StructuredOutputs(regex=THINK)))
    request.messages.items.add(role="user", content=QUESTION[0]["content"])
    with grpc.insecure_channel(address) as channel:
        responses = list(pb_grpc.GenerationStub(channel).Generate(request, timeout=120))
    assert "".join(r.reasoning for r in responses) == reasoning
    assert "".join(r.text for r in responses) == content
