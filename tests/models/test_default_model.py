"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF): conversion against transformers.

One conversion (into a temporary cache) and one transformers GGUF load serve
the whole module. The converted folder must hold exactly the tensors
transformers' GGUF loader produces, our model on it must match transformers
on it, and its tokenizer.json must encode like transformers' GGUF tokenizer.
"""

from __future__ import annotations

import json
import logging
import time

import pytest
import torch

from tests.models.conftest import PagedDriver, hf_logits
from workers.model.loader import (
    FINGERPRINT_FILE,
    convert_gguf_cached,
    default_gguf_path,
    load_model,
    model_fingerprint,
    resolve_model,
)

pytestmark = pytest.mark.slow
logger = logging.getLogger(__name__)

TEXTS = [
    "Hello world! How are you today?",
    "The year 2024 had 366 days; pi is 3.14159265358979.",
    "  leading spaces,\ttabs\nand\n\nnewlines   ",
    "def f(x):\n    return x ** 2  # square\n",
    "Ünïcödé — 日本語のテキスト, emoji 🤖🎉, Ελληνικά.",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>tokens<|im_end|>glued<|im_start|>",
    "",
]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("prefixserve-cache")


@pytest.fixture(scope="module")
def converted(cache_dir):
    start = time.monotonic()
    folder = convert_gguf_cached(default_gguf_path(), cache_dir)
    logger.warning("default model conversion took %.1f s", time.monotonic() - start)
    return folder


@pytest.fixture(scope="module")
def hf_from_gguf():
    """transformers' own GGUF loader (dequantizes on load; ~20 s)."""
    from transformers import AutoModelForCausalLM

    path = default_gguf_path()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def ours(converted):
    from workers.model.attention.torch_backend import TorchAttentionBackend

    start = time.monotonic()
    model, _ = load_model(converted, "float32", "cpu", TorchAttentionBackend())
    logger.warning("default model load took %.1f s", time.monotonic() - start)
    return model


def test_folder_layout(converted) -> None:
    names = {p.name for p in converted.iterdir()}
    assert names == {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        FINGERPRINT_FILE,
    }
    config = json.loads((converted / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is True
    tokenizer_config = json.loads((converted / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tokenizer_config["chat_template"]
    assert tokenizer_config["eos_token"] == "<|im_end|>" and tokenizer_config["bos_token"] == "<|im_start|>"
    assert json.loads((converted / "generation_config.json").read_text())["eos_token_id"] == 2
    assert not [p for p in converted.parent.iterdir() if p.name.endswith(".tmp")]  # no temp folders


def test_tensors_equal_transformers_gguf_loader(converted, hf_from_gguf) -> None:
    from safetensors.torch import load_file

    ours = load_file(converted / "model.safetensors")
    reference = hf_from_gguf.state_dict()
    assert set(ours) == set(reference) - {"lm_head.weight"}  # tied: stored once
    for name, tensor in reference.items():
        mine = ours["model.embed_tokens.weight" if name == "lm_head.weight" else name]
        assert mine.dtype == torch.float32 and torch.equal(mine, tensor), name


def test_config_matches_transformers_gguf_config(converted, hf_from_gguf) -> None:
    from transformers import AutoConfig

    ours = AutoConfig.from_pretrained(converted)
    theirs = hf_from_gguf.config
    keys = [
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings",
        "tie_word_embeddings", "bos_token_id", "eos_token_id", "rope_parameters",
    ]
    assert {k: getattr(ours, k) for k in keys} == {k: getattr(theirs, k) for k in keys}


def test_logits_match_transformers_on_converted_folder(converted, ours) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(converted)
    messages = [{"role": "user", "content": "Name three colors of the rainbow."}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    driver = PagedDriver(ours, num_blocks=32, block_size=16)
    logits = driver.step({"a": prompt})["a"]
    reference = hf_logits(hf, prompt)
    # The native GEMM sums each dot product in its own (batch-invariant) order, not
    # MKL's: float rounding apart, the logits are transformers'.
    torch.testing.assert_close(logits, reference, atol=1e-3, rtol=0)
    assert torch.equal(logits.argmax(-1), reference.argmax(-1))
    tokens = list(prompt)
    for _ in range(8):
        tokens.append(int(logits[-1].argmax()))
        logits = driver.step({"a": tokens[-1:]})["a"]
    with torch.inference_mode():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt) :]
    assert tokens[len(prompt) :] == expected.tolist()


def test_tokenizer_json_encodes_like_transformers_gguf_tokenizer(converted) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    path = default_gguf_path()
    reference = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ours = Tokenizer.from_file(str(converted / "tokenizer.json"))
    for text in TEXTS:
        ids = ours.encode(text).ids
        assert ids == reference.encode(text), text
        assert ours.decode(ids, skip_special_tokens=False) == reference.decode(ids), text


def test_chat_template_renders_like_gguf_tokenizer(converted) -> None:
    from transformers import AutoTokenizer

    path = default_gguf_path()
    reference = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ours = AutoTokenizer.from_pretrained(converted)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    kwargs = dict(tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(messages, **kwargs) == reference.apply_chat_template(messages, **kwargs)


def test_default_model_resolves_to_the_cached_folder(converted, cache_dir, monkeypatch) -> None:
    monkeypatch.setenv("PREFIXSERVE_CACHE_DIR", str(cache_dir))
    start = time.monotonic()
    assert resolve_model(None) == converted
    assert time.monotonic() - start < 5  # no second conversion
    assert model_fingerprint(converted) == (converted / FINGERPRINT_FILE).read_text().strip()
