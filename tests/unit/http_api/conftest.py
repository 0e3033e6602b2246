"""The OpenAI HTTP API's test server for this folder's modules: the fake
backend (``openai_server.FakeBackend``) behind ``serve_openai`` on a free
loopback port, in an event loop on its own thread."""

from __future__ import annotations

import asyncio
import threading

import openai
import pytest

from cluster.shared.types import FinishReason
from router.openai import serve_openai
from router.tokenizer import RouterTokenizer
from tests.factories import make_router_tokenizer
from tests.unit.http_api.openai_server import TEMPLATE, FakeBackend


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
