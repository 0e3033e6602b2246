"""Helpers of the router integration tests: a tiny-model Serve app, gRPC
routers in front of it, and requests with bounded waits.

Everything is real (Ray Serve, Redis, ``grpc.aio``); ``RecordingBackend``
only remembers what passes through the real ``RouterBackend``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, Optional, TypeVar

import grpc

from cluster.app import REPLICA_DEPLOYMENT, build_app
from cluster.shared.config import ClusterConfig, EngineConfig
from cluster.shared.directory import Directory
from cluster.shared.types import GenerationRequest, StreamChunk
from router.backend import ModelInfo, RouterBackend
from router.pb import generation_pb2 as pb
from router.pb import generation_pb2_grpc as pb_grpc
from router.server import RouterServer
from router.tokenizer import RouterTokenizer
from tests.factories import make_tiny_model_dir

T = TypeVar("T")

BLOCK_SIZE = 4
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def make_chat_model_dir(path: Path) -> Path:
    """A tiny random-init llama with a byte-level BPE and a ChatML template."""
    make_tiny_model_dir("llama", path)
    config = {"chat_template": CHATML, "bos_token": "<s>", "eos_token": "</s>"}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


# cache_aware without load slack: a busy replica gets no new prefix (warm_on_two_replicas).
WARM_POLICY_PARAMS = {"balance_abs_threshold": 0}


@contextlib.contextmanager
def serve_app(app_name: str, model_dir: Path, redis_url: str, namespace: str, replicas: int = 2,
              routing_policy: str = "cache_aware", routing_policy_params: Optional[dict] = None,
              **engine_args: Any):
    """A replica deployment of ``model_dir`` under ``app_name`` (replica_num_cpus
    0.25); yields its handle and deletes the app afterwards.

    ``engine_args`` are vLLM-style engine arguments (``block_size``,
    ``num_kv_blocks``, ``max_num_seqs``, ...).
    """
    from ray import serve

    engine = EngineConfig.from_kwargs(model=str(model_dir), **engine_args)
    config = ClusterConfig(replicas=replicas, redis_url=redis_url, namespace=namespace, engine=engine,
                           replica_num_cpus=0.25, routing_policy=routing_policy,
                           routing_policy_params=routing_policy_params or {})
    serve.start(proxy_location="Disabled")
    handle = serve.run(build_app(config), name=app_name, route_prefix=None)
    try:
        yield handle
    finally:
        serve.delete(app_name)


def new_handle(app_name: str) -> Any:
    """A fresh handle of the replica deployment: its own Serve router, hence its
    own ``PrefixAwareRequestRouter`` and directory client."""
    from ray import serve

    return serve.get_deployment_handle(REPLICA_DEPLOYMENT, app_name=app_name)


@dataclass
class Call:
    """One request that went through a ``RecordingBackend``."""

    request: GenerationRequest
    text: str = ""
    last: Optional[StreamChunk] = None


@dataclass
class RecordingBackend:
    """The real ``RouterBackend``, remembering each request and what came back."""

    inner: RouterBackend
    calls: list[Call] = field(default_factory=list)

    @property
    def tokenizer(self) -> RouterTokenizer:
        return self.inner.tokenizer

    @property
    def model(self) -> ModelInfo:
        return self.inner.model

    async def stream(self, request: GenerationRequest) -> AsyncIterator[StreamChunk]:
        call = Call(request)
        self.calls.append(call)
        async for chunk in self.inner.stream(request):
            call.text += chunk.text
            call.last = chunk
            yield chunk


def make_backend(handle: Any, model_dir: Path) -> RecordingBackend:
    max_len = json.loads((model_dir / "config.json").read_text())["max_position_embeddings"]
    return RecordingBackend(RouterBackend(handle, RouterTokenizer.from_model_dir(model_dir), ModelInfo("tiny", max_len)))


@contextlib.asynccontextmanager
async def running_router(backend: Any, redis_url: str, namespace: str) -> AsyncIterator[tuple[RouterServer, Any]]:
    """A started ``RouterServer`` on a free loopback port and a stub to it."""
    server = RouterServer(backend, Directory.from_url(redis_url, namespace), port=0)
    async with asyncio.timeout(30):
        await server.start()
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            yield server, pb_grpc.GenerationStub(channel)
    finally:
        async with asyncio.timeout(30):
            await server.stop(grace=1.0)


def ids_request(ids: list[int], max_tokens: int = 2, **sampling: Any) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=ids),
                              sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, **sampling))


async def collect(stub: Any, request: pb.GenerateRequest, timeout: float = 60.0) -> list[pb.GenerateResponse]:
    """Every chunk of one Generate call (the deadline bounds it)."""
    return [chunk async for chunk in stub.Generate(request, timeout=timeout)]


async def final(stub: Any, request: pb.GenerateRequest, timeout: float = 60.0) -> pb.GenerateResponse:
    """The last chunk of one Generate call."""
    return (await collect(stub, request, timeout))[-1]


async def wait_until(probe: Callable[[], Awaitable[Optional[T]]], what: str, timeout: float = 30.0,
                     period: float = 0.25) -> T:
    """Polls ``probe`` until it returns something truthy; fails naming ``what``."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            async with asyncio.timeout(10):
                last = await probe()
        except Exception as exc:  # noqa: BLE001 - keep polling; report the last error
            last = exc
        else:
            if last:
                return last
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout:.0f} s; last probe: {last!r}")
        await asyncio.sleep(period)


