"""Fused elementwise kernels of the decoder layer in Triton (the GPU's ``cpu_ops``):

    add_rms_norm(x, residual, weight)   residual += x; out = rms_norm(residual) * weight
    rotary(qk, cos, sin)                in place, HF's rotate-half convention
    silu_and_mul(gate_up)               silu(gate) * up

Eager torch launches ~8 kernels for an RMSNorm with its residual add, ~8 for
the rotary embedding and 3 for SiLU-and-mul, each a pass over memory; these
are one launch and one pass each. At decode batch sizes a GPU step is bound
by launches, not by these bytes, so the count is what matters (and it is what
a CUDA graph replays).

Arithmetic: float32 inside every kernel, rounded to the tensor's dtype where
HF's Llama code rounds (the residual sum before the norm; the normalized row
before the weight). In float32 the results match the torch code of
``layers.py`` to float rounding (``tests/unit/test_triton_ops.py`` runs them in
the interpreter); in 16-bit the rotary and SiLU products are rounded once
instead of per operation, which is closer to the exact value, not further.

Imported lazily: only ``load()`` imports triton, and it returns None where
Triton cannot run (no triton, or a CPU tensor without ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any, Optional

import torch

logger = logging.getLogger(__name__)

_kernels: Any = None


def _build() -> Any:
    """Defines the kernels (the first call imports triton)."""
    import triton
    import triton.language as tl

    @triton.jit
    def add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, stride_x, stride_res, stride_out, hidden, eps,
                            HAS_X: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < hidden
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        if HAS_X:
            x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
            r = (r.to(tl.float32) + x.to(tl.float32)).to(r.dtype)  # rounded like residual.add_(x)
            tl.store(res_ptr + row * stride_res + cols, r, mask=mask)
        r32 = r.to(tl.float32)
        variance = tl.sum(r32 * r32, axis=0) / hidden
        normed = (r32 * tl.math.rsqrt(variance + eps)).to(r.dtype)  # HF: x * torch.rsqrt(variance + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        out = w.to(tl.float32) * normed.to(tl.float32)
        tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def rotary_kernel(qk_ptr, cos_ptr, sin_ptr, stride_tok, stride_head, stride_cs, heads,
                      HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
        tok = tl.program_id(0)
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_HALF)[None, :]
        mask = (h < heads) & (d < HALF)
        cos = tl.load(cos_ptr + tok * stride_cs + d, mask=d < HALF, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + tok * stride_cs + d, mask=d < HALF, other=0.0).to(tl.float32)
        base = qk_ptr + tok * stride_tok + h * stride_head + d
        x1 = tl.load(base, mask=mask, other=0.0)
        x2 = tl.load(base + HALF, mask=mask, other=0.0)
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        tl.store(base, (a * cos - b * sin).to(x1.dtype), mask=mask)
        tl.store(base + HALF, (b * cos + a * sin).to(x1.dtype), mask=mask)

    @triton.jit
    def silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, inter, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inter
        g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
        silu = g / (1.0 + tl.exp(-g))
        tl.store(out_ptr + row * stride_out + cols, (silu * u).to(out_ptr.dtype.element_ty), mask=mask)

    return SimpleNamespace(triton=triton, add_rms_norm=add_rms_norm_kernel, rotary=rotary_kernel,
                           silu_and_mul=silu_and_mul_kernel)


class TritonOps:
    """The three fused ops on one device; the layers call them where ``fused`` is set."""

    SILU_BLOCK = 1024

    def __init__(self, kernels: Any) -> None:
        self._k = kernels

    def add_rms_norm(self, x: Optional[torch.Tensor], residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """``residual += x`` in place (when ``x`` is given); returns ``rms_norm(residual) * weight``
        in ``residual``'s dtype. ``x`` and ``residual`` are ``[T, H]`` with unit stride on H."""
        tokens, hidden = residual.shape
        assert residual.stride(1) == 1 and (x is None or (x.shape == residual.shape and x.stride(1) == 1))
        out = torch.empty_like(residual)
        if tokens:
            block = self._k.triton.next_power_of_2(hidden)
            self._k.add_rms_norm[(tokens,)](
                x if x is not None else residual, residual, weight, out,
                x.stride(0) if x is not None else 0, residual.stride(0), out.stride(0), hidden, eps,
                HAS_X=x is not None, BLOCK=block)
        return out

    def rotary(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotates ``qk`` ``[T, heads, D]`` in place (rows may be strided, D contiguous);
        ``cos`` / ``sin`` ``[T, D / 2]`` with the same row stride."""
        tokens, heads, dim = qk.shape
        assert qk.stride(2) == 1 and cos.stride(1) == 1 and cos.stride() == sin.stride()
        if tokens:
            half = dim // 2
            self._k.rotary[(tokens,)](
                qk, cos, sin, qk.stride(0), qk.stride(1), cos.stride(0), heads,
                HALF=half, BLOCK_H=self._k.triton.next_power_of_2(heads),
                BLOCK_HALF=self._k.triton.next_power_of_2(half))

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate_up[:, :I]) * gate_up[:, I:]`` for ``[T, 2I]`` with unit stride on the columns."""
        tokens, width = gate_up.shape
        assert gate_up.stride(1) == 1 and width % 2 == 0
        inter = width // 2
        out = torch.empty(tokens, inter, dtype=gate_up.dtype, device=gate_up.device)
        if tokens:
            grid = (tokens, self._k.triton.cdiv(inter, self.SILU_BLOCK))
            self._k.silu_and_mul[grid](gate_up, out, gate_up.stride(0), out.stride(0), inter, BLOCK=self.SILU_BLOCK)
        return out


def load(device: torch.device) -> Optional[TritonOps]:
    """The fused ops for ``device``, or None where Triton cannot run them (then the
    layers keep their torch code)."""
    from workers.model.attention.triton_backend import triton_runs_on

    global _kernels
    if not triton_runs_on(device):
        return None
    if _kernels is None:
        try:
            _kernels = _build()
        except ImportError as exc:
            logger.info("triton is not importable (%s): the fused norm, rotary and SiLU kernels are off", exc)
            return None
    return TritonOps(_kernels)
