"""Paged attention with soft-capped scores (Gemma 2), in plain torch.

Neither ``scaled_dot_product_attention`` nor the native prefill kernel
(``cpu_prefill``) can cap scores between the product and the softmax, so
soft-capped prefill chunks take this path of the torch backend: one request
at a time, its context gathered by slot, then transformers' eager order of
operations. Decode rows go to the native decode kernel (``cpu_decode``, which
caps) when the backend hands one over (``decode_lib``), else here a group at
a time (padded and masked)::

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

from workers.model.attention import cpu_decode, kv_int8
from workers.model.attention.base import AttentionMetadata, write_kv

# Scores of one chunk of query rows ([Hq, rows, L] float32) stay below this.
SCORE_BYTES = 64 << 20
# Gathered K/V bytes of one group of decodes (as the torch backend's groups: they stay in the CPU cache).
DECODE_GROUP_BYTES = 4 << 20


def softcap_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                      meta: AttentionMetadata, scale: float, sliding_window: Optional[int],
                      softcap: float, decode_lib: Optional[object] = None) -> torch.Tensor:
    """Writes k/v into the cache at ``meta.slot_mapping``, then attends every
    request's rows over its context with capped scores (``AttentionBackend.forward``);
    with ``decode_lib`` (``cpu_decode.load()``'s) the decode rows on that kernel."""
    write_kv(k, v, kv_cache, meta.slot_mapping)
    block_size = kv_cache.shape[2]
    flat = kv_cache.flatten(1, 2)  # [2, slots, Hkv, hd]
    out = torch.empty_like(q)
    start = 0
    nd = meta.num_decodes
    if decode_lib is not None and nd:  # the decode kernel caps too; tree rows read their tails there
        tails = meta.tree_tails
        if tails is not None:
            tails = (tails[0][:nd].contiguous(), tails[1][:nd].contiguous())
        out[:nd] = cpu_decode.paged_decode(decode_lib, q[:nd], kv_cache, meta.block_tables[:nd],
                                           meta.seq_lens[:nd], scale, sliding_window, tails=tails, softcap=softcap)
        start = nd
    elif meta.tree_tails is None and nd:  # plain decodes, in groups (the torch backend's layout)
        start = nd
        out[:start] = _decodes(q[:start], kv_cache, meta, scale, sliding_window, softcap)
    for i in range(start, meta.num_requests):
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


def _decodes(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
             sliding_window: Optional[int], softcap: float) -> torch.Tensor:
    """Decode rows ``q [nd, Hq, hd]`` (one per request, longest context first), a group of requests per
    call: their blocks gathered and padded to the group's longest context, masked past each one's length."""
    nd, num_heads, head_dim = q.shape
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    out = torch.empty_like(q)
    start = 0
    while start < nd:
        per_seq = 2 * 4 * meta.seq_lens_list[start] * num_kv_heads * head_dim
        end = min(nd, start + max(1, DECODE_GROUP_BYTES // per_seq))
        n, num_blocks = end - start, -(-max(meta.seq_lens_list[start:end]) // block_size)
        kv = kv_cache.index_select(1, meta.block_tables[start:end, :num_blocks].flatten())
        if kv.dtype == torch.int8:
            kv = kv_int8.dequantize(kv)
        kv = kv.to(q.dtype).view(2, n, num_blocks * block_size, num_kv_heads, head_dim).transpose(2, 3)
        qg = q[start:end].view(n, num_kv_heads, num_heads // num_kv_heads, head_dim)  # query heads by KV head
        scores = torch.matmul(qg, kv[0].transpose(2, 3)) * scale  # [n, Hkv, group, L]
        scores = torch.tanh(scores / softcap) * softcap
        pos = torch.arange(num_blocks * block_size, device=q.device).unsqueeze(0)
        lens = meta.seq_lens[start:end].to(pos.dtype).unsqueeze(1)
        mask = pos < lens
        if sliding_window is not None:
            mask &= pos >= lens - sliding_window
        scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out[start:end] = torch.matmul(probs, kv[1]).view(n, num_heads, head_dim)
        start = end
    return out


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seq_len: int, scale: float,
            sliding_window: Optional[int], softcap: float) -> torch.Tensor:
    """Rows ``q [n, Hq, hd]`` at positions ``seq_len - n ..`` over ``keys, values [L, Hkv, hd]``."""
    qlen, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[1]
    group = num_heads // num_kv_heads
    kh, vh = keys.transpose(0, 1), values.transpose(0, 1)  # [Hkv, L, hd]
    rows = max(1, SCORE_BYTES // (4 * num_heads * seq_len))
    k_pos = torch.arange(seq_len, device=q.device).unsqueeze(0)
    out = torch.empty_like(q)
    for r0 in range(0, qlen, rows):
        r1 = min(qlen, r0 + rows)
        # [n, Hq, hd] -> [Hkv, group * n, hd]: each KV head's query heads, no copy of the keys per query head
        qg = q[r0:r1].reshape(r1 - r0, num_kv_heads, group * head_dim).transpose(0, 1)
        qg = qg.reshape(num_kv_heads, r1 - r0, group, head_dim).transpose(1, 2).reshape(num_kv_heads, -1, head_dim)
        scores = torch.matmul(qg, kh.transpose(1, 2)) * scale  # [Hkv, group * n, L]
        scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(seq_len - qlen + r0, seq_len - qlen + r1, device=q.device).unsqueeze(1)
        mask = k_pos <= q_pos
        if sliding_window is not None:
            mask &= k_pos > q_pos - sliding_window
        scores = scores.view(num_kv_heads, group, r1 - r0, seq_len).masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        res = torch.matmul(probs.view(num_kv_heads, -1, seq_len), vh)  # [Hkv, group * n, hd]
        out[r0:r1] = res.view(num_kv_heads, group, r1 - r0, head_dim).permute(2, 0, 1, 3).reshape(
            r1 - r0, num_heads, head_dim)
    return out
