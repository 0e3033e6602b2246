"""The native decoder (``workers/model/native_decoder.py``) makes the module
path's kernel calls with precomputed pointers: its logits are bitwise the
module path's, in decode-only steps and in steps with prefill chunks (MoE layers too)."""

from __future__ import annotations

import random

import pytest
import torch

from tests.factories import make_hf_config, make_hf_model, save_tiny_tokenizer
from tests.models.conftest import PagedDriver, save_hf_model
from workers.model.attention.torch_backend import TorchAttentionBackend
from workers.model.loader import load_model

CASES = {
    "llama_bias_tied": ("llama", {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True}, None),
    "mistral_sliding": ("mistral", {"sliding_window": 8}, None),
    "qwen2": ("qwen2", {}, None),
    "llama_int4": ("llama", {}, "int4"),  # quantized linears: the step driver's qgemm calls
    "llama_w8a8": ("llama", {}, "w8a8"),  # int8 x int8: the step driver's i8gemm calls
    "mixtral": ("mixtral", {}, None),  # MoE layers: the step driver's moe_forward_f32 calls
    "mixtral_int4": ("mixtral", {}, "int4"),  # quantized experts
    "qwen2_moe": ("qwen2_moe", {}, None),  # a shared expert and a dense layer: the per-layer loop runs it
}
NO_DRIVER = {"qwen2_moe"}  # the shared expert stays in torch: no one-call step


@pytest.mark.parametrize("name", sorted(CASES))
def test_native_decoder_matches_the_module_path_bitwise(name, tmp_path):
    family, overrides, quantization = CASES[name]
    hf_model = make_hf_model(make_hf_config(family, **overrides))
    folder = save_hf_model(hf_model, tmp_path)
    if quantization == "w8a8":  # calibrated on text at load
        save_tiny_tokenizer(folder, hf_model.config.vocab_size)
    model, _ = load_model(folder, "float32", "cpu", TorchAttentionBackend(), quantization=quantization)
    fast = model.native_decoder
    if fast is None:
        pytest.skip("a native kernel did not build here")
    assert (fast._driver is not None) == (name not in NO_DRIVER)  # decode-only steps below run as one C call
    rng = random.Random(3)
    prompts = {f"r{i}": [rng.randrange(3, 500) for _ in range(n)] for i, n in enumerate([5, 13, 1, 22])}
    drivers = [PagedDriver(model, block_size=4), PagedDriver(model, block_size=4)]
    steps = [
        {"r0": prompts["r0"], "r1": prompts["r1"][:6]},        # prefills
        {"r0": [7], "r1": prompts["r1"][6:], "r2": prompts["r2"]},  # a decode and prefill chunks
        {"r0": [8], "r1": [9], "r2": [10]},                  # decode only
        {"r0": [11], "r1": [12], "r2": [13], "r3": prompts["r3"]},
        {"r0": [14], "r1": [15], "r2": [16], "r3": [17]},    # decode only, past the sliding window
    ]
    for chunks in steps:
        model.native_decoder = fast
        got = drivers[0].step(chunks)
        model.native_decoder = None  # the module path
        expected = drivers[1].step(chunks)
        for rid in chunks:
            assert torch.equal(got[rid], expected[rid]), (name, rid)
    model.native_decoder = fast


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_head_norms_keep_the_module_path(tmp_path, family):
    # The C step driver has no per-head q/k norm (nor Gemma's layer layout): such models must not get it.
    folder = save_hf_model(make_hf_model(make_hf_config(family)), tmp_path)
    model, _ = load_model(folder, "float32", "cpu", TorchAttentionBackend())
    assert model.model.layers[0].self_attn.q_norm is not None
    assert model.native_decoder is None


def test_soft_capped_attention_keeps_the_module_path(tmp_path):
    # The C step driver's attention cannot cap scores (Gemma 2): the torch layers run such a model.
    folder = save_hf_model(make_hf_model(make_hf_config("gemma2")), tmp_path)
    model, _ = load_model(folder, "float32", "cpu", TorchAttentionBackend())
    assert model.model.layers[0].self_attn.softcap == 5.0 and model.native_decoder is None
