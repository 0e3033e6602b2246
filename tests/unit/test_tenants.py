"""Tenants bound to API keys (``router.tenants``): the tenants file, what a
tenant's request becomes, the per-tenant gate, and both front ends running
each call as its key's tenant (real loopback servers, a recording fake
backend)."""

from __future__ import annotations

import asyncio
import hashlib
import threading
from typing import AsyncIterator, Optional

import grpc
import httpx2
import pytest

from cluster.shared.types import FinishReason, GenerationRequest, SamplingParams, StreamChunk
from router.backend import ModelInfo
from router.errors import OverloadedError
from router.limits import Limits
from router.metrics import RouterMetrics
from router.openai import serve_openai
from router.pb import generation_pb2 as pb
from router.pb import generation_pb2_grpc as pb_grpc
from router.security import ApiKeys, Security, bearer_metadata
from router.server import RETRY_AFTER_KEY, RouterServer
from router.tenants import DEFAULT_TENANT, Tenant, TenantGate, load_tenants
from tests.factories import make_router_tokenizer

TENANTS_YAML = """
tenants:
  - name: search
    keys: [sk-search-1, sk-search-2]
    max_priority: 0
    max_concurrent_streams: 1
    max_tokens_per_request: 3
  - name: batch
    key_sha256: [{batch_digest}]
    max_priority: 10
    requests_per_s: 0.001
    burst: 2
  - name: shared-a
    keys: [sk-shared-a]
    cache_namespace: org
  - name: shared-b
    keys: [sk-shared-b]
    cache_namespace: org
"""


def write_tenants(path) -> str:
    digest = hashlib.sha256(b"sk-batch").hexdigest()
    path.write_text(TENANTS_YAML.format(batch_digest=digest))
    return str(path)


def request(priority: int = 0, salt: str = "", max_tokens: int = 4) -> GenerationRequest:
    return GenerationRequest("r", [1, 2, 3], SamplingParams(max_tokens=max_tokens), priority=priority,
                             cache_salt=salt)


# ------------------------------------------------------------------ the file
def test_tenants_file_binds_keys_and_digests_to_tenants(tmp_path):
    keys = ApiKeys.load(tenants_file=write_tenants(tmp_path / "tenants.yaml"))
    assert keys.identify("Bearer sk-search-2").name == "search"
    assert keys.identify("Bearer sk-batch").name == "batch"  # listed only by its digest
    assert keys.identify("Bearer sk-nobody") is None and not keys.allows("Bearer sk-batch2")
    assert sorted(t.name for t in keys.tenants) == ["batch", "search", "shared-a", "shared-b"]
    # Plain keys beside the file belong to the default tenant, which changes nothing.
    mixed = ApiKeys.load(["sk-plain"], tenants_file=str(tmp_path / "tenants.yaml"))
    assert mixed.identify("Bearer sk-plain") is DEFAULT_TENANT
    assert DEFAULT_TENANT.apply(request(priority=-5, salt="x")) == request(priority=-5, salt="x")


@pytest.mark.parametrize("text, message", [
    ("tenants: []", "expected 'tenants:' with a list"),
    ("tenants:\n  - name: a b\n    keys: [k]", "name must be 1-64 characters"),
    ("tenants:\n  - name: a\n    keys: [k]\n    max_prioriti: 1", r"unknown fields \['max_prioriti'\]"),
    ("tenants:\n  - name: a", "tenant 'a' has no key"),
    ("tenants:\n  - name: a\n    keys: [k]\n  - name: b\n    keys: [k]", "also one of tenant 'a'"),
    ("tenants:\n  - name: a\n    keys: [k]\n  - name: a\n    keys: [j]", "appears twice"),
    ("tenants:\n  - name: a\n    key_sha256: [abc]", "not 64 hex digits"),
    ("tenants:\n  - name: a\n    keys: [k]\n    requests_per_s: 0", "requests_per_s must be > 0"),
    ("tenants:\n  - name: a\n    keys: [k]\n    max_concurrent_streams: 1.5", "must be an integer >= 1"),
    ("tenants: [", "not valid YAML"),
])
def test_a_bad_tenants_file_is_refused_naming_what_to_change(tmp_path, text, message):
    path = tmp_path / "tenants.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_tenants(str(path))


