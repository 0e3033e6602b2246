"""LoRA adapters at the front ends: ``model`` names an adapter (its name or
``<model>:<adapter>``) and the request carries its ``LoRARequest``, over HTTP
and gRPC; ``/v1/models`` lists adapters with their parent; an unknown name is
404 naming the adapters too; the request router hashes an adapter's blocks
with the content hash its replicas publish, never the name alone."""

from __future__ import annotations

import grpc
import openai
import pytest

from cluster.shared.config import LoRAConfig
from cluster.shared.hashing import hash_block_chain, lora_fingerprint, root_hash
from cluster.shared.types import FinishReason, GenerationRequest, LoRARequest, SamplingParams
from router.backend import ModelInfo
from router.models import ModelBackends, ModelNotFoundError
from router.pb import generation_pb2 as pb
from router.pb import generation_pb2_grpc as pb_grpc
from tests.factories import make_router_tokenizer
from tests.unit.grpc_server import serving_grpc
from tests.unit.http_api.openai_server import TEMPLATE, FakeBackend, serving

MODULES = LoRAConfig(enable_lora=True, lora_modules=("sql=/adapters/sql", "chat=/adapters/chat"))


@pytest.fixture(scope="module")
def backends(tmp_path_factory):
    tok = make_router_tokenizer(tmp_path_factory.mktemp("tok"), TEMPLATE)
    base, other = FakeBackend(tok), FakeBackend(tok)
    base.model = ModelInfo("base", 256, MODULES)
    other.model = ModelInfo("other", 256)
    return ModelBackends({"base": base, "other": other})


@pytest.fixture(autouse=True)
def _clear(backends):
    for backend in backends:
        backend.requests.clear()


def test_model_info_resolves_adapters():
    info = ModelInfo("base", 256, MODULES)
    assert info.adapters == {"sql": "/adapters/sql", "chat": "/adapters/chat"}
    assert info.adapter_of("sql") == "sql" and info.adapter_of("base:chat") == "chat"
    assert info.adapter_of("base") is None and info.adapter_of("other:sql") is None
    assert info.lora_request("base:sql") == LoRARequest("sql", 0, "/adapters/sql")
    assert info.lora_request("base") is None and ModelInfo("m", 8).adapters == {}


def test_pick_finds_the_model_serving_an_adapter(backends):
    base = list(backends)[0]
    assert backends.pick("sql") is base and backends.pick("base:chat") is base
    with pytest.raises(ModelNotFoundError, match="'base', 'other', 'sql', 'chat'"):
        backends.pick("other:sql")


def test_http_requests_carry_the_adapter_and_models_lists_them(backends):
    base = list(backends)[0]
    with serving(backends) as handle:
        with openai.OpenAI(base_url=handle.url, api_key="unused", max_retries=0, timeout=20) as client:
            cards = client.models.list().data
            assert [(c.id, c.parent) for c in cards] == [("base", None), ("sql", "base"), ("chat", "base"),
                                                          ("other", None)]
            assert cards[1].root == "/adapters/sql"
            out = client.completions.create(model="sql", prompt="hello", max_tokens=2)
            assert out.model == "sql"
            client.chat.completions.create(model="base:chat", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=1)
            client.completions.create(model="base", prompt="hello", max_tokens=1)
            with pytest.raises(openai.NotFoundError, match="'sql', 'chat'"):
                client.completions.create(model="nope", prompt="hello", max_tokens=1)
    assert [r.lora_request for r in base.requests] == [LoRARequest("sql", 0, "/adapters/sql"),
                                                       LoRARequest("chat", 0, "/adapters/chat"), None]


def test_grpc_requests_carry_the_adapter(backends):
    base = list(backends)[0]
    with serving_grpc(backends) as address:
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            for model in ("chat", "base", "base:sql"):
                list(stub.Generate(pb.GenerateRequest(prompt="hello", sampling=pb.SamplingParams(max_tokens=1),
                                                      model=model), timeout=20))
    assert [r.lora_request and r.lora_request.lora_name for r in base.requests] == ["chat", None, "sql"]


