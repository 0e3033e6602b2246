"""Tool calling over gRPC (``GenerateRequest.tools``, ``router/convert_tools.py``),
through a real ``RouterServer`` on loopback with a fake backend that records
what it receives and streams scripted text.

Checked exactly: the constraint the backend gets per ``tool_choice``; the
prompt, which must be the HTTP API's for the same conversation; the
responses of streamed Hermes, Llama 3 JSON and named-function output (text
without the calls, each call once and whole, finish_reason ``tool_calls``);
and every bad tool field refused with INVALID_ARGUMENT naming it.
"""

from __future__ import annotations

import json
import re
from typing import AsyncIterator, Sequence

import grpc
import pytest

from cluster.shared.chat_template import TOOLS_FOOTER, TOOLS_HEADER
from cluster.shared.structured import StructuredOutputsParams
from cluster.shared.types import FinishReason, GenerationRequest, StreamChunk
from router.backend import ModelInfo
from router.openai.protocol import parse_request
from router.pb import generation_pb2 as pb
from router.pb import generation_pb2_grpc as pb_grpc
from router.tokenizer import RouterTokenizer
from tests.factories import make_router_tokenizer
from tests.unit.grpc_server import serving_grpc

MODEL = "tiny"
# SmolLM2's template (ChatML, no tools): tools reach it as the built-in Hermes block.
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = pb.Tool(name="get_weather", description="Weather now", parameters_json=json.dumps(CITY))
TIME = pb.Tool(name="get-time")  # no parameters
CALL_ID = re.compile(r"^call_[A-Za-z0-9]{24}$")


class RecordingBackend:
    """Records each request; streams ``pieces`` as chunks, the last one finished with ``finish``."""

    def __init__(self, tokenizer: RouterTokenizer) -> None:
        self.tokenizer = tokenizer
        self.model = ModelInfo(MODEL, 4096)
        self.requests: list[GenerationRequest] = []
        self.pieces: Sequence[str] = ("hi",)
        self.finish = FinishReason.STOP

    async def stream(self, request: GenerationRequest) -> AsyncIterator[StreamChunk]:
        self.requests.append(request)
        for i, piece in enumerate(self.pieces):
            last = i == len(self.pieces) - 1
            yield StreamChunk(request.request_id, [10 + i], piece, self.finish if last else None,
                              prompt_tokens=len(request.prompt_token_ids), completion_tokens=i + 1)


@pytest.fixture(scope="module")
def router_tok(tmp_path_factory) -> RouterTokenizer:
    return make_router_tokenizer(tmp_path_factory.mktemp("grpc-tools-tok"), CHATML)


@pytest.fixture(scope="module")
def served(router_tok):
    """``(backend, address)`` of one RouterServer on its own event loop."""
    backend = RecordingBackend(router_tok)
    with serving_grpc(backend) as address:
        yield backend, address


@pytest.fixture
def backend(served, router_tok) -> RecordingBackend:
    backend = served[0]
    backend.requests.clear()
    backend.pieces, backend.finish, backend.tokenizer = ("hi",), FinishReason.STOP, router_tok
    return backend


def generate(address: str, request: pb.GenerateRequest) -> list[pb.GenerateResponse]:
    with grpc.insecure_channel(address) as channel:
        return list(pb_grpc.GenerationStub(channel).Generate(request, timeout=20))


def make_request(content: str = "Weather in Paris?", **fields) -> pb.GenerateRequest:
    msg = pb.GenerateRequest(tools=fields.pop("tools", [WEATHER, TIME]), **fields)
    msg.messages.items.add(role="user", content=content)
    return msg


def summary(responses: list[pb.GenerateResponse]) -> list[tuple]:
    """``(text, [(name, arguments)], finish_reason)`` per response."""
    return [(r.text, [(c.name, c.arguments) for c in r.tool_calls], r.finish_reason) for r in responses]


# --------------------------------------------------------------------------- the request


def test_tool_choice_required_constrains_the_output_to_an_array_of_calls(served, backend):
    generate(served[1], make_request(tool_choice="required", parallel_tool_calls=False))
    call = {"type": "object", "required": ["name", "parameters"], "additionalProperties": False}
    expected = {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object", "properties": {"name": {"const": "get_weather"}, "parameters": CITY},
         "required": call["required"], "additionalProperties": False},
        {"type": "object", "properties": {"name": {"const": "get-time"},
                                          "parameters": {"type": "object", "properties": {}}},
         "required": call["required"], "additionalProperties": False},
    ]}, "maxItems": 1}
    [request] = backend.requests
    assert request.sampling_params.structured_outputs == StructuredOutputsParams(json=expected)


@pytest.mark.parametrize("fields", [{"tool_choice_function": "get_weather"},
                                    {"tool_choice": "function", "tool_choice_function": "get_weather"}])
def test_a_named_function_constrains_the_output_to_its_arguments(served, backend, fields):
    generate(served[1], make_request(**fields))
    [request] = backend.requests
    assert request.sampling_params.structured_outputs == StructuredOutputsParams(json=CITY)


