"""Attention backend on Triton kernels over the paged cache, any block size.

Requests with query length 1 (decodes) go to the decode kernel in
``triton_decode.py``; prefill chunks (with or without a cached prefix) to the
varlen kernel in ``triton_prefill.py``, one launch for all of them. The
runner orders decodes first (``meta.num_decodes``), so a mixed batch splits
into two contiguous parts::

    requests  [0, num_decodes)          [num_decodes, B)
    tokens    [0, num_decodes)          [num_decodes, T)
              Triton decode kernel      Triton prefill kernel (own sub-metadata)

A batch whose every query has length 1 is all decodes, whatever
``num_decodes`` says. Neither triton nor the torch backend is imported until
first use, so this module imports on machines without triton.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch

from workers.model.attention.base import AttentionBackend, AttentionMetadata, write_kv


def triton_runs_on(device: torch.device) -> bool:
    """Whether Triton kernels can run on ``device`` here.

    CUDA (and ROCm, which torch also calls ``cuda``) compiles kernels; any
    other device needs the interpreter (``TRITON_INTERPRET=1``, tests only).
    """
    return torch.device(device).type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


class TritonAttentionBackend:
    """Triton decode and prefill kernels.

    Args:
        fallback: A backend to run prefill chunks instead of the Triton
            prefill kernel (tests); None uses the kernel.
    """

    name = "triton"

    def __init__(self, fallback: Optional[AttentionBackend] = None) -> None:
        self._fallback = fallback
        self._decode_fn: Any = None
        self._prefill_fn: Any = None

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
            raise ValueError("attention soft-capping (Gemma 2) needs attention_backend 'torch', not 'triton'")
        if meta.tree_tails is not None:
            raise NotImplementedError("tree verification (speculative_config num_candidates > 1) runs on the "
                                      "torch attention backend")
        num_reqs = meta.num_requests
        num_decodes = num_reqs if meta.max_query_len == 1 else meta.num_decodes
        if num_decodes == 0:
            return self._prefill(q, k, v, kv_cache, meta, scale, sliding_window)
        assert all(n == 1 for n in meta.query_lens_list[:num_decodes]), "decodes must come first"
        if num_decodes == num_reqs:
            write_kv(k, v, kv_cache, meta.slot_mapping)
            return self._decode(q, kv_cache, meta.block_tables, meta.seq_lens, scale, sliding_window)
        nd = num_decodes  # decodes hold one token each: tokens [0, nd)
        out = torch.empty_like(q)
        write_kv(k[:nd], v[:nd], kv_cache, meta.slot_mapping[:nd])
        out[:nd] = self._decode(q[:nd], kv_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale, sliding_window)
        out[nd:] = self._prefill(q[nd:], k[nd:], v[nd:], kv_cache, prefill_metadata(meta, nd), scale, sliding_window)
        return out

    def _decode(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        sliding_window: Optional[int],
    ) -> torch.Tensor:
        if self._decode_fn is None:
            self._decode_fn = _import_kernel(q.device, "triton_decode", "paged_decode_attention")
        return self._decode_fn(q, kv_cache, block_tables, seq_lens, scale, sliding_window)

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 meta: AttentionMetadata, scale: float, sliding_window: Optional[int]) -> torch.Tensor:
        """Chunks of several tokens: their K/V into the cache, then one launch for all."""
        if self._fallback is not None:
            return self._fallback.forward(q, k, v, kv_cache, meta, scale, sliding_window)
        if self._prefill_fn is None:
            self._prefill_fn = _import_kernel(q.device, "triton_prefill", "paged_prefill_attention")
        write_kv(k, v, kv_cache, meta.slot_mapping)
        return self._prefill_fn(q, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                meta.max_query_len, scale, sliding_window)


def _import_kernel(device: torch.device, module: str, name: str) -> Any:
    """A kernel entry point of ``workers.model.attention.<module>``, with the errors a user can act on."""
    if not triton_runs_on(device):
        raise ValueError(
            f"the triton attention backend needs a CUDA device, got {device}; "
            "use attention_backend='torch' on CPU (or TRITON_INTERPRET=1 in tests)"
        )
    try:
        import importlib

        return getattr(importlib.import_module(f"workers.model.attention.{module}"), name)
    except ImportError as exc:
        raise ImportError("the triton attention backend needs the 'triton' package (pip install triton)") from exc


def prefill_metadata(meta: AttentionMetadata, num_decodes: int) -> AttentionMetadata:
    """Metadata of the requests after the first ``num_decodes`` (one token each).

    Args:
        meta: The whole batch's metadata, decodes first.
        num_decodes: Requests (and tokens) to drop from the front.

    Returns:
        Metadata for requests ``[num_decodes, B)`` with token offsets rebased to 0.
    """
    nd = num_decodes
    seq_lens_list = meta.seq_lens_list[nd:]
    query_lens_list = meta.query_lens_list[nd:]
    return AttentionMetadata(
        slot_mapping=meta.slot_mapping[nd:],
        query_start_loc=meta.query_start_loc[nd:] - nd,
        seq_lens=meta.seq_lens[nd:],
        block_tables=meta.block_tables[nd:],
        query_lens_list=query_lens_list,
        seq_lens_list=seq_lens_list,
        max_query_len=max(query_lens_list),
        max_seq_len=max(seq_lens_list),
        num_decodes=0,
    )
