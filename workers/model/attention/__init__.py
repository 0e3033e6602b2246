"""Attention backends over the paged KV cache, chosen by name::

    torch       scaled_dot_product_attention; any device, any dtype (CPU default)
    triton      Triton decode kernel + torch for prefill chunks (CUDA)
    flash_attn  flash-attn 2 over the paged cache (CUDA, fp16/bf16,
                block_size a multiple of 256)
    auto        on CUDA: flash_attn when it can serve the dtype and block
                size, else triton when installed, else torch; on CPU: torch
                (``auto_choice``; the choice and its reason are logged)

A model with soft-capped attention scores (Gemma 2) runs on ``torch`` only:
``auto`` picks it, ``triton`` / ``flash_attn`` are refused with a message;
``batch_invariant`` serves it (the per-query native decode kernel caps scores).

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
    attn_softcap: bool = False,
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
        attn_softcap: The model soft-caps its attention scores (Gemma 2):
            only the torch backend can (with ``batch_invariant`` too: its
            per-query kernel caps).

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
    if batch_invariant:  # the torch backend only, which caps soft-capped scores too
        return _batch_invariant_backend(name, device, dtype)
    if attn_softcap:
        return _softcap_backend(name)
    if name == "auto":
        return _auto_backend(device, dtype, block_size)
    if name == "torch":
        from workers.model.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "triton":
        return _triton_backend(device)
    return _flash_attn_backend(device, dtype, block_size)


def _softcap_backend(name: str) -> AttentionBackend:
    from workers.model.attention.torch_backend import TorchAttentionBackend

    if name not in ("auto", "torch"):
        raise ValueError(f"attention_backend {name!r} cannot soft-cap attention scores, which this model "
                         "(Gemma 2: attn_logit_softcapping) needs; use attention_backend 'torch' or 'auto'")
    if name == "auto":
        logger.info("attention backend auto: torch (the model soft-caps attention scores; only torch can)")
    return TorchAttentionBackend()


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


def auto_choice(device_type: str, dtype: Optional[torch.dtype], block_size: Optional[int], *,
                has_flash_attn: bool, has_triton: bool) -> tuple[str, str]:
    """What ``auto`` builds, and why: ``(backend name, reason)``."""
    if device_type != "cuda":
        return "torch", f"{device_type}: the torch backend (native decode kernel where it builds)"
    if has_flash_attn and dtype in (torch.float16, torch.bfloat16) and block_size is not None \
            and block_size % 256 == 0:
        return "flash_attn", f"CUDA, {dtype}, block_size {block_size}"
    blockers = []
    if not has_flash_attn:
        blockers.append("flash-attn is not installed")
    if dtype not in (torch.float16, torch.bfloat16):
        blockers.append(f"flash-attn needs float16 or bfloat16, not {dtype}")
    if block_size is None or block_size % 256:
        blockers.append(f"flash-attn's paged KV needs block_size a multiple of 256, not {block_size}")
    if has_triton:
        return "triton", "CUDA without flash-attn (" + "; ".join(blockers) + "): the Triton decode kernel"
    return "torch", "CUDA without flash-attn (" + "; ".join(blockers) + ") or triton: the torch backend"


def _auto_backend(device: torch.device, dtype: Optional[torch.dtype], block_size: Optional[int]) -> AttentionBackend:
    has_flash_attn = device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None
    has_triton = device.type == "cuda" and importlib.util.find_spec("triton") is not None
    name, reason = auto_choice(device.type, dtype, block_size, has_flash_attn=has_flash_attn, has_triton=has_triton)
    logger.info("attention backend auto: %s (%s)", name, reason)
    if name == "flash_attn":
        return _flash_attn_backend(device, dtype, block_size)
    if name == "triton":
        return _triton_backend(device)
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
