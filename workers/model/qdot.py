"""Group-quantized weights against int8 activations (CPU): llama.cpp's route
for its Q4 / Q8 files, on our kernel (``csrc/qdot.h``, run by ``qgemm_f32``).

Each row of ``x`` is quantized when called, per group of 32 inputs
(``dx = max|x| / 127``, ``xq = round(x / dx)``), and meets the 4- or 8-bit
weights of the same group in integer dot products (AVX-512 VNNI
``vpdpbusd``; AVX-512BW / AVX2 ``vpmaddubsw`` + ``vpmaddwd``)::

    y[r, c] = sum over groups g:  scale[g][c] * dx[r][g] * (sum over k in g of xq[r, k] * q[k][c])
                                + min[g][c] * (sum over k in g of x[r, k])

The integer sums are exact, so every row's result is the same whatever the
batch and the threads (batch-invariant); the result differs from the exact
float path (``qgemm.py``) by the activations' rounding (at most half a step
of ``dx`` per input). Per weight it costs a quarter (VNNI) of an instruction
instead of a conversion and an FMA: the batch-1 step goes from
compute-bound to the weight read, and prefill runs on integer throughput.

Which weights: 4-bit (0..15) and 8-bit (-127..127) in groups of exactly 32,
with ``K`` a multiple of 32: GGUF Q4_0, Q4_1, Q4_K, Q8_0, ``int4`` with
groups of 32, and the int8 LM head. :func:`try_dot_weight` returns None for
any other, which then keeps the exact kernel.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Optional

import numpy as np
import torch

from workers.model import qgemm

logger = logging.getLogger(__name__)

GROUP = 32  # inputs per activation block and weight group (QB in qdot.h)
FLAG = 64  # QDOT_FLAG: qgemm_f32 reads the dot-product layouts
HALF = 128  # QDOT_HALF: scales and mins stored as half floats


def available(lib: Optional[ctypes.CDLL]) -> bool:
    """Whether ``lib`` (``qgemm.load()``) has the integer path on this CPU."""
    if lib is None:
        return False
    lib.qdot_available.restype = ctypes.c_int
    return bool(lib.qdot_available())


def supports(q: np.ndarray, bits: int, group_size: int) -> bool:
    """Whether a weight of these integers fits the integer path."""
    if group_size != GROUP or q.shape[1] % GROUP or bits not in (4, 8):
        return False
    return bits == 4 or int(q.min(initial=0)) >= -127  # |q| must negate in int8


class DotQuantWeight(qgemm.QuantWeight):
    """A group-quantized weight ``[N, K]`` in the dot-product layouts (module doc).

    Same arguments as :class:`qgemm.QuantWeight` (``bits`` 4 or 8, ``group_size``
    32). ``bits`` then reads as the kernel's format code (``weight_bits | FLAG``,
    ``| HALF`` where the scales and mins are half floats exactly, as GGUF's are, and
    are stored so), what the native decoder passes to ``qgemm_f32``; ``weight_bits``
    holds 4 or 8.
    """

    def __init__(self, q: np.ndarray, scales: np.ndarray, mins: Optional[np.ndarray], bits: int, group_size: int,
                 bias: Optional[torch.Tensor], lib: ctypes.CDLL, name: str = "") -> None:
        n, k = q.shape
        if not available(lib):
            raise ValueError("int8 activations need the integer kernel (AVX2, or AVX-512 with BW); not on this CPU")
        if not supports(q, bits, group_size):
            raise ValueError(f"int8 activations take 4-bit or 8-bit (-127..127) weights in groups of {GROUP} "
                             f"with inputs a multiple of {GROUP}; got {bits}-bit {n}x{k}, groups of {group_size}")
        if bits == 4 and (q.min() < 0 or q.max() > 15):
            raise ValueError("4-bit weights must hold values 0..15")
        self.lib, self.weight_bits, self.group_size, self.name = lib, bits, group_size, name
        self.bits = bits | FLAG
        self.out_features, self.in_features = n, k
        nr = lib.qgemm_panel_width()
        num_panels = -(-n // nr)
        qpad = np.zeros((num_panels * nr, k), dtype=np.int8 if bits == 8 else np.uint8)
        qpad[:n] = q
        if bits == 4:  # [P, NR, K/8, (low, high), 4] -> bytes [P, K/8, NR, 4]
            parts = qpad.reshape(num_panels, nr, k // 8, 2, 4)
            packed = parts[:, :, :, 0, :] | (parts[:, :, :, 1, :] << 4)
        else:  # [P, NR, K/4, 4] -> [P, K/4, NR, 4]
            packed = qpad.reshape(num_panels, nr, k // 4, 4)
        self.q = torch.from_numpy(np.ascontiguousarray(packed.transpose(0, 2, 1, 3)).reshape(-1).view(np.uint8))
        groups = k // group_size
        self.scales = self._panels(scales, num_panels, nr, groups)
        self.mins = self._panels(mins, num_panels, nr, groups) if mins is not None else None
        # GGUF's scales and mins are half floats: stored as such they are the same values in fewer bytes
        # (a Q4_1 weight reads 0.625 bytes instead of 0.75), widened exactly by the kernel.
        if all(_exact_in_half(t) for t in (self.scales, self.mins) if t is not None):
            self.scales = self.scales.half()
            self.mins = self.mins.half() if self.mins is not None else None
            self.bits |= HALF
        self.bias: Optional[torch.Tensor] = None
        if bias is not None:
            self.bias = torch.zeros(num_panels * nr, dtype=torch.float32)
            self.bias[:n] = bias.detach()

    def integer_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The integers of rows ``ids`` as ``[len(ids), K]`` (uint8 0..15 or int8), read back from the panels."""
        nr, k = self.lib.qgemm_panel_width(), self.in_features
        panel, col = ids // nr, ids % nr
        if self.weight_bits == 4:
            data = self.q.view(-1, k // 8, nr, 4)[panel, :, col, :]  # [T, K/8, 4]
            return torch.stack((data & 15, data >> 4), dim=2).reshape(len(ids), k)
        return self.q.view(torch.int8).view(-1, k // 4, nr, 4)[panel, :, col, :].reshape(len(ids), k)

    def dequantized_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``scale * q + min`` of ``ids`` as float32 ``[len(ids), K]`` (an embedding's lookup)."""
        nr, k, gs = self.lib.qgemm_panel_width(), self.in_features, self.group_size
        panel, col = ids // nr, ids % nr
        groups = k // gs
        scales = self.scales.float().view(-1, groups, nr)[panel, :, col]
        out = scales.repeat_interleave(gs, dim=1) * self.integer_rows(ids).float()
        if self.mins is not None:
            out = out + self.mins.float().view(-1, groups, nr)[panel, :, col].repeat_interleave(gs, dim=1)
        return out

    rows = dequantized_rows


def _exact_in_half(values: torch.Tensor) -> bool:
    return bool(torch.isfinite(values).all()) and torch.equal(values.half().float(), values)


def try_dot_weight(q: np.ndarray, scales: np.ndarray, mins: Optional[np.ndarray], bits: int, group_size: int,
                   bias: Optional[torch.Tensor], lib: ctypes.CDLL, name: str = "") -> Optional[DotQuantWeight]:
    """A :class:`DotQuantWeight` of these integers, or None where the integer path does not take them."""
    if not available(lib) or not supports(q, bits, group_size):
        return None
    return DotQuantWeight(q, scales, mins, bits, group_size, bias, lib, name=name)
