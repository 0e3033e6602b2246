"""Our Llama-family model on paged KV against transformers float32, on random-init checkpoints.

Every case loads the HF checkpoint through our loader and checks, against
HF's full-sequence forward, the logits of every position for: one prefill,
a prefill chunked over several steps, greedy decode steps, and a mixed step
(decode of one request batched with a prefill chunk of another).
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from tests.factories import make_hf_config, make_hf_model
from tests.models.conftest import LLAMA3_ROPE, PagedDriver, hf_logits, save_hf_model
from workers.model.config import ModelArchConfig
from workers.model.llama import LlamaForCausalLM
from workers.model.loader import load_model

ATOL = 1e-4
PROMPT_LEN = 24  # > 2x the Mistral sliding window of 8
NUM_DECODE_STEPS = 6

CASES = {
    "llama_gqa": ("llama", {}),
    "llama_mqa_tied": ("llama", {"num_key_value_heads": 1, "tie_word_embeddings": True}),
    "llama3_rope": ("llama", {"head_dim": 16, "rope_parameters": LLAMA3_ROPE}),
    "llama_bias": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "mistral_sliding": ("mistral", {"sliding_window": 8}),
    "qwen2_bias": ("qwen2", {}),
    "qwen2_sliding_upper": (
        "qwen2",
        {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1, "num_hidden_layers": 3},
    ),
    "qwen3_qk_norm": ("qwen3", {}),
    "qwen3_head_dim_bias": ("qwen3", {"head_dim": 24, "attention_bias": True}),  # head_dim != hidden / heads
    "phi3_fused_checkpoint": ("phi3", {}),
    "phi3_sliding": ("phi3", {"sliding_window": 8}),
    "gemma3_local_global": ("gemma3", {}),
    "gemma2_softcaps": ("gemma2", {"num_hidden_layers": 3}),  # local, global, local; capped scores and logits
    "mixtral_8x_top2": ("mixtral", {}),
    "qwen2_moe_shared_expert": ("qwen2_moe", {}),  # a gated shared expert; layer 1 dense
    "qwen3_moe_norm_topk": ("qwen3_moe", {}),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    """(hf model, our model, prompt) of one config; the llama one is saved sharded."""
    from workers.model.attention.torch_backend import TorchAttentionBackend

    family, overrides = CASES[request.param]
    hf = make_hf_model(make_hf_config(family, **overrides))
    shard = "40KB" if request.param == "llama_gqa" else None
    folder = save_hf_model(hf, tmp_path_factory.mktemp(request.param), max_shard_size=shard)
    if shard:
        assert (folder / "model.safetensors.index.json").is_file()
    ours, _ = load_model(folder, "float32", "cpu", TorchAttentionBackend())
    prompt = random.Random(1).choices(range(3, hf.config.vocab_size), k=PROMPT_LEN)
    return hf, ours, prompt


def _assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_prefill_logits_match_hf(case) -> None:
    hf, ours, prompt = case
    logits = PagedDriver(ours).step({"a": prompt})["a"]
    _assert_close(logits, hf_logits(hf, prompt))


def test_chunked_prefill_matches_hf(case) -> None:
    hf, ours, prompt = case
    driver = PagedDriver(ours, block_size=4)
    # Chunk borders inside and on block borders; the last chunk alone spans > the window.
    pieces, start = [], 0
    for size in (5, 3, 1, 15):
        pieces.append(driver.step({"a": prompt[start : start + size]})["a"])
        start += size
    assert start == len(prompt)
    _assert_close(torch.cat(pieces), hf_logits(hf, prompt))


def test_greedy_decode_matches_hf(case) -> None:
    hf, ours, prompt = case
    driver = PagedDriver(ours)
    last = driver.step({"a": prompt})["a"][-1]
    tokens = list(prompt)
    for _ in range(NUM_DECODE_STEPS):
        tokens.append(int(last.argmax()))
        last = driver.step({"a": tokens[-1:]})["a"][-1]
        _assert_close(last, hf_logits(hf, tokens)[-1])
    with torch.inference_mode():
        expected = hf.generate(
            torch.tensor([prompt]), max_new_tokens=NUM_DECODE_STEPS, do_sample=False, pad_token_id=0
        )[0, len(prompt) :].tolist()
    assert tokens[len(prompt) :] == expected


def test_mixed_batch_matches_hf(case) -> None:
    """One step holding a decode of request a and prefill chunks of b (fresh) and c (continued)."""
    hf, ours, prompt = case
    other = prompt[::-1]
    driver = PagedDriver(ours, block_size=4)
    driver.step({"a": prompt, "c": other[:7]})
    nxt = 7
    out = driver.step({"a": [nxt], "b": other[:13], "c": other[7:20]})
    _assert_close(out["a"], hf_logits(hf, prompt + [nxt])[-1:])
    _assert_close(out["b"], hf_logits(hf, other[:13]))
    _assert_close(out["c"], hf_logits(hf, other[:20])[7:])


def test_uses_fused_projections(case) -> None:
    _, ours, _ = case
    names = {name for name, _ in ours.named_parameters()}
    assert "model.layers.0.self_attn.qkv_proj.weight" in names
    mlp = "model.layers.0.mlp." + ("experts.0." if ours.arch.is_moe_layer(0) else "")  # each expert fused too
    assert mlp + "gate_up_proj.weight" in names
    assert not any(".q_proj." in n or ".gate_proj." in n for n in names)
    if ours.arch.tie_word_embeddings:  # one copy: the embedding reads the LM head's packed rows
        assert ours.lm_head.backend == "native" and ours.model.embed_tokens.packed is ours.lm_head.packed


@pytest.mark.parametrize("backend", ["torch", "onednn", "native"])
def test_every_linear_backend_matches_hf(backend, tmp_path) -> None:
    from workers.model.attention.torch_backend import TorchAttentionBackend

    # Biases on every projection and a tied LM head: each kernel path with and without a bias.
    hf = make_hf_model(make_hf_config("llama", attention_bias=True, mlp_bias=True, tie_word_embeddings=True))
    folder = save_hf_model(hf, tmp_path)
    ours, _ = load_model(folder, "float32", "cpu", TorchAttentionBackend(), linear_backend=backend)
    assert {m.backend for m in ours.modules() if hasattr(m, "backend")} == {backend}
    prompt = random.Random(2).choices(range(3, hf.config.vocab_size), k=PROMPT_LEN)
    driver = PagedDriver(ours, block_size=4)
    _assert_close(driver.step({"a": prompt})["a"], hf_logits(hf, prompt))
    _assert_close(driver.step({"a": [5]})["a"], hf_logits(hf, prompt + [5])[-1:])


@pytest.mark.parametrize("name", ["mistral_sliding", "qwen2_sliding_upper"])
def test_sliding_window_changes_late_positions(name: str, attn_backend) -> None:
    """Guards the sliding cases against passing vacuously (window ignored = same logits)."""
    family, overrides = CASES[name]
    hf = make_hf_model(make_hf_config(family, **overrides))
    config = dict(hf.config.to_dict(), use_sliding_window=False, sliding_window=None, layer_types=None)
    arch = ModelArchConfig.from_hf_config(config)
    assert arch.sliding_window is None
    full = LlamaForCausalLM(arch, attn_backend)
    full.load_weights(hf.state_dict().items())
    prompt = random.Random(1).choices(range(3, hf.config.vocab_size), k=PROMPT_LEN)
    logits = PagedDriver(full).step({"a": prompt})["a"]
    ref = hf_logits(hf, prompt)
    window = overrides["sliding_window"]
    torch.testing.assert_close(logits[:window], ref[:window], atol=ATOL, rtol=0)
    assert (logits[window:] - ref[window:]).abs().max() > 100 * ATOL


def test_checkpoint_mismatch_is_rejected(tmp_path, attn_backend) -> None:
    hf = make_hf_model(make_hf_config("llama"))
    folder = save_hf_model(hf, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] = 80
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="mlp.*has shape .* the config expects"):
        load_model(folder, "float32", "cpu", attn_backend)


def test_missing_weight_is_rejected(tmp_path, attn_backend) -> None:
    from safetensors.torch import load_file, save_file

    folder = save_hf_model(make_hf_model(make_hf_config("llama")), tmp_path)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.self_attn.v_proj.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"lacks 1 weights: model.layers.1.self_attn.qkv_proj.weight\[v\]"):
        load_model(folder, "float32", "cpu", attn_backend)
