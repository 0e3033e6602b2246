"""The Triton dequantize-in-GEMM kernel (``quant/triton_qgemm.py``), interpreted
on CPU: 4- and 8-bit group-quantized weights, with and without mins, ragged
shapes and a ragged last group, against float64 on the dequantized weight, and
GGUF / GPTQ-decoded weights through the same kernel."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed")

from workers.model.quant.gguf_blocks import DecodedWeight  # noqa: E402
from workers.model.quant.methods import quantize_int4, quantize_int8  # noqa: E402
from workers.model.quant.triton_qgemm import TritonQuantWeight  # noqa: E402


@pytest.mark.parametrize("kind,n,k", [("int4-g32", 70, 96), ("int4-g64", 40, 192), ("int8", 33, 64),
                                      ("int4-g64-ragged", 24, 160)])
def test_triton_quantized_gemm_matches_float64(kind, n, k):
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen).numpy()
    if kind == "int8":
        decoded = quantize_int8(w)
        decoded = DecodedWeight(decoded.q, np.repeat(decoded.scales, k // 32, axis=1), None, 8, 32, "int8-g32")
    else:
        decoded = quantize_int4(w, 64 if "g64" in kind else 32)
    bias = torch.randn(n, generator=gen)
    weight = TritonQuantWeight(decoded, "cpu", bias)
    x = torch.randn(19, k, generator=gen)
    dense = torch.from_numpy(decoded.dequantize()).double()
    ref = x.double() @ dense.T + bias.double()
    torch.testing.assert_close(weight.matmul(x), ref.float(), atol=1e-4, rtol=1e-4)


def test_gguf_q4_1_q5_0_and_q8_0_blocks_run_through_it():
    from gguf import GGMLQuantizationType as T
    from gguf import quants

    from workers.model.quant.gguf_blocks import decode

    rng = np.random.default_rng(1)
    for name in ("Q4_1", "Q5_0", "Q8_0"):  # Q5_0's 5-bit values travel as 8-bit ones
        raw = quants.quantize(rng.standard_normal((20, 64)).astype(np.float32), getattr(T, name))
        decoded = decode(raw, name, (20, 64))
        x = torch.randn(3, 64)
        ref = x.double() @ torch.from_numpy(decoded.dequantize()).double().T
        torch.testing.assert_close(TritonQuantWeight(decoded, "cpu").matmul(x), ref.float(), atol=1e-4, rtol=1e-4)


def test_shapes_the_kernel_cannot_take_are_refused():
    with pytest.raises(ValueError, match="groups of a multiple of 16"):
        TritonQuantWeight(DecodedWeight(np.zeros((4, 8), np.uint8), np.ones((4, 1), np.float32), None, 4, 8, "x"),
                          "cpu")
