"""The model architecture as our layers need it, parsed once from an HF ``config.json``.

Only the Llama family is supported: Llama (GQA/MQA, tied embeddings, llama3
rope scaling), Mistral (sliding window), Qwen2 (q/k/v bias, optional
sliding window on the upper layers) and Qwen3 (Qwen2's layout with an
RMSNorm over each query and key head before the rotary embedding), Phi-3
(checkpoints with fused ``qkv_proj`` / ``gate_up_proj``; default RoPE or its
``longrope`` long-context scaling, ``workers/model/longrope.py``), Gemma 3 text models (scaled
embeddings, (1 + w) RMSNorms before and after each sub-block, GeGLU, q/k
norms, interleaved sliding-window layers with their own RoPE base,
``query_pre_attn_scalar``; ``workers/model/gemma.py``), Gemma 2 (Gemma 3's
layer without q/k norms, one RoPE base, and tanh soft-capping of the
attention scores and of the final logits), and the
mixture-of-experts variants: Mixtral (Mistral's attention), Qwen2-MoE (with a
gated shared expert) and Qwen3-MoE (``workers/model/moe.py``). Both config formats are read: the
transformers v4 one (``rope_theta`` + ``rope_scaling``) and the v5 one
(``rope_parameters``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

from workers.model.longrope import LongRopeScaling, parse_longrope

# HF ``architectures`` entry -> our family name.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
GEMMA_FAMILIES = ("gemma2", "gemma3")
SUPPORTED_ROPE_TYPES = ("default", "llama3", "longrope", "su")
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"

# rope_theta when a config names none (the transformers defaults of the three classes).
_DEFAULT_ROPE_THETA = 10000.0
_DEFAULT_RMS_NORM_EPS = {"llama": 1e-6, "mistral": 1e-6, "qwen2": 1e-6, "qwen3": 1e-6, "phi3": 1e-5, "gemma2": 1e-6,
                         "gemma3": 1e-6, "mixtral": 1e-5, "qwen2_moe": 1e-6, "qwen3_moe": 1e-6}


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1 frequency-dependent rope scaling (``rope_type: llama3``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelArchConfig:
    """Shapes and constants of one decoder-only model (full, unsharded sizes).

    Attributes:
        family: ``llama``, ``mistral``, ``qwen2``, ``qwen3``, ``phi3``, ``gemma2``, ``gemma3``,
            ``mixtral``, ``qwen2_moe`` or ``qwen3_moe``.
        layer_types: Per layer, ``full_attention`` or ``sliding_attention``.
        attention_bias: Bias on the q/k/v projections (Qwen2; Llama's
            ``attention_bias``).
        o_proj_bias: Bias on the output projection (Llama's ``attention_bias``
            only; Qwen2 has none).
        sliding_window: Window of the ``sliding_attention`` layers, else None.
        eos_token_ids: All end-of-sequence ids (HF allows a list).
        qk_norm: An RMSNorm (``rms_norm_eps``) over each query and key head,
            before the rotary embedding (Qwen3, Qwen3-MoE).
        num_experts / num_experts_per_tok: Routed experts of a MoE layer, and
            how many each token uses (0: a dense model).
        moe_intermediate_size: Intermediate size of one routed expert.
        shared_expert_intermediate_size: Qwen2-MoE's gated shared expert (0: none).
        norm_topk_prob: Renormalise the chosen experts' probabilities (always
            for Mixtral).
        moe_layers: Per layer, whether its MLP is the MoE (Qwen's
            ``decoder_sparse_step`` and ``mlp_only_layers``).
        hidden_act: ``silu`` (SwiGLU) or ``gelu_pytorch_tanh`` (Gemma's GeGLU).
        local_rope_theta: RoPE base of the sliding-window layers when it
            differs from ``rope_theta`` (Gemma 3), else None.
        query_pre_attn_scalar: Attention scale ``1 / sqrt(this)`` instead of
            ``1 / sqrt(head_dim)`` (Gemma).
        embed_scale: Multiplies the embeddings (Gemma: ``sqrt(hidden_size)``).
        sandwich_norms: Gemma's four norms per layer (before and after the
            attention and the MLP), with ``(1 + w)`` weights.
        attn_logit_softcapping: Attention scores become ``tanh(s / c) * c``
            before the mask and softmax (Gemma 2), else None.
        final_logit_softcapping: The same cap on the LM head's logits (Gemma 2).
    """

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[Union[Llama3RopeScaling, LongRopeScaling]]
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    o_proj_bias: bool
    mlp_bias: bool
    sliding_window: Optional[int]
    layer_types: tuple[str, ...]
    bos_token_id: Optional[int]
    eos_token_ids: tuple[int, ...]
    qk_norm: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[bool, ...] = ()
    hidden_act: str = "silu"
    local_rope_theta: Optional[float] = None
    query_pre_attn_scalar: Optional[float] = None
    embed_scale: float = 1.0
    sandwich_norms: bool = False
    attn_logit_softcapping: Optional[float] = None
    final_logit_softcapping: Optional[float] = None

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries; it needs one per layer "
                f"({self.num_hidden_layers})"
            )
        if SLIDING_ATTENTION in self.layer_types and not self.sliding_window:
            raise ValueError("layer_types names sliding_attention layers but sliding_window is not set")

    @property
    def eos_token_id(self) -> Optional[int]:
        """The first EOS id (the one tokenizers call ``eos_token``), or None."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def is_moe_layer(self, layer_idx: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[layer_idx]

    def layer_sliding_window(self, layer_idx: int) -> Optional[int]:
        """The sliding window of one layer, or None for full attention."""
        return self.sliding_window if self.layer_types[layer_idx] == SLIDING_ATTENTION else None

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> "ModelArchConfig":
        """Parses an HF ``config.json`` dict.

        Raises:
            ValueError: For an unsupported architecture, rope type, activation
                or inconsistent sizes, saying what is supported.
        """
        family = _family(config)
        num_heads = int(config["num_attention_heads"])
        hidden_size = int(config["hidden_size"])
        num_layers = int(config["num_hidden_layers"])
        gemma = _parse_gemma(config, family) if family in GEMMA_FAMILIES else {}
        if not gemma and config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config['hidden_act']!r} is not supported; only 'silu' is")
        rope_theta, rope_scaling = (gemma.pop("rope_theta"), None) if family == "gemma3" else _parse_rope(
            config, int(config.get("head_dim") or hidden_size // num_heads))
        sliding_window, layer_types = _parse_sliding(config, family, num_layers)
        qkv_bias = family in ("qwen2", "qwen2_moe") or bool(config.get("attention_bias", False))
        o_bias = family in ("llama", "qwen3", "qwen3_moe", "gemma2") and bool(config.get("attention_bias", False))
        return cls(
            family=family,
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(config["intermediate_size"]),
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=int(config.get("head_dim") or hidden_size // num_heads),
            rms_norm_eps=float(config.get("rms_norm_eps", _DEFAULT_RMS_NORM_EPS[family])),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            o_proj_bias=o_bias,
            mlp_bias=family == "llama" and bool(config.get("mlp_bias", False)),
            sliding_window=sliding_window,
            layer_types=layer_types,
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=_as_id_tuple(config.get("eos_token_id")),
            qk_norm=family in ("qwen3", "qwen3_moe", "gemma3"),
            **_parse_moe(config, family, num_layers),
            **gemma,
        )


def _family(config: Mapping[str, Any]) -> str:
    """The family from ``architectures``, else (configs built in code) from ``model_type``."""
    architectures = config.get("architectures") or []
    for name in architectures:
        if name in SUPPORTED_ARCHITECTURES:
            return SUPPORTED_ARCHITECTURES[name]
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    if architectures:
        raise ValueError(f"unsupported architectures {list(architectures)}; supported: {supported}")
    if config.get("model_type") in SUPPORTED_ARCHITECTURES.values():
        return config["model_type"]
    raise ValueError(f"config.json names no 'architectures'; add one of: {supported}")


def _parse_rope(config: Mapping[str, Any], head_dim: int
                ) -> tuple[float, Optional[Union[Llama3RopeScaling, LongRopeScaling]]]:
    """Reads rope theta and scaling from either config format."""
    params = dict(config.get("rope_parameters") or {})
    legacy = config.get("rope_scaling") or {}
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError("per-layer rope_parameters are not supported; use one rope setting for all layers")
    params = {**legacy, **params}
    theta = float(params.get("rope_theta", config.get("rope_theta", _DEFAULT_ROPE_THETA)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)} "
            "(remove rope_scaling or use a model without it)"
        )
    if float(params.get("partial_rotary_factor", config.get("partial_rotary_factor") or 1.0)) != 1.0:
        raise ValueError("partial_rotary_factor other than 1.0 is not supported")
    if rope_type == "default":
        return theta, None
    if rope_type in ("longrope", "su"):
        return theta, parse_longrope(params, config, head_dim)
    try:
        scaling = Llama3RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(
                params.get("original_max_position_embeddings", config.get("max_position_embeddings", 2048))
            ),
        )
    except KeyError as exc:
        raise ValueError(f"llama3 rope scaling needs {exc.args[0]!r} in rope_scaling") from None
    if scaling.high_freq_factor <= scaling.low_freq_factor:
        raise ValueError("llama3 rope scaling needs high_freq_factor > low_freq_factor")
    return theta, scaling


def _parse_sliding(
    config: Mapping[str, Any], family: str, num_layers: int
) -> tuple[Optional[int], tuple[str, ...]]:
    """Which layers use a sliding window, following each HF class's rules."""
    window = config.get("sliding_window")
    qwen = family in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
    if family == "llama" or (qwen and not config.get("use_sliding_window", False)):
        window = None
    if window is not None and int(window) < 1:
        raise ValueError(f"sliding_window must be >= 1 or null, got {window}")
    if window is None:
        return None, (FULL_ATTENTION,) * num_layers
    window = int(window)
    layer_types = config.get("layer_types")
    if layer_types:
        bad = set(layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION}
        if bad:
            raise ValueError(f"unsupported layer_types {sorted(bad)}; use {FULL_ATTENTION} or {SLIDING_ATTENTION}")
        return window, tuple(layer_types)
    if family == "gemma2":  # transformers' default: even layers local, odd layers global
        return window, tuple(SLIDING_ATTENTION if i % 2 == 0 else FULL_ATTENTION for i in range(num_layers))
    if qwen:
        first_sliding = int(config.get("max_window_layers", num_layers))
        types = tuple(SLIDING_ATTENTION if i >= first_sliding else FULL_ATTENTION for i in range(num_layers))
        return window, types
    return window, (SLIDING_ATTENTION,) * num_layers


def _parse_gemma(config: Mapping[str, Any], family: str) -> dict[str, Any]:
    """Gemma 2's and Gemma 3's fields (Gemma 3 with its RoPE bases: one per layer type)."""
    name = "Gemma 2" if family == "gemma2" else "Gemma 3"
    act = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"{name}'s hidden_activation {act!r} is not supported; 'gelu_pytorch_tanh' is")
    caps = {key: config.get(key) for key in ("attn_logit_softcapping", "final_logit_softcapping")}
    if family == "gemma3" and any(cap is not None for cap in caps.values()):
        raise ValueError("logit soft-capping is supported for Gemma 2 only, not in a Gemma 3 config; "
                         "remove attn_logit_softcapping / final_logit_softcapping (null)")
    for key, cap in caps.items():
        if cap is not None and not float(cap) > 0:
            raise ValueError(f"{key} must be > 0 or null, got {cap}")
    if config.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention is not supported (decoder-only, causal attention)")
    fields = dict(hidden_act="gelu_pytorch_tanh", embed_scale=float(config["hidden_size"]) ** 0.5,
                  query_pre_attn_scalar=float(config.get("query_pre_attn_scalar") or config["head_dim"]),
                  sandwich_norms=True, **{k: None if v is None else float(v) for k, v in caps.items()})
    return {**fields, **_parse_gemma3_rope(config)} if family == "gemma3" else fields


