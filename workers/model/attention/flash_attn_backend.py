"""Attention backend on flash-attn 2's paged KV cache (CUDA only).

Our cache layout ``kv[0|1]: [num_blocks, block_size, num_kv_heads, head_dim]``
is flash-attn's paged ``k_cache`` / ``v_cache`` layout, so the tensors go in as
they are, with ``meta.block_tables`` as ``block_table``:

* decode-only batch (every query length 1): ``flash_attn_with_kvcache`` with
  ``cache_seqlens = seq_lens`` (the new K/V are already written);
* anything else: one ``flash_attn_varlen_func`` call over the whole batch with
  ``block_table`` (vLLM style): ``cu_seqlens_q = query_start_loc``,
  ``cu_seqlens_k = [0, cumsum(seq_lens)]``, ``causal=True``. flash-attn aligns
  the causal mask bottom-right, which is exactly "a chunk's queries are the last
  query_len positions of its sequence".

A sliding window of W keys (the query's own position included) is flash-attn's
``window_size=(W - 1, 0)``: query i sees keys ``[i - (W - 1), i]``.

Limits of upstream flash-attn 2 (checked up front, with a message that says
what to change): CUDA, float16/bfloat16, head_dim a multiple of 8 and <= 256,
and a paged-KV ``block_size`` that is a multiple of 256 (``flash_api.cpp``:
"Paged KV cache block size must be divisible by 256"; only vLLM's fork of
flash-attn accepts 16). ``flash_attn_varlen_func(block_table=...)`` needs
flash-attn >= 2.6.
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch
import torch.nn.functional as F

from workers.model.attention.base import AttentionMetadata, write_kv

_INSTALL_HINT = "pip install 'prefixserve[gpu]' (flash-attn >= 2.6, CUDA only)"
_DTYPES = (torch.float16, torch.bfloat16)
_PAGE_MULTIPLE = 256
_MAX_HEAD_DIM = 256


def check_flash_attn_config(dtype: Optional[torch.dtype], block_size: Optional[int]) -> None:
    """Raises ValueError when flash-attn cannot serve this dtype or block size.

    Args:
        dtype: Compute / KV dtype, or None when not known yet.
        block_size: KV block size, or None when not known yet.
    """
    if dtype is not None and dtype not in _DTYPES:
        raise ValueError(
            f"attention_backend='flash_attn' supports float16 and bfloat16, got {dtype}; "
            "use dtype='bfloat16', or attention_backend='triton' / 'torch' for float32"
        )
    if block_size is not None and block_size % _PAGE_MULTIPLE:
        raise ValueError(
            f"attention_backend='flash_attn' needs block_size to be a multiple of {_PAGE_MULTIPLE} "
            f"(flash-attn's paged KV cache), got {block_size}; set block_size={_PAGE_MULTIPLE} "
            "or use attention_backend='triton' / 'torch'"
        )


class FlashAttnBackend:
    """flash-attn 2 over the paged KV cache.

    Args:
        dtype: Compute dtype, when known, checked now rather than at the first
            forward.
        block_size: KV block size, when known, likewise.

    Raises:
        ImportError: flash-attn is missing or too old (names the ``gpu`` extra).
        ValueError: ``dtype`` or ``block_size`` that flash-attn cannot serve.
    """

    name = "flash_attn"

    def __init__(self, dtype: Optional[torch.dtype] = None, block_size: Optional[int] = None) -> None:
        try:
            from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
        except ImportError as exc:
            raise ImportError(f"attention_backend='flash_attn' needs flash-attn: {_INSTALL_HINT}") from exc
        if "block_table" not in inspect.signature(flash_attn_varlen_func).parameters:
            raise ImportError(
                f"the installed flash-attn has no paged varlen attention (block_table); {_INSTALL_HINT}"
            )
        check_flash_attn_config(dtype, block_size)
        self._varlen = flash_attn_varlen_func
        self._with_kvcache = flash_attn_with_kvcache
        # cu_seqlens_k of the last metadata seen: every layer of a step shares
        # one AttentionMetadata, so this is computed once per step.
        self._cu_seqlens_k_meta: Optional[AttentionMetadata] = None
        self._cu_seqlens_k: Optional[torch.Tensor] = None

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
        """Writes k/v into the cache at ``meta.slot_mapping``, then attends.

        Args and return as in ``AttentionBackend.forward``.
        """
        if softcap is not None:
            raise ValueError("attention soft-capping (Gemma 2) needs attention_backend 'torch', not 'flash_attn'")
        if meta.tree_tails is not None:
            raise NotImplementedError("tree verification (speculative_config num_candidates > 1) runs on the "
                                      "torch attention backend")
        self._check_inputs(q, kv_cache)
        write_kv(k, v, kv_cache, meta.slot_mapping)
        window = (-1, -1) if sliding_window is None else (sliding_window - 1, 0)
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        if meta.max_query_len == 1:
            out = self._with_kvcache(
                q.unsqueeze(1),  # [B, 1, Hq, hd]
                k_cache,
                v_cache,
                cache_seqlens=meta.seq_lens,
                block_table=meta.block_tables,
                softmax_scale=scale,
                causal=True,
                window_size=window,
            )
            return out.squeeze(1)
        return self._varlen(
            q,
            k_cache,
            v_cache,
            cu_seqlens_q=meta.query_start_loc,
            cu_seqlens_k=self._cu_seqlens_k_of(meta),
            max_seqlen_q=meta.max_query_len,
            max_seqlen_k=meta.max_seq_len,
            softmax_scale=scale,
            causal=True,
            window_size=window,
            block_table=meta.block_tables,
        )

    @staticmethod
    def _check_inputs(q: torch.Tensor, kv_cache: torch.Tensor) -> None:
        check_flash_attn_config(q.dtype, kv_cache.shape[2])
        head_dim = q.shape[-1]
        if head_dim % 8 or head_dim > _MAX_HEAD_DIM:
            # flash-attn would pad q and the whole cache to a multiple of 8 on
            # every call; refuse instead.
            raise ValueError(
                f"attention_backend='flash_attn' needs head_dim a multiple of 8 and <= {_MAX_HEAD_DIM}, "
                f"got {head_dim}; use attention_backend='triton' or 'torch'"
            )
        assert kv_cache.dtype == q.dtype and kv_cache.is_cuda, (kv_cache.dtype, q.dtype, kv_cache.device)

    def _cu_seqlens_k_of(self, meta: AttentionMetadata) -> torch.Tensor:
        if self._cu_seqlens_k_meta is not meta:
            cumsum = torch.cumsum(meta.seq_lens, dim=0, dtype=torch.int32)
            self._cu_seqlens_k = F.pad(cumsum, (1, 0))
            self._cu_seqlens_k_meta = meta
        assert self._cu_seqlens_k is not None
        return self._cu_seqlens_k
