"""Attention over the paged KV cache with plain torch (the CPU default).

Decodes (query length 1) are batched in groups of about
``DECODE_GROUP_BYTES`` of K/V: a group's blocks are gathered into one padded tensor and one
``scaled_dot_product_attention`` call serves it, masked by each request's
length (and sliding window)::

    block_tables[g:g+G, :nb]  --gather-->  K [G, nb*block_size, Hkv, hd]
    mask[d, j] = (j < seq_len[d]) and (j >= seq_len[d] - window)

The runner orders decodes by context length, so a group's padding is small.
On CPU in float32, decodes use the native kernel of ``cpu_decode`` instead
(one pass over the paged K/V, about 2x faster), when a C compiler is there.

On a CPU with AVX-512 in float32, every prefill chunk of the step is attended
in one call of the native kernel of ``cpu_prefill`` (straight from the paged
cache, 3-4x faster than torch's SDPA there). Otherwise prefill chunks run one
request at a time: a first chunk without cached context attends to its own
keys with ``is_causal`` (no gather); a chunk with context gathers its blocks
and uses an explicit causal mask offset by the context length.

Layers with soft-capped scores (Gemma 2): decodes on the native decode kernel,
which caps scores (``cpu_decode``), prefill chunks (and every row where the
kernel is off) in ``softcap.py``: plain torch, one request at a time (neither
SDPA nor the prefill kernel caps scores). With ``batch_invariant`` every row,
capped or not, goes through the per-query decode kernel (``_per_query``).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from cluster.shared.sizes import cdiv
from workers.model.attention import cpu_decode, cpu_prefill, kv_int8
from workers.model.attention.base import AttentionMetadata, write_kv
from workers.model.attention.softcap import softcap_attention

# Gathered K/V bytes per decode group (one SDPA call each); fits in L2/L3.
DECODE_GROUP_BYTES = 4 << 20


class TorchAttentionBackend:
    """Paged attention with ``torch.nn.functional.scaled_dot_product_attention``.

    Args:
        native_decode: Serve float32 CPU decodes with the native kernel of
            ``cpu_decode`` (built on first use; the torch path when it cannot
            be built).
        native_prefill: Serve float32 CPU prefill chunks with the native
            kernel of ``cpu_prefill`` (AVX-512 only; the torch path
            otherwise). Defaults to ``native_decode``.
    """

    name = "torch"

    def __init__(self, native_decode: bool = True, batch_invariant: bool = False,
                 native_prefill: Optional[bool] = None) -> None:
        self._native_decode = native_decode or batch_invariant
        self._native_prefill = native_decode if native_prefill is None else native_prefill
        self._prefill_layouts: dict[tuple, object] = {}  # layout -> the prefill kernel, or None
        self.batch_invariant = batch_invariant
        self._native_lib = None  # the kernel for the cache dtype last seen (one per model)
        self._native_libs: dict[torch.dtype, object] = {}
        self._native_layouts: dict[tuple, bool] = {}

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: Optional[int] = None,
        softcap: Optional[float] = None,
    ) -> torch.Tensor:
        nd = meta.num_decodes
        if self.batch_invariant:  # every row on the per-query kernel, which caps soft-capped scores too
            return self._per_query(q, k, v, kv_cache, meta, scale, sliding_window, softcap)
        if softcap is not None:  # decodes on the native kernel, which caps; prefill chunks in softcap.py
            if self._native_decode and self._native_ready(q, k, v, kv_cache) and nd == meta.num_requests:
                return cpu_decode.paged_decode(self._native_lib, q, kv_cache, meta.block_tables, meta.seq_lens,
                                               scale, sliding_window, new_kv=(k, v, meta.slot_mapping),
                                               tails=meta.tree_tails, softcap=softcap)
            native = self._native_decode and nd > 0 and self._native_ready(q, None, None, kv_cache)
            return softcap_attention(q, k, v, kv_cache, meta, scale, sliding_window, softcap,
                                     decode_lib=self._native_lib if native else None)
        if nd == meta.num_requests and self._native_decode and self._native_ready(q, k, v, kv_cache):
            # A decode-only step: the new K/V are written and attended in one native call.
            return cpu_decode.paged_decode(self._native_lib, q, kv_cache, meta.block_tables, meta.seq_lens, scale,
                                           sliding_window, new_kv=(k, v, meta.slot_mapping), tails=meta.tree_tails)
        write_kv(k, v, kv_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self._decode(q[:nd], kv_cache, meta, scale, sliding_window)
        prefill_lib = self._prefill_kernel(q, kv_cache)
        if prefill_lib is not None:  # every prefill chunk of the step in one call
            cpu_prefill.paged_prefill(prefill_lib, q, kv_cache, meta.block_tables, meta.query_start_loc,
                                      meta.seq_lens, scale, sliding_window, out, (nd, meta.num_requests))
            return out
        start = nd  # decodes occupy the first nd tokens
        for i in range(nd, meta.num_requests):
            qlen = meta.query_lens_list[i]
            out[start : start + qlen] = self._prefill_one(
                q[start : start + qlen],
                k[start : start + qlen],
                v[start : start + qlen],
                kv_cache,
                meta.block_tables[i],
                meta.seq_lens_list[i],
                scale,
                sliding_window,
            )
            start += qlen
        return out

    def _per_query(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                   meta: AttentionMetadata, scale: float, sliding_window: Optional[int],
                   softcap: Optional[float] = None) -> torch.Tensor:
        """Every query token as its own decode: token t of request i attends
        positions [.., pos_t] through the decode kernel, so a token's result is
        the same whether it came in a prefill chunk (of any size) or a decode.
        The kernel caps soft-capped scores (``softcap``, Gemma 2) itself."""
        if not self._native_ready(q, None, None, kv_cache):
            raise ValueError("batch_invariant attention needs the native CPU kernel and a float32 cache")
        write_kv(k, v, kv_cache, meta.slot_mapping)
        if meta.max_query_len == 1:
            return cpu_decode.paged_decode(self._native_lib, q, kv_cache, meta.block_tables, meta.seq_lens, scale,
                                           sliding_window, tails=meta.tree_tails, softcap=softcap)
        owner = torch.repeat_interleave(torch.arange(meta.num_requests), torch.tensor(meta.query_lens_list))
        positions = torch.cat([torch.arange(s - n, s) for s, n in zip(meta.seq_lens_list, meta.query_lens_list)])
        tables = meta.block_tables.index_select(0, owner)
        tails = None
        if meta.tree_tails is not None:  # tree rows are decodes: one token each, their row's tail
            tails = (meta.tree_tails[0].index_select(0, owner).contiguous(),
                     meta.tree_tails[1].index_select(0, owner).contiguous())
        return cpu_decode.paged_decode(self._native_lib, q, kv_cache, tables, (positions + 1).to(torch.int32),
                                       scale, sliding_window, tails=tails, softcap=softcap)

    def _prefill_kernel(self, q: torch.Tensor, kv_cache: torch.Tensor) -> Optional[object]:
        """The native prefill kernel when it serves this layout (kept per layout), else None."""
        if not self._native_prefill:
            return None
        key = (q.shape[1:], q.stride()[1:], q.dtype, q.device, kv_cache.shape[2:], kv_cache.dtype)
        if key not in self._prefill_layouts:
            ok = cpu_prefill.supports(q, kv_cache)
            self._prefill_layouts[key] = cpu_prefill.load() if ok else None
        return self._prefill_layouts[key]

    def _native_ready(self, q: torch.Tensor, k: Optional[torch.Tensor], v: Optional[torch.Tensor],
                      kv_cache: torch.Tensor) -> bool:
        """Whether the native kernel serves this call (built, and the layout fits).
        Every layer of a model calls with the same layout: the answer is kept."""
        key = (q.shape[1:], q.stride()[1:], q.dtype, kv_cache.shape[2:], kv_cache.dtype,
               None if k is None else (k.stride()[1:], v.stride()[1:], k.dtype))
        ready = self._native_layouts.get(key)
        if ready is None:
            ready = cpu_decode.supports(q, kv_cache) and kv_cache.is_contiguous()
            if k is not None:
                ready = ready and all(t.stride(2) == 1 and t.stride(1) == t.shape[2] and t.dtype == torch.float32
                                      for t in (k, v))
            if ready and kv_cache.dtype not in self._native_libs:
                self._native_libs[kv_cache.dtype] = cpu_decode.load(kv_cache.dtype)
            ready = ready and self._native_libs.get(kv_cache.dtype) is not None
            self._native_layouts[key] = ready
        if ready:
            self._native_lib = self._native_libs[kv_cache.dtype]
        return ready

    def _decode(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: Optional[int],
    ) -> torch.Tensor:
        # Groups sized so a group's gathered K/V (about DECODE_GROUP_BYTES)
        # stays in the CPU cache between the gather and the attention: 2-3x
        # faster than one big gather. Each group is padded to its longest
        # context; the runner orders decodes longest first, so padding is small.
        nd = q.shape[0]
        tails = meta.tree_tails
        if self._native_decode and self._native_ready(q, None, None, kv_cache):
            if tails is not None:
                tails = (tails[0][:nd].contiguous(), tails[1][:nd].contiguous())
            return cpu_decode.paged_decode(
                self._native_lib, q, kv_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale, sliding_window,
                tails=tails)
        if tails is not None:
            return self._decode_tree_rows(q, kv_cache, meta, scale, sliding_window)
        row_bytes = 2 * kv_cache.shape[3] * kv_cache.shape[4] * 4  # gathered as float32
        out = torch.empty_like(q)
        start = 0
        while start < nd:
            per_seq = meta.seq_lens_list[start] * row_bytes
            end = min(nd, start + max(1, DECODE_GROUP_BYTES // per_seq))
            out[start:end] = self._decode_group(q[start:end], kv_cache, meta, start, end, scale, sliding_window)
            start = end
        return out

    @staticmethod
    def _decode_tree_rows(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                          sliding_window: Optional[int]) -> torch.Tensor:
        """Decodes one at a time, each over the slots of its positions: through
        its block table, and from ``tail_lo`` on (a tree row) its listed slots."""
        block_size = kv_cache.shape[2]
        flat = kv_cache.flatten(1, 2)  # [2, slots, Hkv, hd]
        tail_lo, tail_slots = meta.tree_tails
        out = torch.empty_like(q)
        for i in range(q.shape[0]):
            length = meta.seq_lens_list[i]
            pos = torch.arange(length)
            slots = meta.block_tables[i].long()[pos // block_size] * block_size + pos % block_size
            lo = int(tail_lo[i])
            if 0 <= lo < length:
                slots[lo:] = tail_slots[i, : length - lo]
            if sliding_window is not None:
                slots = slots[max(0, length - sliding_window):]
            keys, values = flat[0].index_select(0, slots), flat[1].index_select(0, slots)
            if kv_cache.dtype == torch.int8:
                keys, values = kv_int8.dequantize(keys), kv_int8.dequantize(values)
            out[i] = F.scaled_dot_product_attention(
                q[i].unsqueeze(1), keys.transpose(0, 1), values.transpose(0, 1), scale=scale, enable_gqa=True
            ).squeeze(1)
        return out

    @staticmethod
    def _decode_group(
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        start: int,
        end: int,
        scale: float,
        sliding_window: Optional[int],
    ) -> torch.Tensor:
        n = end - start
        block_size = kv_cache.shape[2]
        max_len = max(meta.seq_lens_list[start:end])
        num_blocks = cdiv(max_len, block_size)
        ids = meta.block_tables[start:end, :num_blocks].flatten()
        # [n*nb, bs, Hkv, hd] -> [n, Hkv, L, hd]; index_select is ~2.5x
        # faster than advanced indexing here.
        keys = _gather(kv_cache, 0, ids)
        shape = (n, num_blocks * block_size) + tuple(keys.shape[2:])
        keys = keys.view(shape).transpose(1, 2)
        values = _gather(kv_cache, 1, ids).view(shape).transpose(1, 2)
        pos = torch.arange(num_blocks * block_size, device=q.device)
        lens = meta.seq_lens[start:end].to(pos.dtype).unsqueeze(1)
        mask = pos.unsqueeze(0) < lens
        if sliding_window is not None:
            mask &= pos.unsqueeze(0) >= lens - sliding_window
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2),  # [n, Hq, 1, hd]
            keys,
            values,
            attn_mask=mask[:, None, None, :],
            scale=scale,
            enable_gqa=True,
        )
        return out.squeeze(2)

    @staticmethod
    def _prefill_one(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_len: int,
        scale: float,
        sliding_window: Optional[int],
    ) -> torch.Tensor:
        qlen = q.shape[0]
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, qlen, hd]
        if qlen == seq_len and (sliding_window is None or sliding_window >= seq_len):
            out = F.scaled_dot_product_attention(
                qh,
                k.transpose(0, 1).unsqueeze(0),
                v.transpose(0, 1).unsqueeze(0),
                is_causal=True,
                scale=scale,
                enable_gqa=True,
            )
            return out.squeeze(0).transpose(0, 1)
        block_size = kv_cache.shape[2]
        num_blocks = cdiv(seq_len, block_size)
        ids = block_table[:num_blocks]
        keys = _gather(kv_cache, 0, ids).flatten(0, 1)[:seq_len].transpose(0, 1).unsqueeze(0)
        values = _gather(kv_cache, 1, ids).flatten(0, 1)[:seq_len].transpose(0, 1).unsqueeze(0)
        q_pos = torch.arange(seq_len - qlen, seq_len, device=q.device).unsqueeze(1)
        k_pos = torch.arange(seq_len, device=q.device).unsqueeze(0)
        mask = k_pos <= q_pos
        if sliding_window is not None:
            mask &= k_pos > q_pos - sliding_window
        out = F.scaled_dot_product_attention(
            qh, keys, values, attn_mask=mask, scale=scale, enable_gqa=True
        )
        return out.squeeze(0).transpose(0, 1)


def _gather(kv_cache: torch.Tensor, which: int, ids: torch.Tensor) -> torch.Tensor:
    """Blocks ``ids`` of the keys (0) or values (1): ``[len(ids), block_size, Hkv, hd]``, dequantized
    from an int8 cache."""
    blocks = kv_cache[which].index_select(0, ids)
    return kv_int8.dequantize(blocks) if kv_cache.dtype == torch.int8 else blocks
