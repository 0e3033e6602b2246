"""The KV cache's memory: the element type and row width of a cache block,
what one block costs across the layers, and zero-filled tensors whose pages
are committed only when written (so a replica's RSS grows with the blocks
it uses), or all at once (``prefault``). The layout itself is in ``workers/model/attention/base.py``."""

from __future__ import annotations

import logging
import time

import torch

from workers.model.attention import kv_int8

logger = logging.getLogger(__name__)


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros whose CPU pages are committed only when first written.

    ``torch.zeros`` on CPU writes every byte up front: gigabytes of KV cache
    cost seconds at start-up and show as resident memory before any request.
    NumPy's ``zeros`` uses ``calloc``, which maps untouched pages to the
    shared zero page, so a replica's RSS grows with the blocks it uses.
    """
    import numpy as np

    np_dtypes = {torch.float32: np.float32, torch.float16: np.float16, torch.int8: np.int8}
    if device.type != "cpu" or dtype not in np_dtypes:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.from_numpy(np.zeros(shape, dtype=np_dtypes[dtype]))


PAGE_BYTES = 4096


def prefault(tensors: list[torch.Tensor]) -> None:
    """Commits every page of contiguous zero-filled CPU ``tensors`` now (``lazy_zeros``' memory, for
    ``CacheConfig.kv_cache_prefault``): a zero byte written into each page, so they still read as zeros."""
    began, total = time.perf_counter(), 0
    for tensor in tensors:
        if tensor.device.type != "cpu" or tensor.numel() == 0:
            continue
        if not tensor.is_contiguous():
            raise ValueError("prefault needs a contiguous tensor")
        tensor.view(-1).view(torch.uint8)[::PAGE_BYTES].zero_()
        total += tensor.numel() * tensor.element_size()
    if total:
        logger.info("KV cache committed: %.0f MiB in %.2f s", total / 2**20, time.perf_counter() - began)


def kv_layout(head_dim: int, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> tuple[torch.dtype, int]:
    """``(element dtype, elements per (token, head) row)`` of the KV cache: the
    model's dtype and ``head_dim``, or int8 rows of ``head_dim`` values and their
    scale (``kv_cache_dtype="int8"``, ``attention/kv_int8.py``)."""
    if kv_cache_dtype == "int8":
        return torch.int8, kv_int8.row_width(head_dim)
    return dtype, head_dim


def kv_block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                   kv_cache_dtype: str = "auto") -> int:
    """Bytes one KV block takes across all layers (keys and values)."""
    elem_dtype, row = kv_layout(head_dim, dtype, kv_cache_dtype)
    elem = torch.tensor([], dtype=elem_dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * row * elem
