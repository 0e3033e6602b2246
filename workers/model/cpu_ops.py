"""Fused elementwise kernels of the decoder layer on CPU (float32), native:

    add_rms_norm(x, residual, weight)   residual += x; out = rms_norm(residual) * weight
    rms_norm(x, weight)                 out = rms_norm(x) * weight
    rotary(qk, cos, sin)                in place, HF's rotate-half convention
    silu_and_mul(gate_up)               silu(gate) * up
    gelu_tanh_and_mul(gate_up)          gelu_tanh(gate) * up (Gemma's GeGLU)
    head_rms_norm(qk, weight)           in place, an RMSNorm over each head (Qwen3, Gemma 3)

Eager torch spends ~8 op dispatches on an RMSNorm, ~8 on the rotary
embedding and 3 on SiLU-and-mul, each a pass over memory; these are one call
and one pass each, threaded over tokens. Every row is computed on its own in
a fixed order (the norm's sum of squares runs over the hidden size, in order),
so, as with the native GEMM, a token's result does not depend on the rest of
the batch. Arithmetic follows HF's float32 order (mean of squares, rsqrt of
mean + eps, times the weight); the sum's order differs from torch's
vectorized ``mean`` by float rounding.

Built with ``workers/model/native.py``; without a compiler ``load()`` is None
and the layers keep their torch code.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

from workers.model import native

_SOURCE = native.source("cpu_ops.c")

# -ffp-contract=off: a * c - b * s is not fused into one FMA in some rows and not
# others; every element is computed by the same two roundings. -fno-math-errno
# lets expf vectorize (glibc's vector math): a column's element is always
# computed by the same code, whatever the number of rows.
_FLAGS = (*native.FLAGS, "-ffp-contract=off", "-fno-math-errno")
_P, _L, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_float
_SIGNATURES = {
    "add_rms_norm_f32": [_P, _P, _P, _P, _L, _L, _F],
    "rotary_f32": [_P, _L, _L, _L, _L, _P, _P],
    "silu_and_mul_f32": [_P, _P, _L, _L],
    "gelu_tanh_and_mul_f32": [_P, _P, _L, _L],
    "head_rms_norm_f32": [_P, _L, _L, _L, _L, _P, _F],
    "argmax_rows_f32": [_P, _L, _L, _L, _P],
    "mask_rows_f32": [_P, _L, _L, _P, _L, _P, _L],
}


def load() -> Optional[ctypes.CDLL]:
    """The kernels, or None (no compiler or a failed build)."""
    return native.build("cpu_ops", _SOURCE, _FLAGS, _SIGNATURES)


def _ok(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)


def add_rms_norm(lib: ctypes.CDLL, x: Optional[torch.Tensor], residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """``residual += x`` in place (when ``x`` is given); returns ``rms_norm(residual) * weight``.

    ``x`` and ``residual`` are ``[T, H]`` contiguous float32 on CPU.
    """
    tokens, hidden = residual.shape
    out = torch.empty_like(residual)
    lib.add_rms_norm_f32(x.data_ptr() if x is not None else None, residual.data_ptr(), weight.data_ptr(),
                         out.data_ptr(), tokens, hidden, eps)
    return out


def rotary(lib: ctypes.CDLL, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotates ``qk`` ``[T, heads, D]`` in place (rows may be strided, heads and D contiguous);
    ``cos`` / ``sin`` ``[T, D / 2]`` contiguous."""
    tokens, heads, dim = qk.shape
    assert qk.stride(2) == 1 and qk.stride(1) == dim
    lib.rotary_f32(qk.data_ptr(), tokens, heads, dim, qk.stride(0), cos.data_ptr(), sin.data_ptr())


def silu_and_mul(lib: ctypes.CDLL, gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate_up[:, :I]) * gate_up[:, I:]`` for contiguous ``[T, 2I]``."""
    tokens, width = gate_up.shape
    out = torch.empty(tokens, width // 2, dtype=gate_up.dtype)
    lib.silu_and_mul_f32(gate_up.data_ptr(), out.data_ptr(), tokens, width // 2)
    return out


def gelu_tanh_and_mul(lib: ctypes.CDLL, gate_up: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate_up[:, :I]) * gate_up[:, I:]`` for contiguous ``[T, 2I]``; tanh
    within a few ulp of torch's (Cephes' polynomial), not bitwise."""
    tokens, width = gate_up.shape
    out = torch.empty(tokens, width // 2, dtype=gate_up.dtype)
    lib.gelu_tanh_and_mul_f32(gate_up.data_ptr(), out.data_ptr(), tokens, width // 2)
    return out


def head_rms_norm(lib: ctypes.CDLL, qk: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: each head of ``qk`` ``[T, heads, D]`` (rows may be strided, heads and D
    contiguous) becomes ``rms_norm(head) * weight``; the bits of :func:`add_rms_norm` on those rows."""
    tokens, heads, dim = qk.shape
    assert qk.stride(2) == 1 and qk.stride(1) == dim
    lib.head_rms_norm_f32(qk.data_ptr(), tokens, heads, dim, qk.stride(0), weight.data_ptr(), eps)


def argmax_rows(lib: ctypes.CDLL, x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` (int64) of float32 ``[N, V]`` rows with a unit column
    stride, torch's answer for ties (the first) and NaNs (the first NaN)."""
    rows, cols = x.shape
    assert x.stride(1) == 1 and cols > 0
    out = torch.empty(rows, dtype=torch.long)
    lib.argmax_rows_f32(x.data_ptr(), rows, cols, x.stride(0), out.data_ptr())
    return out


def mask_rows(lib: ctypes.CDLL, x: torch.Tensor, rows: torch.Tensor, masks: torch.Tensor) -> None:
    """In place: ``x[rows[r], i] = -inf`` where bit ``i`` of ``masks[r]`` is
    clear (``masks`` ``[len(rows), words]`` int32, bit ``i % 32`` of word
    ``i // 32``; tokens past ``32 * words`` are disallowed). ``x`` is float32
    ``[N, V]`` with a unit column stride; ``rows`` int64."""
    assert x.stride(1) == 1 and masks.dtype == torch.int32 and masks.is_contiguous() and rows.dtype == torch.long
    assert masks.shape[0] == rows.shape[0]
    lib.mask_rows_f32(x.data_ptr(), x.stride(0), x.shape[1], rows.data_ptr(), rows.shape[0], masks.data_ptr(),
                      masks.shape[1])


__all__ = ["add_rms_norm", "argmax_rows", "gelu_tanh_and_mul", "head_rms_norm", "mask_rows", "load", "rotary",
           "silu_and_mul", "_ok"]
