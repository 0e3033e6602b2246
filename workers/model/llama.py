"""The Llama family (Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2 and 3, the MoE variants) over a flat
token batch and a paged KV cache.

One forward pass takes every scheduled token of every request at once::

    input_ids [T], positions [T]      prefill chunks and decodes, concatenated
        -> embed -> N x (attention + MLP) -> norm -> hidden [T, hidden]

Attention goes through the injected backend (``attention/base.py``), which
writes the new K/V into the layer's cache and attends over the request's whole
context. Projections are fused (``qkv_proj``, ``gate_up_proj``): one matmul
instead of three (two), which matters on CPU. Parameter names follow HF with
the fused projections renamed, so ``load_weights`` takes HF names.

Tensor parallelism: given a ``TPContext`` (``tp.py``), the model holds one
rank's slice. Modules take their *local* sizes (heads, KV heads,
intermediate size, vocab rows) as constructor arguments, ``o_proj`` and
``down_proj`` become row-parallel (all-reduce, then the bias), the embedding
vocab-parallel, and ``compute_logits`` gathers the vocab slices to rank 0.
Loading takes HF names of the full checkpoint and copies the rank's slice
(``shard_checkpoint_tensor``). Without a context (one process) every module
is a plain ``nn.Linear`` / ``nn.Embedding``: the single-process forward pass,
with no collective.
"""

from __future__ import annotations

import logging

from typing import Any, Iterable, Optional

import torch
from torch import nn

from workers.model import cpu_ops
from workers.model.attention.base import AttentionBackend, AttentionMetadata
from workers.model.config import ModelArchConfig
from workers.model.gemma import GemmaModel
from workers.model.layers import GeluAndMul, RMSNorm, RotaryEmbedding, SiluAndMul
from workers.model.linear import Linear, finalize_linears
from workers.model.mlp import GatedMLP
from workers.model.moe import SparseMoE
from workers.model.tp import (
    TPContext,
    TPShard,
    plan_shards,
    vocab_embedding,
)
from workers.model.weights import load_checkpoint
from workers.model.self_attention import LlamaAttention

