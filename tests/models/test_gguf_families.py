"""GGUF conversion of Qwen2, Qwen3, Phi-3, Gemma 2, Qwen2-MoE and Qwen3-MoE
against transformers' own GGUF loader, on tiny synthetic files
(``gguf_families_factory.py``: k-quant, Q8_0, Q5_0, F16 and F32 tensors;
byte-level BPE or SentencePiece vocabularies).

Per family: the converted folder holds exactly the tensors and config values
``from_pretrained(gguf_file=...)`` produces (each routed expert its slice of
transformers' stacked expert tensors), its tokenizer encodes, decodes and
renders the chat template like transformers' GGUF tokenizer, and our engine
(``LLM`` on the folder) picks transformers' greedy tokens on the GGUF model.
Then what is refused (Mixtral's per-expert layout, values the GGUF does not record), and
``quantization="gguf"`` over the files' own blocks.
"""

from __future__ import annotations

import pytest
import torch

from tests.models.gguf_families_factory import CHATML, FAMILIES, SLIDING_WINDOW, write_tiny_gguf
from workers.model.gguf import SUPPORTED_GGUF_ARCHITECTURES, gguf_to_hf_config
from workers.model.loader import convert_gguf_cached

TEXTS = ["hello world", "the  answer\nis in there", "Ünïcode 🤖 bytes", "<|im_start|>user\nhi<|im_end|>", ""]
PROMPTS = ["hello world", "the world is", "an answer in the", "hello hello hello the world and the"]
NUM_TOKENS = 8
CONFIG_KEYS = ["model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings",
               "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "rope_parameters",
               "hidden_act", "use_sliding_window", "layer_types", "attention_bias", "sliding_window",
               "query_pre_attn_scalar", "hidden_activation", "attn_logit_softcapping", "final_logit_softcapping",
               "num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
               "shared_expert_intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
               "qkv_bias", "partial_rotary_factor"]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(arch, GGUF path, converted folder, transformers' model of the GGUF)."""
    from transformers import AutoModelForCausalLM

    arch = request.param
    path = write_tiny_gguf(tmp_path_factory.mktemp(f"gguf-{arch}") / f"tiny-{arch}.gguf", arch)
    folder = convert_gguf_cached(path, tmp_path_factory.mktemp(f"cache-{arch}"))
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    return arch, path, folder, hf


def _reference_tensors(hf) -> dict[str, torch.Tensor]:
    """transformers' state dict with stacked experts sliced per expert (the folder's layout)."""
    out = {}
    for name, tensor in hf.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):
            gate, up = tensor.chunk(2, dim=1)
            for e in range(tensor.shape[0]):
                out[f"{name[:-len('gate_up_proj')]}{e}.gate_proj.weight"] = gate[e]
                out[f"{name[:-len('gate_up_proj')]}{e}.up_proj.weight"] = up[e]
        elif name.endswith("mlp.experts.down_proj"):
            for e in range(tensor.shape[0]):
                out[f"{name[:-len('down_proj')]}{e}.down_proj.weight"] = tensor[e]
        else:
            out[name] = tensor
    return out


def test_tensors_equal_transformers_gguf_loader(family) -> None:
    from safetensors.torch import load_file

    arch, _, folder, hf = family
    ours = load_file(folder / "model.safetensors")
    reference = _reference_tensors(hf)
    tied = hf.config.tie_word_embeddings
    assert set(ours) == set(reference) - ({"lm_head.weight"} if tied else set()), arch
    for name, tensor in reference.items():
        mine = ours["model.embed_tokens.weight" if (tied and name == "lm_head.weight") else name]
        assert mine.dtype == torch.float32 and torch.equal(mine, tensor), (arch, name)


def test_config_matches_transformers_gguf_config(family) -> None:
    from transformers import AutoConfig

    from workers.model.loader import read_arch

    arch, _, folder, hf = family
    ours, theirs = AutoConfig.from_pretrained(folder), hf.config
    missing = object()
    keys = [k for k in CONFIG_KEYS if getattr(theirs, k, missing) is not missing]
    if arch == "qwen2moe":  # transformers' GGUF path leaves 0 here; both mean "no window" (use_sliding_window)
        keys.remove("sliding_window")
    assert {k: getattr(ours, k, missing) for k in keys} == {k: getattr(theirs, k) for k in keys}
    assert type(ours) is type(theirs)
    read_arch(folder)  # our engine parses it
    if arch == "gemma2":
        assert ours.sliding_window == SLIDING_WINDOW and ours.layer_types == ["sliding_attention", "full_attention"]


def test_tokenizer_and_chat_template_match_transformers_gguf_tokenizer(family) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    arch, path, folder, _ = family
    reference = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ours = Tokenizer.from_file(str(folder / "tokenizer.json"))
    for text in TEXTS:
        ids = ours.encode(text).ids
        assert ids == reference.encode(text), (arch, text)
        assert ours.decode(ids, skip_special_tokens=False) == reference.decode(ids), (arch, text)
    if arch.startswith("qwen"):
        messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "the world"}]
        kwargs = dict(tokenize=False, add_generation_prompt=True)
        rendered = AutoTokenizer.from_pretrained(folder).apply_chat_template(messages, **kwargs)
        assert rendered == reference.apply_chat_template(messages, **kwargs)
        assert rendered.startswith("<|im_start|>user\nhello<|im_end|>\n") and reference.chat_template == CHATML


