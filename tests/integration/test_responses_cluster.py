"""/v1/responses through ``prefixserve up`` on the default model: stored in the
cluster's Redis, a continuation reuses the first turn's KV, a stream's deltas
equal the non-streamed greedy text."""

from __future__ import annotations

import re
import signal
import time

import openai
import pytest

from tests.integration.up_process import running_up

STORY = ("Write a short story about a lighthouse keeper who finds a message in a bottle. "
         "The keeper lives alone on a rocky island far from the coast, and every night lights the lamp. ") * 3


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """``(up process, openai client)``."""
    log_path = tmp_path_factory.mktemp("responses-up") / "up.log"
    with running_up(log_path, "--block-size", "16", "--replica-num-cpus", "0.5", "--grpc-port", "0",
                    "--http-port", "0") as (proc, text):
        base = re.search(r"OpenAI HTTP on (http://127\.0\.0\.1:\d+/v1)", text).group(1)
        with openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120) as api:
            yield proc, api


@pytest.fixture()
def client(cluster):
    return cluster[1]


def test_a_continuation_carries_the_context_and_reuses_its_kv(client):
    first = client.responses.create(input=STORY, temperature=0, max_output_tokens=16)
    assert first.status in ("completed", "incomplete") and first.output_text
    second = client.responses.create(input="Give the story a title.", previous_response_id=first.id,
                                     temperature=0, max_output_tokens=8)
    assert second.usage.input_tokens >= first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= 0.8 * first.usage.input_tokens, second.usage
    # Stored in Redis: a new client (any router) reads it back.
    assert client.responses.retrieve(second.id).output_text == second.output_text
    assert [i.type for i in client.responses.input_items.list(second.id).data] == ["message"]


def test_stream_deltas_equal_the_greedy_text(client):
    whole = client.responses.create(input="Name three colors.", temperature=0, max_output_tokens=12, store=False)
    events = list(client.responses.create(input="Name three colors.", temperature=0, max_output_tokens=12,
                                          stream=True, store=False))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"], kinds
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert set(kinds[4:-4]) == {"response.output_text.delta"}, kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_the_openai_agents_sdk_runs_an_agent_with_a_function_tool(client):
    import asyncio

    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    calls = []

    @function_tool
    def get_weather(city: str) -> str:
        """Returns the weather of a city."""
        calls.append(city)
        return f"It is sunny in {city}."

    async def main():
        async with AsyncOpenAI(base_url=str(client.base_url), api_key="unused", max_retries=0) as api:
            model = OpenAIResponsesModel(model="SmolLM2-135M-Instruct", openai_client=api)
            agent = Agent(name="weather", instructions="Answer with the weather.", tools=[get_weather], model=model,
                          model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=48))
            return await Runner.run(agent, "What is the weather in Paris?", max_turns=4)

    result = asyncio.run(main())
    kinds = [type(item).__name__ for item in result.new_items]
    # tool_choice required: the engine constrains the first turn to a call; the SDK runs the
    # tool, sends its output back, and the model answers in text (the SDK resets tool_choice).
    assert kinds[:2] == ["ToolCallItem", "ToolCallOutputItem"] and kinds[-1] == "MessageOutputItem", kinds
    assert len(calls) == 1 and isinstance(result.final_output, str) and result.final_output


def test_langchain_chat_openai_with_the_responses_api_answers(client):
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(model="SmolLM2-135M-Instruct", base_url=str(client.base_url), api_key="unused",
                      use_responses_api=True, temperature=0, max_tokens=12, max_retries=0)
    reply = chat.invoke("Name a color.")
    whole = client.responses.create(input="Name a color.", temperature=0, max_output_tokens=12, store=False)
    assert reply.text == whole.output_text and reply.text


WEATHER = {"type": "function", "name": "get_weather", "description": "The weather of a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def test_a_function_tool_round_trip_with_the_openai_client(client):
    """function_call -> function_call_output -> answer, by previous_response_id: tool_choice
    required makes the first turn a call (a grammar), none makes the second one text."""
    import json

    call = client.responses.create(input="What is the weather in Paris?", tools=[WEATHER], tool_choice="required",
                                   temperature=0, max_output_tokens=48)
    calls = [item for item in call.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather", call.output
    assert isinstance(json.loads(calls[0].arguments)["city"], str)
    answer = client.responses.create(previous_response_id=call.id, tools=[WEATHER], tool_choice="none",
                                     temperature=0, max_output_tokens=16, input=[
                                         {"type": "function_call_output", "call_id": calls[0].call_id,
                                          "output": "Sunny, 21 C."}])
    assert [item.type for item in answer.output] == ["message"] and answer.output_text, answer.output
    assert answer.usage.input_tokens >= call.usage.input_tokens + call.usage.output_tokens  # the call came along
    assert [i.type for i in client.responses.input_items.list(answer.id).data] == ["function_call_output"]


def test_json_schema_delete_background_cancel_and_refusals(client):
    """The rest of the openai client's surface through the cluster: text.format json_schema gives
    valid JSON, delete forgets, a background response completes when polled and a long one cancels,
    a built-in tool and an unknown id are refused by name."""
    import json

    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Lyon", "Nice"]}},
              "required": ["city"], "additionalProperties": False}
    held = client.responses.create(input="Which city is the capital of France? Answer in JSON.", temperature=0,
                                   max_output_tokens=32, text={"format": {"type": "json_schema", "name": "city",
                                                                          "schema": schema, "strict": True}})
    assert held.status == "completed" and json.loads(held.output_text)["city"] in ("Paris", "Lyon", "Nice")
    client.responses.delete(held.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(held.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_0123456789abcdef")
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(input="Search the web.", tools=[{"type": "web_search"}], max_output_tokens=4)
    assert "web_search" in err.value.message, err.value.message
    greedy = client.responses.create(input="Count to five.", temperature=0, max_output_tokens=8, store=False)
    queued = client.responses.create(input="Count to five.", temperature=0, max_output_tokens=8, background=True)
    assert queued.status in ("queued", "in_progress")
    deadline = time.monotonic() + 120
    while (done := client.responses.retrieve(queued.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, done.status
        time.sleep(0.2)
    assert done.status in ("completed", "incomplete") and done.output_text == greedy.output_text
    long = client.responses.create(input=STORY, temperature=0, max_output_tokens=400, background=True)
    assert client.responses.cancel(long.id).status == "cancelled"
    assert client.responses.retrieve(long.id).status == "cancelled"


def test_with_redis_killed_stored_requests_503_and_unstored_ones_answer(cluster):
    """Last in this module: it leaves the cluster without its Redis."""
    import os

    import psutil

    proc, client = cluster
    first = client.responses.create(input="Say hello.", temperature=0, max_output_tokens=4)
    (redis,) = [p for p in psutil.Process(proc.pid).children(recursive=True) if p.name() == "redis-server"]
    os.kill(redis.pid, signal.SIGKILL)
    for _ in range(100):  # not our child: poll until it is gone (or a zombie of up's)
        if not redis.is_running() or redis.status() == psutil.STATUS_ZOMBIE:
            break
        time.sleep(0.1)
    for fields in ({}, {"previous_response_id": first.id}):
        with pytest.raises(openai.APIStatusError) as err:
            client.responses.create(input="Again.", temperature=0, max_output_tokens=4, **fields)
        assert err.value.status_code == 503 and "store: false" in err.value.message, err.value.message
    # Routing falls back to load only; a response that stores nothing still answers.
    alone = client.responses.create(input="Say hello.", temperature=0, max_output_tokens=4, store=False)
    assert alone.output_text == first.output_text
