"""GPTQ (Frantar et al., 2023) for ``prefixserve quantize --method gptq``: 4-bit
weights chosen against the layer's inputs, not only its weights.

For a linear layer ``W [N, K]`` with calibration inputs ``X [n, K]``, GPTQ
minimizes ``||X W^T - X Q^T||^2`` column by column: it quantizes input column
``k``, then spreads that column's error over the columns not yet quantized
through the inverse Hessian ``H^-1`` of ``H = 2 X^T X / n`` (Optimal Brain
Quantization, done in blocks of 128 columns with the Cholesky factor of
``H^-1``). Groups of ``group_size`` inputs get their grid (scale and integer
zero point) when the quantizer reaches them, from the weights as updated so
far, as the reference implementation does with static ordering
(``desc_act=False``).

The grid is GPTQ's asymmetric 4-bit one, the one its checkpoints store: per
group ``scale = (max - min) / 15`` over a range that includes 0, rounded to
float16 as written, an integer zero point ``round(-min / scale)`` in 0..15,
and ``w ~ scale * (q - zero)``. ``rtn`` is the same grid without the error
feedback (round to nearest), for ``--rtn`` and for comparison.

The Hessians come from one float pass over calibration text
(``smoothquant.input_statistics``); inputs are the float model's, not the
partly quantized one's (no "true-sequential" pass).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from workers.model.quant.gguf_blocks import DecodedWeight

logger = logging.getLogger(__name__)

BLOCK = 128  # columns per lazy-update block
DAMP = 0.01  # fraction of the mean diagonal added to H


def _grid(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``w [N, g]``: the float16-exact scale and the integer zero of GPTQ's asymmetric 4-bit grid."""
    lo = torch.clamp(w.min(dim=1).values, max=0)
    hi = torch.clamp(w.max(dim=1).values, min=0)
    both_zero = (lo == 0) & (hi == 0)
    lo, hi = torch.where(both_zero, -1.0, lo), torch.where(both_zero, 1.0, hi)
    scale = ((hi - lo) / 15).to(torch.float16).to(w.dtype)
    scale = torch.where(scale == 0, torch.finfo(torch.float16).tiny, scale)
    zero = torch.clamp(torch.round(-lo / scale), 0, 15)
    return scale, zero


def _quantize(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """The grid's integers of ``w [N, ...]`` (0..15)."""
    shape = (-1,) + (1,) * (w.dim() - 1)
    return torch.clamp(torch.round(w / scale.view(shape)) + zero.view(shape), 0, 15)


def _decoded(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int, name: str) -> DecodedWeight:
    s = scales.float().numpy().astype(np.float32)
    return DecodedWeight(q.to(torch.uint8).numpy(), s, (-s * zeros.float().numpy()).astype(np.float32), 4,
                         group_size, name)


def rtn(w: np.ndarray, group_size: int) -> DecodedWeight:
    """Round to nearest on GPTQ's grid, group by group."""
    wt = torch.from_numpy(np.asarray(w, dtype=np.float32)).double()
    n, k = wt.shape
    groups = -(-k // group_size)
    q = torch.empty(n, k)
    scales, zeros = torch.empty(n, groups, dtype=torch.float64), torch.empty(n, groups, dtype=torch.float64)
    for g in range(groups):
        cols = wt[:, g * group_size : (g + 1) * group_size]
        scales[:, g], zeros[:, g] = _grid(cols)
        q[:, g * group_size : (g + 1) * group_size] = _quantize(cols, scales[:, g], zeros[:, g]).float()
    return _decoded(q, scales, zeros, group_size, f"rtn-g{group_size}")


def gptq(w: np.ndarray, h: torch.Tensor, group_size: int) -> DecodedWeight:
    """GPTQ of ``w [N, K]`` (float32) against the Hessian ``h [K, K]`` of its inputs (module doc)."""
    W = torch.from_numpy(np.asarray(w, dtype=np.float32)).double().clone()
    n, k = W.shape
    if group_size % 2 or BLOCK % group_size:
        raise ValueError(f"GPTQ's group_size must be even and divide {BLOCK}, got {group_size}")
    H = h.double().clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    H += DAMP * torch.mean(torch.diag(H)) * torch.eye(k, dtype=H.dtype)
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    groups = -(-k // group_size)
    Q = torch.zeros(n, k)
    scales, zeros = torch.empty(n, groups, dtype=torch.float64), torch.empty(n, groups, dtype=torch.float64)
    for i1 in range(0, k, BLOCK):
        i2 = min(i1 + BLOCK, k)
        W1, Hinv1 = W[:, i1:i2].clone(), Hinv[i1:i2, i1:i2]
        Err1 = torch.zeros_like(W1)
        for i in range(i2 - i1):
            col = i1 + i
            g = col // group_size
            if col % group_size == 0:  # the group's grid, from the weights as updated so far (inside this block)
                scales[:, g], zeros[:, g] = _grid(W1[:, i : i + group_size])
            qcol = _quantize(W1[:, i], scales[:, g], zeros[:, g])
            Q[:, col] = qcol.float()
            err = (W1[:, i] - scales[:, g] * (qcol - zeros[:, g])) / Hinv1[i, i]
            W1[:, i:] -= err.unsqueeze(1) @ Hinv1[i, i:].unsqueeze(0)
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
    return _decoded(Q, scales, zeros, group_size, f"gptq-g{group_size}")
