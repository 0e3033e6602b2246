"""Gemma 3 GGUF conversion against transformers' own GGUF loader, on a tiny
synthetic file (``gguf_gemma3_factory.py``: k-quant, Q8_0, Q5_0, F16 and F32
tensors, a SentencePiece-style vocabulary, Gemma's chat template).

The converted folder must hold exactly the tensors and config values
``from_pretrained(gguf_file=...)`` produces, its tokenizer must encode and
render the chat template like transformers' GGUF tokenizer, and our model on
it must give transformers' logits on a prompt longer than the sliding window.
The real model (Gemma 3 270M, Q4_K_M) is ``test_gemma3_270m.py``.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.models.conftest import PagedDriver, hf_logits
from tests.models.gguf_gemma3_factory import CHAT_TEMPLATE, NUM_LAYERS, SLIDING_WINDOW, write_tiny_gemma3_gguf
from workers.model.gguf import gguf_to_hf_config
from workers.model.loader import convert_gguf_cached, load_model

TEXTS = ["hello world", "the  answer\nis in there", "Ünïcode 🤖 bytes", "<start_of_turn>user\nhi<end_of_turn>", ""]


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    return write_tiny_gemma3_gguf(tmp_path_factory.mktemp("gguf") / "tiny-gemma3.gguf")


@pytest.fixture(scope="module")
def converted(gguf_path, tmp_path_factory):
    return convert_gguf_cached(gguf_path, tmp_path_factory.mktemp("prefixserve-cache"))


@pytest.fixture(scope="module")
def hf_from_gguf(gguf_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                dtype=torch.float32).eval()


def test_tensors_equal_transformers_gguf_loader(converted, hf_from_gguf) -> None:
    from safetensors.torch import load_file

    ours = load_file(converted / "model.safetensors")
    reference = hf_from_gguf.state_dict()
    assert set(ours) == set(reference) - {"lm_head.weight"}  # tied: stored once
    for name, tensor in reference.items():
        mine = ours["model.embed_tokens.weight" if name == "lm_head.weight" else name]
        assert mine.dtype == torch.float32 and torch.equal(mine, tensor), name
    # Norms are stored as 1 + w: the folder holds w (near 0), as Gemma3RMSNorm wants.
    assert ours["model.layers.0.self_attn.q_norm.weight"].abs().mean() < 0.5


def test_config_matches_transformers_gguf_config(converted, hf_from_gguf) -> None:
    from transformers import AutoConfig

    ours = AutoConfig.from_pretrained(converted)
    theirs = hf_from_gguf.config
    keys = [
        "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
        "bos_token_id", "eos_token_id", "pad_token_id", "rope_parameters", "sliding_window", "layer_types",
        "query_pre_attn_scalar", "hidden_activation", "attn_logit_softcapping", "final_logit_softcapping",
    ]
    assert {k: getattr(ours, k) for k in keys} == {k: getattr(theirs, k) for k in keys}
    assert ours.layer_types[5] == "full_attention" and ours.layer_types.count("full_attention") == 1
    assert ours.sliding_window == SLIDING_WINDOW and ours.num_hidden_layers == NUM_LAYERS


def test_tokenizer_and_chat_template_match_transformers_gguf_tokenizer(converted, gguf_path) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    ours = Tokenizer.from_file(str(converted / "tokenizer.json"))
    for text in TEXTS:
        ids = ours.encode(text).ids
        assert ids == reference.encode(text), text
        assert ours.decode(ids, skip_special_tokens=False) == reference.decode(ids), text
    assert json.loads((converted / "tokenizer_config.json").read_text())["chat_template"] == CHAT_TEMPLATE
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "the world"}]
    kwargs = dict(tokenize=False, add_generation_prompt=True)
    rendered = AutoTokenizer.from_pretrained(converted).apply_chat_template(messages, **kwargs)
    assert rendered == reference.apply_chat_template(messages, **kwargs)
    assert rendered.startswith("<bos><start_of_turn>user\nhello<end_of_turn>\n")


def test_our_model_matches_transformers_past_the_sliding_window(converted) -> None:
    from transformers import AutoModelForCausalLM

    from workers.model.attention.torch_backend import TorchAttentionBackend

    hf = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    model, arch = load_model(converted, "float32", "cpu", TorchAttentionBackend())
    assert arch.family == "gemma3" and arch.query_pre_attn_scalar == 256
    prompt = [2] + [7 + (i * 37) % 300 for i in range(3 * SLIDING_WINDOW)]
    driver = PagedDriver(model, num_blocks=32, block_size=4)
    logits = driver.step({"a": prompt})["a"]
    torch.testing.assert_close(logits, hf_logits(hf, prompt), atol=1e-4, rtol=1e-4)
    tokens = list(prompt)
    for _ in range(4):  # decode steps attend through the window as well
        tokens.append(int(logits[-1].argmax()))
        logits = driver.step({"a": tokens[-1:]})["a"]
        torch.testing.assert_close(logits[-1], hf_logits(hf, tokens)[-1], atol=1e-4, rtol=1e-4)


def _metadata(**overrides):
    base = {"general.architecture": "gemma3", "gemma3.attention.head_count": 4, "gemma3.embedding_length": 640,
            "gemma3.feed_forward_length": 2048, "gemma3.block_count": 18, "gemma3.context_length": 32768,
            "gemma3.attention.layer_norm_rms_epsilon": 1e-6, "gemma3.attention.key_length": 256,
            "tokenizer.ggml.tokens.count": 262144}
    return {**base, **overrides}


def test_config_of_gemma3_metadata_and_what_is_refused() -> None:
    config = gguf_to_hf_config(_metadata(), ["token_embd.weight"])
    assert config["architectures"] == ["Gemma3ForCausalLM"] and config["tie_word_embeddings"] is True
    assert config["sliding_window"] == 4096  # Gemma3TextConfig's default when the file has none
    assert config["rope_parameters"]["sliding_attention"]["rope_theta"] == 10_000.0
    with pytest.raises(ValueError, match="query_pre_attn_scalar"):  # the 27B model's head size
        gguf_to_hf_config(_metadata(**{"gemma3.attention.key_length": 128}), [])
    with pytest.raises(ValueError, match="rope scaling"):  # the 4B and larger models
        gguf_to_hf_config(_metadata(**{"gemma3.rope.scaling.type": "linear"}), [])
    with pytest.raises(ValueError, match="local RoPE base"):
        gguf_to_hf_config(_metadata(**{"gemma3.rope.freq_base_swa": 20_000.0}), [])


def test_gguf_quantization_runs_the_files_blocks_without_the_llama_permutation(tmp_path) -> None:
    """``quantization="gguf"`` reads the linear layers' blocks from the file: Q / K rows as stored
    (llama.cpp permutes them for llama files only), every layer equal to the converted float one."""
    from workers.model import qgemm
    from workers.model.attention.torch_backend import TorchAttentionBackend
    from workers.model.linear import Linear

    if qgemm.load() is None:
        pytest.skip("no native quantized kernel here")
    path = write_tiny_gemma3_gguf(tmp_path / "native.gguf", seed=1, native_types_only=True)
    folder = convert_gguf_cached(path, tmp_path / "cache")
    float_model, _ = load_model(folder, "float32", "cpu", TorchAttentionBackend())
    model, _ = load_model(folder, "float32", "cpu", TorchAttentionBackend(), quantization="gguf", gguf_path=path)
    floats = {n: m for n, m in float_model.named_modules() if isinstance(m, Linear)}
    quantized = {n: m for n, m in model.named_modules() if isinstance(m, Linear)}
    assert {m.quant.name for m in quantized.values()} == {"q8_0", "q4_k", "q6_k", "q4_k+q5_0", "q5_0+q8_0"}  # fused
    for name, layer in quantized.items():
        ids = torch.arange(layer.out_features)
        reference = floats[name].packed.rows(ids) if floats[name].packed is not None else floats[name].weight
        assert torch.equal(layer.quant.dequantized_rows(ids), reference.detach()), name
