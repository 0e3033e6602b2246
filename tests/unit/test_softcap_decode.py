"""The decode kernel's score cap (Gemma 2's ``attn_logit_softcapping``, ``csrc/paged_decode.c``) against
``softcap.py``'s torch attention, on each of the kernel's paths: the AVX2 one (``-march=haswell``, the
build an AVX2-only machine gets), the generic one (no AVX2, and head_dim not a multiple of 8 on any
build) and the int8 cache's; and through the torch backend, whose capped decodes now run on it."""

from __future__ import annotations

import pytest
import torch

from tests.attention_cases import make_paged_case
from workers.model import native
from workers.model.attention import cpu_decode
from workers.model.attention.softcap import softcap_attention
from workers.model.attention.torch_backend import TorchAttentionBackend

BUILDS = {"native": (), "haswell": ("-march=haswell",), "generic": ("-march=x86-64",)}


def _lib(build: str, kv_int8: bool = False):
    flags = (*cpu_decode._FLAGS, *BUILDS[build], *(("-DKV_INT8",) if kv_int8 else ()))
    lib = native.build(f"paged_decode_{build}{'_i8' if kv_int8 else ''}", cpu_decode._SOURCE, flags,
                       cpu_decode._SIGNATURES)
    if lib is None:
        pytest.skip("the decode kernel did not build here")
    return lib


def _torch_capped(case, scale, window, cap):
    """softcap.py's plain-torch rows (no kernel) over a copy of the case's cache."""
    return softcap_attention(case.q, case.k, case.v, case.kv_cache.clone(), case.meta, scale, window, cap)


@pytest.mark.parametrize("build", sorted(BUILDS))
@pytest.mark.parametrize("head_dim", [64, 12], ids=["d64", "d12_generic"])
@pytest.mark.parametrize("window", [None, 21])
def test_capped_decode_matches_torch(build, head_dim, window):
    # Lengths that end mid-block, one past the 512-position chunk (split and merged), GQA 3:1; a cap of
    # 2 puts scores on both sides of tanh8's 0.625 switch (polynomial / exp), and past the exp clamp.
    seq_lens = [1, 37, 600, 130]
    case = make_paged_case(seq_lens, [1] * len(seq_lens), 16, 9, 3, head_dim, seed=head_dim)
    case.q.mul_(3.0)  # scores up to ~20: tanh saturates for some
    scale, cap = head_dim ** -0.5, 2.0
    lib = _lib(build)
    expected = _torch_capped(case, scale, window, cap)
    cache = case.kv_cache.clone()
    out = cpu_decode.paged_decode(lib, case.q, cache, case.meta.block_tables, case.meta.seq_lens, scale, window,
                                  new_kv=(case.k, case.v, case.meta.slot_mapping), softcap=cap)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    uncapped = cpu_decode.paged_decode(lib, case.q, cache, case.meta.block_tables, case.meta.seq_lens, scale,
                                       window)
    assert (uncapped - expected).abs().max() > 1e-2  # the cap matters here: a kernel that drops it fails
    alone = cpu_decode.paged_decode(lib, case.q[2:3], cache, case.meta.block_tables[2:3],
                                    case.meta.seq_lens[2:3], scale, window, softcap=cap)
    assert torch.equal(alone, out[2:3])  # batch-invariant as without a cap


def test_capped_decode_int8_cache():
    from workers.model.attention import kv_int8

    case = make_paged_case([9, 70], [1, 1], 16, 4, 2, 64, seed=4)
    case.q.mul_(3.0)
    cache = kv_int8.quantize(case.kv_cache)
    lib = _lib("native", kv_int8=True)
    out = cpu_decode.paged_decode(lib, case.q, cache.clone(), case.meta.block_tables, case.meta.seq_lens, 0.125,
                                  None, new_kv=(case.k, case.v, case.meta.slot_mapping), softcap=2.0)
    expected = softcap_attention(case.q, case.k, case.v, cache.clone(), case.meta, 0.125, None, 2.0)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def test_torch_backend_caps_decodes_on_the_kernel():
    # Decode-only steps and the decode rows of mixed steps both go to the kernel: the same bits as a direct
    # call, and a prefill row's answer stays softcap.py's.
    case = make_paged_case([1, 37, 20, 9], [1, 1, 1, 5], 4, 6, 2, 16, seed=9)
    case.q.mul_(3.0)
    lib = cpu_decode.load()
    if lib is None:
        pytest.skip("the decode kernel did not build here")
    cache = case.kv_cache.clone()
    out = TorchAttentionBackend().forward(case.q, case.k, case.v, cache, case.meta, 0.25, None, softcap=2.0)
    direct = cpu_decode.paged_decode(lib, case.q[:3], cache, case.meta.block_tables[:3], case.meta.seq_lens[:3],
                                     0.25, None, softcap=2.0)
    assert torch.equal(out[:3], direct)
    expected = _torch_capped(case, 0.25, None, 2.0)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    assert torch.equal(out[3:], expected[3:])
