"""``bench serve --backend openai-responses``'s client (cluster/bench/clients_responses.py): a
turn that extends an answered response is sent as its new part with that response's id."""

from __future__ import annotations

import pytest

from cluster import cli
from cluster.bench.clients import RequestFailed
from cluster.bench.clients_responses import ResponsesClient


class _Encoding:
    def __init__(self, ids):
        self.ids = ids


class FakeTokenizer:
    """One character a token: id = ord(c)."""

    def decode(self, ids):
        return "".join(chr(i) for i in ids if i >= 32)

    def encode(self, text, add_special_tokens=False):
        return _Encoding([ord(c) for c in text])


def completed(response_id, kind="response.completed", input_tokens=10, cached=8):
    return {"type": kind, "response": {"id": response_id, "usage": {
        "input_tokens": input_tokens, "output_tokens": 2, "input_tokens_details": {"cached_tokens": cached}}}}


def test_a_turn_that_extends_an_answered_response_continues_it():
    client = ResponsesClient("http://127.0.0.1:1/v1", tokenizer=FakeTokenizer())
    prompt = [ord(c) for c in "hello"]
    assert client._split(prompt) == (None, prompt)  # a first turn: the whole prompt
    deltas = [client._delta({"type": "response.output_text.delta", "delta": "ok"}, prompt),
              client._delta({"type": "response.output_text.done", "text": "ok"}, prompt),
              client._delta(completed("resp_1"), prompt)]
    assert deltas[1] is None
    assert (deltas[0].num_tokens, deltas[0].text) == (1, "ok")
    last = deltas[2]
    assert (last.finish_reason, last.response_id) == ("stop", "resp_1")
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.cached_prompt_tokens) == (10, 2, 8)
    answer = client.answer_ids([d for d in deltas if d is not None])
    assert answer == [ord("o"), ord("k")]
    following = prompt + answer + [ord(c) for c in " more"]
    assert client._split(following) == ("resp_1", [ord(c) for c in " more"])
    assert client._split(following) == (None, following)  # taken: a response is continued once
    assert client._created == ["resp_1"]


def test_incomplete_is_length_and_errors_fail_the_request():
    client = ResponsesClient("http://127.0.0.1:1/v1", tokenizer=FakeTokenizer())
    assert client._delta(completed("resp_2", kind="response.incomplete"), []).finish_reason == "length"
    assert client._delta({"type": "response.reasoning_text.delta", "delta": "hm"}, []).num_tokens == 1
    with pytest.raises(RequestFailed, match="no replica"):
        client._delta({"type": "error", "error": {"message": "no replica"}}, [])
    with pytest.raises(RequestFailed, match="boom"):
        client._delta({"type": "response.failed", "response": {"error": {"message": "boom"}}}, [])


async def _first(client, **kwargs):
    async for delta in client.stream([40, 41], 4, **kwargs):
        return delta


def test_what_the_responses_backend_cannot_run_is_refused(caplog):
    import asyncio

    with pytest.raises(ValueError, match="tokenizer.json"):
        ResponsesClient("http://127.0.0.1:1/v1")
    client = ResponsesClient("http://127.0.0.1:1/v1", tokenizer=FakeTokenizer())
    with pytest.raises(ValueError, match="not structured outputs"):
        asyncio.run(_first(client, question="q", structured_outputs={"regex": "a+"}))
    assert cli.main(["bench", "serve", "--backend", "openai-responses", "--base-url", "http://127.0.0.1:1/v1",
                     "--dataset-name", "json"]) == 2
    assert "structured outputs go over --backend openai or grpc" in caplog.text
    assert cli.main(["bench", "serve", "--backend", "openai-responses", "--url", "127.0.0.1:1"]) == 2
    assert "the openai-responses backend takes --base-url" in caplog.text
