"""Property tests of request validation on both front ends (hypothesis).

A real ``RouterServer`` (gRPC) and a real ``serve_openai`` (HTTP) run on
loopback over a fake backend. Generated requests mix valid, malformed and
out-of-range fields; whatever arrives, the answer is a clean one: a stream
that ends with a finish reason, or ``INVALID_ARGUMENT`` / HTTP 400 (404 for an
unknown model) with a message, never ``INTERNAL`` / 500, never a hang (every
call has a deadline). The fake backend checks that anything accepted is within
the limits, so an accepted bad request fails the test too.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
from typing import AsyncIterator

import grpc
import httpx2
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from cluster.shared.types import FinishReason, GenerationRequest, StreamChunk
from router.backend import ModelInfo
from router.limits import Limits
from router.openai import serve_openai
from router.pb import generation_pb2 as pb
from router.pb import generation_pb2_grpc as pb_grpc
from router.server import RouterServer
from router.tokenizer import RouterTokenizer
from tests.factories import make_router_tokenizer

MODEL = "tiny"
MAX_MODEL_LEN = 48
VOCAB = 512
LIMITS = Limits(max_messages=6, max_stop_strings=4, max_stop_string_chars=16, max_stop_token_ids=8,
                max_logprobs=5, max_output_tokens=32)
TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class CheckingBackend:
    """Streams two chunks after checking the request is within the limits."""

    def __init__(self, tokenizer: RouterTokenizer) -> None:
        self.tokenizer = tokenizer
        self.model = ModelInfo(MODEL, MAX_MODEL_LEN)

    async def stream(self, request: GenerationRequest) -> AsyncIterator[StreamChunk]:
        params = request.sampling_params
        ids = request.prompt_token_ids
        assert 1 <= len(ids) < MAX_MODEL_LEN and all(0 <= t < VOCAB for t in ids), ids
        assert 1 <= params.max_tokens <= LIMITS.max_output_tokens, params
        assert len(ids) + params.max_tokens <= MAX_MODEL_LEN, (len(ids), params.max_tokens)
        assert len(params.stop) <= LIMITS.max_stop_strings
        assert all(0 < len(s) <= LIMITS.max_stop_string_chars for s in params.stop)
        assert len(params.stop_token_ids) <= LIMITS.max_stop_token_ids
        assert params.logprobs is None or 0 <= params.logprobs <= LIMITS.max_logprobs
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            assert math.isfinite(getattr(params, name)), params
        yield StreamChunk(request.request_id, [7], " a", prompt_tokens=len(ids), completion_tokens=1)
        yield StreamChunk(request.request_id, [8], " b", FinishReason.LENGTH, prompt_tokens=len(ids),
                          completion_tokens=2)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """(grpc address, http base url), served from one background loop."""
    tokenizer = make_router_tokenizer(tmp_path_factory.mktemp("prop-tok"), TEMPLATE)
    backend = CheckingBackend(tokenizer)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start():
        grpc_server = RouterServer(backend, port=0, limits=LIMITS)
        await grpc_server.start()
        return grpc_server, await serve_openai(backend, port=0, limits=LIMITS)

    grpc_server, http = asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    try:
        yield grpc_server.address, http.url
    finally:
        asyncio.run_coroutine_threadsafe(http.stop(), loop).result(30)
        asyncio.run_coroutine_threadsafe(grpc_server.stop(0), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


# ------------------------------------------------------------------ gRPC
# Each request is mostly valid: up to two fields (drawn) get wild values, the
# others valid ones, so accepted and rejected requests are both common.
FLOATS = st.floats() | st.sampled_from([0.0, 0.5, 1.0, -1.0, 2.0, 1e-320, 1e308, -0.0])
UINT32 = st.integers(0, 40) | st.integers(0, 2**32 - 1)
SHORT_TEXT = st.text(max_size=24)
ASCII = st.text(st.characters(min_codepoint=32, max_codepoint=126), min_size=1, max_size=16)
ROLES = st.sampled_from(["user", "system", "assistant"])
VALID_FLOATS = {"temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "min_p": st.floats(0, 1),
                "repetition_penalty": st.floats(0.5, 2), "presence_penalty": st.floats(-2, 2),
                "frequency_penalty": st.floats(-2, 2)}
GRPC_FIELDS = ("input", *VALID_FLOATS, "max_tokens", "top_k", "seed", "logprobs", "stop", "stop_token_ids",
               "request_id", "cache_salt")


def _grpc_input(draw, msg: pb.GenerateRequest, wild: bool) -> None:
    kind = draw(st.sampled_from(["none", "prompt", "ids", "messages"] if wild else ["prompt", "ids", "messages"]))
    if kind == "prompt":
        msg.prompt = draw(st.text(max_size=120) if wild else ASCII)
    elif kind == "ids":
        ids = st.lists(st.integers(0, VOCAB + 5) | UINT32, max_size=60) if wild else st.lists(
            st.integers(3, VOCAB - 1), min_size=1, max_size=30)
        msg.prompt_token_ids.ids.extend(draw(ids))
    elif kind == "messages":
        msg.messages.SetInParent()
        roles = st.sampled_from(["user", "system", "assistant", "tool", "robot", ""]) if wild else ROLES
        items = draw(st.lists(st.tuples(roles, SHORT_TEXT if wild else ASCII), min_size=0 if wild else 1,
                              max_size=9 if wild else 3))
        for role, content in items:
            msg.messages.items.add(role=role, content=content)


@st.composite
def grpc_requests(draw) -> pb.GenerateRequest:
    bad = draw(st.sets(st.sampled_from(GRPC_FIELDS), max_size=2))
    msg = pb.GenerateRequest()
    _grpc_input(draw, msg, "input" in bad)
    sampling = msg.sampling
    for name, valid in VALID_FLOATS.items():
        if draw(st.booleans()) or name in bad:
            setattr(sampling, name, draw(FLOATS if name in bad else valid))
    optional = {"max_tokens": (st.integers(1, 8), UINT32), "top_k": (st.integers(-1, 50), st.integers(-2**31, -2)),
                "seed": (st.integers(-2**63, 2**63 - 1),) * 2, "logprobs": (st.integers(0, 5), UINT32)}
    for name, (valid, wild) in optional.items():
        if draw(st.booleans()) or name in bad:
            setattr(sampling, name, draw(wild if name in bad else valid))
    stop = st.lists(st.text(max_size=20), max_size=6) if "stop" in bad else st.lists(ASCII, max_size=4)
    sampling.stop.extend(draw(stop))
    stop_ids = st.lists(UINT32, max_size=10) if "stop_token_ids" in bad else st.lists(st.integers(0, 600), max_size=8)
    sampling.stop_token_ids.extend(draw(stop_ids))
    sampling.ignore_eos = draw(st.booleans())
    long_text = st.text(min_size=250, max_size=300)
    msg.request_id = draw(long_text if "request_id" in bad else st.text(max_size=8))
    msg.cache_salt = draw(long_text if "cache_salt" in bad else st.text(max_size=8))
    msg.priority = draw(st.integers(-2**31, 2**31 - 1))
    return msg


@SETTINGS
@given(msg=grpc_requests())
def test_grpc_answers_any_request_cleanly(servers, msg):
    address, _ = servers
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        try:
            chunks = list(stub.Generate(msg, timeout=20))
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, (exc.code(), exc.details())
            assert exc.details()
            event("rejected")
        else:
            assert chunks and chunks[-1].finish_reason == "length"
            event("accepted")


# ------------------------------------------------------------------ HTTP
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=8,
)
MESSAGE = st.fixed_dictionaries({"role": ROLES, "content": ASCII | st.lists(
    st.fixed_dictionaries({"type": st.just("text"), "text": ASCII}), min_size=1, max_size=2)})
WILD_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "nobody"]) | JSON,
     "content": SHORT_TEXT | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": SHORT_TEXT}),
                                      max_size=2) | JSON},
)
# field: (valid values, wild values); wild ones also include any JSON value.
HTTP_FIELDS = {
    "model": (st.just(MODEL), st.text(max_size=8)),
    "prompt": (ASCII | st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=30),
               st.text(max_size=80) | st.lists(st.integers(-2, VOCAB + 2), max_size=60) | st.lists(SHORT_TEXT)),
    "messages": (st.lists(MESSAGE, min_size=1, max_size=3), st.lists(WILD_MESSAGE, max_size=8)),
    "max_tokens": (st.integers(1, 8), st.integers() | st.floats()),
    "max_completion_tokens": (st.integers(1, 8), st.integers(-2, 60)),
    **{name: (valid, FLOATS) for name, valid in VALID_FLOATS.items()},
    "top_k": (st.integers(-1, 50), st.integers()), "seed": (st.integers(0, 2**32), st.integers()),
    "priority": (st.integers(-10, 10), st.integers()),
    "stop": (ASCII | st.lists(ASCII, max_size=4), st.text(max_size=20) | st.lists(st.text(max_size=20))),
    "stop_token_ids": (st.lists(st.integers(0, 600), max_size=8), st.lists(st.integers(), max_size=10)),
    "logprobs": (st.integers(0, 5), st.integers(-1, 8) | st.booleans()),
    "top_logprobs": (st.integers(0, 5), st.integers(-1, 8)),
    "n": (st.just(1), st.integers(0, 3)), "best_of": (st.just(1), st.integers(0, 3)),
    "echo": (st.just(False), st.booleans()), "stream": (st.booleans(), JSON),
    "stream_options": (st.just({"include_usage": True}), JSON), "ignore_eos": (st.booleans(), JSON),
    "cache_salt": (st.text(max_size=10), st.text(min_size=250, max_size=300)),
}


@st.composite
def http_bodies(draw, chat: bool) -> dict:
    bad = draw(st.sets(st.sampled_from(sorted(HTTP_FIELDS)), max_size=2))
    present = draw(st.sets(st.sampled_from(sorted(HTTP_FIELDS)))) | bad
    present.add("messages" if chat else "prompt")
    if chat:  # chat takes logprobs as a boolean
        present.discard("logprobs")
    body = {}
    for name in sorted(present):
        valid, wild = HTTP_FIELDS[name]
        body[name] = draw(wild | JSON if name in bad else valid)
    return body


def _check_http(response: httpx2.Response) -> None:
    assert response.status_code in (200, 400, 404), (response.status_code, response.text)
    event(f"HTTP {response.status_code}")
    if response.status_code != 200:
        error = response.json()["error"]
        assert error["message"] and error["type"]
    elif response.headers["content-type"].startswith("text/event-stream"):
        assert response.text.endswith("data: [DONE]\n\n")
        assert '"error"' not in response.text, response.text
    else:
        assert response.json()["choices"][0]["finish_reason"] == "length"


@SETTINGS
@given(data=st.data(), chat=st.booleans())
def test_http_answers_any_body_cleanly(servers, data, chat):
    _, url = servers
    body = data.draw(http_bodies(chat))
    path = "/chat/completions" if chat else "/completions"
    response = httpx2.post(url + path, content=json.dumps(body), timeout=20,
                           headers={"Content-Type": "application/json"})
    _check_http(response)


@settings(max_examples=60, deadline=None)
@given(raw=st.binary(max_size=64) | JSON.map(json.dumps).map(str.encode))
def test_http_answers_any_bytes_cleanly(servers, raw):
    _, url = servers
    _check_http(httpx2.post(url + "/completions", content=raw, timeout=20))
