"""GGUF -> HF-style folder (config.json, float32 safetensors, tokenizer) conversion.

Loading a GGUF through transformers dequantizes every tensor on every load
(about a minute for the default model); we do it once and load the folder in
seconds. The folder holds exactly the values transformers' own GGUF loader
produces:

- every tensor is dequantized with ``gguf.quants.dequantize`` straight to
  float32 (no float16/bfloat16 step);
- llama.cpp's converter permutes the rows of ``attn_q`` / ``attn_k`` so that
  rotary pairs are interleaved (its rope layout); we undo it exactly as
  transformers does. Within each head of ``d = head_dim`` rows::

      HF row order     0, 1, ..., d/2-1 | d/2, ..., d-1    (rotate_half halves)
      GGUF row order   0, d/2, 1, d/2+1, ..., d/2-1, d-1   (interleaved pairs)

  i.e. GGUF viewed as ``[heads, d/2, 2]`` is HF viewed as ``[heads, 2, d/2]``
  with the last two axes swapped; ``_reverse_permute`` swaps them back. Q uses
  the attention head count, K the KV head count.
- the tokenizer is rebuilt from the GGUF metadata by transformers (the same
  code ``AutoTokenizer.from_pretrained(..., gguf_file=...)`` runs) and saved as
  ``tokenizer.json``; ``tokenizer_config.json`` carries the chat template.
  Known divergence, inherited on purpose (transformers is our oracle): for
  the ``smollm`` pre-tokenizer transformers uses the plain GPT-2 split, while
  llama.cpp and SmolLM2's own tokenizer split digits off first. Only
  whitespace runs before a digit tokenize differently: a blank line before
  ``1.`` gives tokens ``Ċ Ċ 1`` here and ``ĊĊ 1`` in the original.

Gemma 3 (``general.architecture == "gemma3"``, text models) differs in three
ways, each as transformers' GGUF loader has it:

- llama.cpp stores every Gemma RMSNorm weight as ``1 + w`` (Gemma's norm
  multiplies by ``1 + w``; llama.cpp's by the weight), so ``w`` is the stored
  value minus 1, in float32, for every ``*norm.weight`` (q/k norms included);
- Q and K are not permuted (Gemma rotates halves, like llama.cpp's NEOX rope);
- the GGUF records neither ``query_pre_attn_scalar``, the local RoPE base nor
  the layer pattern: they take ``Gemma3TextConfig``'s defaults (256, 10000,
  five sliding-window layers then one global). These are the values of every
  Gemma 3 text model but the 27B (scalar 168, head_dim 128), so a GGUF whose
  head_dim is not 256 is refused rather than converted wrong. Rope scaling
  (the 4B and larger models) is refused as for Llama.

Base Gemma 3 GGUFs carry no chat template; the folder then has none either.

Mixtral GGUFs are ``llama`` files with a router (``ffn_gate_inp``) and
stacked experts (``ffn_{gate,up,down}_exps``, ``[experts, rows, cols]``).
transformers' GGUF loader reads them as a dense Llama and drops the experts,
so here the oracle is transformers' ``MixtralForCausalLM`` on the folder: it
holds the checkpoint layout of Mixtral's own releases
(``block_sparse_moe.gate``, ``block_sparse_moe.experts.E.w1 / w3 / w2`` =
gate / up / down, each expert its slice of the stacked tensor), Q / K
un-permuted as for Llama; ``expert_count`` / ``expert_used_count`` give
``num_local_experts`` / ``num_experts_per_tok`` and ``feed_forward_length``
each expert's size. Files of the older layout (one ``ffn_gate.E`` tensor per
expert) are refused.

Supported architectures: ``llama`` (Llama, Mistral, SmolLM and Mixtral GGUFs
use it), ``gemma3``, and (``gguf_families.py``) ``qwen2``, ``qwen3``,
``phi3``, ``gemma2``, ``qwen2moe`` and ``qwen3moe``: every architecture
transformers' GGUF loader reads that our engine serves, and Mixtral.
"""

from __future__ import annotations

import json
import logging
import time
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from workers.model import gguf_families

logger = logging.getLogger(__name__)

