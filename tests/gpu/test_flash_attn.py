"""flash-attn backend against the torch backend (needs CUDA and flash-attn).

The torch backend runs on float32 copies of the same batch, so the reference
carries no bfloat16 error of its own.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("flash_attn", reason="needs flash-attn: pip install 'prefixserve[gpu]'")

from tests.attention_cases import make_paged_case  # noqa: E402
from workers.model.attention import get_attention_backend  # noqa: E402
from workers.model.attention.flash_attn_backend import FlashAttnBackend  # noqa: E402
from workers.model.attention.torch_backend import TorchAttentionBackend  # noqa: E402

BLOCK_SIZE = 256  # upstream flash-attn's paged KV needs a multiple of 256


def run_both(seq_lens, query_lens, hq, hkv, head_dim, window, dtype, seed=0):
    case = make_paged_case(seq_lens, query_lens, BLOCK_SIZE, hq, hkv, head_dim, seed, extra_blocks=2).to("cuda")
    meta, kv_cache, q, k, v = case.meta, case.kv_cache, case.q, case.k, case.v
    scale = head_dim**-0.5
    expected = TorchAttentionBackend().forward(q, k, v, kv_cache.clone(), meta, scale, window)
    cache = kv_cache.to(dtype)
    out = FlashAttnBackend(dtype=dtype, block_size=BLOCK_SIZE).forward(
        q.to(dtype), k.to(dtype), v.to(dtype), cache, meta, scale, window
    )
    flat = cache.view(2, -1, hkv, head_dim)
    assert torch.equal(flat[0, meta.slot_mapping], k.to(dtype))
    return out.float(), expected


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("hq, hkv", [(8, 8), (9, 3), (8, 2)])
def test_decode_batch_matches_torch(hq, hkv, window, dtype):
    out, expected = run_both([1, 255, 256, 257, 700], [1] * 5, hq, hkv, 64, window, dtype)
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("hq, hkv", [(8, 8), (8, 2)])
def test_mixed_batch_matches_torch(hq, hkv, window):
    # Two decodes, a chunk with cached context, a fresh prompt across blocks.
    seq_lens, query_lens = [300, 20, 600, 290], [1, 1, 77, 290]
    out, expected = run_both(seq_lens, query_lens, hq, hkv, 128, window, torch.bfloat16)
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)


def test_auto_picks_flash_attn_when_it_fits():
    assert get_attention_backend("auto", "cuda", dtype=torch.bfloat16, block_size=256).name == "flash_attn"
    assert get_attention_backend("auto", "cuda", dtype=torch.bfloat16, block_size=16).name == "torch"
    assert get_attention_backend("auto", "cuda", dtype=torch.float32, block_size=256).name == "torch"
    with pytest.raises(ValueError, match="multiple of 256"):
        get_attention_backend("flash_attn", "cuda", block_size=16)
