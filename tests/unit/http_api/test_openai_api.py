"""The OpenAI-compatible HTTP API (``router.openai``) through the official ``openai`` client.

A fake backend implements the ``Backend`` protocol: it streams one word per
requested token, with usage counters derived from the request, and records
when its generator is finalized. The real ``RouterTokenizer`` runs over the
tiny test tokenizer with a small chat template. The server runs with
``serve_openai`` on a free loopback port, in an event loop on its own thread.
"""

from __future__ import annotations

import asyncio
import threading
from typing import AsyncIterator, Optional

import httpx2
import openai
import pytest

from cluster.shared.types import FinishReason, GenerationRequest, StreamChunk, TokenLogprob
from router.backend import ModelInfo
from router.errors import NoReplicaError, OverloadedError
from router.openai import serve_openai
from router.tokenizer import RouterTokenizer
from tests.factories import make_router_tokenizer

MODEL = "tiny-llama"
MAX_MODEL_LEN = 256
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def cached_tokens(prompt_len: int) -> int:
    """What the fake reports as a prefix-cache hit: whole 4-token blocks, leaving one token."""
    return ((prompt_len - 1) // 4) * 4


class FakeBackend:
    """Streams ``max_tokens`` chunks " w0", " w1", ... (or the pieces of ``script``, the
    last ending with ``script_finish``) and records every request and finalization."""

    def __init__(self, tokenizer: RouterTokenizer) -> None:
        self.tokenizer = tokenizer
        self.model = ModelInfo(MODEL, MAX_MODEL_LEN)
        self.requests: list[GenerationRequest] = []
        self.finalized: list[str] = []
        self.finalized_event = threading.Event()
        self.fail: Optional[Exception] = None
        self.delay = 0.0
        self.fail_after: Optional[int] = None
        self.script: Optional[list[str]] = None
        self.script_finish = FinishReason.STOP

    async def stream(self, request: GenerationRequest) -> AsyncIterator[StreamChunk]:
        self.requests.append(request)
        try:
            if self.fail is not None:
                raise self.fail
            pieces = self.script or [f" w{i}" for i in range(request.sampling_params.max_tokens)]
            finish = self.script_finish if self.script else FinishReason.LENGTH
            n = len(pieces)
            prompt_len = len(request.prompt_token_ids)
            choices = request.sampling_params.num_choices
            prompt_lps = None
            if request.sampling_params.prompt_logprobs is not None:
                prompt_lps = [None] + [TokenLogprob(t, -1.0, ((t, -1.0),)) for t in request.prompt_token_ids[1:]]
            for i in range(n):
                if self.delay:
                    await asyncio.sleep(self.delay)
                if i == self.fail_after:
                    raise NoReplicaError("the replica died")
                for c in range(choices):  # choice c's tokens are 100 + i + 10 * c, logprob -0.5 - c
                    logprobs = None
                    if request.sampling_params.logprobs is not None:
                        logprobs = [TokenLogprob(100 + i + 10 * c, -0.5 - c, ((100 + i, -0.5), (7, -1.5)))]
                    yield StreamChunk(
                        request_id=request.request_id,
                        token_ids=[100 + i + 10 * c],
                        text=pieces[i] if not c else f"{pieces[i]}/{c}",
                        finish_reason=finish if i == n - 1 else None,
                        logprobs=logprobs,
                        prompt_tokens=prompt_len,
                        completion_tokens=i + 1,
                        cached_prompt_tokens=cached_tokens(prompt_len),
                        replica_id="replica-0",
                        prompt_logprobs=prompt_lps if i == 0 and c == 0 else None,
                        index=c,
                        more_choices=not (i == n - 1 and c == choices - 1),
                    )
        finally:
            self.finalized.append(request.request_id)
            self.finalized_event.set()


@pytest.fixture(scope="module")
def router_tok(tmp_path_factory) -> RouterTokenizer:
    return make_router_tokenizer(tmp_path_factory.mktemp("tiny-tok"), TEMPLATE)


@pytest.fixture(scope="module")
def served(router_tok):
    backend = FakeBackend(router_tok)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    handle = asyncio.run_coroutine_threadsafe(serve_openai(backend, port=0), loop).result(15)
    try:
        yield backend, handle
    finally:
        asyncio.run_coroutine_threadsafe(handle.stop(), loop).result(15)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


@pytest.fixture()
def backend(served) -> FakeBackend:
    fake, _ = served
    fake.fail, fake.delay, fake.fail_after = None, 0.0, None
    fake.script, fake.script_finish = None, FinishReason.STOP
    fake.finalized_event.clear()
    return fake


@pytest.fixture()
def client(served) -> openai.OpenAI:
    _, handle = served
    with openai.OpenAI(base_url=handle.url, api_key="unused", max_retries=0, timeout=20) as c:
        yield c


def test_binds_a_free_loopback_port(served):
    _, handle = served
    assert handle.host == "127.0.0.1" and handle.port > 0
    assert httpx2.get(f"http://127.0.0.1:{handle.port}/health").status_code == 200


def test_models_lists_the_served_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].object == "model"