@pytest.mark.parametrize("choice", ["", "auto", "none"])
def test_auto_and_none_leave_the_output_free(served, backend, choice):
    generate(served[1], make_request(tool_choice=choice))
    assert backend.requests[0].sampling_params.structured_outputs is None


def test_a_strict_tool_in_auto_mode_gets_a_structural_tag(served, backend):
    strict = pb.Tool(name="get_weather", parameters_json=json.dumps(CITY), strict=True)
    generate(served[1], make_request(tools=[strict]))
    tag = {"type": "structural_tag", "structures": [
        {"begin": '<tool_call>\n{"name": "get_weather", "arguments": ', "schema": CITY, "end": "}\n</tool_call>"}],
        "triggers": ["<tool_call>"]}
    assert backend.requests[0].sampling_params.structured_outputs == StructuredOutputsParams(structural_tag=tag)


def test_the_prompt_is_the_http_apis_for_the_same_conversation(served, backend, router_tok):
    msg = make_request("Weather in Paris and the time?", tool_choice="none")
    assistant = msg.messages.items.add(role="assistant")
    assistant.tool_calls.add(id="call_1", name="get_weather", arguments='{"city": "Paris"}')
    assistant.tool_calls.add(id="call_2", name="get-time")  # empty arguments: {}
    msg.messages.items.add(role="tool", content="18 C", tool_call_id="call_1", name="get_weather")
    msg.messages.items.add(role="tool", content="12:00", tool_call_id="call_2")
    generate(served[1], msg)
    body = {"model": MODEL, "tool_choice": "none", "messages": [
        {"role": "user", "content": "Weather in Paris and the time?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get-time", "arguments": "{}"}}]},
        {"role": "tool", "content": "18 C", "tool_call_id": "call_1"},
        {"role": "tool", "content": "12:00", "tool_call_id": "call_2"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                                    "parameters": CITY}},
                  {"type": "function", "function": {"name": "get-time"}}]}
    http = parse_request(body, True, router_tok, ModelInfo(MODEL, 4096))
    prompt_ids = backend.requests[0].prompt_token_ids
    assert prompt_ids == http.request.prompt_token_ids
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": CITY}},
             {"type": "function", "function": {"name": "get-time", "parameters": {"type": "object", "properties": {}}}}]
    assert router_tok.decode(prompt_ids, skip_special_tokens=False) == (
        "<|im_start|>system\n" + TOOLS_HEADER + "".join("\n" + json.dumps(t) for t in tools) + TOOLS_FOOTER
        + "<|im_end|>\n<|im_start|>user\nWeather in Paris and the time?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get-time", "arguments": {}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n18 C\n</tool_response>\n<tool_response>\n12:00\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n")


# --------------------------------------------------------------------------- the responses


def test_streamed_hermes_calls_come_whole_on_the_chunk_that_closes_them(served, backend):
    backend.pieces = ("Let me check.", " <tool", '_call>\n{"name": "get_weather", ',
                      '"arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get-time"',
                      ', "arguments": {}}\n</tool_call>', "")
    responses = generate(served[1], make_request())
    assert summary(responses) == [
        ("Let me check.", [], ""),
        ("", [], ""),  # " <tool" may start a call: held back
        ("", [], ""),
        ("", [("get_weather", '{"city": "Paris"}')], ""),
        ("", [("get-time", "{}")], ""),
        ("", [], "tool_calls"),
    ]
    ids = [c.id for r in responses for c in r.tool_calls]
    assert all(CALL_ID.match(i) for i in ids) and len(set(ids)) == 2
    assert [list(r.token_ids) for r in responses] == [[10], [11], [12], [13], [14], [15]]  # every token, unparsed
    assert responses[-1].usage.completion_tokens == 6


def test_text_that_is_no_call_stays_text_and_the_finish_reason_stop(served, backend):
    backend.pieces = ("a <tool", "box> is not a call", "")
    assert summary(generate(served[1], make_request())) == [
        ("a", [], ""), (" <toolbox> is not a call", [], ""), ("", [], "stop")]


def test_a_call_cut_by_max_tokens_stays_text_and_length_stays(served, backend):
    backend.pieces, backend.finish = ('<tool_call>\n{"name": "get_weather", "arguments": {"ci',), FinishReason.LENGTH
    assert summary(generate(served[1], make_request())) == [
        ('<tool_call>\n{"name": "get_weather", "arguments": {"ci', [], "length")]


def test_parallel_tool_calls_false_keeps_the_first_call(served, backend):
    backend.pieces = ('<tool_call>\n{"name": "get-time", "arguments": {}}\n</tool_call>',
                      '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    assert summary(generate(served[1], make_request(parallel_tool_calls=False))) == [
        ("", [("get-time", "{}")], ""), ("", [], "tool_calls")]


def test_a_named_functions_call_comes_whole_on_the_last_chunk(served, backend):
    backend.pieces = ('{"city": ', '"Paris"}')
    responses = generate(served[1], make_request(tool_choice_function="get_weather"))
    assert summary(responses) == [("", [], ""), ("", [("get_weather", '{"city": "Paris"}')], "tool_calls")]
    assert CALL_ID.match(responses[-1].tool_calls[0].id)


def test_required_calls_come_as_their_objects_close(served, backend):
    backend.pieces = ('[{"name": "get-time", "parameters": {}}', ', {"name": "get_weather", "parameters": '
                      '{"city": "Rome"}}]')
    assert summary(generate(served[1], make_request(tool_choice="required"))) == [
        ("", [("get-time", "{}")], ""), ("", [("get_weather", '{"city": "Rome"}')], "tool_calls")]


def test_tool_choice_none_returns_the_text_as_is(served, backend):
    backend.pieces = ('<tool_call>\n{"name": "get-time", "arguments": {}}\n</tool_call>',)
    assert summary(generate(served[1], make_request(tool_choice="none"))) == [
        ('<tool_call>\n{"name": "get-time", "arguments": {}}\n</tool_call>', [], "stop")]


def test_the_routers_tool_call_parser_picks_the_format(served, backend, tmp_path):
    backend.tokenizer = make_router_tokenizer(tmp_path, CHATML)
    backend.tokenizer.tool_call_parser = "llama3_json"  # what --tool-call-parser llama3_json builds
    backend.pieces = ('{"name": "get_weather", "parameters": {"city": "Lima"}}', '; {"name": "get-time"}')
    assert summary(generate(served[1], make_request())) == [
        ("", [("get_weather", '{"city": "Lima"}')], ""), ("", [("get-time", "{}")], "tool_calls")]


def test_requests_without_tools_are_answered_as_before(served, backend):
    backend.pieces = ('<tool_call>\n{"name": "get-time", "arguments": {}}\n</tool_call>',)
    assert summary(generate(served[1], make_request(tools=[]))) == [
        ('<tool_call>\n{"name": "get-time", "arguments": {}}\n</tool_call>', [], "stop")]


# --------------------------------------------------------------------------- bad requests


def _with_history(*items: pb.ChatMessage) -> pb.GenerateRequest:
    msg = pb.GenerateRequest()
    msg.messages.items.extend(items)
    return msg


def _on_prompt(**fields) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt="hi", **fields)