def _parse_gemma3_rope(config: Mapping[str, Any]) -> dict[str, Any]:
    """Gemma 3's RoPE bases, global and local (default RoPE only)."""
    params = config.get("rope_parameters") or {}
    if params and all(isinstance(v, dict) for v in params.values()):  # transformers v5: one per layer type
        per_type = {t: dict(v) for t, v in params.items()}
    else:  # v4: rope_theta (+ rope_scaling) for the global layers, rope_local_base_freq for the local ones
        per_type = {FULL_ATTENTION: {**(config.get("rope_scaling") or {}),
                                     "rope_theta": config.get("rope_theta", 1_000_000.0)},
                    SLIDING_ATTENTION: {"rope_theta": config.get("rope_local_base_freq", 10_000.0)}}
    for layer_type, p in per_type.items():
        kind = p.get("rope_type", p.get("type", "default"))
        if kind != "default":
            raise ValueError(f"Gemma 3 rope type {kind!r} ({layer_type} layers) is not supported yet; "
                             "only 'default' is")
    full = float(per_type.get(FULL_ATTENTION, {}).get("rope_theta", 1_000_000.0))
    local = float(per_type.get(SLIDING_ATTENTION, {}).get("rope_theta", full))
    return dict(rope_theta=full, local_rope_theta=local if local != full else None)


def _parse_moe(config: Mapping[str, Any], family: str, num_layers: int) -> dict[str, Any]:
    """The MoE fields of ``ModelArchConfig`` (none for a dense family)."""
    if family not in MOE_FAMILIES:
        return {}
    if family == "mixtral":
        experts, inter, shared, norm = int(config["num_local_experts"]), int(config["intermediate_size"]), 0, True
        layers = (True,) * num_layers
    else:
        experts = int(config.get("num_experts", config.get("num_local_experts", 0)) or 0)  # v4 / v5 names
        inter = int(config["moe_intermediate_size"])
        shared = int(config.get("shared_expert_intermediate_size") or 0) if family == "qwen2_moe" else 0
        norm = bool(config.get("norm_topk_prob", False))
        step, dense = int(config.get("decoder_sparse_step", 1) or 1), set(config.get("mlp_only_layers") or ())
        layers = tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(num_layers))
    top_k = int(config["num_experts_per_tok"])
    if not 1 <= top_k <= experts:
        raise ValueError(f"num_experts_per_tok must be in 1..{experts} (the experts), got {top_k}")
    return dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=inter,
                shared_expert_intermediate_size=shared, norm_topk_prob=norm, moe_layers=layers)


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)
