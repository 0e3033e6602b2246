"""Stored responses live under the caller's tenant (router/openai/response_store.py): another
tenant's response id is a 404 on every route that takes one, and touches nothing; a second API
key of the same tenant reads it."""

from __future__ import annotations

import openai
import pytest

from router.backend import ModelInfo
from router.openai.response_store import MemoryResponseStore
from router.security import Security
from tests.unit.http_api.openai_server import MODEL, FakeBackend, serving

TENANTS = """
tenants:
  - name: alpha
    keys: [sk-alpha-1, sk-alpha-2]
  - name: beta
    keys: [sk-beta]
"""


@pytest.fixture(scope="module")
def served(router_tok, tmp_path_factory):
    path = tmp_path_factory.mktemp("responses-tenants") / "tenants.yaml"
    path.write_text(TENANTS)
    backend = FakeBackend(router_tok)
    backend.model = ModelInfo(MODEL, 4096)
    backend.response_store = MemoryResponseStore()
    with serving(backend, security=Security.from_options(tenants_file=str(path))) as handle:
        yield handle


def _client(handle, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=handle.url, api_key=key, max_retries=0, timeout=20)


def test_another_tenants_response_id_is_not_found(served):
    with _client(served, "sk-alpha-1") as alpha, _client(served, "sk-alpha-2") as alpha_too, \
            _client(served, "sk-beta") as beta:
        mine = alpha.responses.create(model=MODEL, input="hello", max_output_tokens=2)
        assert alpha_too.responses.retrieve(mine.id).output_text == mine.output_text
        others = {
            "retrieve": lambda: beta.responses.retrieve(mine.id),
            "input_items": lambda: beta.responses.input_items.list(mine.id),
            "delete": lambda: beta.responses.delete(mine.id),
            "cancel": lambda: beta.responses.cancel(mine.id),
            "previous_response_id": lambda: beta.responses.create(model=MODEL, input="more", max_output_tokens=2,
                                                                  previous_response_id=mine.id),
        }
        for route, call in others.items():
            with pytest.raises(openai.NotFoundError):
                call()
                pytest.fail(f"{route} of another tenant's response answered")
        # Beta's delete touched nothing: alpha still continues its conversation.
        assert alpha.responses.retrieve(mine.id).output_text == mine.output_text
        assert alpha.responses.create(model=MODEL, input="more", max_output_tokens=2,
                                      previous_response_id=mine.id).status in ("completed", "incomplete")
