"""A native float32 GEMM for the linear layers on CPU: ``y = x @ W.T (+ b)``
with ``W`` packed once at load, and every output element computed the same
way whatever the batch.

Layout and loop (NR = 2 vectors: 32 floats with AVX-512, 16 with AVX2)::

    W [N, K]  ──pack──▶  panels [ceil(N / NR)][K][NR]   (zero-padded columns)

    for each panel p            (threads split the panels)
      for each block of MR rows of x
        acc[MR][NR] = 0
        for k = 0 .. K-1:       acc[r][j] = fma(W[p*NR + j, k], x[r, k], acc[r][j])
        y[r, p*NR + j] = acc[r][j] (+ b[j])

Batch invariance: element ``y[r, n]`` is one FMA chain over ``k`` in
ascending order from zero, then the bias: the same instructions on the same
values whether the step has 1 row or 512, whichever row block or thread
computes it, and wherever the row sits in the batch. A request's logits
therefore never depend on its batch-mates (vLLM and SGLang need a special
batch-invariant mode for this; here it is the default). Its reduction order
differs from MKL's, so results differ from ``F.linear`` by float rounding
(parity with transformers is tested on tokens, as before).

Speed: the microkernel keeps MR x 2 vector accumulators in registers
(AVX-512: 12 x 2 of 32, AVX2: 6 x 2 of 16) with one broadcast of ``x`` per
row and ``k``; weights stream through each panel once per row block, in
the packed order the hardware prefetcher follows. At one row it reads the
weights at the memory's speed; with many rows it is bound by FMA throughput.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Optional

import torch

from workers.model import native

logger = logging.getLogger(__name__)

_SOURCE = native.source("gemm_f32.c")

_P, _L = ctypes.c_void_p, ctypes.c_long
_SIGNATURES = {"gemm_f32": [_P, _L, _L, _L, _P, _L, _P, _P, _L]}


def load() -> Optional[ctypes.CDLL]:
    """The built kernel library, or None (no compiler, no AVX2 + FMA, or a failed build)."""
    lib = native.build("gemm_f32", _SOURCE, signatures=_SIGNATURES)
    if lib is not None:
        lib.gemm_panel_width.restype = ctypes.c_int
        lib.gemm_rows_per_block.restype = ctypes.c_int
    return lib


class PackedWeight:
    """A weight ``[N, K]`` (and bias) packed for :func:`gemm_f32`.

    Args:
        weight: ``[N, K]`` float32 on CPU.
        bias: ``[N]`` float32 or None.
        lib: The kernel library (``load()``).
    """

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], lib: ctypes.CDLL) -> None:
        assert weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.dim() == 2
        self.lib = lib
        self.out_features, self.in_features = weight.shape
        nr = lib.gemm_panel_width()
        self.panel_width = nr
        num_panels = -(-self.out_features // nr)
        padded = torch.zeros(num_panels * nr, self.in_features, dtype=torch.float32)
        padded[: self.out_features] = weight.detach()
        # [P, NR, K] -> [P, K, NR]: column j of panel p is row p * NR + j of W.
        self.panels = padded.view(num_panels, nr, self.in_features).transpose(1, 2).contiguous()
        self.bias: Optional[torch.Tensor] = None
        if bias is not None:
            self.bias = torch.zeros(num_panels * nr, dtype=torch.float32)
            self.bias[: self.out_features] = bias.detach()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``W[ids]`` ``[len(ids), K]`` read back from the panels (a tied embedding's lookup)."""
        nr = self.panel_width
        return self.panels[ids // nr, :, ids % nr]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x [M, K] @ W.T + b`` as ``[M, N]`` float32."""
        return self._run(x, self.bias)

    def matmul_no_bias(self, x: torch.Tensor) -> torch.Tensor:
        """``x [M, K] @ W.T`` (a row-parallel layer adds the bias after its all-reduce)."""
        return self._run(x, None)

    def _run(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if x.dim() != 2 or x.stride(1) != 1 or x.dtype != torch.float32:
            x = x.reshape(-1, self.in_features).contiguous().float()
        m = x.shape[0]
        y = torch.empty(m, self.out_features, dtype=torch.float32)
        if m:
            self.lib.gemm_f32(x.data_ptr(), m, self.in_features, x.stride(0), self.panels.data_ptr(),
                              self.out_features, bias.data_ptr() if bias is not None else None,
                              y.data_ptr(), self.out_features)
        return y
