"""Layers against transformers' Llama code: bit-exact where the arithmetic is the same."""

from __future__ import annotations

import pytest
import torch

from tests.factories import make_hf_config
from tests.models.conftest import LLAMA3_ROPE
from workers.model.config import ModelArchConfig
from workers.model.layers import RMSNorm, RotaryEmbedding, SiluAndMul, rope_inv_freq


@pytest.mark.parametrize("rope", [None, LLAMA3_ROPE], ids=["default", "llama3"])
def test_inv_freq_equals_hf(rope) -> None:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    overrides = {"head_dim": 16, "rope_parameters": rope} if rope else {"head_dim": 16}
    config = make_hf_config("llama", **overrides)
    arch = ModelArchConfig.from_hf_config(config.to_dict())
    ours = rope_inv_freq(arch.head_dim, arch.rope_theta, arch.rope_scaling)
    assert torch.equal(ours, LlamaRotaryEmbedding(config).inv_freq)


def test_llama3_scaling_touches_all_three_bands() -> None:
    arch = ModelArchConfig.from_hf_config(make_hf_config("llama", head_dim=16, rope_parameters=LLAMA3_ROPE).to_dict())
    plain = rope_inv_freq(16, arch.rope_theta)
    scaled = rope_inv_freq(16, arch.rope_theta, arch.rope_scaling)
    ratio = plain / scaled
    assert (ratio == 1).any() and (ratio == 8).any() and ((ratio > 1) & (ratio < 8)).any()


@pytest.mark.parametrize("rope", [None, LLAMA3_ROPE], ids=["default", "llama3"])
def test_rotary_equals_hf(rope) -> None:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    overrides = {"head_dim": 16, "rope_parameters": rope} if rope else {"head_dim": 16}
    config = make_hf_config("llama", **overrides)
    arch = ModelArchConfig.from_hf_config(config.to_dict())
    rotary = RotaryEmbedding(arch.head_dim, arch.max_position_embeddings, arch.rope_theta, arch.rope_scaling)
    positions = torch.tensor([0, 1, 5, 31, 32, 77, 127])
    torch.manual_seed(0)
    q = torch.randn(len(positions), 4, 16)
    k = torch.randn(len(positions), 2, 16)
    cos_hf, sin_hf = LlamaRotaryEmbedding(config)(q, positions[None])
    # HF layout: [batch, heads, T, D]
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos_hf, sin_hf)
    cos, sin = rotary.lookup(positions)
    assert torch.equal(RotaryEmbedding.apply(q, cos, sin), q_hf[0].transpose(0, 1))
    assert torch.equal(RotaryEmbedding.apply(k, cos, sin), k_hf[0].transpose(0, 1))


def test_rotary_on_meta_then_rebuilt() -> None:
    with torch.device("meta"):
        rotary = RotaryEmbedding(8, 16, 10000.0)
    rotary = rotary.to_empty(device="cpu")
    rotary.build_cache(torch.device("cpu"))
    assert torch.equal(rotary.cos_sin_cache, RotaryEmbedding(8, 16, 10000.0).cos_sin_cache)


def test_rmsnorm_equals_hf() -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    x = torch.randn(5, 32) * 3
    ours, ref = RMSNorm(32, 1e-5), LlamaRMSNorm(32, eps=1e-5)
    with torch.no_grad():
        ours.weight.normal_()
        ref.weight.copy_(ours.weight)
    assert torch.equal(ours(x), ref(x))


def test_silu_and_mul() -> None:
    x = torch.randn(3, 10)
    assert torch.equal(SiluAndMul()(x), torch.nn.functional.silu(x[:, :5]) * x[:, 5:])


def test_native_geglu_is_torchs_to_a_few_ulp_and_the_same_in_every_lane() -> None:
    from workers.model import cpu_ops
    from workers.model.layers import GeluAndMul

    lib = cpu_ops.load()
    if lib is None:
        pytest.skip("no C compiler here")
    x = torch.randn(7, 2 * 203, generator=torch.Generator().manual_seed(0)) * 4
    layer = GeluAndMul()
    expected = layer(x)  # torch's gelu(approximate="tanh")
    layer.native = lib
    got = layer(x)
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(layer(x[3:4].contiguous())[0], got[3])  # a row alone
    # An element gets the same bits in a vector lane (column 0) and in the scalar tail (column 8 of 9).
    values = x[:, :8].flatten()
    for start in range(0, values.numel(), 8):
        row = torch.ones(1, 18)
        row[0, :8], row[0, 8] = values[start : start + 8], values[start]
        out = cpu_ops.gelu_tanh_and_mul(lib, row)
        assert out[0, 0] == out[0, 8], start


def test_head_rms_norm_gives_the_norm_of_each_head_row_in_place() -> None:
    from workers.model import cpu_ops

    lib = cpu_ops.load()
    if lib is None:
        pytest.skip("no C compiler here")
    qkv = torch.randn(5, 3 * 16 + 16, generator=torch.Generator().manual_seed(1))
    norm = RMSNorm(16, 1e-6)
    with torch.no_grad():
        norm.weight.normal_()
    norm.native = lib
    expected = norm(qkv[:, :48].reshape(-1, 16)).view(5, 48)  # add_rms_norm over the copied rows
    heads = qkv[:, :48].view(5, 3, 16)
    cpu_ops.head_rms_norm(lib, heads, norm.weight, norm.eps)  # strided rows of qkv, in place
    assert torch.equal(qkv[:, :48], expected)
