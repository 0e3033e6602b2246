"""The fused Triton norm, rotary and SiLU kernels compiled for CUDA, against the torch code."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("triton", reason="needs triton")

from workers.model import triton_ops  # noqa: E402
from workers.model.layers import RMSNorm, RotaryEmbedding, SiluAndMul  # noqa: E402

TOL = {torch.float32: 2e-6, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.fixture(scope="module")
def ops():
    loaded = triton_ops.load(torch.device("cuda"))
    assert loaded is not None
    return loaded


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_fused_ops_match_torch(ops, dtype, tokens):
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    hidden, heads, kv_heads, dim, inter = 576, 9, 3, 64, 1536
    norm = RMSNorm(hidden, 1e-5).to("cuda", dtype)
    norm.weight.data = (torch.rand(hidden, generator=gen, device="cuda") + 0.5).to(dtype)
    x = torch.randn(tokens, hidden, generator=gen, device="cuda").to(dtype)
    residual = torch.randn(tokens, hidden, generator=gen, device="cuda").to(dtype)
    want_res, got_res = residual.clone(), residual.clone()
    want = norm(x, want_res)
    got = ops.add_rms_norm(x, got_res, norm.weight, norm.eps)
    torch.testing.assert_close(got_res, want_res, atol=0, rtol=0)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])

    rope = RotaryEmbedding(dim, 4096, 100000.0).to("cuda", dtype)
    cos, sin = rope.lookup(torch.randint(0, 4096, (tokens,), generator=gen, device="cuda"))
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen, device="cuda").to(dtype)
    qk = qkv[:, : (heads + kv_heads) * dim].view(tokens, heads + kv_heads, dim)
    want_qk = RotaryEmbedding.apply(qk.clone(), cos, sin)
    ops.rotary(qk, cos, sin)
    torch.testing.assert_close(qk.float(), want_qk.float(), atol=TOL[dtype], rtol=TOL[dtype])

    gate_up = torch.randn(tokens, 2 * inter, generator=gen, device="cuda").to(dtype)
    torch.testing.assert_close(ops.silu_and_mul(gate_up).float(), SiluAndMul()(gate_up).float(), atol=TOL[dtype],
                               rtol=TOL[dtype])
