"""A native paged-attention prefill kernel for CPUs with AVX-512 (float32), built on first use.

Torch's prefill path gathers each request's blocks into a contiguous tensor
and calls ``scaled_dot_product_attention`` once per request; on this AMD CPU
its inner products go through MKL's sgemm at a third of the core's rate. This
kernel attends every prefill chunk of a step in one call, straight from the
paged cache (after the step's keys and values are written), at close to the
core's FMA rate::

    for each (request r, KV head h, tile of R query positions):   (OpenMP, dynamic)
        rows = the R positions x the G query heads of h  (R * G <= 16: one zmm lane each)
        for each tile of up to 16 keys (within one block) the rows can see:
            S[j] = K[j] . Q^T            16 accumulators; each key element broadcast
            causal / sliding-window mask, online softmax per lane (row)
            O[row] = O[row] * corr + sum_j P[j][row] V[j]

The queries are held transposed (``Q^T[d]`` is one vector of the tile's
rows), so a key's scores for all the rows are one vector and neither the keys
nor the scores need a transpose or a horizontal sum. A row's arithmetic
depends only on its request, its position and the tile's key order (absolute
positions), never on the other requests of the step.

It needs AVX-512F and ``head_dim`` a multiple of 16 (``supports``); without
them, or without a compiler, ``load()`` returns None and the torch path
serves, as before.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Optional

import torch

from workers.model import native

logger = logging.getLogger(__name__)

_SOURCE = native.source("paged_prefill.c")

MAX_DIM, MAX_GROUP = 256, 16
_FLAGS = (*native.FLAGS, "-ffp-contract=fast", "-fno-math-errno")
_P, _L, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
_SIGNATURES = {"paged_prefill_f32": [_P, _L, _P, _P, _P, _I, _P, _P, _I, _I, _I, _I, _I, _I,
                                     ctypes.c_float, _I, _P, _L]}


def _has_avx512() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " avx512f " in line + " " for line in f)
    except OSError:
        return False


def load() -> Optional[ctypes.CDLL]:
    """Builds (once per source version and machine) and loads the kernel.

    Returns:
        The library, or None on a CPU without AVX-512F, without a C compiler,
        or when the build fails (callers keep the torch path).
    """
    if not _has_avx512():
        logger.debug("no AVX-512F: prefill attention stays on torch")
        return None
    return native.build("paged_prefill", _SOURCE, _FLAGS, _SIGNATURES)


def supports(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether the kernel can serve this call (CPU, float32 queries and cache,
    ``head_dim`` a multiple of 16 up to 256, at most 16 query heads per KV head)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = kv_cache.shape[3]
    return (
        q.device.type == "cpu"
        and q.dtype == torch.float32
        and kv_cache.dtype == torch.float32
        and q.stride(2) == 1
        and q.stride(1) == head_dim
        and kv_cache.shape[4] == head_dim
        and kv_cache.is_contiguous()
        and num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= MAX_GROUP
        and head_dim % 16 == 0
        and head_dim <= MAX_DIM
    )


def paged_prefill(
    lib: ctypes.CDLL,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: Optional[int],
    out: torch.Tensor,
    requests: tuple[int, int],
) -> None:
    """Prefill attention of requests ``requests[0] .. requests[1] - 1`` into ``out`` (see module doc).

    Args:
        q: [T, num_heads, head_dim] float32 of the whole step; rows may be
            strided (heads and head_dim contiguous).
        kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim], the
            step's keys and values already written.
        block_tables: [B, width] int32; query_start_loc: [B + 1] int32;
            seq_lens: [B] int32 (as in ``AttentionMetadata``).
        out: [T, num_heads, head_dim] float32 (heads and head_dim contiguous):
            the requests' rows are written, every other row left alone.
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    assert out.stride(2) == 1 and out.stride(1) == head_dim and q.stride(2) == 1 and q.stride(1) == head_dim
    tables, starts, lens = (t if t.dtype == torch.int32 else t.to(torch.int32)
                            for t in (block_tables, query_start_loc, seq_lens))
    tables, starts, lens = tables.contiguous(), starts.contiguous(), lens.contiguous()
    lib.paged_prefill_f32(
        q.data_ptr(), q.stride(0), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), tables.data_ptr(),
        tables.shape[1], starts.data_ptr(), lens.data_ptr(), requests[0], requests[1], num_heads,
        kv_cache.shape[3], head_dim, kv_cache.shape[2], float(scale), int(sliding_window or 0),
        out.data_ptr(), out.stride(0),
    )