@torch.inference_mode()
def test_our_greedy_tokens_equal_transformers_on_the_gguf(family) -> None:
    """Teacher-forced (transformers' argmax after our prefix is our next token at every step), and one
    ``generate``; the last prompt runs past Gemma 2's sliding window."""
    from transformers import GenerationConfig

    from cluster.shared.types import SamplingParams
    from workers.llm import LLM

    arch, _, folder, hf = family
    with LLM(str(folder), dtype="float32") as llm:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True))
    assert len(outs[-1].prompt_token_ids) > SLIDING_WINDOW
    for prompt, out in zip(PROMPTS, outs):
        ids, tokens = list(out.prompt_token_ids), list(out.token_ids)
        assert len(tokens) == NUM_TOKENS
        logits = hf(torch.tensor([ids + tokens[:-1]])).logits[0, len(ids) - 1:]
        assert logits.argmax(-1).tolist() == tokens, (arch, prompt)
    ids, tokens = list(outs[0].prompt_token_ids), list(outs[0].token_ids)
    config = GenerationConfig(max_new_tokens=NUM_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    hf.generation_config.eos_token_id = None  # else generate merges the GGUF's EOS back in (ours ignored it)
    assert hf.generate(torch.tensor([ids]), generation_config=config)[0, len(ids):].tolist() == tokens, arch


def _metadata(arch: str, **overrides):
    base = {"general.architecture": arch, f"{arch}.attention.head_count": 8, f"{arch}.embedding_length": 2048,
            f"{arch}.feed_forward_length": 8192, f"{arch}.block_count": 4, f"{arch}.context_length": 4096,
            f"{arch}.attention.layer_norm_rms_epsilon": 1e-6, "tokenizer.ggml.tokens.count": 1000}
    return {**base, **overrides}


def test_what_is_refused_says_what_is_supported() -> None:
    assert SUPPORTED_GGUF_ARCHITECTURES == ("llama", "gemma3", *FAMILIES)
    mixtral = _metadata("llama", **{"llama.expert_count": 8, "llama.expert_used_count": 2})
    with pytest.raises(ValueError, match="one tensor per expert"):  # Mixtral's older layout (stacked: converted)
        gguf_to_hf_config(mixtral, ["blk.0.ffn_gate.0.weight"])
    assert gguf_to_hf_config(mixtral, ["blk.0.ffn_gate_exps.weight"])["model_type"] == "mixtral"  # test_gguf_mixtral
    with pytest.raises(ValueError, match="not supported; supported: llama, gemma3, qwen2, qwen3, phi3, gemma2"):
        gguf_to_hf_config(_metadata("falcon"), [])
    with pytest.raises(ValueError, match="query_pre_attn_scalar"):  # Gemma 2 27B's head size
        gguf_to_hf_config(_metadata("gemma2", **{"gemma2.attention.key_length": 128}), [])
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        gguf_to_hf_config(_metadata("gemma2", **{"gemma2.attn_logit_softcapping": 40.0}), [])
    with pytest.raises(ValueError, match="partial rotary"):  # Phi-4-mini
        gguf_to_hf_config(_metadata("phi3", **{"phi3.rope.dimension_count": 192}), [])
    with pytest.raises(ValueError, match="rope scaling"):  # Phi-3 128k (longrope)
        gguf_to_hf_config(_metadata("phi3"), ["rope_factors_long.weight", "rope_factors_short.weight"])
    config = gguf_to_hf_config(_metadata("qwen2moe", **{"qwen2moe.expert_count": 60, "qwen2moe.expert_used_count": 4,
                                                       "qwen2moe.expert_feed_forward_length": 2560}), [])
    assert (config["moe_intermediate_size"], config["shared_expert_intermediate_size"]) == (2560, 5632)


@pytest.mark.parametrize("arch", FAMILIES)
def test_gguf_quantization_runs_the_files_blocks(arch, tmp_path) -> None:
    """``quantization="gguf"``: every linear layer runs the file's blocks (Q / K rows as stored, Phi-3's
    fused qkv and gate+up as they are, each expert its slice of the stacked expert tensors) and equals the
    converted float layer; the MoE routers stay float."""
    from workers.model import qgemm
    from workers.model.attention.torch_backend import TorchAttentionBackend
    from workers.model.linear import Linear
    from workers.model.loader import load_model

    if qgemm.load() is None:
        pytest.skip("no native quantized kernel here")
    path = write_tiny_gguf(tmp_path / "native.gguf", arch, seed=1, native_types_only=True)
    folder = convert_gguf_cached(path, tmp_path / "cache")
    backend = TorchAttentionBackend()
    float_model, _ = load_model(folder, "float32", "cpu", backend)
    model, _ = load_model(folder, "float32", "cpu", backend, quantization="gguf", gguf_path=path)
    floats = {n: m for n, m in float_model.named_modules() if isinstance(m, Linear)}
    linears = {n: m for n, m in model.named_modules() if isinstance(m, Linear)}
    quantized = {n: m for n, m in linears.items() if m.quant is not None}
    names = {m.quant.name for m in quantized.values()}
    assert {"q8_0", "q4_k"} <= names  # and q6_k but in qwen2moe
    assert any("q5_0" in name for name in names)  # the 5-bit kernel runs the file's Q5_0 (fused: the widest type)
    # Every projection of both layers (each expert's, the shared expert's) and the LM head; routers stay float.
    assert set(quantized) == {n for n, m in linears.items() if not getattr(m, "keep_float", False)}
    assert len(quantized) == {"qwen2moe": 2 * (2 + 4 * 2 + 2) + 1, "qwen3moe": 2 * (2 + 4 * 2) + 1}.get(arch, 9)
    for name, layer in quantized.items():
        ids = torch.arange(layer.out_features)
        reference = floats[name].packed.rows(ids) if floats[name].packed is not None else floats[name].weight
        assert torch.equal(layer.quant.dequantized_rows(ids), reference.detach()), (arch, name)
