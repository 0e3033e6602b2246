"""GGUF block formats decode to integer weights with per-group scales and mins
that dequantize to exactly gguf's own values, for every supported format."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants

from workers.model.quant.gguf_blocks import decode

FORMATS = ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"]


def random_blocks(type_name: str, n: int, k: int) -> np.ndarray:
    """Random raw blocks of ``type_name`` for an ``n x k`` tensor (valid f16 scales)."""
    qtype = getattr(T, type_name)
    rng = np.random.default_rng(len(type_name) + n)
    if type_name in ("Q8_0", "Q4_0", "Q4_1"):  # the quantizer exists for these: use it
        return quants.quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
    block_size, type_size = quants.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n * k // block_size, type_size), dtype=np.uint8)
    # Sane f16 scales where the format keeps them (avoid inf / nan bit patterns).
    f16 = rng.uniform(0.001, 0.05, (raw.shape[0], 2)).astype(np.float16).view(np.uint8)  # [blocks, 4] bytes
    if type_name in ("Q4_K", "Q5_K"):
        raw[:, 0:4] = f16  # d and dmin
    else:  # Q6_K keeps d at the end
        raw[:, -2:] = f16[:, :2]
    return raw.reshape(n, -1)


@pytest.mark.parametrize("type_name", FORMATS)
def test_decoded_weights_dequantize_to_ggufs_values(type_name):
    n, k = 6, 512
    raw = random_blocks(type_name, n, k)
    expected = quants.dequantize(raw, getattr(T, type_name)).reshape(n, k)
    decoded = decode(raw, type_name, (n, k))
    assert np.array_equal(decoded.dequantize(), expected)
    if decoded.bits == 4:
        assert decoded.q.min() >= 0 and decoded.q.max() <= 15


def test_unsupported_formats_and_shapes_are_named():
    with pytest.raises(ValueError, match="Q2_K has no native kernel; supported: Q4_0, Q4_1"):
        decode(np.zeros((1, 84), np.uint8), "Q2_K", (1, 256))
    with pytest.raises(ValueError, match="multiple of 256"):
        decode(np.zeros((1, 144), np.uint8), "Q4_K", (1, 100))
    with pytest.raises(ValueError, match="expected 2"):
        decode(np.zeros((1, 34), np.uint8), "Q8_0", (2, 32))
