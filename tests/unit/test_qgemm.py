"""The native GEMM over group-quantized weights (``qgemm.py``): against float64
on the dequantized weights, ragged last groups, rows read back exactly, and
batch invariance (a row's result is bitwise the same whatever the batch), on the
AVX-512 build and on the AVX2 + FMA build made explicitly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from workers.model import qgemm

pytestmark = pytest.mark.skipif(qgemm.load() is None, reason="no C compiler or no AVX2 + FMA here")

# bits, group, N, K, mins: model shapes, ragged panels (N % 32), a ragged last group (576 = 4 x 128 + 64)
CASES = [(4, 32, 960, 576, True), (8, 32, 100, 64, False), (4, 128, 37, 576, True),
         (8, 16, 576, 1536, False), (8, 576, 70, 576, False), (4, 64, 33, 192, False)]


def random_weight(bits, group, n, k, mins, seed=0):
    rng = np.random.default_rng(seed + n + k)
    q = rng.integers(0, 16, (n, k)).astype(np.uint8) if bits == 4 else rng.integers(-128, 128, (n, k)).astype(np.int8)
    groups = -(-k // group)
    scales = (rng.random((n, groups)) * 0.01 + 1e-4).astype(np.float32)
    lows = (rng.standard_normal((n, groups)) * 0.05).astype(np.float32) if mins else None
    dense = np.repeat(scales, group, axis=1)[:, :k] * q.astype(np.float32)
    if mins:
        dense = dense + np.repeat(lows, group, axis=1)[:, :k]
    return q, scales, lows, torch.from_numpy(dense)


@pytest.mark.parametrize("bits,group,n,k,mins", CASES)
def test_quantized_gemm_matches_float64_on_the_dequantized_weight(bits, group, n, k, mins):
    q, scales, lows, dense = random_weight(bits, group, n, k, mins)
    bias = torch.randn(n)
    weight = qgemm.QuantWeight(q, scales, lows, bits, group, bias, qgemm.load())
    x = torch.randn(40, k)
    ref = x.double() @ dense.double().T
    torch.testing.assert_close(weight.matmul_no_bias(x), ref.float(), atol=1e-5 * k**0.5, rtol=1e-5)
    torch.testing.assert_close(weight.matmul(x), (ref + bias.double()).float(), atol=1e-5 * k**0.5, rtol=1e-5)
    ids = torch.tensor([0, n - 1, n // 2, min(31, n - 1)])
    assert torch.equal(weight.dequantized_rows(ids), dense[ids])  # an embedding's lookup is exact


@pytest.mark.parametrize("bits,group,n,k,mins", CASES[:3])
def test_quantized_gemm_rows_do_not_depend_on_their_batch(bits, group, n, k, mins):
    q, scales, lows, _ = random_weight(bits, group, n, k, mins, seed=3)
    weight = qgemm.QuantWeight(q, scales, lows, bits, group, None, qgemm.load())
    x = torch.randn(140, k)
    full = weight.matmul(x)
    for size in list(range(1, 18)) + [31, 63, 64, 65, 127]:  # across the decoded-panel path (16 rows)
        for start in (0, 1, 140 - size):
            assert torch.equal(weight.matmul(x[start : start + size]), full[start : start + size]), (size, start)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(weight.matmul(x), full)
    finally:
        torch.set_num_threads(threads)


def test_quantized_weight_rejects_what_it_cannot_hold():
    lib = qgemm.load()
    with pytest.raises(ValueError, match="bits must be 4, 5 or 8"):
        qgemm.QuantWeight(np.zeros((4, 8), np.uint8), np.ones((4, 1), np.float32), None, 3, 8, None, lib)
    with pytest.raises(ValueError, match="0..15"):
        qgemm.QuantWeight(np.full((4, 8), 16, np.uint8), np.ones((4, 1), np.float32), None, 4, 8, None, lib)


def test_quantized_gemm_avx2_build_is_exact_and_invariant_too():
    """The AVX2 + FMA code path (the CPUs without AVX-512), built explicitly here."""
    import ctypes
    import platform

    from workers.model import native

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 only")
    flags = ("-O3", "-mavx2", "-mfma", "-mno-avx512f", "-fopenmp", "-shared", "-fPIC")
    lib = native.build("qgemm_f32_avx2", qgemm._SOURCE, flags, qgemm._SIGNATURES)
    if lib is None:
        pytest.skip("no compiler for the AVX2 build")
    lib.qgemm_panel_width.restype = ctypes.c_int
    assert lib.qgemm_panel_width() == 16
    for bits, group, n, k, mins in (CASES[0], CASES[1], CASES[2]):
        q, scales, lows, dense = random_weight(bits, group, n, k, mins, seed=5)
        weight = qgemm.QuantWeight(q, scales, lows, bits, group, None, lib)
        x = torch.randn(70, k)
        full = weight.matmul(x)
        torch.testing.assert_close(full, (x.double() @ dense.double().T).float(), atol=1e-5 * k**0.5, rtol=1e-5)
        for size in (1, 5, 6, 7, 13, 15, 16, 17, 64, 65):
            assert torch.equal(weight.matmul(x[2 : 2 + size]), full[2 : 2 + size]), (bits, size)
        ids = torch.tensor([0, n - 1, 17])
        assert torch.equal(weight.dequantized_rows(ids), dense[ids])


@pytest.mark.parametrize("bits,group,n,k,mins", [CASES[0], CASES[1], (5, 32, 70, 256, True)])
def test_rows_with_a_stride_and_a_ragged_last_strip_give_the_contiguous_bits(bits, group, n, k, mins):
    """x's rows may sit ``ldx != K`` apart (a view into a wider buffer); the prefill path packs them in
    strips of rows, the last one padded with zero rows it never stores: both paths, every M."""
    rng = np.random.default_rng(7)
    q = (rng.integers(-128, 128, (n, k)).astype(np.int8) if bits == 8
         else rng.integers(0, 1 << bits, (n, k)).astype(np.uint8))
    groups = -(-k // group)
    scales = (rng.random((n, groups)) * 0.01 + 1e-4).astype(np.float32)
    lows = (rng.standard_normal((n, groups)) * 0.05).astype(np.float32) if mins else None
    weight = qgemm.QuantWeight(q, scales, lows, bits, group, torch.randn(n), qgemm.load())
    wide = torch.randn(45, k + 24)
    for m in (1, 3, 16, 25, 45):  # few rows; then strips of 12 / 6 rows, full and ragged
        view = wide[:m, 8 : 8 + k]
        assert view.stride(0) == k + 24
        got = weight.matmul(view)
        assert torch.equal(got, weight.matmul(view.contiguous())), m
        assert torch.equal(got[-1:], weight.matmul(view[-1:].contiguous())), m  # and the row alone
