"""GGUF conversion of the families beyond Llama and Gemma 3: Qwen2, Qwen3, Phi-3,
Gemma 2, Qwen2-MoE and Qwen3-MoE (``gguf.py`` writes the folder; this module
says, per ``general.architecture``, which HF config fields and tensors a file
becomes). Every value is what transformers' own GGUF loader produces
(``from_pretrained(..., gguf_file=...)``, the legacy ``load_gguf_checkpoint``
path), so the rules are its rules:

- no Q/K row permutation (llama.cpp permutes llama-architecture files only);
- Gemma 2 norms are stored as ``1 + w``: ``w`` is the value minus 1, in
  float32, as for Gemma 3;
- Phi-3 keeps its fused ``attn_qkv`` / ``ffn_up`` (gate then up) as HF's
  ``qkv_proj`` / ``gate_up_proj``;
- routed experts are stored stacked (``ffn_{gate,up,down}_exps``,
  ``[experts, rows, cols]``); the folder holds one tensor per expert
  (``mlp.experts.E.gate_proj.weight``: the checkpoint layout our loader and
  transformers both read), each expert's rows exactly transformers' slice of
  its stacked ``gate_up_proj`` / ``down_proj``. Qwen2-MoE's shared-expert gate
  is a vector in the file, ``[1, hidden]`` in HF.

What the GGUF records but transformers' loader ignores is taken from the
file only where it fixes tensor shapes (Qwen3's head_dim, the MoE expert
sizes): transformers could not load such a file at all when the file differs
from its class default, and for every file it can load the value is the same.
Values that change results without changing shapes take transformers'
defaults, and a file that records another value is refused rather than
converted wrong: Gemma 2's ``query_pre_attn_scalar`` (256: head_dim must be
256; the 27B model uses 144) and its soft-caps (50 / 30), Phi-3's partial
rotary (``rope.dimension_count`` must equal head_dim: Phi-4-mini's 0.75 is
refused) and long-context RoPE factors (``gguf.py`` refuses every rope
scaling tensor). Known divergence inherited from transformers: Phi-3 GGUFs
record ``attention.sliding_window`` (2047 for Phi-3-mini-4k), which its GGUF
loader ignores, so the folder has full attention like transformers' model.

Mixtral GGUFs use ``general.architecture == "llama"`` with stacked experts;
transformers' loader builds a dense Llama and drops the experts, so
``gguf.py`` converts them itself (its module docstring).
"""

from __future__ import annotations

import re
from typing import Any, Iterator

import numpy as np

FAMILY_ARCHITECTURES = ("qwen2", "qwen3", "phi3", "gemma2", "qwen2moe", "qwen3moe")
MOE_ARCHITECTURES = ("qwen2moe", "qwen3moe")
# HF model_type -> GGUF general.architecture (the folder's config says which file layout it came from).
GGUF_ARCH_OF_MODEL_TYPE = {"qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3", "gemma2": "gemma2",
                           "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}
_MODEL = {  # arch -> (HF architectures entry, model_type)
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "phi3": ("Phi3ForCausalLM", "phi3"),
    "gemma2": ("Gemma2ForCausalLM", "gemma2"),
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
}
# Class defaults transformers' GGUF loader falls back on (see the module docstring).
_QWEN3_HEAD_DIM = 128
_GEMMA2_HEAD_DIM = 256  # = query_pre_attn_scalar
_GEMMA2_SOFTCAPS = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}
_QWEN2MOE_SIZES = (1408, 5632)  # moe_intermediate_size, shared_expert_intermediate_size
_QWEN3MOE_EXPERT_SIZE = 768

