"""Triton decode kernel compiled for CUDA, against the torch backend."""

from __future__ import annotations

import random

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton", reason="needs triton")

from workers.model.attention.base import AttentionMetadata  # noqa: E402
from workers.model.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from workers.model.attention.triton_backend import TritonAttentionBackend  # noqa: E402


def make_decode_batch(seq_lens, block_size, hq, hkv, head_dim, seed):
    """One new token per request; context in a shuffled paged cache (CUDA)."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 2
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    tables, slots = [], []
    for seq_len in seq_lens:
        blocks = [free.pop() for _ in range(-(-seq_len // block_size))]
        tables.append(blocks)
        slots.append(blocks[(seq_len - 1) // block_size] * block_size + (seq_len - 1) % block_size)
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device="cuda"),
        query_start_loc=torch.arange(len(seq_lens) + 1, dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device="cuda"),
        query_lens_list=[1] * len(seq_lens),
        seq_lens_list=list(seq_lens),
        max_query_len=1,
        max_seq_len=max(seq_lens),
        num_decodes=len(seq_lens),
    )
    n = len(seq_lens)
    tensors = [
        torch.randn(2, num_blocks, block_size, hkv, head_dim, generator=gen),
        torch.randn(n, hq, head_dim, generator=gen),
        torch.randn(n, hkv, head_dim, generator=gen),
        torch.randn(n, hkv, head_dim, generator=gen),
    ]
    return meta, [t.cuda() for t in tensors]


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("window", [None, 50])
@pytest.mark.parametrize("block_size, hq, hkv, head_dim", [(16, 8, 8, 64), (16, 9, 3, 64), (32, 32, 8, 128), (1, 4, 1, 80)])
def test_decode_matches_torch(block_size, hq, hkv, head_dim, window, dtype, atol):
    meta, (kv_cache, q, k, v) = make_decode_batch([1, 15, 16, 17, 300, 1000], block_size, hq, hkv, head_dim, seed=hq)
    scale = head_dim**-0.5
    expected = TorchAttentionBackend().forward(q, k, v, kv_cache.clone(), meta, scale, window)
    cast = [t.to(dtype) for t in (q, k, v, kv_cache)]
    out = TritonAttentionBackend().forward(cast[0], cast[1], cast[2], cast[3], meta, scale, window)
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=atol)