# Bump when the output of the conversion changes: cached folders are keyed on it.
CONVERTER_VERSION = 1
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "gemma3", *gguf_families.FAMILY_ARCHITECTURES)
# Tensors of rope scaling (Llama 3.1's rope_freqs, Phi-3's long-context factors): refused.
_ROPE_SCALING_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")

# GGUF tensor name (after ``blk.N.``) -> HF name (after ``model.layers.N.``), per architecture.
_PROJECTIONS = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER_TENSORS = {
    "llama": {
        **_PROJECTIONS,
        "attn_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
    },
    "gemma3": {
        **_PROJECTIONS,
        "attn_norm.weight": "input_layernorm.weight",
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "ffn_norm.weight": "pre_feedforward_layernorm.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
        "attn_q_norm.weight": "self_attn.q_norm.weight",
        "attn_k_norm.weight": "self_attn.k_norm.weight",
    },
}
_LAYER_TENSORS["mixtral"] = {
    **{k: v for k, v in _PROJECTIONS.items() if k.startswith("attn_")},
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate_inp.weight": "block_sparse_moe.gate.weight",
}
_MIXTRAL_EXPERTS = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight")
_MIXTRAL_EXPERT_NAMES = {"gate": "w1", "up": "w3", "down": "w2"}  # Mixtral's checkpoint names
# Gemma 3 fields the GGUF does not record: Gemma3TextConfig's defaults (see the module docstring).
_GEMMA3_HEAD_DIM = 256
_GEMMA3_QUERY_PRE_ATTN_SCALAR = 256
_GEMMA3_LOCAL_ROPE_THETA = 10_000.0
_GEMMA3_SLIDING_WINDOW_PATTERN = 6  # every 6th layer is global
_KEY_ORDER = ("architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "hidden_activation",
              "rms_norm_eps", "max_position_embeddings", "rope_theta", "rope_parameters", "tie_word_embeddings",
              "attention_bias", "mlp_bias")
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Writes the HF-style folder of a GGUF file into ``out_dir`` (which must exist, empty).

    Not atomic by itself: callers write into a temporary folder and rename it
    (see ``loader.resolve_model``).

    Raises:
        ValueError: If the file's architecture or rope scaling is unsupported.
    """
    from gguf import GGUFReader

    start = time.monotonic()
    logger.info("converting %s to %s (once; later loads use the folder)", gguf_path, out_dir)
    reader = GGUFReader(str(gguf_path))
    metadata = _read_metadata(reader)
    config = gguf_to_hf_config(metadata, [t.name for t in reader.tensors])
    tensors = _convert_tensors(reader, config)

    from safetensors.torch import save_file

    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", _generation_config(config))
    _write_tokenizer(gguf_path, out_dir, config)
    logger.info("converted %s in %.1f s", gguf_path.name, time.monotonic() - start)


def _read_metadata(reader: Any) -> dict[str, Any]:
    """Metadata values as Python scalars, strings and lists (the vocabulary is skipped: large)."""
    skip = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.scores", "tokenizer.ggml.token_type")
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key in skip:
            out[key + ".count"] = len(field.data)
            continue
        out[key] = field.contents()
    return out


def gguf_to_hf_config(metadata: dict[str, Any], tensor_names: list[str]) -> dict[str, Any]:
    """HF config fields (``LlamaConfig``, ``Gemma3TextConfig`` or a ``gguf_families`` one) from GGUF metadata.

    Raises:
        ValueError: For an unsupported architecture, rope scaling we cannot
            reproduce, or a Gemma 3 head size whose attention scale the GGUF
            does not record.
    """
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)} "
            "(or pass an HF folder with config.json and safetensors)"
        )
    mixtral = arch == "llama" and bool(metadata.get("llama.expert_count") or any("_exps." in n for n in tensor_names))
    if mixtral and not any(_MIXTRAL_EXPERTS.fullmatch(n) for n in tensor_names):
        raise ValueError(
            "this Mixtral GGUF stores one tensor per expert (blk.N.ffn_gate.E.weight, an older llama.cpp layout); "
            "only stacked experts (ffn_gate_exps / ffn_up_exps / ffn_down_exps) are converted: re-convert it with "
            "a recent llama.cpp, or pass the HF checkpoint folder (MixtralForCausalLM)"
        )
    scaling = metadata.get(f"{arch}.rope.scaling.type")
    if (scaling not in (None, "none")) or any(n in tensor_names for n in _ROPE_SCALING_TENSORS):
        raise ValueError(
            "this GGUF uses rope scaling (rope.scaling.type or a rope_freqs / rope_factors tensor), which the GGUF "
            "conversion does not support; pass the HF checkpoint folder instead"
        )
    heads = int(metadata[f"{arch}.attention.head_count"])
    hidden = int(metadata[f"{arch}.embedding_length"])
    config: dict[str, Any] = {
        "vocab_size": int(metadata.get(f"{arch}.vocab_size") or metadata["tokenizer.ggml.tokens.count"]),
        "hidden_size": hidden,
        "intermediate_size": int(metadata[f"{arch}.feed_forward_length"]),
        "num_hidden_layers": int(metadata[f"{arch}.block_count"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(metadata.get(f"{arch}.attention.head_count_kv", heads)),
        "rms_norm_eps": float(metadata[f"{arch}.attention.layer_norm_rms_epsilon"]),
        "max_position_embeddings": int(metadata[f"{arch}.context_length"]),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": False,
    }
    if arch in gguf_families.FAMILY_ARCHITECTURES:
        config.update(gguf_families.config_fields(arch, metadata, config))
        if gguf_families.drops_attention_bias(arch):
            del config["attention_bias"]
    elif arch == "gemma3":
        config.update(_gemma3_fields(metadata, config))
    else:
        config.update(_llama_fields(metadata, hidden // heads))
        if mixtral:
            config.update(_mixtral_fields(metadata))
    # The order config.json has always had for llama (the rest keeps its place after these).
    config = {k: config[k] for k in sorted(config, key=lambda k: _KEY_ORDER.index(k) if k in _KEY_ORDER else 99)}
    config["torch_dtype"] = "float32"
    for name in ("bos", "eos", "padding"):
        token_id = metadata.get(f"tokenizer.ggml.{name}_token_id")
        if token_id is not None:
            config[f"{'pad' if name == 'padding' else name}_token_id"] = int(token_id)
    return config


def _llama_fields(metadata: dict[str, Any], default_head_dim: int) -> dict[str, Any]:
    theta = float(metadata.get("llama.rope.freq_base", 10000.0))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "head_dim": int(metadata.get("llama.rope.dimension_count") or default_head_dim),
        "hidden_act": "silu",
        "rope_theta": theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "mlp_bias": False,
    }


def _mixtral_fields(metadata: dict[str, Any]) -> dict[str, Any]:
    """MixtralConfig's own fields (module docstring); each expert is ``feed_forward_length`` wide."""
    return {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "num_local_experts": int(metadata["llama.expert_count"]),
        "num_experts_per_tok": int(metadata["llama.expert_used_count"]),
        "sliding_window": None,
    }


