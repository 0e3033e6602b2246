"""Small building blocks of the Llama family: RMSNorm, rotary embedding, SiLU-and-mul.

The arithmetic follows transformers' Llama code operation for operation (same
order, float32 where it computes in float32) so that our logits match the HF
reference to float noise, but the code is ours and works on flat token batches
(``[T, ...]``, no batch dimension, no padding).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from workers.model import cpu_ops
from workers.model.config import Llama3RopeScaling
from workers.model.longrope import LongRopeScaling


class RMSNorm(nn.Module):
    """Root-mean-square layer norm, computed in float32 like HF's ``LlamaRMSNorm``.

    ``forward(x, residual)`` also does the residual add before it (vLLM's
    fused form): ``residual += x`` in place, then the norm of ``residual``.
    With ``native`` set (``cpu_ops``, CPU float32) or ``fused`` (``triton_ops``,
    GPU) both are one kernel.
    """

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.native: Any = None  # cpu_ops library, set by the model's finalize
        self.fused: Any = None  # triton_ops.TritonOps on a GPU, set by the model's finalize

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.native is not None:
            if residual is None:
                return cpu_ops.add_rms_norm(self.native, None, x.contiguous(), self.weight, self.eps)
            return cpu_ops.add_rms_norm(self.native, x.contiguous(), residual, self.weight, self.eps)
        if self.fused is not None and x.dim() == 2:
            if residual is None:
                return self.fused.add_rms_norm(None, x.contiguous(), self.weight, self.eps)
            return self.fused.add_rms_norm(x.contiguous(), residual, self.weight, self.eps)
        if residual is not None:
            x = residual.add_(x)
        input_dtype = x.dtype
        x32 = x.float()
        variance = x32.pow(2).mean(-1, keepdim=True)
        return self.weight * (x32 * torch.rsqrt(variance + self.eps)).to(input_dtype)


class GeluAndMul(nn.Module):
    """``gelu_tanh(x[..., :d]) * x[..., d:]`` for the fused gate/up output ``[.., 2d]`` (Gemma's GeGLU).

    With ``native`` (``cpu_ops``) one C pass whose tanh is Cephes' polynomial (a
    few ulp from torch's): the native decoder calls the same kernel."""

    def __init__(self) -> None:
        super().__init__()
        self.native: Any = None  # cpu_ops library, set by the model's finalize
        self.fused: Any = None  # unused: GPUs keep torch's gelu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None and x.dim() == 2 and x.is_contiguous():
            return cpu_ops.gelu_tanh_and_mul(self.native, x)
        d = x.shape[-1] // 2
        return F.gelu(x[..., :d], approximate="tanh") * x[..., d:]


class SiluAndMul(nn.Module):
    """``silu(x[..., :d]) * x[..., d:]`` for the fused gate/up projection output ``[.., 2d]``."""

    def __init__(self) -> None:
        super().__init__()
        self.native: Any = None  # cpu_ops library, set by the model's finalize
        self.fused: Any = None  # triton_ops.TritonOps on a GPU, set by the model's finalize

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None and x.dim() == 2 and x.is_contiguous():
            return cpu_ops.silu_and_mul(self.native, x)
        if self.fused is not None and x.dim() == 2 and x.stride(1) == 1:
            return self.fused.silu_and_mul(x)
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]