def _with_json_object(**fields) -> pb.GenerateRequest:
    msg = make_request(**fields)
    msg.sampling.structured_outputs.json_object = True
    return msg


BAD = [
    (make_request(tool_choice="maybe"),
     "tool_choice must be one of none, auto, required or function (with tool_choice_function), got 'maybe'"),
    (make_request(tool_choice="function"), 'tool_choice_function is empty: tool_choice "function" needs'),
    (make_request(tool_choice="auto", tool_choice_function="get_weather"),
     "tool_choice_function names 'get_weather' but tool_choice is 'auto'"),
    (make_request(tool_choice_function="get_wether"),
     "tool_choice_function names the function 'get_wether', which is not in tools (get_weather, get-time)"),
    (make_request(tools=[], tool_choice="required"), "tool_choice needs tools"),
    (make_request(tools=[pb.Tool(name="f", parameters_json="{not json")]), "tools[0].parameters_json is not JSON ("),
    (make_request(tools=[TIME, pb.Tool(name="f", parameters_json='{"type": "array"}')]),
     "tools[1].parameters_json must be a JSON schema of an object"),
    (make_request(tools=[pb.Tool(name="get weather")]), "tools[0].name must match ^[a-zA-Z0-9_-]{1,64}$"),
    (make_request(tools=[TIME, TIME]), "tools[1].name 'get-time' is given twice"),
    (make_request(tools=[pb.Tool(name=f"f{i}") for i in range(129)]), "tools has 129 tools: at most 128"),
    (_on_prompt(tools=[TIME]), "tools needs messages input"),
    (_on_prompt(tool_choice_function="get-time"), "tool_choice_function needs messages input"),
    (_on_prompt(parallel_tool_calls=True), "parallel_tool_calls needs messages input"),
    (_with_json_object(tool_choice="required"),
     "tool_choice 'required' holds the output to tool calls, and sampling.structured_outputs holds it"),
    (_with_history(pb.ChatMessage(role="user", content="q"), pb.ChatMessage(role="tool", content="18 C")),
     "messages.items[1].tool_call_id must be the id of the call this tool message answers"),
    (_with_history(pb.ChatMessage(role="user", content="q", tool_call_id="call_1")),
     "messages.items[0].tool_call_id is only allowed on tool messages"),
    (_with_history(pb.ChatMessage(role="user", content="q", tool_calls=[pb.ToolCall(id="c", name="f")])),
     "messages.items[0].tool_calls is only allowed on assistant messages"),
    (_with_history(pb.ChatMessage(role="user", content="q"),
                   pb.ChatMessage(role="assistant", tool_calls=[pb.ToolCall(id="c", arguments="{}")])),
     "messages.items[1].tool_calls[0].name must be a non-empty string"),
]


@pytest.mark.parametrize("request_msg,details", BAD, ids=[d[:40] for _, d in BAD])
def test_bad_tool_fields_are_invalid_argument_naming_the_field(served, backend, request_msg, details):
    with pytest.raises(grpc.RpcError) as info:
        generate(served[1], request_msg)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(details), info.value.details()
    assert backend.requests == []