def test_a_key_in_both_the_key_file_and_the_tenants_file_is_refused(tmp_path):
    with pytest.raises(ValueError, match="list it once, under its tenant"):
        ApiKeys.load(["sk-search-1"], tenants_file=write_tenants(tmp_path / "t.yaml"))


# ------------------------------------------------------------ the request
def test_a_tenant_clamps_priority_and_owns_the_cache_namespace():
    batch = Tenant("batch", cache_namespace="batch", max_priority=10)
    assert batch.apply(request(priority=-100)).priority == 10  # asked to jump the queue: clamped
    assert batch.apply(request(priority=42)).priority == 42  # less urgent: as asked
    a, b = Tenant("a", cache_namespace="a"), Tenant("b", cache_namespace="b")
    # B sending A's salt still lands in B's namespace; a client salt narrows, never widens.
    assert a.apply(request(salt="s")).cache_salt != b.apply(request(salt="s")).cache_salt
    assert a.apply(request(salt="s")).cache_salt != a.apply(request()).cache_salt
    assert b.apply(request(salt=a.apply(request()).cache_salt)).cache_salt.startswith("tenant:b:")
    shared = Tenant("a2", cache_namespace="a")
    assert shared.apply(request(salt="s")).cache_salt == a.apply(request(salt="s")).cache_salt
    limits = Tenant("t", max_tokens_per_request=3).limits_over(Limits(max_output_tokens=100))
    assert limits.max_output_tokens == 3
    assert Tenant("t", max_tokens_per_request=300).limits_over(Limits(max_output_tokens=100)).max_output_tokens == 100


# -------------------------------------------------------------- the gate
def test_gate_limits_rate_and_open_streams_per_tenant():
    now = [0.0]
    metrics = RouterMetrics("p")
    gate = TenantGate(metrics, clock=lambda: now[0])
    rate = Tenant("rate", requests_per_s=2.0, burst=2)
    gate.admit(rate).release()
    gate.admit(rate).release()
    with pytest.raises(OverloadedError, match="over its requests_per_s of 2") as info:
        gate.admit(rate)
    assert info.value.retry_after_s == pytest.approx(0.5)
    now[0] = 0.5  # one token back
    gate.admit(rate).release()
    streams = Tenant("streams", max_concurrent_streams=2)
    held = [gate.admit(streams), gate.admit(streams)]
    with pytest.raises(OverloadedError, match="max_concurrent_streams"):
        gate.admit(streams)
    gate.admit(Tenant("other", max_concurrent_streams=1)).release()  # tenants do not share limits
    held[0].release()
    held[0].release()  # idempotent
    assert gate.open_streams(streams) == 1
    gate.admit(streams)
    text = metrics.render().decode()
    assert 'router_tenant_requests_total{outcome="rate_limited",tenant="rate"} 1.0' in text
    assert 'router_tenant_requests_total{outcome="admitted",tenant="rate"} 3.0' in text
    assert 'router_tenant_requests_total{outcome="concurrency_limited",tenant="streams"} 1.0' in text


