"""The response store's TTL and size cap come from the config (router.responses_ttl_s,
router.responses_max_record_bytes), and a response over the cap is a 400 that says its size
while ``store: false`` still answers."""

from __future__ import annotations

import asyncio

import openai
import pytest

from cluster.shared.config import ClusterConfig, RouterConfig
from router.backend import ModelInfo
from router.openai.response_store import (DEFAULT_MAX_RECORD_BYTES, DEFAULT_TTL_S, MemoryResponseStore,
                                          RedisResponseStore, open_response_store)
from tests.unit.http_api.openai_server import MODEL, FakeBackend, serving


def test_the_config_sets_the_stores_ttl_and_size_cap():
    assert (RouterConfig().responses_ttl_s, RouterConfig().responses_max_record_bytes) == \
        (DEFAULT_TTL_S, DEFAULT_MAX_RECORD_BYTES)
    router = ClusterConfig.from_dict({"router": {"responses_ttl_s": 60, "responses_max_record_bytes": 4096}}).router
    memory = open_response_store(None, "ns", router.responses_ttl_s, router.responses_max_record_bytes)
    assert isinstance(memory, MemoryResponseStore) and (memory.ttl_s, memory.max_record_bytes) == (60, 4096)
    shared = open_response_store("redis://127.0.0.1:1", "ns", router.responses_ttl_s,
                                 router.responses_max_record_bytes)  # no connection until used
    try:
        assert isinstance(shared, RedisResponseStore) and (shared.ttl_s, shared.max_record_bytes) == (60, 4096)
    finally:
        asyncio.run(shared.aclose())
    for bad in ({"responses_ttl_s": 0}, {"responses_max_record_bytes": -1}):
        with pytest.raises(ValueError, match="responses_ttl_s and responses_max_record_bytes must be > 0"):
            RouterConfig(**bad)


def test_a_response_over_the_cap_is_a_400_and_store_false_answers(router_tok):
    backend = FakeBackend(router_tok)
    backend.model = ModelInfo(MODEL, 4096)
    backend.response_store = MemoryResponseStore(max_record_bytes=2000)
    long_input = "a few words more " * 100  # ~1,700 characters: the record with its conversation is over 2,000
    with serving(backend) as handle, openai.OpenAI(base_url=handle.url, api_key="unused", max_retries=0,
                                                    timeout=20) as api:
        with pytest.raises(openai.BadRequestError) as err:
            api.responses.create(model=MODEL, input=long_input, max_output_tokens=2)
        assert "over the store's limit of 2000" in err.value.message, err.value.message
        assert api.responses.create(model=MODEL, input=long_input, max_output_tokens=2, store=False).output_text
        short = api.responses.create(model=MODEL, input="short", max_output_tokens=2)  # under the cap: stored
        assert api.responses.retrieve(short.id).output_text == short.output_text
