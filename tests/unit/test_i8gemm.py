"""The native int8 x int8 GEMM of W8A8 (``i8gemm.py``): per-token activation
quantization and the integer products against a float64 reference of the same
quantization, batch invariance (exact int32 sums), rows read back, and the
AVX2 build (no VNNI) giving bitwise the same results."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from workers.model import i8gemm

pytestmark = pytest.mark.skipif(i8gemm.load() is None, reason="no C compiler or no AVX2 here")

SHAPES = [(960, 576), (576, 1536), (37, 70), (1, 3)]  # model shapes, ragged panels, K not a multiple of 4


def random_weight(n, k, seed=0):
    rng = np.random.default_rng(seed + n + k)
    q = rng.integers(-127, 128, (n, k)).astype(np.int8)
    scales = (rng.random(n) * 0.01 + 1e-3).astype(np.float32)
    return q, scales


def reference(x, q, scales, bias):
    """The same quantization (in float32, as the kernel: q = round_half_even(x * (127 / max|x|)),
    scale max|x| / 127), then the products and sums in float64."""
    amax = x.abs().amax(dim=1, keepdim=True)
    # A true division, as the kernel's 127.0f / amax: torch computes `127.0 / amax` as a reciprocal times
    # 127, one more rounding, which flipped the rounding of a near-tie about once in 600 draws.
    xq = torch.clamp(torch.round(x * (torch.full_like(amax, 127.0) / amax)), -127, 127).double()
    a = (amax / 127.0).double()
    y = (xq @ torch.from_numpy(q).double().T) * a * torch.from_numpy(scales).double()
    return y + (bias.double() if bias is not None else 0)


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_int8_gemm_matches_the_quantized_product(n, k, with_bias):
    q, scales = random_weight(n, k)
    bias = torch.randn(n) if with_bias else None
    weight = i8gemm.Int8Weight(q, scales, bias, i8gemm.load())
    x = torch.randn(33, k)
    torch.testing.assert_close(weight.matmul(x), reference(x, q, scales, bias).float(), atol=1e-5, rtol=1e-5)
    ids = torch.tensor([0, n - 1, n // 2])
    assert torch.equal(weight.dequantized_rows(ids), torch.from_numpy(q[ids.numpy()]).float()
                       * torch.from_numpy(scales[ids.numpy()]).unsqueeze(1))


def test_int8_gemm_rows_do_not_depend_on_their_batch_or_threads():
    q, scales = random_weight(100, 72, seed=2)
    weight = i8gemm.Int8Weight(q, scales, torch.randn(100), i8gemm.load())
    x = torch.randn(80, 72)
    full = weight.matmul(x)
    for size in list(range(1, 14)) + [31, 64, 79]:
        for start in (0, 1, 80 - size):
            assert torch.equal(weight.matmul(x[start : start + size]), full[start : start + size]), (size, start)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(weight.matmul(x), full)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(weight.matmul(torch.zeros(2, 72)), weight.bias[:100].expand(2, 100))  # all-zero rows


def test_bad_int8_weights_are_refused():
    with pytest.raises(ValueError, match="-127..127"):
        i8gemm.Int8Weight(np.full((2, 4), -128, np.int8), np.ones(2, np.float32), None, i8gemm.load())


def test_int8_gemm_avx2_build_gives_the_same_bits():
    """The AVX2 path (vpmaddubsw, no VNNI), built explicitly: the sums are exact, so bitwise equal."""
    import ctypes
    import platform

    from workers.model import native

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 only")
    flags = ("-O3", "-mavx2", "-mfma", "-mno-avx512f", "-fopenmp", "-shared", "-fPIC")
    lib = native.build("i8gemm_f32_avx2", i8gemm._SOURCE, flags, i8gemm._SIGNATURES)
    if lib is None:
        pytest.skip("no compiler for the AVX2 build")
    lib.i8gemm_panel_width.restype = ctypes.c_int
    lib.i8gemm_vnni.restype = ctypes.c_int
    assert lib.i8gemm_vnni() == 0 and lib.i8gemm_panel_width() == 16
    for n, k in SHAPES[:3]:
        q, scales = random_weight(n, k, seed=4)
        bias = torch.randn(n)
        x = torch.randn(21, k)
        ours = i8gemm.Int8Weight(q, scales, bias, lib).matmul(x)
        torch.testing.assert_close(ours, reference(x, q, scales, bias).float(), atol=1e-5, rtol=1e-5)
        assert torch.equal(ours, i8gemm.Int8Weight(q, scales, bias, i8gemm.load()).matmul(x))