async def replicas_idle(redis_url: str, namespace: str, count: int = 2) -> bool:
    """Whether ``count`` replicas report nothing running or waiting in their
    heartbeats; after it, give Serve's routing stats (pulled every second) a
    moment to catch up before relying on the load a request router sees."""
    directory = Directory.from_url(redis_url, namespace)
    try:
        stats = await directory.replica_stats()
    finally:
        await directory.aclose()
    return len(stats) == count and all(not s.get("num_running") and not s.get("num_waiting") for s in stats.values())


async def directory_holders(redis_url: str, namespace: str, tokenizer: RouterTokenizer,
                            ids: list[int]) -> dict[str, int]:
    """``{replica_id: leading blocks of ids held}`` per the directory, holders only."""
    chain = tokenizer.block_hashes(ids, None, "", BLOCK_SIZE)
    directory = Directory.from_url(redis_url, namespace)
    try:
        return {rid: n for rid, n in (await directory.lookup(chain)).items() if n > 0}
    finally:
        await directory.aclose()


async def warm_on_two_replicas(stub: Any, prefix_a: list[int], prefix_b: list[int]) -> tuple[str, str]:
    """Caches ``prefix_a`` on one replica and ``prefix_b`` on the other.

    A long request with ``prefix_a`` is still running when ``prefix_b``
    arrives, so ``prefix_b`` (cached nowhere) goes to the idle replica -- in
    an app whose ``cache_aware`` policy has ``balance_abs_threshold`` 0
    (``WARM_POLICY_PARAMS``): with the default slack, a new prefix goes to
    the emptiest cache, which may be the busy replica's.
    Load-only routing of idle replicas then sends both prefixes to the same
    replica, so a test that finds each prefix on its own holder shows that the
    directory was consulted.

    Returns:
        The replica ids holding ``prefix_a`` and ``prefix_b``.
    """
    call = stub.Generate(ids_request(prefix_a + [5], max_tokens=200, ignore_eos=True), timeout=120)
    try:
        async with asyncio.timeout(120):
            first = await anext(aiter(call))
            holder_b = await final(stub, ids_request(prefix_b + [5]))
    finally:
        call.cancel()  # its prompt's blocks stay cached
    return first.replica_id, holder_b.replica_id


Send = Callable[[list[int]], Awaitable[tuple[str, int]]]  # prompt ids -> (replica id, cached prompt tokens)


def distinct_prefixes(count: int, length: int, salt: int = 0) -> list[list[int]]:
    """``count`` prompts of ``length`` token ids (< 500: the tiny models' vocab
    is 512) that differ in their first token."""
    return [[10 + salt * 16 + i] + [50 + (i * 7 + salt * 13 + j) % 400 for j in range(1, length)] for i in range(count)]


async def burst_reaches_holders(send: Send, prefixes: list[list[int]], per_prefix: int = 2,
                                settle_s: float = 1.5) -> list[tuple[int, str, str, int]]:
    """Caches each prefix (one request each, in turn), then sends
    ``per_prefix`` requests of every prefix *at once*.

    Under that burst, routing by load alone spreads the requests over the
    replicas, so some land where their prefix is not cached; routing on the
    directory sends each to its prefix's holder. A decision handed to another
    request (see tests/unit/test_serve_router.py) lands some on the wrong one.

    Returns:
        ``(prefix index, holder, replica reached, cached tokens)`` per burst request.
    """
    holders = []
    for i, prefix in enumerate(prefixes):
        replica_id, _ = await send(prefix + [3, 400 + i])
        holders.append(replica_id)
    await asyncio.sleep(settle_s)  # the directory learns the blocks after the step
    jobs = [(i, prefix + [4, 300 + 10 * i + k]) for i, prefix in enumerate(prefixes) for k in range(per_prefix)]
    results = await asyncio.gather(*(send(ids) for _, ids in jobs))
    return [(i, holders[i], replica_id, cached) for (i, _), (replica_id, cached) in zip(jobs, results)]


def assert_all_hit(outcomes: list[tuple[int, str, str, int]], prefix_len: int) -> None:
    """Every burst request reached its prefix's holder and reused the whole prefix."""
    wrong = [o for o in outcomes if o[2] != o[1] or o[3] != prefix_len]
    assert not wrong, f"(prefix, holder, reached, cached) that missed, of {len(outcomes)}: {wrong}"


def run_bounded(coro: Awaitable[T], cleanup_s: float = 15.0) -> T:
    """``asyncio.run(coro)``, but the tasks left behind get ``cleanup_s`` to end
    after cancellation instead of forever: under load a Redis client caught in a
    Sentinel failover has been seen to ignore its cancellation, which hung
    ``asyncio.run``'s own cleanup after the test had passed."""
    loop = asyncio.new_event_loop()
    try:
        result = loop.run_until_complete(coro)
        pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.wait(pending, timeout=cleanup_s))
        loop.run_until_complete(loop.shutdown_asyncgens())
        return result
    finally:
        loop.close()
