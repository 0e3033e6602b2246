"""A native int8 x int8 GEMM for W8A8 (CPU): ``y = x @ W.T (+ b)`` with ``W``
int8 per output channel (``w_scale[c] * wq[c, :]``) and ``x`` quantized per
row when called (``a_r = max|x_r| / 127``, ``xq_r = round(x_r / a_r)``)::

    y[r, c] = a_r * w_scale[c] * (sum over k of xq[r, k] * wq[c, k])  (+ b[c])

The sum is computed in int32, exactly, so every row's result is the same
whatever the batch (batch-invariant by construction) and whatever the thread
count. Products come from integer dot-product instructions, four int8 pairs
per 32-bit lane:

    AVX-512 VNNI    vpdpbusd (u8 x s8); x is stored as xq + 128 (u8) and
                    128 * sum(wq[c, :]) is subtracted after the loop
    AVX2            vpmaddubsw on |xq| and wq with xq's sign (no saturation:
                    127 * 127 * 2 < 2^15), then vpmaddwd

Layout of a panel of NR output columns: int8 ``[K4 / 4][NR][4]`` (four
consecutive inputs of a column per 32-bit lane; K padded to K4, a multiple of
four, with zeros). Per weight it reads one byte; per 64 (VNNI) or 32 (AVX2)
multiply-adds one instruction, four times the float FMA rate.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import numpy as np
import torch

from workers.model import native

_SOURCE = native.source("i8gemm_f32.c")

_P, _L = ctypes.c_void_p, ctypes.c_long
_SIGNATURES = {"i8gemm_f32": [_P, _L, _L, _L, _P, _P, _P, _L, _P, _P, _L]}


def load() -> Optional[ctypes.CDLL]:
    """The built kernel, or None (no compiler, no AVX2, or a failed build)."""
    lib = native.build("i8gemm_f32", _SOURCE, signatures=_SIGNATURES)
    if lib is not None:
        lib.i8gemm_panel_width.restype = ctypes.c_int
        lib.i8gemm_vnni.restype = ctypes.c_int
    return lib


class Int8Weight:
    """An int8 weight ``[N, K]`` with one scale per output channel, for :func:`i8gemm_f32`.

    Args:
        q: ``[N, K]`` int8 in -127..127.
        scales: ``[N]`` float32 (``W ~ scales[:, None] * q``).
        bias: ``[N]`` or None.
        lib: The kernel (``load()``).
        name: Format name, for logs and metrics.
    """

    def __init__(self, q: np.ndarray, scales: np.ndarray, bias: Optional[torch.Tensor], lib: ctypes.CDLL,
                 name: str = "w8a8") -> None:
        n, k = q.shape
        if q.dtype != np.int8 or q.min() < -127:
            raise ValueError(f"int8 weight of {n}x{k}: values must be int8 in -127..127")
        self.lib, self.name = lib, name
        self.out_features, self.in_features = n, k
        nr = lib.i8gemm_panel_width()
        num_panels, k4 = -(-n // nr), -(-k // 4) * 4
        padded = np.zeros((num_panels * nr, k4), dtype=np.int8)
        padded[:n, :k] = q
        # [P, NR, K4/4, 4] -> [P, K4/4, NR, 4]
        panels = padded.reshape(num_panels, nr, k4 // 4, 4).transpose(0, 2, 1, 3)
        self.q = torch.from_numpy(np.ascontiguousarray(panels).reshape(-1).view(np.uint8))
        self.scales = torch.zeros(num_panels * nr, dtype=torch.float32)
        self.scales[:n] = torch.from_numpy(np.asarray(scales, dtype=np.float32).reshape(n))
        # 128 * sum of a column's weights: what x + 128 adds to its dot products (VNNI).
        self.wsum = torch.from_numpy(padded.astype(np.int32).sum(axis=1) * 128).to(torch.int32).contiguous()
        self.bias: Optional[torch.Tensor] = None
        if bias is not None:
            self.bias = torch.zeros(num_panels * nr, dtype=torch.float32)
            self.bias[:n] = bias.detach().float()

    @property
    def nbytes(self) -> int:
        """Bytes the kernel reads (panels, scales, column sums, bias)."""
        tensors = [self.q, self.scales, self.wsum] + ([self.bias] if self.bias is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)

    def _panels(self) -> tuple[torch.Tensor, int]:
        """The packed integers as ``[P, K4 / 4, NR, 4]`` int8, and K rounded up to 4 (``K4``)."""
        k4 = -(-self.in_features // 4) * 4
        return self.q.view(torch.int8).view(-1, k4 // 4, self.lib.i8gemm_panel_width(), 4), k4

    def int8_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """The weight as it was given: ``(q [N, K] int8, scales [N] float32)``, read back from the panels."""
        panels, k4 = self._panels()
        rows = panels.permute(0, 2, 1, 3).reshape(-1, k4)
        n = self.out_features
        return rows[:n, : self.in_features].numpy().copy(), self.scales[:n].numpy().copy()

    def dequantized_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``scale * q`` of ``ids`` as float32 ``[len(ids), K]``, read back from the panels."""
        panels, k4 = self._panels()
        nr = panels.shape[2]
        q = panels[ids // nr, :, ids % nr, :].reshape(len(ids), k4)[:, : self.in_features]
        return q.float() * self.scales[ids].unsqueeze(1)

    rows = dequantized_rows

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
            self.lib.i8gemm_f32(x.data_ptr(), m, self.in_features, x.stride(0), self.q.data_ptr(),
                                self.scales.data_ptr(), self.wsum.data_ptr(), self.out_features,
                                bias.data_ptr() if bias is not None else None, y.data_ptr(), self.out_features)
        return y