def test_the_request_router_hashes_adapter_blocks_by_content():
    serve_common = pytest.importorskip("ray.serve._private.common")
    from router.serve_router import PrefixAwareRequestRouter
    from tests.unit.test_serve_router import FakeReplica

    router = PrefixAwareRequestRouter(serve_common.DeploymentID("d", "app"),
                                      serve_common.DeploymentHandleSource.UNKNOWN)
    router.initialize_state(redis_url=None, block_size=4, model_fingerprint="fp")
    holder, other = FakeReplica("r0"), FakeReplica("r1")
    holder.routing_stats = {"lora_adapters": (("chat", "c0ffee"), ("sql", "5eed"))}
    assert router._adapter_fingerprint("sql", [other, holder]) == lora_fingerprint("fp", "5eed")
    unknown = router._adapter_fingerprint("new", [other, holder])
    assert unknown not in ("fp", lora_fingerprint("fp", "new"))
    # The engine salts the same way (workers/engine/engine.py): same content, same chain.
    prompt = list(range(12))
    request = GenerationRequest("x", prompt, SamplingParams(), lora_request=LoRARequest("sql"))
    assert request.lora_request.lora_name == "sql"
    assert hash_block_chain(prompt, 4, root_hash(lora_fingerprint("fp", "5eed"), "")) != \
        hash_block_chain(prompt, 4, root_hash("fp", ""))


def test_lora_config_from_flags_and_from_a_config_file():
    from cluster.cli.flags import Parser, add_engine_args, engine_kwargs
    from cluster.shared.config import EngineConfig
    from cluster.shared.config.loading import build_strict

    parser = Parser()
    add_engine_args(parser)
    args = parser.parse_args(["--enable-lora", "--max-loras", "2", "--lora-modules", "sql=/a", "chat=/b"])
    config = EngineConfig.from_kwargs(**engine_kwargs(args))
    assert config.lora.enable_lora and config.lora.max_loras == 2 and config.lora.cpu_capacity == 2
    assert config.lora.modules == {"sql": "/a", "chat": "/b"}
    filed = build_strict(EngineConfig, {"enable_lora": True, "lora_modules": {"sql": "/a"}, "max_lora_rank": 32})
    assert filed.lora.lora_modules == ("sql=/a",) and filed.lora.max_lora_rank == 32
    assert EngineConfig.from_kwargs(**filed.flat()) == filed
    with pytest.raises(ValueError, match="need enable_lora"):
        EngineConfig.from_kwargs(lora_modules=["sql=/a"])
    with pytest.raises(ValueError, match="name=path"):
        EngineConfig.from_kwargs(enable_lora=True, lora_modules=["sql"])
    with pytest.raises(ValueError, match="max_cpu_loras"):
        EngineConfig.from_kwargs(enable_lora=True, max_loras=4, max_cpu_loras=2)
    # Adapters shard with the model (tests/engine/test_lora_tp.py).
    assert EngineConfig.from_kwargs(enable_lora=True, tensor_parallel_size=2).parallel.tensor_parallel_size == 2


def test_grpc_lora_adapter_field(backends):
    base = list(backends)[0]
    with serving_grpc(backends) as address:
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            list(stub.Generate(pb.GenerateRequest(prompt="hello", sampling=pb.SamplingParams(max_tokens=1),
                                                  model="base", lora_adapter="sql"), timeout=20))
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(pb.GenerateRequest(prompt="hello", model="base", lora_adapter="nope"),
                                   timeout=20))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "'chat', 'sql'" in err.value.details()
    assert base.requests[-1].lora_request == LoRARequest("sql", 0, "/adapters/sql")


