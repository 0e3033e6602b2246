"""Triton decode and prefill kernels compiled for CUDA, against the torch backend."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton", reason="needs triton")

from tests.attention_cases import make_paged_case  # noqa: E402
from workers.model.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from workers.model.attention.triton_backend import TritonAttentionBackend  # noqa: E402


# Decodes alone; then decodes first, a fresh prompt, a chunk after a cached prefix and a long chunk.
BATCHES = [([1, 15, 16, 17, 300, 1000], [1] * 6), ([40, 300, 17, 700, 1000], [1, 1, 17, 200, 1000])]


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2), (torch.float16, 5e-3)])
@pytest.mark.parametrize("window", [None, 50])
@pytest.mark.parametrize("block_size, hq, hkv, head_dim",
                         [(16, 8, 8, 64), (16, 9, 3, 64), (32, 32, 8, 128), (1, 4, 1, 80)])
@pytest.mark.parametrize("seq_lens, query_lens", BATCHES)
def test_kernels_match_torch(seq_lens, query_lens, block_size, hq, hkv, head_dim, window, dtype, atol):
    case = make_paged_case(seq_lens, query_lens, block_size, hq, hkv, head_dim, seed=hq, extra_blocks=2)
    case = case.to("cuda")
    meta, kv_cache, q, k, v = case.meta, case.kv_cache, case.q, case.k, case.v
    scale = head_dim**-0.5
    expected = TorchAttentionBackend().forward(q, k, v, kv_cache.clone(), meta, scale, window)
    cast = [t.to(dtype) for t in (q, k, v, kv_cache)]
    out = TritonAttentionBackend().forward(cast[0], cast[1], cast[2], cast[3], meta, scale, window)
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=atol)
