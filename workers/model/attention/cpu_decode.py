"""A native paged-attention decode kernel for CPUs (float32), built on first use.

Torch's decode path gathers each request's blocks into a padded tensor and
then attends over it: the KV bytes cross memory three times. This kernel reads
every key and value once, straight from the paged cache, with an online
softmax per block, threads over (request, KV head) pairs, and keeps the GQA
query heads of one KV head together so each key is loaded once::

    for each (request r, kv head h):          (OpenMP, dynamic schedule)
        for each block b of r:                 positions [lo, seq_len)
            s[g, j] = q[r, h*G+g] . K[b, j, h]   for the G query heads of h
            online softmax update of acc[g], m[g], l[g] with V[b, j, h]
        out[r, h*G+g] = acc[g] / l[g]

One call per layer can also write the step's new keys and values into their
slots first, reading q, k and v straight out of the fused projection's rows
(no copies, no separate scatter).

With AVX2 and a float32 cache (head_dim a multiple of 8) a hand-vectorized
path serves instead: a task is a request, a range of its KV heads (all of
them unless tasks are too few for the threads) and a chunk of 512 positions;
each block's rows of the range are read together, and a sequence longer than
a chunk is attended chunk by chunk in parallel and merged in order
(flash-decoding). Chunks are cut at the request's own positions and a query
head's arithmetic never depends on the head range, so a request's output is
the same whatever its batch-mates.

Soft-capped scores (Gemma 2) are capped in the kernel, between the product
and the softmax (``softcap``), on both paths.

It is plain C built on first use (``workers/model/native.py``): no compiler,
or a failed build, leaves ``load()`` returning None and the torch path in
use; nothing else changes.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Optional

import torch

from workers.model import native

logger = logging.getLogger(__name__)

_SOURCE = native.source("paged_decode.c")

MAX_GROUP, MAX_DIM, MAX_BLOCK = 32, 256, 256
_FLAGS = (*native.FLAGS, "-ffp-contract=fast", "-fno-math-errno")
_P, _L, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
_SIGNATURES = {"paged_decode_f32": [_P, _L, _P, _L, _P, _L, _P, _P, _P, _P, _I, _P, _I, _I, _I, _I, _I,
                                    ctypes.c_float, _I, _P, _L, _P, _P, _I, ctypes.c_float]}


def load(kv_dtype: torch.dtype = torch.float32) -> Optional[ctypes.CDLL]:
    """Builds (once per source version and machine, ``workers/model/native.py``) and loads the kernel
    for a float32 cache, or with ``kv_dtype`` int8 for the int8 cache (``kv_int8.py``).

    Returns:
        The library, or None when no C compiler is found or the build fails
        (logged once; callers fall back to torch).
    """
    if kv_dtype == torch.int8:
        return native.build("paged_decode_i8", _SOURCE, (*_FLAGS, "-DKV_INT8"), _SIGNATURES)
    return native.build("paged_decode", _SOURCE, _FLAGS, _SIGNATURES)


def supports(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether the kernel can serve this call (CPU, float32 queries, a float32
    or int8 cache, sizes in range)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    row = head_dim + 4 if kv_cache.dtype == torch.int8 else head_dim  # int8 rows end in their scale
    return (
        q.device.type == "cpu"
        and q.dtype == torch.float32
        and q.stride(2) == 1
        and q.stride(1) == head_dim
        and kv_cache.dtype in (torch.float32, torch.int8)
        and kv_cache.shape[4] == row
        and kv_cache.is_contiguous()
        and num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= MAX_GROUP
        and head_dim <= MAX_DIM
        and block_size <= MAX_BLOCK
    )


def paged_decode(
    lib: ctypes.CDLL,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: Optional[int],
    new_kv: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
    tails: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    softcap: Optional[float] = None,
) -> torch.Tensor:
    """Attention of one query per request over its paged K/V (see module doc).

    Args:
        q: [B, num_heads, head_dim] float32; rows may be strided (heads and
            head_dim contiguous, e.g. a view of the fused q/k/v projection).
        kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim], contiguous.
        block_tables: [B, width] int32.
        seq_lens: [B] int32 (the query sits at position seq_len - 1).
        new_kv: ``(k, v, slot_mapping)``: each request's new key and value
            ([B, num_kv_heads, head_dim], rows may be strided, heads and
            head_dim contiguous) written to its slot first, in the same call.
        tails: ``(tail_lo [B] int32, tail_slots [B, W] int64)`` for tree
            verification: a request with ``tail_lo >= 0`` reads its positions
            from ``tail_lo`` on at ``tail_slots[r, p - tail_lo]`` (the
            request's own path through the tree) instead of through its
            block table; -1 reads the table as usual.
        softcap: Gemma 2's cap: each scaled score ``s`` becomes
            ``softcap * tanh(s / softcap)`` before the softmax.

    Returns:
        [B, num_heads, head_dim], contiguous.
    """
    num_reqs, num_heads, head_dim = q.shape
    assert q.stride(2) == 1 and q.stride(1) == head_dim
    tables = block_tables if block_tables.dtype == torch.int32 else block_tables.to(torch.int32)
    lens = seq_lens if seq_lens.dtype == torch.int32 else seq_lens.to(torch.int32)
    tables, lens = tables.contiguous(), lens.contiguous()
    out = torch.empty(num_reqs, num_heads, head_dim, dtype=q.dtype)
    k_ptr = v_ptr = slots_ptr = None
    ldk = ldv = 0
    if new_kv is not None:
        k, v, slots = new_kv
        assert k.stride(2) == v.stride(2) == 1 and k.stride(1) == v.stride(1) == head_dim
        assert slots.dtype == torch.int64 and slots.is_contiguous()
        k_ptr, v_ptr, slots_ptr, ldk, ldv = k.data_ptr(), v.data_ptr(), slots.data_ptr(), k.stride(0), v.stride(0)
    tail_lo_ptr = tail_slots_ptr = None
    tail_width = 0
    if tails is not None:
        tail_lo, tail_slots = tails
        assert tail_lo.dtype == torch.int32 and tail_slots.dtype == torch.int64
        assert tail_lo.is_contiguous() and tail_slots.is_contiguous() and tail_lo.shape[0] == num_reqs
        tail_lo_ptr, tail_slots_ptr, tail_width = tail_lo.data_ptr(), tail_slots.data_ptr(), tail_slots.shape[1]
    lib.paged_decode_f32(
        q.data_ptr(), q.stride(0), k_ptr, ldk, v_ptr, ldv, slots_ptr, kv_cache[0].data_ptr(), kv_cache[1].data_ptr(),
        tables.data_ptr(), tables.shape[1], lens.data_ptr(), num_reqs, num_heads, kv_cache.shape[3], head_dim,
        kv_cache.shape[2], float(scale), int(sliding_window or 0), out.data_ptr(), num_heads * head_dim,
        tail_lo_ptr, tail_slots_ptr, tail_width, float(softcap or 0.0),
    )
    return out