def test_list_replicas_and_status_show_the_loaded_adapters():
    from cluster.client.status import ReplicaRow, format_status
    from router.server import _replica_info

    info = _replica_info("r0", {"num_running": 1, "lora_adapters": "sql,chat"})
    assert list(info.lora_adapters) == ["sql", "chat"]
    assert list(_replica_info("r1", {"lora_adapters": ""}).lora_adapters) == []
    lines = format_status({"r0": ReplicaRow("r0", lora_adapters=tuple(info.lora_adapters)), "r1": ReplicaRow("r1")},
                          {}, show_metrics=False)
    assert "LoRA adapters" in lines[0] and "sql,chat" in lines[1] and lines[2].rstrip().endswith("-")


def test_replica_metrics_count_requests_and_tokens_per_adapter():
    from workers.engine.outputs import RequestOutput
    from workers.metrics import MAX_LORA_NAMES, ReplicaMetrics

    metrics = ReplicaMetrics("r0", "base")
    for name in ["sql", "sql", *[f"a{i}" for i in range(MAX_LORA_NAMES + 3)]]:
        timer = metrics.start_request(lora_name=name)
        timer.on_output(RequestOutput("x", [1, 2], "", FinishReason.STOP, num_prompt_tokens=3, num_output_tokens=2,
                                      num_cached_tokens=0))
    metrics.record_lora(num_loaded=3, num_active=2, num_loads=5, num_evictions=2, load_seconds=[0.02, 0.3])
    metrics.record_lora(num_loaded=3, num_active=2, num_loads=5, num_evictions=2)  # no new load: nothing observed
    text = metrics.render().decode()
    assert 'prefixserve:lora_load_seconds_count{model="base",replica="r0"} 2.0' in text  # both loads of the step
    assert 'prefixserve:lora_requests_total{lora_name="sql",model="base",replica="r0"} 2.0' in text
    assert 'prefixserve:lora_generation_tokens_total{lora_name="sql",model="base",replica="r0"} 4.0' in text
    assert 'lora_name="_other"' in text and text.count("prefixserve:lora_requests_total{") == MAX_LORA_NAMES + 1
    assert 'prefixserve:lora_loads_total{model="base",replica="r0"} 5.0' in text
    assert 'prefixserve:lora_loaded_adapters{model="base",replica="r0"} 3.0' in text


def test_adapters_by_name_from_the_dynamic_folder(tmp_path):
    (tmp_path / "dyn1").mkdir()
    (tmp_path / "dyn1" / "adapter_config.json").write_text("{}")
    (tmp_path / "notes").mkdir()  # a folder without an adapter is not one
    info = ModelInfo("base", 256, LoRAConfig(enable_lora=True, lora_modules=("sql=/a",),
                                             dynamic_lora_loading_path=str(tmp_path)))
    assert info.adapters == {"sql": "/a", "dyn1": str(tmp_path / "dyn1")}
    assert info.lora_request("base:dyn1") == LoRARequest("dyn1", 0, str(tmp_path / "dyn1"))
    for name in ("notes", "missing", "../dyn1", ".hidden", "a/b"):
        assert info.adapter_of(name) is None, name
    # A folder only the replicas mount: the router passes a plain name on, the replica loads it or says why.
    remote = ModelInfo("base", 256, LoRAConfig(enable_lora=True, dynamic_lora_loading_path="/mnt/not-here"))
    assert remote.lora_request("team-a") == LoRARequest("team-a", 0, "/mnt/not-here/team-a")
    assert remote.adapter_of("../etc") is None and remote.adapters == {}


def test_an_api_key_bound_to_adapters(tmp_path):
    from router.tenants import load_tenants

    path = tmp_path / "tenants.yaml"
    path.write_text("tenants:\n  - name: team-a\n    keys: [sk-a]\n    lora_adapters: [sql]\n"
                    "  - name: base-only\n    keys: [sk-b]\n    lora_adapters: []\n"
                    "  - name: any\n    keys: [sk-c]\n")
    tenants = {t.name: t for _, t in load_tenants(str(path))}
    sql = GenerationRequest("r", [1], SamplingParams(), lora_request=LoRARequest("sql"))
    chat = GenerationRequest("r", [1], SamplingParams(), lora_request=LoRARequest("chat"))
    plain = GenerationRequest("r", [1], SamplingParams())
    assert tenants["team-a"].apply(sql).lora_request == LoRARequest("sql")
    for name, request in (("team-a", chat), ("base-only", sql)):
        with pytest.raises(ModelNotFoundError, match="does not exist for this API key"):
            tenants[name].apply(request)
    assert tenants["base-only"].apply(plain).cache_salt == "tenant:base-only"
    assert tenants["any"].apply(chat).lora_request == LoRARequest("chat")
    path.write_text("tenants:\n  - name: t\n    keys: [sk-a]\n    lora_adapters: sql\n")
    with pytest.raises(ValueError, match="lora_adapters must be a list"):
        load_tenants(str(path))


