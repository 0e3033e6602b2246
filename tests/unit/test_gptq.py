"""GPTQ (``workers/model/quant/gptq.py``): its grid is the one GPTQ checkpoints
store, and its error feedback beats rounding to nearest on the layer's output."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from workers.model.quant import gptq
from workers.model.quant.checkpoints import QuantSpec, decode_layer
from workers.model.quant.checkpoint_writer import pack_layer


def _inputs(k: int, seed: int) -> torch.Tensor:
    """Correlated calibration inputs with a few outlier channels, as activations have."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1024, 24, generator=gen) @ torch.randn(24, k, generator=gen) + 0.1 * torch.randn(1024, k, generator=gen)
    x[:, :3] *= 8
    return x.double()


@pytest.mark.parametrize("group", [32, 128])
def test_gptq_output_error_is_far_below_round_to_nearest(group):
    k = 256
    x = _inputs(k, seed=group)
    w = (torch.randn(48, k, generator=torch.Generator().manual_seed(1)) * 0.05).numpy()
    h = 2 * x.T @ x / x.shape[0]

    def output_error(decoded):
        diff = x @ torch.from_numpy(w).double().T - x @ torch.from_numpy(decoded.dequantize()).double().T
        return float((diff**2).mean())

    rounded, fitted = gptq.rtn(w, group), gptq.gptq(w, h, group)
    assert output_error(fitted) < 0.2 * output_error(rounded)
    # The weights themselves move further from the float ones: GPTQ trades weight error for output error.
    assert np.abs(fitted.dequantize() - w).mean() > np.abs(rounded.dequantize() - w).mean()


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_gptq_grid_is_what_the_checkpoint_layouts_store(method):
    k = 192  # the last group of 128 is shorter
    x = _inputs(k, seed=3)
    w = (torch.randn(40, k, generator=torch.Generator().manual_seed(2)) * 0.05).numpy()
    w[5] = 0.0  # an all-zero row gets a usable grid
    w[7, :64] = np.abs(w[7, :64])  # a group of one sign still holds 0
    decoded = gptq.gptq(w, 2 * x.T @ x / x.shape[0], 64)
    zeros = -decoded.mins / decoded.scales
    assert np.array_equal(zeros, np.rint(zeros)) and zeros.min() >= 0 and zeros.max() <= 15
    assert np.array_equal(decoded.scales, decoded.scales.astype(np.float16).astype(np.float32))
    assert decoded.q.dtype == np.uint8 and decoded.q.max() <= 15
    back = decode_layer("layer", pack_layer(decoded, method), QuantSpec(method, 4, 64)).decoded
    assert np.array_equal(back.dequantize(), decoded.dequantize())  # written exactly as computed


def test_gptq_rejects_groups_that_straddle_its_blocks():
    with pytest.raises(ValueError, match="divide 128"):
        gptq.gptq(np.zeros((8, 256), dtype=np.float32), torch.eye(256, dtype=torch.float64), 96)


def test_awq_search_never_loses_to_rounding_and_wins_on_salient_channels():
    from workers.model.quant import awq

    k = 128
    x = _inputs(k, seed=9)
    w = (torch.randn(32, k, generator=torch.Generator().manual_seed(4)) * 0.05).numpy()
    h = x.T @ x / x.shape[0]
    s = awq.search_scales([w[:16], w[16:]], h, x.abs().mean(dim=0), 32)

    def output_error(scales):
        wt = torch.from_numpy(w).double()
        d = wt - torch.from_numpy(gptq.rtn((wt * scales).float().numpy(), 32).dequantize()).double() / scales
        return float(((d @ h) * d).sum())

    assert output_error(s) < 0.9 * output_error(torch.ones(k, dtype=torch.float64))
    assert s[:3].mean() > s[3:].mean()  # the outlier channels are the ones protected


@pytest.mark.parametrize("family,overrides", [("qwen2", {}), ("llama", {"num_key_value_heads": 4})])
def test_awq_scaling_leaves_the_float_model_unchanged(tmp_path, family, overrides):
    # Folded scales (norms, up rows and bias, v rows without GQA) cancel in
    # float: the scaled checkpoint computes what the original does.
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from tests.factories import make_tiny_model_dir
    from workers.model.quant import awq

    src = make_tiny_model_dir(family, tmp_path / "src", with_tokenizer=False, **overrides)
    tensors = load_file(str(src / "model.safetensors"))
    config = AutoModelForCausalLM.from_pretrained(src).config
    gen = torch.Generator().manual_seed(0)
    stats = {}
    for name in tensors:
        if name.endswith("_proj.weight") and ".layers." in name:
            k = tensors[name].shape[1]
            x = torch.randn(64, k, generator=gen, dtype=torch.float64) * torch.rand(k, generator=gen, dtype=torch.float64) * 4
            stats[name[: -len(".weight")]] = (x.T @ x / 64, x.abs().mean(dim=0))
    gqa = config.num_key_value_heads != config.num_attention_heads
    scaled = awq.apply(tensors, stats, config.num_hidden_layers, 32, grouped_query=gqa)
    assert scaled == config.num_hidden_layers * (3 if gqa else 4)
    dst = tmp_path / "dst"
    dst.mkdir()
    save_file(tensors, str(dst / "model.safetensors"))
    (dst / "config.json").write_text((src / "config.json").read_text())
    ids = torch.tensor([[5, 17, 3, 99, 42, 7, 8, 64]])
    with torch.no_grad():
        before = AutoModelForCausalLM.from_pretrained(src, torch_dtype=torch.float32)(ids).logits
        after = AutoModelForCausalLM.from_pretrained(dst, torch_dtype=torch.float32)(ids).logits
    torch.testing.assert_close(after, before, atol=1e-4, rtol=1e-4)
    assert not torch.equal(load_file(str(src / "model.safetensors"))["model.layers.0.input_layernorm.weight"],
                           tensors["model.layers.0.input_layernorm.weight"])
