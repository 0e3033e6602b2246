"""Paged attention with soft-capped scores (Gemma 2), in plain torch.

Neither ``scaled_dot_product_attention`` nor our native kernels (``cpu_decode``,
``cpu_prefill``) can cap scores between the product and the softmax, so
soft-capped layers take this path of the torch backend: one request at a
time, its context gathered by slot, then transformers' eager order of
operations::

    s = (q @ k^T) * scale                       [Hq, q rows, L]
    s = tanh(s / cap) * cap                      before the mask, as transformers
    s[j > pos_q or j <= pos_q - window] = -inf   causal (+ sliding window)
    out = softmax(s, float32) @ v

A decode row of a tree verification (``meta.tree_tails``) reads its
positions from ``tail_lo`` on at its listed slots, as the torch backend's
tree path does. Query rows go in chunks so the scores of a long prefill
stay within ``SCORE_BYTES``.
"""

from __future__ import annotations

from typing import Optional

import torch

from workers.model.attention import kv_int8
from workers.model.attention.base import AttentionMetadata, write_kv

# Scores of one chunk of query rows ([Hq, rows, L] float32) stay below this.
SCORE_BYTES = 64 << 20


def softcap_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                      meta: AttentionMetadata, scale: float, sliding_window: Optional[int],
                      softcap: float) -> torch.Tensor:
    """Writes k/v into the cache at ``meta.slot_mapping``, then attends every
    request's rows over its context with capped scores (``AttentionBackend.forward``)."""
    write_kv(k, v, kv_cache, meta.slot_mapping)
    block_size = kv_cache.shape[2]
    flat = kv_cache.flatten(1, 2)  # [2, slots, Hkv, hd]
    out = torch.empty_like(q)
    start = 0
    for i in range(meta.num_requests):
        qlen, seq_len = meta.query_lens_list[i], meta.seq_lens_list[i]
        pos = torch.arange(seq_len, device=q.device)
        slots = meta.block_tables[i].long()[pos // block_size] * block_size + pos % block_size
        if meta.tree_tails is not None:
            lo = int(meta.tree_tails[0][i])
            if 0 <= lo < seq_len:
                slots[lo:] = meta.tree_tails[1][i, : seq_len - lo]
        keys, values = flat[0].index_select(0, slots), flat[1].index_select(0, slots)
        if kv_cache.dtype == torch.int8:
            keys, values = kv_int8.dequantize(keys), kv_int8.dequantize(values)
        out[start : start + qlen] = _attend(q[start : start + qlen], keys.to(q.dtype), values.to(q.dtype),
                                            seq_len, scale, sliding_window, softcap)
        start += qlen
    return out


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seq_len: int, scale: float,
            sliding_window: Optional[int], softcap: float) -> torch.Tensor:
    """Rows ``q [n, Hq, hd]`` at positions ``seq_len - n ..`` over ``keys, values [L, Hkv, hd]``."""
    qlen, num_heads = q.shape[0], q.shape[1]
    group = num_heads // keys.shape[1]
    kh = keys.transpose(0, 1).repeat_interleave(group, 0)  # [Hq, L, hd]
    vh = values.transpose(0, 1).repeat_interleave(group, 0)
    qh = q.transpose(0, 1)  # [Hq, n, hd]
    rows = max(1, SCORE_BYTES // (4 * num_heads * seq_len))
    k_pos = torch.arange(seq_len, device=q.device).unsqueeze(0)
    out = torch.empty_like(qh)
    for r0 in range(0, qlen, rows):
        r1 = min(qlen, r0 + rows)
        scores = torch.matmul(qh[:, r0:r1], kh.transpose(1, 2)) * scale
        scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(seq_len - qlen + r0, seq_len - qlen + r1, device=q.device).unsqueeze(1)
        mask = k_pos <= q_pos
        if sliding_window is not None:
            mask &= k_pos > q_pos - sliding_window
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out[:, r0:r1] = torch.matmul(probs, vh)
    return out.transpose(0, 1)