def test_load_and_unload_adapters_at_run_time(tmp_path):
    import httpx2

    from router.lora_registry import RuntimeAdapters
    from router.security import Security

    tok = make_router_tokenizer(tmp_path, TEMPLATE)
    backend = FakeBackend(tok)
    config = LoRAConfig(enable_lora=True, lora_modules=("sql=/adapters/sql",), allow_runtime_lora_updating=True)
    backend.model = ModelInfo("base", 256, config, RuntimeAdapters())
    (tmp_path / "tenants.yaml").write_text("tenants:\n  - name: ops\n    keys: [sk-ops]\n    lora_admin: true\n"
                                            "  - name: app\n    keys: [sk-app]\n")
    security = Security.from_options(tenants_file=str(tmp_path / "tenants.yaml"))
    with serving(ModelBackends({"base": backend}), security) as handle:
        def post(path, body, key="sk-ops"):
            return httpx2.post(f"{handle.url}/{path}", json=body, headers={"Authorization": f"Bearer {key}"},
                               timeout=20)

        assert post("load_lora_adapter", {"lora_name": "new", "lora_path": "/x"}, key="sk-app").status_code == 403
        loaded = post("load_lora_adapter", {"lora_name": "new", "lora_path": "/adapters/new"})
        assert loaded.status_code == 200 and "added successfully" in loaded.text
        models = httpx2.get(f"{handle.url}/models", headers={"Authorization": "Bearer sk-app"}, timeout=20).json()
        assert [m["id"] for m in models["data"]] == ["base", "sql", "new"]
        assert post("completions", {"model": "new", "prompt": "hi", "max_tokens": 1}, key="sk-app").status_code == 200
        first = backend.requests[-1].lora_request
        assert (first.lora_name, first.lora_path) == ("new", "/adapters/new") and first.lora_int_id > 0
        # Loaded again: a new generation, so replicas read it afresh.
        assert post("load_lora_adapter", {"lora_name": "new", "lora_path": "/adapters/new"}).status_code == 200
        post("completions", {"model": "new", "prompt": "hi", "max_tokens": 1})
        assert backend.requests[-1].lora_request.lora_int_id > first.lora_int_id
        for body, status in (({"lora_name": "sql", "lora_path": "/y"}, 400),
                             ({"lora_name": "a:b", "lora_path": "/y"}, 400), ({"lora_name": "z"}, 400),
                             ({"lora_name": "z", "lora_path": "/y", "model": "gpt"}, 404)):
            assert post("load_lora_adapter", body).status_code == status, body
        assert post("unload_lora_adapter", {"lora_name": "new"}).text.endswith("removed successfully.")
        assert post("completions", {"model": "new", "prompt": "hi", "max_tokens": 1}).status_code == 404
        assert post("unload_lora_adapter", {"lora_name": "new"}).status_code == 404
        assert post("unload_lora_adapter", {"lora_name": "sql"}).status_code == 400
    off = FakeBackend(tok)
    off.model = ModelInfo("base", 256, LoRAConfig(enable_lora=True))
    with serving(ModelBackends({"base": off})) as handle:
        reply = httpx2.post(f"{handle.url}/load_lora_adapter", json={"lora_name": "n", "lora_path": "/p"}, timeout=20)
        assert reply.status_code == 404 and "allow-runtime-lora-updating" in reply.text
