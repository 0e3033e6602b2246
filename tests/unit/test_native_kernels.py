"""The native CPU kernels: the packed GEMM of the linear layers (``gemm.py``)
and the fused norm / rotary / SiLU kernels (``cpu_ops.py``), against float64
or torch references, and batch invariance: a row's result is bitwise the
same whatever else is in the batch, where it sits, and how many threads run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from workers.model import cpu_ops, gemm
from workers.model.layers import RMSNorm, RotaryEmbedding, SiluAndMul

pytestmark = pytest.mark.skipif(gemm.load() is None, reason="no C compiler or no AVX2 + FMA here")

SHAPES = [(960, 576), (576, 1536), (100, 64), (37, 10), (1, 3)]  # model shapes, and ragged panels


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemm_matches_float64(n, k, with_bias):
    gen = torch.Generator().manual_seed(n + k)
    w, x = torch.randn(n, k, generator=gen), torch.randn(33, k, generator=gen)
    b = torch.randn(n, generator=gen) if with_bias else None
    packed = gemm.PackedWeight(w, b, gemm.load())
    ref = x.double() @ w.double().T + (b.double() if b is not None else 0)
    torch.testing.assert_close(packed.matmul(x), ref.float(), atol=2e-5 * k**0.5, rtol=1e-5)
    torch.testing.assert_close(packed.matmul_no_bias(x), (x.double() @ w.double().T).float(),
                               atol=2e-5 * k**0.5, rtol=1e-5)


@pytest.mark.parametrize("n,k", SHAPES[:3])
def test_gemm_rows_do_not_depend_on_their_batch(n, k):
    gen = torch.Generator().manual_seed(7)
    w, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    x = torch.randn(160, k, generator=gen)
    packed = gemm.PackedWeight(w, b, gemm.load())
    full = packed.matmul(x)
    # Every batch size from 1 up, across the row-block, K-blocking and packing
    # thresholds (MR = 6 or 12 rows; packed from 32), at several offsets.
    for size in list(range(1, 34)) + [40, 63, 127, 128, 129, 160]:
        for start in {0, 1, 160 - size}:
            if start + size <= 160:
                assert torch.equal(packed.matmul(x[start : start + size]), full[start : start + size]), (size, start)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(packed.matmul(x), full)
    finally:
        torch.set_num_threads(threads)
    strided = torch.randn(160, k + 5, generator=gen)[:, :k]  # rows with a stride other than k
    strided.copy_(x)
    assert torch.equal(packed.matmul(strided), full)


def test_packed_rows_read_back_the_weight():
    w = torch.randn(100, 24)
    packed = gemm.PackedWeight(w, None, gemm.load())
    ids = torch.tensor([0, 31, 32, 99, 5])
    assert torch.equal(packed.rows(ids), w[ids])


def _ops():
    lib = cpu_ops.load()
    if lib is None:
        pytest.skip("the fused CPU kernels did not build")
    return lib


def test_add_rms_norm_matches_torch_and_adds_in_place():
    lib = _ops()
    norm = RMSNorm(64, 1e-5)
    norm.weight.data.normal_()
    x, residual = torch.randn(9, 64), torch.randn(9, 64)
    expected_residual = residual + x
    expected = norm(expected_residual.clone())  # torch: the norm of the sum
    norm.native = lib
    res = residual.clone()
    out = norm(x, res)
    assert torch.equal(res, expected_residual)  # the add is exact either way
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(norm(x), RMSNorm.forward(_torch_norm(norm), x), atol=1e-5, rtol=1e-5)
    assert torch.equal(norm(x[3:4]), norm(x)[3:4])  # a row alone, bitwise


def _torch_norm(norm: RMSNorm) -> RMSNorm:
    plain = RMSNorm(norm.weight.shape[0], norm.eps)
    plain.weight.data.copy_(norm.weight.data)
    return plain


def test_rotary_in_place_matches_torch_on_strided_rows():
    lib = _ops()
    rope = RotaryEmbedding(16, 64, 10000.0)
    positions = torch.tensor([0, 5, 17, 63])
    cos, sin = rope.lookup(positions)
    qkv = torch.randn(4, (3 + 2) * 16 + 32)  # q and k heads, then v: rows strided like the model's
    qk = qkv[:, : 5 * 16].view(4, 5, 16)
    expected = RotaryEmbedding.apply(qk, cos, sin)
    untouched = qkv[:, 5 * 16 :].clone()
    out = RotaryEmbedding.apply(qk, cos, sin, lib)
    assert out.data_ptr() == qk.data_ptr()
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)
    assert torch.equal(qkv[:, 5 * 16 :], untouched)


def test_silu_and_mul_matches_torch():
    lib = _ops()
    x = torch.randn(7, 2 * 48) * 4
    act = SiluAndMul()
    expected = F.silu(x[:, :48]) * x[:, 48:]
    act.native = lib
    torch.testing.assert_close(act(x), expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(act(x[2:3]), act(x)[2:3])


def test_silu_and_norm_vector_and_tail_agree_bitwise():
    # Widths that are not multiples of the vector loops: the scalar tail must
    # give the same bits as a vector lane (exp8 is exp_poly lane by lane), and
    # both must match torch.
    lib = _ops()
    gate, up = torch.randn(3, 13) * 6, torch.randn(3, 13)
    gate[:, 8:] = gate[:, :5]  # the tail repeats the first vector's lanes
    up[:, 8:] = up[:, :5]
    act = SiluAndMul()
    act.native = lib
    out = act(torch.cat([gate, up], dim=1))
    assert torch.equal(out[:, 8:], out[:, :5])
    torch.testing.assert_close(out, F.silu(gate) * up, atol=1e-5, rtol=1e-5)
    norm = RMSNorm(70, 1e-5)  # two 32-wide vector rounds and a tail of 6
    norm.weight.data.normal_()
    x = torch.randn(5, 70)
    expected = RMSNorm.forward(_torch_norm(norm), x)
    norm.native = lib
    torch.testing.assert_close(norm(x), expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(norm(x[4:5]), norm(x)[4:5])


def test_gemm_avx2_build_is_exact_and_invariant_too():
    """The AVX2 + FMA code path (the CPUs without AVX-512), built explicitly here."""
    import ctypes
    import platform

    from workers.model import native

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 only")
    flags = ("-O3", "-mavx2", "-mfma", "-mno-avx512f", "-fopenmp", "-shared", "-fPIC")
    lib = native.build("gemm_f32_avx2", gemm._SOURCE, flags, gemm._SIGNATURES)
    if lib is None:
        pytest.skip("no compiler for the AVX2 build")
    lib.gemm_panel_width.restype = ctypes.c_int
    assert lib.gemm_panel_width() == 16  # two 8-float vectors
    gen = torch.Generator().manual_seed(11)
    w, b = torch.randn(100, 72, generator=gen), torch.randn(100, generator=gen)
    x = torch.randn(150, 72, generator=gen)
    packed = gemm.PackedWeight(w, b, lib)
    full = packed.matmul(x)
    torch.testing.assert_close(full, (x.double() @ w.double().T + b.double()).float(), atol=1e-4, rtol=1e-5)
    for size in (1, 5, 6, 7, 13, 31, 32, 33, 127, 128, 129):
        assert torch.equal(packed.matmul(x[3 : 3 + size]), full[3 : 3 + size]), size


@pytest.mark.parametrize("cols", [1, 7, 15, 16, 17, 49152])
def test_argmax_rows_is_torchs_argmax_with_ties_and_nans(cols):
    lib = cpu_ops.load()
    gen = torch.Generator().manual_seed(cols)
    rows = []
    rows.append(torch.randn(cols, generator=gen))
    rows.append(torch.randint(0, 3, (cols,), generator=gen).float())  # many ties: the first maximum wins
    rows.append(torch.full((cols,), float("-inf")))  # all -inf: index 0
    zeros = torch.zeros(cols)
    zeros[::2] = -0.0  # -0 and +0 tie
    rows.append(zeros)
    for where in {0, cols // 2, cols - 1}:  # a NaN anywhere wins, the first one
        row = torch.randn(cols, generator=gen)
        row[where] = float("nan")
        if where + 3 < cols:
            row[where + 3] = float("nan")
        rows.append(row)
    ascending = torch.arange(cols, dtype=torch.float32)
    rows.append(ascending)  # the last element, found in the tail or the last lane
    rows.append(ascending.flip(0))
    x = torch.stack(rows)
    assert torch.equal(cpu_ops.argmax_rows(lib, x), x.argmax(dim=-1))
    # Strided rows (a view of wider logits) and many rows (threaded).
    wide = torch.randn(64, cols + 5, generator=gen)
    view = wide[:, 2 : 2 + cols]
    assert torch.equal(cpu_ops.argmax_rows(lib, view), view.argmax(dim=-1))