def test_completion_from_text_prompt(client, backend, router_tok):
    prompt = "the quick brown fox jumps over the lazy dog"
    out = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=3, temperature=0.0, top_p=0.9, seed=7, stop=["zz"],
        presence_penalty=0.5, frequency_penalty=0.25,
        extra_body={"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1, "ignore_eos": True, "stop_token_ids": [2]},
    )
    assert out.id.startswith("cmpl-") and out.object == "text_completion" and out.model == MODEL
    assert out.choices[0].text == " w0 w1 w2"
    assert out.choices[0].finish_reason == "length"
    ids = router_tok.encode(prompt)
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 3
    assert out.usage.total_tokens == len(ids) + 3
    assert out.usage.prompt_tokens_details.cached_tokens == cached_tokens(len(ids))
    params = backend.requests[-1].sampling_params
    assert backend.requests[-1].prompt_token_ids == ids
    assert (params.max_tokens, params.temperature, params.top_p, params.seed) == (3, 0.0, 0.9, 7)
    assert (params.top_k, params.min_p, params.repetition_penalty) == (5, 0.1, 1.1)
    assert params.ignore_eos and params.stop == ("zz",) and params.stop_token_ids == (2,)
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, 0.25)


def test_completion_from_token_ids_with_logprobs(client, backend):
    out = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8, 9], max_tokens=2, logprobs=1)
    assert backend.requests[-1].prompt_token_ids == [5, 6, 7, 8, 9]
    assert backend.requests[-1].sampling_params.logprobs == 1
    assert out.choices[0].logprobs.token_logprobs == [-0.5, -0.5]
    assert len(out.choices[0].logprobs.tokens) == 2
    assert out.usage.prompt_tokens == 5


def test_chat_completion_renders_the_template(client, backend, router_tok):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=2)
    assert out.id.startswith("chatcmpl-") and out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == " w0 w1"
    assert out.choices[0].finish_reason == "length"
    expected = router_tok.render_chat(messages)
    assert backend.requests[-1].prompt_token_ids == expected
    assert out.usage.prompt_tokens == len(expected)
    assert out.usage.prompt_tokens_details.cached_tokens == cached_tokens(len(expected))


def test_chat_default_max_tokens_fills_the_context(client, backend, router_tok):
    messages = [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]
    client.chat.completions.create(model=MODEL, messages=messages, logprobs=True, top_logprobs=2)
    request = backend.requests[-1]
    assert request.sampling_params.max_tokens == MAX_MODEL_LEN - len(request.prompt_token_ids)
    assert request.sampling_params.logprobs == 2


def test_streamed_completion_with_usage(client, router_tok):
    prompt = "prefix caching and paged attention"
    stream = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == " w0 w1 w2 w3"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    n = len(router_tok.encode(prompt))
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (n, 4)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached_tokens(n)
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("cmpl-")


