"""Attention backends over the paged KV cache, chosen by name::

    torch       scaled_dot_product_attention; any device, any dtype (CPU default)
    triton      Triton decode kernel + torch for prefill chunks (CUDA)
    flash_attn  flash-attn 2 over the paged cache (CUDA, fp16/bf16,
                block_size a multiple of 256)
    auto        flash_attn when it can serve this device, dtype and block
                size, else torch

Backends import their heavy dependencies (triton, flash_attn) only when built,
so this package imports anywhere.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Optional, Union

import torch

from cluster.shared.config import ATTENTION_BACKENDS
from workers.model.attention.base import AttentionBackend, AttentionMetadata, write_kv

__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "AttentionMetadata", "get_attention_backend", "write_kv"]

logger = logging.getLogger(__name__)


def get_attention_backend(
    name: str,
    device: Union[str, torch.device],
    *,
    dtype: Optional[torch.dtype] = None,
    block_size: Optional[int] = None,
    batch_invariant: bool = False,
) -> AttentionBackend:
    """Builds the attention backend called ``name`` for ``device``.

    Args:
        name: One of ``auto``, ``torch``, ``triton``, ``flash_attn``.
        device: Device the model runs on.
        dtype: Compute / KV-cache dtype, when known; lets ``auto`` skip
            flash-attn for float32 and ``flash_attn`` fail early.
        block_size: KV block size, when known; flash-attn's paged KV needs a
            multiple of 256, checked here rather than at the first forward.
        batch_invariant: Every query through one per-query kernel, prefill
            included (``torch`` backend on CPU, float32, native kernel built).

    Returns:
        A backend implementing ``AttentionBackend``.

    Raises:
        ValueError: Unknown name, or a backend that cannot run on ``device``
            (or with ``dtype`` / ``block_size``).
        ImportError: The backend's package is missing (says what to install).
    """
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(ATTENTION_BACKENDS)}")
    device = torch.device(device)
    if batch_invariant:
        return _batch_invariant_backend(name, device, dtype)
    if name == "auto":
        return _auto_backend(device, dtype, block_size)
    if name == "torch":
        from workers.model.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "triton":
        return _triton_backend(device)
    return _flash_attn_backend(device, dtype, block_size)


def _batch_invariant_backend(name: str, device: torch.device, dtype: Optional[torch.dtype]) -> AttentionBackend:
    from workers.model.attention import cpu_decode
    from workers.model.attention.torch_backend import TorchAttentionBackend

    if name not in ("auto", "torch") or device.type != "cpu" or dtype not in (None, torch.float32):
        raise ValueError(f"batch_invariant runs on CPU in float32 with attention_backend auto or torch; got "
                         f"{name!r} on {device.type} in {dtype}: drop batch_invariant or change them")
    if cpu_decode.load() is None:
        raise ValueError("batch_invariant needs the native attention kernel, which did not build here "
                         "(a C compiler is needed; see the log)")
    return TorchAttentionBackend(batch_invariant=True)


def _auto_backend(device: torch.device, dtype: Optional[torch.dtype], block_size: Optional[int]) -> AttentionBackend:
    if device.type == "cuda":
        try:
            return _flash_attn_backend(device, dtype, block_size)
        except (ImportError, ValueError) as exc:
            # Expected on many GPU setups (no flash-attn, float32, block_size 16).
            logger.info("attention backend auto: using torch, flash_attn unavailable (%s)", exc)
    from workers.model.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend()


def _triton_backend(device: torch.device) -> AttentionBackend:
    from workers.model.attention.triton_backend import TritonAttentionBackend, triton_runs_on

    if not triton_runs_on(device):
        raise ValueError(
            f"attention_backend='triton' needs a CUDA device, got {device.type!r}; "
            "use attention_backend='torch' (or 'auto') on CPU"
        )
    if importlib.util.find_spec("triton") is None:
        raise ImportError("attention_backend='triton' needs the 'triton' package: pip install triton")
    return TritonAttentionBackend()


def _flash_attn_backend(
    device: torch.device, dtype: Optional[torch.dtype], block_size: Optional[int]
) -> AttentionBackend:
    if device.type != "cuda":
        raise ValueError(
            f"attention_backend='flash_attn' needs a CUDA device, got {device.type!r}; "
            "use attention_backend='torch' (or 'auto') on CPU"
        )
    from workers.model.attention.flash_attn_backend import FlashAttnBackend

    return FlashAttnBackend(dtype=dtype, block_size=block_size)
