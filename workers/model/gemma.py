"""Gemma 3 text models and Gemma 2 on the Llama family's attention and paged KV cache.

What differs from Llama (transformers' ``Gemma3ForCausalLM``)::

    x = embed(ids) * sqrt(hidden)
    per layer:   h = x + post_attn_norm(attn(input_norm(x)))       # norms before AND after
                 x = h + post_ffw_norm(mlp(pre_ffw_norm(h)))       # each sub-block
    attention:   q, k normed per head (q_norm / k_norm) before RoPE; scale
                 1 / sqrt(query_pre_attn_scalar); sliding-window layers (by
                 ``layer_types``) rotate with their own RoPE base
    mlp:         gelu_tanh(gate) * up  (GeGLU)
    norms:       x * rsqrt(mean(x^2) + eps) * (1 + w)

Gemma 2 (``Gemma2ForCausalLM``) has the same layer without the q/k norms,
one RoPE base for every layer (even layers local, odd ones global by
default), and tanh soft-capping (``config.py``)::

    scores = tanh(q.k * scale / c_attn) * c_attn     before the mask and softmax
    logits = tanh(lm_head(x) / c_final) * c_final    (``compute_logits``)

Only the torch attention backend caps scores: its decodes on the native decode
kernel (``softcap`` of ``csrc/paged_decode.c``, which the native decoder's
one-call step calls too), its prefill chunks in ``attention/softcap.py``; the
other backends are refused for such a model (``attention/__init__.py``).

The ``(1 + w)`` is folded into the weights at load (``weights.py``), so every
norm is our ``RMSNorm``; in float32 the product is the same as transformers'.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from workers.model.attention.base import AttentionBackend, AttentionMetadata
from workers.model.config import ModelArchConfig
from workers.model.layers import RMSNorm, RotaryEmbedding
from workers.model.mlp import GatedMLP
from workers.model.self_attention import LlamaAttention
from workers.model.tp import TPContext, TPShard, vocab_embedding


class GemmaDecoderLayer(nn.Module):
    """Attention and MLP, each between two norms, each added to the stream."""

    def __init__(self, arch: ModelArchConfig, layer_idx: int, attn_backend: AttentionBackend, shard: TPShard,
                 tp: Optional[TPContext] = None) -> None:
        super().__init__()
        assert arch.query_pre_attn_scalar is not None
        self.self_attn = LlamaAttention(
            hidden_size=arch.hidden_size, num_heads=shard.num_heads, num_kv_heads=shard.num_kv_heads,
            head_dim=arch.head_dim, attn_backend=attn_backend, qkv_bias=arch.attention_bias,
            o_bias=arch.o_proj_bias, sliding_window=arch.layer_sliding_window(layer_idx), tp=tp,
            layer_idx=layer_idx, qk_norm_eps=arch.rms_norm_eps if arch.qk_norm else None,
            scale=arch.query_pre_attn_scalar ** -0.5, softcap=arch.attn_logit_softcapping,
        )
        self.mlp = GatedMLP(arch.hidden_size, shard.intermediate_size, tp=tp, act=arch.hidden_act)
        eps = arch.rms_norm_eps
        self.input_layernorm = RMSNorm(arch.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, eps)
        self.pre_feedforward_layernorm = RMSNorm(arch.hidden_size, eps)
        self.post_feedforward_layernorm = RMSNorm(arch.hidden_size, eps)
        self.local = arch.layer_sliding_window(layer_idx) is not None

    def forward(self, x: torch.Tensor, rope: dict[bool, tuple[torch.Tensor, torch.Tensor]],
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        cos, sin = rope[self.local]
        h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class GemmaModel(nn.Module):
    """Scaled embedding, decoder layers and final norm (HF's ``model.`` prefix)."""

    def __init__(self, arch: ModelArchConfig, attn_backend: AttentionBackend, shard: TPShard,
                 tp: Optional[TPContext] = None) -> None:
        super().__init__()
        self.embed_scale = arch.embed_scale
        self.embed_tokens = vocab_embedding(shard.vocab_size, arch.hidden_size, tp)
        self.layers = nn.ModuleList(GemmaDecoderLayer(arch, i, attn_backend, shard, tp)
                                    for i in range(arch.num_hidden_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(arch.head_dim, arch.max_position_embeddings, arch.rope_theta)
        self.rotary_emb_local: Optional[RotaryEmbedding] = None
        if arch.local_rope_theta is not None:
            self.rotary_emb_local = RotaryEmbedding(arch.head_dim, arch.max_position_embeddings,
                                                    arch.local_rope_theta)

    def build_rope_caches(self, device: torch.device) -> None:
        self.rotary_emb.build_cache(device)
        if self.rotary_emb_local is not None:
            self.rotary_emb_local.build_cache(device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids) * self.embed_scale
        full = self.rotary_emb.lookup(positions)
        local = self.rotary_emb_local.lookup(positions) if self.rotary_emb_local is not None else full
        rope = {False: full, True: local}
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, rope, kv_cache, meta)
        return self.norm(x)