def test_streamed_chat_with_usage(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=3, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == " w0 w1 w2"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 3
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 0
    assert all(c.object == "chat.completion.chunk" and c.id.startswith("chatcmpl-") for c in chunks)


def test_stream_without_include_usage_has_no_usage_chunk(served):
    _, handle = served
    with httpx2.stream(
        "POST", f"{handle.url}/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 2, "stream": True}
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)
    assert len(lines) == 3 and '"usage"' not in "".join(lines)


def _error(exc_info) -> dict:
    body = exc_info.value.response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


@pytest.mark.parametrize(
    "kwargs, param, words",
    [
        ({"prompt": ""}, "prompt", "empty"),
        ({"prompt": "hello", "top_p": 0.0}, "top_p", "(0, 1]"),
        ({"prompt": "hello", "n": 17}, "n", "max_n of 16"),
        ({"prompt": "hello", "n": 3, "best_of": 2}, "best_of", ">= n = 3"),
        ({"prompt": "hello", "best_of": 3, "stream": True}, "best_of", "cannot be streamed"),
        ({"prompt": "hello", "logit_bias": {"abc": 1}}, "logit_bias", "not a token id"),
        ({"prompt": "hello", "logit_bias": {"999999": 1}}, "logit_bias", "not a token id"),
        ({"prompt": "hello", "logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
        ({"prompt": "hello", "suffix": "x"}, "suffix", "not supported"),
        ({"prompt": ["a"] * 17}, "prompt", "max_n of 16"),
        ({"prompt": "hello", "temperature": -1.0}, "temperature", ">= 0"),
        ({"prompt": [1, 99999]}, "prompt", "out of range"),
        ({"prompt": "hello", "max_tokens": 10_000}, "max_tokens", "at most"),
        ({"prompt": ["a", ""]}, "prompt", "prompt[1] is empty"),
    ],
)
def test_bad_completion_requests_get_400(client, kwargs, param, words):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, **kwargs)
    error = _error(info)
    assert info.value.status_code == 400
    assert error["param"] == param and words in error["message"]
    assert error["type"] == "invalid_request_error"


def test_bad_chat_requests_get_400(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "hi"}])
    assert _error(info)["param"] == "messages" and "role" in _error(info)["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[])
    assert _error(info)["param"] == "messages"


def test_unknown_model_gets_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-17", prompt="hello")
    error = _error(info)
    assert info.value.status_code == 404 and error["param"] == "model" and error["code"] == "model_not_found"
    assert MODEL in error["message"]


def test_malformed_json_gets_400(served):
    _, handle = served
    for path in ("/completions", "/chat/completions"):
        response = httpx2.post(handle.url + path, content=b"{not json", headers={"content-type": "application/json"})
        assert response.status_code == 400
        assert "not valid JSON" in response.json()["error"]["message"]
    response = httpx2.post(handle.url + "/completions", json=[1, 2])
    assert response.status_code == 400 and "JSON object" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    "error, exc_type, status",
    [
        (OverloadedError("queues are full"), openai.RateLimitError, 429),
        (NoReplicaError("nothing running"), openai.InternalServerError, 503),
        (ValueError("prompt is too long for the replica"), openai.BadRequestError, 400),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_backend_errors_map_to_statuses(client, backend, error, exc_type, status, stream):
    backend.fail = error
    with pytest.raises(exc_type) as info:
        client.completions.create(model=MODEL, prompt="hello", stream=stream)
    assert info.value.status_code == status
    assert str(error) in _error(info)["message"]


def test_error_mid_stream_is_sent_in_band(served, backend):
    _, handle = served
    backend.fail_after = 2
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 5, "stream": True}
    with httpx2.stream("POST", f"{handle.url}/completions", json=body) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line]
    assert len(lines) == 4 and lines[-1] == "data: [DONE]"
    assert '"error"' in lines[2] and "the replica died" in lines[2]


def test_disconnect_mid_stream_closes_the_backend_stream(client, backend):
    backend.delay = 0.02
    stream = client.completions.create(model=MODEL, prompt="hello world", max_tokens=200, stream=True)
    chunks = iter(stream)
    received = [next(chunks) for _ in range(3)]
    assert len(received) == 3
    request_id = backend.requests[-1].request_id
    assert request_id not in backend.finalized
    stream.close()  # drops the connection mid-stream
    assert backend.finalized_event.wait(10), "the backend stream was not closed after the client left"
    assert request_id in backend.finalized
    # The server keeps serving.
    assert client.completions.create(model=MODEL, prompt="hello", max_tokens=1).choices[0].text == " w0"


def test_disconnect_during_non_streamed_request_aborts(served, backend):
    _, handle = served
    backend.delay = 0.02
    with pytest.raises(httpx2.TimeoutException):
        httpx2.post(handle.url + "/completions", json={"prompt": "hello", "max_tokens": 200}, timeout=0.3)
    assert backend.finalized_event.wait(10), "the backend stream was not closed after the client left"


def test_stop_closes_the_port(router_tok):
    async def main() -> int:
        handle = await serve_openai(FakeBackend(router_tok), port=0)
        async with httpx2.AsyncClient() as http:
            assert (await http.get(f"http://127.0.0.1:{handle.port}/v1/models")).status_code == 200
        await handle.stop()
        return handle.port

    port = asyncio.run(main())
    with pytest.raises(httpx2.ConnectError):
        httpx2.get(f"http://127.0.0.1:{port}/health")


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
