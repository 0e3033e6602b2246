"""Tenants bound to API keys on a real replica (Ray Serve, the engine's prefix
cache, Redis): a tenant never gets cached tokens from another tenant's
prompt, even when it sends the other tenant's ``cache_salt``; two keys of one
tenant (or tenants sharing a cache namespace) do share the cache.

``usage.prompt_tokens_details.cached_tokens`` is the replica's own count of
prompt tokens served from its prefix cache, so a probe through it is exactly
what this test tries."""

from __future__ import annotations

import asyncio
import uuid

import httpx2 as httpx
import pytest

from router.backend import ModelInfo, RouterBackend
from router.openai import serve_openai
from router.security import Security
from router.tokenizer import RouterTokenizer
from tests.factories import make_tiny_model_dir
from tests.integration.router_cluster import serve_app

TENANTS = """
tenants:
  - name: alpha
    keys: [sk-alpha-1, sk-alpha-2]
  - name: beta
    keys: [sk-beta]
  - name: alpha-partner
    keys: [sk-partner]
    cache_namespace: alpha
"""
PROMPT = [7 + (i * 13) % 200 for i in range(48)]  # 12 blocks of 4


@pytest.fixture(scope="module")
def router_url(ray_local, redis_server, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tenants-e2e")
    model_dir = make_tiny_model_dir("llama", tmp)
    (tmp / "tenants.yaml").write_text(TENANTS)
    security = Security.from_options(tenants_file=str(tmp / "tenants.yaml"))
    namespace = f"tenants-{uuid.uuid4().hex[:6]}"
    with serve_app("tenants-test", model_dir, redis_server.url, namespace, replicas=1, block_size=4,
                   num_kv_blocks=256) as handle:
        backend = RouterBackend(handle, RouterTokenizer.from_model_dir(model_dir), ModelInfo("tiny", 512))
        loop = asyncio.new_event_loop()
        server = loop.run_until_complete(serve_openai(backend, port=0, security=security))
        import threading

        thread = threading.Thread(target=loop.run_forever, daemon=True)
        thread.start()
        try:
            yield server.url
        finally:
            asyncio.run_coroutine_threadsafe(server.stop(), loop).result(30)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)


def cached_tokens(url: str, key: str, salt: str = "") -> int:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    if salt:
        body["cache_salt"] = salt
    reply = httpx.post(f"{url}/completions", json=body, timeout=120, headers={"Authorization": f"Bearer {key}"})
    assert reply.status_code == 200, reply.text
    return reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_tenant_never_sees_another_tenants_cached_prefix(router_url):
    assert cached_tokens(router_url, "sk-alpha-1", salt="team-x") == 0  # cold
    assert cached_tokens(router_url, "sk-alpha-1", salt="team-x") >= 40  # warm for alpha itself
    # beta sends alpha's prompt and alpha's salt: still a miss, every time.
    assert cached_tokens(router_url, "sk-beta", salt="team-x") == 0
    assert cached_tokens(router_url, "sk-beta") == 0
    # The same prompt under beta's own namespace is now cached for beta only.
    assert cached_tokens(router_url, "sk-beta", salt="team-x") >= 40
    # Another key of alpha, and a tenant sharing alpha's namespace, share alpha's entries.
    assert cached_tokens(router_url, "sk-alpha-2", salt="team-x") >= 40
    assert cached_tokens(router_url, "sk-partner", salt="team-x") >= 40
    # A client salt narrows alpha's namespace: without it, a different cache.
    assert cached_tokens(router_url, "sk-alpha-2") == 0