logger = logging.getLogger(__name__)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: ``h += attn(norm(h)); h += mlp(norm(h))``.

    The residual stream travels beside the sub-block outputs and each add
    happens inside the next norm (vLLM's layout): ``forward(x, residual)``
    returns the MLP output and the stream, and the model's final norm adds
    the last MLP output. The first layer gets ``residual`` None.
    """

    def __init__(
        self,
        arch: ModelArchConfig,
        layer_idx: int,
        attn_backend: AttentionBackend,
        shard: TPShard,
        tp: Optional[TPContext] = None,
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(
            hidden_size=arch.hidden_size,
            num_heads=shard.num_heads,
            num_kv_heads=shard.num_kv_heads,
            head_dim=arch.head_dim,
            attn_backend=attn_backend,
            qkv_bias=arch.attention_bias,
            o_bias=arch.o_proj_bias,
            sliding_window=arch.layer_sliding_window(layer_idx),
            tp=tp,
            layer_idx=layer_idx,
            qk_norm_eps=arch.rms_norm_eps if arch.qk_norm else None,
        )
        self.mlp: nn.Module
        if arch.is_moe_layer(layer_idx):
            self.mlp = SparseMoE(arch.hidden_size, shard.moe_intermediate[1], arch.num_experts,
                                 arch.num_experts_per_tok, arch.norm_topk_prob,
                                 shard.shared_intermediate[1] or None, tp=tp)
        else:
            self.mlp = GatedMLP(arch.hidden_size, shard.intermediate_size, bias=arch.mlp_bias, tp=tp)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: Optional[torch.Tensor],
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:  # the first layer: x is the embedding, the stream starts there
            residual = x
            x = self.input_layernorm(x)
        else:
            x = self.input_layernorm(x, residual)  # residual += x (last MLP output), then norm
        x = self.self_attn(x, cos, sin, kv_cache, meta)
        x = self.post_attention_layernorm(x, residual)  # residual += attention output, then norm
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm (HF's ``model.`` prefix)."""

    def __init__(
        self, arch: ModelArchConfig, attn_backend: AttentionBackend, shard: TPShard, tp: Optional[TPContext] = None
    ) -> None:
        super().__init__()
        self.embed_tokens = vocab_embedding(shard.vocab_size, arch.hidden_size, tp)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(arch, i, attn_backend, shard, tp) for i in range(arch.num_hidden_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(
            arch.head_dim, arch.max_position_embeddings, arch.rope_theta, arch.rope_scaling
        )

    def build_rope_caches(self, device: torch.device) -> None:
        self.rotary_emb.build_cache(device)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        residual: Optional[torch.Tensor] = None
        cos, sin = self.rotary_emb.lookup(positions)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, cos, sin, kv_cache, meta)
        return self.norm(x, residual)


class LlamaForCausalLM(nn.Module):
    """A Llama-family causal LM running on a paged KV cache.

    Args:
        arch: The model's architecture (full sizes).
        attn_backend: Attention implementation shared by all layers.
        tp: This rank's tensor-parallel context; None (or a group of one)
            builds the whole model.
    """

    def __init__(
        self, arch: ModelArchConfig, attn_backend: AttentionBackend, tp: Optional[TPContext] = None
    ) -> None:
        super().__init__()
        self.arch = arch
        self.tp = tp if tp is not None and tp.world_size > 1 else None
        self.shard = self.tp.shard if self.tp is not None else plan_shards(
            arch.num_attention_heads, arch.num_key_value_heads, arch.intermediate_size, arch.vocab_size, 1,
            arch.moe_intermediate_size, arch.shared_expert_intermediate_size,
        )[0]
        model_cls = GemmaModel if arch.sandwich_norms else LlamaModel
        self.model: nn.Module = model_cls(arch, attn_backend, self.shard, self.tp)
        self.lm_head = Linear(arch.hidden_size, self.shard.vocab_size, bias=False)
        self.compiled: Any = None  # CompiledDecoder with enforce_eager False
        self.native_decoder: Any = None  # NativeDecoder when every kernel is native (native_decoder.py)
        self.tie_weights()

    @property
    def long_rope_rows(self) -> int:
        """Where the long factors' rotary rows start (longrope; 0 otherwise)."""
        return self.model.rotary_emb.long_rows

    def tie_weights(self) -> None:
        """Shares the embedding with the LM head when the config says so."""
        if self.arch.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Runs one step over a flat token batch.

        Args:
            input_ids: ``[T]`` int64, the new tokens of all requests.
            positions: ``[T]`` int64, their positions in their sequences.
            kv_caches: One tensor per layer, layout of ``attention/base.py``;
                updated in place.
            meta: Batch layout of the step.

        Returns:
            Final hidden states ``[T, hidden_size]``.
        """
        if self.compiled is not None:
            return self.compiled(input_ids, positions, kv_caches, meta)
        if self.native_decoder is not None:
            return self.native_decoder.forward(input_ids, positions, kv_caches, meta)
        return self.model(input_ids, positions, kv_caches, meta)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        """Float32 logits ``[N, vocab_size]`` of hidden states ``[N, hidden_size]``.

        With tensor parallelism every rank must call it (it gathers the vocab
        slices); rank 0 gets the full logits, the other ranks None. A model
        with ``final_logit_softcapping`` (Gemma 2) gets capped logits, so the
        sampler, logprobs and speculative verification all see them.
        """
        logits = self.lm_head(hidden).float()
        cap = self.arch.final_logit_softcapping
        if cap is not None:  # Gemma 2, as transformers; elementwise, so each TP rank caps its vocab slice
            logits = torch.tanh(logits / cap) * cap
        return logits if self.tp is None else self.tp.gather_vocab(logits)

    def finalize(self, linear_backend: str, compile: bool = False) -> int:
        """Installs the (resolved) linear backend's kernels once the weights are
        loaded (``linear.py``) and, on CPU in float32, the fused native norms,
        rotary and SiLU (``cpu_ops.py``), on a GPU their Triton kernels
        (``triton_ops.py``); with ``compile`` the decoder stack
        runs under ``torch.compile`` (``compiled.py``). Returns the number of
        linear layers."""
        tied = (self.lm_head, self.model.embed_tokens) if self.arch.tie_word_embeddings else None
        count = finalize_linears(self, linear_backend, tied)
        weight = self.model.norm.weight
        native = cpu_ops.load() if weight.device.type == "cpu" and weight.dtype == torch.float32 else None
        fused = None
        if weight.device.type == "cuda":
            from workers.model import triton_ops

            fused = triton_ops.load(weight.device)
            logger.info("fused norm, rotary and SiLU kernels: %s", "triton" if fused is not None else "off (torch)")
        for module in self.modules():
            if isinstance(module, (RMSNorm, SiluAndMul, GeluAndMul, LlamaAttention)):
                module.native = native
                module.fused = fused
        if compile:
            from workers.model.compiled import CompiledDecoder

            self.compiled = CompiledDecoder(self)
        else:
            from workers.model.native_decoder import NativeDecoder

            if native is not None:  # the routed experts of each MoE layer in one C call (moe_native.py)
                for module in self.modules():
                    if isinstance(module, SparseMoE):
                        module.install_native()
            self.native_decoder = NativeDecoder.try_build(self)
        return count

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies HF-named tensors into the (fused) parameters, then re-ties the
        embeddings and rebuilds the rotary table (``weights.py``).

        Works on a model built on the ``meta`` device and materialized with
        ``to_empty``.

        Raises:
            ValueError: If a tensor has no parameter, has the wrong shape, or a
                parameter gets no tensor (the checkpoint does not match the config).
        """
        load_checkpoint(self, weights)
        self.tie_weights()
        self.model.build_rope_caches(self.model.embed_tokens.weight.device)
