"""GPTQ and AWQ checkpoints: their standard 4-bit layouts, read and written.

A folder whose ``config.json`` has ``quantization_config.quant_method`` ``gptq``
or ``awq`` is loaded with its packed tensors (vLLM does the same without being
told; ``quantization=`` may name the method or stay None)::

    GPTQ (v1, AutoGPTQ / GPTQModel)          AWQ (AutoAWQ "GEMM")
    qweight int32 [K / 8, N]  along K        qweight int32 [K, N / 8]  along N, nibble i
            nibble j = input 8i + j                  = column 8c + (0,2,4,6,1,3,5,7)[i]
    qzeros  int32 [G, N / 8]  zero - 1       qzeros  int32 [G, N / 8]  same order, zero
    scales  fp16  [G, N]                     scales  fp16  [G, N]
    g_idx   int32 [K]  group of each input   (groups of group_size consecutive inputs)
            (act order: not consecutive)

    W[n, k] = scales[g(k), n] * (q[k, n] - zero[g(k), n])

Each layer becomes a ``qgemm.QuantWeight`` (4-bit, ``scale * q + min`` with
``min = -scale * zero``); the float model is loaded with exactly those values
(``scale * q + min`` in float32), so the quantized and the float runs compute
the same weights. With act order the inputs are permuted so that groups are
consecutive and ``x`` is permuted the same way at run time (one permutation
per input: GPTQ derives it from the inputs' Hessian, which q/k/v and
gate/up share). ``checkpoint_writer.write_checkpoint`` writes both layouts from a float model
(``prefixserve quantize``).

W8A8 (SmoothQuant) checkpoints use compressed-tensors' ``int-quantized``
format, as llm-compressor writes and vLLM reads: each linear layer's
``weight`` int8 ``[N, K]`` and ``weight_scale`` ``[N, 1]`` (symmetric, one
scale per output channel), activations quantized per token at run time
(``input_activations.dynamic``), the smoothing already folded into the float
norms and producer rows; ``checkpoint_writer.write_w8a8_checkpoint`` writes one.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
import torch

from workers.model.quant.gguf_blocks import DecodedWeight

logger = logging.getLogger(__name__)

METHODS = ("gptq", "awq")
W8A8 = "w8a8"  # compressed-tensors int-quantized
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # column offset held by nibble i of a packed AWQ int32
PARTS = ("qweight", "qzeros", "scales")
LINEAR_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class QuantSpec:
    """``quantization_config`` of a GPTQ / AWQ checkpoint."""

    method: str
    bits: int
    group_size: int
    desc_act: bool = False

    @classmethod
    def from_config(cls, folder: Path) -> Optional["QuantSpec"]:
        """The folder's spec, None when its config.json has no GPTQ / AWQ ``quantization_config``.

        Raises:
            ValueError: A method or setting this loader does not read (says which).
        """
        path = folder / "config.json"
        if not path.is_file():
            return None
        qc = json.loads(path.read_text()).get("quantization_config")
        if not qc:
            return None
        method = str(qc.get("quant_method", "")).lower()
        if method == "compressed-tensors":
            return cls._compressed_tensors(path, qc)
        if method not in METHODS:
            raise ValueError(f"{path}: quantization_config.quant_method {method!r} is not supported; "
                             f"supported: gptq, awq, compressed-tensors (W8A8 int8)")
        bits = int(qc.get("bits", qc.get("w_bit", 4)))
        group = int(qc.get("group_size", qc.get("q_group_size", 128)))
        if bits != 4:
            raise ValueError(f"{path}: {method} with bits={bits}: only 4-bit checkpoints are supported")
        if method == "awq" and str(qc.get("version", "gemm")).lower() != "gemm":
            raise ValueError(f"{path}: AWQ version {qc.get('version')!r}: only the GEMM layout is supported")
        if method == "gptq" and str(qc.get("checkpoint_format", "gptq")).lower() != "gptq":
            raise ValueError(f"{path}: GPTQ checkpoint_format {qc.get('checkpoint_format')!r}: only 'gptq' (v1)")
        return cls(method, bits, group, bool(qc.get("desc_act", False)))

    @classmethod
    def _compressed_tensors(cls, path: Path, qc: dict) -> "QuantSpec":
        """compressed-tensors: only W8A8 int8 (weights per channel, activations per token, dynamic)."""
        groups = list((qc.get("config_groups") or {}).values())
        supported = ("compressed-tensors is read for W8A8 int8 only (format int-quantized; weights int 8-bit "
                     "symmetric per channel; input activations int 8-bit symmetric per token, dynamic)")
        if str(qc.get("format", "")) != "int-quantized" or len(groups) != 1:
            raise ValueError(f"{path}: compressed-tensors format {qc.get('format')!r} with {len(groups)} config "
                             f"groups: {supported}")
        w, a = groups[0].get("weights") or {}, groups[0].get("input_activations") or {}
        if (w.get("num_bits"), w.get("type"), w.get("symmetric"), w.get("strategy")) != (8, "int", True, "channel") \
                or (a.get("num_bits"), a.get("type"), a.get("symmetric"), a.get("strategy"), a.get("dynamic")) \
                != (8, "int", True, "token", True):
            raise ValueError(f"{path}: compressed-tensors weights {w} and input_activations {a}: {supported}")
        return cls(W8A8, 8, 0)


@dataclass
class LoadedQuant:
    """One layer of the checkpoint: its 4-bit weight, and the input permutation of act order."""

    decoded: DecodedWeight
    perm: Optional[np.ndarray] = None  # inputs in group order; None when groups are consecutive


# ----------------------------------------------------------------- unpacking
def _nibbles(packed: np.ndarray, axis: int) -> np.ndarray:
    """int32 -> the eight 4-bit values of each, along ``axis`` (nibble j at position 8i + j)."""
    u = packed.astype(np.uint32)
    parts = [(u >> np.uint32(4 * j)) & np.uint32(15) for j in range(8)]
    stacked = np.stack(parts, axis=axis + 1)  # [..., n, 8, ...]
    shape = list(packed.shape)
    shape[axis] *= 8
    return stacked.reshape(shape).astype(np.uint8)


def _awq_columns(packed: np.ndarray) -> np.ndarray:
    """AWQ's [R, N / 8] int32 -> [R, N] values in column order."""
    nib = _nibbles(packed, 1).reshape(packed.shape[0], -1, 8)  # [R, N/8, nibble]
    out = np.empty_like(nib)
    out[:, :, list(AWQ_ORDER)] = nib
    return out.reshape(packed.shape[0], -1)


