"""Tiny synthetic GGUFs of the families ``gguf_families.py`` converts, laid out
the way llama.cpp writes them: qwen2, qwen3, phi3, gemma2, qwen2moe, qwen3moe
(and ``mixtral``: a llama-architecture file with stacked experts, which
``gguf.py`` converts; ``test_gguf_mixtral.py`` writes one from transformers'
own model).

Every file has 2 layers of hidden size 256 and mixes the storage types real
k-quant files use (Q8_0, Q5_0, F16, Q4_K, Q6_K; F32 norms, biases and
routers; 3-D expert tensors quantized like the rest). Scales are picked so
that greedy decoding does not collapse into repeating one token (it then
checks little). gguf-py cannot quantize to k-quants, so Q4_K / Q6_K tensors are
random blocks with small scales. ``native_types_only`` keeps to the formats
the native kernels run (Q8_0, Q5_0, Q4_K, Q6_K: F16 becomes Q8_0).

Sizes transformers' GGUF loader does not read from the file take its config
classes' defaults here (Qwen3's head_dim 128, Gemma 2's 256, Qwen2-MoE's
expert sizes 1408 / 5632, Qwen3-MoE's 768), or transformers could not load
the file at all.

Qwen files carry a byte-level BPE vocabulary (``gpt2``, with merges and
ChatML specials); Phi-3 and Gemma 2 a SentencePiece-style one.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tests.models.gguf_gemma3_factory import vocabulary as spm_vocabulary

HIDDEN = 256
NUM_LAYERS = 2
SLIDING_WINDOW = 8
FAMILIES = ("qwen2", "qwen3", "phi3", "gemma2", "qwen2moe", "qwen3moe")
# arch -> (heads, kv heads, head_dim, intermediate, experts, experts per token, expert size, shared expert size)
SHAPES = {
    "qwen2": (4, 2, 64, 512, 0, 0, 0, 0),
    "qwen3": (2, 1, 128, 512, 0, 0, 0, 0),
    "phi3": (4, 4, 64, 512, 0, 0, 0, 0),
    "gemma2": (2, 1, 256, 512, 0, 0, 0, 0),
    "qwen2moe": (4, 2, 64, 512, 4, 2, 1408, 5632),
    "qwen3moe": (2, 1, 128, 512, 4, 2, 768, 0),
    "mixtral": (4, 2, 64, 512, 4, 2, 512, 0),
}
CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_BPE_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_BPE_MERGES = ["Ġ t", "h e", "Ġt he", "i n", "e r", "Ġ a", "Ġ w", "o r", "l d", "Ġw or", "Ġwor ld", "l l",
               "Ġ h", "Ġh e", "Ġhe ll", "Ġhell o", "a n", "Ċ Ċ"]


def bpe_vocabulary() -> tuple[list[str], list[int], list[str]]:
    """A byte-level BPE vocabulary: tokens, GGUF token types, merges."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = list(bytes_to_unicode().values())
    for merge in _BPE_MERGES:
        tokens.append(merge.replace(" ", ""))
    types = [1] * len(tokens) + [3] * len(_BPE_SPECIALS)
    return tokens + _BPE_SPECIALS, types, list(_BPE_MERGES)


