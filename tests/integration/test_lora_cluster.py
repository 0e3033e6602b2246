"""LoRA adapters through ``prefixserve up --enable-lora --lora-modules``: the
openai client's ``model="<adapter>"`` answers with that adapter's tokens
(equal to the offline engine's), ``/v1/models`` lists the adapters with their
parent, and two replicas serve six adapters with ``--max-loras 2`` under
concurrent load, none refused; gRPC names an adapter in ``model`` too; an
adapter loaded and unloaded at run time answers, then is 404."""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest

from cluster.shared.types import LoRARequest, SamplingParams
from router.pb import generation_pb2 as pb
from router.pb import generation_pb2_grpc as pb_grpc
from tests.engine.test_lora import ADAPTERS, save_adapter
from tests.factories import make_tiny_model_dir
from tests.integration.up_process import running_up

PROMPT = "hello world"
NUM_TOKENS = 8
NAMES = [f"ad{i}" for i in range(6)]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-up")
    base = make_tiny_model_dir("llama", root / "base", seed=4)
    specs = list(ADAPTERS.values())
    adapters = {name: save_adapter(base, root / name, *specs[i % len(specs)], seed=20 + i)
                for i, name in enumerate(NAMES)}
    return base, adapters


@pytest.fixture(scope="module")
def expected(folders):
    from workers.llm import LLM

    base, adapters = folders
    with LLM(str(base), block_size=4, enable_lora=True, max_loras=2, max_cpu_loras=6) as llm:
        outs = llm.generate([PROMPT] * 7, SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0),
                            lora_request=[None] + [LoRARequest(n, 0, str(adapters[n])) for n in NAMES])
    texts = {name: out.text for name, out in zip([None, *NAMES], outs)}
    assert len(set(texts.values())) > 3, texts  # the adapters change the output
    return texts


@pytest.fixture(scope="module")
def served(folders, tmp_path_factory):
    base, adapters = folders
    modules = [f"{name}={path}" for name, path in adapters.items()]
    log_path = tmp_path_factory.mktemp("lora-up-log") / "up.log"
    with running_up(log_path, "--model", str(base), "--replicas", "2", "--enable-lora", "--max-loras", "2",
                    "--max-cpu-loras", "3", "--allow-runtime-lora-updating", "--lora-modules", *modules, "--block-size", "4",
                    "--kv-cache-memory", "0.01", "--swap-space", "0.01", "--replica-num-cpus", "0.25",
                    "--grpc-port", "0", "--http-port", "0") as (proc, text):
        base_url = re.search(r"OpenAI HTTP on (http://127\.0\.0\.1:\d+/v1)", text).group(1)
        address = re.search(r"gRPC on (127\.0\.0\.1:\d+)", text).group(1)
        yield base_url, address


def test_models_lists_the_adapters_with_their_parent(served, folders):
    base_url, _ = served
    with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120) as client:
        cards = client.models.list().data
    assert cards[0].parent is None
    assert [(c.id, c.parent) for c in cards[1:]] == [(name, cards[0].id) for name in NAMES]
    assert cards[1].root == str(folders[1]["ad0"])


def test_six_adapters_on_two_replicas_with_max_loras_2(served, expected):
    base_url, _ = served
    jobs = [NAMES[i % 6] for i in range(18)] + [None, None]

    def complete(name):
        with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300) as client:
            out = client.completions.create(model=name or "base", prompt=PROMPT, max_tokens=NUM_TOKENS, temperature=0)
            return name, out.choices[0].text

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(complete, jobs))
    assert [text for _, text in results] == [expected[name] for name in jobs]


def test_grpc_model_names_an_adapter(served, expected):
    _, address = served
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        request = pb.GenerateRequest(prompt=PROMPT, model="ad3", sampling=pb.SamplingParams(
            max_tokens=NUM_TOKENS, temperature=0.0))
        text = "".join(r.text for r in stub.Generate(request, timeout=120))
        assert text == expected["ad3"]
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(pb.GenerateRequest(prompt=PROMPT, model="ad9"), timeout=60))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and "'ad5'" in err.value.details()


def holders(address: str) -> list[str]:
    """The adapters every replica reports loaded (ListReplicas, about a second old)."""
    with grpc.insecure_channel(address) as channel:
        replicas = pb_grpc.GenerationStub(channel).ListReplicas(pb.ListReplicasRequest(), timeout=30).replicas
    return [name for replica in replicas for name in replica.lora_adapters]


def test_load_and_unload_an_adapter_at_run_time(served, folders, expected, tmp_path):
    import httpx2

    base_url, _ = served
    loaded = httpx2.post(f"{base_url}/load_lora_adapter", json={"lora_name": "rt", "lora_path": str(folders[1]["ad2"])},
                         timeout=120)
    assert loaded.status_code == 200, loaded.text
    with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120) as client:
        out = client.completions.create(model="rt", prompt=PROMPT, max_tokens=NUM_TOKENS, temperature=0)
        assert out.choices[0].text == expected["ad2"]
        (tmp_path / "adapter_config.json").write_text("{not json")
        bad = httpx2.post(f"{base_url}/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(tmp_path)},
                          timeout=120)
        assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]
        deadline = time.monotonic() + 10  # the replicas' stats come with their heartbeats (1 s)
        while "rt" not in holders(served[1]) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert "rt" in holders(served[1])  # the check's replica, or the one that answered, holds it
        assert httpx2.post(f"{base_url}/unload_lora_adapter", json={"lora_name": "rt"}, timeout=60).status_code == 200
        deadline = time.monotonic() + 30  # replicas follow the registry every 2 s (workers/lora/registry_sync.py)
        while "rt" in holders(served[1]) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert "rt" not in holders(served[1])  # its weights left every replica, not waiting for the LRU
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="rt", prompt=PROMPT, max_tokens=1)
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="bad", prompt=PROMPT, max_tokens=1)