def rope_inv_freq(head_dim: int, theta: float, scaling: Optional[Llama3RopeScaling] = None) -> torch.Tensor:
    """Inverse frequencies ``[head_dim / 2]`` (float32), exactly as transformers computes them.

    With ``scaling`` this is Llama 3.1's rule: long wavelengths are divided by
    ``factor``, short ones kept, and the band in between interpolated.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype=torch.float) / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    if scaling is None:
        return inv_freq
    old_context_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context_len / scaling.low_freq_factor
    high_freq_wavelen = old_context_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_context_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def longrope_inv_freq(head_dim: int, theta: float, factors: tuple[float, ...]) -> torch.Tensor:
    """LongRoPE's inverse frequencies for one factor set, as transformers computes them."""
    ext = torch.tensor(factors, dtype=torch.float32)
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (ext * theta ** exponents)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding in HF's ``rotate_half`` convention.

    The head dimension is split in two halves ``(x1, x2)`` (not interleaved
    pairs)::

        out = [x1 * cos - x2 * sin,  x2 * cos + x1 * sin]

    cos/sin of every position up to ``max_positions`` are precomputed once;
    a step gathers its rows with :meth:`lookup` (once per step, shared by all
    layers) and each layer calls :meth:`apply`. With ``LongRopeScaling`` the
    table has ``2 * max_positions`` rows: the short factors' rows, then the long
    ones' (``long_rows`` is the offset the runner adds to a long sequence's
    positions), both times the attention factor, as transformers' Phi-3 does.
    """

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: Optional[Llama3RopeScaling | LongRopeScaling] = None,
    ) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary embedding needs an even head_dim, got {head_dim}")
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.theta = theta
        self.scaling = scaling
        self.long_rows = max_positions if isinstance(scaling, LongRopeScaling) else 0
        self.register_buffer("cos_sin_cache", torch.empty(0), persistent=False)
        self.build_cache()

    def build_cache(self, device: Optional[torch.device] = None) -> None:
        """(Re)computes the cos/sin table ``[max_positions, 2, head_dim / 2]``.

        Computed in float32, stored in the buffer's current dtype (the model's
        dtype after ``.to(dtype)``). Called at construction and again after the
        module was created on the ``meta`` device and materialized with
        ``to_empty`` (buffers then hold garbage).
        """
        if device is None or torch.device(device).type == "meta":
            device = self.cos_sin_cache.device
        if device.type == "meta":
            # Built on the meta device: nothing to compute until materialized.
            self.cos_sin_cache = torch.empty(self.max_positions + self.long_rows, 2, self.head_dim // 2,
                                             device=device)
            return
        positions = torch.arange(self.max_positions, device=device, dtype=torch.int64).float()
        if isinstance(self.scaling, LongRopeScaling):
            tables = []
            for factors in (self.scaling.short_factor, self.scaling.long_factor):
                inv_freq = longrope_inv_freq(self.head_dim, self.theta, factors).to(device)
                freqs = positions[:, None] * inv_freq[None, :]
                scale = self.scaling.attention_factor
                tables.append(torch.stack((freqs.cos() * scale, freqs.sin() * scale), dim=1))
            cache = torch.cat(tables)
        else:
            inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling).to(device)
            freqs = positions[:, None] * inv_freq[None, :]
            cache = torch.stack((freqs.cos(), freqs.sin()), dim=1)
        self.cos_sin_cache = cache.to(self.cos_sin_cache.dtype)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[T, head_dim / 2]`` (contiguous) of ``positions`` ``[T]``.

        Positions must be below ``max_positions`` (the caller caps sequence
        lengths at ``max_model_len``), plus ``long_rows`` for a longrope
        sequence in its long mode.
        """
        rows = self.cos_sin_cache.index_select(0, positions)
        return rows[:, 0].contiguous(), rows[:, 1].contiguous()

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, native: Any = None,
              fused: Any = None) -> torch.Tensor:
        """Rotates ``x`` ``[T, heads, head_dim]`` by ``cos`` / ``sin`` ``[T, head_dim / 2]``.

        With ``native`` (``cpu_ops``; rows may be strided, heads and head_dim
        contiguous) or ``fused`` (``triton_ops``, GPU; head_dim contiguous)
        ``x`` is rotated in place and returned; otherwise a new contiguous
        tensor is returned.
        """
        if native is not None:
            cpu_ops.rotary(native, x, cos, sin)
            return x
        if fused is not None and x.stride(2) == 1:
            fused.rotary(x, cos, sin)
            return x
        half = x.shape[-1] // 2
        x1 = x[..., :half]
        x2 = x[..., half:]
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def extra_repr(self) -> str:
        scaled = ", longrope" if self.long_rows else ", llama3 scaling" if self.scaling else ""
        return f"head_dim={self.head_dim}, max_positions={self.max_positions}, theta={self.theta}{scaled}"
