"""TLS, mTLS and bearer-token authentication of both front ends
(``router.security``), over real loopback sockets with a fake backend.

Certificates are generated here: a CA, a server certificate for 127.0.0.1
and a client certificate, all signed by that CA. Also here: request-size
limits at the transport (gRPC message, HTTP body) and the retry hint of an
overload on both front ends.
"""

from __future__ import annotations

import asyncio
import ssl
import threading
from typing import AsyncIterator, Optional

import grpc
import httpx2
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.shared.types import FinishReason, GenerationRequest, StreamChunk
from router.backend import ModelInfo
from router.errors import OverloadedError
from router.limits import Limits
from router.openai import serve_openai
from router.pb import generation_pb2 as pb
from router.pb import generation_pb2_grpc as pb_grpc
from router.security import ApiKeys, Security, TLSFiles, bearer_metadata, client_channel
from router.server import RETRY_AFTER_KEY, RouterServer
from router.tokenizer import RouterTokenizer
from tests.factories import make_router_tokenizer, make_test_certs

KEY = "sk-test-0123456789"
MODEL = "tiny"


# ------------------------------------------------------------ certificates
@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> dict[str, str]:
    return make_test_certs(tmp_path_factory.mktemp("certs"))


def ca_context(certs: dict[str, str]) -> ssl.SSLContext:
    """A client context that trusts the test CA."""
    return ssl.create_default_context(cafile=certs["ca"] + ".crt")


# ---------------------------------------------------------------- servers
class FakeBackend:
    """Streams ``max_tokens`` chunks; raises ``fail`` instead when set."""

    def __init__(self, tokenizer: RouterTokenizer) -> None:
        self.tokenizer = tokenizer
        self.model = ModelInfo(MODEL, 64)
        self.fail: Optional[Exception] = None

    async def stream(self, request: GenerationRequest) -> AsyncIterator[StreamChunk]:
        if self.fail is not None:
            raise self.fail
        n = request.sampling_params.max_tokens
        for i in range(n):
            yield StreamChunk(request.request_id, [100 + i], f" w{i}",
                              FinishReason.LENGTH if i == n - 1 else None,
                              prompt_tokens=len(request.prompt_token_ids), completion_tokens=i + 1)


class Servers:
    """gRPC and HTTP front ends on one background event loop."""

    def __init__(self, backend: FakeBackend, security: Optional[Security], limits: Optional[Limits] = None) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

        async def start():
            grpc_server = RouterServer(backend, port=0, security=security, limits=limits)
            await grpc_server.start()
            http = await serve_openai(backend, port=0, security=security, limits=limits)
            return grpc_server, http

        self.grpc, self.http = self.run(start())

    def run(self, coro, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.run(self.http.stop())
        self.run(self.grpc.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


@pytest.fixture(scope="module")
def router_tok(tmp_path_factory) -> RouterTokenizer:
    return make_router_tokenizer(tmp_path_factory.mktemp("sec-tok"), "{% for m in messages %}{{ m['content'] }}{% endfor %}")


@pytest.fixture(scope="module")
def backend(router_tok) -> FakeBackend:
    return FakeBackend(router_tok)


@pytest.fixture(scope="module")
def secured(backend, certs):
    """TLS (no client certs) + API key; health open, metrics open."""
    security = Security(tls=TLSFiles(certs["server"] + ".crt", certs["server"] + ".key"), api_keys=ApiKeys([KEY]))
    servers = Servers(backend, security, Limits(max_request_bytes=4096))
    yield servers
    servers.close()


@pytest.fixture(autouse=True)
def _reset(backend):
    backend.fail = None


def grpc_call(address: str, metadata=(), ca: Optional[str] = None, cert: Optional[str] = None,
              insecure: bool = False, request: Optional[pb.GenerateRequest] = None):
    """Runs one Generate; returns the chunks (or raises AioRpcError)."""
    request = request or pb.GenerateRequest(prompt="hello", sampling=pb.SamplingParams(max_tokens=2))

    async def main():
        if insecure:
            channel = grpc.aio.insecure_channel(address)
        else:
            channel = client_channel(address, ca_file=ca, cert_file=cert and cert + ".crt",
                                     key_file=cert and cert + ".key")
        async with channel:
            stub = pb_grpc.GenerationStub(channel)
            return [c async for c in stub.Generate(request, timeout=10, metadata=metadata)]

    return asyncio.run(main())


def health(address: str, ca: str, metadata=()) -> int:
    async def main():
        async with client_channel(address, ca_file=ca) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10,
                                                                     metadata=metadata)
            return reply.status

    return asyncio.run(main())


# ------------------------------------------------------------------ unit
def test_api_keys_accept_only_a_bearer_with_a_known_key(tmp_path):
    keys = ApiKeys(["a-key", "b-key"])
    assert keys.allows("Bearer a-key") and keys.allows(b"bearer  b-key ")
    for bad in (None, "", "a-key", "Basic a-key", "Bearer", "Bearer a-ke", "Bearer a-key2", 42):
        assert not keys.allows(bad)
    assert "a-key" not in repr(keys)
    path = tmp_path / "keys"
    path.write_text("# ops keys\nk1\n\n  k2  \n")
    loaded = ApiKeys.load(["k0"], str(path))
    assert len(loaded) == 3 and loaded.allows("Bearer k2") and loaded.allows("Bearer k0")
    assert ApiKeys.load() is None
    path.write_text("# nothing\n")
    with pytest.raises(ValueError, match="holds no key"):
        ApiKeys.load(key_file=str(path))
    with pytest.raises(ValueError, match="empty or contains whitespace"):
        ApiKeys(["has space"])
    with pytest.raises(ValueError, match="--tls-cert .*missing.crt: cannot read it"):
        TLSFiles(str(tmp_path / "missing.crt"), str(path))


# ------------------------------------------------------------------ gRPC
def test_grpc_needs_the_key_over_tls(secured, certs):
    address, ca = secured.grpc.address, certs["ca"] + ".crt"
    chunks = grpc_call(address, bearer_metadata(KEY), ca=ca)
    assert "".join(c.text for c in chunks) == " w0 w1" and chunks[-1].finish_reason == "length"
    for metadata in ((), bearer_metadata("wrong"), (("authorization", KEY),)):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            grpc_call(address, metadata, ca=ca)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "authorization: Bearer" in info.value.details()


def test_grpc_unary_methods_need_the_key_and_health_stays_open(secured, certs):
    address, ca = secured.grpc.address, certs["ca"] + ".crt"
    assert health(address, ca) == health_pb2.HealthCheckResponse.SERVING

    async def list_replicas(metadata):
        async with client_channel(address, ca_file=ca) as channel:
            await pb_grpc.GenerationStub(channel).ListReplicas(pb.ListReplicasRequest(), timeout=10,
                                                               metadata=metadata)

    with pytest.raises(grpc.aio.AioRpcError) as info:
        asyncio.run(list_replicas(()))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.aio.AioRpcError) as info:  # past auth: this router has no directory
        asyncio.run(list_replicas(bearer_metadata(KEY)))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_grpc_plaintext_to_the_tls_port_fails_cleanly_and_the_server_keeps_serving(secured, certs):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        grpc_call(secured.grpc.address, bearer_metadata(KEY), insecure=True)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert grpc_call(secured.grpc.address, bearer_metadata(KEY), ca=certs["ca"] + ".crt")[-1].finish_reason