def decode_layer(name: str, tensors: dict[str, torch.Tensor], spec: QuantSpec) -> LoadedQuant:
    """One layer's packed tensors -> 4-bit values, scales and mins per group (rows = outputs).

    Raises:
        ValueError: A missing tensor or a shape that does not fit the spec (names the tensor).
    """
    for part in PARTS:
        if part not in tensors:
            raise ValueError(f"{name}: {spec.method} checkpoint lacks {name}.{part} (expected "
                             f"{', '.join(name + '.' + p for p in PARTS)})")
    qweight = tensors["qweight"].numpy()
    qzeros = tensors["qzeros"].numpy()
    scales = tensors["scales"].float().numpy()
    if spec.method == "gptq":
        q = _nibbles(qweight, 0)  # [K, N]
        zeros = (_nibbles(qzeros, 1).astype(np.int32) + 1) & 15  # v1 stores zero - 1 (0 - 1 wraps to 15)
    else:
        q = _awq_columns(qweight)  # [K, N]
        zeros = _awq_columns(qzeros).astype(np.int32)
    k, n = q.shape
    groups = -(-k // spec.group_size)
    if scales.shape != (groups, n) or zeros.shape != (groups, n):
        raise ValueError(f"{name}.scales has shape {tuple(scales.shape)} and {name}.qzeros holds "
                         f"{tuple(zeros.shape)} zeros; group_size {spec.group_size} over {k} inputs and {n} "
                         f"outputs expects ({groups}, {n}): check quantization_config.group_size")
    g_idx = tensors.get("g_idx")
    perm = None
    if g_idx is not None:
        g = g_idx.numpy().astype(np.int64)
        if g.shape != (k,) or g.min() < 0 or g.max() >= groups:
            raise ValueError(f"{name}.g_idx must hold {k} group numbers in [0, {groups}), got shape "
                             f"{tuple(g.shape)}")
        if np.any(np.bincount(g, minlength=groups) > spec.group_size):
            raise ValueError(f"{name}.g_idx puts more than group_size {spec.group_size} inputs in a group")
        if not np.array_equal(g, np.arange(k) // spec.group_size):
            perm = np.argsort(g, kind="stable")  # act order: groups made consecutive
            q = q[perm]
            if np.any(np.bincount(g, minlength=groups)[:-1] != spec.group_size):
                raise ValueError(f"{name}.g_idx: every group but the last must hold {spec.group_size} inputs")
    scale_t = scales.T.astype(np.float32)  # [N, G]
    mins = (-scale_t * zeros.T.astype(np.float32)).astype(np.float32)
    decoded = DecodedWeight(np.ascontiguousarray(q.T), np.ascontiguousarray(scale_t), np.ascontiguousarray(mins),
                            4, spec.group_size, f"{spec.method}-g{spec.group_size}")
    return LoadedQuant(decoded, perm)


def float_weight(layer: LoadedQuant) -> torch.Tensor:
    """The float32 weight ``[N, K]`` the layer computes with (inputs in checkpoint order)."""
    w = layer.decoded.dequantize()
    if layer.perm is not None:
        out = np.empty_like(w)
        out[:, layer.perm] = w
        w = out
    return torch.from_numpy(w)


def read_checkpoint(weights: Iterator[tuple[str, torch.Tensor]], spec: QuantSpec,
                    quantized: dict[str, LoadedQuant]) -> Iterator[tuple[str, torch.Tensor]]:
    """Passes float tensors through, decodes each quantized layer into ``quantized``
    (HF prefix -> layer) and yields its float weight as ``<prefix>.weight``."""
    if spec.method == W8A8:
        yield from _read_w8a8(weights, quantized)
        return
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        prefix, _, part = name.rpartition(".")
        if part in (*PARTS, "g_idx"):  # decoded once every file is read (a layer's parts may be split)
            pending.setdefault(prefix, {})[part] = tensor
            continue
        yield name, tensor
    for prefix, layer in pending.items():
        loaded = decode_layer(prefix, layer, spec)
        quantized[prefix] = loaded
        yield prefix + ".weight", float_weight(loaded)


def _read_w8a8(weights: Iterator[tuple[str, torch.Tensor]],
               quantized: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """compressed-tensors W8A8: each int8 ``weight`` with its ``weight_scale`` into ``quantized``
    (prefix -> ``(q [N, K] int8, scales [N] float32)``), yielded as ``scale * q`` in float32."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        prefix, _, part = name.rpartition(".")
        if part == "weight_scale" or (part == "weight" and tensor.dtype == torch.int8):
            pending.setdefault(prefix, {})[part] = tensor
            continue
        yield name, tensor
    for prefix, parts in pending.items():
        if set(parts) != {"weight", "weight_scale"}:
            have = ", ".join(f"{prefix}.{p}" for p in sorted(parts))
            raise ValueError(f"{prefix}: a W8A8 layer needs an int8 {prefix}.weight and its {prefix}.weight_scale, "
                             f"found only {have}")
        q, scale = parts["weight"], parts["weight_scale"].float().reshape(-1)
        if scale.shape[0] != q.shape[0]:
            raise ValueError(f"{prefix}.weight_scale holds {scale.shape[0]} scales for {q.shape[0]} output channels "
                             "(one per channel expected)")
        quantized[prefix] = (q.numpy(), scale.numpy().astype(np.float32))
        yield prefix + ".weight", q.float() * scale[:, None]
