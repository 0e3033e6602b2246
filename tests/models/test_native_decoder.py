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
    "qwen2_moe": ("qwen2_moe", {}, None),  # a shared expert (in moe_forward_f32) and a dense layer
    "phi3": ("phi3", {}, None),  # fused qkv / gate_up checkpoint, split on load
    "qwen3_moe": ("qwen3_moe", {}, None),  # q/k norms and routed experts
    "qwen3": ("qwen3", {}, None),  # per-head q/k norms, in place before the rotation
    "gemma3": ("gemma3", {}, None),  # four norms, GeGLU, q/k norms, two RoPE tables
    "gemma3_int4": ("gemma3", {}, "int4"),
    "gemma2": ("gemma2", {}, None),  # capped scores: the decode kernel's cap, in the one-call step too
}
NO_DRIVER: set[str] = set()  # every family here gets the one-call decode step


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
def test_head_norms_and_gemmas_layout_get_the_step_driver(tmp_path, family):
    # Qwen3's and Gemma 3's per-head q/k norms and Gemma's four norms, GeGLU and local RoPE table run in
    # the one-call decode step (csrc/decoder_step.c); the bitwise test above checks its numbers.
    folder = save_hf_model(make_hf_model(make_hf_config(family)), tmp_path)
    model, _ = load_model(folder, "float32", "cpu", TorchAttentionBackend())
    if model.native_decoder is None:
        pytest.skip("a native kernel did not build here")
    layer = model.native_decoder.layers[0]
    assert model.model.layers[0].self_attn.q_norm is not None and layer.q_norm and layer.k_norm
    assert model.native_decoder._driver is not None
    assert (layer.gelu, bool(layer.norm3), bool(layer.norm4)) == ((True,) * 3 if family == "gemma3" else (False,) * 3)
    if family == "gemma3":  # the local layers rotate with their own table
        assert {lay.local for lay in model.native_decoder.layers} == {True, False}


def test_soft_capped_scores_run_in_the_one_call_step(tmp_path):
    # Gemma 2: the decode kernel caps its scores, so the one-call step serves its decode-only steps (the
    # bitwise test above checks its numbers). With the cap not passed to the kernel (each layer's struct
    # set to 0) the step's logits differ from the module path's: the bitwise check catches a lost cap.
    folder = save_hf_model(make_hf_model(make_hf_config("gemma2")), tmp_path)
    model, _ = load_model(folder, "float32", "cpu", TorchAttentionBackend())
    assert model.model.layers[0].self_attn.softcap == 5.0
    fast = model.native_decoder
    if fast is None:
        pytest.skip("a native kernel did not build here")
    assert fast._driver is not None and {layer.cap for layer in fast.layers} == {5.0}
    for layer_c in fast._layers_c:
        layer_c.cap = 0.0
    rng = random.Random(5)
    prompts = {f"r{i}": [rng.randrange(3, 500) for _ in range(n)] for i, n in enumerate([9, 14])}
    drivers = [PagedDriver(model, block_size=4), PagedDriver(model, block_size=4)]
    differs = False
    for chunks in (prompts, {"r0": [7], "r1": [8]}, {"r0": [9], "r1": [10]}):
        model.native_decoder = fast
        got = drivers[0].step(chunks)
        model.native_decoder = None
        expected = drivers[1].step(chunks)
        differs |= any(not torch.equal(got[rid], expected[rid]) for rid in chunks)
    model.native_decoder = fast
    assert differs
