"""GPTQ (``workers/model/quant/gptq.py``): its grid is the one GPTQ checkpoints
store, and its error feedback beats rounding to nearest on the layer's output."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from workers.model.quant import gptq
from workers.model.quant.checkpoints import QuantSpec, decode_layer, pack_layer


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