def _gemma3_fields(metadata: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's own fields; what the GGUF lacks is Gemma3TextConfig's default (module docstring)."""
    head_dim = int(metadata.get("gemma3.attention.key_length", _GEMMA3_HEAD_DIM))
    if head_dim != _GEMMA3_HEAD_DIM:
        raise ValueError(
            f"this Gemma 3 GGUF has head_dim {head_dim}; the GGUF does not record query_pre_attn_scalar, which "
            f"is {_GEMMA3_QUERY_PRE_ATTN_SCALAR} only for head_dim {_GEMMA3_HEAD_DIM} (the 27B model uses 168): "
            "pass the HF checkpoint folder instead"
        )
    local_theta = float(metadata.get("gemma3.rope.freq_base_swa", _GEMMA3_LOCAL_ROPE_THETA))
    if local_theta != _GEMMA3_LOCAL_ROPE_THETA:
        raise ValueError(f"this Gemma 3 GGUF sets the local RoPE base to {local_theta}; transformers' GGUF loader "
                         f"assumes {_GEMMA3_LOCAL_ROPE_THETA}: pass the HF checkpoint folder instead")
    pattern = _GEMMA3_SLIDING_WINDOW_PATTERN
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "head_dim": head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": _GEMMA3_QUERY_PRE_ATTN_SCALAR,
        "sliding_window": int(metadata.get("gemma3.attention.sliding_window", 4096)),
        "layer_types": ["sliding_attention" if (i + 1) % pattern else "full_attention"
                        for i in range(config["num_hidden_layers"])],
        "rope_parameters": {
            "full_attention": {"rope_type": "default",
                               "rope_theta": float(metadata.get("gemma3.rope.freq_base", 1_000_000.0))},
            "sliding_attention": {"rope_type": "default", "rope_theta": _GEMMA3_LOCAL_ROPE_THETA},
        },
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
    }


def _hf_tensor_name(gguf_name: str, arch: str) -> str:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".", 2)
    layer_tensors = _LAYER_TENSORS[arch]
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in layer_tensors:
        return f"model.layers.{parts[1]}.{layer_tensors[parts[2]]}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no counterpart in a {arch} model; is the file complete?")


def _reverse_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's rope row permutation of a Q or K weight (see the module docstring)."""
    half = weights.shape[0] // num_heads // 2
    w = weights.reshape(num_heads, half, 2, *weights.shape[1:])
    return w.swapaxes(2, 1).reshape(weights.shape)


def _convert_tensors(reader: Any, config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Dequantizes every tensor to float32 and maps it to its HF name."""
    from gguf.quants import dequantize
    from tqdm.auto import tqdm

    arch = {"gemma3_text": "gemma3", "mixtral": "mixtral"}.get(config["model_type"], "llama")
    family = gguf_families.GGUF_ARCH_OF_MODEL_TYPE.get(config["model_type"])
    tensors: dict[str, torch.Tensor] = {}
    for tensor in tqdm(reader.tensors, desc="dequantizing GGUF", unit="tensor", mininterval=1.0):
        if family is not None:  # the other families: one GGUF tensor may be several HF ones (experts)
            for name, weights in gguf_families.hf_tensors(family, tensor.name, dequantize(tensor.data,
                                                                                           tensor.tensor_type)):
                tensors[name] = torch.from_numpy(np.array(weights, dtype=np.float32, order="C"))
            continue
        weights = dequantize(tensor.data, tensor.tensor_type)
        if arch == "mixtral" and (m := _MIXTRAL_EXPERTS.fullmatch(tensor.name)):
            for expert, rows in enumerate(weights):  # [experts, rows, cols]: one tensor per expert
                expert_name = f"model.layers.{m[1]}.block_sparse_moe.experts.{expert}.{_MIXTRAL_EXPERT_NAMES[m[2]]}"
                tensors[expert_name + ".weight"] = torch.from_numpy(np.array(rows, dtype=np.float32, order="C"))
            continue
        name = _hf_tensor_name(tensor.name, arch)
        if arch == "gemma3":
            if tensor.name.endswith("norm.weight"):
                weights = weights - 1  # stored as 1 + w (module docstring); float32 like transformers
        elif name.endswith("self_attn.q_proj.weight"):
            weights = _reverse_permute(weights, config["num_attention_heads"])
        elif name.endswith("self_attn.k_proj.weight"):
            weights = _reverse_permute(weights, config["num_key_value_heads"])
        # np.array copies: the reader's arrays are views of a read-only memory map.
        tensors[name] = torch.from_numpy(np.array(weights, dtype=np.float32, order="C"))
        logger.debug("%s -> %s %s %s", tensor.name, name, tensor.tensor_type.name, tuple(weights.shape))
    logger.info("dequantized %d tensors", len(tensors))
    return tensors


def _generation_config(config: dict[str, Any]) -> dict[str, Any]:
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    return {k: config[k] for k in keys if k in config}


def _write_tokenizer(gguf_path: Path, out_dir: Path, config: dict[str, Any]) -> None:
    """tokenizer.json + tokenizer_config.json, rebuilt from the GGUF by transformers."""
    from transformers import AutoTokenizer

    start = time.monotonic()
    hf_tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    hf_tokenizer.backend_tokenizer.save(str(out_dir / "tokenizer.json"))
    tokenizer_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": config["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "add_bos_token": bool(getattr(hf_tokenizer, "add_bos_token", False)),
        "add_eos_token": bool(getattr(hf_tokenizer, "add_eos_token", False)),
    }
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        value = getattr(hf_tokenizer, name, None)
        if value is not None:
            tokenizer_config[name] = str(value)
    if hf_tokenizer.chat_template:
        tokenizer_config["chat_template"] = hf_tokenizer.chat_template
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    logger.info("rebuilt the tokenizer from GGUF metadata in %.1f s", time.monotonic() - start)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
