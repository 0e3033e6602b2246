"""Triton dequantize-in-GEMM for group-quantized weights (GPUs; tested on CPU
under ``TRITON_INTERPRET=1``, which must be set before this module is imported).

One kernel serves the weight-only formats of ``workers/model/quant/``: a
weight ``W [N, K]`` is ``scale * q + min`` per group of ``group_size``
consecutive inputs (GGUF Q4_0 / Q4_1 / Q4_K / Q5_K / Q8_0 / Q6_K, int4, int8,
GPTQ, AWQ all decode to that, ``DecodedWeight``). On the device it is held as::

    4-bit   qweight int32 [K / 8, N]: input 8i + j of column n in bits 4j..4j+3
            of qweight[i, n] (GPTQ's packing along K)
    8-bit   qweight int8  [K, N]
    scales, mins  [ceil(K / group_size), N] (mins may be absent)

    grid = (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N))
    for each K tile (BLOCK_K inputs, inside one group):
        q  = unpack the tile's nibbles (or int8)         [BLOCK_K, BLOCK_N]
        w  = q * scale[g] + min[g]                       (float32, in registers)
        acc += x[BLOCK_M, BLOCK_K] @ w                   (tl.dot, float32 accumulate)

so the weights cross memory at 4 or 8 bits and are dequantized in registers,
never written out. ``BLOCK_K`` divides the group size, so a tile never spans
two groups. Float32 inputs use "tf32x3" dots (about float32 accuracy).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
import torch
import triton
import triton.language as tl

from workers.model.quant.gguf_blocks import DecodedWeight


@triton.jit
def _qgemm_kernel(x_ptr, q_ptr, s_ptr, m_ptr, y_ptr, M, N, K, stride_xm, stride_ym,
                  GROUP: tl.constexpr, BITS: tl.constexpr, HAS_MINS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        wmask = mask_k[:, None] & mask_n[None, :]
        if BITS == 4:
            packed = tl.load(q_ptr + (offs_k // 8)[:, None] * N + offs_n[None, :], mask=wmask, other=0)
            q = ((packed >> ((offs_k % 8) * 4)[:, None]) & 15).to(tl.float32)
        else:
            q = tl.load(q_ptr + offs_k[:, None] * N + offs_n[None, :], mask=wmask, other=0).to(tl.float32)
        g = k0 // GROUP
        scale = tl.load(s_ptr + g * N + offs_n, mask=mask_n, other=0.0)
        w = q * scale[None, :]
        if HAS_MINS:
            low = tl.load(m_ptr + g * N + offs_n, mask=mask_n, other=0.0)
            w = w + low[None, :]
        w = tl.where(wmask, w, 0.0)
        acc += tl.dot(x, w, input_precision=PRECISION)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc,
             mask=mask_m[:, None] & mask_n[None, :])


class TritonQuantWeight:
    """A ``DecodedWeight`` on a device, multiplied by :meth:`matmul`.

    Args:
        decoded: The weight (``bits`` 4 or 8; groups of an even size of at least 16).
        device: Where to keep it.
        bias: ``[N]`` or None.
    """

    def __init__(self, decoded: DecodedWeight, device: torch.device | str,
                 bias: Optional[torch.Tensor] = None) -> None:
        n, k = decoded.q.shape
        if decoded.bits == 5:  # Q5_0 / Q5_1 / Q5_K values (0..31) travel as 8-bit ones here
            decoded = dataclasses.replace(decoded, q=decoded.q.astype(np.int8), bits=8)
        if decoded.bits not in (4, 8) or decoded.group_size < 16 or decoded.group_size % 16:
            raise ValueError(f"the Triton kernel takes 4- or 8-bit weights in groups of a multiple of 16 inputs, "
                             f"got {decoded.bits} bits in groups of {decoded.group_size}")
        if decoded.bits == 4 and k % 8:
            raise ValueError(f"4-bit weights pack 8 inputs per int32: K={k} is not a multiple of 8")
        self.out_features, self.in_features = n, k
        self.bits, self.group_size, self.name = decoded.bits, decoded.group_size, decoded.format
        qt = decoded.q.T  # [K, N]
        if decoded.bits == 4:
            v = qt.astype(np.uint32).reshape(k // 8, 8, n)
            packed = np.zeros((k // 8, n), dtype=np.uint32)
            for j in range(8):
                packed |= v[:, j] << np.uint32(4 * j)
            q = torch.from_numpy(packed.view(np.int32))
        else:
            q = torch.from_numpy(np.ascontiguousarray(qt.astype(np.int8)))
        self.q = q.contiguous().to(device)
        self.scales = torch.from_numpy(np.ascontiguousarray(decoded.scales.T.astype(np.float32))).to(device)
        self.mins = (torch.from_numpy(np.ascontiguousarray(decoded.mins.T.astype(np.float32))).to(device)
                     if decoded.mins is not None else None)
        self.bias = bias.detach().float().to(device) if bias is not None else None

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if x2.stride(1) != 1:
            x2 = x2.contiguous()
        m = x2.shape[0]
        y = torch.empty(m, self.out_features, dtype=torch.float32, device=x2.device)
        block_k = min(64, self.group_size)
        while self.group_size % block_k:
            block_k //= 2
        grid = (triton.cdiv(m, 16), triton.cdiv(self.out_features, 64))
        _qgemm_kernel[grid](x2, self.q, self.scales, self.mins if self.mins is not None else self.scales, y,
                            m, self.out_features, self.in_features, x2.stride(0), y.stride(0),
                            GROUP=self.group_size, BITS=self.bits, HAS_MINS=self.mins is not None,
                            BLOCK_M=16, BLOCK_N=64, BLOCK_K=block_k,
                            PRECISION="tf32x3" if x2.dtype == torch.float32 else "tf32")
        if self.bias is not None:
            y += self.bias
        return y.to(x.dtype)
