"""Triton paged-attention decode kernel (one query token per request).

Imported only by ``TritonAttentionBackend`` when it first runs, so that the
package imports without triton. Triton decides at decoration time whether to
interpret kernels: set ``TRITON_INTERPRET=1`` before this module is imported
to run it on CPU tensors (tests).

One program per (request, KV head). It serves the ``GROUP = Hq / Hkv`` query
heads that share the KV head, so each K/V tile is read once per group (GQA)::

    grid = (num_requests, num_kv_heads)

    q rows    [BLOCK_H >= GROUP, BLOCK_D]        query heads of the group
    K/V tile  [BLOCK_N tokens, BLOCK_D]          token t of the request lives at
              block_tables[r, t // block_size] * block_size + t % block_size

    scores = q @ K^T (float32), online softmax over the tiles, out = P @ V / l

Token-wise addressing lets one tile span several KV blocks, so any block size
(even 1) works with 32- or 64-token tiles. Tiles before the sliding window are
skipped, not masked. Padded head rows and dims are loaded as zeros and never
stored. Scores, softmax and the accumulator are float32; 16-bit caches use
tensor-core dots on 16-bit inputs (P is cast to V's dtype, as in flash-attn),
float32 caches use "tf32x3" dots (about float32 accuracy, ~1e-6 relative).

Flash-decoding: a sequence longer than ``SPLIT`` (512) positions is cut at
absolute multiples of it, each split attended by its own program (grid
``(num_requests, num_kv_heads, splits)``), which keeps a small batch with long
contexts from leaving the GPU's multiprocessors idle; a second kernel merges
the splits' (max, sum, unnormalized output) in order. The cuts depend only on
the request's own length, so its result never depends on its batch-mates,
and a sequence of one split is written directly, as without splits. The grid's
split count comes from the block-table width (no read of ``seq_lens`` on the
host: no sync, and fixed inside a CUDA graph); programs past a request's
splits return at once.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

# tl.dot needs every dimension >= 16.
_MIN_DOT = 16
# Positions per split of a long sequence (flash-decoding): cut at absolute
# multiples, so a request's result depends on its own length only.
SPLIT = 512
# Float32 dots: "tf32x3" (three TF32 tensor-core passes) is float32-accurate
# (~1e-6 relative); plain "tf32" is not, "ieee" spills registers. 16-bit
# inputs ignore it.
_DOT_PRECISION = "tf32x3"


@triton.jit
def _kv_tile_offsets(block_tables_ptr, table_offset, pos, valid, kv_head, dims, stride_c_block, stride_c_slot,
                     stride_c_head, KV_BLOCK_SIZE: tl.constexpr):
    """Element offsets ``[len(pos), len(dims)]`` of one KV head's keys (or values)
    at token positions ``pos``, through the block table at ``table_offset``."""
    block_ids = tl.load(block_tables_ptr + table_offset + pos // KV_BLOCK_SIZE, mask=valid, other=0)
    # int64: block_id * stride overflows int32 on large caches.
    slot_offs = block_ids.to(tl.int64) * stride_c_block + (pos % KV_BLOCK_SIZE) * stride_c_slot \
        + kv_head * stride_c_head
    return slot_offs[:, None] + dims[None, :]


@triton.jit
def _online_softmax_tile(scores, m_i, l_i, acc, v, DOT_PRECISION: tl.constexpr):
    """One tile of the online softmax: masked scores (-inf where not seen)
    ``[M, N]`` and values ``[N, D]`` update the running max, sum and
    accumulator. A row that has seen nothing yet keeps m = -inf and adds 0."""
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(scores - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    # P in V's dtype, as flash-attn does: 16-bit tensor-core dots with a float32 accumulator.
    acc = tl.dot(p.to(v.dtype), v, acc=acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _paged_decode_kernel(
    out_ptr,
    partial_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
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
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SPLIT: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req)

    rows = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + rows
    dims = tl.arange(0, BLOCK_D)
    q_mask = (rows < GROUP)[:, None] & (dims < HEAD_DIM)[None, :]
    q_offs = req * stride_q_tok + heads[:, None] * stride_q_head + dims[None, :]
    q = tl.load(q_ptr + q_offs, mask=q_mask, other=0.0)

    first = 0
    if HAS_WINDOW:
        first = tl.maximum(seq_len - window, 0)
    # Split `split` of this request: absolute positions [(first // SPLIT + split) * SPLIT, + SPLIT) within
    # [first, seq_len); the cuts depend on the request alone, never on its batch.
    num_splits = (seq_len - 1) // SPLIT - first // SPLIT + 1
    if split >= num_splits:
        return
    split_lo = tl.maximum((first // SPLIT + split) * SPLIT, first)
    split_hi = tl.minimum((first // SPLIT + split + 1) * SPLIT, seq_len)
    tile_start = (split_lo // BLOCK_N) * BLOCK_N
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for start in range(tile_start, split_hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = (pos < split_hi) & (pos >= split_lo)
        kv_offs = _kv_tile_offsets(block_tables_ptr, req * stride_bt, pos, valid, kv_head, dims, stride_c_block,
                                   stride_c_slot, stride_c_head, KV_BLOCK_SIZE)
        kv_mask = valid[:, None] & (dims < HEAD_DIM)[None, :]
        k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # [BLOCK_H, BLOCK_N] fp32
        scores = tl.where(valid[None, :], scores, float("-inf"))
        v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        m_i, l_i, acc = _online_softmax_tile(scores, m_i, l_i, acc, v, DOT_PRECISION)

    if num_splits == 1:
        out = acc / l_i[:, None]
        o_offs = req * stride_o_tok + heads[:, None] * stride_o_head + dims[None, :]
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:  # this split's running max, sum and unnormalized sum: _merge_splits_kernel combines them in order
        part = partial_ptr + ((req * MAX_SPLITS + split) * (GROUP * tl.num_programs(1)) + heads) * (BLOCK_D + 2)
        h_ok = rows < GROUP
        tl.store(part, m_i, mask=h_ok)
        tl.store(part + 1, l_i, mask=h_ok)
        tl.store(part[:, None] + 2 + dims[None, :], acc, mask=h_ok[:, None])


@triton.jit
def _merge_splits_kernel(out_ptr, partial_ptr, seq_lens_ptr, window, stride_o_tok, stride_o_head, num_heads,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT: tl.constexpr,
                         MAX_SPLITS: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """One (request, query head) of a request with several splits: the splits'
    results merged in order (flash-decoding's second pass)."""
    req = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + req)
    first = 0
    if HAS_WINDOW:
        first = tl.maximum(seq_len - window, 0)
    num_splits = (seq_len - 1) // SPLIT - first // SPLIT + 1
    if num_splits > 1:
        dims = tl.arange(0, BLOCK_D)
        m = tl.full([1], float("-inf"), dtype=tl.float32)
        for s in range(0, num_splits):
            part = partial_ptr + ((req * MAX_SPLITS + s) * num_heads + head) * (BLOCK_D + 2)
            m = tl.maximum(m, tl.load(part + tl.arange(0, 1)))
        total = tl.zeros([1], dtype=tl.float32)
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for s in range(0, num_splits):
            part = partial_ptr + ((req * MAX_SPLITS + s) * num_heads + head) * (BLOCK_D + 2)
            weight = tl.exp(tl.load(part + tl.arange(0, 1)) - m)
            total += tl.load(part + 1 + tl.arange(0, 1)) * weight
            acc += tl.load(part + 2 + dims) * weight
        out = acc / total
        tl.store(out_ptr + req * stride_o_tok + head * stride_o_head + dims, out.to(out_ptr.dtype.element_ty),
                 mask=dims < HEAD_DIM)


