"""How the gRPC router behaves on a real local cluster (Ray Serve with two
tiny-model replicas, the Redis directory, ``RouterServer`` on loopback):
a hot prefix spreads under heavy concurrency, two routers on one Redis agree,
and the ``prefixserve generate / chat --url`` clients work end to end."""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import sys
import uuid
from pathlib import Path

import pytest

from tests.integration.router_cluster import (
    BLOCK_SIZE,
    WARM_POLICY_PARAMS,
    serve_app,
    directory_holders,
    final,
    ids_request,
    make_backend,
    make_chat_model_dir,
    new_handle,
    running_router,
    wait_until,
    replicas_idle,
    warm_on_two_replicas,
)

pytestmark = pytest.mark.timeout(900)

logger = logging.getLogger(__name__)

APP = "router-behaviour"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cluster(ray_local, redis_server, tmp_path_factory):
    """Yields (model_dir, redis_url, namespace) of a running 2-replica app (default policy)."""
    model_dir = make_chat_model_dir(tmp_path_factory.mktemp("behaviour-llama"))
    namespace = f"behaviour-{uuid.uuid4().hex[:6]}"
    with serve_app(APP, model_dir, redis_server.url, namespace, block_size=BLOCK_SIZE, num_kv_blocks=400):
        yield model_dir, redis_server.url, namespace


@pytest.fixture
def warm_cluster(ray_local, redis_server, tmp_path_factory):
    """Like ``cluster``, with ``WARM_POLICY_PARAMS`` (see ``warm_on_two_replicas``)."""
    model_dir = make_chat_model_dir(tmp_path_factory.mktemp("behaviour-warm-llama"))
    namespace = f"behaviour-warm-{uuid.uuid4().hex[:6]}"
    with serve_app(f"{APP}-warm", model_dir, redis_server.url, namespace, block_size=BLOCK_SIZE,
                   num_kv_blocks=400, routing_policy_params=WARM_POLICY_PARAMS):
        yield model_dir, redis_server.url, namespace, f"{APP}-warm"


