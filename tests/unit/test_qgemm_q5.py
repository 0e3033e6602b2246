"""5-bit GGUF weights (Q5_0, Q5_1, Q5_K) on the native quantized GEMM
(``qgemm.py``, ``bits=5``): decoding equals gguf's own dequantize, the kernel
equals dequantize-then-matmul, and each row's result is bitwise the same
whatever its batch, on the AVX-512 build and on AVX2 + FMA and AVX-512F-only
builds."""

from __future__ import annotations

import ctypes
import platform

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

from workers.model import native, qgemm
from workers.model.quant.gguf_blocks import decode
from workers.model.quant.methods import _stack

pytestmark = pytest.mark.skipif(qgemm.load() is None, reason="no C compiler or no AVX2 + FMA here")

FORMATS = ["Q5_0", "Q5_1", "Q5_K"]
# N, K: Gemma 3 270M's gate / up (640 -> 2048) and q (640 -> 1024) shapes, and ragged panels (N % 32)
SHAPES = [(2048, 640), (37, 256), (100, 512)]


def random_blocks(type_name: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Raw blocks of an ``n x k`` tensor: gguf's quantizer where it has one, else random bytes with sane scales."""
    rng = np.random.default_rng(seed + n + k)
    qtype = getattr(T, type_name)
    if type_name != "Q5_K":
        return quants.quantize((rng.standard_normal((n, k)) * 0.05).astype(np.float32), qtype)
    block_size, type_size = quants.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n * k // block_size, type_size), dtype=np.uint8)
    raw[:, 0:4] = rng.uniform(0.001, 0.05, (raw.shape[0], 2)).astype(np.float16).view(np.uint8)  # d and dmin
    return raw.reshape(n, -1)


def packed(type_name: str, n: int, k: int, lib, seed: int = 0):
    raw = random_blocks(type_name, n, k, seed)
    decoded = decode(raw, type_name, (n, k))
    dense = quants.dequantize(raw, getattr(T, type_name)).reshape(n, k)
    return qgemm.QuantWeight(decoded.q, decoded.scales, decoded.mins, decoded.bits, decoded.group_size, None, lib,
                             name=decoded.format), torch.from_numpy(dense)


def assert_matmul_close(y: torch.Tensor, x: torch.Tensor, dense: torch.Tensor) -> None:
    """``y`` is ``x @ dense.T`` to float32 rounding: within 1e-5 of the sum of the terms' magnitudes (the
    bound of a float32 dot product's error) of float64, and of float32 dequantize-then-matmul."""
    bound = 1e-5 * (x.abs().double() @ dense.abs().double().T) + 1e-7
    assert ((y.double() - x.double() @ dense.double().T).abs() <= bound).all()
    assert ((y.double() - (x @ dense.T).double()).abs() <= 2 * bound).all()


@pytest.mark.parametrize("type_name", FORMATS)
def test_5bit_blocks_decode_to_ggufs_values_at_5_bits(type_name):
    n, k = 6, 512
    raw = random_blocks(type_name, n, k)
    decoded = decode(raw, type_name, (n, k))
    assert decoded.bits == 5 and decoded.q.dtype == np.uint8 and decoded.q.max() <= 31
    assert np.array_equal(decoded.dequantize(), quants.dequantize(raw, getattr(T, type_name)).reshape(n, k))


@pytest.mark.parametrize("type_name", FORMATS)
@pytest.mark.parametrize("n,k", SHAPES)
def test_5bit_gemm_equals_dequantize_then_matmul(type_name, n, k):
    k = 768 if type_name == "Q5_K" and k % 256 else k  # a superblock is 256 inputs
    weight, dense = packed(type_name, n, k, qgemm.load())
    rows = -(-n // weight.lib.qgemm_panel_width()) * weight.lib.qgemm_panel_width()  # padded to whole panels
    assert weight.nbytes == rows * k * 5 // 8 + 2 * 4 * rows * (k // 32)  # 5 bits a weight, + scales and mins
    ids = torch.tensor([0, n - 1, n // 2, min(33, n - 1)])
    assert torch.equal(weight.dequantized_rows(ids), dense[ids])  # an embedding's lookup is gguf's value
    for m in (1, 8, 40):  # the per-row path and the decoded-panel path (from 16 rows)
        x = torch.randn(m, k)
        y = weight.matmul(x)
        assert_matmul_close(y, x, dense)


@pytest.mark.parametrize("type_name", ["Q5_0", "Q5_K"])
def test_5bit_gemm_rows_do_not_depend_on_their_batch(type_name):
    weight, _ = packed(type_name, 100, 512, qgemm.load(), seed=3)
    x = torch.randn(140, 512)
    full = weight.matmul(x)
    for size in list(range(1, 18)) + [31, 64, 65, 127]:
        for start in (0, 1, 140 - size):
            assert torch.equal(weight.matmul(x[start : start + size]), full[start : start + size]), (size, start)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(weight.matmul(x), full)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("isa", ["avx2", "avx512f-without-bw"])
def test_5bit_gemm_other_builds_are_exact_and_invariant_too(isa):
    """The AVX2 + FMA path (16 columns), and AVX-512 without AVX-512BW (the fifth bits by compare, not by mask)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 only")
    if isa != "avx2" and "avx512f" not in open("/proc/cpuinfo").read():
        pytest.skip("no AVX-512 here")
    isa_flags = ("-mavx2", "-mfma", "-mno-avx512f") if isa == "avx2" else ("-mavx512f", "-mavx2", "-mfma",
                                                                             "-mno-avx512bw")
    flags = ("-O3", *isa_flags, "-fopenmp", "-shared", "-fPIC")
    lib = native.build(f"qgemm_f32_{isa}", qgemm._SOURCE, flags, qgemm._SIGNATURES)
    if lib is None:
        pytest.skip(f"no compiler for the {isa} build")
    lib.qgemm_panel_width.restype = ctypes.c_int
    assert lib.qgemm_panel_width() == (16 if isa == "avx2" else 32)
    for type_name in FORMATS:
        weight, dense = packed(type_name, 37, 256, lib, seed=5)
        x = torch.randn(70, 256)
        full = weight.matmul(x)
        assert_matmul_close(full, x, dense)
        for size in (1, 2, 3, 4, 15, 16, 17, 64, 65):
            assert torch.equal(weight.matmul(x[2 : 2 + size]), full[2 : 2 + size]), (type_name, size)
        ids = torch.tensor([0, 36, 17])
        assert torch.equal(weight.dequantized_rows(ids), dense[ids])


def test_fused_projection_of_5bit_4bit_and_8bit_parts_keeps_every_value():
    """Gemma 3 270M's q / k / v: Q5_0 parts, a Q8_0 v in some layers; gate + up of Q5_0 with Q4_K."""
    parts = {name: decode(random_blocks(name, n, 256), name, (n, 256))
             for name, n in (("Q5_0", 64), ("Q4_0", 32), ("Q8_0", 16))}
    for names, bits in ((["Q5_0", "Q4_0"], 5), (["Q5_0", "Q4_0", "Q8_0"], 8)):
        stacked = _stack([parts[n] for n in names])
        assert stacked.bits == bits
        assert np.array_equal(stacked.dequantize(), np.concatenate([parts[n].dequantize() for n in names]))
        weight = qgemm.QuantWeight(stacked.q, stacked.scales, stacked.mins, stacked.bits, stacked.group_size, None,
                                   qgemm.load())
        x = torch.randn(5, 256)
        dense = torch.from_numpy(stacked.dequantize())
        assert_matmul_close(weight.matmul(x), x, dense)


def test_5bit_weights_refuse_what_they_cannot_hold():
    lib = qgemm.load()
    with pytest.raises(ValueError, match="0..31"):
        qgemm.QuantWeight(np.full((4, 8), 32, np.uint8), np.ones((4, 1), np.float32), None, 5, 8, None, lib)
    with pytest.raises(ValueError, match="multiples of 8"):
        qgemm.QuantWeight(np.zeros((4, 12), np.uint8), np.ones((4, 3), np.float32), None, 5, 4, None, lib)
