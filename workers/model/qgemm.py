"""A native GEMM over group-quantized weights (CPU): ``y = x @ W.T (+ b)`` where
each weight is ``scale * q + min`` with a small integer ``q`` and a float
``scale`` / ``min`` per group of ``group_size`` consecutive inputs.

One kernel serves every weight-only format (``workers/model/quant/``):

    format          q                       group   min
    GGUF Q4_0       4-bit, 0..15            32      -8 * d
    GGUF Q4_1       4-bit, 0..15            32      m
    GGUF Q8_0       8-bit, -128..127        32      none
    GGUF Q4_K       4-bit, 0..15            32      -dmin * m   (scale d * sc)
    GGUF Q5_0       5-bit, 0..31            32      -16 * d
    GGUF Q5_1       5-bit, 0..31            32      m
    GGUF Q5_K       5-bit, 0..31            32      -dmin * m
    GGUF Q6_K       6-bit in 8, -32..31     16      none        (scale d * sc)
    int4 (ours)     4-bit, 0..15            32/64/128  asymmetric
    int8 (ours)     8-bit, -127..127        the row  none

Layout of a panel of NR output columns (as ``gemm.py``: 32 with AVX-512, 16
with AVX2)::

    4-bit  bytes [K / 2][NR]: byte (kk, c) holds q[2kk][c] (low nibble) and
           q[2kk + 1][c] (high nibble), so one load gives two inputs' q of
           every column, unpacked along the vector
    5-bit  the 4-bit layout of the low four bits, then bytes [K / 8][NR] of
           fifth bits: bit i of byte (j, c) is bit 4 of q[8j + i][c]
           (0.625 bytes per weight; groups and K multiples of 8)
    8-bit  int8  [K][NR]
    scales float [K / group][NR], mins float [K / group][NR] or none

Arithmetic: per group the integer weights meet x in one FMA chain (exact
small integers as floats), then the group's scale and min are applied::

    y[r, c] = sum over groups g, in order:
                  scale[g][c] * (sum over k in g, in order: x[r, k] * q[k][c])
                + min[g][c]   * (sum over k in g, in order: x[r, k])

Every element is computed the same way whatever the batch (the
per-row group sums of x are computed once per row, in order): batch-invariant
like the float GEMM. It is not the float GEMM on dequantized weights (that
sums ``x * (scale * q + min)`` term by term): results agree to float rounding
(``tests/unit/test_qgemm.py``). Per weight it costs one int-to-float
conversion and one FMA per row, on 4, 5 or 8 bits read from memory instead of 32.

From 16 rows (prefill, large decode batches) each panel's q is first decoded
to floats once (exact small integers, K x NR floats, in L2) and the rows run
on that with the same operations in the same order, so the same bits; the
conversion is then paid once per panel instead of once per 3 rows (AVX2),
1.3x faster at 64-512 rows on the AVX2 EPYC. There x is packed in strips of
rows as the float32 GEMM packs it, and the group sums are taken from the
strips on every thread (``csrc/qgemm_prefill.h``). What remains against the
float32 GEMM on the same shapes is the arithmetic itself: per group of G
inputs an element takes G FMAs plus two (scale, min), so with groups of 32
an FMA-bound CPU runs it at most at 32 / 34 = 0.94x the float32 GEMM's speed
(0.98x with groups of 128) unless the bits change (docs/QUANTIZATION.md).
"""

from __future__ import annotations

import ctypes
from typing import Optional

import numpy as np
import torch

from workers.model import native

_SOURCE = native.source("qgemm_f32.c")

_P, _L, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
_SIGNATURES = {"qgemm_f32": [_P, _L, _L, _L, _P, _P, _P, _I, _L, _L, _P, _P, _L]}


def load() -> Optional[ctypes.CDLL]:
    """The built kernel, or None (no compiler, no AVX2 + FMA, or a failed build)."""
    lib = native.build("qgemm_f32", _SOURCE, signatures=_SIGNATURES)
    if lib is not None:
        lib.qgemm_panel_width.restype = ctypes.c_int
    return lib


