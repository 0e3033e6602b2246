"""The int8 KV cache (``attention/kv_int8.py``): rows of int8 values and their
float32 scale, written and read by the torch backend and the native decode
kernel (built with ``-DKV_INT8``), against dense attention over the
dequantized keys and values."""

from __future__ import annotations

import math

import pytest
import torch

from tests.attention_cases import PagedCase, make_paged_case, reference
from workers.model.attention import cpu_decode, kv_int8
from workers.model.attention.torch_backend import TorchAttentionBackend


def test_rows_round_trip_within_half_a_step_and_keep_zeros():
    x = torch.randn(50, 3, 64) * torch.logspace(-3, 2, 50)[:, None, None]
    x[7] = 0.0
    rows = kv_int8.quantize(x)
    assert rows.dtype == torch.int8 and rows.shape == (50, 3, 68)
    back = kv_int8.dequantize(rows)
    step = x.abs().amax(dim=-1, keepdim=True) / 127
    assert torch.all((back - x).abs() <= step / 2 * (1 + 1e-5) + 1e-12)
    assert torch.equal(back[7], torch.zeros(3, 64))


def int8_case(seq_lens, query_lens, hq, hkv, seed) -> tuple[PagedCase, PagedCase]:
    """A paged case on an int8 cache, and the float case whose keys and values are
    the int8 ones dequantized (every token is read back from the cache: all have context)."""
    case = make_paged_case(seq_lens, query_lens, 4, hq, hkv, 64, seed=seed)
    int8_cache = kv_int8.quantize(case.kv_cache)
    full = [(kv_int8.dequantize(kv_int8.quantize(k)), kv_int8.dequantize(kv_int8.quantize(v))) for k, v in case.full]
    ref = PagedCase(kv_int8.dequantize(int8_cache), case.meta, case.q, case.k, case.v, full)
    return PagedCase(int8_cache, case.meta, case.q, case.k, case.v, case.full), ref


@pytest.mark.parametrize("native", [True, False], ids=["native_decode", "torch_decode"])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("hq,hkv", [(6, 2), (4, 4)])
def test_int8_cache_attention_matches_dense_over_dequantized_values(hq, hkv, window, native):
    # Decodes, then chunks with context: every key is read back from the int8 cache.
    case, ref = int8_case([9, 17, 12, 20], [1, 1, 4, 6], hq, hkv, seed=hq + hkv)
    scale = 1 / math.sqrt(64)
    out = TorchAttentionBackend(native_decode=native).forward(case.q, case.k, case.v, case.kv_cache, case.meta,
                                                              scale, window)
    torch.testing.assert_close(out, reference(ref, scale, window), atol=1e-5, rtol=1e-5)
    # The step's keys were written as int8 rows: they read back as their quantized values.
    flat = case.kv_cache.view(2, -1, hkv, 68)
    assert torch.equal(flat[0, case.meta.slot_mapping], kv_int8.quantize(case.k))


def test_native_decode_writes_what_the_torch_path_writes():
    """The kernel's fused write of the step's keys quantizes exactly as kv_int8.quantize."""
    assert cpu_decode.load(torch.int8) is not None
    a, _ = int8_case([9, 17, 30], [1, 1, 1], 6, 2, seed=5)
    b = PagedCase(a.kv_cache.clone(), a.meta, a.q, a.k, a.v, a.full)
    scale = 0.125
    native = TorchAttentionBackend(native_decode=True).forward(a.q, a.k, a.v, a.kv_cache, a.meta, scale)
    torch_path = TorchAttentionBackend(native_decode=False).forward(b.q, b.k, b.v, b.kv_cache, b.meta, scale)
    assert torch.equal(a.kv_cache, b.kv_cache)
    torch.testing.assert_close(native, torch_path, atol=1e-5, rtol=1e-5)
