"""The OpenAI-compatible HTTP API (``router.openai``) through the official
``openai`` client: completions, chat, streaming, usage, errors and
disconnects. The server and its fake backend: ``tests/unit/http_api/openai_server.py``."""

from __future__ import annotations

import asyncio

import httpx2
import openai
import pytest

from router.errors import NoReplicaError, OverloadedError
from router.openai import serve_openai
from tests.unit.http_api.openai_server import MAX_MODEL_LEN, MODEL, FakeBackend, _error, cached_tokens


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
