"""A random EAGLE-3 checkpoint written from vLLM's published layout
(``Eagle3LlamaForCausalLM``: ``midlayer.`` names, ``fc`` over three target
layers' features, qkv over [embed; feature], its own norm and LM head over a
draft vocabulary, ``d2t`` / ``t2d``), not by our own ``save``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import save_file

from tests.factories import TINY


def write_vllm_eagle3(folder: Path, seed: int = 0, hidden: int = TINY["hidden_size"], vocab: int = TINY["vocab_size"],
                      draft_vocab: int = 128, layer_ids: Optional[list[int]] = None, own_embed: bool = False,
                      scale: float = 0.2, midlayer: bool = True) -> Path:
    """Writes the checkpoint; ``layer_ids`` None leaves vLLM's default choice
    (2, L // 2, L - 3) to the reader. The draft vocabulary is every
    ``vocab // draft_vocab``-th target id, so ``d2t`` holds real offsets."""
    g = torch.Generator().manual_seed(seed)
    heads, kv_heads, inter = TINY["num_attention_heads"], TINY["num_key_value_heads"], TINY["intermediate_size"]
    d = hidden // heads

    def rand(*shape):
        return (torch.randn(*shape, generator=g) * scale).contiguous()

    layer = "midlayer." if midlayer else "layers.0."
    ids = torch.arange(draft_vocab) * max(1, vocab // draft_vocab)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids[ids < vocab]] = True
    tensors = {"fc.weight": rand(hidden, 3 * hidden), "norm.weight": 1 + rand(hidden),
               "lm_head.weight": rand(draft_vocab, hidden) * 5, "d2t": ids - torch.arange(draft_vocab), "t2d": t2d,
               f"{layer}input_layernorm.weight": 1 + rand(hidden), f"{layer}hidden_norm.weight": 1 + rand(hidden),
               f"{layer}self_attn.q_proj.weight": rand(heads * d, 2 * hidden),
               f"{layer}self_attn.k_proj.weight": rand(kv_heads * d, 2 * hidden),
               f"{layer}self_attn.v_proj.weight": rand(kv_heads * d, 2 * hidden),
               f"{layer}self_attn.o_proj.weight": rand(hidden, heads * d),
               f"{layer}post_attention_layernorm.weight": 1 + rand(hidden),
               f"{layer}mlp.gate_proj.weight": rand(inter, hidden),
               f"{layer}mlp.up_proj.weight": rand(inter, hidden),
               f"{layer}mlp.down_proj.weight": rand(hidden, inter)}
    if own_embed:
        tensors["embed_tokens.weight"] = rand(vocab, hidden) * 5
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": hidden,
              "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "num_hidden_layers": 1, "rms_norm_eps": TINY["rms_norm_eps"], "rope_theta": 10000.0,
              "max_position_embeddings": TINY["max_position_embeddings"], "vocab_size": vocab,
              "draft_vocab_size": draft_vocab, "target_hidden_size": hidden, "hidden_act": "silu",
              "tie_word_embeddings": False, "torch_dtype": "float32"}
    if layer_ids is not None:
        config["eagle_aux_hidden_state_layer_ids"] = layer_ids
    (folder / "config.json").write_text(json.dumps(config))
    return folder
