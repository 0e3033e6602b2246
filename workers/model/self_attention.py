"""Self-attention of the Llama family: GQA with a fused q/k/v projection, the
rotary embedding, optional per-head q/k norms (Qwen3, Gemma 3), a sliding
window, a scale of the model's and optional soft-capping of the scores (Gemma 2); the paged attention itself is the injected
backend's (``attention/base.py``). ``o_proj`` is row-parallel under TP."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from workers.model import cpu_ops
from workers.model.attention.base import AttentionBackend, AttentionMetadata
from workers.model.layers import RMSNorm, RotaryEmbedding
from workers.model.linear import Linear
from workers.model.tp import TPContext, row_parallel_linear


class LlamaAttention(nn.Module):
    """Self-attention with GQA, fused q/k/v projection and rotary embedding.

    Args:
        num_heads: Query heads held by this module (all of them without TP).
        num_kv_heads: KV heads held by this module.
        sliding_window: Attend only to the last ``sliding_window`` positions.
        qk_norm_eps: With a value, an RMSNorm over each query and each key
            head before the rotary embedding (Qwen3's ``q_norm`` / ``k_norm``).
        scale: The attention scale; None is ``1 / sqrt(head_dim)``.
        softcap: With a value ``c``, scores become ``tanh(s / c) * c`` before
            the softmax (Gemma 2); the backend must support it (torch).
        tp: The tensor-parallel context; ``o_proj`` is row-parallel with one.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        attn_backend: AttentionBackend,
        qkv_bias: bool = False,
        o_bias: bool = False,
        sliding_window: Optional[int] = None,
        tp: Optional[TPContext] = None,
        layer_idx: int = 0,
        qk_norm_eps: Optional[float] = None,
        scale: Optional[float] = None,
        softcap: Optional[float] = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        self.scale = scale if scale is not None else head_dim**-0.5
        self.sliding_window = sliding_window
        self.softcap = softcap
        # Passed only when set, so backends (and test fakes) without the argument serve every other model.
        self.backend_kwargs = {"softcap": softcap} if softcap is not None else {}
        self.attn_backend = attn_backend
        self.native: Any = None  # cpu_ops library (in-place rotary), set by finalize
        self.fused: Any = None  # triton_ops.TritonOps (in-place rotary on a GPU), set by finalize
        self.layer_idx = layer_idx
        self.use_attention_op = False  # under torch.compile: attention as a custom op (compiled.py)
        self.qkv_proj = Linear(hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = row_parallel_linear(self.q_size, hidden_size, o_bias, tp)
        self.q_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.k_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None

    def qkv_shard_rows(self, shard_id: str) -> tuple[int, int]:
        """``(first row, number of rows)`` of the q, k or v part of ``qkv_proj``."""
        starts = {"q": 0, "k": self.q_size, "v": self.q_size + self.kv_size}
        return starts[shard_id], self.q_size if shard_id == "q" else self.kv_size

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        # q and k are rotated together (one call for both), then split as views:
        # q [T, Hq, D] and k, v [T, Hkv, D] may be non-contiguous, with stride 1 on D.
        qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.native is not None:  # per head, in place in qkv (cpu_ops)
            cpu_ops.head_rms_norm(self.native, qk[:, : self.num_heads], self.q_norm.weight, self.q_norm.eps)
            cpu_ops.head_rms_norm(self.native, qk[:, self.num_heads :], self.k_norm.weight, self.k_norm.eps)
        elif self.q_norm is not None:  # per head, before the rotation (Qwen3); a new tensor, rotated in place
            q = self.q_norm(qk[:, : self.num_heads].reshape(-1, self.head_dim))
            k = self.k_norm(qk[:, self.num_heads :].reshape(-1, self.head_dim))
            qk = torch.cat([q.view(num_tokens, self.num_heads, -1), k.view(num_tokens, self.num_kv_heads, -1)], 1)
        qk = RotaryEmbedding.apply(qk, cos, sin, self.native, self.fused)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.use_attention_op:
            out = torch.ops.prefixserve.attention(q, k, v, kv_cache, self.layer_idx)
        else:
            out = self.attn_backend.forward(q, k, v, kv_cache, meta, self.scale, self.sliding_window,
                                            **self.backend_kwargs)
        return self.o_proj(out.reshape(num_tokens, self.q_size))