_ATTENTION = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
}
_MLP = {
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_BIASES = {f"attn_{p}.bias": f"self_attn.{p}_proj.bias" for p in "qkv"}
_QK_NORMS = {"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}
_ROUTER = {"ffn_gate_inp.weight": "mlp.gate.weight", "ffn_norm.weight": "post_attention_layernorm.weight"}
_SHARED_EXPERT = {
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
}
# GGUF tensor name (after ``blk.N.``) -> HF name (after ``model.layers.N.``).
LAYER_TENSORS = {
    "qwen2": {**_ATTENTION, **_BIASES, **_MLP},
    "qwen3": {**_ATTENTION, **_QK_NORMS, **_MLP},
    "phi3": {**_ATTENTION, "attn_qkv.weight": "self_attn.qkv_proj.weight", **_MLP,
             "ffn_up.weight": "mlp.gate_up_proj.weight"},
    "gemma2": {**_ATTENTION, **_MLP, "post_attention_norm.weight": "post_attention_layernorm.weight",
               "ffn_norm.weight": "pre_feedforward_layernorm.weight",
               "post_ffw_norm.weight": "post_feedforward_layernorm.weight"},
    "qwen2moe": {**_ATTENTION, **_BIASES, **_ROUTER, **_SHARED_EXPERT},
    "qwen3moe": {**_ATTENTION, **_QK_NORMS, **_ROUTER},
}
_EXPERTS = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight")


def config_fields(arch: str, metadata: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """The family's own HF config fields (``config`` holds the shared ones, read from the GGUF).

    Raises:
        ValueError: A value transformers' loader would replace by a default
            that differs from the file's (module docstring).
    """
    architecture, model_type = _MODEL[arch]
    theta = float(metadata.get(f"{arch}.rope.freq_base", 10000.0))
    fields: dict[str, Any] = {"architectures": [architecture], "model_type": model_type, "hidden_act": "silu",
                              "rope_theta": theta, "rope_parameters": {"rope_type": "default", "rope_theta": theta}}
    if arch.startswith("qwen"):
        fields.update(use_sliding_window=False, sliding_window=None)
    if arch in ("qwen3", "qwen3moe"):
        fields["head_dim"] = int(metadata.get(f"{arch}.attention.key_length", _QWEN3_HEAD_DIM))
    if arch in MOE_ARCHITECTURES:
        fields.update(_moe_fields(arch, metadata))
    if arch == "phi3":
        _check_phi3(metadata, config)
    if arch == "gemma2":
        fields = _gemma2_fields(metadata, config, fields)
    return fields


def _moe_fields(arch: str, metadata: dict[str, Any]) -> dict[str, Any]:
    expert, shared = _QWEN2MOE_SIZES if arch == "qwen2moe" else (_QWEN3MOE_EXPERT_SIZE, 0)
    fields = {
        "num_experts": int(metadata[f"{arch}.expert_count"]),
        "num_experts_per_tok": int(metadata[f"{arch}.expert_used_count"]),
        "moe_intermediate_size": int(metadata.get(f"{arch}.expert_feed_forward_length", expert)),
        "norm_topk_prob": arch == "qwen3moe",  # llama.cpp renormalises Qwen3-MoE's top-k only
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }
    if arch == "qwen2moe":
        fields["shared_expert_intermediate_size"] = int(
            metadata.get("qwen2moe.expert_shared_feed_forward_length", shared))
    return fields


def _check_phi3(metadata: dict[str, Any], config: dict[str, Any]) -> None:
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    rotary = int(metadata.get("phi3.rope.dimension_count", head_dim))
    if rotary != head_dim:
        raise ValueError(f"this Phi-3 GGUF rotates {rotary} of {head_dim} dimensions per head (partial rotary, "
                         "Phi-4-mini); transformers' GGUF loader rotates them all: pass the HF checkpoint folder")


def _gemma2_fields(metadata: dict[str, Any], config: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    head_dim = int(metadata.get("gemma2.attention.key_length", _GEMMA2_HEAD_DIM))
    if head_dim != _GEMMA2_HEAD_DIM:
        raise ValueError(
            f"this Gemma 2 GGUF has head_dim {head_dim}; the GGUF does not record query_pre_attn_scalar, which is "
            f"{_GEMMA2_HEAD_DIM} only for head_dim {_GEMMA2_HEAD_DIM} (the 27B model uses 144): pass the HF "
            "checkpoint folder instead")
    for key, default in _GEMMA2_SOFTCAPS.items():
        value = metadata.get(f"gemma2.{key}")
        if value is not None and float(value) != default:
            raise ValueError(f"this Gemma 2 GGUF sets {key} to {float(value)}; transformers' GGUF loader assumes "
                             f"{default}: pass the HF checkpoint folder instead")
    del fields["hidden_act"]
    return {
        **fields,
        "head_dim": head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": _GEMMA2_HEAD_DIM,
        "sliding_window": int(metadata.get("gemma2.attention.sliding_window", 4096)),
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention"
                        for i in range(config["num_hidden_layers"])],
        **_GEMMA2_SOFTCAPS,
    }


def drops_attention_bias(arch: str) -> bool:
    """Families whose HF config has no ``attention_bias`` (Qwen2's q/k/v biases are always on)."""
    return arch in ("qwen2", "qwen2moe", "phi3")


def hf_tensors(arch: str, gguf_name: str, weights: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
    """The HF tensors (name, float32 values) of one dequantized GGUF tensor.

    Raises:
        ValueError: A tensor the architecture has no counterpart for.
    """
    globals_ = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}
    if gguf_name in globals_:
        name = globals_[gguf_name]
    elif m := _EXPERTS.fullmatch(gguf_name):
        if arch in MOE_ARCHITECTURES:
            for expert, rows in enumerate(weights):  # [experts, rows, cols]: one tensor per expert
                yield f"model.layers.{m[1]}.mlp.experts.{expert}.{m[2]}_proj.weight", rows
            return
        name = ""
    else:
        parts = gguf_name.split(".", 2)
        layer = LAYER_TENSORS[arch]
        name = f"model.layers.{parts[1]}.{layer[parts[2]]}" if len(parts) == 3 and parts[2] in layer else ""
    if not name:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no counterpart in a {arch} model; is the file complete?")
    if arch == "gemma2" and gguf_name.endswith("norm.weight"):
        weights = weights - 1  # stored as 1 + w; float32 like transformers
    if gguf_name.endswith("ffn_gate_inp_shexp.weight"):
        weights = weights.reshape(1, -1)  # a vector in the file, [1, hidden] in HF
    yield name, weights
