"""Quantization of a loaded model's linear layers (``quantization=``):

    gguf   the GGUF file's own quantized tensors (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
           Q4_K, Q5_K, Q6_K), decoded exactly (``gguf_blocks.py``); the tied
           embedding and LM head too, as the file has them
    int8   symmetric per output channel: q = round(w / s), s = max|w| / 127
    int4   asymmetric per group of ``quantization_group_size`` inputs (32, the
           default, 64 or 128). Groups of 32 take Q4_1's grid:
           s = (max - min) / 15, q = round((w - min) / s), w ~ s * q + min.
           Groups of 64 and 128 take GPTQ's grid rounded to nearest
           (``gptq.rtn``): the range widened to hold 0, an integer zero point
           z, w ~ s * (q - z), so weights near zero stay unbiased. Measured on
           the default model's held-out perplexity (float32 13.87): Q4_1's
           grid 13.87 / 18.90 / 22.06 at 32 / 64 / 128, GPTQ's 17.18 / 17.84
           / 18.38 (docs/QUANTIZATION.md).
    w8a8   SmoothQuant: int8 weights per output channel, int8 activations per
           token at run time, smoothed on calibration text (``smoothquant.py``)

The LM head of ``int8`` / ``int4`` / ``w8a8`` (and a tied embedding, which
reads its rows from it) is int8 per group of 32 inputs, as llama.cpp keeps
``output.weight`` at 8 bits: at batch 1 a float head would be half of the
weight bytes read per step. ``w8a8`` runs it against int8 activations
(``qdot.py``), ``int8`` / ``int4`` weight-only. ``gguf-a8`` is ``gguf`` with
every 4- / 8-bit tensor in groups of 32 on ``qdot.py``. Every quantized layer runs on
``qgemm.py``.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from workers.model import qdot, qgemm
from workers.model.quant.gguf_blocks import DecodedWeight, decode

logger = logging.getLogger(__name__)

INT4_GROUP_SIZES = (32, 64, 128)
DEFAULT_INT4_GROUP = 32  # measured: see the module doc
HEAD_GROUP = 32
FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


@dataclass
class QuantSummary:
    """What ``quantize_linears`` did."""

    method: str
    formats: dict[str, int]  # format name -> layers
    weight_bytes: int  # of the quantized layers

    @property
    def label(self) -> str:
        """What metrics and logs call it: ``int8``, ``int4-g32``, ``gguf:q4_1+q8_0``."""
        if self.method in ("gguf", "gguf-a8"):
            return self.method + ":" + "+".join(sorted(self.formats))
        return max(self.formats, key=self.formats.get) if self.formats else self.method  # the layers' format


def quantize_linears(model: Any, method: str, group_size: Optional[int], gguf_path: Optional[Path],
                     calibration_ids: Optional[list[int]] = None,
                     checkpoint_layers: Optional[dict[str, Any]] = None) -> QuantSummary:
    """Replaces the kernels of ``model``'s linear layers by quantized ones
    (mutates the model; call before ``model.finalize``).

    Raises:
        ValueError: No native kernel here, a shape the format cannot hold, or a
            GGUF tensor in an unsupported format (names it).
    """
    arch = model.arch
    # Layouts the plans lack: experts (int8 / int4, and gguf: the file's stacked expert blocks), Gemma's sandwich
    # norms (and gguf: its plan reads the linear layers' blocks and leaves the norms alone).
    if (arch.num_experts and method not in ("int8", "int4", "gguf")) or \
            (arch.sandwich_norms and method not in ("int8", "int4", "gguf")):
        kind = (f"mixture-of-experts models ({arch.family}) yet; use 'int8', 'int4' or 'gguf' (their experts "
                "are quantized, the router stays float32)") if arch.num_experts else f"{arch.family} models yet; use " \
            "'int8', 'int4' or 'gguf'"
        raise ValueError(f"quantization={method!r} is not supported for {kind}")
    lib = qgemm.load()
    if lib is None:
        raise ValueError(f"quantization={method!r} needs the native quantized kernel (a C compiler and a CPU "
                         "with AVX2 + FMA); it did not build here, see the log")
    if method == "w8a8":
        return _w8a8(model, lib, calibration_ids, checkpoint_layers)
    if method in ("gptq", "awq"):
        return _install_plan(method, _checkpoint_plan(model, checkpoint_layers or {}), lib)
    if method in ("gguf", "gguf-a8"):
        if gguf_path is None:
            raise ValueError(f"quantization={method!r} runs a .gguf file's own tensors: pass model=<file.gguf> "
                             "(or the default model)")
        if method == "gguf-a8" and (arch.num_experts or not qdot.available(lib)):
            raise ValueError("quantization='gguf-a8' " + ("runs dense models only; use 'gguf' for mixture-of-experts"
                             if arch.num_experts else "needs AVX2 or AVX-512BW integer instructions; use 'gguf'"))
        plan = _gguf_plan(model, gguf_path)
    else:
        plan = _float_plan(model, method, group_size)
    return _install_plan(method, [(linear, decoded, None) for linear, decoded in plan], lib,
                         int8_activations=method == "gguf-a8")


def _install_plan(method: str, plan: list[tuple[Any, DecodedWeight, Optional[np.ndarray]]], lib: Any,
                  int8_activations: bool = False) -> QuantSummary:
    """Packs every planned weight, then installs them all (nothing half-installed on an error).
    ``int8_activations``: each weight the integer path takes (``qdot.py``) runs there, the rest exactly."""
    weights: list[Any] = []
    for linear, decoded, perm in plan:
        weight: Any = None
        if int8_activations:
            weight = qdot.try_dot_weight(decoded.q, decoded.scales, decoded.mins, decoded.bits, decoded.group_size,
                                         linear.bias, lib, name=decoded.format + "-a8")
        if weight is None:
            weight = qgemm.QuantWeight(decoded.q, decoded.scales, decoded.mins, decoded.bits, decoded.group_size,
                                       linear.bias, lib, name=decoded.format)
        weights.append(PermutedInputs(weight, perm) if perm is not None else weight)
    formats: dict[str, int] = {}
    total = 0
    for (linear, decoded, _), weight in zip(plan, weights):
        install_quantized(linear, weight)
        formats[weight.name] = formats.get(weight.name, 0) + 1
        total += weight.nbytes
    logger.info("quantization %s: %s, %.1f MiB of quantized weights", method,
                ", ".join(f"{n} x {f}" for f, n in sorted(formats.items())), total / 2**20)
    return QuantSummary(method, formats, total)


def install_quantized(linear: Any, weight: qgemm.QuantWeight) -> None:
    """Makes ``linear`` run on ``weight`` and frees its float weight."""
    linear.quant = weight
    linear.kernel, linear.kernel_no_bias = weight.matmul, weight.matmul_no_bias
    linear.backend = weight.name
    linear.weight = torch.nn.Parameter(torch.empty(0, linear.in_features), requires_grad=False)


# ------------------------------------------------------------------ int8 / int4
def quantize_int8(w: np.ndarray) -> DecodedWeight:
    """Symmetric per output channel (one group of the whole row)."""
    scale = np.abs(w).max(axis=1, keepdims=True) / np.float32(127)
    scale[scale == 0] = 1.0
    q = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
    return DecodedWeight(q, scale.astype(np.float32), None, 8, w.shape[1], "int8")


def quantize_head(w: np.ndarray) -> DecodedWeight:
    """The LM head (and a tied embedding): symmetric int8 per group of 32 inputs, as GGUF's Q8_0."""
    n, k = w.shape
    groups = -(-k // HEAD_GROUP)
    padded = np.zeros((n, groups * HEAD_GROUP), dtype=np.float32)
    padded[:, :k] = w
    scale = np.abs(padded.reshape(n, groups, HEAD_GROUP)).max(axis=2) / np.float32(127)
    scale[scale == 0] = 1.0
    q = np.clip(np.rint(w / np.repeat(scale, HEAD_GROUP, axis=1)[:, :k]), -127, 127).astype(np.int8)
    return DecodedWeight(q, scale.astype(np.float32), None, 8, HEAD_GROUP, "int8-g32")


def quantize_int4(w: np.ndarray, group_size: int) -> DecodedWeight:
    """Asymmetric per group of ``group_size`` inputs (the last group of a row may
    be shorter): Q4_1's grid for groups of 32, GPTQ's for wider ones (module doc)."""
    if group_size > 32:
        from workers.model.quant import gptq

        return dataclasses.replace(gptq.rtn(w, group_size), format=f"int4-g{group_size}")
    n, k = w.shape
    groups = -(-k // group_size)
    lo = np.stack([w[:, i * group_size : (i + 1) * group_size].min(axis=1) for i in range(groups)], axis=1)
    hi = np.stack([w[:, i * group_size : (i + 1) * group_size].max(axis=1) for i in range(groups)], axis=1)
    scale = (hi - lo) / np.float32(15)
    scale[scale == 0] = 1.0
    lo_k = np.repeat(lo, group_size, axis=1)[:, :k]
    scale_k = np.repeat(scale, group_size, axis=1)[:, :k]
    q = np.clip(np.rint((w - lo_k) / scale_k), 0, 15).astype(np.uint8)
    return DecodedWeight(q, scale.astype(np.float32), lo.astype(np.float32), 4, group_size, f"int4-g{group_size}")


def _float_plan(model: Any, method: str, group_size: Optional[int]) -> list[tuple[Any, DecodedWeight]]:
    from workers.model.linear import Linear

    if method == "int4":
        group_size = group_size or DEFAULT_INT4_GROUP
        if group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"quantization_group_size must be one of {INT4_GROUP_SIZES} for int4, got {group_size}")
    plan = []
    for module in model.modules():
        if not isinstance(module, Linear) or getattr(module, "keep_float", False):  # a MoE router stays float
            continue
        w = module.weight.detach().float().numpy()
        if module is model.lm_head:
            plan.append((module, quantize_head(w)))
        else:
            plan.append((module, quantize_int8(w) if method == "int8" else quantize_int4(w, group_size)))
    return plan


# ------------------------------------------------------------------ gptq / awq
class PermutedInputs:
    """A quantized weight whose inputs are stored in group order (GPTQ act order):
    ``x`` is permuted the same way before the GEMM."""

    def __init__(self, weight: qgemm.QuantWeight, perm: np.ndarray) -> None:
        self.weight, self.name = weight, weight.name
        self.out_features, self.in_features = weight.out_features, weight.in_features
        self.perm = torch.from_numpy(np.ascontiguousarray(perm)).long()
        self.inverse = torch.argsort(self.perm)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.perm.numel() * 8

    def dequantized_rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight.dequantized_rows(ids).index_select(1, self.inverse)

    rows = dequantized_rows

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight.matmul(x.reshape(-1, self.in_features).index_select(1, self.perm))

    def matmul_no_bias(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight.matmul_no_bias(x.reshape(-1, self.in_features).index_select(1, self.perm))


def _checkpoint_plan(model: Any, layers: dict[str, Any]) -> list[tuple[Any, DecodedWeight, Optional[np.ndarray]]]:
    """The decoder's linear layers from a GPTQ / AWQ checkpoint's layers (HF names;
    q/k/v and gate/up stacked into the fused projections). The LM head stays float,
    as the checkpoint has it."""
    plan = []

    def fused(module: Any, names: list[str]) -> None:
        parts = [layers.get(n) for n in names]
        if any(p is None for p in parts):
            missing = [n for n, p in zip(names, parts) if p is None]
            raise ValueError(f"the checkpoint has no quantized tensors for {', '.join(missing)}")
        perms = [p.perm for p in parts]
        if any((a is None) != (b is None) or (a is not None and not np.array_equal(a, b))
               for a, b in zip(perms, perms[1:])):
            raise ValueError(f"{', '.join(names)} share an input but not an act-order permutation (g_idx): "
                             "fused projections need one")
        plan.append((module, _stack([p.decoded for p in parts]), perms[0]))

    for i, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{i}."
        fused(layer.self_attn.qkv_proj, [prefix + f"self_attn.{p}_proj" for p in "qkv"])
        fused(layer.self_attn.o_proj, [prefix + "self_attn.o_proj"])
        fused(layer.mlp.gate_up_proj, [prefix + "mlp.gate_proj", prefix + "mlp.up_proj"])
        fused(layer.mlp.down_proj, [prefix + "mlp.down_proj"])
    return plan


# ------------------------------------------------------------------------ w8a8
def _w8a8(model: Any, lib: Any, calibration_ids: Optional[list[int]],
          checkpoint_layers: Optional[dict[str, Any]] = None) -> QuantSummary:
    from workers.model.linear import Linear
    from workers.model.quant import smoothquant

    from workers.model import i8gemm

    ilib = i8gemm.load()
    if ilib is None:
        raise ValueError("quantization='w8a8' needs the native int8 kernel (a C compiler and a CPU with AVX2); "
                         "it did not build here, see the log")
    layers: list[Any] = []
    weights: list[Any] = []
    if checkpoint_layers:  # a W8A8 checkpoint: smoothed and quantized already
        for i, layer in enumerate(model.model.layers):
            prefix = f"model.layers.{i}."
            for linear, names in ((layer.self_attn.qkv_proj, [f"self_attn.{p}_proj" for p in "qkv"]),
                                  (layer.self_attn.o_proj, ["self_attn.o_proj"]),
                                  (layer.mlp.gate_up_proj, ["mlp.gate_proj", "mlp.up_proj"]),
                                  (layer.mlp.down_proj, ["mlp.down_proj"])):
                missing = [prefix + n for n in names if prefix + n not in checkpoint_layers]
                if missing:
                    raise ValueError(f"the W8A8 checkpoint has no int8 weight for {', '.join(missing)}")
                parts = [checkpoint_layers[prefix + n] for n in names]
                layers.append(linear)
                weights.append(i8gemm.Int8Weight(np.concatenate([q for q, _ in parts]),
                                                 np.concatenate([sc for _, sc in parts]), linear.bias, ilib))
    else:
        if not calibration_ids:
            raise ValueError("quantization='w8a8' calibrates on text: the model folder needs a tokenizer.json")
        smoothquant.smooth(model, smoothquant.calibrate(model, calibration_ids))
        layers = [m for m in model.modules() if isinstance(m, Linear) and m is not model.lm_head]
        for linear in layers:  # every weight is quantized before any layer changes
            q, scales = smoothquant.quantize_per_channel(linear.weight.detach().float().numpy())
            weights.append(i8gemm.Int8Weight(q, scales, linear.bias, ilib))
    head = model.lm_head
    d = quantize_head(head.weight.detach().float().numpy())
    layers.append(head)
    # The head's activations are quantized too (per 32 inputs, qdot.py), as everywhere else in w8a8.
    head_weight: Any = qdot.try_dot_weight(d.q, d.scales, None, 8, d.group_size, head.bias, lib,
                                           name=d.format + "-a8")
    if head_weight is None:
        head_weight = qgemm.QuantWeight(d.q, d.scales, None, 8, d.group_size, head.bias, lib, name=d.format)
    weights.append(head_weight)
    for linear, weight in zip(layers, weights):
        install_quantized(linear, weight)
    total = sum(w.nbytes for w in weights)
    logger.info("quantization w8a8: %d layers, LM head %s, %.1f MiB of int8 weights",
                len(layers) - 1, head_weight.name, total / 2**20)
    return QuantSummary("w8a8", {"w8a8": len(layers) - 1, head_weight.name: 1}, total)


# ------------------------------------------------------------------------ gguf
def _gguf_plan(model: Any, gguf_path: Path) -> list[tuple[Any, DecodedWeight]]:
    from gguf import GGUFReader

    from workers.model.gguf import _reverse_permute

    reader = GGUFReader(str(gguf_path))
    tensors = {t.name: t for t in reader.tensors}
    arch = model.arch
    field = reader.fields.get("general.architecture")
    file_arch = field.contents() if field is not None else "llama"

    def load(name: str, expert: Optional[int] = None) -> Optional[DecodedWeight]:
        """The tensor's (or one expert's, of a stacked ``[experts, rows, cols]`` one) integers, scales and
        mins; None for a float tensor (its layer stays float)."""
        tensor = tensors.get(name)
        if tensor is None:
            raise ValueError(f"{gguf_path.name} has no tensor {name!r}")
        type_name = tensor.tensor_type.name
        if type_name in FLOAT_TYPES:
            return None
        shape = (int(tensor.shape[1]), int(tensor.shape[0]))  # GGUF lists dimensions innermost first
        try:
            return decode(tensor.data if expert is None else tensor.data[expert], type_name, shape)
        except ValueError as e:
            raise ValueError(f"{gguf_path.name}: tensor {name!r}: {e}") from None

    def permuted(decoded: Optional[DecodedWeight], heads: int) -> Optional[DecodedWeight]:
        # llama.cpp permutes the Q / K rows of llama-architecture files only (gguf.py); the others' are as HF's.
        if decoded is None or file_arch != "llama":
            return decoded
        rows = _reverse_permute(np.arange(decoded.q.shape[0]), heads)
        return decoded.take_rows(rows)

    plan = []
    for i, layer in enumerate(model.model.layers):
        prefix = f"blk.{i}."
        if prefix + "attn_qkv.weight" in tensors:  # Phi-3: q, k, v fused, and gate + up in ffn_up (our layout)
            plan.append((layer.self_attn.qkv_proj, load(prefix + "attn_qkv.weight")))
        else:
            qkv = [permuted(load(prefix + "attn_q.weight"), arch.num_attention_heads),
                   permuted(load(prefix + "attn_k.weight"), arch.num_key_value_heads),
                   load(prefix + "attn_v.weight")]
            plan.append((layer.self_attn.qkv_proj, _stack(qkv)))
        plan.append((layer.self_attn.o_proj, load(prefix + "attn_output.weight")))
        if hasattr(layer.mlp, "experts"):  # MoE: the router (and the shared expert's gate) stay float
            for e, expert in enumerate(layer.mlp.experts):
                parts = [load(f"{prefix}ffn_{p}_exps.weight", e) for p in ("gate", "up")]
                plan.append((expert.gate_up_proj, _stack(parts)))
                plan.append((expert.down_proj, load(prefix + "ffn_down_exps.weight", e)))
            if layer.mlp.shared_expert is not None:
                shared = layer.mlp.shared_expert
                plan.append((shared.gate_up_proj, _stack([load(prefix + "ffn_gate_shexp.weight"),
                                                          load(prefix + "ffn_up_shexp.weight")])))
                plan.append((shared.down_proj, load(prefix + "ffn_down_shexp.weight")))
            continue
        gate_up = [load(prefix + "ffn_up.weight")] if prefix + "ffn_gate.weight" not in tensors and \
            arch.family == "phi3" else [load(prefix + "ffn_gate.weight"), load(prefix + "ffn_up.weight")]
        plan.append((layer.mlp.gate_up_proj, _stack(gate_up)))
        plan.append((layer.mlp.down_proj, load(prefix + "ffn_down.weight")))
    head = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    plan.append((model.lm_head, load(head)))
    kept = sum(decoded is None for _, decoded in plan)
    if kept:
        logger.info("%s: %d linear layers have float tensors and stay float", gguf_path.name, kept)
    return [(linear, decoded) for linear, decoded in plan if decoded is not None]


def _stack(parts: list[Optional[DecodedWeight]]) -> Optional[DecodedWeight]:
    """Stacks the rows of weights of one input size into one (a fused projection);
    differing formats meet in the widest: the most bits (4 < 5 < 8: each holds the
    narrower ones' values), the smallest group, zero mins.
    None (the fused layer stays float) when a part is float."""
    if any(p is None for p in parts):
        return None
    bits = max(p.bits for p in parts)
    group = min(p.group_size for p in parts)
    with_mins = any(p.mins is not None for p in parts)
    qs, scales, mins = [], [], []
    for p in parts:
        q = p.q if p.bits == bits else p.q.astype(np.int8 if bits == 8 else np.uint8)
        repeat = p.group_size // group
        qs.append(q)
        scales.append(np.repeat(p.scales, repeat, axis=1))
        if with_mins:
            mins.append(np.repeat(p.mins, repeat, axis=1) if p.mins is not None else np.zeros_like(scales[-1]))
    names = sorted({p.format for p in parts})
    return DecodedWeight(np.concatenate(qs), np.concatenate(scales), np.concatenate(mins) if with_mins else None,
                         bits, group, "+".join(names))
