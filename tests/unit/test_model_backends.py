"""Several models behind one router: the request's `model` picks the backend, over HTTP and gRPC."""

from __future__ import annotations

import asyncio

import grpc
import httpx2 as httpx
import openai
import pytest

from router.backend import ModelInfo
from router.models import ModelBackends, ModelNotFoundError
from router.pb import generation_pb2 as pb
from router.pb import generation_pb2_grpc as pb_grpc
from tests.factories import make_router_tokenizer
from tests.unit.grpc_server import serving_grpc
from tests.unit.http_api.openai_server import TEMPLATE, FakeBackend, serving


def _backend(tok, name: str, max_len: int) -> FakeBackend:
    backend = FakeBackend(tok)
    backend.model = ModelInfo(name, max_len)
    return backend


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    tok = make_router_tokenizer(tmp_path_factory.mktemp("tok"), TEMPLATE)
    return _backend(tok, "alpha", 256), _backend(tok, "beta", 64)


@pytest.fixture(scope="module")
def http(two):
    with serving(ModelBackends({"alpha": two[0], "beta": two[1]})) as handle:
        with openai.OpenAI(base_url=handle.url, api_key="unused", max_retries=0, timeout=20) as client:
            yield client, handle.url


@pytest.fixture(autouse=True)
def _clear(two):
    for backend in two:
        backend.requests.clear()


def test_pick_by_name_and_the_first_is_the_default(two):
    backends = ModelBackends({"alpha": two[0], "beta": two[1]})
    assert backends.pick("beta") is two[1] and backends.pick(None) is two[0] and backends.pick("") is two[0]
    assert backends.names == ["alpha", "beta"]
    with pytest.raises(ModelNotFoundError, match="'gpt-4' does not exist: this server serves 'alpha', 'beta'"):
        backends.pick("gpt-4")
    with pytest.raises(ValueError, match="model must be a string"):
        backends.pick(3)
    assert ModelBackends.of(two[1]).names == ["beta"]


def test_models_lists_every_served_model(http):
    client, _ = http
    cards = client.models.list().data
    assert [(m.id, m.max_model_len) for m in cards] == [("alpha", 256), ("beta", 64)]


def test_each_request_goes_to_its_models_backend(http, two):
    client, _ = http
    out = client.completions.create(model="beta", prompt="hello", max_tokens=3)
    assert out.model == "beta" and out.choices[0].text == " w0 w1 w2"
    chat = client.chat.completions.create(model="alpha", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=2, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices) == " w0 w1"
    assert [len(b.requests) for b in two] == [1, 1]


def test_a_request_without_model_goes_to_the_first(http, two):
    _, url = http
    reply = httpx.post(f"{url}/completions", json={"prompt": "hello", "max_tokens": 1}, timeout=20)
    assert reply.status_code == 200 and reply.json()["model"] == "alpha"
    assert [len(b.requests) for b in two] == [1, 0]


def test_each_models_limits_apply(http):
    client, _ = http
    with pytest.raises(openai.BadRequestError, match="64"):  # beta's max_model_len, not alpha's
        client.completions.create(model="beta", prompt="hello", max_tokens=100)


def test_an_unknown_model_is_404_naming_the_served_ones(http, two):
    client, url = http
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4", prompt="hello", max_tokens=1)
    body = err.value.response.json()["error"]
    assert body["code"] == "model_not_found" and body["param"] == "model"
    assert "'alpha', 'beta'" in body["message"]
    reply = httpx.post(f"{url.removesuffix('/v1')}/tokenize", json={"model": "nope", "prompt": "hi"}, timeout=20)
    assert reply.status_code == 404 and reply.json()["error"]["code"] == "model_not_found"
    assert [len(b.requests) for b in two] == [0, 0]


def test_tokenize_reports_the_named_models_limit(http):
    _, url = http
    reply = httpx.post(f"{url.removesuffix('/v1')}/tokenize", json={"model": "beta", "prompt": "hi"}, timeout=20)
    assert reply.status_code == 200 and reply.json()["max_model_len"] == 64


@pytest.fixture(scope="module")
def grpc_address(two):
    with serving_grpc(ModelBackends({"alpha": two[0], "beta": two[1]})) as address:
        yield address


def _generate(address: str, **fields) -> list[pb.GenerateResponse]:
    request = pb.GenerateRequest(prompt="hello", sampling=pb.SamplingParams(max_tokens=2), **fields)
    with grpc.insecure_channel(address) as channel:
        return list(pb_grpc.GenerationStub(channel).Generate(request, timeout=20))


def test_grpc_routes_by_the_model_field(grpc_address, two):
    assert "".join(r.text for r in _generate(grpc_address, model="beta")) == " w0 w1"
    assert "".join(r.text for r in _generate(grpc_address)) == " w0 w1"  # empty: the first model
    assert [len(b.requests) for b in two] == [1, 1]


def test_grpc_unknown_model_is_not_found(grpc_address, two):
    with pytest.raises(grpc.RpcError) as err:
        _generate(grpc_address, model="gpt-4")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert "this server serves 'alpha', 'beta'" in err.value.details()
    assert [len(b.requests) for b in two] == [0, 0]


def test_list_replicas_names_each_replicas_model_and_status_shows_it():
    from cluster.client.status import ReplicaRow, format_status
    from router.models import ModelDirectories
    from router.server import _replica_info

    class Directory:
        def __init__(self, stats):
            self.stats = stats

        async def replica_stats(self):
            return self.stats

    both = ModelDirectories({"alpha": Directory({"r1": {"num_running": 2}}), "beta": Directory({"r2": {}}),
                             "gamma": None})
    stats = asyncio.run(both.replica_stats())
    infos = [_replica_info(rid, s) for rid, s in sorted(stats.items())]
    assert [(i.replica_id, i.model, i.num_running) for i in infos] == [("r1", "alpha", 2), ("r2", "beta", 0)]
    rows = {i.replica_id: ReplicaRow(i.replica_id, model=i.model, running=i.num_running) for i in infos}
    lines = format_status(rows, {}, show_metrics=False)
    assert lines[0].split()[:2] == ["replica", "model"] and "alpha" in lines[1] and "beta" in lines[2]
    one = format_status({"r1": ReplicaRow("r1", model="alpha")}, {}, show_metrics=False)
    assert "model" not in one[0]  # one model: no column


def test_an_empty_model_is_the_default_over_http_as_over_grpc(http, two):
    _, url = http
    reply = httpx.post(f"{url}/completions", json={"model": "", "prompt": "hello", "max_tokens": 1}, timeout=20)
    assert reply.status_code == 200 and reply.json()["model"] == "alpha"
    assert [len(b.requests) for b in two] == [1, 0]