def test_grpc_message_over_max_request_bytes_is_refused(secured, certs):
    big = pb.GenerateRequest(prompt="x" * 5000, sampling=pb.SamplingParams(max_tokens=1))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        grpc_call(secured.grpc.address, bearer_metadata(KEY), ca=certs["ca"] + ".crt", request=big)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert grpc_call(secured.grpc.address, bearer_metadata(KEY), ca=certs["ca"] + ".crt")[-1].finish_reason


def test_grpc_overload_carries_a_retry_hint(secured, backend, certs):
    backend.fail = OverloadedError("queue full", retry_after_s=2.5)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        grpc_call(secured.grpc.address, bearer_metadata(KEY), ca=certs["ca"] + ".crt")
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert dict(info.value.trailing_metadata())[RETRY_AFTER_KEY] == "2500"


def test_grpc_mtls_refuses_a_client_without_a_certificate(backend, certs):
    tls = TLSFiles(certs["server"] + ".crt", certs["server"] + ".key", client_ca_file=certs["ca"] + ".crt")
    servers = Servers(backend, Security(tls=tls))
    try:
        ca = certs["ca"] + ".crt"
        with pytest.raises(grpc.aio.AioRpcError) as info:
            grpc_call(servers.grpc.address, ca=ca)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert grpc_call(servers.grpc.address, ca=ca, cert=certs["client"])[-1].finish_reason == "length"
        # HTTP: the handshake fails without a client certificate, succeeds with one.
        context = ssl.create_default_context(cafile=ca)
        with pytest.raises(httpx2.TransportError):
            httpx2.get(f"{servers.http.url}/models", verify=context, timeout=10)
        context.load_cert_chain(certs["client"] + ".crt", certs["client"] + ".key")
        assert httpx2.get(f"{servers.http.url}/models", verify=context, timeout=10).status_code == 200
    finally:
        servers.close()


