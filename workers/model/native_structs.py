"""The C structs the native step driver (``csrc/decoder_step.c``) and the
native MoE layer (``csrc/moe_f32.c``) read, as ctypes declares them, and how
a :class:`Linear`'s installed kernel becomes one (``csrc/decoder_types.h``
holds the C side; a field added there is added here, in the same place).

    Fns    the kernels, as function pointers: gemm, qgemm, norm, rotary, silu,
           decode attention, i8gemm, LoRA's grouped side paths (and this step's
           adapter rows), the MoE layer, and qgemm's panel range and group
           sums (the MoE layer threads its experts' GEMMs itself), GeGLU, and
           the per-head q/k norm
    Lin    one linear layer: kind 0 packed float panels, 1 group-quantized
           (``qgemm.py``), 2 int8 x int8 (``i8gemm.py``)
"""

from __future__ import annotations

import ctypes
from typing import Any, Optional

from workers.model import gemm, i8gemm, qgemm

P, L, F = ctypes.c_void_p, ctypes.c_long, ctypes.c_float


class Fns(ctypes.Structure):
    _fields_ = [("gemm", P), ("qgemm", P), ("norm", P), ("rotary", P), ("silu", P), ("decode", P),
                ("i8gemm", P), ("lora", P), ("lora_rows", P), ("moe", P), ("qgemm_panels", P), ("qgemm_sums", P),
                ("gemm_panels", P), ("gelu", P), ("head_norm", P)]


class Lin(ctypes.Structure):
    _fields_ = [("kind", L), ("w", P), ("scales", P), ("mins", P), ("bias", P), ("bits", L), ("group", L),
                ("n", L), ("k", L), ("lora", P)]


def address(fn: Any) -> int:
    """A ctypes function's address (0 for None)."""
    return ctypes.cast(fn, ctypes.c_void_p).value or 0 if fn is not None else 0


def set_qgemm(fns: Fns, qlib: ctypes.CDLL) -> None:
    """Points ``fns`` at the quantized GEMM of ``qlib`` (``qgemm.load()``) and its pieces."""
    fns.qgemm, fns.qgemm_panels = address(qlib.qgemm_f32), address(qlib.qgemm_panels_f32)
    fns.qgemm_sums = address(qlib.qgemm_group_sums)


def weight_of(linear: Any) -> tuple:
    """What ``NativeDecoder._linear`` calls a layer's kernel with: ``(None,
    panels, bias or 0, out_features, in_features)`` for a packed float weight,
    ``(quant, q, scales, mins or 0, bias or 0, out_features, in_features)``
    for a quantized one (``qgemm.py``), ``(layer kernel, None, out_features,
    in_features)`` for one that quantizes its input too (``w8a8``; the step
    driver calls its ``i8gemm`` directly)."""
    quant = linear.quant
    if quant is not None and not isinstance(quant, qgemm.QuantWeight):
        return (quant, None, quant.out_features, quant.in_features)
    if quant is not None:
        return (quant, quant.q.data_ptr(), quant.scales.data_ptr(),
                quant.mins.data_ptr() if quant.mins is not None else 0,
                quant.bias.data_ptr() if quant.bias is not None else 0, quant.out_features, quant.in_features)
    packed: gemm.PackedWeight = linear.packed
    bias = packed.bias.data_ptr() if packed.bias is not None else 0
    return None, packed.panels.data_ptr(), bias, packed.out_features, packed.in_features


def lin_struct(weight: tuple) -> Optional[Lin]:
    """A linear for the C side (from :func:`weight_of`), or None for one it cannot call."""
    if weight[0] is None:
        _, panels, bias, n, k = weight
        return Lin(0, panels, None, None, bias or None, 0, 0, n, k)
    if weight[1] is None:
        quant = weight[0]
        if not isinstance(quant, i8gemm.Int8Weight):
            return None
        bias = quant.bias.data_ptr() if quant.bias is not None else None
        return Lin(2, quant.q.data_ptr(), quant.scales.data_ptr(), quant.wsum.data_ptr(), bias, 8, 0,
                   quant.out_features, quant.in_features)
    quant, q, scales, mins, bias, n, k = weight
    return Lin(1, q, scales, mins or None, bias or None, quant.bits, quant.group_size, n, k)


def linear_struct(linear: Any) -> Optional[Lin]:
    """:func:`lin_struct` of a :class:`Linear` with a native kernel installed, else None."""
    if linear.quant is None and (linear.backend != "native" or linear.packed is None):
        return None
    return lin_struct(weight_of(linear))
