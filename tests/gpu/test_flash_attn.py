"""flash-attn backend against the torch backend (needs CUDA and flash-attn).

The torch backend runs on float32 copies of the same batch, so the reference
carries no bfloat16 error of its own.
"""

from __future__ import annotations

import random

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("flash_attn", reason="needs flash-attn: pip install 'prefixserve[gpu]'")

from workers.model.attention import get_attention_backend  # noqa: E402
from workers.model.attention.base import AttentionMetadata  # noqa: E402
from workers.model.attention.flash_attn_backend import FlashAttnBackend  # noqa: E402
from workers.model.attention.torch_backend import TorchAttentionBackend  # noqa: E402

BLOCK_SIZE = 256  # upstream flash-attn's paged KV needs a multiple of 256


def make_batch(seq_lens, query_lens, hq, hkv, head_dim, seed, device="cuda"):
    """Decodes first; context K/V in a shuffled paged cache, new K/V returned."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // BLOCK_SIZE) for n in seq_lens) + 2
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    kv_cache = torch.randn(2, num_blocks, BLOCK_SIZE, hkv, head_dim, generator=gen)
    flat = kv_cache.view(2, -1, hkv, head_dim)
    tables, slots, qs, ks, vs = [], [], [], [], []
    for seq_len, qlen in zip(seq_lens, query_lens):
        blocks = [free.pop() for _ in range(-(-seq_len // BLOCK_SIZE))]
        tables.append(blocks)
        seq_slots = [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(seq_len)]
        slots += seq_slots[seq_len - qlen :]
        qs.append(torch.randn(qlen, hq, head_dim, generator=gen))
        ks.append(torch.randn(qlen, hkv, head_dim, generator=gen))
        vs.append(torch.randn(qlen, hkv, head_dim, generator=gen))
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        query_start_loc=torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device),
        query_lens_list=list(query_lens),
        seq_lens_list=list(seq_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        num_decodes=sum(1 for n in query_lens if n == 1),
    )
    tensors = [kv_cache, torch.cat(qs), torch.cat(ks), torch.cat(vs)]
    return meta, [t.to(device) for t in tensors]


def run_both(seq_lens, query_lens, hq, hkv, head_dim, window, dtype, seed=0):
    meta, (kv_cache, q, k, v) = make_batch(seq_lens, query_lens, hq, hkv, head_dim, seed)
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
