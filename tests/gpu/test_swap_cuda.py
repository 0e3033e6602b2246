"""Swap on a real GPU: the copy stream against a busy compute stream."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from workers.swap import BlockSwapper  # noqa: E402


def test_swap_round_trip_while_the_compute_stream_reuses_the_blocks():
    device = torch.device("cuda")
    layers, blocks = 4, 64
    dev = [torch.randn(2, blocks, 16, 8, 64, device=device) for _ in range(layers)]
    host = [torch.zeros(2, blocks, 16, 8, 64).pin_memory() for _ in range(layers)]
    swapper = BlockSwapper(dev, host, device)
    for round_ in range(20):
        out = [(b, b) for b in range(round_ % 7, blocks, 7)]
        want = [cache[:, [a for a, _ in out]].cpu() for cache in dev]
        big = torch.randn(4096, 4096, device=device)
        for _ in range(4):  # queue compute ahead of the copy
            big = big @ big / 64
        swapper.swap_out(out)
        for cache in dev:  # the freed blocks get new KV at once
            cache[:, [a for a, _ in out]] = -1.0
        swapper.swap_in([(b, b) for _, b in out])  # and come straight back
        for cache, expected in zip(dev, want):
            got = cache[:, [b for _, b in out]].cpu()
            assert torch.equal(got, expected), f"round {round_}: blocks changed on the way"
    torch.cuda.synchronize()