def write_tiny_gguf(path: Path, arch: str, seed: int = 0, native_types_only: bool = False) -> Path:
    """Writes a synthetic ``arch`` GGUF to ``path`` and returns it."""
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFWriter

    heads, kv_heads, head_dim, inter, experts, top_k, expert_inter, shared_inter = SHAPES[arch]
    gguf_arch = "llama" if arch == "mixtral" else arch
    q5_0, f16 = Q.Q5_0, (Q.Q8_0 if native_types_only else Q.F16)
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), gguf_arch)
    writer.add_name(f"tiny {arch}")
    keys = {"context_length": 1024, "embedding_length": HIDDEN, "block_count": NUM_LAYERS,
            "feed_forward_length": inter, "attention.head_count": heads, "attention.head_count_kv": kv_heads,
            "attention.key_length": head_dim, "attention.value_length": head_dim, "rope.dimension_count": head_dim}
    if experts:
        keys.update({"expert_count": experts, "expert_used_count": top_k, "expert_feed_forward_length": expert_inter})
    if shared_inter:
        keys["expert_shared_feed_forward_length"] = shared_inter
    if arch == "gemma2":
        keys["attention.sliding_window"] = SLIDING_WINDOW
    for key, value in keys.items():
        writer.add_uint32(f"{gguf_arch}.{key}", value)
    writer.add_float32(f"{gguf_arch}.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_float32(f"{gguf_arch}.rope.freq_base", 1_000_000.0 if arch.startswith("qwen") else 10_000.0)
    if arch == "gemma2":
        writer.add_float32("gemma2.attn_logit_softcapping", 50.0)
        writer.add_float32("gemma2.final_logit_softcapping", 30.0)
    _add_vocabulary(writer, arch)

    def add(name: str, shape: tuple[int, ...], kind, std: float = 0.05) -> None:
        data, kwargs = _encode(rng, shape, kind, std)
        writer.add_tensor(name, data, **kwargs)

    vocab = len(bpe_vocabulary()[0] if arch.startswith("qwen") else spm_vocabulary()[0])
    # Gemma scales the embeddings by sqrt(hidden): small ones, or the tied head just repeats the last token.
    add("token_embd.weight", (vocab, HIDDEN), Q.Q8_0, 0.002 if arch == "gemma2" else 0.05)
    writer.add_tensor("output_norm.weight", _norm(rng, HIDDEN, arch))
    if arch not in ("gemma2", "qwen3"):  # gemma2 and qwen3 here: tied embeddings
        add("output.weight", (vocab, HIDDEN), Q.Q8_0)
    q, kv = heads * head_dim, kv_heads * head_dim
    for i in range(NUM_LAYERS):
        p = f"blk.{i}."
        if arch == "phi3":  # fused, as Phi-3's own checkpoints
            add(p + "attn_qkv.weight", (q + 2 * kv, HIDDEN), Q.Q8_0, 0.2)
        else:
            add(p + "attn_q.weight", (q, HIDDEN), q5_0)
            add(p + "attn_k.weight", (kv, HIDDEN), f16)
            add(p + "attn_v.weight", (kv, HIDDEN), Q.Q8_0)
        add(p + "attn_output.weight", (HIDDEN, q), Q.Q4_K)
        if arch in ("qwen2", "qwen2moe"):
            for part, size in (("q", q), ("k", kv), ("v", kv)):
                writer.add_tensor(f"{p}attn_{part}.bias", (0.1 * rng.standard_normal(size)).astype(np.float32))
        if arch in ("qwen3", "qwen3moe"):
            writer.add_tensor(p + "attn_q_norm.weight", _norm(rng, head_dim, arch))
            writer.add_tensor(p + "attn_k_norm.weight", _norm(rng, head_dim, arch))
        norms = ["attn_norm", "ffn_norm"] + (["post_attention_norm", "post_ffw_norm"] if arch == "gemma2" else [])
        for norm in norms:
            writer.add_tensor(f"{p}{norm}.weight", _norm(rng, HIDDEN, arch))
        if experts:
            _add_experts(writer, add, rng, p, experts, expert_inter, shared_inter)
        elif arch == "phi3":
            add(p + "ffn_up.weight", (2 * inter, HIDDEN), q5_0, 0.2)  # gate and up, fused
            add(p + "ffn_down.weight", (HIDDEN, inter), Q.Q6_K)
        else:
            add(p + "ffn_gate.weight", (inter, HIDDEN), q5_0)
            add(p + "ffn_up.weight", (inter, HIDDEN), Q.Q4_K)
            add(p + "ffn_down.weight", (HIDDEN, inter), Q.Q6_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_experts(writer, add, rng, p: str, experts: int, inter: int, shared: int) -> None:
    from gguf import GGMLQuantizationType as Q

    writer.add_tensor(p + "ffn_gate_inp.weight", (0.1 * rng.standard_normal((experts, HIDDEN))).astype(np.float32))
    add(p + "ffn_gate_exps.weight", (experts, inter, HIDDEN), Q.Q4_K)
    add(p + "ffn_up_exps.weight", (experts, inter, HIDDEN), Q.Q8_0)
    down = Q.Q8_0 if inter % 256 else Q.Q6_K  # k-quant rows are multiples of 256
    add(p + "ffn_down_exps.weight", (experts, HIDDEN, inter), down)
    if shared:
        writer.add_tensor(p + "ffn_gate_inp_shexp.weight", (0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
        add(p + "ffn_gate_shexp.weight", (shared, HIDDEN), Q.Q4_K)
        add(p + "ffn_up_shexp.weight", (shared, HIDDEN), Q.Q8_0)
        add(p + "ffn_down_shexp.weight", (HIDDEN, shared), Q.Q8_0)


def _add_vocabulary(writer, arch: str) -> None:
    if arch.startswith("qwen") or arch == "mixtral":
        tokens, types, merges = bpe_vocabulary()
        writer.add_string("tokenizer.ggml.model", "gpt2")
        writer.add_string("tokenizer.ggml.pre", "qwen2")
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges)
        end, im_end = tokens.index("<|endoftext|>"), tokens.index("<|im_end|>")
        writer.add_bos_token_id(end)
        writer.add_eos_token_id(im_end)
        writer.add_pad_token_id(end)
        writer.add_add_bos_token(False)
        writer.add_chat_template(CHATML)
        return
    tokens, types = spm_vocabulary()
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


def _norm(rng: np.random.Generator, size: int, arch: str) -> np.ndarray:
    """A norm weight; Gemma's as llama.cpp stores it: 1 + w."""
    return (1.0 + 0.1 * rng.standard_normal(size)).astype(np.float32)


def _encode(rng: np.random.Generator, shape: tuple[int, ...], kind, std: float = 0.05) -> tuple[np.ndarray, dict]:
    """The tensor's bytes (or float16 values) and ``add_tensor``'s keyword arguments."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quantize

    if kind == Q.F16:
        return (std * rng.standard_normal(shape)).astype(np.float16), {}
    if kind in (Q.Q8_0, Q.Q5_0):
        return quantize((std * rng.standard_normal(shape)).astype(np.float32), kind), {"raw_dtype": kind}
    block_bytes = {Q.Q4_K: 144, Q.Q6_K: 210}[kind]
    blocks = rng.integers(0, 256, size=(*shape[:-1], shape[-1] // 256, block_bytes), dtype=np.uint8)
    if kind == Q.Q4_K:  # d, dmin (float16) open the block
        blocks[..., 0:2] = np.frombuffer(np.float16(1e-4).tobytes(), np.uint8)
        blocks[..., 2:4] = np.frombuffer(np.float16(5e-5).tobytes(), np.uint8)
    else:  # Q6_K: d (float16) closes it
        blocks[..., 208:210] = np.frombuffer(np.float16(2e-5).tobytes(), np.uint8)
    return blocks.reshape(*shape[:-1], -1), {"raw_dtype": kind}