class QuantWeight:
    """A group-quantized weight ``[N, K]`` packed for :func:`qgemm_f32`.

    Args:
        q: ``[N, K]`` integers (0..15 for ``bits`` 4, 0..31 for 5; int8 for 8).
        scales: ``[N, K / group_size]`` float32.
        mins: ``[N, K / group_size]`` float32, or None.
        bits: 4, 5 or 8.
        group_size: Inputs per group (even; 5-bit: a multiple of 8); the last group of a row may be
            shorter (K = 576 with groups of 128: four of 128, one of 64).
        bias: ``[N]`` float32 or None.
        lib: The kernel (``load()``).
        name: Format name, for logs and metrics (``q4_1``, ``int4-g32``, ...).
    """

    def __init__(self, q: np.ndarray, scales: np.ndarray, mins: Optional[np.ndarray], bits: int, group_size: int,
                 bias: Optional[torch.Tensor], lib: ctypes.CDLL, name: str = "") -> None:
        n, k = q.shape
        step = 8 if bits == 5 else 2  # 5-bit: a byte of fifth bits covers 8 inputs
        if bits not in (4, 5, 8) or group_size % step or k % step:
            raise ValueError(f"quantized weight of {n}x{k}: bits must be 4, 5 or 8, the group size ({group_size}) "
                             f"and the input size multiples of {step}")
        top = (1 << bits) - 1
        if bits != 8 and (q.min() < 0 or q.max() > top):
            raise ValueError(f"{bits}-bit weights must hold values 0..{top}")
        self.lib, self.bits, self.group_size, self.name = lib, bits, group_size, name
        self.out_features, self.in_features = n, k
        nr = lib.qgemm_panel_width()
        num_panels = -(-n // nr)
        rows = num_panels * nr
        groups = -(-k // group_size)  # the last group may be shorter
        qpad = np.zeros((rows, k), dtype=np.int8 if bits == 8 else np.uint8)
        qpad[:n] = q
        panel_q = qpad.reshape(num_panels, nr, k).transpose(0, 2, 1)  # [P, K, NR]
        if bits in (4, 5):
            low = panel_q & np.uint8(15)
            packed = low[:, 0::2, :] | (low[:, 1::2, :] << 4)  # [P, K/2, NR]
            if bits == 5:  # then the fifth bits, 8 inputs a byte: [P, K/2 + K/8, NR]
                fifth = (panel_q >> 4).reshape(num_panels, k // 8, 8, nr) << np.arange(8, dtype=np.uint8)[:, None]
                packed = np.concatenate([packed, np.bitwise_or.reduce(fifth, axis=2).astype(np.uint8)], axis=1)
            panel_q = packed
        self.q = torch.from_numpy(np.ascontiguousarray(panel_q).view(np.uint8))
        self.scales = self._panels(scales, num_panels, nr, groups)
        self.mins = self._panels(mins, num_panels, nr, groups) if mins is not None else None
        self.bias: Optional[torch.Tensor] = None
        if bias is not None:
            self.bias = torch.zeros(rows, dtype=torch.float32)
            self.bias[:n] = bias.detach()

    @staticmethod
    def _panels(values: np.ndarray, num_panels: int, nr: int, groups: int) -> torch.Tensor:
        padded = np.zeros((num_panels * nr, groups), dtype=np.float32)
        padded[: values.shape[0]] = values
        return torch.from_numpy(np.ascontiguousarray(padded.reshape(num_panels, nr, groups).transpose(0, 2, 1)))

    @property
    def nbytes(self) -> int:
        """Bytes the packed weight holds (integers, scales, mins, bias)."""
        tensors = [self.q, self.scales] + [t for t in (self.mins, self.bias) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    def dequantized_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``scale * q + min`` of ``ids`` as float32 ``[len(ids), K]`` (an embedding's lookup)."""
        nr, k, gs = self.lib.qgemm_panel_width(), self.in_features, self.group_size
        panel, col = ids // nr, ids % nr
        if self.bits in (4, 5):
            data = self.q.view(-1, k // 2 + (k // 8 if self.bits == 5 else 0), nr)[panel, :, col]  # [T, bytes]
            packed = data[:, : k // 2]
            q = torch.stack((packed & 15, packed >> 4), dim=-1).reshape(len(ids), k)
            if self.bits == 5:
                bit = torch.arange(8, dtype=torch.uint8)
                q = q | (((data[:, k // 2 :, None] >> bit) & 1) << 4).reshape(len(ids), k)
            q = q.float()
        else:
            q = self.q.view(torch.int8).view(-1, k, nr)[panel, :, col].float()
        groups = -(-k // gs)
        scales = self.scales.view(-1, groups, nr)[panel, :, col].repeat_interleave(gs, dim=1)[:, :k]
        out = scales * q
        if self.mins is not None:
            out = out + self.mins.view(-1, groups, nr)[panel, :, col].repeat_interleave(gs, dim=1)[:, :k]
        return out

    rows = dequantized_rows  # the interface a tied embedding reads rows through

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self._run(x, self.bias)

    def matmul_no_bias(self, x: torch.Tensor) -> torch.Tensor:
        return self._run(x, None)

    def _run(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if x.dim() != 2 or x.stride(1) != 1 or x.dtype != torch.float32:
            x = x.reshape(-1, self.in_features).contiguous().float()
        m = x.shape[0]
        y = torch.empty(m, self.out_features, dtype=torch.float32)
        if m:
            self.lib.qgemm_f32(x.data_ptr(), m, self.in_features, x.stride(0), self.q.data_ptr(),
                               self.scales.data_ptr(), self.mins.data_ptr() if self.mins is not None else None,
                               self.bits, self.group_size, self.out_features,
                               bias.data_ptr() if bias is not None else None, y.data_ptr(), self.out_features)
        return y
