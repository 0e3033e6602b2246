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

Only ``general.architecture == "llama"`` files are supported (Llama, Mistral
and SmolLM GGUFs use it).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

# Bump when the output of the conversion changes: cached folders are keyed on it.
CONVERTER_VERSION = 1
SUPPORTED_GGUF_ARCHITECTURES = ("llama",)

# GGUF tensor name (after ``blk.N.``) -> HF name (after ``model.layers.N.``).
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
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
    """HF ``LlamaConfig`` fields from GGUF metadata.

    Raises:
        ValueError: For an architecture other than llama, or rope scaling we
            cannot reproduce.
    """
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)} "
            "(or pass an HF folder with config.json and safetensors)"
        )
    scaling = metadata.get(f"{arch}.rope.scaling.type")
    if (scaling not in (None, "none")) or "rope_freqs.weight" in tensor_names:
        raise ValueError(
            "this GGUF uses rope scaling (rope.scaling.type or a rope_freqs tensor), which the GGUF "
            "conversion does not support; pass the HF checkpoint folder instead"
        )
    heads = int(metadata[f"{arch}.attention.head_count"])
    hidden = int(metadata[f"{arch}.embedding_length"])
    head_dim = int(metadata.get(f"{arch}.rope.dimension_count") or hidden // heads)
    theta = float(metadata.get(f"{arch}.rope.freq_base", 10000.0))
    vocab = int(metadata.get(f"{arch}.vocab_size") or metadata["tokenizer.ggml.tokens.count"])
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(metadata[f"{arch}.feed_forward_length"]),
        "num_hidden_layers": int(metadata[f"{arch}.block_count"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(metadata.get(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(metadata[f"{arch}.attention.layer_norm_rms_epsilon"]),
        "max_position_embeddings": int(metadata[f"{arch}.context_length"]),
        "rope_theta": theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    for name in ("bos", "eos", "padding"):
        token_id = metadata.get(f"tokenizer.ggml.{name}_token_id")
        if token_id is not None:
            config[f"{'pad' if name == 'padding' else name}_token_id"] = int(token_id)
    return config


def _hf_tensor_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no counterpart in a Llama model; is this a Llama GGUF?")


def _reverse_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's rope row permutation of a Q or K weight (see the module docstring)."""
    half = weights.shape[0] // num_heads // 2
    w = weights.reshape(num_heads, half, 2, *weights.shape[1:])
    return w.swapaxes(2, 1).reshape(weights.shape)


def _convert_tensors(reader: Any, config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Dequantizes every tensor to float32 and maps it to its HF name."""
    from gguf.quants import dequantize
    from tqdm.auto import tqdm

    tensors: dict[str, torch.Tensor] = {}
    for tensor in tqdm(reader.tensors, desc="dequantizing GGUF", unit="tensor", mininterval=1.0):
        name = _hf_tensor_name(tensor.name)
        weights = dequantize(tensor.data, tensor.tensor_type)
        if name.endswith("self_attn.q_proj.weight"):
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