def test_health_can_require_the_key(backend, certs):
    security = Security(tls=TLSFiles(certs["server"] + ".crt", certs["server"] + ".key"),
                        api_keys=ApiKeys([KEY]), auth_health=True, auth_metrics=True)
    servers = Servers(backend, security)
    try:
        ca = certs["ca"] + ".crt"
        with pytest.raises(grpc.aio.AioRpcError) as info:
            health(servers.grpc.address, ca)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert health(servers.grpc.address, ca, bearer_metadata(KEY)) == health_pb2.HealthCheckResponse.SERVING
        base = servers.http.url.removesuffix("/v1")
        for path in ("/health", "/metrics"):
            assert httpx2.get(base + path, verify=ca_context(certs), timeout=10).status_code == 401
        assert httpx2.get(base + "/health", verify=ca_context(certs), timeout=10,
                          headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    finally:
        servers.close()


# ------------------------------------------------------------------ HTTP
def test_http_needs_the_key_over_tls(secured, certs):
    url = secured.http.url
    assert url.startswith("https://127.0.0.1:")
    refused = httpx2.get(f"{url}/models", verify=ca_context(certs), timeout=10)
    assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
    assert refused.json()["error"]["code"] == "invalid_api_key"
    wrong = httpx2.post(f"{url}/completions", verify=ca_context(certs), timeout=10,
                        headers={"Authorization": "Bearer nope"},
                        json={"prompt": "hi", "max_tokens": 1})
    assert wrong.status_code == 401
    # Health is open; /metrics is open too (404 here: no metrics configured, but not 401).
    base = url.removesuffix("/v1")
    assert httpx2.get(f"{base}/health", verify=ca_context(certs), timeout=10).status_code == 200
    assert httpx2.get(f"{base}/metrics", verify=ca_context(certs), timeout=10).status_code == 404
    # The official client with the key and the CA works.
    with openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=20,
                       http_client=openai.DefaultHttpxClient(verify=ca_context(certs))) as client:
        out = client.completions.create(model=MODEL, prompt="hello", max_tokens=3)
    assert out.choices[0].text == " w0 w1 w2"


def test_http_plaintext_to_the_tls_port_fails_cleanly(secured, certs):
    plain = secured.http.url.replace("https://", "http://")
    try:
        response = httpx2.get(f"{plain}/models", timeout=10, headers={"Authorization": f"Bearer {KEY}"})
    except httpx2.TransportError:
        pass  # the TLS server drops the plaintext connection
    else:
        assert response.status_code >= 400, "a TLS port must not serve plaintext"
    ok = httpx2.get(f"{secured.http.url}/models", verify=ca_context(certs), timeout=10,
                    headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200


def test_http_body_over_max_request_bytes_is_413(secured, certs):
    response = httpx2.post(f"{secured.http.url}/completions", verify=ca_context(certs), timeout=10,
                           headers={"Authorization": f"Bearer {KEY}"}, json={"prompt": "x" * 5000})
    assert response.status_code == 413
    error = response.json()["error"]
    assert error["code"] == "request_too_large" and "max_request_bytes is 4096" in error["message"]


def test_http_overload_is_429_with_retry_after(secured, backend, certs):
    backend.fail = OverloadedError("queue full", retry_after_s=2.5)
    response = httpx2.post(f"{secured.http.url}/completions", verify=ca_context(certs), timeout=10,
                           headers={"Authorization": f"Bearer {KEY}"}, json={"prompt": "x", "max_tokens": 1})
    assert response.status_code == 429 and response.headers["retry-after"] == "3"
    assert response.json()["error"]["code"] == "overloaded"


# ------------------------------------------------------------------ CLI
def test_cli_generate_url_uses_tls_and_the_key_from_the_environment(secured, certs, capsys, monkeypatch):
    from cluster.cli import build_parser
    from cluster.client.generate import _generate_remote

    monkeypatch.setenv("PREFIXSERVE_API_KEY", KEY)
    argv = ["generate", "--url", secured.grpc.address, "--tls-ca", certs["ca"] + ".crt", "--max-tokens", "2", "hi"]
    assert asyncio.run(_generate_remote(build_parser().parse_args(argv))) == 0
    assert capsys.readouterr().out == " w0 w1\n"
    monkeypatch.delenv("PREFIXSERVE_API_KEY")
    assert asyncio.run(_generate_remote(build_parser().parse_args(argv))) == 4  # UNAUTHENTICATED, logged
    assert capsys.readouterr().out == ""


def test_health_port_answers_plaintext_probes_while_the_main_port_speaks_tls(backend, certs):
    """Kubernetes' gRPC probes speak no TLS: ``health_port`` serves grpc.health.v1
    alone in plaintext, reporting what the TLS port reports (NOT_SERVING on a
    drain), and nothing else (no Generation there, so no way around TLS or keys)."""
    security = Security(tls=TLSFiles(certs["server"] + ".crt", certs["server"] + ".key"), api_keys=ApiKeys([KEY]))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def run(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(30)

    server = RouterServer(backend, port=0, security=security, health_port=0)
    run(server.start())
    try:
        plain = f"127.0.0.1:{server.health_port}"

        async def probe():
            async with grpc.aio.insecure_channel(plain) as channel:
                return (await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                                        timeout=10)).status

        async def generate_on_health_port():
            async with grpc.aio.insecure_channel(plain) as channel:
                request = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=1))
                return [c async for c in pb_grpc.GenerationStub(channel).Generate(
                    request, timeout=10, metadata=bearer_metadata(KEY))]

        assert asyncio.run(probe()) == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError) as info:
            asyncio.run(generate_on_health_port())
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
        run(server.not_serving())
        assert asyncio.run(probe()) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert health(server.address, certs["ca"] + ".crt") == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        run(server.stop(0))
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