def test_hot_prefix_under_heavy_concurrency_spreads_over_both_replicas(cluster):
    model_dir, redis_url, namespace = cluster
    prefix = list(range(100, 164))  # 16 blocks shared by every request
    num_requests, max_tokens = 48, 16

    async def main():
        backend = make_backend(new_handle(APP), model_dir)
        async with running_router(backend, redis_url, namespace) as (_, stub):
            warm = await final(stub, ids_request(prefix + [5]))
            await wait_until(lambda: directory_holders(redis_url, namespace, backend.tokenizer, prefix),
                             "the prefix in the directory")
            requests = [ids_request(prefix + [6 + i % 200, 7 + i // 200], max_tokens=max_tokens, ignore_eos=True)
                        for i in range(num_requests)]
            async with asyncio.timeout(300):
                finals = await asyncio.gather(*(final(stub, r, timeout=240) for r in requests))
        return warm, finals

    warm, finals = asyncio.run(main())
    per_replica = collections.Counter(f.replica_id for f in finals)
    assert all(f.finish_reason == "length" and f.usage.completion_tokens == max_tokens for f in finals)
    assert len(per_replica) == 2, f"a hot prefix must not pile onto one replica: {dict(per_replica)}"
    # What the warm holder took, it served from its cache.
    assert per_replica[warm.replica_id] > 0
    assert all(f.usage.cached_prompt_tokens >= 64 for f in finals if f.replica_id == warm.replica_id)
    logger.info("hot prefix: %s per replica (warmed on %s)", dict(per_replica), warm.replica_id)


def test_two_routers_on_one_redis_route_a_prefix_to_the_same_replica(warm_cluster):
    model_dir, redis_url, namespace, app = warm_cluster
    prefix_a, prefix_b = list(range(300, 364)), list(range(400, 464))  # 16 blocks each

    async def main():
        # Two backends on two handles: two Serve routers, two directory clients.
        first, second = make_backend(new_handle(app), model_dir), make_backend(new_handle(app), model_dir)
        async with running_router(first, redis_url, namespace) as (_, stub1), \
                running_router(second, redis_url, namespace) as (_, stub2):
            holder_a, holder_b = await warm_on_two_replicas(stub1, prefix_a, prefix_b)
            for prefix, holder in ((prefix_a, holder_a), (prefix_b, holder_b)):
                await wait_until(lambda p=prefix: directory_holders(redis_url, namespace, first.tokenizer, p),
                                 f"the prefix held by {holder} in the directory")
            # The warm-up's stream was cancelled: let the load every router sees return to 0
            # (this app's policy has no load slack, WARM_POLICY_PARAMS).
            await wait_until(lambda: replicas_idle(redis_url, namespace), "both replicas idle")
            await asyncio.sleep(2.5)  # Serve's routing stats are pulled every second
            # Router 2 has never seen either prefix.
            again = [await final(stub2, ids_request(p + [6, 7])) for p in (prefix_a, prefix_b, prefix_a, prefix_b)]
        return (holder_a, holder_b), again, first, second

    holders, again, first, second = asyncio.run(main())
    assert holders[0] != holders[1], "the warm-up must leave each prefix on its own replica"
    assert [f.replica_id for f in again] == [holders[0], holders[1]] * 2
    assert all(f.usage.cached_prompt_tokens == 64 for f in again)
    assert len(first.calls) == 2 and len(second.calls) == 4  # each router served its own requests


async def run_cli(address: str, *args: str, stdin: str = "", timeout: float = 180.0) -> tuple[int, str, str]:
    """Runs ``python -m cluster.cli <args> --url address`` and returns (rc, stdout, stderr)."""

    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "cluster.cli", *args, "--url", address, cwd=ROOT, env=env,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    try:
        async with asyncio.timeout(timeout):
            out, err = await proc.communicate(stdin.encode())
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    return proc.returncode, out.decode(), err.decode()


def test_chat_and_generate_clients_talk_to_a_running_router(cluster):
    model_dir, redis_url, namespace = cluster

    async def main():
        backend = make_backend(new_handle(APP), model_dir)
        async with running_router(backend, redis_url, namespace) as (server, _):
            chat = await run_cli(server.address, "chat", "--max-tokens", "8", stdin="hello world\nthe quick fox\n")
            chat_calls = list(backend.calls)
            backend.calls.clear()
            gen = await run_cli(server.address, "generate", "hello world", "--max-tokens", "6")
            gen_chat = await run_cli(server.address, "generate", "--chat", "prefix caching", "--max-tokens", "6")
        return chat, chat_calls, gen, gen_chat, backend

    chat, chat_calls, gen, gen_chat, backend = asyncio.run(main())
    tok = backend.tokenizer

    rc, out, err = chat
    assert rc == 0, err
    assert len(chat_calls) == 2, err
    turn1, turn2 = chat_calls
    assert turn1.last.finished and turn2.last.finished
    assert turn1.last.completion_tokens > 0 and turn1.text, "the first reply is empty"
    # The terminal shows both replies, one per line.
    assert out == f"{turn1.text}\n{turn2.text}\n"
    # The second turn carried the whole conversation: the first turn and its reply.
    user1 = {"role": "user", "content": "hello world"}
    assert turn1.request.prompt_token_ids == tok.render_chat([user1])
    assert turn2.request.prompt_token_ids == tok.render_chat(
        [user1, {"role": "assistant", "content": turn1.text}, {"role": "user", "content": "the quick fox"}])
    assert turn2.last.prompt_tokens > turn1.last.prompt_tokens
    # ... and reused the first turn's cached blocks on the same replica.
    assert turn2.last.replica_id == turn1.last.replica_id
    assert turn2.last.cached_prompt_tokens > 0

    rc, out, err = gen
    assert rc == 0, err
    plain, chatted = backend.calls
    assert plain.request.prompt_token_ids == tok.encode("hello world")
    assert out == plain.text + "\n" and plain.last.completion_tokens == 6
    assert f"replica={plain.last.replica_id} finish_reason=length" in err

    rc, out, err = gen_chat
    assert rc == 0, err
    assert chatted.request.prompt_token_ids == tok.render_chat([{"role": "user", "content": "prefix caching"}])
    assert out == chatted.text + "\n"
