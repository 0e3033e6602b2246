"""The int8 KV cache (``kv_cache_dtype="int8"``): one scale per token and head.

A layer's cache is one int8 tensor ``[2, num_blocks, block_size, num_kv_heads,
head_dim + 4]``: each (token, head) row holds the head's ``head_dim`` values
quantized symmetrically, ``q = round_half_even(x * 127 / max|x|)``, followed
by the four bytes of the float32 scale ``max|x| / 127``. So swapping and
copying blocks stay dtype-blind (a block is still one slice), and the native
decode kernel (``cpu_decode.py``, built with ``-DKV_INT8``) reads values and
scale from the same cache line. A row takes ``head_dim + 4`` bytes against
``4 * head_dim`` in float32 (3.8x the blocks for head_dim 64) and
``2 * head_dim`` in float16 (1.9x).
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4


def row_width(head_dim: int) -> int:
    """Bytes of one (token, head) row: the values, then the scale."""
    return head_dim + SCALE_BYTES


def quantize(x: torch.Tensor) -> torch.Tensor:
    """``[..., head_dim]`` float -> ``[..., head_dim + 4]`` int8 rows (values, then the scale's bytes)."""
    x = x.float()
    amax = x.abs().amax(dim=-1, keepdim=True)
    # A true division, as the native kernel's 127.0f / amax: torch computes `127.0 / amax` as a reciprocal
    # times 127 (an ulp off for a quarter of the values), which could round a near-tie the other way, so
    # a token's KV would depend on which path (prefill here, decode in C) wrote it.
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.clamp(torch.round(x * inv), -127, 127).to(torch.int8)
    scale = (amax / 127.0).contiguous().view(torch.int8)  # [..., 4] bytes of the float32
    return torch.cat((q, scale), dim=-1)


def dequantize(rows: torch.Tensor) -> torch.Tensor:
    """``[..., head_dim + 4]`` int8 rows -> ``[..., head_dim]`` float32."""
    scale = rows[..., -SCALE_BYTES:].contiguous().view(torch.float32)
    return rows[..., :-SCALE_BYTES].float() * scale


def write(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Quantizes ``k``, ``v`` ``[T, num_kv_heads, head_dim]`` into their slots of an int8 cache."""
    width = kv_cache.shape[-1]
    heads = kv_cache.shape[-2]
    kv_cache[0].view(-1, heads, width)[slot_mapping] = quantize(k)
    kv_cache[1].view(-1, heads, width)[slot_mapping] = quantize(v)