# ----------------------------------------------------------- front ends
class RecordingBackend:
    """Records each request; streams ``max_tokens`` chunks, holding the first
    chunk of tenant ``search``'s requests back while ``hold`` is clear."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.model = ModelInfo("tiny", 64)
        self.seen: list[GenerationRequest] = []
        self.hold = asyncio.Event()
        self.hold.set()
        self.fail: Optional[Exception] = None

    async def stream(self, request: GenerationRequest) -> AsyncIterator[StreamChunk]:
        self.seen.append(request)
        if self.fail is not None:
            raise self.fail
        if request.cache_salt.startswith("tenant:search"):
            await self.hold.wait()
        n = request.sampling_params.max_tokens
        for i in range(n):
            yield StreamChunk(request.request_id, [100 + i], f" w{i}", FinishReason.LENGTH if i == n - 1 else None,
                              prompt_tokens=len(request.prompt_token_ids), completion_tokens=i + 1,
                              cached_prompt_tokens=1)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tenants")
    tokenizer = make_router_tokenizer(tmp, "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    backend = RecordingBackend(tokenizer)
    security = Security.from_options(tenants_file=write_tenants(tmp / "tenants.yaml"))
    metrics = RouterMetrics("p")
    security.tenant_gate.metrics = metrics
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def run(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(30)

    async def start():
        grpc_server = RouterServer(backend, port=0, security=security, limits=Limits())
        await grpc_server.start()
        return grpc_server, await serve_openai(backend, port=0, security=security)

    grpc_server, http = run(start())
    yield {"backend": backend, "grpc": grpc_server.address, "http": http.url, "loop": loop, "metrics": metrics}
    run(http.stop())
    run(grpc_server.stop(0))
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


def generate(address: str, key: str, prompt_override: str = "hello", **fields) -> list:
    sampling = pb.SamplingParams(max_tokens=fields.pop("max_tokens", 2))

    async def main():
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            call = stub.Generate(pb.GenerateRequest(prompt=prompt_override, sampling=sampling, **fields), timeout=10,
                                 metadata=bearer_metadata(key))
            return [c async for c in call]

    return asyncio.run(main())


def test_grpc_runs_each_call_as_its_keys_tenant(servers):
    backend = servers["backend"]
    backend.seen.clear()
    generate(servers["grpc"], "sk-batch", priority=-7, cache_salt="sk-search-salt")
    generate(servers["grpc"], "sk-search-1", priority=-7, cache_salt="sk-search-salt")
    batch, search = backend.seen
    assert batch.priority == 10 and search.priority == 0  # clamped to each tenant's max_priority
    assert batch.cache_salt == "tenant:batch:sk-search-salt" and search.cache_salt == "tenant:search:sk-search-salt"
    # The token cap of the tenant applies like a server limit: named, INVALID_ARGUMENT.
    with pytest.raises(grpc.aio.AioRpcError) as info:
        generate(servers["grpc"], "sk-search-2", max_tokens=4)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_output_tokens of 3" in info.value.details()


def test_grpc_refuses_a_tenant_over_its_limits_before_parsing(servers):
    backend = servers["backend"]
    backend.seen.clear()
    # batch: a burst of 2 at 0.001 requests/s; one was spent above (or is spent now).
    errors = []
    for _ in range(3):
        try:
            generate(servers["grpc"], "sk-batch")
        except grpc.aio.AioRpcError as exc:
            errors.append(exc)
    assert errors and errors[-1].code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "requests_per_s" in errors[-1].details() and RETRY_AFTER_KEY in dict(errors[-1].trailing_metadata())
    # A refused request reached nothing: no prompt parsed, nothing sent on.
    assert len(backend.seen) == 3 - len(errors)
    # Other tenants are not affected.
    assert generate(servers["grpc"], "sk-shared-a")[-1].finish_reason == "length"


def test_concurrent_streams_are_capped_per_tenant_across_both_front_ends(servers):
    backend, loop = servers["backend"], servers["loop"]
    backend.seen.clear()
    loop.call_soon_threadsafe(backend.hold.clear)
    box: dict = {}

    def held_stream():
        try:
            box["chunks"] = generate(servers["grpc"], "sk-search-1")
        except Exception as exc:  # noqa: BLE001 - asserted below
            box["error"] = exc

    first = threading.Thread(target=held_stream)
    first.start()
    try:
        for _ in range(100):  # until the first stream holds the tenant's only slot
            if len(backend.seen) and backend.seen[-1].cache_salt.startswith("tenant:search"):
                break
            threading.Event().wait(0.05)
        response = httpx2.post(f"{servers['http']}/completions", timeout=10,
                               headers={"Authorization": "Bearer sk-search-2"},
                               json={"model": "tiny", "prompt": "hi", "max_tokens": 1})
        assert response.status_code == 429 and "max_concurrent_streams" in response.json()["error"]["message"]
        assert "retry-after" in response.headers
        other = httpx2.post(f"{servers['http']}/completions", timeout=10,
                            headers={"Authorization": "Bearer sk-shared-b"},
                            json={"model": "tiny", "prompt": "hi", "max_tokens": 1, "priority": -3})
        assert other.status_code == 200
    finally:
        loop.call_soon_threadsafe(backend.hold.set)
        first.join(15)
    assert box.get("chunks") and box["chunks"][-1].finish_reason == "length"
    # The slot is free again once the stream ended.
    ok = httpx2.post(f"{servers['http']}/completions", timeout=10, headers={"Authorization": "Bearer sk-search-2"},
                     json={"model": "tiny", "prompt": "hi", "max_tokens": 1})
    assert ok.status_code == 200
    text = servers["metrics"].render().decode()
    assert 'router_tenant_requests_total{outcome="concurrency_limited",tenant="search"} 1.0' in text
    assert 'router_tenant_tokens_total{kind="completion",tenant="search"}' in text


def test_internal_errors_name_the_request_id_not_the_exception(servers):
    backend = servers["backend"]
    backend.fail = RuntimeError("secret detail: redis://admin:hunter2@10.0.0.7")
    try:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            generate(servers["grpc"], "sk-shared-a", request_id="req-42")
        assert info.value.code() == grpc.StatusCode.INTERNAL
        assert "req-42" in info.value.details() and "hunter2" not in info.value.details()
        response = httpx2.post(f"{servers['http']}/completions", timeout=10,
                               headers={"Authorization": "Bearer sk-shared-a"},
                               json={"model": "tiny", "prompt": "hi", "max_tokens": 1})
        assert response.status_code == 500
        message = response.json()["error"]["message"]
        assert "hunter2" not in message and backend.seen[-1].request_id in message
    finally:
        backend.fail = None


def test_big_requests_are_tokenized_off_the_event_loop(servers, monkeypatch):
    """Bodies / messages of OFFLOAD_BYTES or more are parsed and tokenized in a
    worker thread, small ones on the loop (no thread hop for them)."""
    backend = servers["backend"]
    threads: list[str] = []
    encode = backend.tokenizer.encode

    def recording_encode(text, *args, **kwargs):
        threads.append(threading.current_thread().name)
        return encode(text[:64], *args, **kwargs)  # the tiny model's context: only the thread matters

    monkeypatch.setattr(backend.tokenizer, "encode", recording_encode)
    big = "a " * 40_000  # 80 KB
    for prompt in ("hi", big):
        response = httpx2.post(f"{servers['http']}/completions", timeout=60,
                               headers={"Authorization": "Bearer sk-shared-a"},
                               json={"model": "tiny", "prompt": prompt, "max_tokens": 1})
        assert response.status_code == 200, response.text
    for prompt in ("hi", big):
        assert generate(servers["grpc"], "sk-shared-b", prompt_override=prompt)[-1].finish_reason == "length"
    loop_thread = threads[0]
    assert threads[2] == loop_thread  # gRPC small: on its loop (the same thread as HTTP's here)
    assert threads[1] != loop_thread and threads[3] != loop_thread


def test_every_prompt_of_a_batched_completion_runs_as_the_tenant(servers):
    """Each prompt of ``prompt: [a, b, c]`` gets the tenant's salt and priority,
    not only the first (a client salt must not reach another tenant's cache)."""
    backend = servers["backend"]
    backend.seen.clear()
    response = httpx2.post(f"{servers['http']}/completions", timeout=10,
                           headers={"Authorization": "Bearer sk-search-1"},
                           json={"prompt": ["a", "b", "c"], "max_tokens": 1, "cache_salt": "theirs",
                                 "priority": -5})
    assert response.status_code == 200, response.text
    assert sorted(r.cache_salt for r in backend.seen) == ["tenant:search:theirs"] * 3
    assert [r.priority for r in backend.seen] == [0, 0, 0]
