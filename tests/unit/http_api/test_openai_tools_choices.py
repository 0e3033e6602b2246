"""The OpenAI-compatible HTTP API's tool calling, several choices (``n``,
``best_of``, lists of prompts), echo, prompt logprobs and the tokenize
routes, through the official ``openai`` client (server:
``tests/unit/http_api/openai_server.py``)."""

from __future__ import annotations

import httpx2
import pytest

from cluster.shared.types import FinishReason
from router.backend import ModelInfo
from tests.unit.http_api.openai_server import MAX_MODEL_LEN, MODEL, FakeBackend


# --------------------------------------------------------------------------- tools

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
# A Hermes answer: text, a call with a literal </tool_call> in an argument, a second call.
TOOL_ANSWER = ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "a</tool_call>b"}}\n'
               '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
EXPECTED_CALLS = [("get_weather", '{"city": "a</tool_call>b"}'), ("get_time", "{}")]
TOOL_MODEL_LEN = 4096  # the tiny BPE spends ~500 tokens on the built-in tool block


@pytest.fixture()
def tool_backend(backend) -> FakeBackend:
    """The fake with a context long enough for the tool block."""
    backend.model = ModelInfo(MODEL, TOOL_MODEL_LEN)
    yield backend
    backend.model = ModelInfo(MODEL, MAX_MODEL_LEN)


def _pieces(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


def test_chat_with_tools_returns_tool_calls(client, tool_backend, router_tok):
    tool_backend.script = _pieces(TOOL_ANSWER, 5)
    messages = [{"role": "user", "content": "hello"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL, TIME_TOOL])
    message = out.choices[0].message
    assert message.content == "Checking." and out.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == EXPECTED_CALLS
    assert all(c.type == "function" and c.id.startswith("call_") and len(c.id) == 29 for c in message.tool_calls)
    request = tool_backend.requests[-1]
    # The tiny template takes no tools: the built-in block rides in a system message of its own.
    assert request.prompt_token_ids == router_tok.render_chat(messages, tools=[WEATHER_TOOL, TIME_TOOL])
    assert "<tools>" in router_tok.decode(request.prompt_token_ids)
    assert request.sampling_params.structured_outputs is None  # auto without strict tools: free text


def test_streamed_tool_calls_assemble_to_the_same_calls(client, tool_backend):
    for size in (1, 3, 7, 64):
        tool_backend.script = _pieces(TOOL_ANSWER, size)
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hello"}], tools=[WEATHER_TOOL, TIME_TOOL], stream=True))
        content = "".join(c.choices[0].delta.content or "" for c in chunks)
        calls: dict[int, list] = {}
        for chunk in chunks:
            for piece in chunk.choices[0].delta.tool_calls or []:
                if piece.id is not None:
                    assert piece.index not in calls and piece.type == "function" and piece.function.name
                    calls[piece.index] = [piece.function.name, ""]
                calls[piece.index][1] += piece.function.arguments or ""
        assert content == "Checking." and [tuple(calls[i]) for i in sorted(calls)] == EXPECTED_CALLS
        assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_named_tool_choice_constrains_and_streams_arguments(client, tool_backend):
    tool_backend.script = ['{"city"', ': "Paris"}']
    choice = {"type": "function", "function": {"name": "get_weather"}}
    body = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], tools=[WEATHER_TOOL, TIME_TOOL],
                tool_choice=choice)
    out = client.chat.completions.create(**body)
    params = tool_backend.requests[-1].sampling_params
    assert params.structured_outputs.schema() == WEATHER_TOOL["function"]["parameters"]
    call = out.choices[0].message.tool_calls[0]
    assert (out.choices[0].message.content, call.function.name, call.function.arguments) == (
        None, "get_weather", '{"city": "Paris"}')
    chunks = list(client.chat.completions.create(**body, stream=True))
    pieces = [c.choices[0].delta.tool_calls[0].function.arguments for c in chunks if c.choices[0].delta.tool_calls]
    assert pieces == ['{"city"', ': "Paris"}']


