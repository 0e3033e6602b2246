"""A tiny synthetic Gemma 3 GGUF, written the way llama.cpp lays one out.

``write_tiny_gemma3_gguf`` writes a random 7-layer model (hidden 256,
head_dim 256: the only head size the converter accepts) whose tensors cover
every storage type the real Q4_K_M files use::

    token_embd      Q8_0          attn_q / ffn_gate   Q5_0
    attn_k          F16           attn_v              Q8_0
    attn_output     Q4_K          ffn_up              Q4_K
    ffn_down        Q6_K          *norm.weight        F32, stored as 1 + w

gguf-py cannot quantize to k-quants, so Q4_K / Q6_K tensors are random
blocks with small scales: valid files whose values are whatever the blocks
decode to. The vocabulary is a small SentencePiece-style one (specials,
byte fallback, a few pieces, a run of spaces stored as spaces, as Gemma's
GGUFs do) with Gemma's chat template.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

HIDDEN = 256
INTERMEDIATE = 512
NUM_LAYERS = 7  # layers 0-4 sliding, 5 global, 6 sliding
NUM_HEADS = 2
NUM_KV_HEADS = 1
HEAD_DIM = 256
SLIDING_WINDOW = 8
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>"
    "{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{{ message['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
_PIECES = ["\u2581", *"abcdefghijklmnopqrstuvwxyz", "\n", "  ", "\u2581t", "th", "he", "\u2581the", "in", "er",
           "\u2581a", "an", "\u2581w", "or", "ld", "\u2581world", "\u2581hello", "ll", "lo"]
_TYPE_NORMAL, _TYPE_UNKNOWN, _TYPE_CONTROL, _TYPE_BYTE = 1, 2, 3, 6


def vocabulary() -> tuple[list[str], list[int]]:
    """Tokens and their GGUF token types."""
    tokens = _SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + _PIECES
    types = ([_TYPE_CONTROL, _TYPE_CONTROL, _TYPE_CONTROL, _TYPE_UNKNOWN, _TYPE_CONTROL, _TYPE_CONTROL]
             + [_TYPE_BYTE] * 256 + [_TYPE_NORMAL] * len(_PIECES))
    return tokens, types


def write_tiny_gemma3_gguf(path: Path, seed: int = 0, native_types_only: bool = False) -> Path:
    """Writes the synthetic GGUF to ``path`` and returns it.

    Args:
        native_types_only: Q8_0 instead of F16 (Q5_0 stays: the 5-bit kernel runs it), so that every
            linear layer has a native kernel (``quantization="gguf"``).
    """
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFWriter

    q5_0, f16 = Q.Q5_0, (Q.Q8_0 if native_types_only else Q.F16)

    rng = np.random.default_rng(seed)
    tokens, types = vocabulary()
    writer = GGUFWriter(str(path), "gemma3")
    writer.add_name("tiny gemma3")
    for key, value in {"context_length": 1024, "embedding_length": HIDDEN, "block_count": NUM_LAYERS,
                       "feed_forward_length": INTERMEDIATE, "attention.head_count": NUM_HEADS,
                       "attention.head_count_kv": NUM_KV_HEADS, "attention.key_length": HEAD_DIM,
                       "attention.value_length": HEAD_DIM, "attention.sliding_window": SLIDING_WINDOW}.items():
        writer.add_uint32(f"gemma3.{key}", value)
    writer.add_float32("gemma3.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_float32("gemma3.rope.freq_base", 1_000_000.0)
    writer.add_string("tokenizer.ggml.model", "llama")
    writer.add_string("tokenizer.ggml.pre", "default")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_types(types)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    def add(name: str, shape: tuple[int, int], kind: Q) -> None:
        data, kwargs = _encode(rng, shape, kind)
        writer.add_tensor(name, data, **kwargs)

    add("token_embd.weight", (len(tokens), HIDDEN), Q.Q8_0)
    writer.add_tensor("output_norm.weight", _norm(rng, HIDDEN))
    for i in range(NUM_LAYERS):
        p = f"blk.{i}."
        add(p + "attn_q.weight", (NUM_HEADS * HEAD_DIM, HIDDEN), q5_0)
        add(p + "attn_k.weight", (NUM_KV_HEADS * HEAD_DIM, HIDDEN), f16)
        add(p + "attn_v.weight", (NUM_KV_HEADS * HEAD_DIM, HIDDEN), Q.Q8_0)
        add(p + "attn_output.weight", (HIDDEN, NUM_HEADS * HEAD_DIM), Q.Q4_K)
        add(p + "ffn_gate.weight", (INTERMEDIATE, HIDDEN), q5_0)
        add(p + "ffn_up.weight", (INTERMEDIATE, HIDDEN), Q.Q4_K)
        add(p + "ffn_down.weight", (HIDDEN, INTERMEDIATE), Q.Q6_K)
        for norm, size in (("attn_norm", HIDDEN), ("post_attention_norm", HIDDEN), ("ffn_norm", HIDDEN),
                           ("post_ffw_norm", HIDDEN), ("attn_q_norm", HEAD_DIM), ("attn_k_norm", HEAD_DIM)):
            writer.add_tensor(f"{p}{norm}.weight", _norm(rng, size))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _norm(rng: np.random.Generator, size: int) -> np.ndarray:
    """A Gemma norm weight as llama.cpp stores it: 1 + w."""
    return (1.0 + 0.1 * rng.standard_normal(size)).astype(np.float32)


def _encode(rng: np.random.Generator, shape: tuple[int, int], kind) -> tuple[np.ndarray, dict]:
    """The tensor's bytes (or float16 values) and ``add_tensor``'s keyword arguments."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quantize

    if kind == Q.F16:
        return (0.05 * rng.standard_normal(shape)).astype(np.float16), {}
    if kind in (Q.Q8_0, Q.Q5_0):
        return quantize((0.05 * rng.standard_normal(shape)).astype(np.float32), kind), {"raw_dtype": kind}
    rows, cols = shape
    block_bytes = {Q.Q4_K: 144, Q.Q6_K: 210}[kind]
    blocks = rng.integers(0, 256, size=(rows, cols // 256, block_bytes), dtype=np.uint8)
    if kind == Q.Q4_K:  # d, dmin (float16) open the block
        blocks[..., 0:2] = np.frombuffer(np.float16(1e-4).tobytes(), np.uint8)
        blocks[..., 2:4] = np.frombuffer(np.float16(5e-5).tobytes(), np.uint8)
    else:  # Q6_K: d (float16) closes it
        blocks[..., 208:210] = np.frombuffer(np.float16(2e-5).tobytes(), np.uint8)
    return blocks.reshape(rows, -1), {"raw_dtype": kind}
