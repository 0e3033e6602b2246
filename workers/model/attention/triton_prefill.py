"""Triton paged-attention prefill kernel: variable-length query chunks over a
cached prefix, any block size (the default 16 included).

Imported only when the Triton backend first runs a prefill chunk (set
``TRITON_INTERPRET=1`` before import to run it on CPU tensors, as the tests
do). The chunk's own K/V are written into the cache first, so every key,
prefix or new, is read through the block table::

    grid = (num_requests, cdiv(max_query_len, BLOCK_M), num_heads)

    query row i of request r sits at position ctx_r + i, where
    ctx_r = seq_lens[r] - query_len[r] (the cached prefix), and attends to
    positions max(0, ctx_r + i - window + 1) .. ctx_r + i

    for each key tile of BLOCK_N positions the tile's rows can see:
        scores = q @ K^T * scale (float32), masked causally / by the window
        online softmax; acc += P @ V

One launch serves the whole batch (the torch fallback loops over requests).
Rows of a tile whose keys in some tile are all masked contribute nothing
there (the running maximum stays finite or the tile is skipped), so no row
ever divides by zero: each sees at least its own position. Numerics as in
``triton_decode.py``: float32 scores and accumulator, "tf32x3" dots for
float32 caches, tensor-core dots for 16-bit ones.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from workers.model.attention.triton_decode import (
    _DOT_PRECISION,
    _MIN_DOT,
    _kv_tile_offsets,
    _online_softmax_tile,
    check_inputs,
    scalar_args,
)


@triton.jit
def _paged_prefill_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_ptr,
    scale,
    window,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_c_block,
    stride_c_slot,
    stride_c_head,
    stride_bt,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    req = tl.program_id(0)
    tile = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP
    q_start = tl.load(query_start_ptr + req)
    q_len = tl.load(query_start_ptr + req + 1) - q_start
    m0 = tile * BLOCK_M
    if m0 < q_len:
        seq_len = tl.load(seq_lens_ptr + req)
        ctx = seq_len - q_len
        rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = rows < q_len
        q_pos = ctx + rows  # absolute position of each query row
        dims = tl.arange(0, BLOCK_D)
        d_ok = dims < HEAD_DIM
        q_offs = (q_start + rows)[:, None] * stride_q_tok + head * stride_q_head + dims[None, :]
        q = tl.load(q_ptr + q_offs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)

        last_row = tl.minimum(m0 + BLOCK_M, q_len) - 1
        hi = ctx + last_row + 1  # keys beyond the tile's last row are never seen
        lo = 0
        if HAS_WINDOW:
            lo = tl.maximum(ctx + m0 - window + 1, 0)
        tile_start = (lo // BLOCK_N) * BLOCK_N

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        for start in range(tile_start, hi, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            key_ok = (pos < hi) & (pos >= lo)
            kv_offs = _kv_tile_offsets(block_tables_ptr, req * stride_bt, pos, key_ok, kv_head, dims,
                                       stride_c_block, stride_c_slot, stride_c_head, KV_BLOCK_SIZE)
            kv_mask = key_ok[:, None] & d_ok[None, :]
            k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
            scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # [BLOCK_M, BLOCK_N]
            seen = key_ok[None, :] & (pos[None, :] <= q_pos[:, None])
            if HAS_WINDOW:
                seen = seen & (pos[None, :] > q_pos[:, None] - window)
            scores = tl.where(seen, scores, float("-inf"))
            v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
            m_i, l_i, acc = _online_softmax_tile(scores, m_i, l_i, acc, v, DOT_PRECISION)

        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_offs = (q_start + rows)[:, None] * stride_o_tok + head * stride_o_head + dims[None, :]
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _launch_config(dtype: torch.dtype, block_d: int) -> tuple[int, int, int]:
    """(query rows per tile, key tokens per tile, warps): smaller tiles for float32
    (tf32x3 dots take three times the registers) and for large heads."""
    if dtype.itemsize == 2:
        return (64, 64, 4) if block_d <= 128 else (32, 32, 8)
    return (32, 32, 4) if block_d <= 64 else (16, 32, 8)


def paged_prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    sliding_window: Optional[int] = None,
) -> torch.Tensor:
    """Causal attention of each request's query chunk over its paged K/V.

    Request r's queries are rows ``query_start_loc[r] .. query_start_loc[r+1]``
    of ``q``, at the last positions of its ``seq_lens[r]``; their K/V (and the
    prefix's) must already be in the cache.

    Args:
        q: [T, num_heads, head_dim], last dim contiguous.
        kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim].
        block_tables: [B, max_blocks] int32.
        seq_lens: [B] int32.
        query_start_loc: [B + 1] int32 (starts at 0).
        max_query_len: The longest chunk (sizes the grid; a host int, no sync).
        scale: Softmax scale.
        sliding_window: Keys per query, or None for all.

    Returns:
        [T, num_heads, head_dim] in q's dtype.
    """
    tokens = q.shape[0]
    q, block_tables = check_inputs(q, kv_cache, block_tables)
    _, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    num_reqs = seq_lens.shape[0]
    assert block_tables.shape[0] == num_reqs and query_start_loc.shape == (num_reqs + 1,)
    out = torch.empty_like(q)
    if tokens == 0 or num_reqs == 0:
        return out
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    block_d = max(_MIN_DOT, triton.next_power_of_2(head_dim))
    block_m, block_n, num_warps = _launch_config(kv_cache.dtype, block_d)
    grid = (num_reqs, triton.cdiv(max_query_len, block_m), num_heads)
    _paged_prefill_kernel[grid](
        out,
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        *scalar_args(q, out, k_cache, block_tables, scale, sliding_window),
        HEAD_DIM=head_dim,
        GROUP=num_heads // num_kv_heads,
        KV_BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        HAS_WINDOW=sliding_window is not None,
        DOT_PRECISION=_DOT_PRECISION,
        num_warps=num_warps,
    )
    return out
