"""The integer-activation path of the quantized GEMM (``qdot.py``, ``csrc/qdot.h``):
against float64 on the same activation quantization, batch and thread
invariance, rows read back exactly, what it refuses, and the AVX2 build made
explicitly (the CPUs without AVX-512) giving the same bits."""

from __future__ import annotations

import ctypes
import platform

import numpy as np
import pytest
import torch

from workers.model import native, qdot, qgemm

LIB = qgemm.load()
pytestmark = pytest.mark.skipif(not qdot.available(LIB), reason="no C compiler or no integer kernel here")

# bits, N, K, mins: a model's gate/up and down shapes (ragged panels), an 8-bit head, a tiny one
CASES = [(4, 960, 576, True), (4, 37, 1536, False), (8, 100, 576, False), (8, 33, 64, True)]


def random_weight(bits, n, k, mins, seed=0, half=False):
    """half: scales and mins that are half floats exactly (as GGUF's), which the weight then stores so."""
    rng = np.random.default_rng(seed + n + k)
    q = rng.integers(0, 16, (n, k)).astype(np.uint8) if bits == 4 else rng.integers(-127, 128, (n, k)).astype(np.int8)
    groups = k // 32
    scales = (rng.random((n, groups)) * 0.01 + 1e-4).astype(np.float32)
    lows = (rng.standard_normal((n, groups)) * 0.05).astype(np.float32) if mins else None
    if half:
        scales = scales.astype(np.float16).astype(np.float32)
        lows = lows.astype(np.float16).astype(np.float32) if mins else None
    return q, scales, lows


def reference(x, q, scales, mins):
    """float64 of the module doc's formula: x quantized per 32 inputs exactly as the kernel does (float32)."""
    m, k = x.shape
    groups = k // 32
    xg = x.numpy().reshape(m, groups, 32)
    amax = np.abs(xg).max(axis=2)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), np.float32(0)).astype(np.float32)
    xq = np.rint(xg * inv[:, :, None]).astype(np.float64)
    dx = (amax / np.float32(127)).astype(np.float64)
    isum = np.einsum("mgk,ngk->mng", xq, q.astype(np.float64).reshape(q.shape[0], groups, 32))
    y = (isum * dx[:, None, :] * scales[None].astype(np.float64)).sum(axis=2)
    if mins is not None:
        y += (xg.astype(np.float64).sum(axis=2)[:, None, :] * mins[None]).sum(axis=2)
    return torch.from_numpy(y)


@pytest.mark.parametrize("half", [False, True], ids=["float32-scales", "half-scales"])
@pytest.mark.parametrize("bits,n,k,mins", CASES)
def test_integer_path_matches_float64_on_the_quantized_activations(bits, n, k, mins, half):
    q, scales, lows = random_weight(bits, n, k, mins, half=half)
    bias = torch.randn(n)
    weight = qdot.DotQuantWeight(q, scales, lows, bits, 32, bias, LIB)
    assert bool(weight.bits & qdot.HALF) == half and weight.scales.element_size() == (2 if half else 4)
    x = torch.randn(21, k)
    ref = reference(x, q, scales, lows)
    torch.testing.assert_close(weight.matmul_no_bias(x), ref.float(), atol=2e-5 * k**0.5, rtol=1e-5)
    torch.testing.assert_close(weight.matmul(x), (ref + bias.double()).float(), atol=2e-5 * k**0.5, rtol=1e-5)
    # the exact path on the same weight differs by the activations' rounding only
    exact = qgemm.QuantWeight(q, scales, lows, bits, 32, None, LIB).matmul(x)
    assert (weight.matmul_no_bias(x) - exact).abs().max() < 0.05 * exact.abs().max()
    ids = torch.tensor([0, n - 1, n // 2, min(31, n - 1)])
    dense = np.repeat(scales, 32, axis=1) * q.astype(np.float32) + (np.repeat(lows, 32, axis=1) if mins else 0)
    assert torch.equal(weight.dequantized_rows(ids), torch.from_numpy(dense[ids.numpy()]).float())


@pytest.mark.parametrize("bits,n,k,mins", CASES[:3])
def test_integer_path_rows_do_not_depend_on_their_batch_or_threads(bits, n, k, mins):
    q, scales, lows = random_weight(bits, n, k, mins, seed=3)
    weight = qdot.DotQuantWeight(q, scales, lows, bits, 32, None, LIB)
    x = torch.randn(70, k)
    full = weight.matmul(x)
    for size in list(range(1, 10)) + [16, 17, 33, 64]:
        for start in (0, 1, 70 - size):
            assert torch.equal(weight.matmul(x[start : start + size]), full[start : start + size]), (size, start)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(weight.matmul(x), full)
    finally:
        torch.set_num_threads(threads)


def test_integer_path_refuses_what_it_cannot_hold():
    q = np.zeros((4, 64), np.uint8)
    scales = np.ones((4, 2), np.float32)
    with pytest.raises(ValueError, match="groups of 32"):
        qdot.DotQuantWeight(np.zeros((4, 128), np.uint8), np.ones((4, 1), np.float32), None, 4, 128, None, LIB)
    with pytest.raises(ValueError, match="-127..127"):  # -128 cannot take x's sign in int8
        qdot.DotQuantWeight(np.full((4, 64), -128, np.int8), scales, None, 8, 32, None, LIB)
    with pytest.raises(ValueError, match="0..15"):
        qdot.DotQuantWeight(q + 16, scales, None, 4, 32, None, LIB)
    assert qdot.try_dot_weight(np.zeros((4, 48), np.uint8), np.ones((4, 2), np.float32), None, 4, 32, None,
                               LIB) is None  # K not a multiple of 32: the exact kernel keeps it
    assert qdot.try_dot_weight(np.zeros((4, 64), np.uint8), scales, None, 5, 32, None, LIB) is None


def test_integer_path_avx2_build_gives_the_same_bits():
    """The AVX2 code (vpmaddubsw) and the AVX-512 one (VNNI or BW) compute the same exact integer sums and the
    same float operations per row, so the same bits."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 only")
    flags = ("-O3", "-mavx2", "-mfma", "-mno-avx512f", "-fopenmp", "-shared", "-fPIC")
    lib = native.build("qgemm_f32_avx2", qgemm._SOURCE, flags, qgemm._SIGNATURES)
    if lib is None:
        pytest.skip("no compiler for the AVX2 build")
    lib.qgemm_panel_width.restype = ctypes.c_int
    assert lib.qgemm_panel_width() == 16 and qdot.available(lib)
    for (bits, n, k, mins), half in [(case, half) for case in CASES for half in (False, True)]:
        q, scales, lows = random_weight(bits, n, k, mins, seed=5, half=half)  # half: F16C or the C conversion
        weight = qdot.DotQuantWeight(q, scales, lows, bits, 32, None, lib)
        x = torch.randn(40, k)
        full = weight.matmul(x)
        native_width = qdot.DotQuantWeight(q, scales, lows, bits, 32, None, LIB).matmul(x)
        assert torch.equal(full, native_width), bits  # per lane the same operations whatever the width
        for size in (1, 2, 3, 5, 17):
            assert torch.equal(weight.matmul(x[3 : 3 + size]), full[3 : 3 + size]), (bits, size)
