"""The typed request shapes of /v1/responses (router/openai/responses_models.py):
one validation at the edge, a 400 naming the field and the path to the bad
value, and the bodies the official clients (openai, the OpenAI Agents SDK,
LangChain) send accepted as they are."""

from __future__ import annotations

import asyncio

import httpx2 as httpx
import pytest

from cluster.shared.types import FinishReason
from router.backend import ModelInfo
from router.openai.errors import APIError
from router.openai.response_store import MemoryResponseStore
from router.openai.responses_models import CreateRequest, FunctionCallItem, MessageItem, parse_create
from tests.unit.http_api.openai_server import MODEL, FakeBackend, serving
from tests.unit.http_api.test_responses_api import CALL


def test_a_valid_request_is_typed_with_its_defaults():
    request = parse_create({"input": [
        {"role": "user", "content": "Weather?"},  # an easy input message: no type
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}", "status": "completed"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Sunny.", "annotations": [], "logprobs": []}]},
    ], "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}}, "temperature": 0})
    assert isinstance(request, CreateRequest) and request.store and not request.stream and not request.background
    assert [type(item) for item in request.input] == [MessageItem, FunctionCallItem, type(request.input[2]),
                                                      MessageItem]
    assert request.temperature == 0.0 and request.text.format.schema_ == {"type": "object"}
    assert parse_create({"input": "hi"}).input[0].content[0].text == "hi"


@pytest.mark.parametrize("body, param, message", [
    ({"input": "hi", "store": "true"}, "store", "store: Input should be a valid boolean"),  # no coercion
    ({"input": "hi", "temperature": "0.5"}, "temperature", "temperature: Input should be a valid number"),
    ({"input": "hi", "prompt_cache_key": "k"}, "prompt_cache_key", "unknown or unsupported field 'prompt_cache_key'"),
    ({"input": "hi", "metadata": {"a": 1}}, "metadata", "metadata.a: Input should be a valid string"),
    ({"input": "hi", "metadata": {str(i): "v" for i in range(17)}}, "metadata", "at most 16 keys"),
    ({"input": []}, "input", "input: List should have at least 1 item"),
    ({"input": [{"type": "image"}]}, "input", "item 0 has type 'image'"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input",
     "input[0].message.content: a content part of type 'input_image': only text parts"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input", "input[0].message.role: Input should be 'user'"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input",
     "input[0].function_call.call_id: Field required"),
    ({"input": [{"role": "user", "content": "x", "name": "ann"}]}, "input", "input[0].message.name: Extra inputs"),
    ({"input": "hi", "tools": [{"type": "file_search"}]}, "tools", "tool 0 has type 'file_search': only function"),
    ({"input": "hi", "tools": [{"type": "function"}]}, "tools", "tools[0].name: Field required"),
    ({"input": "hi", "tool_choice": "any"}, "tool_choice", "tool_choice: must be 'none', 'auto', 'required'"),
    ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text", "text.format: Input tag 'yaml'"),
    ({"input": "hi", "text": {"verbosity": "high"}}, "text", "text.verbosity: Input should be 'medium'"),
    ({"input": "hi", "reasoning": {"summary": "auto"}}, "reasoning", "reasoning.summary: not supported"),
    ({"input": "hi", "truncation": "auto"}, "truncation", "truncation: 'auto' is not supported"),
    ({"input": "hi", "include": ["reasoning.encrypted_content"]}, "include", "include: not supported"),
    ({"input": "hi", "service_tier": "flex"}, "service_tier", "service_tier: Input should be 'auto' or 'default'"),
    ({"input": "hi", "stream_options": {"include_obfuscation": True}}, "stream_options",
     "stream_options.include_obfuscation: Input should be False"),
    ({"input": "hi", "background": True, "store": False}, "store", "a background response is stored"),
    ({"input": "hi", "background": True, "stream": True}, "stream", "streaming a background response"),
    ({"model": "m"}, "input", "input is required"),
])
def test_a_bad_field_is_one_400_naming_it(body, param, message):
    with pytest.raises(APIError) as caught:
        parse_create(body)
    assert (caught.value.status, caught.value.param) == (400, param)
    assert message in caught.value.message, caught.value.message


@pytest.fixture(scope="module")
def served(router_tok):
    backend = FakeBackend(router_tok)
    backend.model = ModelInfo(MODEL, 4096)
    backend.response_store = MemoryResponseStore()
    with serving(backend) as handle:
        yield backend, handle


def test_the_http_api_answers_with_the_400(served):
    backend, handle = served
    backend.requests.clear()
    reply = httpx.post(f"{handle.url}/responses", timeout=20, json={"input": "hi", "tools": [{"type": "function"}]})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "tools"
    assert "tools[0].name: Field required" in reply.json()["error"]["message"] and not backend.requests


def test_the_agents_sdk_and_langchain_send_bodies_we_accept(served):
    from agents import Agent, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from langchain_openai import ChatOpenAI
    from openai import AsyncOpenAI

    backend, handle = served
    backend.fail, backend.delay, backend.fail_after = None, 0.0, None
    backend.script, backend.script_finish = [CALL], FinishReason.STOP
    set_tracing_disabled(True)

    @function_tool
    def get_weather(city: str) -> str:
        """Returns the weather of a city."""
        backend.script = ["It is", " sunny."]  # the next turn answers
        return f"It is sunny in {city}."

    async def main():
        async with AsyncOpenAI(base_url=handle.url, api_key="unused", max_retries=0) as api:
            agent = Agent(name="weather", instructions="Answer with the weather.", tools=[get_weather],
                          model=OpenAIResponsesModel(model=MODEL, openai_client=api))
            return await Runner.run(agent, "What is the weather in Paris?", max_turns=3)

    result = asyncio.run(main())  # its second turn sends back our function_call item and its output
    assert result.final_output == "It is sunny."
    chat = ChatOpenAI(model=MODEL, base_url=handle.url, api_key="unused", use_responses_api=True, temperature=0,
                      max_tokens=12, max_retries=0)
    assert chat.invoke("Name a color.").text == "It is sunny."
