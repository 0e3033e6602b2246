"""A transformers Mixtral model written as a GGUF the way llama.cpp's converter
writes one, so that ``bench latency --compare llama.cpp`` can run our engine
and llama.cpp on the same mixture-of-experts file (``bench moe --write-gguf``).

Layout (``general.architecture = llama``)::

    token_embd, output           [vocab, hidden]       Q8_0 (or F32)
    blk.N.attn_q / attn_k        rows permuted as llama.cpp's converter does
                                 (interleaved rotary pairs; ``gguf.py`` undoes it)
    blk.N.attn_v / attn_output   Q8_0
    blk.N.ffn_gate_inp           [experts, hidden]     F32 (the router)
    blk.N.ffn_gate_exps / _up    [experts, inter, hidden]  ``expert_type`` (Q5_0 by default)
    blk.N.ffn_down_exps          [experts, hidden, inter]  Q8_0
    norms                        F32

The vocabulary comes from a callback (another GGUF's ``tokenizer.*`` fields:
``copy_tokenizer``), since the file must tokenize for both engines.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np


def copy_tokenizer(src: Path) -> Callable[[Any], None]:
    """A callback that copies every ``tokenizer.*`` field of the GGUF ``src`` into a writer."""

    def add(writer: Any) -> None:
        import gguf

        reader = gguf.GGUFReader(str(src))
        for key, field in reader.fields.items():
            if key.startswith("tokenizer."):
                main = field.types[0]
                sub = field.types[-1] if main == gguf.GGUFValueType.ARRAY else None
                writer.add_key_value(key, field.contents(), main, sub)

    return add


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's Q / K row order (interleaved rotary pairs)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_mixtral_gguf(model: Any, path: Path, add_vocabulary: Callable[[Any], None],
                       expert_type: str = "Q5_0", other_type: str = "Q8_0") -> Path:
    """Writes ``model`` (a transformers ``MixtralForCausalLM``) to ``path`` (module doc).

    Args:
        expert_type / other_type: GGUF types (``F32``, ``Q8_0``, ``Q5_0``, ...) of the
            experts' gate / up tensors and of the other matrices; vectors stay F32.
    """
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    c = model.config
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    heads, kv_heads = c.num_attention_heads, c.num_key_value_heads
    writer = GGUFWriter(str(path), "llama")
    for key, value in {"context_length": c.max_position_embeddings, "embedding_length": c.hidden_size,
                       "block_count": c.num_hidden_layers, "feed_forward_length": c.intermediate_size,
                       "attention.head_count": heads, "attention.head_count_kv": kv_heads,
                       "rope.dimension_count": c.hidden_size // heads, "expert_count": c.num_local_experts,
                       "expert_used_count": c.num_experts_per_tok, "vocab_size": c.vocab_size}.items():
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", c.rms_norm_eps)
    writer.add_float32("llama.rope.freq_base", float(c.rope_parameters["rope_theta"]))
    add_vocabulary(writer)

    def add(name: str, w: np.ndarray, type_name: str = other_type) -> None:
        kind = GGMLQuantizationType[type_name]
        if w.ndim < 2 or kind == GGMLQuantizationType.F32:
            writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float32))
        else:
            writer.add_tensor(name, quantize(np.ascontiguousarray(w), kind), raw_dtype=kind)

    add("token_embd.weight", state["model.embed_tokens.weight"])
    add("output_norm.weight", state["model.norm.weight"])
    add("output.weight", state["lm_head.weight"])
    for i in range(c.num_hidden_layers):
        hf, p = f"model.layers.{i}.", f"blk.{i}."
        add(p + "attn_q.weight", _permute(state[hf + "self_attn.q_proj.weight"], heads))
        add(p + "attn_k.weight", _permute(state[hf + "self_attn.k_proj.weight"], kv_heads))
        add(p + "attn_v.weight", state[hf + "self_attn.v_proj.weight"])
        add(p + "attn_output.weight", state[hf + "self_attn.o_proj.weight"])
        add(p + "attn_norm.weight", state[hf + "input_layernorm.weight"])
        add(p + "ffn_norm.weight", state[hf + "post_attention_layernorm.weight"])
        add(p + "ffn_gate_inp.weight", state[hf + "mlp.gate.weight"], "F32")
        gate, up = np.split(state[hf + "mlp.experts.gate_up_proj"], 2, axis=1)  # [E, 2 * I, H]
        add(p + "ffn_gate_exps.weight", gate, expert_type)
        add(p + "ffn_up_exps.weight", up, expert_type)
        add(p + "ffn_down_exps.weight", state[hf + "mlp.experts.down_proj"])  # [E, H, I]
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
