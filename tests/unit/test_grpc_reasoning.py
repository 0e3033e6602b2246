"""Reasoning over gRPC (``GenerateResponse.reasoning``, ``router/reasoning.py``):
a real ``RouterServer`` on loopback over a fake backend that streams a
Qwen3-style output in pieces that cut the tags; tool calls are read from the
content after the think block only."""

from __future__ import annotations


import grpc
import pytest

from cluster.shared.types import FinishReason
from router.pb import generation_pb2 as pb
from router.pb import generation_pb2_grpc as pb_grpc
from tests.factories import make_router_tokenizer
from tests.unit.grpc_server import serving_grpc
from tests.unit.test_grpc_tools import WEATHER, RecordingBackend

# ChatML with Qwen3's switch: enable_thinking false writes an empty think block.
QWEN3ISH = (
    "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    "{% endif %}"
)
THOUGHT = ["<thi", "nk>\nParis", " weather?\n</th", "ink>\n", "\nSunny", "."]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tokenizer = make_router_tokenizer(tmp_path_factory.mktemp("grpc-think-tok"), QWEN3ISH)
    tokenizer.reasoning_parser = "qwen3"
    backend = RecordingBackend(tokenizer)
    with serving_grpc(backend) as address:
        yield backend, address


@pytest.fixture
def backend(served):
    backend = served[0]
    backend.requests.clear()
    backend.pieces, backend.finish = THOUGHT, FinishReason.STOP
    backend.tokenizer.reasoning_parser = "qwen3"
    return backend


def generate(address: str, request: pb.GenerateRequest) -> list[pb.GenerateResponse]:
    with grpc.insecure_channel(address) as channel:
        return list(pb_grpc.GenerationStub(channel).Generate(request, timeout=20))


def chat(content: str = "Weather in Paris?", **fields) -> pb.GenerateRequest:
    msg = pb.GenerateRequest(**fields)
    msg.messages.items.add(role="user", content=content)
    return msg


def test_each_chunk_carries_its_reasoning_and_the_text_only_the_content(served, backend):
    responses = generate(served[1], chat())
    assert len(responses) == len(THOUGHT)
    assert "".join(r.reasoning for r in responses) == "Paris weather?"
    assert "".join(r.text for r in responses) == "Sunny."
    assert [r.reasoning for r in responses][:3] == ["", "Paris", " weather?"]  # released as it comes
    assert responses[-1].finish_reason == "stop"
    # One token a piece: the four pieces up to "</think>" (tags included), as the HTTP API counts them.
    assert responses[-1].usage.reasoning_tokens == 4 and responses[-1].usage.completion_tokens == len(THOUGHT)


def test_tool_calls_come_from_the_content_after_the_think_block(served, backend):
    backend.pieces = ["<think>\nI could say ", CALL[:20], CALL[20:], "\n</think>\n\n", CALL[:30], CALL[30:]]
    responses = generate(served[1], chat(tools=[WEATHER]))
    assert "".join(r.reasoning for r in responses) == "I could say " + CALL
    calls = [(c.name, c.arguments) for r in responses for c in r.tool_calls]
    assert calls == [("get_weather", '{"city": "Paris"}')]
    assert "".join(r.text for r in responses) == "" and responses[-1].finish_reason == "tool_calls"


def test_no_parser_and_prompts_leave_the_text_whole(served, backend):
    whole = "".join(THOUGHT)
    responses = generate(served[1], pb.GenerateRequest(prompt="Weather in Paris?"))  # not chat: not split
    assert "".join(r.text for r in responses) == whole and not any(r.reasoning for r in responses)
    assert responses[-1].usage.reasoning_tokens == 0
    backend.tokenizer.reasoning_parser = "none"
    responses = generate(served[1], chat())
    assert "".join(r.text for r in responses) == whole and not any(r.reasoning for r in responses)


def test_a_grammar_holds_the_content_after_the_reasoning(served, backend, tmp_path):
    # The prompt opens <think>: the engine's grammar lets the block through first ("open"),
    # then holds the call's arguments; the router splits the same way.
    opened = make_router_tokenizer(tmp_path, QWEN3ISH.replace("assistant\n' }}", "assistant\n<think>\n' }}"))
    opened.reasoning_parser = "deepseek_r1"
    kept, backend.tokenizer = backend.tokenizer, opened
    backend.pieces = ["Paris, so", " the city.\n</th", "ink>\n\n", '{"city": ', '"Paris"}']
    try:
        responses = generate(served[1], chat(tools=[WEATHER], tool_choice_function="get_weather"))
    finally:
        backend.tokenizer = kept
    assert backend.requests[-1].sampling_params.structured_outputs.reasoning == "open"
    assert "".join(r.reasoning for r in responses) == "Paris, so the city."
    assert [(c.name, c.arguments) for r in responses for c in r.tool_calls] == [("get_weather", '{"city": "Paris"}')]
    generate(served[1], chat(tools=[WEATHER], tool_choice_function="get_weather"))  # qwen3: a block may come first
    assert backend.requests[-1].sampling_params.structured_outputs.reasoning == "optional"


def test_a_prompt_that_opens_think_starts_the_output_in_reasoning(served, backend, tmp_path):
    opened = make_router_tokenizer(tmp_path, QWEN3ISH.replace("assistant\n' }}", "assistant\n<think>\n' }}"))
    opened.reasoning_parser = "qwen3"
    kept, backend.tokenizer = backend.tokenizer, opened
    backend.pieces = ["Hmm, Paris", ".\n</think>", "\n\nSunny."]
    try:
        responses = generate(served[1], chat())
    finally:
        backend.tokenizer = kept
    assert "".join(r.reasoning for r in responses) == "Hmm, Paris."
    assert "".join(r.text for r in responses) == "Sunny."


def test_chat_template_kwargs_reach_the_template(served, backend):
    responses = generate(served[1], chat(chat_template_kwargs_json='{"enable_thinking": false}'))
    assert backend.requests[-1].prompt_token_ids == backend.tokenizer.render_chat(
        [{"role": "user", "content": "Weather in Paris?"}], template_kwargs={"enable_thinking": False})
    # The prompt closed the think block: the output is all content.
    assert "".join(r.text for r in responses) == "".join(THOUGHT) and not any(r.reasoning for r in responses)


@pytest.mark.parametrize("request_, message", [
    (chat(chat_template_kwargs_json="{nope"), "chat_template_kwargs_json is not valid JSON"),
    (chat(chat_template_kwargs_json="[1]"), "must be a JSON object"),
    (chat(chat_template_kwargs_json='{"tools": 1}'), "may not set tools"),
    (pb.GenerateRequest(prompt="hi", chat_template_kwargs_json="{}"), "applies to messages only"),
])
def test_bad_chat_template_kwargs_are_invalid_argument(served, backend, request_, message):
    with pytest.raises(grpc.RpcError) as err:
        generate(served[1], request_)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in err.value.details()
    assert not backend.requests