def test_required_tool_choice_gets_an_array_schema(client, tool_backend):
    tool_backend.script = ['[{"name": "get_time", "parameters": {}}]']
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                         tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required",
                                         parallel_tool_calls=False)
    schema = tool_backend.requests[-1].sampling_params.structured_outputs.schema()
    assert schema["type"] == "array" and (schema["minItems"], schema["maxItems"]) == (1, 1)
    assert [t["properties"]["name"] for t in schema["items"]["anyOf"]] == [{"const": "get_weather"},
                                                                           {"const": "get_time"}]
    assert [(c.function.name, c.function.arguments) for c in out.choices[0].message.tool_calls] == [("get_time", "{}")]


def test_cut_call_stays_content_with_finish_length(client, tool_backend):
    tool_backend.script = _pieces('<tool_call>\n{"name": "get_time", "argu', 4)
    tool_backend.script_finish = FinishReason.LENGTH
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                         tools=[TIME_TOOL])
    message = out.choices[0].message
    assert message.tool_calls is None and message.content == '<tool_call>\n{"name": "get_time", "argu'
    assert out.choices[0].finish_reason == "length"


def test_tool_history_renders_and_tool_choice_none_is_plain_text(client, tool_backend, router_tok):
    messages = [
        {"role": "user", "content": "time?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_x", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_x", "content": "12:00"},
    ]
    tool_backend.script = ["<tool_call>", "\n{}"]
    out = client.chat.completions.create(model=MODEL, messages=messages, tools=[TIME_TOOL], tool_choice="none")
    assert out.choices[0].message.content == "<tool_call>\n{}" and out.choices[0].finish_reason == "stop"
    text = router_tok.decode(tool_backend.requests[-1].prompt_token_ids)
    assert '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>' in text
    assert "<tool_response>\n12:00\n</tool_response>" in text and "<tools>" in text  # none still offers them


@pytest.mark.parametrize("extra, param, words", [
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not in tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER_TOOL, WEATHER_TOOL]}, "tools", "unique"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", "must match"),
    ({"functions": [{"name": "f", "parameters": {}}]}, "functions", "deprecated"),
    ({"tools": [WEATHER_TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", "response_format"),
    ({"messages": [{"role": "tool", "content": "12:00"}]}, "messages", "tool_call_id"),
])
def test_bad_tool_requests_get_400(served, tool_backend, extra, param, words):
    _, handle = served
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}
    response = httpx2.post(handle.url + "/chat/completions", json=body)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == param and words in error["message"], error


def test_tools_on_completions_get_400(served):
    _, handle = served
    response = httpx2.post(handle.url + "/completions", json={"prompt": "hi", "tools": [WEATHER_TOOL]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "tools"


# ------------------------------------------------- choices, prompts, echo, tokenize
def test_n_returns_indexed_choices_and_sums_usage(client, backend):
    out = client.completions.create(model=MODEL, prompt="hello", max_tokens=2, n=3, seed=4)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == [" w0 w1", " w0/1 w1/1", " w0/2 w1/2"]
    assert backend.requests[-1].sampling_params.n == 3 and backend.requests[-1].sampling_params.seed == 4
    assert out.usage.completion_tokens == 6 and out.usage.prompt_tokens == len(backend.requests[-1].prompt_token_ids)


def test_n_streamed_tags_every_chunk_with_its_choice(client):
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                            n=3, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    content: dict[int, str] = {}
    roles, finishes = set(), {}
    for chunk in chunks:
        for choice in chunk.choices:
            if choice.delta.role:
                roles.add(choice.index)
            content[choice.index] = content.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert roles == {0, 1, 2} and finishes == {0: "length", 1: "length", 2: "length"}
    assert content == {0: " w0 w1", 1: " w0/1 w1/1", 2: " w0/2 w1/2"}
    assert chunks[-1].usage.completion_tokens == 6


def test_best_of_returns_the_n_best_by_cumulative_logprob(client, backend):
    # The fake's choice c has logprob -0.5 - c per token: choices 0 and 1 are the best two.
    out = client.completions.create(model=MODEL, prompt="hello", max_tokens=2, n=2, best_of=4)
    params = backend.requests[-1].sampling_params
    assert (params.n, params.best_of, params.logprobs) == (2, 4, 0)  # logprobs computed to rank
    assert [c.text for c in out.choices] == [" w0 w1", " w0/1 w1/1"] and [c.index for c in out.choices] == [0, 1]
    assert all(c.logprobs is None for c in out.choices)  # not asked for: not returned
    assert out.usage.completion_tokens == 8  # every generated choice counts


def test_a_list_of_prompts_returns_choices_in_order(client, backend):
    prompts = ["one", "two two", [5, 6, 7], "four"]
    out = client.completions.create(model=MODEL, prompt=prompts, max_tokens=1, n=2)
    assert [c.index for c in out.choices] == list(range(8))
    sent = backend.requests[-4:]
    assert [r.prompt_token_ids for r in sent][2] == [5, 6, 7]
    assert out.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in sent)
    assert out.usage.completion_tokens == 8
    streamed = list(client.completions.create(model=MODEL, prompt=prompts, max_tokens=1, stream=True))
    assert sorted(c.choices[0].index for c in streamed if c.choices) == [0, 1, 2, 3]


def test_echo_returns_the_prompt_and_its_logprobs(client, backend, router_tok):
    out = client.completions.create(model=MODEL, prompt="hello there", max_tokens=1, echo=True)
    assert out.choices[0].text == "hello there w0"
    assert backend.requests[-1].sampling_params.prompt_logprobs is None  # no logprobs: the cache serves it all
    out = client.completions.create(model=MODEL, prompt="hello there", max_tokens=1, echo=True, logprobs=1)
    ids = backend.requests[-1].prompt_token_ids
    assert backend.requests[-1].sampling_params.prompt_logprobs == 1
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None
    assert lp.token_logprobs[1:] == [-1.0] * (len(ids) - 1) + [-0.5]
    streamed = list(client.completions.create(model=MODEL, prompt="hello there", max_tokens=2, echo=True,
                                              stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == "hello there w0 w1"


def test_prompt_logprobs_and_processor_fields_reach_the_replica(client, backend):
    out = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=1, logit_bias={"9": -100, "11": 50},
                                    extra_body={"prompt_logprobs": 0, "allowed_token_ids": [9, 11, 12],
                                                "bad_words": ["zz"], "min_tokens": 1})
    params = backend.requests[-1].sampling_params
    assert params.logit_bias == ((9, -100.0), (11, 50.0)) and params.allowed_token_ids == (9, 11, 12)
    assert params.bad_words == ("zz",) and params.min_tokens == 1 and params.prompt_logprobs == 0
    entries = out.model_extra["choices"][0]["prompt_logprobs"] if out.model_extra.get("choices") else \
        out.choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None and entries[1] == {"6": {"logprob": -1.0, "rank": 1, "decoded_token": entries[1]["6"]
                                                       ["decoded_token"]}}


def test_tokenize_and_detokenize(served, router_tok):
    _, handle = served
    base = f"http://127.0.0.1:{handle.port}"
    out = httpx2.post(f"{base}/tokenize", json={"prompt": "hello world"}).json()
    assert out["tokens"] == router_tok.encode("hello world") and out["count"] == len(out["tokens"])
    assert out["max_model_len"] == MAX_MODEL_LEN
    messages = [{"role": "user", "content": "hi"}]
    chat = httpx2.post(f"{base}/tokenize", json={"messages": messages}).json()
    assert chat["tokens"] == router_tok.render_chat(messages)
    back = httpx2.post(f"{base}/detokenize", json={"tokens": out["tokens"]}).json()
    assert back["prompt"] == router_tok.decode(out["tokens"], skip_special_tokens=False)
    bad = httpx2.post(f"{base}/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
