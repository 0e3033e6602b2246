"""Two routers over one cluster share /v1/responses state through Redis: a
conversation started on one continues on the other, whose prefix-aware routing
finds the first turn's KV on the replica that holds it."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid

import openai
import pytest

from cluster.shared.config import RouterConfig
from router.deployment import ServedModel, open_models
from router.limits import Limits
from router.openai import serve_openai
from tests.integration.router_cluster import make_chat_model_dir, new_handle, serve_app

APP = "responses-routers"
INPUT = " ".join(f"item {i} of the inventory list is a box of parts;" for i in range(4))


@contextlib.contextmanager
def router(model_dir, redis_url: str, namespace: str):
    """One router's HTTP front end (its own Serve handle, directory index and store client)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start():
        served = [ServedModel(str(model_dir), "tiny", 512, namespace, "prefix_cost")]
        backends, _, metrics = await open_models({"tiny": new_handle(APP)}, served, redis_url, RouterConfig(),
                                                 Limits())
        return await serve_openai(backends, port=0, metrics=metrics)

    handle = asyncio.run_coroutine_threadsafe(start(), loop).result(60)
    try:
        with openai.OpenAI(base_url=handle.url, api_key="unused", max_retries=0, timeout=120) as client:
            client.freeze = lambda: loop.call_soon_threadsafe(loop.stop)  # a router that dies: nothing runs on
            yield client
    finally:
        if loop.is_running():
            asyncio.run_coroutine_threadsafe(handle.stop(), loop).result(30)
            loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


@pytest.fixture(scope="module")
def routers(ray_local, redis_server, tmp_path_factory):
    model_dir = make_chat_model_dir(tmp_path_factory.mktemp("responses-routers"))
    namespace = f"rr-{uuid.uuid4().hex[:6]}"
    with serve_app(APP, model_dir, redis_server.url, namespace, replicas=2, routing_policy="prefix_cost",
                   block_size=4, num_kv_blocks=256):
        with router(model_dir, redis_server.url, namespace) as a, router(model_dir, redis_server.url, namespace) as b:
            yield a, b, (model_dir, redis_server.url, namespace)


def wait_until_listed(client, where, messages) -> None:
    """Until the directory lists every whole block of ``messages``' chat prompt on some replica,
    and a moment for the routers' indexes, which follow its stream (a fixed wait was a guess)."""
    import httpx2 as httpx

    from cluster.shared.directory import Directory
    from cluster.shared.fingerprint import model_fingerprint
    from cluster.shared.hashing import hash_block_chain, root_hash

    model_dir, redis_url, namespace = where
    tokens = httpx.post(str(client.base_url).rstrip("/").removesuffix("/v1") + "/tokenize", timeout=60,
                        json={"model": "tiny", "messages": messages}).json()["tokens"]
    chain = hash_block_chain(tokens, 4, root_hash(model_fingerprint(model_dir)))

    async def poll():
        directory = Directory.from_url(redis_url, namespace)
        try:
            deadline = time.monotonic() + 30
            while max((await directory.lookup(chain)).values(), default=0) < len(chain):
                assert time.monotonic() < deadline, "the directory never listed the first turn's prompt"
                await asyncio.sleep(0.1)
        finally:
            await directory.aclose()

    asyncio.run(poll())
    time.sleep(0.5)


def test_a_conversation_continues_on_another_router_with_its_kv(routers):
    a, b, where = routers
    first = a.responses.create(model="tiny", input=INPUT, temperature=0, max_output_tokens=8)
    wait_until_listed(a, where, [{"role": "user", "content": INPUT}])  # the KV events reach b's index
    second = b.responses.create(model="tiny", input="And the next one?", previous_response_id=first.id,
                                temperature=0, max_output_tokens=4)
    assert second.usage.input_tokens >= first.usage.input_tokens + first.usage.output_tokens  # the context came
    assert second.usage.input_tokens_details.cached_tokens >= 0.8 * first.usage.input_tokens, second.usage
    assert b.responses.retrieve(first.id).output_text == first.output_text  # stored by a, read by b
    b.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(first.id)


def test_a_background_response_of_a_router_that_died_ends_failed_not_in_progress(ray_local, redis_server,
                                                                                tmp_path_factory, routers):
    from router.openai.responses_background import LEASE_S

    _, b, _ = routers
    model_dir = make_chat_model_dir(tmp_path_factory.mktemp("responses-dying"))
    namespace = f"rd-{uuid.uuid4().hex[:6]}"
    with router(model_dir, redis_server.url, namespace) as dying, \
            router(model_dir, redis_server.url, namespace) as survivor:
        started = dying.responses.create(model="tiny", input=INPUT, max_output_tokens=290, background=True)
        assert started.status == "in_progress"
        dying.freeze()  # its event loop stops: the generation and the lease renewals with it
        time.sleep(LEASE_S + 1)
        ended = survivor.responses.retrieve(started.id)
        assert ended.status == "failed" and "stopped before it finished" in ended.error.message
