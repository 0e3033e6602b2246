"""The OpenAI HTTP API's test server for this folder's modules: the fake
backend (``openai_server.FakeBackend``) behind ``serve_openai`` on a free
loopback port, in an event loop on its own thread."""

from __future__ import annotations

import openai
import pytest

from cluster.shared.types import FinishReason
from router.tokenizer import RouterTokenizer
from tests.factories import make_router_tokenizer
from tests.unit.http_api.openai_server import TEMPLATE, FakeBackend, serving


@pytest.fixture(scope="module")
def router_tok(tmp_path_factory) -> RouterTokenizer:
    return make_router_tokenizer(tmp_path_factory.mktemp("tiny-tok"), TEMPLATE)


@pytest.fixture(scope="module")
def served(router_tok):
    backend = FakeBackend(router_tok)
    with serving(backend) as handle:
        yield backend, handle


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