def _launch_config(dtype: torch.dtype, block_d: int) -> tuple[int, int]:
    """(tokens per K/V tile, warps) that keep the kernel free of register spills.

    Measured with ptxas for sm80 / sm90 (registers per thread, no spills):
    16-bit 64-token tiles take 64-96 registers up to head_dim 128 on 4 warps
    and 112 at 256 on 8; float32 (tf32x3 dots) needs 32-token tiles, and 8
    warps past head_dim 64.
    """
    if dtype.itemsize == 2:
        return 64, 4 if block_d <= 128 else 8
    return 32, 4 if block_d <= 64 else 8


def check_inputs(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The shape, dtype and stride checks both kernels' launchers make; ``q`` and
    ``block_tables`` with a unit last stride."""
    _, num_heads, head_dim = q.shape
    cache_head_dim, num_kv_heads = kv_cache.shape[4], kv_cache.shape[3]
    assert cache_head_dim == head_dim and num_heads % num_kv_heads == 0, (q.shape, kv_cache.shape)
    assert q.dtype == kv_cache.dtype, (q.dtype, kv_cache.dtype)
    assert kv_cache.stride(-1) == 1 and kv_cache[0].stride() == kv_cache[1].stride()
    q = q if q.stride(-1) == 1 else q.contiguous()
    return q, block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()


def scalar_args(q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor,
                scale: float, sliding_window: Optional[int]) -> tuple:
    """The scale, window and strides both kernels take after their pointers, in their order."""
    return (float(scale), int(sliding_window or 0), q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0))


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: Optional[int] = None,
) -> torch.Tensor:
    """Attention of one query token per request over its paged K/V.

    The query of request i sits at position ``seq_lens[i] - 1`` and attends to
    positions ``0 .. seq_lens[i] - 1`` (the last ``sliding_window`` of them when
    set). Its own K/V must already be in the cache.

    Args:
        q: [B, num_heads, head_dim], last dim contiguous.
        kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim].
        block_tables: [B, max_blocks] int32.
        seq_lens: [B] int32, each >= 1.
        scale: Softmax scale.
        sliding_window: Keys per query, or None for all.

    Returns:
        [B, num_heads, head_dim] in q's dtype.
    """
    num_reqs = q.shape[0]
    q, block_tables = check_inputs(q, kv_cache, block_tables)
    assert block_tables.shape[0] == num_reqs and seq_lens.shape == (num_reqs,)
    _, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    out = torch.empty_like(q)
    if num_reqs == 0:
        return out
    group = num_heads // num_kv_heads
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    block_d = max(_MIN_DOT, triton.next_power_of_2(head_dim))
    block_n, num_warps = _launch_config(kv_cache.dtype, block_d)
    # The grid covers the most splits any request of this table width can have: a bound known on the
    # host without reading seq_lens (no sync, and fixed for a CUDA graph's buffers).
    max_splits = triton.cdiv(block_tables.shape[1] * block_size, SPLIT)
    partial = torch.empty(num_reqs * max_splits * num_heads * (block_d + 2) if max_splits > 1 else 1,
                          dtype=torch.float32, device=q.device)
    _paged_decode_kernel[(num_reqs, num_kv_heads, max_splits)](
        out,
        partial,
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        *scalar_args(q, out, k_cache, block_tables, scale, sliding_window),
        HEAD_DIM=head_dim,
        GROUP=group,
        KV_BLOCK_SIZE=block_size,
        BLOCK_D=block_d,
        BLOCK_H=max(_MIN_DOT, triton.next_power_of_2(group)),
        BLOCK_N=block_n,
        HAS_WINDOW=sliding_window is not None,
        DOT_PRECISION=_DOT_PRECISION,
        SPLIT=SPLIT,
        MAX_SPLITS=max_splits,
        num_warps=num_warps,
    )
    if max_splits > 1:
        _merge_splits_kernel[(num_reqs, num_heads)](
            out, partial, seq_lens, int(sliding_window or 0), out.stride(0), out.stride(1), num_heads,
            HEAD_DIM=head_dim, BLOCK_D=block_d, SPLIT=SPLIT, MAX_SPLITS=max_splits,
            HAS_WINDOW=sliding_window is not None)
    return out
